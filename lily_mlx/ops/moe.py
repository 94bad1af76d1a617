"""MoE op family for Qwen3-Next / Qwen3.5-MoE / Qwen3.6 sparse MoE blocks.

``sparse_moe_forward(self, x)`` replaces ``Qwen3NextSparseMoeBlock.__call__`` (``self`` is the stock
module; attributes are read at call time, so sharding just works). It is split into ops, each with
a plain-MLX reference (``moe_reference``) and, where written, kernels (``moe_kernels``,
``kernels/moe_routing.metal``, ``kernels/moe_gemm.metal``):

- ``moe_router``: softmax, top-k, renormalise (reference only: stock's exact primitives).
- ``moe_routing``: histogram, prefix scan, scatter + inverse map, block map (switch ``gpu_routing``).
- ``moe_grouped_gemm``: grouped 4-bit expert GEMMs of prefill, gate+up+SwiGLU and down (switches
  ``fused_dequant``, ``adaptive_tile``).
- ``moe_expert_up`` / ``moe_expert_down``: the decode GEMV path (references for now; switches
  ``row_gemv``, ``fused_expert_up``, ``fused_expert_down``).

With the reference backend the forward is exactly stock's computation.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.distributed import sum_gradients

from . import Op, op_backend, register_op
from .moe_reference import (
    combine_reference,
    expert_down_reference,
    expert_up_reference,
    router_reference,
    shared_expert_reference,
    switch_glu_reference,
)

KERNEL_BACKENDS = frozenset({"metal", "sim", "cuda"})

# Stock sorts rows by expert (the grouped GEMM of prefill) from this many assignments on; below it
# runs the gather GEMV of decode. lily-mlx keeps the same split between its prefill and decode paths.
SORT_THRESHOLD = 64

register_op(Op("moe_router", "moe", "Router: softmax (precise), top-k by argpartition, renormalise."))
register_op(Op(
    "moe_routing", "moe",
    "Routing bookkeeping: per-expert histogram, prefix-scan offsets, scatter into expert order, "
    "inverse map, block map of row tiles.",
    switches=("gpu_routing",), kernel_backends=KERNEL_BACKENDS,
))
register_op(Op(
    "moe_grouped_gemm", "moe",
    "Grouped 4-bit (affine, group 64) expert GEMMs of prefill: gate+up+SwiGLU and down, then the "
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


def routed_experts_prefill(switch_mlp, x: mx.array, inds: mx.array, scores: mx.array) -> mx.array:
    """Routed experts of a prefill chunk, weighted and summed: x [..., D], inds [..., k] -> [..., D]."""
    if op_backend("moe_grouped_gemm") != "reference":
        from .moe_kernels import routed_experts_combined_kernel

        y = routed_experts_combined_kernel(switch_mlp, x, inds, scores)
        if y is not None:
            return y
    return combine_reference(switch_glu_reference(switch_mlp, x, inds), scores)


def sparse_moe_forward(self, x: mx.array) -> mx.array:
    """``Qwen3NextSparseMoeBlock.__call__`` on lily ops. x: [B, T, D] -> [B, T, D]."""
    if self.sharding_group is not None:
        x = sum_gradients(self.sharding_group)(x)

    inds, scores = router_reference(self.gate(x), self.top_k, self.norm_topk_prob)  # [B, T, k]

    if inds.size >= SORT_THRESHOLD:
        y = routed_experts_prefill(self.switch_mlp, x, inds, scores)
        y = y + shared_expert_reference(self, x)
    else:
        # Decode: gate+up+SwiGLU, then down fused with routing weights and the shared expert.
        h = expert_up_reference(self.switch_mlp, x, inds)
        y = expert_down_reference(self.switch_mlp, h, inds, scores, shared_expert_reference(self, x))

    if self.sharding_group is not None:
        y = mx.distributed.all_sum(y, group=self.sharding_group)
    return y


def microbench_cases():
    """GPU microbenchmarks at Qwen3.6 shapes; see ``moe_bench.microbench_cases``."""
    from .moe_bench import microbench_cases as cases

    return cases()
