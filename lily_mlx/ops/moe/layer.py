"""MoE layer: the sparse MoE forward the patch layer swaps in, and its dispatch into the kernels.

``sparse_moe_forward(self, x)`` replaces ``Qwen3NextSparseMoeBlock.__call__`` (``self`` is the stock
module; attributes are read at call time, so sharding just works). Its ops (registered by the
package, ``lily_mlx.ops.moe``) run their plain-MLX references (``reference``) or, where the backend
has them and the weights fit, the kernels (``kernels``). With the reference backend the forward is
exactly stock's computation.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients

from ...core import compiled, generation, lookahead, projections, step_trace, switches
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


def post_mixer(self, x: mx.array, mixed: mx.array, next_weight: Optional[mx.array] = None):
    """A decoder layer's work after its mixer: h = x + mixed, then h + mlp(post_attention_layernorm(h)).
    A decode call on the kernels takes three or four launches (``kernels.decode_block_from_norm``, switch
    ``fused_norm_router``; three with ``fused_down_combine``), else ``residual_norm`` and the MoE block (stock's
    ops for a stock MLP). ``next_weight`` (the next layer's input-norm weight, from ``_next_norm``): on that path
    the combine (then a launch of its own after the down GEMV) also returns that norm of the output, and (out, n)
    is returned; elsewhere the output alone."""
    moe = type(self.mlp).__call__ is sparse_moe_forward
    if moe:
        backend = _norm_router_backend(self, x, mixed)
        if backend is not None:
            from .kernels import decode_block_from_norm

            nxt = None if next_weight is None else (next_weight, _successor(self).input_layernorm.eps)
            return decode_block_from_norm(self, x, mixed, backend, next_norm=nxt)
    h, normed = residual_norm(self, x, mixed)
    if moe:
        return sparse_moe_forward(self.mlp, normed, residual=h)
    return h + self.mlp(normed)


# The next layer's input norm computed by this layer's combine kernel (switch fused_next_norm) reaches the next
# layer by identity: this layer leaves (its output, the norm of it) on its successor (linked at patch time,
# ``link_successors``), and the successor uses the norm only when it is called with that very array.
_SUCCESSOR = "_lily_successor"
_HANDED = "_lily_handed_norm"


def link_successors(layers) -> None:
    """Link each lily decoder layer of ``layers`` (a model's layer list, in call order) to the next one."""
    for layer, successor in zip(layers, layers[1:]):
        if type(layer).__call__ is decoder_layer_forward and type(successor).__call__ is decoder_layer_forward:
            layer.__dict__[_SUCCESSOR] = successor  # in __dict__: not a child module, not in parameters()


def unlink_successors(layers) -> None:
    for layer in layers:
        layer.__dict__.pop(_SUCCESSOR, None)
        layer.__dict__.pop(_HANDED, None)


def _successor(self):
    return self.__dict__.get(_SUCCESSOR)


def _next_norm(self, x: mx.array) -> Optional[mx.array]:
    """The weight of the next layer's input RMSNorm when this decode call computes it in its combine kernel
    (switch ``fused_next_norm``: the successor is a lily decoder layer with an ``nn.RMSNorm`` of x's dtype and
    width), else None. Whether the call takes the four-launch path is ``post_mixer``'s to decide."""
    successor = _successor(self)
    if successor is None or x.shape[1] != 1 or not switches.is_enabled("fused_next_norm"):
        return None
    norm = successor["input_layernorm"]  # (item access: a module's children are its items; no __getattr__)
    weight = norm.get("weight") if isinstance(norm, dict) else None
    if weight is None:
        return None
    fits = self.__dict__.setdefault("_lily_next_norm_fits", {})  # per activation dtype and width, once
    key = (x.dtype, x.shape[-1], weight.dtype)
    ok = fits.get(key)
    if ok is None:
        from .kernels import residual_norm_reason

        ok = fits[key] = residual_norm_reason(norm, x, x) is None
    return weight if ok else None


def _handed_norm(self, x: mx.array) -> Optional[mx.array]:
    """The input norm of x that the previous layer left for this one, if it left one for this very x."""
    handed = self.__dict__.pop(_HANDED, None)
    return handed[1] if handed is not None and handed[0] is x else None


def _hand_over(self, out):
    """``out`` of a layer's forward: the output, or (output, next layer's input norm of it), which is left on
    the successor for its call with that output. Returns the output."""
    if isinstance(out, (tuple, list)):  # (a trace returns its outputs as a list)
        out, normed = out
        _successor(self).__dict__[_HANDED] = (out, normed)
    return out


def _traced_layer(self, x: mx.array, mask, cache, normed=None, next_weight=None):
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

    # The handed norm and the next layer's norm weight are trace inputs (the latter is not the owner's).
    pre_args = () if normed is None else (normed,)
    post_args = () if next_weight is None else (next_weight,)
    key = (moe_backends, switches.key(), normed is not None,
           None if next_weight is None else (next_weight.shape, next_weight.dtype))
    replayable = switches.is_enabled("layer_replay")
    step = trace(mixer, x, mask, cache, owner=self, key=key,
                 pre=_use_handed if normed is not None else lambda x: _input_norm(self, x),
                 post=lambda x, mixed, *w: post_mixer(self, x, mixed, *w), pre_args=pre_args, post_args=post_args,
                 replayable=replayable)
    if step is None:
        return None
    if step.replay is not None:
        self.__dict__[_REPLAY] = (_replay_signature(x, cache, normed, next_weight), step.replay)
    return step.out


# A decode step's path is chosen once: after a step through the layer traces, the next calls with the same
# signature (nothing chosen from has changed: switch states and dispatch plan, the input's shape and dtype,
# the cache's type, the norms handed in) replay it (``compiled.LayerStep``): the traces called directly,
# none of the per-call checks above (host time: ~45 us of Python a layer on the H200's host, 1.85 ms of a step's
# 4.13 ms build before; docs/decode.md).
_REPLAY = "_lily_layer_replay"


def _replay_signature(x: mx.array, cache, normed, next_weight) -> tuple:
    return (generation.current(), x.shape, x.dtype, type(cache), normed is None,
            None if next_weight is None else (next_weight.shape, next_weight.dtype))


def _replayed(self, x: mx.array, mask, cache, normed, next_weight):
    """The layer's output from its stored replay, or None (no replay for this call's signature, or the
    replay found the cache or the weights changed: nothing was done)."""
    stored = self.__dict__.get(_REPLAY)
    if stored is None or stored[0] != _replay_signature(x, cache, normed, next_weight):
        out = None  # (a switch change moves the generation: layer_replay off never gets here)
    elif compiled.replaying_only() and not getattr(stored[1], "shape_stable", False):
        out = None
    else:
        out = stored[1](x, mask, cache, () if normed is None else (normed,),
                        () if next_weight is None else (next_weight,))
    if out is None and compiled.replaying_only():
        raise compiled.NotReplayed(f"{type(self).__name__}: no shape-stable replay for this step")
    return out


def _use_handed(x: mx.array, normed: mx.array) -> mx.array:
    return normed


def _input_norm(self, x: mx.array) -> mx.array:
    """``self.input_layernorm(x)``; for a decode call with switch ``gemv_input_norm`` on and an ``nn.RMSNorm`` (or the
    watch-only lily class ``constant_weights`` gives it), noted for the projections that take it
    (``projections.note_input_norm``: the dense GEMV may compute the norm itself, and MLX then never evaluates this
    array)."""
    norm = self.input_layernorm
    normed = norm(x)
    if x.shape[1] == 1 and compiled.stock_type(norm) is nn.RMSNorm and switches.is_enabled("gemv_input_norm"):
        projections.note_input_norm(normed, x, norm)
    return normed


def decoder_layer_forward(self, x: mx.array, mask=None, cache=None) -> mx.array:
    """A Qwen3.5/3.6/Next decoder layer (``DecoderLayer`` / ``Qwen3NextDecoderLayer.__call__``): stock's
    computation, except that a lily sparse-MoE block is handed the residual, so that its combine kernel
    adds it (switch ``fused_residual``; same bits as stock's add), that the residual add after the mixer
    and the post-attention norm may be one kernel (``residual_norm``), that a decode call's combine may
    compute the next layer's input norm (``fused_next_norm``: left on the successor, used by it for this
    output), and that a decode step may replay traces of whole layers (``_traced_layer``). x: [B, T, D] ->
    [B, T, D]."""
    if self.training:
        return getattr(type(self), "_lily_stock_class", type(self)).__call__(self, x, mask, cache)
    normed = _handed_norm(self, x)
    next_weight = _next_norm(self, x)
    if x.shape[1] == 1:
        out = _replayed(self, x, mask, cache, normed, next_weight)
        if out is None:
            out = _traced_layer(self, x, mask, cache, normed, next_weight)
            projections.forget_input_norm()
        if out is not None:
            return _hand_over(self, out)
    mixer = self.linear_attn if self.is_linear else self.self_attn
    mixed = mixer(normed if normed is not None else _input_norm(self, x), mask, cache)
    projections.forget_input_norm()
    return _hand_over(self, post_mixer(self, x, mixed, next_weight))


def text_model_forward(self, inputs: mx.array, cache=None, input_embeddings=None) -> mx.array:
    """A Qwen3.5/3.6/Next text model (``TextModel`` / ``Qwen3Next Model.__call__``: embedding, decoder layers, final
    norm, lm_head): stock's code, except that a one-token decode step may replay one trace of the whole step
    (switch ``step_trace``, ``lily_mlx.core.step_trace``). inputs [B, L] token ids -> logits [B, L, vocab]."""
    if step_trace.applies(self, inputs, cache, input_embeddings):
        out = step_trace.decode_step(self, inputs, cache)
        if out is not None:
            return out
    return step_trace.stock_call(self, inputs, cache, input_embeddings)
