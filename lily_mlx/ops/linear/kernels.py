"""Host side of ``kernels/linear/gemv.metal``: dispatch table, launch geometry and shape rules of the
dense 4-bit row GEMV (op ``linear_gemv``)."""

from __future__ import annotations

from typing import Dict, Optional

import mlx.core as mx

from ...core.dispatch import op_backend
from ...core.kernel_registry import KernelSpec, float32_scalar, get_kernel

GEMV = "linear/gemv.metal"

KERNELS: Dict[str, KernelSpec] = {
    "gemv_q4": KernelSpec("linear_gemv_q4", GEMV, ("x", "w", "scales", "biases", "params"), ("y",),
                          params=("K", "N", "B")),
    "gemv_q4_rms_norm": KernelSpec("linear_gemv_q4_rms_norm", GEMV,
                                   ("x", "w", "scales", "biases", "norm_weight", "eps", "params"), ("y",),
                                   params=("K", "N", "B")),
}

# A trial kernel on every backend (on with LILY_TRIAL_OPS=linear_gemv, or where `python -m lily_mlx tune`
# measured it faster on the first decoder layer's in-projection), for two reasons (docs/decode.md): it is not
# batch invariant under MLX-LM's batching (a prompt's last one-token chunk runs the GEMV alone, but MLX's
# matmul when padded to a longer prompt in a batch: a prefill GEMM with the GEMV's per-row arithmetic would
# fix that, as the MoE GEMM tiles do for the expert GEMVs); and on the H200 (2026-12-01) a decode step took
# 0.38 ms less GPU time with it than with MLX's quantised GEMV, yet pipelined decode ran 1.10x faster without
# it (host-bound; that build also had a reshape on each side of every launch, since removed). Re-timed on the
# H100 (2026-12-05, a fast host): 0.30 ms less GPU time a 4K step, decode 1.003-1.015x lily in bursts and
# level pipelined (the step bound by its launches).
GEMV_BACKENDS: frozenset = frozenset()
GEMV_TRIAL_BACKENDS = frozenset({"sim", "cuda", "metal"})

ROWS = 4  # kernels/linear/gemv.metal: LINEAR_GEMV_ROWS (outputs per simdgroup)
SIMDGROUPS = 2  # kernels/linear/gemv.metal: LINEAR_GEMV_SIMDGROUPS
MAX_ROWS_PER_LAUNCH = 8  # rows of x a threadgroup takes (M); more rows take more threadgroups
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def gemv_reason(x: mx.array, weight: mx.array, scales: mx.array, biases: Optional[mx.array], group_size: int,
                bits: int, mode: str) -> Optional[str]:
    """None when the row GEMV computes x . W^T for these arrays, else why not."""
    if mode != "affine" or bits != 4 or biases is None:
        return f"{mode} {bits}-bit weights (4-bit affine only)"
    if group_size not in GROUP_SIZES:
        return f"group size {group_size} (one of {GROUP_SIZES})"
    k = x.shape[-1]
    if k % 32 or weight.ndim != 2 or weight.shape[1] * 8 != k or scales.shape != (weight.shape[0], k // group_size):
        return f"input {x.shape} for weight {weight.shape} (K a multiple of 32)"
    if x.dtype not in DTYPES or scales.dtype != x.dtype or biases.dtype != x.dtype:
        return f"activations {x.dtype} with scales {scales.dtype} (one of bfloat16, float16, float32, alike)"
    return None


def _launch(name: str, x: mx.array, extra: list, weight: mx.array, scales: mx.array, biases: mx.array,
            group_size: int, backend: Optional[str], init_value) -> mx.array:
    k, n = x.shape[-1], weight.shape[0]
    rows = x.size // k
    m = min(rows, MAX_ROWS_PER_LAUNCH)
    per_group = ROWS * SIMDGROUPS
    spec = KERNELS[name]
    (y,) = get_kernel(spec, backend or op_backend("linear_gemv"))(
        inputs=[x, weight, scales, biases, *extra, spec.pack(K=k, N=n, B=rows)],
        template=[("T", x.dtype), ("M", m), ("GS", group_size)],
        grid=(-(-n // per_group) * SIMDGROUPS * 32, -(-rows // m), 1), threadgroup=(SIMDGROUPS * 32, 1, 1),
        output_shapes=[(*x.shape[:-1], n)], output_dtypes=[x.dtype], init_value=init_value,
    )
    return y


def gemv_q4(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int,
            backend: Optional[str] = None, init_value=None) -> mx.array:
    """x [..., K] . W^T -> [..., N] in one launch; every row of x computed alike (batch invariant).
    x goes in and y comes out in their call shapes (the kernel reads rows of K): a reshape on either side
    would be one more primitive for MLX to evaluate per call, host time a decode step is bound by."""
    return _launch("gemv_q4", x, [], weight, scales, biases, group_size, backend, init_value)


def gemv_q4_rms_norm(x: mx.array, norm_weight: mx.array, eps: float, weight: mx.array, scales: mx.array,
                     biases: mx.array, group_size: int, backend: Optional[str] = None, init_value=None) -> mx.array:
    """RMSNorm(x; norm_weight, eps) [..., K] . W^T -> [..., N] in one launch (the norm with stock's rounding
    points, its sum of squares the kernel's own); batch invariant as ``gemv_q4``."""
    return _launch("gemv_q4_rms_norm", x, [norm_weight, float32_scalar(eps)], weight, scales, biases, group_size,
                   backend, init_value)


def rms_norm_reason(x: mx.array, norm_weight: mx.array) -> Optional[str]:
    """None when ``gemv_q4_rms_norm`` computes the norm of x with this weight, else why not."""
    if norm_weight.shape != (x.shape[-1],) or norm_weight.dtype != x.dtype:
        return f"norm weight {norm_weight.shape} {norm_weight.dtype} for input {x.shape} {x.dtype}"
    return None
