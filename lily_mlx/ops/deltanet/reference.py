"""Gated DeltaNet references in plain MLX ops: the oracle for the kernels and the fallback path.

Each function uses the MLX primitives stock MLX-LM uses, in the same order, so that a patched model
on the reference backend computes bit for bit what an unpatched one computes:

- ``conv_input_with_state`` / ``next_conv_state`` / ``conv1d_silu``: the depthwise causal conv1d in
  front of the recurrence, its rolling state [B, K-1, conv_dim] and the SiLU after it.
- ``qk_norm``: L2 normalisation of q and k with the ``Dk**-0.5`` read-out scale folded into q.
- ``gates``: decay ``g = exp(-exp(A_log) * softplus(a + dt_bias))`` (fp32) and ``beta = sigmoid(b)``.
- ``scan_ops``: the delta-rule recurrence, one token at a time (prefill and decode).
- ``gated_rms_norm``: ``rms_norm(out) * weight * silu(z)`` (the module's ``norm(out, z)``).

State layout: [B, Hv, Dv, Dk] fp32, as stock, so prompt caches interchange.
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta as _stock_gated_delta
from mlx_lm.models.activations import precise_swiglu

# ----------------------------------------------------------------------------------------------
# conv1d + SiLU with its rolling state


def conv_input_with_state(qkv: mx.array, conv_state: mx.array, mask: Optional[mx.array]) -> mx.array:
    """Masked projections appended to the conv state: [B, K-1+S, conv_dim]."""
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    return mx.concatenate([conv_state, qkv], axis=1)


def next_conv_state(conv_input: mx.array, n_keep: int, lengths: Optional[mx.array], S: int) -> mx.array:
    """The last ``n_keep`` valid rows of ``conv_input`` (per row ``lengths`` when right-padded)."""
    if lengths is not None:
        ends = mx.clip(lengths, 0, S)
        positions = (ends[:, None] + mx.arange(n_keep))[..., None]
        return mx.take_along_axis(conv_input, positions, axis=1)
    return mx.contiguous(conv_input[:, -n_keep:, :])


def conv1d_silu(conv_input: mx.array, conv1d: nn.Module) -> mx.array:
    """Depthwise causal conv (valid padding over the state-prefixed input) then SiLU: [B, S, conv_dim]."""
    return nn.silu(conv1d(conv_input))


# ----------------------------------------------------------------------------------------------
# q/k normalisation


def qk_norm(q: mx.array, k: mx.array, head_k_dim: int, eps: float = 1e-6) -> Tuple[mx.array, mx.array]:
    """L2-normalise q/k ([B, S, Hk, Dk]) and fold the ``Dk**-0.5`` read-out scale into q.

    The l2norm eps is added to sum(x^2); ``mx.fast.rms_norm`` adds it to mean(x^2), hence the rescale.
    """
    inv_scale = head_k_dim**-0.5
    rms_eps = eps * inv_scale**2
    q = (inv_scale**2) * mx.fast.rms_norm(q, None, rms_eps)
    k = inv_scale * mx.fast.rms_norm(k, None, rms_eps)
    return q, k


# ----------------------------------------------------------------------------------------------
# gates


@partial(mx.compile, shapeless=True)
def _decay(A_log, a, dt_bias):
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))


def gates(a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array) -> Tuple[mx.array, mx.array]:
    """(g fp32 [B, S, Hv], beta [B, S, Hv] in b's dtype)."""
    beta = mx.sigmoid(b)
    g = _decay(A_log, a, dt_bias)
    return g, beta


# ----------------------------------------------------------------------------------------------
# the recurrence


@mx.compile
def _step_ops(q, k, v, g, beta, state, mask=None):
    """One token. q, k: [B, H, Dk]; v: [B, H, Dv]; g, beta: [B, H]; state: [B, H, Dv, Dk]."""
    old_state = state
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)  # [B, H, Dv]
    delta = (v - kv_mem) * beta[..., None]  # [B, H, Dv]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)  # [B, H, Dv]
    if mask is not None:
        # A padded position leaves the state as it was (its y is discarded by the caller).
        mask = mx.expand_dims(mask, axis=(1, 2, 3))
        state = mx.where(mask, state, old_state)
    return y.astype(q.dtype), state


def zero_state(B: int, Hv: int, Dv: int, Dk: int) -> mx.array:
    return mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)


def scan_ops(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    mask: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Delta-rule scan, token by token.

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; state: [B, Hv, Dv, Dk] fp32;
    mask: [B, T] bool. Returns y [B, T, Hv, Dv] (q's dtype) and the final state.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = zero_state(B, Hv, Dv, Dk)
    if (repeat := Hv // Hk) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    ys = []
    for t in range(T):
        y, state = _step_ops(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None if mask is None else mask[:, t]
        )
        ys.append(y)
    return mx.stack(ys, axis=1), state


def stock_uses_metal_kernel(k: mx.array, use_kernel: bool) -> bool:
    """Whether stock MLX-LM would run its own Metal kernel for this call (else it runs the ops)."""
    return (
        use_kernel
        and mx.default_device() == mx.gpu
        and mx.metal.is_available()
        and k.shape[-1] >= 32
        and k.shape[-1] % 32 == 0
    )


def scan_stock(q, k, v, g, beta, state, mask=None, *, use_kernel: bool = True):
    """The scan exactly as stock runs it on this machine: MLX-LM's Metal kernel on an Apple GPU,
    ``scan_ops`` elsewhere. The reference backend uses this so that it is token-identical to stock."""
    if state is None:
        B, _, _, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = zero_state(B, Hv, Dv, Dk)
    if stock_uses_metal_kernel(k, use_kernel):
        return _stock_gated_delta.gated_delta_kernel(q, k, v, g, beta, state, mask)
    return scan_ops(q, k, v, g, beta, state, mask)


# ----------------------------------------------------------------------------------------------
# gated RMSNorm


def gated_rms_norm(out: mx.array, z: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``Qwen3NextRMSNormGated``: rms_norm(out) * weight, times silu(z) in fp32, in out's dtype."""
    x = mx.fast.rms_norm(out, weight, eps)
    return precise_swiglu(out, z, x)


def decode_step(q, k, v, a, b, A_log, dt_bias, state, z, norm_weight, norm_eps, mask=None, *, use_kernel=True):
    """One decode token, reference: gates -> recurrent step -> gated RMSNorm.

    q, k: [B, 1, Hk, Dk]; v, z: [B, 1, Hv, Dv]; a, b: [B, 1, Hv]. Returns (normed out, new state).
    """
    g, beta = gates(a, b, A_log, dt_bias)
    out, state = scan_stock(q, k, v, g, beta, state, mask, use_kernel=use_kernel)
    return gated_rms_norm(out, z, norm_weight, norm_eps), state
