"""Prefill-attention kernel (kernels/attention/prefill.metal) in the CPU simulator vs the reference.

The kernel on hypothesis-drawn shapes (B 1-2, Hkv 1-2, G 1/2/4/8, D 64/128/256, chunks of 1..70
queries, 0..200 cached keys, spare cache capacity, causal or no mask, every threadgroup geometry it
takes), bf16 and fp16, outputs poisoned with NaN so unwritten elements show; Qwen3.6's shape at a few
hundred keys; the causal mask exactly (later keys never reach a query: perturbing them leaves its bits
alone); the invariance it promises (a row's bits depend on its query, its position and its own keys
only: not on the batch, the chunk's length, where the chunk starts, or the query tile it lands in);
the simulator's race check; the dispatch and the fallbacks; the patched embedded model's prefill
logits against stock; the CUDA translation compiling.

Oracle: ``attention_reference`` evaluated in fp32 on the same inputs, not rounded. Tolerance
(relative L2): 2 u, u = 2^-9 (bf16) or 2^-11 (fp16), the unit roundoff. The kernel rounds twice
to the 16-bit type, everything else is fp32: the output once (relative error <= u per element), and
the softmax weights once before P . V (each weight relative <= u; flash attention does the same),
which moves the output by an error of the same size (it is a weighted mean of the weights' rounding
errors, random in sign). Measured over 230 random shapes of the test below: bf16 <= 2.2e-3 (rounding
the fp32 oracle alone to bf16 gives 1.7e-3), fp16 <= 2.8e-4 (2.1e-4); the bound is 3.9e-3 / 9.8e-4.
"""


import mlx.core as mx
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from lily_mlx.core.kernel_registry import record_launches
from lily_mlx.ops.attention import kernels as ak
from lily_mlx.ops.attention import layer as att
from lily_mlx.ops.attention import reference as attref
from lily_mlx.ops.deltanet import kernels as deltanet_kernels
from tests.kernels.kernel_backend import KERNEL_BACKEND, kernel_backend_problem
from tests.kernels.kernel_backend import attention_kernels_on_test_backend  # noqa: F401 (autouse fixture)
from tests.kernels.model_checks import check_fallbacks_match_stock, decided_positions
from tests.ops.deltanet_cases import rel_l2

SIM_MISSING = kernel_backend_problem() or deltanet_kernels.backend_unavailable_reason(KERNEL_BACKEND)
needs_sim = pytest.mark.skipif(SIM_MISSING is not None, reason=f"{KERNEL_BACKEND} kernels not available: {SIM_MISSING}")

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16}
TOL = {"bfloat16": 2 * 2**-9, "float16": 2 * 2**-11}  # module docstring
NAN = float("nan")


def _rand(rng, shape, dtype):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _problem(rng, B, Hkv, G, D, L, cached, dtype, spare=0):
    """queries [B, Hq, L, D]; keys/values [B, Hkv, cached + L + spare, D]: rows < cached + L are live
    (the chunk's own keys last), the rest spare capacity."""
    q = _rand(rng, (B, Hkv * G, L, D), dtype)
    k = _rand(rng, (B, Hkv, cached + L + spare, D), dtype)
    v = _rand(rng, (B, Hkv, cached + L + spare, D), dtype)
    return q, k, v


def _oracle(q, k, v, S, scale, causal=True):
    f32 = [x.astype(mx.float32) for x in (q, k[:, :, :S], v[:, :, :S])]
    return attref.attention_reference(*f32, scale=scale, mask="causal" if causal else None)


def _check(out, want, dtype, tol):
    assert out.dtype == dtype and out.shape == want.shape
    assert not bool(mx.any(mx.isnan(out)).item()), "unwritten output"
    err = rel_l2(out, want)
    assert err < tol, err


def _same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


def _run(q, k, v, S=None, scale=0.125, causal=True, **kw):
    out = ak.prefill_attention(q, k, v, scale=scale, kv_length=S, causal=causal, backend=KERNEL_BACKEND,
                               init_value=NAN, **kw)
    mx.eval(out)
    return out


