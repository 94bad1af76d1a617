"""MoE layer: the sparse MoE forward the patch layer swaps in, and its dispatch into the kernels.

``sparse_moe_forward(self, x)`` replaces ``Qwen3NextSparseMoeBlock.__call__`` (``self`` is the stock
module; attributes are read at call time, so sharding just works). Its ops (registered by the
package, ``lily_mlx.ops.moe``) run their plain-MLX references (``reference``) or, where the backend
has them and the weights fit, the kernels (``kernels``). With the reference backend the forward is
exactly stock's computation.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.distributed import sum_gradients

from ...core import compiled, lookahead, switches
from ...core.dispatch import op_backend
from ...core.log import log_once
from .reference import (
    combine_reference,
    expert_down_reference,
    expert_up_reference,
    router_reference,
    shared_expert_reference,
    switch_glu_reference,
)

# Stock sorts rows by expert (the grouped GEMM of prefill) from this many assignments on; below it
# runs the gather GEMV of decode. The reference path keeps that split (it is stock's computation);
# the kernel path does not use it (batch invariance, see ``sparse_moe_forward``).
SORT_THRESHOLD = 64


def moe_kernels(block, x: mx.array, residual=None):
    """The block on the kernels (``kernels.sparse_moe_kernels``): x [..., D] -> [..., D] (plus
    ``residual`` when given); None on the reference backend or where the kernels do not apply."""
    if op_backend("moe_grouped_gemm") == "reference":
        return None
    from .kernels import sparse_moe_kernels

    return sparse_moe_kernels(block, x, residual)


def sparse_moe_forward(self, x: mx.array, residual=None) -> mx.array:
    """``Qwen3NextSparseMoeBlock.__call__`` on lily ops. x: [B, T, D] -> [B, T, D]. ``residual`` (from
    ``decoder_layer_forward``; stock's block takes none): ``residual + block(x)`` is returned, the add in
    the combine kernel where it can be (switch ``fused_residual``), else MLX's add after the block."""
    if self.training:  # the kernels have no gradients: training runs stock's ops, stock's gradients
        y = getattr(type(self), "_lily_stock_class", type(self)).__call__(self, x)
        return y if residual is None else residual + y
    if self.sharding_group is not None:
        x = sum_gradients(self.sharding_group)(x)

    # Batch invariance: a token's result must not depend on the tokens sharing the call (other rows
    # of a server batch, padding, the chunk it came in). A path chosen by the call's assignment count
    # (stock's 64) or by T would hand the same token to different arithmetic alone and in a batch
    # (MLX-LM pads a 1-token prompt chunk to the batch's longest one). So wherever the kernels apply
    # they run for every call size, decode included: their per-token arithmetic is fixed (a row's
    # fp32 accumulation is the same in 16- and 32-row tiles). The reference keeps stock's split.
    # The residual goes into the combine only without sharding (all_sum adds the ranks' partial outputs).
    fold = residual if (residual is not None and self.sharding_group is None
                        and switches.is_enabled("fused_residual")) else None
    y = moe_kernels(self, x, fold)
    folded = y is not None and fold is not None
    if y is None:
        inds, scores = router_reference(self.gate(x), self.top_k, self.norm_topk_prob)  # [B, T, k]
        if inds.size >= SORT_THRESHOLD:
            y = combine_reference(switch_glu_reference(self.switch_mlp, x, inds), scores)
            y = y + shared_expert_reference(self, x)
        else:
            # Decode: gate+up+SwiGLU, then down fused with routing weights and the shared expert.
            h = expert_up_reference(self.switch_mlp, x, inds)
            y = expert_down_reference(self.switch_mlp, h, inds, scores, shared_expert_reference(self, x))

    if self.sharding_group is not None:
        y = mx.distributed.all_sum(y, group=self.sharding_group)
    if residual is not None and not folded:
        y = residual + y
    lookahead.after_prefill_layer(y)  # the last op of each decoder layer's work (switch bounded_lookahead)
    return y


def residual_norm(self, x: mx.array, mixed: mx.array):
    """(h, post_attention_layernorm(h)) with h = x + mixed: one kernel (switch ``fused_add_norm``, op
    ``moe_residual_norm``) where it applies, else MLX's add and the norm module (stock's ops)."""
    norm = self.post_attention_layernorm
    backend = op_backend("moe_residual_norm")
    if switches.is_enabled("fused_add_norm") and backend != "reference":
        from .kernels import residual_norm_reason, residual_rms_norm

        reason = residual_norm_reason(norm, x, mixed)
        if reason is None:
            return residual_rms_norm(x, mixed, norm.weight, norm.eps, backend)
        log_once(f"moe_residual_norm:{reason}", f"moe_residual_norm: {reason}, using MLX's add and rms_norm")
    h = x + mixed
    return h, norm(h)


# Switches the four-launch decode path after the mixer (``decode_block_from_norm``) needs besides its own: it
# computes what residual_norm + the decode path of sparse_moe_kernels compute with them on, bit for bit.
_NORM_ROUTER_NEEDS = ("fused_add_norm", "fused_residual", "fused_expert_up", "fused_expert_down", "fused_combine")


def _norm_router_backend(self, x: mx.array, mixed: mx.array):
    """The backend of the four-launch path after the mixer (switch ``fused_norm_router``) for this call, or
    None where it does not apply: a call of the decode path's size (``_topk_in_gemv``) on one kernel backend."""
    from .kernels import _topk_in_gemv, norm_router_reason

    block = self.mlp
    if (block.sharding_group is not None or not switches.is_enabled("fused_norm_router")
            or not all(switches.is_enabled(name) for name in _NORM_ROUTER_NEEDS)
            or not _topk_in_gemv(x.size // x.shape[-1] * block.top_k)):
        return None
    backends = {op_backend("moe_router"), op_backend("moe_residual_norm"), op_backend("moe_grouped_gemm")}
    if len(backends) != 1 or "reference" in backends:
        return None
    backend = backends.pop()
    reason = norm_router_reason(block, self.post_attention_layernorm, x, mixed, backend)
    if reason is not None:
        log_once(f"fused_norm_router:{reason}", f"fused_norm_router: {reason}; norm and router in two launches")
        return None
    return backend


def post_mixer(self, x: mx.array, mixed: mx.array) -> mx.array:
    """A decoder layer's work after its mixer: h = x + mixed, then h + mlp(post_attention_layernorm(h)).
    A decode call on the kernels takes four launches (``kernels.decode_block_from_norm``, switch
    ``fused_norm_router``), else ``residual_norm`` and the MoE block (stock's ops for a stock MLP)."""
    moe = type(self.mlp).__call__ is sparse_moe_forward
    if moe:
        backend = _norm_router_backend(self, x, mixed)
        if backend is not None:
            from .kernels import decode_block_from_norm

            return decode_block_from_norm(self, x, mixed, backend)
    h, normed = residual_norm(self, x, mixed)
    if moe:
        return sparse_moe_forward(self.mlp, normed, residual=h)
    return h + self.mlp(normed)


def _traced_layer(self, x: mx.array, mask, cache):
    """A decoder layer's decode step with its shape-stable parts traced as wholes (switch
    ``compiled_layers``, with ``compiled_decode``, Metal or CUDA): a DeltaNet layer in one trace (input
    norm, mixer, residual add, post-attention norm, MoE block with its residual), an attention layer in
    two around its KV cache. The mixer's family does the tracing (``compiled.LAYER_TRACES``), this layer's
    weights the traces' implicit inputs. None where it does not apply (the layer runs piece by piece)."""
    if not switches.is_enabled("compiled_layers") or type(self.mlp).__call__ is not sparse_moe_forward:
        return None
    if self.mlp.sharding_group is not None or getattr(self.input_layernorm, "weight", x).dtype != x.dtype:
        return None  # (the mixer's input must have x's dtype: its fused projections are chosen from x)
    moe_backends = (op_backend("moe_grouped_gemm"), op_backend("moe_router"), op_backend("moe_residual_norm"))
    norm_kernel = () if moe_backends[2] == "reference" else moe_backends[2:]  # MLX's add + norm trace anywhere
    if not compiled.enabled(*moe_backends[:2], *norm_kernel):
        return None
    mixer = self.linear_attn if self.is_linear else self.self_attn
    trace = compiled.LAYER_TRACES.get(type(mixer).__call__)
    if trace is None:
        return None

    return trace(mixer, x, mask, cache, owner=self, key=(moe_backends, switches.key()), pre=self.input_layernorm,
                 post=lambda x, mixed: post_mixer(self, x, mixed))


def decoder_layer_forward(self, x: mx.array, mask=None, cache=None) -> mx.array:
    """A Qwen3.5/3.6/Next decoder layer (``DecoderLayer`` / ``Qwen3NextDecoderLayer.__call__``): stock's
    computation, except that a lily sparse-MoE block is handed the residual, so that its combine kernel
    adds it (switch ``fused_residual``; same bits as stock's add), that the residual add after the mixer
    and the post-attention norm may be one kernel (``residual_norm``), and that a decode step may replay
    traces of whole layers (``_traced_layer``). x: [B, T, D] -> [B, T, D]."""
    if self.training:
        return getattr(type(self), "_lily_stock_class", type(self)).__call__(self, x, mask, cache)
    if x.shape[1] == 1:
        out = _traced_layer(self, x, mask, cache)
        if out is not None:
            return out
    mixer = self.linear_attn if self.is_linear else self.self_attn
    return post_mixer(self, x, mixer(self.input_layernorm(x), mask, cache))
