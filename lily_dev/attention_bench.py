"""Attention microbenchmarks at Qwen3.6's full-attention shape, for the bench harness.

``microbench_cases()`` -> [(name, run_once, bytes_moved, flops)]: the decode cases at each context,
then the prefill cases (``prefill_cases``). Decode:

- ``attention_stock_sdpa_S*``: stock's ``mx.fast.scaled_dot_product_attention`` (what stock MLX-LM
  runs for a decode row);
- ``attention_decode_gqa_S*`` / ``attention_decode_per_head_S*``: lily's one-pass kernel
  (``gqa_packing`` on / off; B * Hkv * G / GT threadgroups, i.e. 2 / 16 per sequence);
- ``attention_fixed_blocks_auto_S*``: the fixed-block split as ``attention_decode_long`` runs it
  (block partials + merge; rows per block from the schedule ``kernels.fixed_block_rows``, R =
  ``DECODE_ROWS_PER_STEP``, ``DECODE_SIMDGROUPS`` simdgroups);
- candidates for its knobs: ``..._small_S*`` (4x as many blocks, a quarter of the rows each:
  ``FIXED_BLOCK_TARGET_BLOCKS`` = 1024), ``..._r2_S*`` (2 rows per simdgroup step instead of 4:
  fewer registers, half the bytes in flight), ``..._sg8_S*`` (8 simdgroups per threadgroup), ``..._gt4_S*``
  (the 8 query heads of a KV head over two threadgroups of 4: ~2/3 of the registers, each row read twice);
- ``..._x8_S*`` (stock, auto and auto_gt4): 8 independent calls per evaluation, bytes and flops x 8: the
  kernels' own time with the per-call evaluation round trip (~60-100 us on MLX-CUDA) spread over 8;
- ``attention_in_buffer_masked_sdpa_x8_S*`` / ``attention_fixed_blocks_live[_sg4|_sg8]_x8_S*`` (``in_buffer_cases``): the
  attention over a KV buffer with 256 rows of capacity past the S live ones (switch ``kv_write_in_trace``):
  stock's attention with those rows masked against the fixed-block kernels reading the live length from an array.

Bytes: the live K and V rows once (the floor), plus q and out; flops: 4 * Hq * S * D (two products
per row and head).

Prefill (``prefill_cases``): a chunk of L = 2048 queries (``PREFILL_CHUNK``) over S = 2K / 8K / 32K
cached keys plus the chunk itself (``PREFILL_CACHED``), causal, bf16, B = 1:

- ``attention_prefill_stock_sdpa_L2K_S*``: stock's ``mx.fast.scaled_dot_product_attention`` with
  mask="causal" (what stock MLX-LM runs for a prefill chunk over a plain KVCache; at head dim 256 MLX
  has no fused kernel on CUDA or M1-M4, so it is matmul, softmax, matmul there);
- ``attention_prefill_lily_L2K_S*``: lily's flash-attention kernel as ``attention_prefill`` runs it
  (``PREFILL_SIMDGROUPS`` simdgroups: 4 chunk positions x 8 heads per threadgroup, 16-key tiles);
- ``attention_prefill_lily_sg8_L2K_S*`` / ``_sg2_``: 8 / 2 simdgroups per threadgroup (8 / 2 chunk
  positions per staged K/V tile: half / twice the K/V staging traffic of the default).

A server's batch (``batch_cases``; mlx_lm's BatchKVCache, rows of S, S / 2, S / 4 and S / 8 keys left-padded to S;
then batches of 1 row, of S and S / 2, and of 8 rows of S, 7 S / 8, ..., S / 8: ``_b1_`` / ``_b2_`` / ``_b8_``),
8 calls an evaluation: ``attention_batch_stock_masked_sdpa_b4_x8_S*`` (stock's attention with the batch's bool mask)
against ``attention_batch_rows_b4_x8_S*`` (op ``attention_decode_batch``: the split over each row's own blocks; its
schedule's candidates ``_t32`` / ``_t8``, 4x / 16x fewer blocks a row, and ``_sg4``, 4 simdgroups a threadgroup) and
``attention_batch_one_pass_b4_x8_S*`` (the one-pass kernel from each row's padding). Bytes: the rows' live K and V
once, plus q and out.

Quantized KV caches (``quantized_kv_cases``; MLX-LM's ``--kv-bits``, groups of 64), 8 calls an evaluation:
``attention_quantized_stock_b*_x8_S*`` (stock's ``quantized_scaled_dot_product_attention``) against
``attention_quantized_lily_b*_x8_S*`` (op ``attention_decode_quantized``'s one-pass kernel) and
``attention_quantized_lily_blocks_b*_x8_S*`` (its fixed-block split, what the op runs from 32K). Bytes: the live
packed rows, scales and biases of K and V once, plus q and out.

q/k preparation (``qk_prep_cases``), one token (decode) and a 2048-token chunk:
``attention_qk_prep_stock_L*`` (stock's five ops: gate split, q_norm, k_norm, two RoPEs) against
``attention_qk_prep_lily_L*`` (the ``fused_qk_prep`` kernel), each also ``_x8`` (8 independent calls per
evaluation). Bytes: q_proj and k_proj read, queries, keys and gate written.

Flops: the causal work only, 4 * D * Hq * (L * S_cached + L (L + 1) / 2) (two products per visible
(query, key) pair and head; stock's unfused path computes the masked half of the chunk's square too,
not counted); bytes: K and V of all S_cached + L rows once, plus q and out.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from lily_mlx.core.backend import resolve_backend
from lily_mlx.ops.attention import kernels as ak
from lily_mlx.tuning.layers import BATCH_FRACTIONS

# Qwen3.6-35B-A3B full attention (one rank): 16 query heads over 2 KV heads, head dim 256.
QWEN36 = dict(Hq=16, Hkv=2, D=256)
CONTEXTS = (4096, 32768, 65536, 131072)
PREFILL_CHUNK = 2048  # MLX-LM's prefill_step_size
PREFILL_CACHED = (2048, 8192, 32768)
# Prefill variants of lily's kernel: name suffix -> keyword arguments of ak.prefill_attention.
PREFILL_VARIANTS = {"": {}, "_sg8": {"simdgroups": 8}, "_sg2": {"simdgroups": 2}}
REPEATS = 8  # calls per evaluation in the _x8 cases
# A server's batch in the batch cases: its rows' own lengths as fractions of the longest (left-padded to it), as tune's
# batch shape class has them.
BATCH_LENGTHS = BATCH_FRACTIONS
# The batches timed: 4 rows as above, then 1, 2 and 8 rows. The split's schedule aims at a constant number of blocks a
# row (never keyed on the batch), so a candidate aim has to be timed at every batch size a server runs: 32 blocks a
# row won at 4 rows on the H200 (2026-12-05) but gives one row a quarter of the threadgroups.
BATCH_COMPOSITIONS = (BATCH_LENGTHS, (1.0,), (1.0, 0.5), tuple(1 - i / 8 for i in range(8)))
# Candidates for the batch split's schedule (a constant aim of blocks a row, never keyed on the batch): name suffix ->
# keyword arguments of ak.decode_attention_fixed_blocks_rows ("": the product's).
BATCH_VARIANTS = {"": {}, "_t32": {"target_blocks": 32}, "_t8": {"target_blocks": 8},
                  "_sg4": {"simdgroups": ak.DECODE_SIMDGROUPS}}
BUFFER_SPARE = 256  # rows of capacity past the live ones in the in-buffer cases (MLX-LM's KVCache.step)

# Fixed-block variants: name suffix -> keyword arguments of a call (rows per block as a function of S).
FIXED_BLOCK_VARIANTS = {
    "auto": {},
    "auto_small": {"block_rows": lambda S: ak.fixed_block_rows(S, target_blocks=4 * ak.FIXED_BLOCK_TARGET_BLOCKS)},
    "auto_r2": {"rows": 2},
    "auto_sg8": {"simdgroups": 8},
    "auto_small_sg8": {"block_rows": lambda S: ak.fixed_block_rows(S, target_blocks=4 * ak.FIXED_BLOCK_TARGET_BLOCKS),
                       "simdgroups": 8},
    "auto_small_r2": {"block_rows": lambda S: ak.fixed_block_rows(S, target_blocks=4 * ak.FIXED_BLOCK_TARGET_BLOCKS),
                      "rows": 2},
    "auto_per_head": {"gqa_packed": False},  # gqa_packing off: one threadgroup per query head
    "auto_gt4": {"heads_per_threadgroup": 4},  # the 8 heads of a KV head over two threadgroups: fewer registers
}

Case = Tuple[str, Callable[[], None], int, int]


def _fixed_blocks(q, k, v, scale, backend, S, variant):
    kw = {n: (a(S) if callable(a) else a) for n, a in FIXED_BLOCK_VARIANTS[variant].items()}
    return ak.decode_attention_fixed_blocks(q, k, v, scale=scale, backend=backend, **kw)


def _label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def prefill_flops(L: int, cached: int, Hq: int = QWEN36["Hq"], D: int = QWEN36["D"], B: int = 1) -> int:
    """Useful flops of a causal chunk of L queries over `cached` keys plus the chunk."""
    return 4 * D * Hq * B * (L * cached + L * (L + 1) // 2)


def prefill_cases(backend: Optional[str] = None, cached: Sequence[int] = PREFILL_CACHED, L: int = PREFILL_CHUNK,
                  B: int = 1, dtype=mx.bfloat16) -> List[Case]:
    """Stock's SDPA and lily's prefill kernel (and its variants) on one causal chunk at each cache size."""
    backend = backend or resolve_backend()
    Hq, Hkv, D = QWEN36["Hq"], QWEN36["Hkv"], QWEN36["D"]
    isz = mx.zeros((), dtype=dtype).itemsize
    scale = D ** -0.5
    cases: List[Case] = []
    for S0 in cached:
        S = S0 + L
        kq, kk, kv = mx.random.split(mx.random.key(S0 + 7), 3)
        q = mx.random.normal((B, Hq, L, D), key=kq).astype(dtype)
        k = mx.random.normal((B, Hkv, S, D), key=kk).astype(dtype)
        v = mx.random.normal((B, Hkv, S, D), key=kv).astype(dtype)
        mx.eval(q, k, v)
        nbytes = (2 * B * Hkv * S * D + 2 * B * Hq * L * D) * isz
        flops = prefill_flops(L, S0, Hq, D, B)
        tag = f"L{_label(L)}_S{_label(S0)}"

        def stock(q=q, k=k, v=v):
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"))

        cases.append((f"attention_prefill_stock_sdpa_{tag}", stock, nbytes, flops))
        if backend == "reference":
            continue
        for suffix, kw in PREFILL_VARIANTS.items():
            def lily(q=q, k=k, v=v, kw=kw):
                mx.eval(ak.prefill_attention(q, k, v, scale=scale, causal=True, backend=backend, **kw))

            cases.append((f"attention_prefill_lily{suffix}_{tag}", lily, nbytes, flops))
    return cases


def microbench_cases(backend: Optional[str] = None, contexts: Sequence[int] = CONTEXTS, B: int = 1,
                     dtype=mx.bfloat16, prefill_cached: Sequence[int] = PREFILL_CACHED,
                     prefill_chunk: int = PREFILL_CHUNK,
                     qk_prep_chunks: Sequence[int] = (1, PREFILL_CHUNK), kv_bits: Sequence[int] = (4, 8),
                     batch_compositions: Sequence[Sequence[float]] = BATCH_COMPOSITIONS) -> List[Case]:
    """The decode cases at each of `contexts` (with ``batch_cases`` for each of `batch_compositions` and
    ``quantized_kv_cases`` for each of `kv_bits`), then
    ``prefill_cases`` (chunk `prefill_chunk` over each of `prefill_cached`; none when it is empty), then
    ``qk_prep_cases`` for `qk_prep_chunks`."""
    backend = backend or resolve_backend()
    Hq, Hkv, D = QWEN36["Hq"], QWEN36["Hkv"], QWEN36["D"]
    isz = mx.zeros((), dtype=dtype).itemsize
    scale = D ** -0.5
    scales = [scale * (1 + 1e-3 * i) for i in range(REPEATS)]  # distinct calls, nothing to share
    cases: List[Case] = []
    for S in contexts:
        key = mx.random.key(S)
        kq, kk, kv = mx.random.split(key, 3)
        q = mx.random.normal((B, Hq, 1, D), key=kq).astype(dtype)
        k = mx.random.normal((B, Hkv, S, D), key=kk).astype(dtype)
        v = mx.random.normal((B, Hkv, S, D), key=kv).astype(dtype)
        mx.eval(q, k, v)
        nbytes = (2 * B * Hkv * S * D + 2 * B * Hq * D) * isz
        flops = 4 * B * Hq * S * D
        label = _label(S)

        def stock(q=q, k=k, v=v):
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale))

        def stock_x8(q=q, k=k, v=v):
            mx.eval([mx.fast.scaled_dot_product_attention(q, k, v, scale=s) for s in scales])

        cases.append((f"attention_stock_sdpa_S{label}", stock, nbytes, flops))
        cases.append((f"attention_stock_sdpa_x{REPEATS}_S{label}", stock_x8, REPEATS * nbytes, REPEATS * flops))
        if backend == "reference":
            continue
        for packed in (True, False):
            def one_pass(q=q, k=k, v=v, packed=packed):
                mx.eval(ak.decode_attention(q, k, v, scale=scale, gqa_packed=packed, backend=backend))

            name = f"attention_decode_{'gqa' if packed else 'per_head'}_S{label}"
            cases.append((name, one_pass, nbytes, flops))
        for variant in FIXED_BLOCK_VARIANTS:
            def blocks(q=q, k=k, v=v, S=S, variant=variant):
                mx.eval(_fixed_blocks(q, k, v, scale, backend, S, variant))

            cases.append((f"attention_fixed_blocks_{variant}_S{label}", blocks, nbytes, flops))

        for variant in ("auto", "auto_gt4"):
            def blocks_x8(q=q, k=k, v=v, S=S, variant=variant):
                mx.eval([_fixed_blocks(q, k, v, s, backend, S, variant) for s in scales])

            cases.append((f"attention_fixed_blocks_{variant}_x{REPEATS}_S{label}", blocks_x8, REPEATS * nbytes,
                          REPEATS * flops))
        cases += in_buffer_cases(q, k, v, scales, backend, label, nbytes, flops)
        for lengths in batch_compositions:
            cases += batch_cases(S, scales, backend, dtype, lengths)
        for bits in kv_bits:
            cases += quantized_kv_cases(q, k, v, scales, backend, label, bits)
    return (cases + prefill_cases(backend, prefill_cached, prefill_chunk, B, dtype)
            + qk_prep_cases(backend, qk_prep_chunks, B=B, dtype=dtype))


def in_buffer_cases(q, k, v, scales, backend, label, nbytes, flops, spare: int = BUFFER_SPARE) -> List[Case]:
    """The attention of a decode step over a KV buffer with ``spare`` rows of capacity past the S live rows
    (switch ``kv_write_in_trace``), 8 calls an evaluation: stock's attention over the buffer with the rows past
    the live ones masked (``layer.attend_in_buffer`` without the kernels) against the fixed-block kernels'
    live-length form (the live length an input array)."""
    B, Hkv, S, D = k.shape
    pad = mx.zeros((B, Hkv, spare, D), dtype=k.dtype)
    kb, vb = mx.concatenate([k, pad], axis=2), mx.concatenate([v, pad], axis=2)
    last_row = mx.array([S - 1], dtype=mx.int32)
    mx.eval(kb, vb, last_row)

    def masked_x8():
        live = mx.arange(S + spare, dtype=mx.int32) <= last_row[0]
        mx.eval([mx.fast.scaled_dot_product_attention(q, kb, vb, scale=s, mask=live) for s in scales])

    def live_x8(simdgroups=None):
        mx.eval([ak.decode_attention_fixed_blocks_live(q, kb, vb, last_row, scale=s, backend=backend,
                                                       simdgroups=simdgroups) for s in scales])

    cases = [(f"attention_in_buffer_masked_sdpa_x{REPEATS}_S{label}", masked_x8, REPEATS * nbytes, REPEATS * flops)]
    if backend != "reference":
        # the product's form (its simdgroups from the capacity and backend: kernels.live_simdgroups), then 4 and 8
        # simdgroups a threadgroup whatever the capacity
        for name, sg in (("", None), ("_sg4", ak.DECODE_SIMDGROUPS), ("_sg8", ak.LIVE_WIDE_SIMDGROUPS)):
            cases.append((f"attention_fixed_blocks_live{name}_x{REPEATS}_S{label}",
                          lambda sg=sg: live_x8(sg), REPEATS * nbytes, REPEATS * flops))
    return cases


def batch_cases(S: int, scales, backend, dtype=mx.bfloat16, lengths=BATCH_LENGTHS) -> List[Case]:
    """A server's batch of decode rows (mlx_lm's BatchKVCache) of S * ``lengths`` keys each, left-padded to S, 8
    calls an evaluation: stock's attention with the batch's one-row bool mask (what MLX-LM runs for it) against
    the split over the rows' own blocks (op ``attention_decode_batch``) and the one-pass kernel from each row's
    padding (op ``attention_decode``)."""
    Hq, Hkv, D = QWEN36["Hq"], QWEN36["Hkv"], QWEN36["D"]
    B = len(lengths)
    live = [max(1, int(S * f)) for f in lengths]
    kq, kk, kv = mx.random.split(mx.random.key(S + 1), 3)
    q = mx.random.normal((B, Hq, 1, D), key=kq).astype(dtype)
    k = mx.random.normal((B, Hkv, S, D), key=kk).astype(dtype)
    v = mx.random.normal((B, Hkv, S, D), key=kv).astype(dtype)
    row_start = mx.array([S - n for n in live], dtype=mx.int32)
    mask = (mx.arange(S)[None, :] >= row_start[:, None]).reshape(B, 1, 1, S)
    mx.eval(q, k, v, row_start, mask)
    isz = mx.zeros((), dtype=dtype).itemsize
    nbytes = REPEATS * (2 * Hkv * sum(live) * D + 2 * B * Hq * D) * isz
    flops = REPEATS * 4 * Hq * sum(live) * D

    def stock_x8():
        mx.eval([mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask=mask) for s in scales])

    def rows_x8(**kw):
        mx.eval([ak.decode_attention_fixed_blocks_rows(q, k, v, row_start, scale=s, backend=backend, **kw)
                 for s in scales])

    def one_pass_x8():
        mx.eval([ak.decode_attention(q, k, v, scale=s, row_start=row_start, backend=backend) for s in scales])

    tag = f"b{B}_x{REPEATS}_S{_label(S)}"
    cases = [(f"attention_batch_stock_masked_sdpa_{tag}", stock_x8, nbytes, flops)]
    if backend != "reference":
        for name, kw in BATCH_VARIANTS.items():
            cases.append((f"attention_batch_rows{name}_{tag}", lambda kw=kw: rows_x8(**kw), nbytes, flops))
        cases.append((f"attention_batch_one_pass_{tag}", one_pass_x8, nbytes, flops))
    return cases


def quantized_kv_cases(q, k, v, scales, backend, label, bits: int, group_size: int = 64) -> List[Case]:
    """Decode over a ``bits``-bit quantized KV cache of the S rows of k and v, 8 calls an evaluation: stock's
    quantized attention against the quantized kernels' one-pass and fixed-block forms (module docstring)."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    B, Hkv, S, D = k.shape
    kq = tuple(mx.quantize(k, group_size=group_size, bits=bits))
    vq = tuple(mx.quantize(v, group_size=group_size, bits=bits))
    mx.eval(kq, vq)
    nbytes = REPEATS * (2 * sum(a.nbytes for a in kq) + 2 * q.nbytes)
    flops = REPEATS * 4 * B * q.shape[1] * S * D

    def stock_x8():
        mx.eval([quantized_scaled_dot_product_attention(q, kq, vq, scale=s, mask=None, group_size=group_size,
                                                        bits=bits) for s in scales])

    def lily_x8(fixed_blocks):
        mx.eval([ak.decode_attention_quantized(q, kq, vq, scale=s, bits=bits, group_size=group_size,
                                               fixed_blocks=fixed_blocks, backend=backend) for s in scales])

    tag = f"b{bits}_x{REPEATS}_S{label}"
    cases = [(f"attention_quantized_stock_{tag}", stock_x8, nbytes, flops)]
    if backend != "reference":
        cases.append((f"attention_quantized_lily_{tag}", lambda: lily_x8(False), nbytes, flops))
        cases.append((f"attention_quantized_lily_blocks_{tag}", lambda: lily_x8(True), nbytes, flops))
    return cases


