"""``metal_kernel`` for MLX's CUDA backend: a Metal kernel body + header run through
``mx.fast.cuda_kernel`` with the call convention of ``mx.fast.metal_kernel``.

How the Metal launch is reproduced (see docs/bridge.md):
- inputs/outputs are renamed (``x`` -> ``x_lily_``) and re-declared at the top of the body with
  Metal element types (``bfloat16_t``, ``half`` with Metal's promotion rules); 0-d inputs become
  values (``const auto T = *T_lily_``), ``x_shape``/``x_strides``/``x_ndim`` pointers/values as Metal
  passes them; atomic outputs become ``atomic<T>*``;
- template arguments become body-local ``using``/``constexpr`` lines, and the kernel name carries a
  hash of the whole translated text, so each variant is compiled once and never confused;
- the true grid travels as a small int32 input; every Metal thread attribute the body names is
  computed from it and CUDA's block/thread indices, and padding threads (CUDA launches whole
  blocks) return before the body. Kernels with barriers or SIMD-group operations must not have
  partial SIMD-groups (the design contract asks for whole threadgroups); that is checked per call.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .. import signature
from .translate import UnbridgeableError, code_only, translate

PRELUDE_PATH = Path(__file__).resolve().parent / "prelude.cuh"
MAX_THREADS_PER_THREADGROUP = 1024

_CUDA_TYPES = {
    mx.bool_: "bool", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
    mx.uint64: "uint64_t", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
    mx.int64: "int64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
    mx.float64: "double",
}
# Metal spelling of template dtypes, resolved by the prelude's declarations in mlx::core::cu.
_ATOMIC_DTYPES = (mx.int32, mx.uint32, mx.float32)

_SIMD_USE = re.compile(r"\b(simd_\w+|quad_\w+|simdgroup_\w+)\s*[(<]")
_BARRIER_USE = re.compile(r"\b(threadgroup_barrier|simdgroup_barrier)\s*\(")


@lru_cache(maxsize=1)
def prelude() -> str:
    return PRELUDE_PATH.read_text()


# Optional prelude sections and what in a kernel's code needs each. MLX hashes a custom kernel's whole
# source (our prelude included) every time it evaluates a launch, on Metal and CUDA alike, so a kernel
# gets only the sections it uses, without comments or indentation.
_SECTION_MARKER = re.compile(r"^// @section (\w+)[ \t]*$", re.MULTILINE)
_SECTION_USES = {
    "simd": re.compile(r"\b(simd_\w+|quad_\w+|simdgroup_(?!barrier\b)\w+)"),
    "atomics": re.compile(r"\b(atomic\w*|memory_order\w*)"),
    "simdgroup_matrix": re.compile(r"\bsimdgroup_(?!barrier\b)\w+|\bmake_filled_simdgroup_matrix\b"),
}
_SECTION_NEEDS = {"simdgroup_matrix": ("simd",)}


def prelude_sections(code: str, atomic_outputs: bool = False) -> frozenset:
    """The optional prelude sections a kernel whose (comment-free) Metal ``code`` is given needs."""
    used = {name for name, pattern in _SECTION_USES.items() if pattern.search(code)}
    if atomic_outputs:
        used.add("atomics")
    for name in list(used):
        used.update(_SECTION_NEEDS.get(name, ()))
    return frozenset(used)


def _drop_comment_lines(text: str) -> str:
    """``text`` without whole-line ``//`` comments and blank lines (smaller source, same code)."""
    return "\n".join(line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("//")) + "\n"


@lru_cache(maxsize=16)
def trimmed_prelude(sections: frozenset) -> str:
    """The prelude with only the optional ``sections`` named, whole-line comments, blank lines and
    indentation dropped (the compiled code is the same)."""
    text = prelude()
    parts, keep, last = [], True, 0
    for m in _SECTION_MARKER.finditer(text):
        if keep:
            parts.append(text[last:m.start()])
        name = m.group(1)
        keep = name == "always" or name in sections
        last = m.end()
    if keep:
        parts.append(text[last:])
    return _drop_comment_lines("\n".join(line.strip() for line in "".join(parts).splitlines()))


# MLX hashes a custom kernel's whole source, header included, every time it evaluates a launch
# (H200, bench.launch_cost: +6.8 us per launch for a 36 KB header). So the header a kernel hands to MLX
# is one ``#include`` of a file holding its real header (prelude + translated Metal header), named by
# the content's hash and written once per content; NVRTC reads the file at compile time only. Where no
# file can be written, the header is inlined as before (same code, larger per-launch hash).
HEADER_DIR_ENV = "LILY_CUDA_HEADER_DIR"  # a folder, or "inline" for no header files


