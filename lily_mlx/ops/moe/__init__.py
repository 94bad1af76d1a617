"""MoE op family for Qwen3-Next / Qwen3.5-MoE / Qwen3.6 sparse MoE blocks. Importing it registers
its ops in ``lily_mlx.core.dispatch`` and gives ``sparse_moe_forward``, the forward the patch layer
swaps in.

Modules: ``layer`` (the forward and its dispatch), ``kernels`` (kernel launchers, routing schedule,
shape rules; ``kernels/moe/routing.metal``, ``kernels/moe/gemm.metal``), ``reference`` (plain-MLX
references: stock's primitives in stock's order).

Ops, each with a plain-MLX reference and, where written, kernels:

- ``moe_router``: softmax, top-k, renormalise (reference only: stock's exact primitives).
- ``moe_routing``: histogram, prefix scan, scatter + inverse map, block map (switch ``gpu_routing``).
- ``moe_grouped_gemm``: grouped 4-bit expert GEMMs, gate+up+SwiGLU and down, and the weighted
  combine (switches ``fused_dequant``, ``adaptive_tile``, ``fused_combine``). Where they apply they
  run for every call size, decode included, so that a token's result is the same alone and in any
  batch (batch invariance).
- ``moe_expert_up`` / ``moe_expert_down``: the decode GEMV path of stock (references; they run
  where the grouped kernels do not; switches ``row_gemv``, ``fused_expert_up``, ``fused_expert_down``
  for GEMV kernels not yet written, which must keep the grouped kernels' per-token arithmetic).
"""

from __future__ import annotations

from ...core.dispatch import Op, register_op
from .layer import sparse_moe_forward  # noqa: F401

KERNEL_BACKENDS = frozenset({"metal", "sim", "cuda"})

register_op(Op("moe_router", "moe", "Router: softmax (precise), top-k by argpartition, renormalise."))
register_op(Op(
    "moe_routing", "moe",
    "Routing bookkeeping: per-expert histogram, prefix-scan offsets, scatter into expert order, "
    "inverse map, block map of row tiles.",
    switches=("gpu_routing",), kernel_backends=KERNEL_BACKENDS,
))
register_op(Op(
    "moe_grouped_gemm", "moe",
    "Grouped 4-bit (affine, group 64) expert GEMMs (prefill and decode): gate+up+SwiGLU and down, then the "
    "routing-weighted sum over each token's experts.",
    switches=("fused_dequant", "adaptive_tile", "fused_combine"), kernel_backends=KERNEL_BACKENDS,
))
register_op(Op(
    "moe_expert_up", "moe", "Decode expert GEMV: gate and up projections with SwiGLU.",
    switches=("row_gemv", "fused_expert_up"),
))
register_op(Op(
    "moe_expert_down", "moe",
    "Decode expert GEMV: down projection with routing weights and the sigmoid-gated shared expert.",
    switches=("row_gemv", "fused_expert_down"),
))
