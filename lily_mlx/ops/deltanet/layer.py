"""Gated DeltaNet layer: the forwards the patch layer swaps in, and the dispatch of each op to its
kernel or its reference.

``qwen3_5_deltanet_forward`` / ``qwen3_next_deltanet_forward`` have the stock modules' call
signature and take the stock instance as ``self``; they read its attributes at call time, so
sharded (per-rank) head counts just work. On the reference backend they run exactly stock's MLX
primitives in stock's order (``reference``). Otherwise each op (registered by the package,
``lily_mlx.ops.deltanet``) runs its kernel (``kernels``) when the backend has one and the shapes are
supported, else its reference with a one-time log line.

Batch invariance: a token's result must not depend on the call it is in (MLX-LM's batched generator
pads a row's prompt chunk to the batch's longest, and a 1-token chunk alone is a decode-shaped
call). So the conv kernel runs every chunk, and the prefill path (gates, scan, gated norm, y in fp32
between them) and the decode kernels compute a token with the same arithmetic.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import mlx.core as mx
from mlx.nn.layers.distributed import sum_gradients

from ...core import compiled, switches
from ...core.dispatch import op_backend
from ...core.log import log_once
from ...core import projections
from . import reference as ref

# ----------------------------------------------------------------------------------------------
# dispatch


def _kernel_backend(op: str, module) -> Optional[str]:
    """The kernel backend op ``op`` (its name) runs on for this call, or None for the reference."""
    if getattr(module, "training", False):
        return None  # stock trains through the ops; so do we
    backend = op_backend(op)
    return None if backend == "reference" else backend


def _kernels_for(op: str, module, q: mx.array, v: mx.array, state: Optional[mx.array] = None):
    """(kernel module, backend) if op ``op`` (its name) runs a kernel for these shapes, else
    (None, None); the reason for a fallback is logged once."""
    backend = _kernel_backend(op, module)
    if backend is None:
        return None, None
    try:
        from . import kernels as dk
    except ImportError as e:  # kernels module missing from this install
        dk, reason = None, f"kernel host code unavailable ({e})"
    else:
        reason = dk.supports(q, v, state=state) or dk.backend_unavailable_reason(backend)
    if reason is not None:
        log_once(f"{op}:{backend}:{reason}", f"{op}: {reason}; using the reference")
        return None, None
    return dk, backend


def recurrence(module, q, k, v, a, b, z, state, mask):
    """Gates, scan and gated norm: normalised out [B, S, Hv, Dv] and the new state [B, Hv, Dv, Dk].

    q, k: [B, S, Hk, Dk] (normalised); v, z: [B, S, Hv, Dv]; a, b: [B, S, Hv]; state fp32 or None
    (zeros; the kernels then skip reading it).
    """
    norm = module.norm

    if q.shape[1] == 1:
        dk, backend = _kernels_for("deltanet_decode", module, q, v, state)
        if dk is not None:
            return dk.decode(
                q, k, v, a, b, module.A_log, module.dt_bias, state, z, norm.weight, norm.eps, mask,
                fused=switches.is_enabled("fused_recurrent_norm"), backend=backend,
            )

    dk, backend = _kernels_for("deltanet_gates", module, q, v)
    if dk is not None:
        g, beta = dk.gates(a, b, module.A_log, module.dt_bias, backend=backend)
    else:
        g, beta = ref.gates(a, b, module.A_log, module.dt_bias)

    norm_dk, norm_backend = _kernels_for("deltanet_gated_norm", module, q, v)
    dk, backend = _kernels_for("deltanet_scan", module, q, v, state)
    if dk is not None:
        register = switches.is_enabled("register_scan")
        staged = register and switches.is_enabled("staged_scan")
        # y stays fp32 into the gated-norm kernel, as in the decode kernels: a token's output is then
        # the same from a prefill chunk and from a decode step (batch invariance).
        out_dtype = mx.float32 if norm_dk is not None else None
        out, state = dk.scan(q, k, v, g, beta, state, mask, register=register, staged=staged, backend=backend,
                             out_dtype=out_dtype)
    else:
        out, state = ref.scan_stock(q, k, v, g, beta, state, mask, use_kernel=not module.training)

    if norm_dk is not None:
        out = norm_dk.gated_norm(out, z, norm.weight, norm.eps, backend=norm_backend, out_dtype=q.dtype)
    else:
        out = norm(out, z)
    return out, state


# ----------------------------------------------------------------------------------------------
# forwards (stock call signature, stock instance as ``self``)


def _conv_qk_kernel(self, qkv, mask, cache):
    """q, k, v and the new conv state from the conv + q/k-norm kernel, or None (reference path).

    It runs for every chunk, decode (S = 1) and prefill alike: a token's q, k, v then never depend
    on the chunk it came in, so a 1-token prompt chunk alone (a decode-shaped call) and the same
    token padded into a batch's longer chunk get the same bits (batch invariance)."""
    op = "deltanet_conv1d_silu"
    if (backend := _kernel_backend(op, self)) is None:
        return None
    from . import kernels as dk

    conv_state = cache[0] if cache is not None else None
    reason = dk.conv_unsupported_reason(self.conv1d, qkv, self.num_k_heads, self.head_k_dim)
    if reason is None and conv_state is not None and conv_state.dtype != qkv.dtype:
        reason = f"conv state in {conv_state.dtype}, activations in {qkv.dtype}"
    reason = reason or dk.backend_unavailable_reason(backend)
    if reason is not None:
        log_once(f"{op}:{backend}:{reason}", f"{op}: {reason}; using the reference")
        return None
    return dk.conv_qk_norm(
        qkv, conv_state, self.conv1d.weight, mask, self.num_k_heads, self.head_k_dim, self.num_v_heads,
        self.head_v_dim, lengths=cache.lengths if cache is not None else None, backend=backend,
    )


