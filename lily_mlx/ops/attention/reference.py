"""Plain-MLX references of the attention op family: the oracle for the kernels and the path that
runs where no kernel applies.

- ``qk_prep_reference``: stock's q_norm, k_norm, partial RoPE and output-gate split, op for op.
- ``attention_reference``: stock's attention, mlx_lm's ``scaled_dot_product_attention`` (quantized KV
  caches included); the reference of the prefill, decode and long-context ops alike, so the reference
  path is token-identical to stock.
- ``blockwise_attention``: the write-up's fixed-block long-context algorithm in plain MLX (the model
  the long-context kernel follows; same function as ``attention_reference`` up to rounding).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import mlx.core as mx
from mlx_lm.models import base as mlx_lm_base

from .kernels import fixed_block_rows


def qk_prep_reference(
    q_proj_out: mx.array,  # [B, L, H * 2D] (queries and gate interleaved per head)
    k_proj_out: mx.array,  # [B, L, Hkv * D]
    v_proj_out: mx.array,  # [B, L, Hkv * D]
    *,
    n_heads: int,
    n_kv_heads: int,
    q_norm: Callable,  # nn.RMSNorm over D
    k_norm: Callable,
    rope: Callable,  # rope(x, offset=...) over [B, heads, L, D], partial (dims < D)
    offset: Any = 0,  # int, or [B] int32 array (BatchKVCache)
) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
    """Stock's preparation, op for op. Returns queries [B, H, L, D], keys and values
    [B, Hkv, L, D] (keys rotated, values only transposed) and the output gate [B, L, H * D]."""
    B, L, _ = q_proj_out.shape
    queries, gate = mx.split(q_proj_out.reshape(B, L, n_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, L, -1)
    queries = q_norm(queries).transpose(0, 2, 1, 3)
    keys = k_norm(k_proj_out.reshape(B, L, n_kv_heads, -1)).transpose(0, 2, 1, 3)
    values = v_proj_out.reshape(B, L, n_kv_heads, -1).transpose(0, 2, 1, 3)
    queries = rope(queries, offset=offset)
    keys = rope(keys, offset=offset)
    return queries, keys, values, gate


def attention_reference(
    queries: mx.array,  # [B, H, L, D]
    keys: Any,  # [B, Hkv, S, D] (S = cached + L), or a quantized (packed, scales, biases) tuple
    values: Any,
    *,
    scale: float,
    mask: Any = None,  # None | "causal" | bool or additive array broadcastable to [B, H, L, S]
    cache: Any = None,
) -> mx.array:  # [B, H, L, D]
    """Stock's attention: mlx_lm's ``scaled_dot_product_attention`` (quantized caches included).
    The reference of the prefill, decode and long-context ops alike."""
    return mlx_lm_base.scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=scale, mask=mask
    )


def blockwise_attention(
    queries: mx.array,  # [B, H, L, D]
    keys: mx.array,  # [B, Hkv, S, D]
    values: mx.array,  # [B, Hkv, S, D]
    *,
    scale: float,
    mask: Optional[mx.array] = None,  # bool or additive, broadcastable to [B, H, L, S]
    block_size: Optional[int] = None,  # rows per block (default: the kernels' schedule for S)
) -> mx.array:  # [B, H, L, D]
    """The fixed-block algorithm in plain MLX: each KV block gives a partial softmax (its max, sum
    and unnormalised output, fp32), then blocks merge by rescaling to the global max. Same function
    as ``attention_reference`` up to rounding; the model the long-context kernel follows."""
    B, n_heads, L, D = queries.shape
    n_kv_heads, S = keys.shape[1], keys.shape[2]
    groups = n_heads // n_kv_heads
    block_size = block_size or fixed_block_rows(S)
    # Query heads of one KV head side by side: [B, Hkv, groups * L, D]; KV rows read once per group.
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv_heads, groups * L, D)
    k, v = keys.astype(mx.float32), values.astype(mx.float32)
    if mask is not None:
        mask = mx.broadcast_to(mask, (B, n_heads, L, S)).reshape(B, n_kv_heads, groups * L, S)
    maxes, sums, outs = [], [], []
    for start in range(0, S, block_size):
        stop = min(start + block_size, S)
        s = q @ k[:, :, start:stop].swapaxes(-1, -2)  # [B, Hkv, groups * L, blk]
        if mask is not None:
            m = mask[..., start:stop]
            s = mx.where(m, s, -mx.inf) if m.dtype == mx.bool_ else s + m.astype(mx.float32)
        m_blk = mx.max(s, axis=-1, keepdims=True)
        m_safe = mx.where(mx.isinf(m_blk), 0.0, m_blk)  # a fully masked block contributes nothing
        p = mx.exp(s - m_safe)
        maxes.append(m_blk)
        sums.append(mx.sum(p, axis=-1, keepdims=True))
        outs.append(p @ v[:, :, start:stop])
    m_all = mx.max(mx.concatenate(maxes, axis=-1), axis=-1, keepdims=True)
    total, out = 0.0, 0.0
    for m_blk, l_blk, o_blk in zip(maxes, sums, outs):
        w = mx.where(mx.isinf(m_blk), 0.0, mx.exp(m_blk - m_all))
        total = total + w * l_blk
        out = out + w * o_blk
    out = out / total
    return out.reshape(B, n_heads, L, D).astype(queries.dtype)
