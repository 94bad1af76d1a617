"""Gated DeltaNet (30 of Qwen3.6's 40 layers): forwards for the patch layer, op registry, dispatch.

``qwen3_5_deltanet_forward`` / ``qwen3_next_deltanet_forward`` have the stock modules' call
signature and take the stock instance as ``self``; they read its attributes at call time, so
sharded (per-rank) head counts just work. On the reference backend they run exactly stock's MLX
primitives in stock's order (``deltanet_reference``). Otherwise each op runs its kernel
(``deltanet_kernels``) when the backend has one and the shapes are supported, else its reference
with a one-time log line.

Ops (``lily_mlx.ops.OPS``):
- ``deltanet_conv1d_silu``: depthwise causal conv1d + SiLU and the conv-state update; one kernel
  also does ``deltanet_qk_norm`` (L2 normalisation of q/k with the read-out scale), for every chunk.
- ``deltanet_gates``: g = exp(-exp(A_log) softplus(a + dt_bias)) and beta = sigmoid(b).
- ``deltanet_scan``: prefill delta-rule scan; switch ``register_scan`` (off: blockwise scan).
- ``deltanet_decode``: one recurrent step + gated RMSNorm; switch ``fused_recurrent_norm``
  (off: gates, step and norm as separate kernels).
- ``deltanet_gated_norm``: rms_norm(out) * weight * silu(z) after the prefill scan.

Batch invariance: a token's result must not depend on the call it is in (MLX-LM's batched generator
pads a row's prompt chunk to the batch's longest, and a 1-token chunk alone is a decode-shaped
call). So the conv kernel runs every chunk, and the prefill path (gates, scan, gated norm, y in fp32
between them) and the decode kernels compute a token with the same arithmetic.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx.nn.layers.distributed import sum_gradients

from ..core import switches
from ..core.log import log_once
from . import Op, op_backend, register_op
from . import deltanet_reference as ref

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
    switches=("register_scan",), kernel_backends=KERNEL_BACKENDS,
))
OP_DECODE = register_op(Op(
    "deltanet_decode", "deltanet", "Decode step: gates, delta-rule update, read-out, gated RMSNorm.",
    switches=("fused_recurrent_norm",), kernel_backends=KERNEL_BACKENDS,
))
OP_GATED_NORM = register_op(Op(
    "deltanet_gated_norm", "deltanet", "Gated RMSNorm rms_norm(out) * weight * silu(z) after the scan.",
    kernel_backends=KERNEL_BACKENDS,
))


# ----------------------------------------------------------------------------------------------
# dispatch


def _kernel_backend(op: Op, module) -> Optional[str]:
    """The kernel backend ``op`` runs on for this call, or None for the reference."""
    if getattr(module, "training", False):
        return None  # stock trains through the ops; so do we
    backend = op_backend(op.name)
    return None if backend == "reference" else backend


def _kernels_for(op: Op, module, q: mx.array, v: mx.array, state: Optional[mx.array] = None):
    """(kernel module, backend) if ``op`` runs a kernel for these shapes, else (None, None); the
    reason for a fallback is logged once."""
    backend = _kernel_backend(op, module)
    if backend is None:
        return None, None
    try:
        from . import deltanet_kernels as dk
    except ImportError as e:  # kernels module missing from this install
        dk, reason = None, f"kernel host code unavailable ({e})"
    else:
        reason = dk.unsupported_reason(q, v, state=state) or dk.backend_unavailable_reason(backend)
    if reason is not None:
        log_once(f"{op.name}:{backend}:{reason}", f"{op.name}: {reason}; using the reference")
        return None, None
    return dk, backend


def recurrence(module, q, k, v, a, b, z, state, mask):
    """Gates, scan and gated norm: normalised out [B, S, Hv, Dv] and the new state [B, Hv, Dv, Dk].

    q, k: [B, S, Hk, Dk] (normalised); v, z: [B, S, Hv, Dv]; a, b: [B, S, Hv]; state fp32 or None
    (zeros; the kernels then skip reading it).
    """
    norm = module.norm

    if q.shape[1] == 1:
        dk, backend = _kernels_for(OP_DECODE, module, q, v, state)
        if dk is not None:
            return dk.decode(
                q, k, v, a, b, module.A_log, module.dt_bias, state, z, norm.weight, norm.eps, mask,
                fused=switches.is_enabled("fused_recurrent_norm"), backend=backend,
            )

    dk, backend = _kernels_for(OP_GATES, module, q, v)
    if dk is not None:
        g, beta = dk.gates(a, b, module.A_log, module.dt_bias, backend=backend)
    else:
        g, beta = ref.gates(a, b, module.A_log, module.dt_bias)

    norm_dk, norm_backend = _kernels_for(OP_GATED_NORM, module, q, v)
    dk, backend = _kernels_for(OP_SCAN, module, q, v, state)
    if dk is not None:
        register = switches.is_enabled("register_scan")
        # y stays fp32 into the gated-norm kernel, as in the decode kernels: a token's output is then
        # the same from a prefill chunk and from a decode step (batch invariance).
        out_dtype = mx.float32 if norm_dk is not None else None
        out, state = dk.scan(q, k, v, g, beta, state, mask, register=register, backend=backend,
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
    if (backend := _kernel_backend(OP_CONV, self)) is None:
        return None
    from . import deltanet_kernels as dk

    conv_state = cache[0] if cache is not None else None
    reason = dk.conv_unsupported_reason(self.conv1d, qkv, self.num_k_heads, self.head_k_dim)
    if reason is None and conv_state is not None and conv_state.dtype != qkv.dtype:
        reason = f"conv state in {conv_state.dtype}, activations in {qkv.dtype}"
    reason = reason or dk.backend_unavailable_reason(backend)
    if reason is not None:
        log_once(f"{OP_CONV.name}:{backend}:{reason}", f"{OP_CONV.name}: {reason}; using the reference")
        return None
    return dk.conv_qk_norm(
        qkv, conv_state, self.conv1d.weight, mask, self.num_k_heads, self.head_k_dim, self.num_v_heads,
        self.head_v_dim, lengths=cache.lengths if cache is not None else None, backend=backend,
    )


def _conv_qk_recurrence(self, qkv, z, b, a, mask, cache, B, S, dtype):
    """Shared by both module types from the q|k|v projections on: normalised out [B, S, Hv, Dv]."""
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


def qwen3_5_deltanet_forward(self, inputs: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None):
    """``mlx_lm.models.qwen3_5.GatedDeltaNet.__call__``: inputs [B, S, hidden] -> [B, S, hidden]."""
    B, S, _ = inputs.shape
    if self.sharding_group is not None:
        inputs = sum_gradients(self.sharding_group)(inputs)

    qkv = self.in_proj_qkv(inputs)
    z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
    b = self.in_proj_b(inputs)
    a = self.in_proj_a(inputs)

    out = _conv_qk_recurrence(self, qkv, z, b, a, mask, cache, B, S, inputs.dtype)
    out = self.out_proj(out.reshape(B, S, -1))
    if self.sharding_group is not None:
        out = mx.distributed.all_sum(out, group=self.sharding_group)
    return out


def qwen3_next_deltanet_forward(self, inputs: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None):
    """``mlx_lm.models.qwen3_next.Qwen3NextGatedDeltaNet.__call__``."""
    B, S, _ = inputs.shape
    q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(inputs), self.in_proj_ba(inputs))
    qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
    out = _conv_qk_recurrence(self, qkv, z, b, a, mask, cache, B, S, inputs.dtype)
    return self.out_proj(out.reshape(B, S, -1))