def _conv_step_backend(self) -> Optional[str]:
    """The backend the one-kernel decode conv step runs on (switch ``fused_conv_step``, with ``fused_recurrent_norm``;
    the conv and decode ops on the same kernel backend), or None."""
    if not (switches.is_enabled("fused_conv_step") and switches.is_enabled("fused_recurrent_norm")):
        return None
    backend = _kernel_backend("deltanet_conv1d_silu", self)
    return backend if backend is not None and _kernel_backend("deltanet_decode", self) == backend else None


def _stored_step(cache, step) -> mx.array:
    """``step`` = (out, new conv state, new recurrent state) of a one-token step: the states into the cache, which
    advances one token; returns out."""
    out, conv_state, state = step
    if cache is not None:
        cache[0] = conv_state
        cache[1] = state
        cache.advance(1)
    return out


def _decode_conv_kernel(self, qkv, z, b, a, mask, cache, joint=None):
    """One decode token (S = 1) through ``deltanet_decode_conv_fused`` (switch ``fused_conv_step``, with
    ``fused_recurrent_norm``): (out, new conv state, new recurrent state), or None where the conv
    kernel and the decode kernel(s) run in turn instead. The fused kernel gives the bits of those two
    kernels, so this choice never changes a result (batch invariance holds either way). ``joint``: qkv is
    the fused in-projection's output and z, b, a are None (``kernels.decode_conv``'s ``joint``).

    Decided from switches, backends and shapes only (it runs per call): both ops on the same kernel
    backend, the shapes the fused kernel takes (``decode_conv_unsupported_reason``)."""
    backend = _conv_step_backend(self)
    if backend is None:
        return None
    from . import kernels as dk

    conv_state = cache[0] if cache is not None else None
    state = cache[1] if cache else None
    Hk, Dk, Hv, Dv = self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim
    reason = dk.decode_conv_unsupported_reason(self.conv1d, qkv, Hk, Dk, Hv, Dv, conv_state, state,
                                               channels=None if joint is None else joint[0])
    if reason is None and (reason := dk.backend_unavailable_reason(backend)) is None:
        norm = self.norm
        return dk.decode_conv(
            qkv, conv_state, self.conv1d.weight, mask, a, b, self.A_log, self.dt_bias, state, z, norm.weight,
            norm.eps, Hk, Dk, Hv, Dv, lengths=cache.lengths if cache is not None else None, backend=backend,
            joint=joint,
        )
    # The two-kernel path takes it from here (and logs its own fallbacks, if any).
    log_once(f"deltanet_decode_conv:{backend}:{reason}",
             f"fused_conv_step: {reason}; conv and decode run as separate ops")
    return None


