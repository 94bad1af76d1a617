"""Gated DeltaNet (30 of Qwen3.6's 40 layers): the op family. Importing it registers its ops in
``lily_mlx.core.dispatch`` and gives the forwards the patch layer swaps in.

Modules: ``layer`` (the forwards and the dispatch into kernels), ``kernels`` (kernel launchers and
shape rules, ``kernels/deltanet/deltanet.metal``), ``reference`` (plain-MLX references: stock's
primitives in stock's order).

Ops (``lily_mlx.ops.OPS``):
- ``deltanet_conv1d_silu``: depthwise causal conv1d + SiLU and the conv-state update; one kernel
  also does ``deltanet_qk_norm`` (L2 normalisation of q/k with the read-out scale), for every chunk.
- ``deltanet_gates``: g = exp(-exp(A_log) softplus(a + dt_bias)) and beta = sigmoid(b).
- ``deltanet_scan``: prefill delta-rule scan; switch ``register_scan`` (off: blockwise scan), switch
  ``staged_scan`` (the register scan's inputs staged through threadgroup memory; off: read per token).
- ``deltanet_decode``: one recurrent step + gated RMSNorm; switch ``fused_recurrent_norm``
  (off: gates, step and norm as separate kernels); switch ``fused_conv_step``: the conv + q/k-norm
  kernel's work for the token inside the same kernel (one launch per layer and decode token).
- ``deltanet_gated_norm``: rms_norm(out) * weight * silu(z) after the prefill scan.
"""

from __future__ import annotations

from ...core.dispatch import Op, register_op
from .layer import qwen3_5_deltanet_forward, qwen3_next_deltanet_forward  # noqa: F401

KERNEL_BACKENDS = frozenset({"metal", "sim", "cuda"})

OP_CONV = register_op(Op(
    "deltanet_conv1d_silu", "deltanet",
    "Depthwise causal conv1d + SiLU over [conv state; q k v projections], and the conv-state update "
    "(kernel: every chunk, fused with the q/k normalisation).",
    kernel_backends=KERNEL_BACKENDS,
))
OP_QK_NORM = register_op(Op(
    "deltanet_qk_norm", "deltanet",
    "L2 normalisation of q and k, read-out scale folded into q (kernel: inside the conv kernel).",
    kernel_backends=KERNEL_BACKENDS,
))
OP_GATES = register_op(Op(
    "deltanet_gates", "deltanet", "Decay g (fp32) and write strength beta from a, b, A_log, dt_bias.",
    kernel_backends=KERNEL_BACKENDS,
))
OP_SCAN = register_op(Op(
    "deltanet_scan", "deltanet", "Prefill delta-rule scan, fp32 state [B, Hv, Dv, Dk].",
    switches=("register_scan", "staged_scan"), kernel_backends=KERNEL_BACKENDS,
))
OP_DECODE = register_op(Op(
    "deltanet_decode", "deltanet", "Decode step: gates, delta-rule update, read-out, gated RMSNorm.",
    switches=("fused_recurrent_norm", "fused_conv_step"), kernel_backends=KERNEL_BACKENDS,
))
OP_GATED_NORM = register_op(Op(
    "deltanet_gated_norm", "deltanet", "Gated RMSNorm rms_norm(out) * weight * silu(z) after the scan.",
    kernel_backends=KERNEL_BACKENDS,
))
OP_IN_PROJ = register_op(Op(
    "deltanet_in_proj", "deltanet",
    "In-projections of a decode-sized call (in_proj_qkv, _z, _b, _a) as one quantised matmul over their "
    "weights concatenated at patch time (MLX's own kernel; same bits; lily_mlx.core.projections).",
    switches=("fused_in_proj",), kernel_backends=KERNEL_BACKENDS,
))
