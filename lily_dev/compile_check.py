"""Compile-check bridge translations without a GPU: with NVRTC (the compiler MLX's CUDA backend
uses, when ``libnvrtc`` is found) or else the CUDA toolkit's ``nvcc`` (front end and ptxas).

MLX's CUDA backend compiles custom kernels with NVRTC against its own device headers, which ship
inside the ``mlx-cuda`` library, not as files. Without them, :data:`STANDIN_UTILS_CUH` stands in for
``mlx/backend/cuda/device/utils.cuh``: it declares only what the generated wrapper and the bridge
use (``Shape``, ``Strides``, the fp16/bf16 headers). A directory holding the real headers can be given
instead (``include_dir``), which checks name clashes with MLX's own device utilities too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Tuple

STANDIN_UTILS_CUH = """\
// Stand-in for MLX's mlx/backend/cuda/device/utils.cuh (compile checks only): the parts the
// custom-kernel wrapper and the lily-mlx bridge rely on.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
#define MAX_NDIM 10
#define WARP_SIZE 32
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
"""


def nvcc_path() -> Optional[str]:
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None
    )


def _standin_dir(root: Path) -> Path:
    d = root / "mlx" / "backend" / "cuda" / "device"
    d.mkdir(parents=True, exist_ok=True)
    (d / "utils.cuh").write_text(STANDIN_UTILS_CUH)
    return root


def cuda_include_dirs() -> list:
    """The CUDA toolkit's headers (and CCCL's ``cuda/std``), next to ``nvcc`` or under CUDA_HOME."""
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    nvcc = nvcc_path()
    if nvcc:
        roots.insert(0, str(Path(os.path.realpath(nvcc)).parent.parent))
    for root in roots:
        inc = Path(root) / "include"
        if root and (inc / "cuda_bf16.h").exists():
            return [str(inc)] + ([str(inc / "cccl")] if (inc / "cccl").is_dir() else [])
    return []


def nvrtc_library() -> Optional[str]:
    """Path of libnvrtc: ``LILY_NVRTC_LIB``, the ``nvidia-cuda-nvrtc`` wheel, or the system's."""
    env = os.environ.get("LILY_NVRTC_LIB")
    if env:
        return env
    try:
        import nvidia.cu13 as cu  # nvidia-cuda-nvrtc (CUDA 13 wheels)

        for lib in sorted(Path(list(cu.__path__)[0], "lib").glob("libnvrtc.so*")):
            return str(lib)
    except ImportError:
        pass
    import ctypes.util

    return ctypes.util.find_library("nvrtc")


