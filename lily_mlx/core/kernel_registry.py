"""Kernel registry: Metal sources in ``kernels/<family>/*.metal`` -> a callable for the active backend.

A kernel file holds sections::

    // @header
    <helpers shared by the kernels of this file>
    // @kernel <name>
    <body: exactly what mx.fast.metal_kernel receives as ``source``>

Every backend returns an object with the call convention of an ``mx.fast.metal_kernel`` kernel
(inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value, verbose).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from .dispatch import active_backend
from .msl_header import header_for, strip_comments

_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # lily_mlx/
# Installed wheel: lily_mlx/_kernels; source checkout: <repo>/kernels.
_KERNEL_DIRS = (_PACKAGE_DIR / "_kernels", _PACKAGE_DIR.parent / "kernels")

# A section marker is a whole line: "// @header" or "// @kernel <name>", optionally followed by a
# "//" comment. Anything else on a marker line is an error, never silently part of a body.
_SECTION = re.compile(r"^//\s*@((?:header|kernel)\w*)(.*)$", re.MULTILINE)
_MARKER_TAIL = re.compile(r"^[ \t]*(\w*)[ \t]*(//.*)?$")


@dataclass(frozen=True)
class KernelSpec:
    """Host-side description of one Metal kernel (one row of an op's dispatch table)."""

    name: str  # kernel name, also the section name in the file
    file: str  # relative to kernels/, e.g. "deltanet/deltanet.metal"
    input_names: Tuple[str, ...]
    output_names: Tuple[str, ...]
    atomic_outputs: bool = False
    ensure_row_contiguous: bool = True
    # The named layout of the int32 ``params`` input: launchers fill it by name (:meth:`pack`), and the
    # kernel body gets one generated ``const int <name> = params[<i>];`` per name (:func:`params_prologue`),
    # so the layout is written once, here, not as positions in two languages.
    params: Tuple[str, ...] = ()

    def pack(self, **values):
        """The ``params`` input: ``values`` by name, in this spec's order (a cached int32 array)."""
        try:
            if len(values) != len(self.params):
                raise KeyError
            ordered = tuple([values[n] for n in self.params])
        except KeyError:
            raise ValueError(f"{self.name}: params {sorted(values)} do not match the layout {list(self.params)}") from None
        return _int32_params(ordered)


def kernels_dir() -> Path:
    for d in _KERNEL_DIRS:
        if d.is_dir():
            return d
    raise FileNotFoundError(f"lily-mlx kernel sources not found (looked in {', '.join(map(str, _KERNEL_DIRS))})")


def parse_kernel_file(text: str, filename: str = "<text>") -> Tuple[str, Dict[str, str]]:
    """Split a kernel file into (header, {kernel_name: body})."""
    header = ""
    bodies: Dict[str, str] = {}
    matches = list(_SECTION.finditer(text))
    if matches and text[: matches[0].start()].strip():
        # Only comments may stand before the first section (a file's preamble).
        for line in text[: matches[0].start()].splitlines():
            if line.strip() and not line.strip().startswith("//"):
                raise ValueError(f"{filename}: code before the first '// @' section: {line.strip()!r}")
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        chunk = text[m.end():end].strip("\n") + "\n"
        kind = m.group(1)
        tail = _MARKER_TAIL.match(m.group(2))
        if kind not in ("header", "kernel") or tail is None:
            raise ValueError(f"{filename}: malformed section marker {m.group(0)!r}")
        name = tail.group(1)
        if kind == "header":
            if name:
                raise ValueError(f"{filename}: '// @header' takes no name (got {name!r})")
            header += chunk
        else:
            if not name:
                raise ValueError(f"{filename}: '// @kernel' needs a name")
            if name in bodies:
                raise ValueError(f"{filename}: kernel {name!r} defined twice")
            bodies[name] = chunk
    if not bodies:
        raise ValueError(f"{filename}: no '// @kernel <name>' section")
    return header, bodies


# In a header: "// @include <family>/<file>.metal" stands for that file's header (helpers one file's kernels
# share with another's: e.g. the router's selection, used by a GEMV kernel of gemm.metal). One level: an
# included header may not include another.
_INCLUDE = re.compile(r"^//\s*@include\s+(\S+)\s*$", re.MULTILINE)


@lru_cache(maxsize=None)
def load_kernel_file(filename: str) -> Tuple[str, Dict[str, str]]:
    path = kernels_dir() / filename
    header, bodies = parse_kernel_file(path.read_text(), filename)
    return _INCLUDE.sub(lambda m: _included_header(m.group(1), filename), header), bodies


def _included_header(other: str, filename: str) -> str:
    text = (kernels_dir() / other).read_text() if other != filename else ""
    if not text:
        raise ValueError(f"{filename}: '// @include {other}': not another kernel file")
    header, _ = parse_kernel_file(text, other)
    if _INCLUDE.search(header):
        raise ValueError(f"{filename}: '// @include {other}': that header includes another (one level only)")
    return f"// (the header of {other})\n{header}"


def params_prologue(params: Tuple[str, ...]) -> str:
    """The lines that read a kernel's named ``params`` at the top of its body (empty without params)."""
    if not params:
        return ""
    reads = "".join(f"  const int {name} = params[{i}];\n  (void){name};\n" for i, name in enumerate(params))
    return "  // named params, generated from the launcher's KernelSpec.params\n" + reads


def kernel_source(spec: KernelSpec) -> Tuple[str, str]:
    """(header, body) of ``spec`` as every backend gets them: the body as written in its file after the named-params
    prologue, and the items of the file's header that it uses (``msl_header.header_for``), both without comments."""
    header, bodies = load_kernel_file(spec.file)
    if spec.name not in bodies:
        raise KeyError(f"kernel {spec.name!r} not found in {spec.file} (has: {', '.join(bodies)})")
    body = strip_comments(params_prologue(spec.params) + bodies[spec.name])
    return header_for(header, body), body


def _factory(backend: str) -> Callable:
    if backend == "metal":
        import mlx.core as mx

        return mx.fast.metal_kernel
    if backend == "sim":
        from ..msl import sim

        return sim.metal_kernel
    if backend == "cuda":
        from ..msl import cuda

        return cuda.metal_kernel
    raise ValueError(f"backend {backend!r} runs no kernels")


def metal_kernel_factory(backend: str) -> Callable:
    """The ``mx.fast.metal_kernel``-compatible factory of a kernel backend (metal, sim or cuda)."""
    return _factory(backend)


@dataclass(eq=False)
class Launch:
    """One kernel launch seen by :func:`record_launches`."""

    name: str  # kernel name (the section name in its .metal file)
    backend: str
    kernel: Callable  # the built kernel, to launch again (benchmarks)
    kwargs: Dict  # the call's arguments: inputs, template, grid, threadgroup, output shapes/dtypes
    launcher: Optional[Callable] = None  # the registry's launcher (launching through it is recorded)
    outputs: Tuple = ()  # the launch's outputs, set once it returns

    @property
    def template(self) -> Dict:
        return dict(self.kwargs.get("template") or ())


class LaunchRecord(list):
    """The launches made while a :func:`record_launches` block was active, in order."""

    def names(self) -> List[str]:
        return [launch.name for launch in self]

    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for launch in self:
            out[launch.name] = out.get(launch.name, 0) + 1
        return out


_recorders: List[LaunchRecord] = []


@contextlib.contextmanager
def record_launches() -> Iterator[LaunchRecord]:
    """Record every lily-mlx kernel launch in the block (tests assert which kernels a switch state
    runs; benchmarks re-time them): ``with record_launches() as rec: ...; rec.counts()``."""
    record = LaunchRecord()
    _recorders.append(record)
    try:
        yield record
    finally:
        # By identity: records nest (a decode plan records inside a caller's record), and two records of
        # the same launches are equal lists.
        for i, r in enumerate(_recorders):
            if r is record:
                del _recorders[i]
                break


class _Launcher:
    """A built kernel plus its name: launching it is one call, recorded while anyone listens."""

    __slots__ = ("name", "backend", "kernel")

    def __init__(self, name: str, backend: str, kernel: Callable):
        self.name, self.backend, self.kernel = name, backend, kernel

    def __call__(self, **kwargs):
        if _recorders:
            launch = Launch(self.name, self.backend, self.kernel, kwargs, self)
            for record in _recorders:
                record.append(launch)
            outputs = self.kernel(**kwargs)
            launch.outputs = tuple(outputs)
            return outputs
        return self.kernel(**kwargs)


_cache: Dict[Tuple[str, str, str], Callable] = {}


def get_kernel(spec: KernelSpec, backend: Optional[str] = None) -> Callable:
    """The kernel ``spec`` built for ``backend`` (default: the active backend), cached."""
    backend = backend or active_backend()
    key = (spec.file, spec.name, backend)
    kernel = _cache.get(key)
    if kernel is None:
        header, body = kernel_source(spec)
        kernel = _Launcher(spec.name, backend, _factory(backend)(
            name=spec.name,
            input_names=list(spec.input_names),
            output_names=list(spec.output_names),
            source=body,
            header=header,
            ensure_row_contiguous=spec.ensure_row_contiguous,
            atomic_outputs=spec.atomic_outputs,
        ))
        _cache[key] = kernel
    return kernel


def clear_cache() -> None:
    _cache.clear()
    load_kernel_file.cache_clear()


# Small constant inputs (sizes, flags, epsilons) recur with the same values on every layer and token.
# Building a fresh mx.array per call costs a host allocation and an upload per kernel launch on a GPU;
# these caches hand back one concrete (already materialised) array per distinct value instead.
# Constant kernel inputs are at least this many 4-byte elements (zeros after the values; kernels read theirs by
# index). MLX's CUDA allocator keeps arrays of at most 8 bytes in one pool of managed memory that every host-made
# scalar shares, where host writes keep moving the pool's pages to the host; an array of 16 bytes is a managed
# allocation of its own, which moves to the GPU at its first use there and stays (these are written once). On Apple
# GPUs memory is unified: the width changes nothing there (still under MLX's 8-element `constant` inputs).
CONSTANT_MIN_ELEMENTS = 4


@lru_cache(maxsize=1024)
def _int32_params(values: Tuple[int, ...]):
    import mlx.core as mx

    padding = [0] * max(0, CONSTANT_MIN_ELEMENTS - len(values))
    return mx.array(list(values) + padding, dtype=mx.int32)


def int32_params(*values: int):
    """``params`` input of a kernel: a cached int32 vector of ``values`` (ints or bools; equal values
    hash alike, so a bool and its int share one entry)."""
    return _int32_params(values)


def constant_input(shape, dtype, value=0):
    """A stand-in input made once, at import (``shape`` filled with ``value``): evaluated now, so that every thread
    can use it. An array not yet evaluated belongs to the stream of the thread that made it, and evaluating it
    from another thread fails (MLX-LM's server generates in a thread of its own)."""
    import mlx.core as mx

    array = mx.full(shape, value, dtype=dtype)
    mx.eval(array)
    return array


@lru_cache(maxsize=64)
def float32_scalar(value: float):
    """A cached float32 input holding ``value`` at index 0 (e.g. a norm's epsilon; CONSTANT_MIN_ELEMENTS wide)."""
    import mlx.core as mx

    return mx.array([float(value)] + [0.0] * (CONSTANT_MIN_ELEMENTS - 1), dtype=mx.float32)
