"""Attention of the Qwen3.5/3.6 full-attention layers (mlx_lm's ``Qwen3NextAttention``).

Four ops, each a function with a reference in plain MLX ops and one dispatch point into a kernel:

- ``qk_prep``: q_norm, k_norm, partial RoPE and the split of the output gate off ``q_proj``.
- ``prefill_attention``: a chunk of T > 1 queries over cache + chunk (causal or given mask).
- ``decode_attention``: one query row per sequence over the KV cache, GQA.
- ``long_context_attention``: decode at long context, where the write-up splits the KV cache into
  fixed blocks processed in parallel and merges them (``blockwise_attention`` is that algorithm in
  plain MLX; the reference stays stock's primitive so the reference path is token-identical).

``attention_forward(self, x, mask, cache)`` is the whole layer with the stock module as ``self``.
On the reference backend it is exactly stock's computation: the same MLX primitives in the same
order, mlx_lm's own ``scaled_dot_product_attention`` (quantized KV caches included). Kernels:
``attention_decode`` (``attention_kernels``, kernels/attention/decode.metal); the other ops run their
reference.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import mlx.core as mx
from mlx_lm.models import base as mlx_lm_base

from ..core.dispatch import active_backend
from ..core.log import log_once
from ..core.switches import is_enabled
from . import Op, attention_kernels, op_backend, register_op

QK_PREP = register_op(Op(
    "attention_qk_prep", "attention",
    "q/k RMSNorm, partial RoPE and output-gate split of a full-attention layer",
    switches=("fused_qk_prep",),
))
PREFILL = register_op(Op(
    "attention_prefill", "attention",
    "attention of a T > 1 chunk over KV cache + chunk (head dim 256, GQA)",
))
DECODE = register_op(Op(
    "attention_decode", "attention",
    "one query row per sequence over the KV cache (GQA)",
    switches=("coalesced_kv", "gqa_packing"),
    # Simulator only until timed on a GPU: the kernel runs B x Hkv threadgroups (2 per sequence at
    # Qwen3.6's shape), too few to fill a GPU at long context, so it could be slower than stock's
    # decode attention. Add "metal"/"cuda" here once a GPU run shows it pays (docs/attention.md).
    kernel_backends=frozenset({"sim"}),
))
LONG_CONTEXT = register_op(Op(
    "attention_decode_long", "attention",
    "decode attention at long context: fixed KV blocks in parallel, then merged",
    switches=("fixed_block_attention", "coalesced_kv", "gqa_packing"),
))

# Shape rules of the fixed-block path (write-up: >= 32K tokens, head dim 256, 8 query heads per KV
# head; other shapes keep the ordinary decode path). Data, so tuning can change them.
FIXED_BLOCK_MIN_CONTEXT = 32 * 1024
FIXED_BLOCK_HEAD_DIM = 256
FIXED_BLOCK_GQA_FACTOR = 8
FIXED_BLOCK_SIZE = 4096  # KV rows per block; a starting point for tuning

# (op name, backend) -> kernel launcher, filled as kernels land; ops without a row run their reference.
KERNELS: dict = {
    (DECODE.name, backend): attention_kernels.decode_attention_from_cache(backend)
    for backend in DECODE.kernel_backends
}


def _kernel_for(op: Op, unsupported: Optional[str] = None) -> Optional[Callable]:
    """The kernel that runs ``op`` on the active backend, or None for the reference.

    ``unsupported`` names why these shapes/inputs are outside the kernel (logged once)."""
    backend = active_backend()
    if backend == "reference":
        return None
    if op_backend(op.name, backend) == "reference" or (op.name, backend) not in KERNELS:
        return None  # said once, at patch time (lily_mlx.patch_report)
    if unsupported:
        log_once(f"{op.name}:{backend}:{unsupported}", f"{op.name}: {unsupported}, using the reference")
        return None
    return KERNELS[(op.name, backend)]


def is_quantized_kv(keys: Any) -> bool:
    """Quantized KV caches hand out (packed, scales, biases) as a tuple or a list (MLX-LM's
    ``QuantizedKVCache`` and ``KVCache.to_quantized`` differ), plain caches an array."""
    return isinstance(keys, (tuple, list))


def _kv_shape(keys: Any) -> Tuple[int, ...]:
    """[B, Hkv, S, ...] of keys (of the packed part for a quantized cache)."""
    return (keys[0] if is_quantized_kv(keys) else keys).shape


# --- q/k preparation ------------------------------------------------------------------------------

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


def qk_prep(q_proj_out, k_proj_out, v_proj_out, *, n_heads, n_kv_heads, q_norm, k_norm, rope,
            offset=0):
    """q/k preparation; see ``qk_prep_reference`` for shapes. Kernel: ``fused_qk_prep``."""
    kernel = _kernel_for(QK_PREP)
    if kernel is not None:  # pragma: no cover - no kernels yet
        return kernel(q_proj_out, k_proj_out, v_proj_out, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      q_norm=q_norm, k_norm=k_norm, rope=rope, offset=offset,
                      fused=is_enabled("fused_qk_prep"))
    return qk_prep_reference(q_proj_out, k_proj_out, v_proj_out, n_heads=n_heads,
                             n_kv_heads=n_kv_heads, q_norm=q_norm, k_norm=k_norm, rope=rope,
                             offset=offset)


# --- attention over the cache ---------------------------------------------------------------------

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


def _unsupported_kv(keys: Any, mask: Any) -> Optional[str]:
    if is_quantized_kv(keys):
        return "quantized KV cache"
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        return "additive mask"
    return None


def prefill_attention(queries, keys, values, *, scale, mask=None, cache=None):
    """Chunk of L queries over cache + chunk; shapes as ``attention_reference``."""
    kernel = _kernel_for(PREFILL, _unsupported_kv(keys, mask))
    if kernel is not None:  # pragma: no cover
        return kernel(queries, keys, values, scale=scale, mask=mask)
    return attention_reference(queries, keys, values, scale=scale, mask=mask, cache=cache)


def decode_attention(queries, keys, values, *, scale, mask=None, cache=None):
    """One query row (L == 1) over the KV cache. Kernel variants: ``coalesced_kv``, ``gqa_packing``.
    The kernel takes a plain ``KVCache`` without a mask (shape rules: ``attention_kernels``)."""
    kernel = _kernel_for(DECODE, attention_kernels.unsupported_reason(queries, keys, values, mask, cache))
    if kernel is not None:
        return kernel(queries, keys, values, scale=scale, mask=mask, cache=cache,
                      coalesced=is_enabled("coalesced_kv"), gqa_packed=is_enabled("gqa_packing"))
    return attention_reference(queries, keys, values, scale=scale, mask=mask, cache=cache)


def long_context_attention(queries, keys, values, *, scale, mask=None, cache=None):
    """Decode at long context (fixed-block split kernel). Reference: stock's attention."""
    kernel = _kernel_for(LONG_CONTEXT, _unsupported_kv(keys, mask))
    if kernel is not None:  # pragma: no cover
        return kernel(queries, keys, values, scale=scale, mask=mask, block_size=FIXED_BLOCK_SIZE,
                      coalesced=is_enabled("coalesced_kv"), gqa_packed=is_enabled("gqa_packing"))
    return attention_reference(queries, keys, values, scale=scale, mask=mask, cache=cache)


