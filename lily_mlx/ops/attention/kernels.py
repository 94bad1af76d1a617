"""Attention kernels, host side: the decode and prefill kernels' dispatch table, shape rules
(``supports``, ``prefill_supports``), launch geometry, the fixed-block schedule (rows per block from
the context length) and the rules that pick the one-pass or the fixed-block path.

The kernels live in ``kernels/attention/decode.metal`` and ``kernels/attention/prefill.metal``
(layout notes there and in docs/attention.md). The host functions have the signature of
``reference.attention_reference`` (one query row for decode, a chunk for prefill), plus the switch
states, ``backend`` (``metal``, ``sim`` or ``cuda``) and ``init_value`` (tests poison outputs with it).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ...core import projections
from ...core.compiled import stock_type
from ...core.kernel_registry import KernelSpec, constant_input, float32_scalar, get_kernel

# Placeholder for the decode kernel's row_start input when every row starts at 0 (never read).
_NO_ROW_START = constant_input((1,), mx.int32)

# Dispatch table: one row per kernel of kernels/attention/decode.metal and prefill.metal.
_FILE = "attention/decode.metal"
_PREFILL_FILE = "attention/prefill.metal"
_QK_PREP_FILE = "attention/qk_prep.metal"
KERNELS = {
    spec.name: spec
    for spec in (
        KernelSpec("attention_decode", _FILE, ("q", "k", "v", "scale", "row_start", "params"), ("out",),
                   params=("Hkv", "G", "S", "S_cap", "has_row_start")),
        KernelSpec("attention_decode_block_partials", _FILE, ("q", "k", "v", "scale", "params"),
                   ("part_max", "part_sum", "part_acc"), params=("Hkv", "G", "S", "S_cap", "NB", "BR")),
        KernelSpec("attention_decode_quantized", _FILE,
                   ("q", "k", "k_scales", "k_biases", "v", "v_scales", "v_biases", "scale", "params"), ("out",),
                   params=("Hkv", "G", "S", "S_cap")),
        KernelSpec("attention_decode_block_partials_quantized", _FILE,
                   ("q", "k", "k_scales", "k_biases", "v", "v_scales", "v_biases", "scale", "params"),
                   ("part_max", "part_sum", "part_acc"), params=("Hkv", "G", "S", "S_cap", "NB", "BR")),
        KernelSpec("attention_decode_block_partials_live", _FILE, ("q", "k", "v", "scale", "last_row", "params"),
                   ("part_max", "part_sum", "part_acc"), params=("Hkv", "G", "S_cap", "NB", "BR")),
        KernelSpec("attention_decode_block_partials_live_quantized", _FILE,
                   ("q", "k", "k_scales", "k_biases", "v", "v_scales", "v_biases", "scale", "last_row", "params"),
                   ("part_max", "part_sum", "part_acc"), params=("Hkv", "G", "S_cap", "NB", "BR")),
        KernelSpec("attention_decode_block_partials_live_tiles", _FILE, ("q", "k", "v", "scale", "last_row", "params"),
                   ("part_max", "part_sum", "part_acc"), params=("B", "Hkv", "S_cap", "NB")),
        KernelSpec("attention_decode_block_partials_rows", _FILE, ("q", "k", "v", "scale", "row_start", "params"),
                   ("part_max", "part_sum", "part_acc"),
                   params=("Hkv", "G", "S", "S_cap", "NB", "TARGET", "MIN_ROWS", "MAX_ROWS")),
        KernelSpec("attention_decode_merge_blocks", _FILE, ("part_max", "part_sum", "part_acc", "params"), ("out",),
                   params=("NB",)),
        KernelSpec("attention_decode_merge_row_blocks", _FILE,
                   ("part_max", "part_sum", "part_acc", "row_start", "params"), ("out",),
                   params=("NB", "Hq", "S", "TARGET", "MIN_ROWS", "MAX_ROWS")),
        KernelSpec("attention_decode_merge_live_blocks", _FILE, ("part_max", "part_sum", "part_acc", "last_row",
                                                                 "params"), ("out",), params=("NB", "BR")),
        KernelSpec("attention_decode_merge_live_blocks_gated", _FILE, ("part_max", "part_sum", "part_acc", "gate",
                                                                       "last_row", "params"), ("out",),
                   params=("NB", "BR")),
        KernelSpec("attention_prefill", _PREFILL_FILE, ("q", "k", "v", "scale", "params"), ("out",),
                   params=("Hkv", "L", "S", "S_cap", "NQ")),
        KernelSpec("attention_qk_prep", _QK_PREP_FILE,
                   ("q_proj", "k_proj", "q_weight", "k_weight", "positions", "eps", "log2_base", "rope_scale",
                    "params"), ("q_out", "k_out", "gate"), params=("H", "Hkv", "L", "q_ld", "k_ld", "k_off")),
        KernelSpec("attention_qk_prep_from_hidden", _QK_PREP_FILE,
                   ("x", "in_norm_weight", "in_norm_eps", "w", "scales", "biases", "q_weight", "k_weight", "positions",
                    "eps", "log2_base", "rope_scale", "params"), ("q_out", "k_out", "v_out", "gate"),
                   params=("B", "H", "Hkv")),
    )
}

# Every attention kernel is written for the GPU backends and the simulator; the *_BACKENDS sets below say
# where each is on by default. On a GPU backend outside its set a kernel is a trial kernel: it runs where
# the machine's tune profile measured it correct and faster (``lily_mlx.core.dispatch``).
WRITTEN_FOR = frozenset({"sim", "metal", "cuda"})
GPU_BACKENDS = frozenset({"metal", "cuda"})

# Backends the decode kernels run on. The one-pass kernel (op ``attention_decode``) runs only
# B * Hkv * G / GT threadgroups (2 per sequence at Qwen3.6's shape) and loses to stock's SDPA on a large
# GPU at every context (H200: 654-783 us at 4K against 148), so it stays off CUDA: there a decode step
# below the fixed-block threshold takes stock's SDPA. The fixed-block kernels (op ``attention_decode_long``)
# pass the kernel tests on the H200 and beat stock's SDPA there from 32K (212 / 191 / 394 us against 384 /
# 627 / 1,196 at 32K / 64K / 128K) but not at 4K (196 against 154): docs/attention.md.
DECODE_BACKENDS = frozenset({"sim"})
LONG_BACKENDS = frozenset({"sim", "cuda"})
# The fixed-block split over a batch's rows (op ``attention_decode_batch``, mlx_lm's BatchKVCache: the server's
# batches), each row's blocks from its own left padding and of its own length's size. On CUDA its tests pass and it
# beats stock's attention with the batch's mask at every measured context (H100, 2026-12-05, 4 rows of S, S / 2,
# S / 4, S / 8 keys, 8 calls: 1,002 / 1,443 / 1,860 / 2,445 us against 1,603 / 7,125 / 14,056 / 26,432 at S = 4K /
# 32K / 64K / 128K). The one-pass kernel was faster at 4K (608 us) and far slower from 32K, but a batch's padded
# length must not choose a row's path: the split serves every length. Metal: a trial kernel until timed there.
BATCH_BACKENDS = frozenset({"sim", "cuda"})
# The decode kernels over a quantized KV cache (op ``attention_decode_quantized``: the one-pass kernel, or the
# fixed blocks where the rule below takes them, reading the packed rows and dequantising them in registers). On CUDA
# the split beats stock's quantized attention at every context (H100, kernel time of 8 calls, 4-bit: 572 / 990 /
# 1,225 / 1,753 us against 808 / 2,140 / 3,894 / 7,246 at 4K / 32K / 64K / 128K; 8-bit 1.19-3.9x), and stock there
# (MLX 0.32.4) raises "No implementation" at some shapes and gave wrong heads at another (docs/attention.md). Metal
# keeps a trial kernel: stock's Metal quantized matmuls have not been timed against it (not through the bridge).
QUANTIZED_DECODE_BACKENDS = frozenset({"sim", "cuda"})
# Backends where a decode step over a quantized cache takes the fixed-block split at every context (with
# fixed_block_attention on), as a plain cache's steps take the split's live-length form on CUDA: the one-pass kernel's
# B * Hkv * G / GT threadgroups (2 a sequence at Qwen3.6) leave a large GPU idle (H200: 654-783 us at 4K against
# stock's 148 for plain caches). Elsewhere (the simulator) the write-up's rule, so both forms run in the tests.
QUANTIZED_SPLIT_BACKENDS = GPU_BACKENDS
QUANTIZED_KV_BITS = (2, 4, 8)  # elements that never straddle two 32-bit words
QUANTIZED_KV_GROUPS = (32, 64, 128)  # MLX's group sizes

# Which decode path a step takes (``layer.decode_path``), on every backend: the write-up's rule, the
# fixed-block path from 32K tokens of the row's context, only at head dim 256 with 8 query heads per KV
# head; below it the one-pass kernel (the simulator, Metal) or stock's SDPA (CUDA). On the H200 the
# crossover lies between the two measured contexts (4K: stock faster; 32K: fixed blocks 1.8x), so 32K
# may be late there: a per-chip threshold is tune's to measure.
FIXED_BLOCK_MIN_CONTEXT = 32 * 1024
FIXED_BLOCK_HEAD_DIM = 256
FIXED_BLOCK_GQA_FACTOR = 8

# Fixed-block schedule: rows per block BR from the row's own context length S (never from the
# batch): the smallest power of two >= S / FIXED_BLOCK_TARGET_BLOCKS, clamped to
# [FIXED_BLOCK_MIN_ROWS, FIXED_BLOCK_MAX_ROWS]. At Qwen3.6's 2 KV heads, B = 1: BR = 64 / 64 / 64 /
# 128 / 256 / 512 rows and 128 / 256 / 512 / 512 / 512 / 512 partial threadgroups at 4K / 8K / 16K /
# 32K / 64K / 128K (about 2 waves of an H200 at 2 resident threadgroups per SM). Each block costs
# G * D * 4 bytes of partials (8 KiB at Qwen3.6) written and read again by the merge: the minimum
# keeps that at <= 1/8 of the block's K/V bytes. Tuning knobs; candidates in lily_dev/attention_bench.py.
FIXED_BLOCK_TARGET_BLOCKS = 256
FIXED_BLOCK_MIN_ROWS = 64
FIXED_BLOCK_MAX_ROWS = 4096
# The live-length form (over a buffer's capacity, kv_write_in_trace) aims at half as many blocks: on the H200
# (lily_dev.live_check, 8 calls an evaluation, 1,024 spare rows, 2026-12-04) twice the rows a block took 4K from
# 733 to 654 us and 128K from 1,362 to 1,314, 32K level (738 / 744).
LIVE_TARGET_BLOCKS = FIXED_BLOCK_TARGET_BLOCKS // 2
# On CUDA the live form's threadgroups hold 8 simdgroups, not 4: at 32K the blocks give ~1 threadgroup an SM (132
# on the H200), one warp a scheduler, and a warp issues an instruction every ~2.7 cycles (Nsight Compute,
# 2026-12-04); 8 simdgroups put two on each scheduler over the same blocks. Partials per decode step, one machine,
# clocks and caches as a run leaves them (docs/results/2026-12-04-h200-positions-wide-threadgroups/): 1,194.1 ->
# 1,024.5 us at 128K; at base clock 613.7 -> 569.9 at 32K. At 4K (capacity 5,120) 258.8 us against 256.6-286.6 in
# three runs of the 4-simdgroup form: no worse. From 0 rows, so that one template serves every context (a decode
# at a new capacity compiles nothing). Not timed below 4K, nor on Apple GPUs (Metal keeps 4).
LIVE_WIDE_MIN_CAPACITY = 0
LIVE_WIDE_SIMDGROUPS = 8
LIVE_WIDE_BACKENDS = frozenset({"cuda"})

# Simdgroups per threadgroup and rows per simdgroup step (R; with double buffering 2 * R rows of K
# and V in flight per simdgroup). GT (rounded up to a power of two) * R <= 32. Registers on sm_90a
# (NVRTC, bf16, D = 256, G = 8): R = 1 / 2 / 4 -> 168 / 216 / 250 per thread, no spills: 12 / 8 / 8
# warps per SM, so R = 4 keeps twice R = 2's bytes in flight at the same occupancy. Threadgroup
# memory: SG * min(GT, 4096 / (SG * D)) * D + 2 * GT * SG fp32 (at most ~16 KiB).
DECODE_SIMDGROUPS = 4
DECODE_ROWS_PER_STEP = 4
# Merge: this many simdgroups (MW) per (head, slice of D), each with MERGE_UNROLL blocks' loads in flight
# (MERGE_UNROLL is the kernel's UNROLL). One MW at every context, so a decode whose cache grows into a new capacity
# compiles no new merge: MW once followed the blocks (2 to 32), and on the H100 (2026-12-05) each new capacity's
# first step compiled a merge variant, ~2.5 s of NVRTC inside the first timed decode of a new length (a Metal
# pipeline compile on a Mac). 8 rather than the 32 that contexts from 4K took: kernel time of the live form with
# MW <= 8 against MW <= 32, 8 calls (lily_dev.live_check): H100 690 / 932 / 1,464 us against 710 / 943 / 1,480 at
# 4K / 32K / 128K (2026-12-05); H200 711 / 720 / 1,410 against 733 / 738 / 1,362 (2026-12-04).
MERGE_SIMDGROUPS = 8
MERGE_UNROLL = 4
SUPPORTED_HEAD_DIMS = (64, 128, 256)
KV_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
MAX_HEADS_PER_THREADGROUP = 8  # registers: 2 * G * D / 32 fp32 per lane with gqa_packing


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def fixed_block_rows(S: int, target_blocks: int = None, min_rows: int = None, max_rows: int = None) -> int:
    """Rows per block for a context of S rows (the schedule above; a function of S alone)."""
    target_blocks = target_blocks or FIXED_BLOCK_TARGET_BLOCKS
    min_rows = min_rows or FIXED_BLOCK_MIN_ROWS
    max_rows = max_rows or FIXED_BLOCK_MAX_ROWS
    return max(min_rows, min(max_rows, _pow2_at_least(-(-S // target_blocks))))


def live_block_rows(S_cap: int) -> int:
    """Rows per block of the live-length form over a buffer of S_cap rows (a function of the capacity alone)."""
    return fixed_block_rows(S_cap, target_blocks=LIVE_TARGET_BLOCKS)


def live_simdgroups(S_cap: int, backend: str) -> int:
    """Simdgroups per partials threadgroup of the live-length form over a buffer of S_cap rows on ``backend``
    (a function of the capacity and backend alone, so never of the batch)."""
    wide = backend in LIVE_WIDE_BACKENDS and S_cap >= LIVE_WIDE_MIN_CAPACITY
    return LIVE_WIDE_SIMDGROUPS if wide else DECODE_SIMDGROUPS


def row_blocks_bound(S: int, target_blocks: int) -> int:
    """The most blocks a batch row of at most S rows can have under the schedule ``fixed_block_rows(L,
    target_blocks)`` (the row partials' stride, ``decode_attention_fixed_blocks_rows``; computed each step, so in
    closed form). Below MIN_ROWS * target a row's blocks are MIN_ROWS long, ceil(L / MIN_ROWS) of them; from there
    the block size keeps L / BR <= target, reaching target at L = BR * target, until it stops at MAX_ROWS."""
    min_rows, max_rows = FIXED_BLOCK_MIN_ROWS, FIXED_BLOCK_MAX_ROWS
    if S < min_rows * target_blocks:
        return -(-S // min_rows)
    return max(target_blocks, -(-S // max_rows))


def batch_simdgroups(backend: str) -> int:
    """Simdgroups per partials threadgroup of a batch's rows (``decode_attention_fixed_blocks_rows``): the live
    form's at any capacity on ``backend``, a function of the backend alone (never of the batch's length)."""
    return LIVE_WIDE_SIMDGROUPS if backend in LIVE_WIDE_BACKENDS else DECODE_SIMDGROUPS


def supports(queries: mx.array, keys: Any, values: Any, mask: Any = None,
             cache: Any = None, batch: bool = False) -> Optional[str]:
    """None when the decode kernel can run these inputs; else why it cannot.

    queries: [B, Hq, L, D]; keys, values: [B, Hkv, S, D] from a plain mlx_lm ``KVCache`` without a mask,
    or (``batch``: the one-pass kernel) from a ``BatchKVCache`` with the bool mask [B, 1, 1, S] it makes for
    one query row (keys from each row's left padding on; the kernel reads the padding from the cache)."""
    from mlx_lm.models.cache import BatchKVCache, KVCache

    if isinstance(keys, (tuple, list)):  # QuantizedKVCache: (packed, scales, biases)
        return "quantized KV cache"
    batched = batch and type(cache) is BatchKVCache
    if batched:
        S = keys.shape[2] if keys.ndim == 4 else -1
        if not (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.shape == (queries.shape[0], 1, 1, S)):
            return "a BatchKVCache with another mask than its own one-row mask"
    elif mask is not None:
        return "a mask"
    elif type(cache) is not KVCache:  # rotating, quantized, batch caches or none at all
        return f"cache {type(cache).__name__} is not a plain KVCache"
    problem = shape_problem(queries, keys, values)
    if problem:
        return problem
    live = cache._idx if batched else cache.offset
    if cache.keys is None or live != keys.shape[2]:
        return "keys are not the cache's live rows"
    return None


def shape_problem(queries: mx.array, keys: mx.array, values: mx.array) -> Optional[str]:
    """None when the decode kernels take queries [B, Hq, 1, D] over keys / values [B, Hkv, S, D] (head dims,
    GQA factor, dtypes); else why not. (``supports`` adds the cache and mask rules.)"""
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
    return None


def quantized_problem(queries: mx.array, keys: Any, values: Any, bits: int, group_size: int) -> Optional[str]:
    """None when the quantized decode kernels take queries [B, Hq, 1, D] over a quantized cache's keys / values,
    each (packed [B, Hkv, S_cap, D * bits / 32] uint32, scales, biases [B, Hkv, S_cap, D / group_size] in the
    queries' dtype); else why not."""
    if not (isinstance(keys, (tuple, list)) and isinstance(values, (tuple, list))):
        return "keys / values are not a quantized cache's (packed, scales, biases)"
    if len(keys) != 3 or len(values) != 3:
        return f"a quantized cache of {len(keys)} arrays a side (the kernels take affine (packed, scales, biases))"
    B, Hq, L, D = queries.shape
    if L != 1:
        return f"L={L} query rows (decode takes one)"
    if bits not in QUANTIZED_KV_BITS:
        return f"{bits}-bit KV cache (the kernels take {QUANTIZED_KV_BITS})"
    if group_size not in QUANTIZED_KV_GROUPS:
        return f"group size {group_size} (the kernels take {QUANTIZED_KV_GROUPS})"
    if D not in SUPPORTED_HEAD_DIMS:
        return f"head dim {D} not in {SUPPORTED_HEAD_DIMS}"
    if D % group_size:
        return f"head dim {D} not a multiple of the group size {group_size}"
    packed = keys[0]
    if packed.ndim != 4 or packed.shape[0] != B or packed.shape[2] == 0:
        return f"packed keys {tuple(packed.shape)} do not match queries {tuple(queries.shape)}"
    Hkv, S_cap = packed.shape[1], packed.shape[2]
    want = {0: ((B, Hkv, S_cap, D * bits // 32), mx.uint32), 1: ((B, Hkv, S_cap, D // group_size), queries.dtype)}
    for side in (keys, values):
        for i, array in enumerate(side):
            shape, dtype = want[min(i, 1)]
            if array.shape != shape or array.dtype != dtype:
                return f"quantized K/V part {tuple(array.shape)} {array.dtype}, not {shape} {dtype}"
    if Hkv == 0 or Hq % Hkv != 0:
        return f"Hq={Hq} not a multiple of Hkv={Hkv}"
    if Hq // Hkv > MAX_HEADS_PER_THREADGROUP:
        return f"{Hq // Hkv} query heads per KV head (at most {MAX_HEADS_PER_THREADGROUP})"
    if queries.dtype not in KV_DTYPES:
        return f"queries of {queries.dtype} not supported"
    return None


def quantized_supports(queries: mx.array, keys: Any, values: Any, mask: Any = None, cache: Any = None) -> Optional[str]:
    """None when the quantized decode kernels run these inputs: one query row over MLX-LM's ``QuantizedKVCache``
    (no mask), ``keys`` / ``values`` its live rows; else why not."""
    from mlx_lm.models.cache import QuantizedKVCache

    if mask is not None:
        return "a mask"
    if type(cache) is not QuantizedKVCache:
        return f"cache {type(cache).__name__} is not a QuantizedKVCache"
    if cache.keys is None:
        return "an empty KV cache"
    problem = quantized_problem(queries, cache.keys, cache.values, cache.bits, cache.group_size)
    if problem:
        return problem
    live = keys[0].shape[2] if isinstance(keys, (tuple, list)) else -1
    if live != cache.offset or live > cache.keys[0].shape[2] or live == 0:
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


def rows_per_step(heads_per_threadgroup: int, requested: Optional[int] = None) -> int:
    """R for GT heads per threadgroup: the requested (default DECODE_ROWS_PER_STEP) power of two,
    lowered until GT (rounded up to a power of two) * R <= 32 (one (head, row) pair per lane)."""
    r = _pow2_at_least(requested or DECODE_ROWS_PER_STEP)
    while r > 1 and _pow2_at_least(heads_per_threadgroup) * r > 32:
        r //= 2
    return r


def _geometry(queries, keys, kv_length, gqa_packed: bool, coalesced: bool, simdgroups: Optional[int] = None,
              rows: Optional[int] = None, heads_per_threadgroup: Optional[int] = None) -> _Geometry:
    """Sizes, threadgroups and template arguments shared by the decode kernels. ``heads_per_threadgroup`` (GT, a
    divisor of G; benchmarks and tests): the query heads of a KV head that share a threadgroup, else G with
    ``gqa_packed`` and 1 without."""
    B, Hq, _, D = queries.shape
    Hkv, S_cap = keys.shape[1], keys.shape[2]
    if kv_length is not None and not 0 < kv_length <= S_cap:
        raise ValueError(f"{kv_length} live rows in a buffer of {S_cap} (the kernels read rows 0 .. live - 1)")
    G = Hq // Hkv
    heads_per_tg = heads_per_threadgroup or (G if gqa_packed else 1)
    if G % heads_per_tg:
        raise ValueError(f"heads per threadgroup {heads_per_tg} does not divide the GQA factor {G}")
    sg = simdgroups or DECODE_SIMDGROUPS
    template = [("InT", queries.dtype), ("D", D), ("GT", heads_per_tg), ("SG", sg),
                ("R", rows_per_step(heads_per_tg, rows)), ("COALESCED", int(coalesced))]
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
    rows: Optional[int] = None,  # rows per simdgroup step (default DECODE_ROWS_PER_STEP)
    row_start: Optional[mx.array] = None,  # [B] int: row b's first live row (left padding), else 0
) -> mx.array:  # [B, Hq, 1, D] in queries' dtype
    """Single-query attention over a contiguous KV buffer, GQA (query head h reads KV head h // G):
    one threadgroup per (KV head, GT heads) over the rows ``row_start[b]`` .. ``kv_length`` - 1."""
    g = _geometry(queries, keys, kv_length, gqa_packed, coalesced, rows=rows)
    has_start = row_start is not None
    (out,) = get_kernel(KERNELS["attention_decode"], backend)(
        inputs=[queries, keys, values, float32_scalar(scale),
                row_start.astype(mx.int32) if has_start else _NO_ROW_START,
                KERNELS["attention_decode"].pack(Hkv=g.Hkv, G=g.G, S=g.S, S_cap=g.S_cap, has_row_start=has_start)],
        template=g.template, grid=(32, g.sg, g.threadgroups),
        threadgroup=(32, g.sg, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
        init_value=init_value,
    )
    return out


class FixedBlockPlan(NamedTuple):
    """Launch geometry of the fixed-block split for one call (``fixed_block_plan``)."""
    block_rows: int  # BR
    blocks: int  # NB = ceil(S / BR) per (sequence, KV head)
    partial_threadgroups: int  # B * Hkv * G / GT * NB
    merge_simdgroups: int  # MW
    merge_lane_floats: int  # MV: fp32 per lane per load (one 8- or 16-byte load)


def fixed_block_plan(S: int, D: int, heads_per_kv_group: int, block_rows: Optional[int] = None,
                     merge_simdgroups: Optional[int] = None,
                     merge_lane_floats: Optional[int] = None) -> FixedBlockPlan:
    """Blocks and merge geometry for S live rows (``heads_per_kv_group``: B * Hkv * G / GT). BR and
    NB depend on S only, MW on nothing, MV on D, so a row's summation order never depends on the batch.
    ``merge_simdgroups`` (MW, default MERGE_SIMDGROUPS) and ``merge_lane_floats`` (MV: 1, 2 or 4; default the
    widest D allows): the merge's geometry, for benchmarks."""
    br = block_rows or fixed_block_rows(S)
    nb = -(-S // br)
    mw = merge_simdgroups or MERGE_SIMDGROUPS
    mv = min(merge_lane_floats or 4, D // 32)
    return FixedBlockPlan(br, nb, heads_per_kv_group * nb, mw, mv)


def decode_attention_fixed_blocks(
    queries: mx.array,  # [B, Hq, 1, D]
    keys: mx.array,  # [B, Hkv, S_cap, D]: rows < kv_length are live
    values: mx.array,
    *,
    scale: float,
    block_rows: Optional[int] = None,  # BR (default: the schedule, fixed_block_rows(S))
    kv_length: Optional[int] = None,
    gqa_packed: bool = True,
    coalesced: bool = True,
    backend: str,
    init_value=None,
    simdgroups: Optional[int] = None,  # per partials threadgroup (default DECODE_SIMDGROUPS)
    rows: Optional[int] = None,  # rows per simdgroup step (default DECODE_ROWS_PER_STEP)
    heads_per_threadgroup: Optional[int] = None,  # GT (default: G with gqa_packed, else 1)
    merge_simdgroups: Optional[int] = None,  # the merge's geometry (fixed_block_plan; benchmarks)
    merge_lane_floats: Optional[int] = None,
) -> mx.array:  # [B, Hq, 1, D]
    """``decode_attention`` with the KV rows cut into blocks of BR rows processed by separate
    threadgroups (fp32 partials), then merged: two launches."""
    g = _geometry(queries, keys, kv_length, gqa_packed, coalesced, simdgroups, rows, heads_per_threadgroup)
    plan = fixed_block_plan(g.S, queries.shape[3], g.threadgroups, block_rows, merge_simdgroups,
                            merge_lane_floats)
    partials = KERNELS["attention_decode_block_partials"]
    return _blocks_then_merge(queries, [keys, values], g, plan, partials, [float32_scalar(scale)],
                              partials.pack(Hkv=g.Hkv, G=g.G, S=g.S, S_cap=g.S_cap, NB=plan.blocks,
                                            BR=plan.block_rows), backend, init_value)


def decode_attention_fixed_blocks_live(
    queries: mx.array,  # [B, Hq, 1, D]
    keys: mx.array,  # [B, Hkv, S_cap, D]: the cache's whole buffer, rows 0 .. last_row live
    values: mx.array,
    last_row: mx.array,  # [1] int32: the last live row (this step's position)
    *,
    scale: float,
    block_rows: Optional[int] = None,  # BR (default: the schedule at the capacity, live_block_rows(S_cap))
    gqa_packed: bool = True,
    coalesced: bool = True,
    backend: str,
    init_value=None,
    merge_simdgroups: Optional[int] = None,  # the merge's geometry (fixed_block_plan; benchmarks)
    merge_lane_floats: Optional[int] = None,
    gate: Optional[mx.array] = None,  # [B, 1, Hq * D]: the layer's output gate, applied by the merge
    simdgroups: Optional[int] = None,  # per partials threadgroup (default live_simdgroups(S_cap, backend))
) -> mx.array:  # [B, Hq, 1, D]; with gate: [B, 1, Hq * D], the attention times sigmoid(gate)
    """``decode_attention_fixed_blocks`` over a buffer whose live length is an array (switch
    ``kv_write_in_trace``): the launch depends on the capacity alone, so one trace serves every step until
    the buffer grows. Blocks cover the capacity (BR from S_cap); the threadgroups of blocks past the live rows
    leave at once and the merge reads only the live blocks. Every row of the batch has the same live length (a
    plain ``KVCache``). With ``gate`` (switch ``fused_output_gate``) the merge also applies the output gate and
    writes the o-projection's input layout."""
    g = _geometry(queries, keys, None, gqa_packed, coalesced, simdgroups or live_simdgroups(keys.shape[2], backend))
    plan = fixed_block_plan(g.S_cap, queries.shape[3], g.threadgroups, block_rows or live_block_rows(g.S_cap),
                            merge_simdgroups, merge_lane_floats)
    partials = KERNELS["attention_decode_block_partials_live"]
    last_row = last_row.astype(mx.int32).reshape(1)
    return _blocks_then_merge(queries, [keys, values], g, plan, partials, [float32_scalar(scale), last_row],
                              partials.pack(Hkv=g.Hkv, G=g.G, S_cap=g.S_cap, NB=plan.blocks, BR=plan.block_rows),
                              backend, init_value, gate, last_row)


def decode_attention_fixed_blocks_rows(
    queries: mx.array,  # [B, Hq, 1, D]
    keys: mx.array,  # [B, Hkv, S_cap, D]: row b's keys are rows row_start[b] .. kv_length - 1
    values: mx.array,
    row_start: mx.array,  # [B] int: row b's first live row (its left padding)
    *,
    scale: float,
    kv_length: Optional[int] = None,  # S: the batch's live rows (default: all of S_cap)
    target_blocks: Optional[int] = None,  # the schedule's aim (default LIVE_TARGET_BLOCKS)
    gqa_packed: bool = True,
    coalesced: bool = True,
    backend: str,
    init_value=None,
    simdgroups: Optional[int] = None,  # per partials threadgroup (default batch_simdgroups(backend))
) -> mx.array:  # [B, Hq, 1, D]
    """The fixed-block split over a batch's rows of their own lengths (mlx_lm's ``BatchKVCache``): row b's keys from
    its left padding on, in blocks of ``fixed_block_rows(S - row_start[b], target_blocks)`` rows counted from there,
    computed in the kernels (no row length reaches the host). A row's output is bit for bit the same sequence's alone
    through ``decode_attention_fixed_blocks`` with that block size and simdgroups: it does not depend on the other
    rows. Two launches; the partials' stride is the most blocks a row of at most S rows can have."""
    target = target_blocks or LIVE_TARGET_BLOCKS
    g = _geometry(queries, keys, kv_length, gqa_packed, coalesced, simdgroups or batch_simdgroups(backend))
    nb = row_blocks_bound(g.S, target)
    # block_rows 0: each row's own, computed in the kernels; the merge's geometry as fixed_block_plan's defaults
    plan = FixedBlockPlan(0, nb, g.threadgroups * nb, MERGE_SIMDGROUPS, min(4, queries.shape[3] // 32))
    schedule = dict(TARGET=target, MIN_ROWS=FIXED_BLOCK_MIN_ROWS, MAX_ROWS=FIXED_BLOCK_MAX_ROWS)
    partials, merge = KERNELS["attention_decode_block_partials_rows"], KERNELS["attention_decode_merge_row_blocks"]
    row_start = row_start.astype(mx.int32)
    return _blocks_then_merge(queries, [keys, values], g, plan, partials, [float32_scalar(scale), row_start],
                              partials.pack(Hkv=g.Hkv, G=g.G, S=g.S, S_cap=g.S_cap, NB=nb, **schedule), backend,
                              init_value, merge=(merge, [row_start, merge.pack(NB=nb, Hq=queries.shape[1], S=g.S,
                                                                               **schedule)]))


def contiguous_lane_elements(D: int, dtype) -> int:
    """The COALESCED template argument of the quantized decode kernels: 1 where the coalesced layout gives each lane
    contiguous elements (D / 32 elements in one load of at most 16 bytes: the 16-bit types, fp32 up to D = 128),
    else 0."""
    return int((D // 32) * dtype.size <= 16)


def _quantized_geometry(queries, keys, values, bits: int, group_size: int, kv_length: Optional[int], gqa_packed: bool,
                        simdgroups: Optional[int] = None, rows: Optional[int] = None) -> _Geometry:
    """``_geometry`` of the quantized launchers, over the packed keys, with BITS and GROUP in the template; a
    ValueError naming what the kernels do not take (``quantized_problem``)."""
    problem = quantized_problem(queries, keys, values, bits, group_size)
    if problem:
        raise ValueError(f"quantized decode attention: {problem}")
    coalesced = bool(contiguous_lane_elements(queries.shape[3], queries.dtype))
    g = _geometry(queries, keys[0], kv_length, gqa_packed, coalesced, simdgroups, rows)
    return g._replace(template=g.template + [("BITS", bits), ("GROUP", group_size)])


def decode_attention_quantized(
    queries: mx.array,  # [B, Hq, 1, D]
    keys: Tuple[mx.array, mx.array, mx.array],  # packed [B, Hkv, S_cap, D * bits / 32] uint32, scales, biases
    values: Tuple[mx.array, mx.array, mx.array],  # the same for V; rows < kv_length are live
    *,
    scale: float,
    bits: int,
    group_size: int,
    kv_length: Optional[int] = None,  # live rows S (default: all of S_cap)
    gqa_packed: bool = True,
    fixed_blocks: bool = False,  # the fixed-block split (partials + merge) instead of the one-pass kernel
    block_rows: Optional[int] = None,  # BR of the split (default: the schedule, fixed_block_rows(S))
    backend: str,
    init_value=None,
    rows: Optional[int] = None,  # rows per simdgroup step (default DECODE_ROWS_PER_STEP)
) -> mx.array:  # [B, Hq, 1, D] in queries' dtype
    """``decode_attention`` (or with ``fixed_blocks`` ``decode_attention_fixed_blocks``) over an MLX-LM
    ``QuantizedKVCache``'s buffers: each K/V row read as its packed words, scale and bias, dequantised in fp32
    (scale * q + bias) where it is used; softmax and accumulation in fp32 as the plain kernels."""
    D = queries.shape[3]
    g = _quantized_geometry(queries, keys, values, bits, group_size, kv_length, gqa_packed, rows=rows)
    kv_inputs = [*keys, *values]
    if fixed_blocks:
        plan = fixed_block_plan(g.S, D, g.threadgroups, block_rows)
        partials = KERNELS["attention_decode_block_partials_quantized"]
        return _blocks_then_merge(queries, kv_inputs, g, plan, partials, [float32_scalar(scale)],
                                  partials.pack(Hkv=g.Hkv, G=g.G, S=g.S, S_cap=g.S_cap, NB=plan.blocks,
                                                BR=plan.block_rows), backend, init_value)
    spec = KERNELS["attention_decode_quantized"]
    (out,) = get_kernel(spec, backend)(
        inputs=[queries, *kv_inputs, float32_scalar(scale), spec.pack(Hkv=g.Hkv, G=g.G, S=g.S, S_cap=g.S_cap)],
        template=g.template, grid=(32, g.sg, g.threadgroups), threadgroup=(32, g.sg, 1),
        output_shapes=[queries.shape], output_dtypes=[queries.dtype], init_value=init_value,
    )
    return out


def decode_attention_quantized_live(
    queries: mx.array,  # [B, Hq, 1, D]
    keys: Tuple[mx.array, mx.array, mx.array],  # a QuantizedKVCache's whole buffers: rows 0 .. last_row live
    values: Tuple[mx.array, mx.array, mx.array],
    last_row: mx.array,  # [1] int32: the last live row (this step's position)
    *,
    scale: float,
    bits: int,
    group_size: int,
    gqa_packed: bool = True,
    backend: str,
    init_value=None,
    gate: Optional[mx.array] = None,  # [B, 1, Hq * D]: the layer's output gate, applied by the merge
    block_rows: Optional[int] = None,  # BR (default: the schedule at the capacity, live_block_rows(S_cap))
) -> mx.array:  # [B, Hq, 1, D]; with gate: [B, 1, Hq * D]
    """``decode_attention_fixed_blocks_live`` over a ``QuantizedKVCache``'s buffers (``kv_write_in_trace`` with
    ``--kv-bits``): blocks and threadgroups from the capacity alone, the live length read from ``last_row``, each row
    dequantised where it is used as in ``decode_attention_quantized``."""
    g = _quantized_geometry(queries, keys, values, bits, group_size, None, gqa_packed,
                            simdgroups=live_simdgroups(keys[0].shape[2], backend))
    plan = fixed_block_plan(g.S_cap, queries.shape[3], g.threadgroups, block_rows or live_block_rows(g.S_cap))
    partials = KERNELS["attention_decode_block_partials_live_quantized"]
    last_row = last_row.astype(mx.int32).reshape(1)
    return _blocks_then_merge(queries, [*keys, *values], g, plan, partials, [float32_scalar(scale), last_row],
                              partials.pack(Hkv=g.Hkv, G=g.G, S_cap=g.S_cap, NB=plan.blocks, BR=plan.block_rows),
                              backend, init_value, gate, last_row)


def decode_attention_quantized_from_cache(backend: str):
    """The launcher ``layer.quantized_decode_attention`` dispatches to on ``backend``: reads the
    ``QuantizedKVCache``'s whole buffers (no copy of the live slices) with the live length as a parameter."""

    def launch(queries, keys, values, *, scale, mask=None, cache=None, gqa_packed=True, fixed_blocks=False):
        return decode_attention_quantized(queries, tuple(cache.keys), tuple(cache.values), scale=scale,
                                          bits=cache.bits, group_size=cache.group_size, kv_length=keys[0].shape[2],
                                          gqa_packed=gqa_packed, fixed_blocks=fixed_blocks, backend=backend)

    return launch


# The matrix-tile form of the live partials (kernels/attention/decode.metal, attention_decode_block_tiles): a
# candidate, not a product path (benchmarks and tests call it by name). One simdgroup per block of TILE_BLOCK_ROWS
# rows, TILE_SIMDGROUPS blocks a threadgroup. Needs the decode kernels' shapes (``shape_problem``: head dims, matching
# dtypes and shapes; the merge it shares takes D in SUPPORTED_HEAD_DIMS), G = 8 (the heads are a tile's rows), a
# 16-bit type and a buffer of at least 8 rows.
TILE_SIMDGROUPS = 4
TILE_BLOCK_ROWS = 128


def tile_scratch_bytes(D: int, block_rows: int, dtype, staged: bool = False) -> int:
    """Threadgroup memory a simdgroup of the matrix-tile partials uses (AttentionTileScratch in decode.metal)."""
    ld = block_rows + 16
    size = dtype.size
    floats = -(-(max(8 * ld, 8 * (D + 8) * size // 4) + (8 * ld + 64) * size // 4) // 4) * 4  # 16-byte aligned
    return 4 * (floats + (8 * (D + 8) * size // 4 if staged else 0))


def tiles_problem(queries: mx.array, keys: mx.array, values: mx.array) -> Optional[str]:
    """None when the matrix-tile partials (and the merge after them) take these shapes; else why not."""
    problem = shape_problem(queries, keys, values)
    if problem:
        return problem
    if queries.shape[1] != 8 * keys.shape[1]:
        return f"G = {queries.shape[1] // keys.shape[1]} query heads a KV head (the tiles need 8)"
    if queries.dtype not in (mx.bfloat16, mx.float16):
        return f"{queries.dtype} (the tiles need a 16-bit type)"
    if keys.shape[2] < 8:
        return f"a buffer of {keys.shape[2]} rows (the tiles need >= 8)"
    return None


def decode_attention_tiles_live(
    queries: mx.array,  # [B, Hq, 1, D], Hq = 8 Hkv
    keys: mx.array,  # [B, Hkv, S_cap, D]: the cache's whole buffer, rows 0 .. last_row live
    values: mx.array,
    last_row: mx.array,  # [1] int32
    *,
    scale: float,
    backend: str,
    block_rows: Optional[int] = None,  # BRM, a multiple of 8 (default TILE_BLOCK_ROWS)
    simdgroups: Optional[int] = None,  # blocks per threadgroup (default TILE_SIMDGROUPS, fewer if over 32 KiB)
    staged: bool = False,  # K and V rows through threadgroup memory (16-byte loads) instead of tiles from memory
    init_value=None,
) -> mx.array:  # [B, Hq, 1, D]
    """``decode_attention_fixed_blocks_live`` with matrix-tile partials (one simdgroup a block), then the same
    merge. Its own bits (another summation order, weights rounded to the input type as the prefill kernel's)."""
    problem = tiles_problem(queries, keys, values)
    if problem:
        raise ValueError(f"matrix-tile decode attention: {problem}")
    B, Hq, _, D = queries.shape
    Hkv, S_cap = keys.shape[1], keys.shape[2]
    brm = block_rows or TILE_BLOCK_ROWS
    sg = simdgroups or TILE_SIMDGROUPS
    while simdgroups is None and sg > 1 and sg * tile_scratch_bytes(D, brm, queries.dtype, staged) > 32 * 1024:
        sg //= 2  # long blocks: fewer of them a threadgroup (Apple's 32 KiB)
    if brm % 8:
        raise ValueError(f"block rows {brm} is not a multiple of 8")
    if sg * tile_scratch_bytes(D, brm, queries.dtype, staged) > 32 * 1024:
        raise ValueError(f"{sg} simdgroups of {brm} block rows at D = {D} need more than 32 KiB of threadgroup memory")
    plan = fixed_block_plan(S_cap, D, B * Hkv, brm)
    partials = KERNELS["attention_decode_block_partials_live_tiles"]
    last_row = last_row.astype(mx.int32).reshape(1)
    part_max, part_sum, part_acc = get_kernel(partials, backend)(
        inputs=[queries, keys, values, float32_scalar(scale), last_row,
                partials.pack(B=B, Hkv=Hkv, S_cap=S_cap, NB=plan.blocks)],
        template=[("InT", queries.dtype), ("D", D), ("SG", sg), ("BRM", brm), ("STAGED", int(staged))],
        grid=(32 * (-(-(B * Hkv * plan.blocks) // sg)), sg, 1), threadgroup=(32, sg, 1),
        output_shapes=[(B * Hq, plan.blocks), (B * Hq, plan.blocks), (B * Hq, plan.blocks, D)],
        output_dtypes=[mx.float32] * 3,
        init_value=init_value,
    )
    return _merge_partials(queries, part_max, part_sum, part_acc, plan, backend, init_value, None, last_row)


def _blocks_then_merge(queries, kv_inputs: list, g: _Geometry, plan: FixedBlockPlan, partials: KernelSpec,
                       scalars: list, params: mx.array, backend: str, init_value,
                       gate: Optional[mx.array] = None, last_row: Optional[mx.array] = None,
                       merge: Optional[Tuple[KernelSpec, list]] = None) -> mx.array:
    """The two launches of the fixed-block split: ``partials`` (inputs q, ``kv_inputs`` (k, v; or a quantized
    cache's six arrays), then ``scalars``, then
    ``params``) writes each block's fp32 partials, the merge kernel combines them: all NB blocks, or with
    ``last_row`` (the live-length form) the live ones only, applying ``gate`` ([B, 1, Hq * D], writing that
    shape) if given; ``merge`` (a merge kernel and its inputs after the partials): that merge instead."""
    B, Hq, _, D = queries.shape
    part_max, part_sum, part_acc = get_kernel(partials, backend)(
        inputs=[queries, *kv_inputs, *scalars, params],
        template=g.template, grid=(32 * plan.partial_threadgroups, g.sg, 1),
        threadgroup=(32, g.sg, 1),
        output_shapes=[(B * Hq, plan.blocks), (B * Hq, plan.blocks), (B * Hq, plan.blocks, D)],
        output_dtypes=[mx.float32] * 3,
        init_value=init_value,
    )
    return _merge_partials(queries, part_max, part_sum, part_acc, plan, backend, init_value, gate, last_row, merge)


def _merge_partials(queries, part_max, part_sum, part_acc, plan: FixedBlockPlan, backend: str, init_value,
                    gate: Optional[mx.array], last_row: Optional[mx.array],
                    merge: Optional[Tuple[KernelSpec, list]] = None) -> mx.array:
    """The merge launch of the fixed-block split (see ``_blocks_then_merge``)."""
    B, Hq, _, D = queries.shape
    if merge is not None:
        merge, merge_inputs = merge
    elif last_row is None:
        merge = KERNELS["attention_decode_merge_blocks"]
        merge_inputs = [merge.pack(NB=plan.blocks)]
    else:
        merge = KERNELS["attention_decode_merge_live_blocks" + ("" if gate is None else "_gated")]
        merge_inputs = [*([] if gate is None else [gate]), last_row, merge.pack(NB=plan.blocks, BR=plan.block_rows)]
    mv, mw = plan.merge_lane_floats, plan.merge_simdgroups
    (out,) = get_kernel(merge, backend)(
        inputs=[part_max, part_sum, part_acc, *merge_inputs],
        template=[("InT", queries.dtype), ("D", D), ("MV", mv), ("MW", mw)],
        grid=(32 * B * Hq * (D // (32 * mv)), mw, 1),
        threadgroup=(32, mw, 1),
        output_shapes=[queries.shape if gate is None else (B, 1, Hq * D)],
        output_dtypes=[queries.dtype],
        init_value=init_value,
    )
    return out


def decode_attention_fixed_blocks_from_cache(backend: str):
    """The launcher ``layer.long_context_attention`` dispatches to on ``backend`` (cache read in
    place; rows per block from the schedule unless ``block_size`` is given)."""

    def launch(queries, keys, values, *, scale, mask=None, cache=None, block_size=None,
               coalesced=True, gqa_packed=True):
        return decode_attention_fixed_blocks(queries, cache.keys, cache.values, scale=scale, block_rows=block_size,
                                             kv_length=keys.shape[2], gqa_packed=gqa_packed, coalesced=coalesced,
                                             backend=backend)

    return launch


def decode_attention_fixed_blocks_rows_from_cache(backend: str):
    """The launcher ``layer.batch_decode_attention`` dispatches to on ``backend``: a ``BatchKVCache``'s whole buffers
    read in place, each row from its left padding on (``supports(batch=True)``)."""

    def launch(queries, keys, values, *, scale, mask=None, cache=None, coalesced=True, gqa_packed=True):
        return decode_attention_fixed_blocks_rows(queries, cache.keys, cache.values, cache.left_padding, scale=scale,
                                                  kv_length=keys.shape[2], gqa_packed=gqa_packed, coalesced=coalesced,
                                                  backend=backend)

    return launch


def decode_attention_from_cache(backend: str):
    """The launcher ``layer.decode_attention`` dispatches to on ``backend``: reads the cache's
    whole buffer (no copy of the live slice) with the live length as a parameter."""

    def launch(queries, keys, values, *, scale, mask=None, cache=None, coalesced=True, gqa_packed=True):
        # A BatchKVCache (supports(batch=True)): each row starts after its left padding.
        row_start = getattr(cache, "left_padding", None) if mask is not None else None
        return decode_attention(queries, cache.keys, cache.values, scale=scale, kv_length=keys.shape[2],
                                gqa_packed=gqa_packed, coalesced=coalesced, backend=backend, row_start=row_start)

    return launch


# --- prefill (kernels/attention/prefill.metal) ----------------------------------------------------

# Backends the prefill kernel (op ``attention_prefill``) runs on: the simulator only until it has been
# timed on a GPU against stock's attention (lily_dev/attention_bench.py, ``attention_prefill_*`` cases).
# To enable it on NVIDIA GPUs add "cuda" here (and "metal" for Apple GPUs) once the kernel tests pass
# there (``LILY_TEST_KERNEL_BACKEND=cuda python -m pytest tests/kernels/test_attention_kernels.py -k prefill``)
# and the kernel beats stock at the chunk sizes the model runs.
PREFILL_BACKENDS = frozenset({"sim"})
# Simdgroups per threadgroup: each owns one 8-row fragment of (position, head) rows, so a threadgroup
# holds 8 * PREFILL_SIMDGROUPS rows = 8 * SG / G chunk positions x the G query heads of one KV head.
PREFILL_SIMDGROUPS = 4
# Keys per staged tile (BK). A row's reduction order over keys follows these tiles (from key 0), so BK
# is a constant, never chosen from the batch or the chunk. Threadgroup memory: 2 * BK * (D + 8) * 2
# bytes (16.5 KiB at D = 256; BK = 32 would need 33 KiB there, over Apple's 32 KiB).
PREFILL_KEY_TILE = 16
PREFILL_PAD = 8  # elements after each staged row (the kernel's PREFILL_PAD)
PREFILL_DTYPES = (mx.bfloat16, mx.float16)  # the products' operand types (simdgroup_matrix)
PREFILL_GQA_FACTORS = (1, 2, 4, 8)  # G must divide the 8 * SG rows of a threadgroup
THREADGROUP_MEMORY_LIMIT = 32 * 1024  # Apple GPUs


def prefill_threadgroup_bytes(D: int, key_tile: int, itemsize: int = 2) -> int:
    """Threadgroup memory of the prefill kernel: the K and V tiles of key_tile padded rows."""
    return 2 * key_tile * (D + PREFILL_PAD) * itemsize


def prefill_supports(queries: mx.array, keys: Any, values: Any, mask: Any = None,
                     cache: Any = None) -> Optional[str]:
    """None when the prefill kernel can run these inputs; else why it cannot.

    queries: [B, Hq, L, D]; keys, values: [B, Hkv, S, D], the live rows of a plain mlx_lm ``KVCache``
    (or the arrays themselves without a cache); mask None (every query sees all S keys, as stock's
    attention without a mask) or "causal" (query i sees keys up to S - L + i)."""
    from mlx_lm.models.cache import KVCache

    if isinstance(keys, (tuple, list)):  # QuantizedKVCache: (packed, scales, biases)
        return "quantized KV cache"
    if isinstance(mask, mx.array):
        kind = "a bool" if mask.dtype == mx.bool_ else "an additive"
        return f"{kind} mask array (the kernel takes \"causal\" or None)"
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return f"mask {mask!r} (the kernel takes \"causal\" or None)"
    if cache is not None and type(cache) is not KVCache:  # rotating, quantized, batch caches
        return f"cache {type(cache).__name__} is not a plain KVCache"
    B, Hq, L, D = queries.shape
    if keys.ndim != 4 or values.shape != keys.shape or keys.shape[0] != B or keys.shape[3] != D:
        return f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match queries {tuple(queries.shape)}"
    if D not in SUPPORTED_HEAD_DIMS:
        return f"head dim {D} not in {SUPPORTED_HEAD_DIMS}"
    Hkv, S = keys.shape[1], keys.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        return f"Hq={Hq} not a multiple of Hkv={Hkv}"
    if Hq // Hkv not in PREFILL_GQA_FACTORS:
        return f"{Hq // Hkv} query heads per KV head (the kernel takes {PREFILL_GQA_FACTORS})"
    if queries.dtype not in PREFILL_DTYPES or keys.dtype != queries.dtype or values.dtype != queries.dtype:
        return f"dtypes q={queries.dtype}, k={keys.dtype}, v={values.dtype} not supported (bf16 or fp16)"
    if S == 0 or L == 0:
        return "an empty KV cache or chunk"
    if mask is not None and S < L:
        return f"a causal mask with fewer keys ({S}) than queries ({L})"
    if cache is not None and (cache.keys is None or cache.offset != S or cache.keys.shape[2] < S):
        return "keys are not the cache's live rows"
    return None


def prefill_geometry(L: int, G: int, simdgroups: Optional[int] = None) -> Tuple[int, int]:
    """(BQ, NQ): chunk positions per threadgroup (8 * SG / G) and query tiles per (sequence, KV
    head) for a chunk of L queries."""
    sg = simdgroups or PREFILL_SIMDGROUPS
    bq = 8 * sg // G
    if bq * G != 8 * sg or bq == 0:
        raise ValueError(f"G={G} must divide the {8 * sg} rows of a threadgroup")
    return bq, -(-L // bq)


def prefill_attention(
    queries: mx.array,  # [B, Hq, L, D]
    keys: mx.array,  # [B, Hkv, S_cap, D]: rows < kv_length are live
    values: mx.array,  # [B, Hkv, S_cap, D]
    *,
    scale: float,
    kv_length: Optional[int] = None,  # live rows S (default: all of S_cap); the chunk is rows S - L .. S - 1
    causal: bool = True,  # mask "causal" (True) or no mask (False)
    backend: str,
    init_value=None,
    simdgroups: Optional[int] = None,  # per threadgroup (default PREFILL_SIMDGROUPS)
    key_tile: Optional[int] = None,  # BK (default PREFILL_KEY_TILE)
) -> mx.array:  # [B, Hq, L, D] in queries' dtype (a transposed view of a [B, L, Hq, D] array)
    """Attention of a chunk of L queries over S keys (flash-attention tiles, simdgroup_matrix
    products, fp32 online softmax), GQA: the G query heads of one KV head share each staged K/V tile."""
    B, Hq, L, D = queries.shape
    Hkv, S_cap = keys.shape[1], keys.shape[2]
    S = S_cap if kv_length is None else kv_length
    G = Hq // Hkv
    sg = simdgroups or PREFILL_SIMDGROUPS
    bk = key_tile or PREFILL_KEY_TILE
    _, nq = prefill_geometry(L, G, sg)
    spec = KERNELS["attention_prefill"]
    (out,) = get_kernel(spec, backend)(
        inputs=[queries, keys, values, float32_scalar(scale), spec.pack(Hkv=Hkv, L=L, S=S, S_cap=S_cap, NQ=nq)],
        template=[("InT", queries.dtype), ("D", D), ("G", G), ("SG", sg), ("BK", bk), ("CAUSAL", int(causal))],
        grid=(32 * B * Hkv * nq, sg, 1),
        threadgroup=(32, sg, 1),
        output_shapes=[(B, L, Hq, D)],
        output_dtypes=[queries.dtype],
        init_value=init_value,
    )
    return out.transpose(0, 2, 1, 3)


def prefill_attention_from_cache(backend: str):
    """The launcher ``layer.prefill_attention`` dispatches to on ``backend``: reads a plain KVCache's
    whole buffer in place (no copy of the live slice), or the keys/values themselves without a cache."""

    def launch(queries, keys, values, *, scale, mask=None, cache=None):
        causal = mask is not None  # prefill_supports: "causal" or None
        if cache is not None:
            return prefill_attention(queries, cache.keys, cache.values, scale=scale, kv_length=keys.shape[2],
                                     causal=causal, backend=backend)
        return prefill_attention(queries, keys, values, scale=scale, causal=causal, backend=backend)

    return launch


# --- q/k preparation (kernels/attention/qk_prep.metal; switch fused_qk_prep) ------------------------

# Backends the q/k preparation kernel (op ``attention_qk_prep``) runs on: every backend. Its launch sits in
# the attention layer's decode trace (compiled_attention), so it costs no Python per step; on the H200 a
# decode step with it took 0.07 ms less GPU time with 50 fewer kernels (docs/attention.md).
QK_PREP_BACKENDS = frozenset({"sim", "cuda", "metal"})
QK_PREP_DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def qk_prep_supports(q_proj_out: mx.array, k_proj_out: mx.array, n_heads: int, n_kv_heads: int, q_norm,
                     k_norm, rope, offset) -> Optional[str]:
    """None when the kernel computes stock's q/k preparation for these inputs, else why not."""
    B, L, _ = q_proj_out.shape
    D = q_proj_out.shape[-1] // (2 * n_heads)
    if q_proj_out.dtype not in QK_PREP_DTYPES or k_proj_out.dtype != q_proj_out.dtype:
        return f"dtype {q_proj_out.dtype}"
    if q_proj_out.shape[-1] != 2 * n_heads * D or k_proj_out.shape[-1] != n_kv_heads * D or D % 32:
        return f"head dim {D} (a multiple of 32 is needed)"
    if stock_type(rope) is not nn.RoPE or rope.traditional or rope.dims % 2 or rope.dims > D:
        return f"rotary embedding {type(rope).__name__} (plain non-traditional nn.RoPE only)"
    for norm in (q_norm, k_norm):
        if stock_type(norm) is not nn.RMSNorm or norm.weight.shape != (D,):
            return f"norm {type(norm).__name__} (nn.RMSNorm over the head dim only)"
        if norm.weight.dtype != q_proj_out.dtype:  # stock would promote the output's dtype
            return f"norm weight dtype {norm.weight.dtype} differs from the activations' {q_proj_out.dtype}"
    if isinstance(offset, mx.array) and offset.shape not in ((B,), ()):
        return f"offset of shape {offset.shape}"
    return None


def _positions(offset: Any, B: int) -> mx.array:
    """The q/k preparation's positions input: each row's cache offset, int32 [B]."""
    if isinstance(offset, mx.array):
        return mx.broadcast_to(offset.astype(mx.int32), (B,))
    return mx.array([int(offset)] * B, dtype=mx.int32)  # a constant: no graph primitive


def qk_prep(q_proj_out: mx.array, k_proj_out: Optional[mx.array], *, n_heads: int, n_kv_heads: int, q_norm, k_norm,
            rope, offset: Any = 0, backend: str, init_value=None) -> Tuple[mx.array, mx.array, mx.array]:
    """Queries [B, H, L, D] and keys [B, Hkv, L, D] (normalised, rotated) and the output gate
    [B, L, H * D], as ``reference.qk_prep_reference`` computes them, in one launch. ``k_proj_out`` None:
    q_proj_out is the fused q/k/v projection's output [B, L, 2 H D + 2 Hkv D] (q | k | v), read in place."""
    B, L, width = q_proj_out.shape
    D = width // (2 * n_heads) if k_proj_out is not None else width // (2 * n_heads + 2 * n_kv_heads)
    if k_proj_out is None:
        q_ld, k_ld, k_off, k_proj_out = width, width, 2 * n_heads * D, q_proj_out
    else:
        q_ld, k_ld, k_off = width, k_proj_out.shape[-1], 0
    positions = _positions(offset, B)
    spec = KERNELS["attention_qk_prep"]
    dtype = q_proj_out.dtype
    q_out, k_out, gate = get_kernel(spec, backend)(
        inputs=[q_proj_out, k_proj_out, q_norm.weight, k_norm.weight, positions, float32_scalar(q_norm.eps),
                float32_scalar(math.log2(rope.base)), float32_scalar(rope.scale),
                spec.pack(H=n_heads, Hkv=n_kv_heads, L=L, q_ld=q_ld, k_ld=k_ld, k_off=k_off)],
        template=[("T", dtype), ("D", D), ("DIMS", rope.dims)],
        grid=(32, n_heads + n_kv_heads, B * L), threadgroup=(32, 1, 1),
        output_shapes=[(B, n_heads, L, D), (B, n_kv_heads, L, D), (B, L, n_heads * D)],
        output_dtypes=[dtype] * 3,
        init_value=init_value,
    )
    return q_out, k_out, gate


# --- the q/k/v projection inside the q/k preparation (switch fused_qkv_prep, with the trial row GEMV) ------------

QKV_PREP_SIMDGROUPS = 16  # kernels/attention/qk_prep.metal: QK_PREP_SIMDGROUPS
# Weight pieces a row and lane in flight in attention_qk_prep_from_hidden's GEMV (template U; at hidden 2048 a lane has
# 2 pieces a row, so 2 is all of them): its 512-thread threadgroups allow 128 registers a thread (NVRTC cannot be told
# the bound through MLX); ptxas for sm_90a at Qwen3.6's shape: 75 registers with 2 (96 with 1). Read at each call
# (--set).
QKV_PREP_UNROLL = 2


def qkv_prep_from_hidden_reason(x: mx.array, weight: mx.array, scales: mx.array, biases: Optional[mx.array],
                                group_size: int, bits: int, mode: str, n_heads: int, n_kv_heads: int,
                                in_norm_weight: Optional[mx.array] = None) -> Optional[str]:
    """Why ``attention_qk_prep_from_hidden`` cannot take this decode call's fused q/k/v projection (x [B, 1, Hd], W
    [(2 H + 2 Hkv) D, Hd] 4-bit affine); None when it can. The q/k preparation's own rules are ``qk_prep_supports``'s."""
    reason = projections.fold_reason(x, weight, scales, biases, group_size, bits, mode, in_norm_weight)
    blocks = 2 * n_heads + 2 * n_kv_heads
    if reason is None and (weight.shape[0] % blocks or (weight.shape[0] // blocks) % 32):
        reason = f"q/k/v projection of {weight.shape[0]} rows ({blocks} heads' blocks of a multiple of 32)"
    return reason


def qkv_prep_from_hidden(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int, *,
                         n_heads: int, n_kv_heads: int, q_norm, k_norm, rope, offset: Any = 0, in_norm=None,
                         backend: str, init_value=None) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
    """Queries [B, H, 1, D], keys and values [B, Hkv, 1, D], gate [B, 1, H * D] of a decode call from the layer's input
    x [B, 1, Hd] in one launch: the bits of the row GEMV over the fused q/k/v projection (weight, scales, biases: q_proj's
    rows, then k_proj's, then v_proj's; ``in_norm`` = (weight, eps): the layer's input norm inside, as the norm GEMV)
    followed by ``qk_prep`` of its output read in place (the values: the GEMV's). Callers check
    ``qkv_prep_from_hidden_reason`` and ``qk_prep_supports`` first."""
    B, _, hd = x.shape
    blocks = 2 * n_heads + 2 * n_kv_heads
    D = weight.shape[0] // blocks
    positions = _positions(offset, B)
    spec = KERNELS["attention_qk_prep_from_hidden"]
    dtype = x.dtype
    q_out, k_out, v_out, gate = get_kernel(spec, backend)(
        inputs=[x, in_norm[0] if in_norm is not None else x, float32_scalar(in_norm[1] if in_norm is not None else 0.0),
                weight, scales, biases, q_norm.weight, k_norm.weight, positions, float32_scalar(q_norm.eps),
                float32_scalar(math.log2(rope.base)), float32_scalar(rope.scale),
                spec.pack(B=B, H=n_heads, Hkv=n_kv_heads)],
        template=[("T", dtype), ("D", D), ("DIMS", rope.dims), ("GS", group_size), ("NORM", int(in_norm is not None)),
                  ("Hd", hd), ("U", QKV_PREP_UNROLL)],
        grid=(32, QKV_PREP_SIMDGROUPS * blocks, B), threadgroup=(32, QKV_PREP_SIMDGROUPS, 1),
        output_shapes=[(B, n_heads, 1, D), (B, n_kv_heads, 1, D), (B, n_kv_heads, 1, D), (B, 1, n_heads * D)],
        output_dtypes=[dtype] * 4,
        init_value=init_value,
    )
    return q_out, k_out, v_out, gate