@needs_sim
@settings(deadline=None, max_examples=30)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 2, 4, 8]), D=st.sampled_from([64, 128, 256]),
    L=st.integers(1, 70), cached=st.integers(0, 200), dtype=st.sampled_from(["bfloat16", "float16"]),
    causal=st.booleans(), spare=st.sampled_from([0, 5]), simdgroups=st.sampled_from([None, 1, 2, 8]),
    key_tile=st.sampled_from([None, 8, 32]), sharp=st.booleans(), seed=st.integers(0, 2**16),
)
def test_prefill_kernel_matches_reference(B, Hkv, G, D, L, cached, dtype, causal, spare, simdgroups, key_tile,
                                          sharp, seed):
    """Chunks that are no multiple of the query tile (8 * SG / G positions) or of the key tile, a
    chunk of one query, no cache at all (cached 0), causal or unmasked, the default geometry
    (None) and the others, a sharp softmax (scale 1: the running max moves and rescales) or the
    usual one; spare cache rows are never read."""
    assume(not (key_tile == 32 and D == 256))  # 33 KiB of threadgroup memory: over Apple's limit
    rng = np.random.default_rng(seed)
    q, k, v = _problem(rng, B, Hkv, G, D, L, cached, DTYPES[dtype], spare)
    S = cached + L
    scale = 1.0 if sharp else D**-0.5
    out = _run(q, k, v, S, scale, causal, simdgroups=simdgroups, key_tile=key_tile)
    _check(out, _oracle(q, k, v, S, scale, causal), DTYPES[dtype], TOL[dtype])


@needs_sim
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_prefill_kernel_qwen36_shape(dtype):
    """Qwen3.6's full-attention heads (16 query heads over 2 KV heads, D = 256) at a few hundred keys:
    a 70-token chunk (no multiple of the 4 positions of a query tile) over 250 cached keys, spare
    cache rows; keys drift towards the queries along the sequence, so later tiles keep moving the
    running max. The launch geometry is the documented one."""
    rng = np.random.default_rng(3)
    L, cached = 70, 250
    S = cached + L
    q, k, v = _problem(rng, 1, 2, 8, 256, L, cached, DTYPES[dtype], spare=7)
    ramp = mx.linspace(0.0, 8.0, S + 7).reshape(1, 1, -1, 1)
    q_mean = q.astype(mx.float32).mean(axis=(1, 2), keepdims=True)
    k = (k.astype(mx.float32) + ramp * q_mean).astype(k.dtype)
    with record_launches() as rec:
        out = _run(q, k, v, S, scale=0.25)
    assert rec.names() == ["attention_prefill"]
    bq, nq = ak.prefill_geometry(L, 8)
    assert (bq, nq) == (4, 18)
    assert rec[0].kwargs["grid"] == (32 * 2 * 18, ak.PREFILL_SIMDGROUPS, 1)
    assert rec[0].kwargs["threadgroup"] == (32, ak.PREFILL_SIMDGROUPS, 1)
    assert rec[0].template == {"InT": DTYPES[dtype], "D": 256, "G": 8, "SG": 4, "BK": 16, "CAUSAL": 1}
    _check(out, _oracle(q, k, v, S, 0.25), DTYPES[dtype], TOL[dtype])


def test_prefill_geometry_and_threadgroup_memory():
    """Query tiles of 8 * SG / G positions; the K/V tiles fit Apple's 32 KiB at every head dim."""
    assert [ak.prefill_geometry(70, g)[0] for g in (1, 2, 4, 8)] == [32, 16, 8, 4]
    assert ak.prefill_geometry(70, 8) == (4, 18) and ak.prefill_geometry(1, 1) == (32, 1)
    assert ak.prefill_geometry(9, 8, simdgroups=8) == (8, 2)
    for D in ak.SUPPORTED_HEAD_DIMS:
        assert ak.prefill_threadgroup_bytes(D, ak.PREFILL_KEY_TILE) <= ak.THREADGROUP_MEMORY_LIMIT
    assert ak.prefill_threadgroup_bytes(256, 16) == 16896
    assert ak.prefill_threadgroup_bytes(256, 32) > ak.THREADGROUP_MEMORY_LIMIT
    with pytest.raises(ValueError):
        ak.prefill_geometry(10, 3)