def _decode_from_hidden(self, inputs: mx.array, fused: projections.FusedProjection, mask, cache) -> Optional[mx.array]:
    """A one-token step of a Qwen3.5/3.6 DeltaNet layer straight from its input through ``deltanet_decode_from_hidden``
    (switch ``fused_in_proj_step``), with the cache updated: normalised out [B, 1, Hv, Dv], or None (nothing done)
    where it does not apply. It applies where the decode call would take the linear family's row GEMV for the fused
    in-projection (``projections.GEMV_PLAN``: the trial kernel on, with the layer's input norm inside where that GEMV
    would compute it) and then ``deltanet_decode_conv_fused`` on the same backend: the kernel gives those two launches'
    bits, so this choice never changes a result."""
    if not switches.is_enabled("fused_in_proj_step"):
        return None
    plan = projections.GEMV_PLAN[0](inputs, fused)
    if plan is None:
        return None
    backend, x, norm = plan
    if _conv_step_backend(self) != backend:
        return None
    from . import kernels as dk

    conv_state = cache[0] if cache is not None else None
    state = cache[1] if cache else None
    Hk, Dk, Hv, Dv = self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim
    in_norm_weight = None if norm is None else norm["weight"]
    reason = (dk.decode_conv_unsupported_reason(self.conv1d, inputs, Hk, Dk, Hv, Dv, conv_state, state,
                                                channels=fused.split_at[0])
              or dk.decode_from_hidden_reason(x, fused.weight, fused.scales, fused.biases, fused.group_size,
                                              fused.bits, fused.mode, Hk, Dk, Hv, Dv, in_norm_weight)
              or dk.backend_unavailable_reason(backend))
    if reason is not None:
        log_once(f"fused_in_proj_step:{reason}", f"fused_in_proj_step: {reason}; the in-projection's GEMV, then the "
                 "conv step")
        return None
    return _stored_step(cache, dk.decode_from_hidden(
        x, fused.weight, fused.scales, fused.biases, fused.group_size, conv_state, self.conv1d.weight, mask,
        self.A_log, self.dt_bias, state, self.norm.weight, self.norm.eps, Hk, Dk, Hv, Dv,
        in_norm=None if norm is None else (in_norm_weight, norm.eps),
        lengths=cache.lengths if cache is not None else None, backend=backend))


def _decode_conv_step(self, qkv, z, b, a, mask, cache, joint=None) -> Optional[mx.array]:
    """A one-token step through ``_decode_conv_kernel`` with the cache updated: normalised out [B, 1, Hv, Dv],
    or None (nothing done) where that kernel does not apply."""
    fused = _decode_conv_kernel(self, qkv, z, b, a, mask, cache, joint)
    return None if fused is None else _stored_step(cache, fused)


def _conv_qk_recurrence(self, qkv, z, b, a, mask, cache, B, S, dtype):
    """Shared by both module types from the q|k|v projections on: normalised out [B, S, Hv, Dv]."""
    if S == 1:
        out = _decode_conv_step(self, qkv, z, b, a, mask, cache)
        if out is not None:
            return out

    fused = _conv_qk_kernel(self, qkv, mask, cache)
    if fused is not None:
        q, k, v, conv_state = fused
        if cache is not None:
            cache[0] = conv_state
    else:
        q, k, v = _conv_qk_reference(self, qkv, mask, cache, B, S, dtype)

    state = cache[1] if cache else None
    out, state = recurrence(self, q, k, v, a, b, z, state, mask)

    if cache is not None:
        cache[1] = state
        cache.advance(S)
    return out


