"""MoE op family for Qwen3-Next / Qwen3.5-MoE / Qwen3.6 sparse MoE blocks. Importing it registers
its ops in ``lily_mlx.core.dispatch`` and gives ``sparse_moe_forward``, the forward the patch layer
swaps in.

Modules: ``layer`` (the forward and its dispatch), ``kernels`` (kernel launchers, routing schedule,
shape rules; ``kernels/moe/routing.metal``, ``kernels/moe/gemm.metal``), ``reference`` (plain-MLX
references: stock's primitives in stock's order).

Ops, each with a plain-MLX reference and, where written, kernels:

- ``moe_router``: router logits (quantised GEMV), softmax, top-k, renormalise, and the shared
  expert's sigmoid gate, in one kernel (switch ``fused_expert_up``); reference: stock's ops.
- ``moe_routing``: histogram, prefix scan, scatter + inverse map, block map (switch ``gpu_routing``).
- ``moe_grouped_gemm``: grouped 4-bit expert GEMMs, gate+up+SwiGLU and down, with the shared expert as
  one more expert (switch ``fused_expert_down``), and the weighted combine (switches ``fused_dequant``,
  ``adaptive_tile``, ``fused_combine``). Where they apply they run for every call size, decode
  included, so that a token's result is the same alone and in any batch (batch invariance).
  Decode calls run the GEMMs' one-row GEMV forms (switch ``row_gemv``), with the same bits.
- ``moe_residual_norm``: the decoder layer's residual add after its mixer and the post-attention RMSNorm
  in one kernel (switch ``fused_add_norm``); reference: MLX's add and ``rms_norm``.
- ``moe_expert_up`` / ``moe_expert_down``: the decode GEMV path of stock (references; they run
  where the grouped kernels do not).
"""

from __future__ import annotations

from ...core.dispatch import Op, register_op
from .layer import decoder_layer_forward, sparse_moe_forward, text_model_forward  # noqa: F401

KERNEL_BACKENDS = frozenset({"metal", "sim", "cuda"})

register_op(Op(
    "moe_router", "moe",
    "Router: quantised router GEMV, softmax (precise), top-k, renormalise; with the shared expert's gate.",
    switches=("fused_expert_up", "split_router", "fused_topk_gemv", "fused_norm_router", "fused_next_norm"), kernel_backends=KERNEL_BACKENDS,
))
register_op(Op(
    "moe_routing", "moe",
    "Routing bookkeeping: per-expert histogram, prefix-scan offsets, scatter into expert order, "
    "inverse map, block map of row tiles.",
    switches=("gpu_routing",), kernel_backends=KERNEL_BACKENDS,
))
register_op(Op(
    "moe_grouped_gemm", "moe",
    "Grouped 4-bit (affine, group 64) expert GEMMs (prefill and decode): gate+up+SwiGLU and down, the "
    "shared expert as one more expert, then the routing-weighted sum over each token's experts.",
    switches=("fused_dequant", "adaptive_tile", "fused_combine", "fused_expert_down", "row_gemv", "fused_down_combine",
              "fused_residual", "register_tiles", "tall_register_blocks", "split_k_gate_up", "direct_down_combine",
              "down_combine_ring", "down_combine_simd_barriers"),
    kernel_backends=KERNEL_BACKENDS,
))
register_op(Op(
    "moe_residual_norm", "moe",
    "The decoder layer's residual add after its mixer and the post-attention RMSNorm before the MoE block, "
    "in one kernel (both outputs).",
    switches=("fused_add_norm",), kernel_backends=KERNEL_BACKENDS,
))
register_op(Op("moe_expert_up", "moe", "Decode expert GEMV (stock's): gate and up projections with SwiGLU."))
register_op(Op(
    "moe_expert_down", "moe",
    "Decode expert GEMV (stock's): down projection with routing weights and the sigmoid-gated shared expert.",
))