def header_dir() -> Optional[Path]:
    """Folder of the header files: ``LILY_CUDA_HEADER_DIR``, else ``lily_mlx/cuda-headers`` under the
    user's cache folder; None when the variable says ``inline``."""
    value = os.environ.get(HEADER_DIR_ENV, "").strip()
    if value == "inline":
        return None
    if value:  # absolute: NVRTC would resolve a relative include against its own idea of the directory
        return Path(value).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return (Path(base) / "lily_mlx" / "cuda-headers").absolute()


_UNWRITABLE: set = set()


def _header_file(text: str, folder: Path) -> Optional[Path]:
    """The file in ``folder`` holding ``text`` (written, atomically, if missing or different), or None
    if it cannot be written."""
    path = folder / f"lily_{hashlib.sha1(text.encode()).hexdigest()[:20]}.cuh"
    try:
        if not (path.is_file() and path.read_text() == text):
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
    except OSError as e:
        if folder not in _UNWRITABLE:  # said once per folder (this package stands alone: no lily logging)
            _UNWRITABLE.add(folder)
            logging.getLogger("lily_mlx").warning(
                "lily-mlx: cannot write CUDA kernel headers to %s (%s); headers are inlined (slower launches). "
                "Set %s to a writable folder.", folder, e, HEADER_DIR_ENV)
        return None
    return path


def launch_header(text: str) -> str:
    """What MLX gets as a kernel's header: ``#include "<file holding text>"``, or ``text`` itself
    (``LILY_CUDA_HEADER_DIR=inline``, an unwritable folder, or a path an include line cannot hold)."""
    folder = header_dir()
    path = _header_file(text, folder) if folder is not None else None
    if path is None or '"' in str(path) or "\n" in str(path):
        return text
    return f'#include "{path}"\n'


# The kernel body in the header file too (default; LILY_CUDA_BODY_IN_HEADER=0 turns it off; read when a
# kernel object is made): the source MLX hashes at every evaluated launch is then its prologue, the signature
# and a one-line call of a device function holding the translated body (1.7-6.4 KB otherwise:
# docs/decode.md). H200, 2026-12-01: a launch evaluates in 4.2 instead of 7.7 us (bench.launch_cost); decode
# at 4K 138.5 vs 129.7 tok/s, 1.97x vs 1.92x the fair baseline (bench.decode_ab, one process per mode).
BODY_IN_HEADER_ENV = "LILY_CUDA_BODY_IN_HEADER"


def body_in_header() -> bool:
    """``LILY_CUDA_BODY_IN_HEADER`` (``1`` when unset); ValueError on any value other than 0 or 1."""
    value = os.environ.get(BODY_IN_HEADER_ENV, "")
    if value.strip() not in ("", "0", "1"):
        raise ValueError(f"{BODY_IN_HEADER_ENV}={value!r} is not 0 or 1 (1, the default: each kernel's translated "
                         "body goes into its header file and MLX gets a one-line body; 0: the body as is)")
    return value.strip() != "0"


def _cuda_params(input_names: Sequence[str], inputs: Sequence[mx.array], output_names: Sequence[str],
                 output_dtypes: Sequence[mx.Dtype], source: str, kernel: bool) -> List[Tuple[str, str]]:
    """(declaration, name) of each parameter MLX's generated signature gives a kernel whose body is
    ``source`` (inputs as ``const T*``, then the shape / strides / ndim that ``source`` names, outputs as
    ``T*``); ``kernel`` False: as a device function's parameters (no ``__grid_constant__``)."""
    grid_constant = "const __grid_constant__ " if kernel else "const "
    by_ref = "" if kernel else "&"
    params = []
    for n, a in zip(input_names, inputs):
        params.append((f"const {_CUDA_TYPES[a.dtype]}* {n}", n))
        if a.ndim > 0:
            if f"{n}_shape" in source:
                params.append((f"{grid_constant}Shape{by_ref} {n}_shape", f"{n}_shape"))
            if f"{n}_strides" in source:
                params.append((f"{grid_constant}Strides{by_ref} {n}_strides", f"{n}_strides"))
            if f"{n}_ndim" in source:
                params.append((f"{grid_constant}int {n}_ndim", f"{n}_ndim"))
    for n, d in zip(output_names, output_dtypes):
        params.append((f"{_CUDA_TYPES[d]}* {n}", n))
    return params