def _conv_qk_reference(self, qkv, mask, cache, B, S, dtype):
    """Stock's conv1d + SiLU, conv-state update, head split and q/k normalisation."""
    if cache is not None and cache[0] is not None:
        conv_state = cache[0]
    else:
        conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=dtype)

    conv_input = ref.conv_input_with_state(qkv, conv_state, mask)  # [B, K-1+S, conv_dim]
    if cache is not None:
        cache[0] = ref.next_conv_state(conv_input, self.conv_kernel_size - 1, cache.lengths, S)
    conv_out = ref.conv1d_silu(conv_input, self.conv1d)  # [B, S, conv_dim]

    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
            [self.num_k_heads, self.num_k_heads, self.num_v_heads],
            [self.head_k_dim, self.head_k_dim, self.head_v_dim],
        )
    ]
    q, k = ref.qk_norm(q, k, self.head_k_dim)
    return q, k, v


class _DecodeStates:
    """The cache entries a DeltaNet decode step reads and writes (conv state, recurrent state, lengths),
    as a trace's inputs and outputs; the real cache is updated and advanced around the trace."""

    def __init__(self, conv_state: mx.array, state: mx.array, lengths: Optional[mx.array]):
        self.cache = [conv_state, state]
        self.lengths = lengths

    def __getitem__(self, i):
        return self.cache[i]

    def __setitem__(self, i, value):
        self.cache[i] = value

    def advance(self, n: int) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class DecodeStepParts:
    """A one-token DeltaNet step as a trace's inputs: ``args`` (conv state, recurrent state, then the mask,
    the cache's lengths and the fused in-projection arrays where present) follow the layer input; ``bind``
    turns the trace's placeholders for them back into (mask, states, fused record) for the mixer. The
    fused weights enter as inputs, so a re-prepared record is never replayed stale. ``key``: everything
    besides the input's shape that changes what the step builds."""

    fused: Optional[projections.FusedProjection]
    args: Tuple[mx.array, ...]
    has_mask: bool
    has_lengths: bool
    key: Tuple

    def bind(self, rest):
        rest = list(rest)
        conv_state, state = rest.pop(0), rest.pop(0)
        m = rest.pop(0) if self.has_mask else None
        states = _DecodeStates(conv_state, state, rest.pop(0) if self.has_lengths else None)
        record = None
        if self.fused is not None:
            w, s = rest.pop(0), rest.pop(0)
            record = dataclasses.replace(self.fused, weight=w, scales=s, biases=rest.pop(0) if rest else None)
        return m, states, record


def _step_parts(self, mixer, inputs: mx.array, mask, cache, fused) -> Optional[DecodeStepParts]:
    """The parts of this call's one-token step (switch ``compiled_decode``, kernels on Metal or CUDA), or
    None where the step is not traced."""
    if inputs.shape[1] != 1 or cache is None or cache[0] is None or cache[1] is None or self.training:
        return None
    backends = (op_backend("deltanet_conv1d_silu"), op_backend("deltanet_decode"))
    if not compiled.enabled(*backends):
        return None
    lengths = cache.lengths
    weights = [] if fused is None else [a for a in (fused.weight, fused.scales, fused.biases) if a is not None]
    args = tuple([cache[0], cache[1]] + [a for a in (mask, lengths) if a is not None] + weights)
    key = (mixer, tuple((a.shape, a.dtype) for a in args), mask is None, lengths is None, backends,
           switches.is_enabled("fused_recurrent_norm"), switches.is_enabled("fused_conv_step"),
           self.out_proj.weight.shape, None if fused is None else (fused.names, fused.split_at))
    return DecodeStepParts(fused, args, mask is not None, lengths is not None, key)