# ---------------------------------------------------------------------------------------------
# the causal mask, and what a row's bits depend on


@needs_sim
def test_causal_mask_is_exact():
    """A query never sees later keys: changing the keys and values after chunk position j (and NaN in
    the spare cache rows, which are never read) leaves the outputs of positions <= j bit for bit,
    and changes every later position."""
    rng = np.random.default_rng(4)
    B, Hkv, G, D, L, cached = 1, 2, 4, 64, 23, 17
    S = cached + L
    q, k, v = _problem(rng, B, Hkv, G, D, L, cached, mx.bfloat16, spare=3)
    poison = mx.concatenate([k[:, :, :S], mx.full((B, Hkv, 3, D), NAN, k.dtype)], axis=2)
    base = _run(q, poison, v, S)
    for j in (0, 5, 15, L - 2):
        rows = mx.arange(S + 3).reshape(1, 1, -1, 1)
        later = (rows > cached + j) & (rows < S)  # the spare rows stay NaN
        k2 = mx.where(later, _rand(rng, k.shape, k.dtype) * 4, poison)
        v2 = mx.where(later, _rand(rng, v.shape, v.dtype) * 4, v)
        out = _run(q, k2, v2, S)
        assert _same(out[:, :, :j + 1], base[:, :, :j + 1]), j
        changed = mx.any(out != base, axis=(0, 1, 3))  # per chunk position
        assert bool(mx.all(changed[j + 1:]).item()), j


@needs_sim
def test_row_bits_depend_only_on_its_query_position_and_keys():
    """The property the kernel keeps (prefill.metal): key tiles start at key 0 with a fixed size, and
    keys a row does not see weigh exactly 0, so a query row's output bits are a function of its query,
    its absolute position and keys 0..t alone. The same token (same cache contents before it) gives
    the same bits whether its chunk is one token longer or shorter after it, starts earlier or later
    (so the token sits in another slot of another query tile), is the whole prompt, or is the token
    alone (chunks of one query), at Qwen3.6's head shape."""
    rng = np.random.default_rng(5)
    N = 50
    q_all, k_all, v_all = _problem(rng, 1, 2, 8, 256, N, 0, mx.bfloat16)

    def chunk(start, length):  # positions start .. start + length - 1 over keys 0 .. start + length - 1
        end = start + length
        return _run(q_all[:, :, start:end], k_all[:, :, :end], v_all[:, :, :end], scale=0.2)

    base = chunk(20, 25)  # positions 20 .. 44
    for start, length in ((20, 26), (20, 24), (17, 33), (23, 22), (21, 29), (0, N)):
        other = chunk(start, length)
        lo, hi = max(20, start), min(45, start + length)
        assert _same(other[:, :, lo - start:hi - start], base[:, :, lo - 20:hi - 20]), (start, length)
    for t in (20, 31, 44):  # one query alone
        assert _same(chunk(t, 1), base[:, :, t - 20:t - 19]), t


@needs_sim
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_batch_invariant(causal):
    """A sequence's outputs are bitwise the same alone and in a batch of 3 (other rows hold other data):
    the geometry depends on L, G and constants only."""
    rng = np.random.default_rng(6)
    q, k, v = _problem(rng, 3, 2, 8, 128, 13, 30, mx.bfloat16, spare=2)
    batch = _run(q, k, v, 43, causal=causal)
    for b in range(3):
        assert _same(_run(q[b:b + 1], k[b:b + 1], v[b:b + 1], 43, causal=causal), batch[b:b + 1]), b


