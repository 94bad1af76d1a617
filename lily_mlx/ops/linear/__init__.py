"""Linear op family: the dense quantised projections of a decode step (DeltaNet in/out projections,
attention q/k/v/o, lm_head). Importing it registers its op in ``lily_mlx.core.dispatch`` and gives
``quantized_linear_forward``, the forward the patch layer swaps into MLX's ``nn.QuantizedLinear``.

Modules: ``layer`` (the forward, the fused-projection matmul and their dispatch), ``kernels`` (launcher
and shape rules; ``kernels/linear/gemv.metal``), ``reference`` (MLX's quantised matmul).

- ``linear_gemv``: y = x . W^T for the rows of a decode call (one token per sequence), W 4-bit affine,
  by lily's row GEMV (switch ``dense_gemv``); reference: MLX's quantised matmul. Prefill chunks keep
  MLX's matmul. A trial kernel on every backend (``kernels.GEMV_BACKENDS``: why).
"""

from __future__ import annotations

from ...core import projections
from ...core.dispatch import Op, register_op
from . import kernels
from .layer import gemv_plan, quantized_linear_forward, quantized_matmul  # noqa: F401

projections.QUANTIZED_MATMUL[0] = quantized_matmul  # a layer's fused in-projections take the GEMV too
projections.GEMV_PLAN[0] = gemv_plan

register_op(Op(
    "linear_gemv", "linear",
    "Dense 4-bit affine projection of a decode call's rows (one token per sequence): row GEMV with "
    "vectorised weight loads, four output rows per simdgroup.",
    # gemv_input_norm, fused_in_proj_step and fused_qkv_prep (a DeltaNet in-projection inside its step's kernel, an
    # attention layer's q/k/v projection inside its q/k preparation) act through it
    switches=("dense_gemv", "gemv_input_norm", "fused_in_proj_step", "fused_qkv_prep"),
    kernel_backends=kernels.GEMV_BACKENDS,
    trial_backends=kernels.GEMV_TRIAL_BACKENDS,
))