def _traced_step(self, mixer, x: mx.array, mask, cache, fused, *, owner, kind, key=(), pre=None, post=None,
                 pre_args=(), post_args=(), replayable=False) -> Optional[compiled.LayerStep]:
    """``post(x, mixer(pre(x, *pre_args)), *post_args)`` for a one-token step through a trace owned by ``owner``
    (``pre`` / ``post`` None: the mixer alone; the args are trace inputs), the states in and out as arrays and
    the cache updated around the trace; None where the step is not traced. ``post`` may return a tuple of
    arrays (returned as a tuple), as the LayerStep's ``out``, with the step's replay if ``replayable``."""
    parts = _step_parts(self, mixer, x, mask, cache, fused)
    if parts is None:
        return None
    n_pre, n_post = len(pre_args), len(post_args)
    # The trace keeps its function (to trace again for new shapes): let it hold the binding, not this call's
    # states (a recurrent state is 2 MB a layer at Qwen3.6 for each row of the batch).
    binding = dataclasses.replace(parts, args=())

    def step(x, *rest):
        with compiled.inline():  # anything the pieces trace or record themselves is part of this trace
            extra_pre, extra_post, rest = rest[:n_pre], rest[n_pre:n_pre + n_post], rest[n_pre + n_post:]
            m, states, record = binding.bind(rest)
            out = mixer(self, pre(x, *extra_pre) if pre is not None else x, m, states, record)
            out = post(x, out, *extra_post) if post is not None else out
        return (*(out if isinstance(out, tuple) else (out,)), states[0], states[1])

    trace_key = (kind, key, x.shape, x.dtype, n_pre, n_post) + parts.key
    outs = compiled.call(owner, trace_key, step, [x, *pre_args, *post_args, *parts.args])
    if outs is None:
        return None
    replay = _step_replay(self, parts, compiled.lookup(owner, trace_key), n_pre, n_post) if replayable else None
    return compiled.LayerStep(_stepped(outs, cache), replay)


def _stepped(outs, cache):
    """A step trace's outputs -> the layer's output(s), the new states into the cache."""
    *outs, cache[0], cache[1] = outs
    cache.advance(1)
    return outs[0] if len(outs) == 1 else tuple(outs)


def _step_replay(self, parts: DecodeStepParts, traced, n_pre: int, n_post: int):
    """The replay of a traced step (``compiled.LayerStep``): the trace called with this call's input, states,
    mask and lengths and the fused in-projection arrays of ``parts``; None (nothing done) where the cache's
    entries or the held projection weights differ from what the trace was made for."""
    if traced is None:
        return None
    fused, has_mask, has_lengths = parts.fused, parts.has_mask, parts.has_lengths
    weights = parts.args[2 + has_mask + has_lengths:]

    def replay(x, mask, cache, pre_args, post_args):
        if len(pre_args) != n_pre or len(post_args) != n_post or (mask is not None) != has_mask or self.training:
            return None
        conv_state, state, lengths = cache[0], cache[1], cache.lengths
        if conv_state is None or state is None or (lengths is not None) != has_lengths:
            return None
        if fused is not None and not projections.holds(self, fused.names, fused.pieces):
            return None
        extra = [a for a in (mask, lengths) if a is not None]  # (as _step_parts orders them)
        return _stepped(traced(x, *pre_args, *post_args, conv_state, state, *extra, *weights), cache)

    return compiled.shape_stable(replay)


def _traced_decode(self, mixer, inputs: mx.array, mask, cache, fused=None) -> Optional[mx.array]:
    """``mixer(self, inputs, mask, cache, fused)`` for a one-token step through its trace (switch
    ``compiled_decode``, kernels on Metal or CUDA), or None where that does not apply."""
    step = _traced_step(self, mixer, inputs, mask, cache, fused, owner=self, kind="mixer")
    return None if step is None else step.out


def _in_projections(self, names: Tuple[str, ...], inputs: mx.array) -> Optional[projections.FusedProjection]:
    """The fused in-projection record for this call (switch ``fused_in_proj``, op ``deltanet_in_proj``;
    calls of a few rows), or None: each projection then runs its own matmul. Same bits either way."""
    return projections.for_call(self, names, inputs, switch="fused_in_proj", op="deltanet_in_proj")