def _mma_enabled() -> bool:
    return os.environ.get("LILY_CUDA_MMA", "1") != "0"


# Lane layout of simdgroup_matrix (prelude.cuh). Only thread_elements() lets a Metal kernel observe which
# lane holds which element, so a kernel whose code never calls it gets mma.sync's fragment layout (fewer
# shuffles per product); ``apple`` keeps Apple's layout everywhere. Read with LILY_CUDA_MMA, when a
# kernel variant's header is built.
SGM_LAYOUT_ENV = "LILY_CUDA_SGM_LAYOUT"
SGM_LAYOUT_CHOICES = ("auto", "apple")
_THREAD_ELEMENTS = re.compile(r"\bthread_elements\b")


def sgm_layout_setting() -> str:
    """``LILY_CUDA_SGM_LAYOUT`` (``auto`` when unset); ValueError on any value other than the choices."""
    value = os.environ.get(SGM_LAYOUT_ENV, "")
    choice = value.strip().lower() or "auto"
    if choice not in SGM_LAYOUT_CHOICES:
        raise ValueError(f"{SGM_LAYOUT_ENV}={value!r} is not one of {', '.join(SGM_LAYOUT_CHOICES)} (auto: "
                         "mma.sync's lane layout for kernels that never call thread_elements(); apple: "
                         "Apple's layout for every kernel)")
    return choice


def _suffix(name: str) -> str:
    return f"{name}_lily_"


def _template_lines(template) -> List[str]:
    lines = []
    for name, value in signature.normalize_template(template):
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};")
        else:
            lines.append(f"  using {name} = {signature.type_string(value)};")
    return lines


def _attribute_lines(source: str) -> List[str]:
    """Locals for the Metal thread attributes ``source`` names (substring rule, as MLX)."""
    used = {a for a, _ in signature.used_thread_attributes(source)}
    u3 = "lily_metal::uint3"
    values = {
        "thread_position_in_grid": "lily_tpig_",
        "thread_position_in_threadgroup": f"{u3}(threadIdx.x, threadIdx.y, threadIdx.z)",
        "threadgroup_position_in_grid": f"{u3}(blockIdx.x, blockIdx.y, blockIdx.z)",
        "threads_per_threadgroup": "lily_tptg_",
        "dispatch_threads_per_threadgroup": f"{u3}(blockDim.x, blockDim.y, blockDim.z)",
        "threadgroups_per_grid": f"{u3}(gridDim.x, gridDim.y, gridDim.z)",
        "threads_per_grid": "lily_grid_",
        "grid_size": "lily_grid_",
        "grid_origin": f"{u3}(0u)",
        "thread_index_in_threadgroup": "lily_tiitg_",
        "thread_index_in_simdgroup": "lily_tiitg_ % 32u",
        "simdgroup_index_in_threadgroup": "lily_tiitg_ / 32u",
        "simdgroups_per_threadgroup": "(lily_tptg_.x * lily_tptg_.y * lily_tptg_.z + 31u) / 32u",
        "dispatch_simdgroups_per_threadgroup": "(blockDim.x * blockDim.y * blockDim.z + 31u) / 32u",
        "thread_execution_width": "32u",
        "threads_per_simdgroup": "32u",
        "quadgroup_index_in_threadgroup": "lily_tiitg_ / 4u",
        "thread_index_in_quadgroup": "lily_tiitg_ % 4u",
        "quadgroups_per_threadgroup": "(lily_tptg_.x * lily_tptg_.y * lily_tptg_.z + 3u) / 4u",
        "dispatch_quadgroups_per_threadgroup": "(blockDim.x * blockDim.y * blockDim.z + 3u) / 4u",
    }
    lines = [
        f"  const {u3} lily_grid_(lily_dispatch_[0], lily_dispatch_[1], lily_dispatch_[2]);",
        f"  const {u3} lily_tpig_(blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y,",
        "                         blockIdx.z * blockDim.z + threadIdx.z);",
        "  // CUDA launches whole blocks; Metal runs exactly the grid.",
        "  if (lily_tpig_.x >= lily_grid_.x || lily_tpig_.y >= lily_grid_.y || lily_tpig_.z >= lily_grid_.z) return;",
        "  // Metal's threads_per_threadgroup is the size of this (possibly partial) threadgroup.",
        f"  const {u3} lily_tptg_(min(blockDim.x, lily_grid_.x - blockIdx.x * blockDim.x),",
        "                         min(blockDim.y, lily_grid_.y - blockIdx.y * blockDim.y),",
        "                         min(blockDim.z, lily_grid_.z - blockIdx.z * blockDim.z));",
        "  const lily_metal::uint lily_tiitg_ = threadIdx.x + lily_tptg_.x * (threadIdx.y + lily_tptg_.y * threadIdx.z);",
    ]
    for attr, ctype in signature.THREAD_ATTRIBUTES:
        if attr in used:
            lines.append(f"  const lily_metal::{ctype} {attr} = {values[attr]};")
    return lines


