"""``metal_kernel``: the simulator's drop-in for ``mx.fast.metal_kernel``."""

from __future__ import annotations

import ctypes
import os
import re
import warnings
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from .. import signature as sig
from . import build, translate

MAX_THREADGROUP = 1024


class SimulatorError(RuntimeError):
    """A kernel misbehaved while running in the simulator."""


class OutOfBoundsError(SimulatorError):
    """A device/constant buffer was read or written outside its extent."""


class DivergenceError(SimulatorError):
    """A barrier or simd op was reached by only part of its threadgroup/simdgroup."""


class RaceError(SimulatorError):
    """Two threads accessed the same threadgroup memory between barriers, at least one writing."""


class MisalignedAccessError(SimulatorError):
    """A buffer element was read or written at an address its type's alignment does not allow."""


_warned_oob: dict = {}

# Kernel text the simulator's C++20 compiler would take but Metal refuses: (pattern, what).
_NOT_METAL = (
    (r"\bdouble\b", "`double` (Apple GPUs have no 64-bit float type; use float)"),
    (r"\brequires\b|\bconcept\b|\bconsteval\b|\bconstinit\b|<=>", "a C++20 construct (Metal is C++17-based)"),
    (r"\[[^\[\]]*\]\s*<\s*(?:typename|class)\b", "a templated lambda (C++20)"),
)

_ERRORS = {1: OutOfBoundsError, 2: DivergenceError, 3: RaceError, 5: MisalignedAccessError}


class _Launch(ctypes.Structure):
    # Mirror of msl_rt::Launch in runtime.h.
    _fields_ = [
        ("ptrs", ctypes.POINTER(ctypes.c_void_p)),
        ("bases", ctypes.POINTER(ctypes.c_void_p)),
        ("nbytes", ctypes.POINTER(ctypes.c_int64)),
        ("grid", ctypes.c_uint32 * 3),
        ("tg", ctypes.c_uint32 * 3),
        ("n_workers", ctypes.c_int32),
        ("race_check", ctypes.c_int32),
        ("stack_bytes", ctypes.c_int64),
        ("err", ctypes.c_char_p),
        ("err_len", ctypes.c_int32),
        ("err_kind", ctypes.c_int32),
        ("err_line", ctypes.c_int32),
        ("allow_oob_reads", ctypes.c_int32),
        ("oob_reads", ctypes.c_int64),
        ("err_pc", ctypes.c_int64),
    ]


# numpy dtype with the same bytes as each MLX dtype (bfloat16 travels as uint16).
_NP_STORAGE = {
    mx.bool_: np.bool_, mx.uint8: np.uint8, mx.uint16: np.uint16, mx.uint32: np.uint32, mx.uint64: np.uint64,
    mx.int8: np.int8, mx.int16: np.int16, mx.int32: np.int32, mx.int64: np.int64, mx.float16: np.float16,
    mx.bfloat16: np.uint16, mx.float32: np.float32, mx.float64: np.float64, mx.complex64: np.complex64,
}


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


# GPU buffers start at least this aligned (Metal's and CUDA's allocators give more), so a kernel may read
# an input through 16-byte vector types (uint4, float4); MLX's CPU allocator may start a small array at
# 8 bytes past that, where the compiled kernel's aligned vector loads would fault.
_BUFFER_ALIGN = 16