@needs_sim
@pytest.mark.skipif(KERNEL_BACKEND != "sim", reason="the race check is the simulator's")
@pytest.mark.parametrize("shape", [
    dict(B=1, Hkv=2, G=8, D=256, L=6, cached=20, causal=True, simdgroups=None, key_tile=None),
    dict(B=2, Hkv=1, G=2, D=64, L=21, cached=9, causal=False, simdgroups=2, key_tile=8),
], ids=["qwen36", "small-tiles"])
def test_prefill_kernel_race_check(monkeypatch, shape):
    """The simulator's race check (threadgroup memory accessed by two threads between the same
    barriers, and a second run in reverse thread order) on the staged K/V tiles."""
    monkeypatch.setenv("LILY_MSL_RACE", "1")
    rng = np.random.default_rng(7)
    s = dict(shape)
    causal, simdgroups, key_tile = s.pop("causal"), s.pop("simdgroups"), s.pop("key_tile")
    q, k, v = _problem(rng, dtype=mx.bfloat16, **s)
    S = s["cached"] + s["L"]
    out = _run(q, k, v, S, causal=causal, simdgroups=simdgroups, key_tile=key_tile)
    _check(out, _oracle(q, k, v, S, 0.125, causal), mx.bfloat16, TOL["bfloat16"])


# ---------------------------------------------------------------------------------------------
# dispatch through the attention op (LILY_BACKEND=sim)


def _filled_cache(cls, k, v, **kw):
    cache = cls(**kw)
    cache.update_and_fetch(k, v)
    return cache


@needs_sim
@pytest.mark.parametrize("mask", ["causal", None])
def test_dispatch_uses_the_prefill_kernel_for_plain_kv_cache(monkeypatch, mask):
    """A chunk over a plain KVCache with mask "causal" (what MLX-LM passes) or None: the kernel runs,
    reading the cache's buffer in place (spare capacity included, live length as a parameter), and
    matches stock's attention; without a cache it runs on the keys/values themselves."""
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    rng = np.random.default_rng(8)
    cached, L = 19, 11
    q, k, v = _problem(rng, 2, 2, 4, 64, L, cached, mx.bfloat16)
    cache = _filled_cache(KVCache, k[:, :, :cached], v[:, :, :cached])
    keys, values = cache.update_and_fetch(k[:, :, cached:], v[:, :, cached:])  # this chunk's rows
    assert cache.keys.shape[2] > keys.shape[2]  # spare capacity the kernel must not read
    with record_launches() as rec:
        out = att.attention(q, keys, values, scale=0.125, mask=mask, cache=cache)
    assert rec.names() == ["attention_prefill"]
    assert rec[0].template["CAUSAL"] == int(mask == "causal")
    assert rec[0].kwargs["inputs"][1] is cache.keys  # the buffer itself, not a copy of the live rows
    assert out.shape == q.shape
    _check(out, _oracle(q, keys, values, cached + L, 0.125, mask == "causal"), mx.bfloat16, TOL["bfloat16"])

    with record_launches() as rec:
        alone = att.attention(q, k, v, scale=0.125, mask=mask, cache=None)
    assert rec.names() == ["attention_prefill"]
    assert _same(alone, out)  # the same kernel arithmetic on the same rows


def _fallback_cases(rng):
    q, k, v = _problem(rng, 2, 2, 4, 64, 6, 4, mx.bfloat16)
    plain = _filled_cache(KVCache, k[:, :, :4], v[:, :, :4])
    keys, values = plain.update_and_fetch(k[:, :, 4:], v[:, :, 4:])
    padded = create_causal_mask(6, 4, left_padding=mx.array([2, 0]))  # what a batch cache's mask looks like
    rotating = _filled_cache(RotatingKVCache, k[:, :, :4], v[:, :, :4], max_size=32)
    rk, rv = rotating.update_and_fetch(k[:, :, 4:], v[:, :, 4:])
    batch = BatchKVCache(left_padding=[2, 0])
    bk, bv = batch.update_and_fetch(k, v)
    quantized = QuantizedKVCache(group_size=64, bits=8)
    qk, qv = quantized.update_and_fetch(k, v)
    f32 = [x.astype(mx.float32) for x in (q, keys, values)]
    q3 = q[:, :6]  # 6 query heads over 2 KV heads: G = 3
    return [
        ("a bool mask array", q, keys, values, padded, plain),
        ("an additive mask array", q, keys, values, mx.where(padded, 0.0, -1e9).astype(mx.bfloat16), plain),
        ("cache RotatingKVCache is not a plain KVCache", q, rk, rv, "causal", rotating),
        ("cache BatchKVCache is not a plain KVCache", q, bk, bv, None, batch),
        ("quantized KV cache", q, qk, qv, "causal", quantized),
        ("not supported (bf16 or fp16)", *f32, "causal", None),
        ("head dim 32 not in", q[..., :32], keys[..., :32], values[..., :32], "causal", None),
        ("3 query heads per KV head", q3, keys, values, "causal", None),
        ("fewer keys (3) than queries (6)", q, keys[:, :, :3], values[:, :, :3], "causal", None),
    ]