class CudaMetalKernel:
    """Callable with ``mx.fast.metal_kernel``'s kernel call convention, running on MLX's CUDA backend."""

    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.metal_source = source
        self.metal_header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        # Translate once up front: unbridgeable constructs fail at construction, like a compile error.
        self.body = _drop_comment_lines(translate(source, "body"))
        self.header = _drop_comment_lines(translate(header, "header")) if header else ""
        code = code_only(source + "\n" + header)
        self.uses_simd = bool(_SIMD_USE.search(code))
        self.uses_barriers = bool(_BARRIER_USE.search(code))
        self.prelude_sections = prelude_sections(code, atomic_outputs)
        self.uses_thread_elements = bool(_THREAD_ELEMENTS.search(code))
        self._kernels: Dict[Tuple, object] = {}
        self._body_in_header = body_in_header()
        # (grid, threadgroup) -> (checked grid, threadgroup, the grid as an int32 input), once per geometry.
        self._launches: Dict[Tuple, Tuple] = {}

    # -- source generation (also used by the CI compile check) ------------------------------------

    def sgm_layout(self) -> Optional[str]:
        """The lane layout of this kernel's simdgroup matrices: ``mma`` (mma.sync's fragments) when its
        code never calls thread_elements() (so cannot tell) and LILY_CUDA_SGM_LAYOUT allows, else
        ``apple``; None for a kernel without simdgroup matrices."""
        if "simdgroup_matrix" not in self.prelude_sections:
            return None
        if self.uses_thread_elements or sgm_layout_setting() == "apple":
            return "apple"
        return "mma"

    def cuda_header(self) -> str:
        mma = "" if _mma_enabled() else "#define LILY_NO_MMA 1\n"
        layout = "#define LILY_SGM_MMA_LAYOUT 1\n" if self.sgm_layout() == "mma" else ""
        return (mma + layout + trimmed_prelude(self.prelude_sections) + "\nnamespace mlx::core::cu {\n"
                + self.header + "\n}  // namespace mlx::core::cu\n")

    def cuda_body(self, specs: Sequence[signature.InputSpec], template) -> str:
        lines = ["  // lily-mlx Metal->CUDA bridge prologue"]
        lines += _template_lines(template)
        for s in specs:
            raw = _suffix(s.name)
            if s.scalar:
                lines.append(f"  const auto {s.name} = *lily_metal::as_metal({raw});")
                continue
            lines.append(f"  auto {s.name} = lily_metal::as_metal({raw});")
            if s.has_shape:
                lines.append(f"  const int* {s.name}_shape = {raw}_shape.data();")
            if s.has_strides:
                lines.append(f"  const int64_t* {s.name}_strides = {raw}_strides.data();")
            if s.has_ndim:
                lines.append(f"  const int {s.name}_ndim = {raw}_ndim;")
        for o in self.output_names:
            conv = "as_atomic" if self.atomic_outputs else "as_metal"
            lines.append(f"  auto {o} = lily_metal::{conv}({_suffix(o)});")
        lines += _attribute_lines(self.metal_source)
        lines.append("  // ---- Metal kernel body ----")
        return "\n".join(lines) + "\n" + self.body

    def cuda_sources(self, inputs, output_dtypes, template) -> Tuple[str, str]:
        """(header, body) for MLX: the translated body as is, or (``LILY_CUDA_BODY_IN_HEADER=1``) inside a
        device function of the header, which the body calls. ``inputs`` include the true-grid input."""
        header, body = self.cuda_header(), self.cuda_body(self.specs(inputs[:-1]), template)
        if not body_in_header():
            return header, body
        names = self.cuda_input_names() + self.cuda_output_names()
        params = _cuda_params(self.cuda_input_names(), inputs, self.cuda_output_names(), output_dtypes, body, False)
        fname = f"lily_body_{hashlib.sha1(body.encode()).hexdigest()[:16]}"
        function = (f"__device__ __forceinline__ void {fname}(\n    " + ",\n    ".join(d for d, _ in params)
                    + ") {\n" + body + "\n}\n")
        head, close, tail = header.rpartition("\n}  // namespace mlx::core::cu\n")  # after the Metal header
        header = head + "\n" + function + close.lstrip("\n") + tail
        assert close and all(n in (p for _, p in params) for n in names)
        return header, f"  {fname}({', '.join(p for _, p in params)});"

    def kernel_name(self, header: str, body: str) -> str:
        digest = hashlib.sha1((header + "\0" + body).encode()).hexdigest()[:16]
        return f"{self.name}_{digest}"

    def cuda_input_names(self) -> List[str]:
        return [_suffix(n) for n in self.input_names] + ["lily_dispatch_"]

    def cuda_output_names(self) -> List[str]:
        return [_suffix(n) for n in self.output_names]

    def specs(self, inputs) -> List[signature.InputSpec]:
        return signature.classify_inputs(self.input_names, inputs, self.metal_source)

    # -- launch checks -------------------------------------------------------------------------

    def _check_launch(self, grid, threadgroup) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
        grid = tuple(int(g) for g in grid)
        tg = tuple(max(1, min(int(t), g)) for t, g in zip(threadgroup, grid))
        if len(grid) != 3 or len(tg) != 3 or min(grid) < 1:
            raise ValueError(f"[metal_kernel] grid {grid} and threadgroup {threadgroup} need 3 positive sizes")
        if tg[0] * tg[1] * tg[2] > MAX_THREADS_PER_THREADGROUP:
            raise ValueError(f"[metal_kernel] threadgroup {tg} exceeds {MAX_THREADS_PER_THREADGROUP} threads")
        if self.uses_simd or self.uses_barriers:
            self._check_simd_groups(grid, tg)
        return grid, tg

    def _check_simd_groups(self, grid, tg) -> None:
        """Barriers and warp shuffles need every CUDA warp either fully live or fully padding, and
        Metal's SIMD-groups (made from the partial threadgroup's own linear index) to be CUDA's warps."""
        partial = [g % t for g, t in zip(grid, tg)]
        for d in (0, 1):
            if partial[d] and any(t > 1 for t in tg[d + 1:]):
                raise UnbridgeableError(
                    f"Metal->CUDA bridge: kernel {self.name!r} uses SIMD-group operations or barriers with "
                    f"grid {grid} and threadgroup {tg}: a partial threadgroup in dimension {'xy'[d]} "
                    "regroups Metal's SIMD-groups differently from CUDA's warps; use a grid that is a "
                    "multiple of the threadgroup")
        sizes = [{t} | ({p} if p else set()) for t, p in zip(tg, partial)]
        for x in sizes[0]:
            for y in sizes[1]:
                for z in sizes[2]:
                    live = x * y * z
                    if live % 32 and (self.uses_simd or live != tg[0] * tg[1] * tg[2]):
                        raise UnbridgeableError(
                            f"Metal->CUDA bridge: kernel {self.name!r} uses SIMD-group operations or "
                            f"barriers, but grid {grid} with threadgroup {tg} has a threadgroup of "
                            f"{live} threads (not whole 32-lane SIMD-groups); CUDA warps cannot run "
                            "partial SIMD-group operations the way Metal does")

    # -- call ----------------------------------------------------------------------------------

    def _cuda_kernel(self, inputs, template, output_dtypes):
        # The key is what changes the generated source: which inputs are 0-d, and the template; with the
        # body in the header, the dtypes too (its device function's parameters). (LILY_CUDA_MMA and
        # LILY_CUDA_SGM_LAYOUT are read when a variant is first built, LILY_CUDA_BODY_IN_HEADER when the
        # kernel object is; never per call.)
        if isinstance(template, dict):
            template = list(template.items())
        key = (tuple([a.ndim == 0 for a in inputs]), tuple(map(tuple, template)) if template else ())
        if self._body_in_header:
            key += (tuple(a.dtype for a in inputs), tuple(output_dtypes))
        k = self._kernels.get(key)
        if k is None:
            with_grid = list(inputs) + [mx.zeros((3,), mx.int32)]
            header, body = self.cuda_sources(with_grid, output_dtypes, template)
            k = mx.fast.cuda_kernel(
                name=self.kernel_name(header, body),  # the full header's hash, not the include line's
                input_names=self.cuda_input_names(),
                output_names=self.cuda_output_names(),
                source=body,
                header=launch_header(header),
                ensure_row_contiguous=self.ensure_row_contiguous,
            )
            self._kernels[key] = k
        return k

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value: Optional[float] = None, verbose: bool = False, stream=None):
        # Per-call work is kept to dictionary look-ups: decode launches hundreds of kernels per token.
        inputs = [x if isinstance(x, mx.array) else signature.as_input_array(x) for x in inputs]
        if len(inputs) != len(self.input_names):
            raise ValueError(f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)} "
                             f"but got size {len(inputs)}.")
        if self.atomic_outputs:
            bad = [d for d in output_dtypes if d not in _ATOMIC_DTYPES]
            if bad:
                raise UnbridgeableError(f"Metal->CUDA bridge: atomic outputs of dtype {bad[0]} (Metal has "
                                        "atomic int, uint and float only)")
        launch_key = (tuple(grid), tuple(threadgroup))
        launch = self._launches.get(launch_key)
        if launch is None:  # checked once per geometry; the true grid travels as a cached int32 input
            if len(self._launches) > 4096:  # prefill chunk lengths vary: keep the cache bounded
                self._launches.clear()
            checked_grid, tg = self._check_launch(grid, threadgroup)
            grid_input = mx.array(list(checked_grid), dtype=mx.int32)
            launch = self._launches[launch_key] = (checked_grid, tg, grid_input)
        grid, tg, grid_input = launch
        kernel = self._cuda_kernel(inputs, template, output_dtypes)
        inputs.append(grid_input)
        if init_value is None and stream is None:
            return kernel(inputs=inputs, grid=grid, threadgroup=tg, output_shapes=output_shapes,
                          output_dtypes=output_dtypes, verbose=verbose)
        kwargs = dict(inputs=inputs, grid=grid, threadgroup=tg, output_shapes=output_shapes,
                      output_dtypes=output_dtypes, verbose=verbose)
        if init_value is not None:
            kwargs["init_value"] = init_value
        if stream is not None:
            kwargs["stream"] = stream
        return kernel(**kwargs)


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True, atomic_outputs: bool = False):
    """``mx.fast.metal_kernel`` for MLX's CUDA backend (same arguments, same call convention)."""
    return CudaMetalKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                           atomic_outputs)