def qk_prep_cases(backend: Optional[str] = None, chunks: Sequence[int] = (1, PREFILL_CHUNK), B: int = 1,
                  dtype=mx.bfloat16, offset: int = 4096) -> List[Case]:
    """Stock's q/k preparation vs the ``fused_qk_prep`` kernel at Qwen3.6's attention shape (64 of 256
    dims rotated, RoPE base 1e7) for each chunk length (module docstring)."""
    import mlx.nn as nn

    from lily_mlx.ops.attention.reference import qk_prep_reference

    backend = backend or resolve_backend()
    Hq, Hkv, D = QWEN36["Hq"], QWEN36["Hkv"], QWEN36["D"]
    isz = mx.zeros((), dtype=dtype).itemsize
    q_norm, k_norm = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)
    q_norm.weight, k_norm.weight = q_norm.weight.astype(dtype), k_norm.weight.astype(dtype)
    rope = nn.RoPE(D // 4, traditional=False, base=1e7)
    kw = dict(n_heads=Hq, n_kv_heads=Hkv, q_norm=q_norm, k_norm=k_norm, rope=rope)
    cases: List[Case] = []
    for L in chunks:
        keys = mx.random.split(mx.random.key(L), 2 * REPEATS)
        inputs = [(mx.random.normal((B, L, Hq * 2 * D), key=keys[2 * i]).astype(dtype),
                   mx.random.normal((B, L, Hkv * D), key=keys[2 * i + 1]).astype(dtype))
                  for i in range(REPEATS)]  # distinct calls, nothing to share
        mx.eval(inputs)
        nbytes = B * L * (Hq * 2 * D + Hkv * D + 2 * Hq * D + Hkv * D) * isz
        flops = 10 * B * L * (Hq + Hkv) * D

        def stock(calls):
            return lambda: mx.eval([qk_prep_reference(q, k, k, offset=offset, **kw) for q, k in calls])

        def lily(calls):
            return lambda: mx.eval([ak.qk_prep(q, k, offset=offset, backend=backend, **kw) for q, k in calls])

        cases.append((f"attention_qk_prep_stock_L{_label(L)}", stock(inputs[:1]), nbytes, flops))
        cases.append((f"attention_qk_prep_stock_x{REPEATS}_L{_label(L)}", stock(inputs), REPEATS * nbytes,
                      REPEATS * flops))
        if backend == "reference":
            continue
        cases.append((f"attention_qk_prep_lily_L{_label(L)}", lily(inputs[:1]), nbytes, flops))
        cases.append((f"attention_qk_prep_lily_x{REPEATS}_L{_label(L)}", lily(inputs), REPEATS * nbytes,
                      REPEATS * flops))
    return cases
