"""MoE op family for Qwen3-Next / Qwen3.5-MoE / Qwen3.6 sparse MoE blocks.

``sparse_moe_forward(self, x)`` replaces ``Qwen3NextSparseMoeBlock.__call__`` (``self`` is the stock
module; attributes are read at call time, so sharding just works). It is split into ops, each with
a plain-MLX reference (``moe_reference``) and, where written, kernels (``moe_kernels``,
``kernels/moe/routing.metal``, ``kernels/moe/gemm.metal``):

- ``moe_router``: softmax, top-k, renormalise (reference only: stock's exact primitives).
- ``moe_routing``: histogram, prefix scan, scatter + inverse map, block map (switch ``gpu_routing``).
- ``moe_grouped_gemm``: grouped 4-bit expert GEMMs, gate+up+SwiGLU and down, and the weighted
  combine (switches ``fused_dequant``, ``adaptive_tile``, ``fused_combine``). Where they apply they
  run for every call size, decode included, so that a token's result is the same alone and in any
  batch (batch invariance).
- ``moe_expert_up`` / ``moe_expert_down``: the decode GEMV path of stock (references; they run
  where the grouped kernels do not; switches ``row_gemv``, ``fused_expert_up``, ``fused_expert_down``
  for GEMV kernels not yet written, which must keep the grouped kernels' per-token arithmetic).

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
# runs the gather GEMV of decode. The reference path keeps that split (it is stock's computation);
# the kernel path does not use it (batch invariance, see ``sparse_moe_forward``).
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


def routed_experts_kernels(switch_mlp, x: mx.array, inds: mx.array, scores: mx.array):
    """Routed experts weighted and summed by the kernels (any number of tokens): x [..., D],
    inds [..., k] -> [..., D]; None on the reference backend or where the kernels do not apply."""
    if op_backend("moe_grouped_gemm") == "reference":
        return None
    from .moe_kernels import routed_experts_combined_kernel

    return routed_experts_combined_kernel(switch_mlp, x, inds, scores)


def sparse_moe_forward(self, x: mx.array) -> mx.array:
    """``Qwen3NextSparseMoeBlock.__call__`` on lily ops. x: [B, T, D] -> [B, T, D]."""
    if self.training:  # the kernels have no gradients: training runs stock's ops, stock's gradients
        return getattr(type(self), "_lily_stock_class", type(self)).__call__(self, x)
    if self.sharding_group is not None:
        x = sum_gradients(self.sharding_group)(x)

    inds, scores = router_reference(self.gate(x), self.top_k, self.norm_topk_prob)  # [B, T, k]

    # Batch invariance: a token's result must not depend on the tokens sharing the call (other rows
    # of a server batch, padding, the chunk it came in). A path chosen by the call's assignment count
    # (stock's 64) or by T would hand the same token to different arithmetic alone and in a batch
    # (MLX-LM pads a 1-token prompt chunk to the batch's longest one). So wherever the kernels apply
    # they run for every call size, decode included: their per-token arithmetic is fixed (a row's
    # fp32 accumulation is the same in 16- and 32-row tiles). The reference keeps stock's split.
    y = routed_experts_kernels(self.switch_mlp, x, inds, scores)
    if y is not None:
        y = y + shared_expert_reference(self, x)
    elif inds.size >= SORT_THRESHOLD:
        y = combine_reference(switch_glu_reference(self.switch_mlp, x, inds), scores)
        y = y + shared_expert_reference(self, x)
    else:
        # Decode: gate+up+SwiGLU, then down fused with routing weights and the shared expert.
        h = expert_up_reference(self.switch_mlp, x, inds)
        y = expert_down_reference(self.switch_mlp, h, inds, scores, shared_expert_reference(self, x))

    if self.sharding_group is not None:
        y = mx.distributed.all_sum(y, group=self.sharding_group)
    return y