def test_unsupported_inputs_fall_back_to_stock(monkeypatch, caplog):
    """Mask arrays (bool, as batch caches give, or additive), other mask kinds, rotating / batch /
    quantized caches, fp32, other head dims and GQA ratios, a causal chunk with fewer keys than
    queries: stock's attention bit for bit (no simulator needed), no launch, each reason logged
    once (the cases run twice)."""
    monkeypatch.setenv("LILY_BACKEND", "sim")
    cases = _fallback_cases(np.random.default_rng(9))
    check_fallbacks_match_stock(att.prefill_attention, cases, caplog, equal_nan=True)
    _, q, keys, values, _, plain = cases[0]
    assert "mask 'sliding'" in ak.prefill_supports(q, keys, values, "sliding", plain)  # any other mask kind


def test_prefill_op_registered_for_the_simulator_only():
    """Simulator only until timed on a GPU (kernels.PREFILL_BACKENDS); a trial kernel on Metal and CUDA
    (its launchers exist there; the dispatch runs it where a tune profile turned it on)."""
    from lily_mlx.ops import OPS, op_backend

    assert ak.PREFILL_BACKENDS == frozenset({"sim"})
    assert OPS["attention_prefill"].kernel_backends == ak.PREFILL_BACKENDS
    assert OPS["attention_prefill"].trial_backends == frozenset({"metal", "cuda"})
    assert all(("attention_prefill", b) in att.KERNELS for b in ("sim", "metal", "cuda"))
    assert [op_backend("attention_prefill", b) for b in ("sim", "cuda", "metal")] == ["sim", "reference", "reference"]


# ---------------------------------------------------------------------------------------------
# the patched embedded model, attention prefill simulated

LOGIT_TOL = 2e-2  # relative L2 of a position's bf16 logits (as the decode kernel's model test)