def _aligned(arr: np.ndarray) -> np.ndarray:
    """``arr`` (C-contiguous), or a copy of it that starts on a :data:`_BUFFER_ALIGN`-byte boundary."""
    if arr.ctypes.data % _BUFFER_ALIGN == 0:
        return arr
    raw = np.empty(arr.nbytes + _BUFFER_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _BUFFER_ALIGN
    out = raw[start:start + arr.nbytes].view(arr.dtype).reshape(arr.shape)
    out[...] = arr
    return out


NO_GRADIENT = ("lily-mlx's kernels have no gradient (as MLX's custom kernels on a GPU): gradients of a patched model "
               "run through stock's ops in training mode (model.train() before mx.grad / value_and_grad), or unpatch "
               "it (lily_mlx.unpatch)")


def _refusing_gradients(outputs: List[mx.array], inputs: List[mx.array]) -> List[mx.array]:
    """``outputs`` as the outputs of a function of ``inputs`` whose vjp is an error: the simulator's outputs come
    from numpy, which would otherwise cut the graph and give silent zero gradients where a GPU raises."""
    differentiable = [x for x in inputs if isinstance(x, mx.array) and mx.issubdtype(x.dtype, mx.inexact)]
    if not differentiable:
        return outputs
    refuse = mx.custom_function(lambda *_: outputs)

    @refuse.vjp
    def _vjp(primals, cotangents, outs):
        raise ValueError(NO_GRADIENT)

    @refuse.jvp
    def _jvp(primals, tangents):
        raise ValueError(NO_GRADIENT)

    refused = list(refuse(*differentiable))
    mx.eval(refused)  # computed here, as the simulator's outputs always were (usable from any thread)
    return refused


def _from_numpy(buf: np.ndarray, dtype: mx.Dtype, shape) -> mx.array:
    out = mx.array(buf)
    if dtype == mx.bfloat16:
        out = out.view(mx.bfloat16)
    return out.reshape(shape)


def _n_workers() -> int:
    env = os.environ.get("LILY_MSL_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover
        return max(1, os.cpu_count() or 1)


def _line_text(text: str, line: int) -> str:
    lines = text.splitlines()
    if 1 <= line <= len(lines):
        return f"\n  line {line}: {lines[line - 1].strip()}"
    return ""


class MetalKernel:
    """A kernel built by :func:`metal_kernel`; call it like an ``mx.fast.metal_kernel`` kernel."""

    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None, race_check: Optional[bool] = None,
                 allow_oob_reads: bool = False):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.compile_options = compile_options
        self.race_check = race_check
        self.allow_oob_reads = allow_oob_reads
        self.last_oob_reads = 0  # out-of-bounds input reads of the last call (allow_oob_reads=True)
        # kernel name -> (params, loaded library): the name encodes everything the text depends on
        # besides this kernel's fixed source/header (template, input dtypes and kinds, output dtypes).
        self._built = {}

    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None) -> List[mx.array]:
        if isinstance(inputs, dict) or isinstance(output_shapes, dict):
            raise TypeError("[metal_kernel] inputs/output_shapes are sequences, as in mx.fast.metal_kernel")
        inputs = [sig.as_input_array(x) for x in inputs]
        if len(output_shapes) != len(self.output_names):
            raise ValueError(f"[metal_kernel] Expected `output_shapes` to have size {len(self.output_names)} "
                             f"but got size {len(output_shapes)}.")
        if len(output_dtypes) != len(self.output_names):
            raise ValueError(f"[metal_kernel] Expected `output_dtypes` to have size {len(self.output_names)} "
                             f"but got size {len(output_dtypes)}.")
        template = sig.normalize_template(template)
        kname, metal_text = sig.generate_source(
            self.name, self.input_names, self.output_names, self.source, self.header, template,
            self.atomic_outputs, inputs, output_dtypes)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{metal_text}\n```", flush=True)
        grid = tuple(int(g) for g in grid)
        tg = tuple(int(t) for t in threadgroup)
        if len(grid) != 3 or len(tg) != 3:
            raise ValueError("[metal_kernel] grid and threadgroup must have 3 entries")
        if tg[0] * tg[1] * tg[2] > MAX_THREADGROUP:
            raise ValueError(f"Thread group size ({tg[0] * tg[1] * tg[2]}) is greater than  the maximum allowed "
                             f"threads per threadgroup ({MAX_THREADGROUP}).")
        if min(tg) <= 0:
            raise ValueError("[metal_kernel] threadgroup sizes must be positive")
        tg = tuple(min(t, g) for t, g in zip(tg, grid))

        race = self.race_check if self.race_check is not None else os.environ.get("LILY_MSL_RACE", "0") == "1"
        params, lib = self._build(kname, metal_text, template, inputs, output_dtypes, traced=False)
        run = lambda lib_, flags: self._launch(lib_, params, inputs, output_shapes, output_dtypes, init_value, grid,
                                               tg, flags, metal_text, kname)
        if not race:
            return _refusing_gradients([_from_numpy(buf, dtype, shape) for buf, dtype, shape in run(lib, 0)], inputs)
        # Race check. (1) Traced build: every threadgroup-memory access is checked against the other
        # threads' accesses between the same two barriers (falls back to attributing writes by
        # comparing memory when the compiler cannot instrument). (2) A second legal schedule (threads
        # of each group in reverse order between sync points): outputs that depend on the order mean
        # threads communicate through memory without a barrier between them.
        try:
            _, traced_lib = self._build(kname, metal_text, template, inputs, output_dtypes, traced=True)
            track = 4
        except build.CompileError:
            traced_lib, track = lib, 1
        first = run(traced_lib, track)
        if not self.atomic_outputs and min(grid) > 0:
            second = run(traced_lib, track | 2)
            for (b1, dtype, shape), (b2, _, _), oname in zip(first, second, self.output_names):
                diff = np.nonzero(b1.view(np.uint8).reshape(-1) != b2.view(np.uint8).reshape(-1))[0]
                if diff.size:
                    elem = int(diff[0]) // b1.itemsize
                    v1, v2 = b1.reshape(-1)[elem], b2.reshape(-1)[elem]
                    raise RaceError(
                        f"[lily_mlx.msl.sim] kernel {self.name} ({kname}): race: output `{oname}` element {elem} "
                        f"depends on the order threads run between barriers ({v1!r} in thread order, {v2!r} in "
                        f"reverse order): threads share memory without a barrier between the accesses")
        return _refusing_gradients([_from_numpy(buf, dtype, shape) for buf, dtype, shape in first], inputs)

    def _build(self, kname, metal_text, template, inputs, output_dtypes, traced):
        built = self._built.get((kname, traced))
        if built is None:
            self._check_mlx_signature(metal_text, kname)
            self._check_metal_language(metal_text, kname)
            specs = sig.classify_inputs(self.input_names, inputs, self.source)
            params = sig.parameters(specs, self.output_names, output_dtypes, self.source, self.atomic_outputs)
            cpp = translate.kernel_cpp(kname, self.header, self.source, sig.template_params(template),
                                       sig.format_template(template), params)
            built = self._built[(kname, traced)] = (params, build.build(cpp, metal_text, kname, traced))
        return built

    def _launch(self, lib, params, inputs, output_shapes, output_dtypes, init_value, grid, tg, flags, metal_text,
                kname):
        keep = []  # numpy arrays that must stay alive during the launch
        ptrs, bases, sizes = [], [], []

        def add(arr: np.ndarray, lo_bytes: int = 0, span: Optional[int] = None):
            keep.append(arr)
            p = arr.ctypes.data
            ptrs.append(p)
            bases.append(p + lo_bytes)
            sizes.append(arr.nbytes if span is None else span)

        outputs_np = []
        for p in params:
            if p.kind == "input":
                x = _to_numpy(inputs[p.input_index])
                if self.ensure_row_contiguous or x.ndim == 0:
                    add(_aligned(np.ascontiguousarray(x)))
                else:
                    lo, span = _strided_extent(x)
                    add(x, lo, span)
            elif p.kind in ("shape", "strides", "ndim"):
                a = inputs[p.input_index]
                if p.kind == "shape":
                    add(np.array(a.shape, dtype=np.int32))
                elif p.kind == "strides":
                    if self.ensure_row_contiguous:
                        st = _row_strides(a.shape)
                    else:
                        x = _to_numpy(a)
                        st = [s // x.itemsize for s in x.strides]
                    add(np.array(st, dtype=np.int64))
                else:
                    add(np.array(a.ndim, dtype=np.int32))
            elif p.kind == "output":
                j = p.output_index
                dtype = output_dtypes[j]
                shape = tuple(int(s) for s in output_shapes[j])
                if init_value is not None:
                    buf = np.array(_to_numpy(mx.full(shape, init_value, dtype)), copy=True)
                else:
                    # Uninitialised on a GPU: poison so unwritten elements show (NaN / -1).
                    buf = np.empty(shape, dtype=_NP_STORAGE[dtype])
                    buf.view(np.uint8).fill(0xFF)
                buf = np.ascontiguousarray(buf)
                outputs_np.append((buf, dtype, shape))
                add(buf)

        n = len(ptrs)
        err = ctypes.create_string_buffer(4096)
        launch = _Launch()
        launch.ptrs = (ctypes.c_void_p * max(n, 1))(*ptrs)
        launch.bases = (ctypes.c_void_p * max(n, 1))(*bases)
        launch.nbytes = (ctypes.c_int64 * max(n, 1))(*sizes)
        launch.grid = (ctypes.c_uint32 * 3)(*grid)
        launch.tg = (ctypes.c_uint32 * 3)(*tg)
        launch.n_workers = _n_workers()
        launch.race_check = flags
        launch.allow_oob_reads = 1 if self.allow_oob_reads else 0
        launch.stack_bytes = int(os.environ.get("LILY_MSL_STACK_KB", "256")) * 1024
        launch.err = ctypes.cast(err, ctypes.c_char_p)
        launch.err_len = len(err)
        if min(grid) > 0:
            rc = lib.lily_sim_launch(ctypes.byref(launch))
            if rc != 0:
                msg = self._name_buffers(err.value.decode(errors="replace"), params)
                cls = _ERRORS.get(rc, SimulatorError)
                line = launch.err_line
                if rc in (3, 5) and not line and launch.err_pc:
                    line = build.source_line_of(lib, launch.err_pc, kname)
                raise cls(f"[lily_mlx.msl.sim] kernel {self.name} ({kname}): {msg}{_line_text(metal_text, line)}")
        del keep
        self.last_oob_reads = int(launch.oob_reads)
        if launch.oob_reads and not _warned_oob.get(kname):
            _warned_oob[kname] = True
            warnings.warn(f"[lily_mlx.msl.sim] kernel {self.name}: {launch.oob_reads} out-of-bounds input read(s) "
                          "returned 0 (allow_oob_reads=True); on a GPU they read whatever memory is there",
                          stacklevel=3)
        return outputs_np

    @staticmethod
    def _check_metal_language(metal_text: str, kname: str) -> None:
        # What the simulator's C++20 and the CUDA bridge accept but Metal (C++17-based, no 64-bit
        # float on Apple GPUs) refuses: caught here rather than on a user's Mac.
        code = re.sub(r"//[^\n]*|/\*.*?\*/", " ", metal_text, flags=re.DOTALL)
        for pattern, what in _NOT_METAL:
            m = re.search(pattern, code)
            if m:
                line = code.count("\n", 0, m.start()) + 1
                raise build.CompileError(
                    f"[lily_mlx.msl.sim] kernel {kname}: {what} at line {line} ({m.group(0).strip()!r}): "
                    f"Metal does not compile it.\n{build.numbered(metal_text)}")

    @staticmethod
    def _check_mlx_signature(metal_text: str, kname: str) -> None:
        # MLX writes ") {" after an output when no thread attribute follows and the buffer index
        # reaches inputs + outputs - 1 early (shape/strides/ndim buffers): that text does not compile
        # on Metal either.
        head = metal_text.split(f"void {kname}(", 1)[-1]
        sig_lines = []
        for line in head.splitlines():
            sig_lines.append(line)
            if line.endswith(") {") and not line.strip().startswith("//"):
                break
        rest = head.splitlines()[len(sig_lines):]
        if rest and rest[0].lstrip().startswith("device ") and "[[buffer(" in rest[0]:
            raise build.CompileError(
                f"[lily_mlx.msl.sim] kernel {kname}: MLX generates an invalid signature for this kernel (several "
                "outputs, shape/strides/ndim buffers and no thread attribute; a known MLX bug), so Metal would "
                f"reject it. Use a thread attribute in the body.\n{build.numbered(metal_text)}")

    @staticmethod
    def _name_buffers(msg: str, params) -> str:
        for p in params:
            if p.index is not None:
                msg = msg.replace(f"buffer {p.index} ", f"buffer {p.index} (`{p.name}`, {p.kind}) ")
        return msg


def _row_strides(shape) -> List[int]:
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return list(reversed(st))


def _strided_extent(x: np.ndarray):
    """(byte offset of the lowest element from x's pointer, byte span) of a strided view."""
    if x.size == 0:
        return 0, 0
    lo = sum(min(0, s * (n - 1)) for s, n in zip(x.strides, x.shape))
    hi = sum(max(0, s * (n - 1)) for s, n in zip(x.strides, x.shape))
    return lo, hi - lo + x.itemsize


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True, atomic_outputs: bool = False,
                 compile_options=None, race_check: Optional[bool] = None,
                 allow_oob_reads: bool = False) -> MetalKernel:
    """Same signature and call convention as ``mx.fast.metal_kernel``; runs on the CPU simulator.

    Simulator-only options: ``race_check`` enables threadgroup-memory race detection (default from
    ``LILY_MSL_RACE=1``); ``allow_oob_reads`` turns out-of-bounds reads of inputs into reads of
    zeros (counted in ``kernel.last_oob_reads``, warned once) instead of an ``OutOfBoundsError``.
    Out-of-bounds accesses to outputs are always errors.
    """
    return MetalKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                       atomic_outputs, compile_options, race_check, allow_oob_reads)