def _qwen3_5_mixer(self, inputs: mx.array, mask, cache, fused=None) -> mx.array:
    B, S, _ = inputs.shape
    if fused is not None:
        if S == 1:  # the in-projection's rows computed inside the step's kernel
            out = _decode_from_hidden(self, inputs, fused, mask, cache)
            if out is not None:
                return self.out_proj(out.reshape(B, S, -1))
        y = projections.matmul(fused, inputs)  # [B, S, qkv | z | b | a]
        if S == 1:  # the decode kernel reads the pieces in place: no split primitive
            out = _decode_conv_step(self, y, None, None, None, mask, cache, joint=fused.split_at)
            if out is not None:
                return self.out_proj(out.reshape(B, S, -1))
        qkv, z, b, a = projections.split(fused, y)
    else:
        qkv, z, b, a = (self.in_proj_qkv(inputs), self.in_proj_z(inputs), self.in_proj_b(inputs),
                        self.in_proj_a(inputs))
    z = z.reshape(B, S, self.num_v_heads, self.head_v_dim)
    out = _conv_qk_recurrence(self, qkv, z, b, a, mask, cache, B, S, inputs.dtype)
    return self.out_proj(out.reshape(B, S, -1))


def _qwen3_next_mixer(self, inputs: mx.array, mask, cache, fused=None) -> mx.array:
    B, S, _ = inputs.shape
    qkvz, ba = projections.run(fused, inputs) if fused is not None else (self.in_proj_qkvz(inputs),
                                                                         self.in_proj_ba(inputs))
    q, k, v, z, b, a = self.fix_query_key_value_ordering(qkvz, ba)
    qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
    out = _conv_qk_recurrence(self, qkv, z, b, a, mask, cache, B, S, inputs.dtype)
    return self.out_proj(out.reshape(B, S, -1))


def qwen3_5_deltanet_forward(self, inputs: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None):
    """``mlx_lm.models.qwen3_5.GatedDeltaNet.__call__``: inputs [B, S, hidden] -> [B, S, hidden]."""
    if self.sharding_group is not None:
        inputs = sum_gradients(self.sharding_group)(inputs)
    fused = _in_projections(self, projections.GROUPS["GatedDeltaNet"], inputs)
    out = _traced_decode(self, _qwen3_5_mixer, inputs, mask, cache, fused)
    if out is None:
        out = _qwen3_5_mixer(self, inputs, mask, cache, fused)
    if self.sharding_group is not None:
        out = mx.distributed.all_sum(out, group=self.sharding_group)
    return out


def qwen3_next_deltanet_forward(self, inputs: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None):
    """``mlx_lm.models.qwen3_next.Qwen3NextGatedDeltaNet.__call__``."""
    fused = _in_projections(self, projections.GROUPS["Qwen3NextGatedDeltaNet"], inputs)
    out = _traced_decode(self, _qwen3_next_mixer, inputs, mask, cache, fused)
    return _qwen3_next_mixer(self, inputs, mask, cache, fused) if out is None else out


# The patched forwards and what a decoder layer's trace needs of each: the mixer and its projection group.
_MIXERS = {
    qwen3_5_deltanet_forward: (_qwen3_5_mixer, "GatedDeltaNet"),
    qwen3_next_deltanet_forward: (_qwen3_next_mixer, "Qwen3NextGatedDeltaNet"),
}


def traced_decode_layer(self, x: mx.array, mask, cache, *, owner, key, pre, post, pre_args=(), post_args=(),
                        replayable=False):
    """``post(x, mixer(pre(x, *pre_args)), *post_args)`` for a one-token step through one trace owned by the
    decoder layer ``owner`` (``compiled.LAYER_TRACES``): the states enter and leave as arrays and the cache is
    updated around the trace. A ``compiled.LayerStep`` (with its replay if ``replayable``), or None where this
    mixer's own step would not be traced (or it is sharded)."""
    entry = _MIXERS.get(type(self).__call__)
    if entry is None or getattr(self, "sharding_group", None) is not None:
        return None
    mixer, group = entry
    fused = _in_projections(self, projections.GROUPS[group], x)
    return _traced_step(self, mixer, x, mask, cache, fused, owner=owner, kind="layer", key=key, pre=pre, post=post,
                        pre_args=pre_args, post_args=post_args, replayable=replayable)


compiled.LAYER_TRACES.update({forward: traced_decode_layer for forward in _MIXERS})