def decode_path(kv_length: int, head_dim: int, gqa_factor: int) -> str:
    """``"fixed_block"`` or ``"ordinary"``: which decode path a shape takes (switch + shape rules)."""
    if (
        is_enabled("fixed_block_attention")
        and kv_length >= FIXED_BLOCK_MIN_CONTEXT
        and head_dim == FIXED_BLOCK_HEAD_DIM
        and gqa_factor == FIXED_BLOCK_GQA_FACTOR
    ):
        return "fixed_block"
    return "ordinary"


def attention(queries, keys, values, *, scale, mask=None, cache=None):
    """Attention of prepared queries over the (updated) KV cache: picks the op by shape."""
    _, n_heads, L, head_dim = queries.shape
    if L != 1:
        return prefill_attention(queries, keys, values, scale=scale, mask=mask, cache=cache)
    _, n_kv_heads, kv_length = _kv_shape(keys)[:3]
    path = decode_path(kv_length, head_dim, n_heads // n_kv_heads)
    op = long_context_attention if path == "fixed_block" else decode_attention
    return op(queries, keys, values, scale=scale, mask=mask, cache=cache)


def blockwise_attention(
    queries: mx.array,  # [B, H, L, D]
    keys: mx.array,  # [B, Hkv, S, D]
    values: mx.array,  # [B, Hkv, S, D]
    *,
    scale: float,
    mask: Optional[mx.array] = None,  # bool or additive, broadcastable to [B, H, L, S]
    block_size: int = FIXED_BLOCK_SIZE,
) -> mx.array:  # [B, H, L, D]
    """The fixed-block algorithm in plain MLX: each KV block gives a partial softmax (its max, sum
    and unnormalised output, fp32), then blocks merge by rescaling to the global max. Same function
    as ``attention_reference`` up to rounding; the model the long-context kernel follows."""
    B, n_heads, L, D = queries.shape
    n_kv_heads, S = keys.shape[1], keys.shape[2]
    groups = n_heads // n_kv_heads
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


# --- the layer ------------------------------------------------------------------------------------

def attention_forward(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    """``Qwen3NextAttention.__call__`` with the stock module as ``self`` (attributes read now, so a
    sharded module's per-rank head counts apply). x: [B, L, hidden] -> [B, L, hidden]."""
    if self.training:  # the kernels have no gradients: training runs stock's ops, stock's gradients
        return getattr(type(self), "_lily_stock_class", type(self)).__call__(self, x, mask=mask, cache=cache)
    B, L, _ = x.shape
    q_proj_out = self.q_proj(x)  # [B, L, H * 2D]
    k_proj_out, v_proj_out = self.k_proj(x), self.v_proj(x)  # [B, L, Hkv * D]
    queries, keys, values, gate = qk_prep(
        q_proj_out, k_proj_out, v_proj_out,
        n_heads=self.num_attention_heads, n_kv_heads=self.num_key_value_heads,
        q_norm=self.q_norm, k_norm=self.k_norm, rope=self.rope,
        offset=cache.offset if cache is not None else 0,
    )
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    output = attention(queries, keys, values, scale=self.scale, mask=mask, cache=cache)
    output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)  # [B, L, H * D]
    return self.o_proj(output * mx.sigmoid(gate))