@contextmanager
def _nvrtc_program(text: str, arch: str, include_dir: Optional[str] = None):
    """(the NVRTC library, a program of ``text`` compiled for ``arch``, NVRTC's status) for the block, as MLX
    compiles at run time (C++17); the program is destroyed after."""
    import ctypes

    lib = ctypes.CDLL(nvrtc_library())
    with tempfile.TemporaryDirectory() as tmp:
        inc = include_dir or os.environ.get("LILY_MLX_CUDA_INCLUDE") or str(_standin_dir(Path(tmp) / "standin"))
        opts = ["--std=c++17", f"-arch={arch}", f"-I{inc}"] + [f"-I{d}" for d in cuda_include_dirs()]
        prog = ctypes.c_void_p()
        if lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"kernel.cu", 0, None, None) != 0:
            raise RuntimeError("nvrtcCreateProgram failed")
        try:
            rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts]))
            yield lib, prog, rc
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_text(lib, prog, what: str) -> str:
    """The program's log (``what`` = "ProgramLog") or PTX ("PTX") as text."""
    import ctypes

    size = ctypes.c_size_t()
    getattr(lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    getattr(lib, f"nvrtcGet{what}")(prog, buf)
    return buf.value.decode(errors="replace")


def compile_nvrtc(text: str, arch: str = "sm_90a", include_dir: Optional[str] = None) -> Tuple[bool, str]:
    """Compile with NVRTC, as MLX does at run time (C++17, the given architecture)."""
    try:
        with _nvrtc_program(text, arch, include_dir) as (lib, prog, rc):
            return rc == 0, _nvrtc_text(lib, prog, "ProgramLog")
    except RuntimeError as e:
        return False, str(e)


def ptx_nvrtc(text: str, arch: str = "compute_90a") -> str:
    """PTX of one translation unit from NVRTC (for counting instructions); AssertionError if it does not compile."""
    with _nvrtc_program(text, arch) as (lib, prog, rc):
        assert rc == 0, "NVRTC failed: " + _nvrtc_text(lib, prog, "ProgramLog")[-2000:]
        return _nvrtc_text(lib, prog, "PTX")


def compiler_available() -> Optional[str]:
    """'nvrtc', 'nvcc' or None: what :func:`compile_cuda` will use."""
    if nvrtc_library() and cuda_include_dirs():
        return "nvrtc"
    return "nvcc" if nvcc_path() else None


def compile_cuda(text: str, arch: str = "sm_90a", include_dir: Optional[str] = None,
                 timeout: float = 300.0, compiler: Optional[str] = None) -> Tuple[bool, str]:
    """Compile one translation unit with NVRTC if available (MLX's own compiler), else nvcc."""
    compiler = compiler or compiler_available()
    if compiler == "nvrtc":
        return compile_nvrtc(text, arch, include_dir)
    return compile_nvcc(text, arch, include_dir, timeout)


def compile_nvcc(text: str, arch: str = "sm_90a", include_dir: Optional[str] = None,
                 timeout: float = 300.0, extra_flags: Tuple[str, ...] = (),
                 cubin_out: Optional[Path] = None) -> Tuple[bool, str]:
    """Compile one translation unit to a cubin (front end and ptxas, as the driver would).
    Returns (ok, compiler output). ``extra_flags``: more nvcc flags (``-Xptxas -v``: resource usage);
    ``cubin_out``: where to keep the cubin (for ``cuobjdump -sass``)."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    include_dir = include_dir or os.environ.get("LILY_MLX_CUDA_INCLUDE")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inc = Path(include_dir) if include_dir else _standin_dir(tmp / "standin")
        src = tmp / "kernel.cu"
        src.write_text(text)
        cmd = [nvcc, "-std=c++17", f"-arch={arch}", "-cubin", "-I", str(inc), "-x", "cu", str(src),
               "-o", str(tmp / "kernel.cubin"), *extra_flags]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out = p.stdout + p.stderr
        ok = p.returncode == 0 and (tmp / "kernel.cubin").stat().st_size > 0
        if ok and cubin_out is not None:
            shutil.copyfile(tmp / "kernel.cubin", cubin_out)
        return ok, out


class RecordedCudaKernel:
    """Stands in for ``mx.fast.cuda_kernel`` where there is no GPU: records what the bridge asks
    MLX to compile for each call and returns zero outputs of the right shapes."""

    def __init__(self, records, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 shared_memory=0):
        self.records, self.name = records, name
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.source, self.header = source, header

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None):
        import mlx.core as mx

        from lily_mlx.msl.cuda.kernel import mlx_cuda_translation_unit

        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]
        kname = "custom_kernel_" + self.name
        if kname not in self.records:
            self.records[kname] = mlx_cuda_translation_unit(
                kname, self.header, self.source, self.input_names, inputs, self.output_names, output_dtypes)
        return [mx.zeros(tuple(s), d) for s, d in zip(output_shapes, output_dtypes)]


# Switch states that reach the other kernels (the write-up's ablation variants).
ABLATIONS = ("register_scan", "fused_dequant", "fused_recurrent_norm")
# deltanet_decode_fused runs only with fused_recurrent_norm on and fused_conv_step off (on, decode takes
# deltanet_decode_conv_fused; with fused_recurrent_norm off, the unfused kernels).
TWO_KERNEL_DECODE = ("fused_conv_step",)


def record_model_translations(model, prompt_tokens: int = 40, vocab_size: int = 1024,
                              disabled_sets=((), ABLATIONS, TWO_KERNEL_DECODE)) -> dict:
    """{kernel name: CUDA translation unit} for every bridge kernel a patched ``model`` launches in
    one prefill and one decode step, with the real call sites' dtypes, shapes and templates. Runs
    anywhere: MLX's CUDA backend is replaced by :class:`RecordedCudaKernel` (outputs are zeros, so
    the model's numbers are meaningless here; only the launches matter)."""
    from unittest import mock

    import mlx.core as mx

    import lily_mlx
    from lily_mlx.core import backend, dispatch, kernel_registry, switches
    from mlx_lm.models.cache import make_prompt_cache

    records: dict = {}

    def fake_cuda_kernel(**kw):
        return RecordedCudaKernel(records, **kw)

    kernel_registry.clear_cache()
    with mock.patch.object(mx.fast, "cuda_kernel", side_effect=fake_cuda_kernel), \
            mock.patch.object(backend, "_cuda_available", return_value=True), \
            mock.patch.dict(os.environ, {"LILY_BACKEND": "cuda"}):
        try:
            lily_mlx.patch(model)
            for disabled in disabled_sets:
                with switches.overrides(disable=[d for d in disabled if d in switches.SWITCHES]):
                    cache = make_prompt_cache(model)
                    prompt = mx.random.randint(0, vocab_size, (1, prompt_tokens), key=mx.random.key(0))
                    mx.eval(model(prompt, cache=cache))
                    mx.eval(model(prompt[:, -1:], cache=cache))
        finally:
            lily_mlx.unpatch(model)
            kernel_registry.clear_cache()
    dispatch.invalidate()  # the plan was resolved for the stand-in CUDA backend
    return records