@needs_sim
def test_embedded_model_prefill_matches_stock(monkeypatch):
    """Two prefill chunks (the prompt, then 16 more tokens over the cache) through the patched
    embedded model (its full-attention layer: 16 query heads over 2 KV heads, D = 64), attention on
    the simulated prefill kernel, the other families on their reference: every position's logits
    within bf16 noise of stock's, and stock's greedy token wherever stock's top-2 margin is no
    near-tie."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from lily_mlx import patch as lily_patch
    from lily_mlx.models.embedded import EMBEDDED_DIR, _is_complete

    assert _is_complete(EMBEDDED_DIR), f"the embedded model is part of the tree: {EMBEDDED_DIR}"
    model, tokenizer = load(str(EMBEDDED_DIR))
    first = tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"")
    second = tokenizer.encode("\n    if n < 2:\n        return n\n    return fib")[:16]
    full_attention = sum(1 for layer in model.layers if not hasattr(layer, "linear_attn"))

    def chunk_logits():
        cache = make_prompt_cache(model)
        outs = [model(mx.array(c)[None], cache=cache)[0].astype(mx.float32) for c in (first, second)]
        mx.eval(outs)
        return mx.concatenate(outs, axis=0)

    stock = chunk_logits()
    decided, _ = decided_positions(stock)
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    monkeypatch.setenv("LILY_REFERENCE_OPS", "moe,deltanet")  # only attention goes to the kernels
    lily_patch.patch(model)
    try:
        with record_launches() as rec:
            lily = chunk_logits()
    finally:
        lily_patch.unpatch(model)
    assert rec.names() == ["attention_qk_prep", "attention_prefill"] * (2 * full_attention)
    assert [launch.template["CAUSAL"] for launch in rec if launch.name == "attention_prefill"] == [1] * (2 * full_attention)
    for pos in range(stock.shape[0]):
        assert rel_l2(lily[pos], stock[pos]) < LOGIT_TOL, pos
    assert decided.sum() >= stock.shape[0] // 2, "the embedded model should be decided at most positions"
    assert (np.array(mx.argmax(lily, axis=-1)) == np.array(mx.argmax(stock, axis=-1)))[decided].all()


# ---------------------------------------------------------------------------------------------
# the CUDA bridge translation compiles (the model's call sites are compiled by
# tests/msl/test_cuda_bridge.py once "cuda" is in PREFILL_BACKENDS)


def test_prefill_kernel_compiles_for_cuda():
    """Qwen3.6's instantiations (bf16 and fp16, D = 256, G = 8, causal or not, 4 and 8 simdgroups)
    and a small one translate and compile; the products go to the tensor cores (mma.sync)."""
    from lily_dev.compile_check import compile_cuda, compiler_available
    from lily_mlx.core.kernel_registry import kernel_source
    from lily_mlx.msl.cuda import metal_kernel, wrap_like_mlx

    if compiler_available() is None:
        pytest.skip("no CUDA compiler (NVRTC or nvcc) installed")
    spec = ak.KERNELS["attention_prefill"]
    header, body = kernel_source(spec)
    kernel = metal_kernel(spec.name, list(spec.input_names), list(spec.output_names), body, header=header)
    for dtype, D, G, sg, bk, causal in ((mx.bfloat16, 256, 8, 4, 16, 1), (mx.float16, 256, 8, 8, 16, 0),
                                        (mx.bfloat16, 64, 1, 2, 32, 1)):
        q, k = mx.zeros((1, 2 * G, 64, D), dtype), mx.zeros((1, 2, 128, D), dtype)
        template = [("InT", dtype), ("D", D), ("G", G), ("SG", sg), ("BK", bk), ("CAUSAL", causal)]
        _, unit = wrap_like_mlx(kernel, [q, k, k, mx.zeros((1,)), mx.zeros((5,), mx.int32)], [dtype],
                                template=template)
        assert "mma.sync.aligned.m16n8k8" in unit
        ok, log = compile_cuda(unit)
        assert ok, log


@needs_sim
def test_prefill_bench_cases():
    """The prefill cases the kernels mode times (small sizes here): each runs, the flops are the causal
    work, and the lily variants compute stock's attention."""
    from lily_dev import attention_bench

    cases = attention_bench.prefill_cases(backend=KERNEL_BACKEND, cached=(40,), L=9)
    assert [name for name, *_ in cases] == [
        "attention_prefill_stock_sdpa_L9_S40", "attention_prefill_lily_L9_S40", "attention_prefill_lily_sg8_L9_S40",
        "attention_prefill_lily_sg2_L9_S40"]
    for name, run_once, nbytes, flops in cases:
        run_once()
        assert flops == 4 * 256 * 16 * sum(40 + i + 1 for i in range(9)), name
        assert nbytes == (2 * 2 * 49 * 256 + 2 * 16 * 9 * 256) * 2, name
    assert attention_bench.prefill_flops(2048, 32768) == 4 * 256 * 16 * (2048 * 32768 + 2048 * 2049 // 2)
    rng = np.random.default_rng(10)
    q, k, v = _problem(rng, 1, 2, 8, 256, 9, 40, mx.bfloat16)
    want = _oracle(q, k, v, 49, 0.0625)
    for kw in attention_bench.PREFILL_VARIANTS.values():
        _check(ak.prefill_attention(q, k, v, scale=0.0625, backend=KERNEL_BACKEND, **kw), want, mx.bfloat16,
               TOL["bfloat16"])
