"""Attention kernels, host side: the decode kernel's dispatch table, shape rules (``supports``) and
launch geometry, and the shape rules of the fixed-block long-context path.

The kernel lives in ``kernels/attention/decode.metal`` (layout notes there and in docs/attention.md). The
host function has the signature of ``reference.attention_reference`` for one query row, plus the
switch states, ``backend`` (``metal``, ``sim`` or ``cuda``) and ``init_value`` (tests poison
outputs with it).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import mlx.core as mx

from ...core.kernel_registry import KernelSpec, float32_scalar, get_kernel

# Dispatch table: one row per kernel of kernels/attention/decode.metal.
_FILE = "attention/decode.metal"
KERNELS = {
    spec.name: spec
    for spec in (
        KernelSpec("attention_decode", _FILE, ("q", "k", "v", "scale", "params"), ("out",),
                   params=("Hkv", "G", "S", "S_cap")),
        KernelSpec("attention_decode_block_partials", _FILE, ("q", "k", "v", "scale", "params"),
                   ("part_max", "part_sum", "part_acc"), params=("Hkv", "G", "S", "S_cap", "NB", "BR")),
        KernelSpec("attention_decode_merge_blocks", _FILE, ("part_max", "part_sum", "part_acc", "params"), ("out",),
                   params=("NB",)),
    )
}

# Backends the decode kernel runs on (the ``attention_decode`` op's kernel backends). Simulator only
# until timed on a GPU: the kernel runs B x Hkv threadgroups (2 per sequence at Qwen3.6's shape), too
# few to fill a GPU at long context, so it could be slower than stock's decode attention. Add
# "metal"/"cuda" here once a GPU run shows it pays (docs/attention.md).
DECODE_BACKENDS = frozenset({"sim"})

# Shape rules of the fixed-block path (write-up: >= 32K tokens, head dim 256, 8 query heads per KV
# head; other shapes keep the ordinary decode path). Data, so tuning can change them.
FIXED_BLOCK_MIN_CONTEXT = 32 * 1024
FIXED_BLOCK_HEAD_DIM = 256
FIXED_BLOCK_GQA_FACTOR = 8
FIXED_BLOCK_SIZE = 4096  # KV rows per block; a starting point for tuning

# Simdgroups per threadgroup: the KV rows are dealt round-robin over them (a tuning knob; no GPU
# timing yet). Threadgroup memory: SIMDGROUPS * D fp32 (8 KiB at D = 256).
DECODE_SIMDGROUPS = 4
SUPPORTED_HEAD_DIMS = (64, 128, 256)
KV_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
MAX_HEADS_PER_THREADGROUP = 8  # registers: 2 * G * D / 32 fp32 per lane with gqa_packing


def supports(queries: mx.array, keys: Any, values: Any, mask: Any = None,
             cache: Any = None) -> Optional[str]:
    """None when the decode kernel can run these inputs; else why it cannot.

    queries: [B, Hq, L, D]; keys, values: [B, Hkv, S, D] from a plain mlx_lm ``KVCache``."""
    from mlx_lm.models.cache import KVCache

    if isinstance(keys, (tuple, list)):  # QuantizedKVCache: (packed, scales, biases)
        return "quantized KV cache"
    if mask is not None:
        return "a mask"
    if type(cache) is not KVCache:  # rotating, quantized, batch caches or none at all
        return f"cache {type(cache).__name__} is not a plain KVCache"
    B, Hq, L, D = queries.shape
    if L != 1:
        return f"L={L} query rows (decode takes one)"
    if keys.ndim != 4 or values.shape != keys.shape or keys.shape[0] != B or keys.shape[3] != D:
        return f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match queries {tuple(queries.shape)}"
    if D not in SUPPORTED_HEAD_DIMS:
        return f"head dim {D} not in {SUPPORTED_HEAD_DIMS}"
    Hkv = keys.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        return f"Hq={Hq} not a multiple of Hkv={Hkv}"
    if Hq // Hkv > MAX_HEADS_PER_THREADGROUP:
        return f"{Hq // Hkv} query heads per KV head (at most {MAX_HEADS_PER_THREADGROUP})"
    if queries.dtype not in KV_DTYPES or keys.dtype != queries.dtype or values.dtype != queries.dtype:
        return f"dtypes q={queries.dtype}, k={keys.dtype}, v={values.dtype} not supported"
    if keys.shape[2] == 0:
        return "an empty KV cache"
    if cache.keys is None or cache.offset != keys.shape[2]:
        return "keys are not the cache's live rows"
    return None


class _Geometry(NamedTuple):
    Hkv: int
    G: int
    S: int
    S_cap: int
    sg: int  # simdgroups per threadgroup
    threadgroups: int  # per block: B * Hkv * G / GT
    template: list


def _geometry(queries, keys, kv_length, gqa_packed: bool, coalesced: bool) -> _Geometry:
    """Sizes, threadgroups and template arguments shared by the decode kernels."""
    B, Hq, _, D = queries.shape
    Hkv, S_cap = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    heads_per_tg = G if gqa_packed else 1
    sg = DECODE_SIMDGROUPS
    template = [("InT", queries.dtype), ("D", D), ("GT", heads_per_tg), ("SG", sg), ("COALESCED", int(coalesced))]
    return _Geometry(Hkv, G, S_cap if kv_length is None else kv_length, S_cap, sg, B * Hkv * (G // heads_per_tg),
                     template)


def decode_attention(
    queries: mx.array,  # [B, Hq, 1, D]
    keys: mx.array,  # [B, Hkv, S_cap, D]: rows < kv_length are live
    values: mx.array,  # [B, Hkv, S_cap, D]
    *,
    scale: float,
    kv_length: Optional[int] = None,  # live rows S (default: all of S_cap)
    gqa_packed: bool = True,
    coalesced: bool = True,
    backend: str,
    init_value=None,
) -> mx.array:  # [B, Hq, 1, D] in queries' dtype
    """Single-query attention over a contiguous KV buffer, GQA (query head h reads KV head h // G)."""
    g = _geometry(queries, keys, kv_length, gqa_packed, coalesced)
    (out,) = get_kernel(KERNELS["attention_decode"], backend)(
        inputs=[queries, keys, values, float32_scalar(scale),
                KERNELS["attention_decode"].pack(Hkv=g.Hkv, G=g.G, S=g.S, S_cap=g.S_cap)],
        template=g.template, grid=(32, g.sg, g.threadgroups),
        threadgroup=(32, g.sg, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
        init_value=init_value,
    )
    return out


def decode_attention_fixed_blocks(
    queries: mx.array,  # [B, Hq, 1, D]
    keys: mx.array,  # [B, Hkv, S_cap, D]: rows < kv_length are live
    values: mx.array,
    *,
    scale: float,
    block_rows: int,
    kv_length: Optional[int] = None,
    gqa_packed: bool = True,
    coalesced: bool = True,
    backend: str,
    init_value=None,
) -> mx.array:  # [B, Hq, 1, D]
    """``decode_attention`` with the KV rows cut into fixed blocks of ``block_rows`` processed by
    separate threadgroups (fp32 partials), then merged: two launches."""
    B, Hq, _, D = queries.shape
    g = _geometry(queries, keys, kv_length, gqa_packed, coalesced)
    nb = -(-g.S // block_rows)
    partials = KERNELS["attention_decode_block_partials"]
    part_max, part_sum, part_acc = get_kernel(partials, backend)(
        inputs=[queries, keys, values, float32_scalar(scale),
                partials.pack(Hkv=g.Hkv, G=g.G, S=g.S, S_cap=g.S_cap, NB=nb, BR=block_rows)],
        template=g.template, grid=(32, g.sg, g.threadgroups * nb),
        threadgroup=(32, g.sg, 1),
        output_shapes=[(B * Hq, nb), (B * Hq, nb), (B * Hq, nb, D)],
        output_dtypes=[mx.float32] * 3,
        init_value=init_value,
    )
    merge = KERNELS["attention_decode_merge_blocks"]
    (out,) = get_kernel(merge, backend)(
        inputs=[part_max, part_sum, part_acc, merge.pack(NB=nb)],
        template=[("InT", queries.dtype), ("D", D)],
        grid=(D, B * Hq, 1),
        threadgroup=(min(D, 256), 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
        init_value=init_value,
    )
    return out


def decode_attention_fixed_blocks_from_cache(backend: str):
    """The launcher ``layer.long_context_attention`` dispatches to on ``backend`` (cache read in place)."""

    def launch(queries, keys, values, *, scale, mask=None, cache=None, block_size=FIXED_BLOCK_SIZE,
               coalesced=True, gqa_packed=True):
        return decode_attention_fixed_blocks(queries, cache.keys, cache.values, scale=scale, block_rows=block_size,
                                             kv_length=keys.shape[2], gqa_packed=gqa_packed, coalesced=coalesced,
                                             backend=backend)

    return launch


def decode_attention_from_cache(backend: str):
    """The launcher ``layer.decode_attention`` dispatches to on ``backend``: reads the cache's
    whole buffer (no copy of the live slice) with the live length as a parameter."""

    def launch(queries, keys, values, *, scale, mask=None, cache=None, coalesced=True, gqa_packed=True):
        return decode_attention(queries, cache.keys, cache.values, scale=scale, kv_length=keys.shape[2],
                                gqa_packed=gqa_packed, coalesced=coalesced, backend=backend)

    return launch