def mlx_cuda_translation_unit(kernel_name: str, header: str, source: str, input_names: Sequence[str],
                              inputs: Sequence[mx.array], output_names: Sequence[str],
                              output_dtypes: Sequence[mx.Dtype]) -> str:
    """The translation unit ``mx.fast.cuda_kernel`` (MLX 0.32) builds and NVRTC compiles: MLX's default
    header, ``header``, the generated signature (inputs as ``const T*``, shape/strides/ndim of
    inputs whose name + suffix occurs in ``source``, outputs as ``T*``) and ``source``."""
    text = ('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
            "#define inf cuda::std::numeric_limits<float>::infinity()\n\n")
    text += header
    text += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    text += f"__global__ void {kernel_name}(\n"
    params = [f"    {decl}" for decl, _ in _cuda_params(input_names, inputs, output_names, output_dtypes, source, True)]
    text += ",\n".join(params) + ") {\n"
    text += source + "\n}\n\n} // namespace mlx::core::cu\n"
    return text


def wrap_like_mlx(kernel: CudaMetalKernel, inputs, output_dtypes, template=None) -> Tuple[str, str]:
    """(kernel name, full CUDA translation unit) as ``mx.fast.cuda_kernel`` would build it for this
    call. Used to compile-check translations with ``nvcc`` where there is no GPU."""
    inputs = [signature.as_input_array(x) for x in inputs]
    header, body = kernel.cuda_sources(inputs + [mx.zeros((3,), mx.int32)], output_dtypes, template)
    kname = "custom_kernel_" + kernel.kernel_name(header, body)
    text = mlx_cuda_translation_unit(kname, header, body, kernel.cuda_input_names(),
                                     inputs + [mx.zeros((3,), mx.int32)], kernel.cuda_output_names(),
                                     output_dtypes)
    return kname, text
