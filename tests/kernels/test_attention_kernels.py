"""Decode-attention kernel (kernels/attention/decode.metal) in the CPU simulator vs the reference.

The kernel on hypothesis-drawn shapes in every switch state (gqa_packing, coalesced_kv), outputs
poisoned with NaN so unwritten elements show, reading only the live rows of a KV buffer with spare
capacity. The oracle is ``attention_reference`` evaluated in fp32 on the same inputs, delivered in
the output's dtype; tolerances: relative L2 < 2e-3 with bf16 inputs, < 1e-5 in fp32. Then the
dispatch (plain KVCache and no mask -> kernel; anything else -> stock, logged once) and the patched
embedded model decoding with the kernel against stock.
"""

from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from lily_mlx.core import switches
from lily_mlx.core.kernel_registry import record_launches
from lily_mlx.ops.attention import kernels as ak
from lily_mlx.ops.attention import layer as att
from lily_mlx.ops.attention import reference as attref
from lily_mlx.ops.deltanet import kernels as deltanet_kernels
from tests.kernels.kernel_backend import KERNEL_BACKEND, kernel_backend_problem
from tests.kernels.kernel_backend import attention_kernels_on_test_backend  # noqa: F401 (autouse fixture)
from tests.kernels.model_checks import check_fallbacks_match_stock, decided_positions
from tests.kernels.model_checks import teacher_forced_logits as shared_teacher_forced_logits
from tests.ops.deltanet_cases import rel_l2

SIM_MISSING = kernel_backend_problem() or deltanet_kernels.backend_unavailable_reason(KERNEL_BACKEND)
needs_sim = pytest.mark.skipif(SIM_MISSING is not None, reason=f"{KERNEL_BACKEND} kernels not available: {SIM_MISSING}")

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
TOL = {"float32": 1e-5, "bfloat16": 2e-3, "float16": 2e-3}
NAN = float("nan")
SWITCH_STATES = [(packed, coalesced) for packed in (True, False) for coalesced in (True, False)]


def _rand(rng, shape, dtype):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _problem(rng, B, Hkv, G, D, S, dtype, spare=0):
    """queries [B, Hq, 1, D]; keys/values [B, Hkv, S + spare, D] (rows >= S are spare capacity)."""
    q = _rand(rng, (B, Hkv * G, 1, D), dtype)
    k = _rand(rng, (B, Hkv, S + spare, D), dtype)
    v = _rand(rng, (B, Hkv, S + spare, D), dtype)
    return q, k, v


def _oracle(q, k, v, S, scale):
    """The fp32 reference on the CPU stream: on a GPU backend MLX's fp32 matmuls may round through TF32
    (4e-4 relative on the H100, 2026-12-05), which the kernels' fp32 chains do not."""
    with mx.stream(mx.cpu):
        f32 = [x.astype(mx.float32) for x in (q, k[:, :, :S], v[:, :, :S])]
        out = attref.attention_reference(*f32, scale=scale).astype(q.dtype)
        mx.eval(out)
    return out


def _check(out, ref, tol):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not bool(mx.any(mx.isnan(out)).item()), "unwritten output"
    assert rel_l2(out, ref) < tol


@needs_sim
@settings(deadline=None, max_examples=24)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 2, 3, 4, 6, 8]),
    D=st.sampled_from([64, 128, 256]), S=st.sampled_from([1, 7, 33, 300]),
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]), state=st.sampled_from(SWITCH_STATES),
    spare=st.sampled_from([0, 5]), rows=st.sampled_from([1, 2, 4]), sharp=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_decode_kernel_matches_reference(B, Hkv, G, D, S, dtype, state, spare, rows, sharp, seed):
    """The one-pass kernel on drawn shapes (GQA ratios that are no power of two pad the (head, row)
    pairs of the transposing reduction), every switch state and rows-per-step, a sharp softmax
    (scale 1: the running max moves and the accumulators are rescaled) or the usual one."""
    rng = np.random.default_rng(seed)
    q, k, v = _problem(rng, B, Hkv, G, D, S, DTYPES[dtype], spare)
    packed, coalesced = state
    scale = 1.0 if sharp else D**-0.5
    out = ak.decode_attention(q, k, v, scale=scale, kv_length=S, gqa_packed=packed, coalesced=coalesced,
                              backend=KERNEL_BACKEND, init_value=NAN, rows=rows)
    _check(out, _oracle(q, k, v, S, scale), TOL[dtype])


@needs_sim
@pytest.mark.parametrize("packed, coalesced", SWITCH_STATES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_kernel_qwen36_head_shape(packed, coalesced, dtype):
    """Qwen3.6's full-attention head shape: 16 query heads over 2 KV heads (G = 8), D = 256; a
    sharp softmax (large scale) so the running max is exercised, S not a multiple of the simdgroups."""
    rng = np.random.default_rng(3)
    q, k, v = _problem(rng, 1, 2, 8, 256, 45, DTYPES[dtype], spare=3)
    out = ak.decode_attention(q, k, v, scale=0.5, kv_length=45, gqa_packed=packed, coalesced=coalesced,
                              backend=KERNEL_BACKEND, init_value=NAN)
    _check(out, _oracle(q, k, v, 45, 0.5), TOL[dtype])


@needs_sim
def test_switch_states_compute_the_same_function():
    rng = np.random.default_rng(4)
    q, k, v = _problem(rng, 2, 2, 4, 128, 33, mx.float32)
    outs = [ak.decode_attention(q, k, v, scale=0.1, gqa_packed=p, coalesced=c, backend=KERNEL_BACKEND, init_value=NAN)
            for p, c in SWITCH_STATES]
    for out in outs[1:]:
        assert rel_l2(out, outs[0]) < 1e-6


# ---------------------------------------------------------------------------------------------
# dispatch through the attention op (LILY_BACKEND=sim)

def _filled_cache(cls, k, v, **kw):
    cache = cls(**kw)
    cache.update_and_fetch(k, v)
    return cache


@needs_sim
@pytest.mark.parametrize("packed, coalesced", SWITCH_STATES)
def test_dispatch_uses_kernel_for_plain_kv_cache(monkeypatch, packed, coalesced):
    """A plain KVCache, L == 1, no mask: the kernel runs (reading the cache buffer in place) and
    matches stock's attention over the same cache."""
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    rng = np.random.default_rng(5)
    q, k, v = _problem(rng, 2, 2, 4, 64, 20, mx.bfloat16)
    cache = _filled_cache(KVCache, k[:, :, :19], v[:, :, :19])
    keys, values = cache.update_and_fetch(k[:, :, 19:], v[:, :, 19:])  # the decode step's row
    assert cache.keys.shape[2] > keys.shape[2]  # spare capacity the kernel must not read
    off = [n for n, on in (("gqa_packing", packed), ("coalesced_kv", coalesced)) if not on]
    with switches.overrides(disable=off), record_launches() as rec:
        out = att.attention(q, keys, values, scale=0.125, mask=None, cache=cache)
    assert rec.names() == ["attention_decode"]
    assert (rec[0].template["GT"], rec[0].template["COALESCED"]) == (4 if packed else 1, int(coalesced))
    _check(out, _oracle(q, keys, values, 20, 0.125), TOL["bfloat16"])


@needs_sim
@pytest.mark.parametrize("packed, coalesced", SWITCH_STATES)
def test_left_padded_batch_rows_have_their_own_bits(packed, coalesced):
    """A BatchKVCache's rows (left padding 0, 5 and 23 rows of garbage): with ``row_start`` each row's
    output is bit for bit the same sequence's alone in a plain buffer (the row steps count from the
    row's first live key), and matches the fp32 oracle over its live keys; outputs poisoned."""
    rng = np.random.default_rng(21)
    B, Hkv, G, D, S = 3, 2, 4, 64, 60
    pads = [0, 5, 23]
    q, k, v = _problem(rng, B, Hkv, G, D, S, mx.bfloat16, spare=3)
    kw = dict(scale=0.125, gqa_packed=packed, coalesced=coalesced, backend=KERNEL_BACKEND, init_value=NAN)
    batch = ak.decode_attention(q, k, v, kv_length=S, row_start=mx.array(pads), **kw)
    for b, pad in enumerate(pads):
        live_k, live_v = k[b:b + 1, :, pad:S], v[b:b + 1, :, pad:S]
        alone = ak.decode_attention(q[b:b + 1], live_k, live_v, kv_length=S - pad, **kw)
        assert bool(mx.array_equal(batch[b:b + 1], alone).item()), b
        _check(batch[b:b + 1], _oracle(q[b:b + 1], live_k, live_v, S - pad, 0.125), TOL["bfloat16"])


@needs_sim
@pytest.mark.parametrize("split", [True, False], ids=["row-blocks", "one-pass"])
def test_dispatch_uses_kernel_for_a_batch_kv_cache_with_its_own_mask(monkeypatch, split):
    """mlx_lm's BatchKVCache with the mask it makes for a decode step: the split over the rows' own blocks (op
    attention_decode_batch), or with fixed_block_attention off the one-pass kernel, runs from each row's left padding
    on and matches stock's masked attention; any other mask falls back."""
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import BatchKVCache

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    rng = np.random.default_rng(22)
    q, k, v = _problem(rng, 2, 2, 4, 64, 20, mx.bfloat16)
    cache = _filled_cache(BatchKVCache, k[:, :, :19], v[:, :, :19], left_padding=[7, 0])
    mask = create_attention_mask(mx.zeros((2, 1, 8)), cache)  # before the step, as the model makes it
    keys, values = cache.update_and_fetch(k[:, :, 19:], v[:, :, 19:])
    with switches.overrides(disable=() if split else ("fixed_block_attention",)), record_launches() as rec:
        out = att.attention(q, keys, values, scale=0.125, mask=mask, cache=cache)
    want_names = (["attention_decode_block_partials_rows", "attention_decode_merge_row_blocks"] if split
                  else ["attention_decode"])
    assert rec.names() == want_names
    want = attref.attention_reference(*(x.astype(mx.float32) for x in (q, keys, values)), scale=0.125,
                                      mask=mask).astype(q.dtype)
    _check(out, want, TOL["bfloat16"])
    additive = mx.where(mask, 0.0, -mx.inf).astype(mx.bfloat16)
    assert "another mask" in ak.supports(q, keys, values, additive, cache, batch=True)
    assert ak.supports(q, keys, values, mask, cache) == "a mask"  # the single sequence's kernels: no batches


def _fallback_cases(rng):
    q, k, v = _problem(rng, 1, 2, 4, 64, 9, mx.float32)
    plain = _filled_cache(KVCache, k, v)
    keys, values = plain.keys[..., :9, :], plain.values[..., :9, :]
    rotating = _filled_cache(RotatingKVCache, k[:, :, :8], v[:, :, :8], max_size=32)
    rk, rv = rotating.update_and_fetch(k[:, :, 8:], v[:, :, 8:])
    quantized = QuantizedKVCache(group_size=64, bits=8)
    qk, qv = quantized.update_and_fetch(k, v)
    return [
        ("a mask", q, keys, values, mx.ones((1, 1, 1, 9), dtype=mx.bool_), plain),
        ("not a plain KVCache", q, rk, rv, None, rotating),
        ("quantized KV cache", q, qk, qv, None, quantized),
        ("not a plain KVCache", q, k, v, None, None),
        ("head dim 32 not in", q[..., :32], keys[..., :32], values[..., :32], None, plain),
    ]


def test_unsupported_inputs_fall_back_to_stock(monkeypatch, caplog):
    """Masks, rotating/quantized/no caches, other head dims: stock's attention bit for bit (no
    simulator needed), no launch, each reason logged once (the cases run twice)."""
    monkeypatch.setenv("LILY_BACKEND", "sim")
    check_fallbacks_match_stock(att.decode_attention, _fallback_cases(np.random.default_rng(6)), caplog)


def test_reference_backend_never_launches(monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "reference")
    rng = np.random.default_rng(7)
    q, k, v = _problem(rng, 1, 1, 2, 64, 4, mx.float32)
    cache = _filled_cache(KVCache, k, v)
    with mock.patch.object(ak, "get_kernel", side_effect=AssertionError("kernel launched")):
        out = att.decode_attention(q, cache.keys[..., :4, :], cache.values[..., :4, :], scale=0.125, cache=cache)
    assert bool(mx.array_equal(out, attref.attention_reference(q, k, v, scale=0.125)).item())


# ---------------------------------------------------------------------------------------------
# the patched embedded model, attention decode simulated

LOGIT_TOL = 2e-2  # relative L2 of a position's bf16 logits (measured 0 to 8.4e-3: about 1-2 bf16 ulps)


@needs_sim
@pytest.mark.parametrize("off", [(), ("gqa_packing", "coalesced_kv")])
def test_embedded_model_decode_matches_stock(monkeypatch, off):
    """Stock's greedy tokens teacher-forced through the patched model (the prompt through the
    simulated prefill kernel, then one simulated decode-attention step per token; the other families
    stay reference): logits
    within bf16 noise of stock's, and stock's token wherever stock's top-2 margin is not a near-tie."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from lily_mlx import patch as lily_patch
    from lily_mlx.models.embedded import EMBEDDED_DIR, _is_complete

    assert _is_complete(EMBEDDED_DIR), f"the embedded model is part of the tree: {EMBEDDED_DIR}"
    model, tokenizer = load(str(EMBEDDED_DIR))
    prompt = mx.array(tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the"))
    n = 8

    def teacher_forced_logits(tokens):
        return shared_teacher_forced_logits(model, prompt, tokens)

    stock_tokens = [int(t) for t, _ in zip((tok for tok, _ in generate_step(prompt, model, max_tokens=n)), range(n))]
    stock_logits = teacher_forced_logits(stock_tokens)
    decided, _ = decided_positions(stock_logits)

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    monkeypatch.setenv("LILY_REFERENCE_OPS", "moe,deltanet")  # only attention goes to the kernels
    lily_patch.patch(model)
    try:
        # (kv_write_in_trace off: the one-pass kernel over the live rows; the buffer's form is tested below)
        with switches.overrides(disable=list(off) + ["kv_write_in_trace"]), record_launches() as rec:
            logits = teacher_forced_logits(stock_tokens)
        # the prompt through the prefill kernel (tests/kernels/test_attention_prefill.py), then every
        # decode step through the decode kernel, each after the q/k preparation kernel, nothing else
        assert rec.names() == ["attention_qk_prep", "attention_prefill"] + ["attention_qk_prep", "attention_decode"] * (n - 1)
        packed = "gqa_packing" not in off
        decode = [launch for launch in rec if launch.name == "attention_decode"]
        assert {(launch.template["GT"], launch.template["COALESCED"]) for launch in decode} == {
            (8 if packed else 1, int("coalesced_kv" not in off))}
        for pos in range(n):
            assert rel_l2(logits[pos], stock_logits[pos]) < LOGIT_TOL, pos
        choice = np.array(mx.argmax(logits, axis=-1))
        assert decided.sum() >= n // 2, "the embedded model should be decided at most positions"
        assert (choice == np.array(stock_tokens))[decided].all()
    finally:
        lily_patch.unpatch(model)


@needs_sim
@pytest.mark.parametrize("gate_in_merge", [False, True])
def test_embedded_model_decode_over_the_kv_buffer_takes_the_live_length_kernels(monkeypatch, gate_in_merge):
    """``kv_write_in_trace`` where the long-context op has its kernels: every decode step writes its row into the
    buffer and attends over the buffer's capacity through the live-length kernels (no mask, at any context; with
    ``fused_output_gate`` the merge applies the output gate); the logits are those of the switch off (the one-pass
    kernel over the live rows) within bf16 noise."""
    from mlx_lm import load

    from lily_mlx import patch as lily_patch
    from lily_mlx.models.embedded import EMBEDDED_DIR
    from tests.kernels.test_compiled_decode import _greedy_logits

    model, tokenizer = load(str(EMBEDDED_DIR))
    prompt = tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the")
    steps = 4
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    monkeypatch.setenv("LILY_REFERENCE_OPS", "moe,deltanet")
    lily_patch.patch(model)
    try:
        live, _ = _greedy_logits(model, prompt, steps=steps)
        # (every step built, so that each records its launches: a traced backend replays the later ones)
        on = ["kv_write_in_trace"] + (["fused_output_gate"] if gate_in_merge else [])
        off = ["compiled_decode"] + ([] if gate_in_merge else ["fused_output_gate"])
        with switches.overrides(enable=on, disable=off), record_launches() as rec:
            buffered, cache = _greedy_logits(model, prompt, steps=steps)
    finally:
        lily_patch.unpatch(model)
    decode = [name for name in rec.names() if name != "attention_prefill"][1:]  # after the prompt's
    merge = "attention_decode_merge_live_blocks" + ("_gated" if gate_in_merge else "")
    assert decode == ["attention_qk_prep", "attention_decode_block_partials_live", merge] * steps, decode
    capacity = next(c.keys.shape[2] for c in cache if type(c) is KVCache)
    partials = [launch for launch in rec if launch.name == "attention_decode_block_partials_live"]
    assert {launch.kwargs["grid"][0] for launch in partials} == {  # the capacity's blocks at every step
        32 * 2 * -(-capacity // ak.live_block_rows(capacity))}
    for step, (a, b) in enumerate(zip(buffered, live)):
        assert rel_l2(a, b) < LOGIT_TOL, step


@needs_sim
def test_embedded_model_decode_with_device_positions_is_unchanged(monkeypatch):
    """``device_positions`` with the live-length kernels: the KV row write, the rotary embedding and the kernels read
    the position through a view of a wide array made from the last step's; the logits are the host scalar's, bit
    for bit."""
    from mlx_lm import load

    from lily_mlx import patch as lily_patch
    from lily_mlx.models.embedded import EMBEDDED_DIR
    from tests.kernels.test_compiled_decode import _greedy_logits

    model, tokenizer = load(str(EMBEDDED_DIR))
    prompt = tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the")
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    monkeypatch.setenv("LILY_REFERENCE_OPS", "moe,deltanet")
    lily_patch.patch(model)
    try:
        with switches.overrides(enable=["kv_write_in_trace"]):
            host, _ = _greedy_logits(model, prompt, steps=3)
            with switches.overrides(enable=["device_positions"]), record_launches() as rec:
                device, _ = _greedy_logits(model, prompt, steps=3)
    finally:
        lily_patch.unpatch(model)
    assert rec.names().count("attention_decode_block_partials_live") == 3
    for step, (a, b) in enumerate(zip(device, host)):
        assert mx.array_equal(a, b).item(), step


# ---------------------------------------------------------------------------------------------
# the CUDA bridge: every switch state translates and compiles (the model's call site is compiled by
# tests/msl/test_cuda_bridge.py in the default switch state only)

def _assert_compiles_for_cuda(name: str, inputs, output_dtypes, templates) -> None:
    """Kernel ``name``'s CUDA translation compiles (NVRTC or nvcc) at each template of ``templates``."""
    from lily_mlx.msl.cuda import metal_kernel, wrap_like_mlx
    from lily_dev.compile_check import compile_cuda, compiler_available
    from lily_mlx.core.kernel_registry import kernel_source

    if compiler_available() is None:
        pytest.skip("no CUDA compiler (NVRTC or nvcc) installed")
    spec = ak.KERNELS[name]
    header, body = kernel_source(spec)
    kernel = metal_kernel(spec.name, list(spec.input_names), list(spec.output_names), body, header=header)
    for template in templates:
        _, unit = wrap_like_mlx(kernel, inputs, output_dtypes, template=template)
        ok, log = compile_cuda(unit)
        assert ok, log


def test_every_switch_state_compiles_for_cuda():
    q, k = mx.zeros((1, 16, 1, 256), mx.bfloat16), mx.zeros((1, 2, 8, 256), mx.bfloat16)
    _assert_compiles_for_cuda(
        "attention_decode", [q, k, k, mx.zeros((1,)), mx.zeros((1,), mx.int32), mx.zeros((5,), mx.int32)],
        [mx.bfloat16], [[("InT", mx.bfloat16), ("D", 256), ("GT", 8 if packed else 1), ("SG", ak.DECODE_SIMDGROUPS),
                         ("R", ak.DECODE_ROWS_PER_STEP), ("COALESCED", int(coalesced))]
                        for packed, coalesced in SWITCH_STATES])


# ---------------------------------------------------------------------------------------------
# the fixed-block split (fixed_block_attention): block partials, then the merge


@needs_sim
@settings(deadline=None, max_examples=20)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 3, 4, 8]), D=st.sampled_from([64, 128, 256]),
    S=st.sampled_from([1, 40, 129, 300]), block_rows=st.sampled_from([None, 1, 16, 48, 4096]),
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]), state=st.sampled_from(SWITCH_STATES),
    spare=st.sampled_from([0, 5]), rows=st.sampled_from([1, 2, 4]), simdgroups=st.sampled_from([1, 2, 4]),
    sharp=st.booleans(), seed=st.integers(0, 2**16),
)
def test_fixed_block_kernels_match_reference(B, Hkv, G, D, S, block_rows, dtype, state, spare, rows, simdgroups,
                                             sharp, seed):
    """Any number of blocks (one; several with a short last one; up to 300 one-row blocks, so the merge
    runs 32 simdgroups with a partial unrolled tail; blocks shorter than a threadgroup step, so some
    simdgroups have no rows), the schedule's block size (None), every switch state, rows per step and
    simdgroups per threadgroup, spare cache rows, a sharp softmax: the merged result is the
    attention; partials and output are poisoned (NaN)."""
    rng = np.random.default_rng(seed)
    q, k, v = _problem(rng, B, Hkv, G, D, S, DTYPES[dtype], spare)
    packed, coalesced = state
    scale = 1.0 if sharp else D**-0.5
    out = ak.decode_attention_fixed_blocks(q, k, v, scale=scale, block_rows=block_rows, kv_length=S,
                                           gqa_packed=packed, coalesced=coalesced, backend=KERNEL_BACKEND,
                                           init_value=NAN, rows=rows, simdgroups=simdgroups)
    _check(out, _oracle(q, k, v, S, scale), TOL[dtype])


@needs_sim
@settings(deadline=None, max_examples=10)
@given(G_GT=st.sampled_from([(8, 4), (8, 2), (4, 2)]), S=st.sampled_from([1, 129, 300]),
       block_rows=st.sampled_from([None, 16, 48]), dtype=st.sampled_from(["bfloat16", "float32"]),
       seed=st.integers(0, 2**16))
def test_fixed_block_kernels_with_the_heads_of_a_kv_head_split(G_GT, S, block_rows, dtype, seed):
    """The G query heads of a KV head over G / GT threadgroups of GT heads each (a benchmark candidate: fewer
    registers a thread, each K/V row read G / GT times): still the attention, partials and output poisoned."""
    G, GT = G_GT
    rng = np.random.default_rng(seed)
    q, k, v = _problem(rng, 1, 2, G, 256, S, DTYPES[dtype], 3)
    scale = 256**-0.5
    out = ak.decode_attention_fixed_blocks(q, k, v, scale=scale, block_rows=block_rows, kv_length=S,
                                           backend=KERNEL_BACKEND, init_value=NAN, heads_per_threadgroup=GT)
    _check(out, _oracle(q, k, v, S, scale), TOL[dtype])
    with pytest.raises(ValueError, match="does not divide"):
        ak.decode_attention_fixed_blocks(q, k, v, scale=scale, kv_length=S, backend=KERNEL_BACKEND,
                                         heads_per_threadgroup=3)


@needs_sim
@settings(deadline=None, max_examples=10)
@given(B=st.integers(1, 2), G=st.sampled_from([1, 8]), D=st.sampled_from([64, 256]), S=st.sampled_from([1, 77]),
       dtype=st.sampled_from(["bfloat16", "float16", "float32"]), seed=st.integers(0, 2**16))
def test_the_merge_applies_the_output_gate(B, G, D, S, dtype, seed):
    """``fused_output_gate``: the live form's merge writes attention * sigmoid(gate) in the o-projection's input
    layout [B, 1, Hq * D], each product rounded as stock's sigmoid and multiply round them: within one rounding of
    the ungated kernel followed by stock's ops (``layer.gated``), and the attention against the fp32 oracle."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    q, k, v = _problem(rng, B, 2, G, D, S, dt, spare=20)
    gate = _rand(rng, (B, 1, 2 * G * D), dt) * 3
    last = mx.array([S - 1], dtype=mx.int32)
    with record_launches() as rec:
        fused = ak.decode_attention_fixed_blocks_live(q, k, v, last, scale=D**-0.5, backend=KERNEL_BACKEND,
                                                      init_value=NAN, gate=gate)
    assert rec.names() == ["attention_decode_block_partials_live", "attention_decode_merge_live_blocks_gated"]
    assert fused.shape == (B, 1, 2 * G * D) and fused.dtype == dt
    plain = ak.decode_attention_fixed_blocks_live(q, k, v, last, scale=D**-0.5, backend=KERNEL_BACKEND)
    _check(fused, att.gated(plain, gate), 1e-6 if dtype == "float32" else 4e-3)
    _check(fused, att.gated(_oracle(q, k, v, S, D**-0.5), gate), TOL[dtype] + 4e-3)


@needs_sim
@settings(deadline=None, max_examples=12)
@given(S=st.sampled_from([40, 300, 1000]), block_rows=st.sampled_from([None, 16]),
       merge=st.sampled_from([(1, 1), (4, 2), (8, 4), (32, 1)]), live=st.booleans(), seed=st.integers(0, 2**16))
def test_fixed_block_merge_geometries_compute_the_attention(S, block_rows, merge, live, seed):
    """The merge's candidate geometries (MW simdgroups a threadgroup, MV fp32 a lane a load: 1 to 32
    simdgroups, 4- to 16-byte loads, a threadgroup per (head, 32 * MV elements of D)), over the live rows and in
    the live-length form: the attention, outputs and partials poisoned."""
    mw, mv = merge
    rng = np.random.default_rng(seed)
    q, k, v = _problem(rng, 1, 2, 8, 256, S, mx.bfloat16, spare=37)
    knobs = dict(block_rows=block_rows, backend=KERNEL_BACKEND, init_value=NAN, merge_simdgroups=mw,
                 merge_lane_floats=mv)
    with record_launches() as rec:
        if live:
            out = ak.decode_attention_fixed_blocks_live(q, k, v, mx.array([S - 1], dtype=mx.int32), scale=0.0625,
                                                        **knobs)
        else:
            out = ak.decode_attention_fixed_blocks(q, k, v, scale=0.0625, kv_length=S, **knobs)
    merge_launch = rec[1]
    assert merge_launch.template["MV"] == mv and merge_launch.template["MW"] == mw
    assert merge_launch.kwargs["grid"][0] == 32 * 16 * 256 // (32 * mv)
    _check(out, _oracle(q, k, v, S, 0.0625), TOL["bfloat16"])


@needs_sim
@settings(deadline=None, max_examples=16)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 3, 8]), D=st.sampled_from([64, 256]),
    capacity=st.sampled_from([1, 64, 300]), fill=st.floats(0.0, 1.0), block_rows=st.sampled_from([None, 16, 48]),
    dtype=st.sampled_from(["bfloat16", "float32"]), state=st.sampled_from(SWITCH_STATES), sharp=st.booleans(),
    simdgroups=st.sampled_from([None, ak.LIVE_WIDE_SIMDGROUPS]), seed=st.integers(0, 2**16),
)
def test_fixed_block_kernels_with_the_live_length_as_an_array(B, Hkv, G, D, capacity, fill, block_rows, dtype, state,
                                                              sharp, simdgroups, seed):
    """The live-length form (switch kv_write_in_trace) over a buffer's whole capacity: rows 0 .. last_row are
    attended, the rows past them hold NaN (read, they would show) and their blocks write empty partials; the
    launch geometry is the capacity's whatever the live length; 4 or 8 simdgroups a threadgroup (the latter what
    CUDA runs). Partials and output poisoned."""
    rng = np.random.default_rng(seed)
    q, k, v = _problem(rng, B, Hkv, G, D, capacity, DTYPES[dtype])
    S = 1 + int(fill * (capacity - 1))
    dead = mx.arange(capacity).reshape(1, 1, -1, 1) >= S
    k, v = mx.where(dead, NAN, k).astype(k.dtype), mx.where(dead, NAN, v).astype(v.dtype)
    packed, coalesced = state
    scale = 1.0 if sharp else D**-0.5
    with record_launches() as rec:
        out = ak.decode_attention_fixed_blocks_live(q, k, v, mx.array([S - 1], dtype=mx.int32), scale=scale,
                                                    block_rows=block_rows, gqa_packed=packed, coalesced=coalesced,
                                                    backend=KERNEL_BACKEND, init_value=NAN, simdgroups=simdgroups)
    assert rec.names() == ["attention_decode_block_partials_live", "attention_decode_merge_live_blocks"]
    blocks = -(-capacity // (block_rows or ak.live_block_rows(capacity)))  # from the capacity, not S
    sg = simdgroups or ak.live_simdgroups(capacity, KERNEL_BACKEND)  # the backend's (8 on CUDA)
    assert rec[0].kwargs["grid"] == (32 * B * Hkv * (1 if packed else G) * blocks, sg, 1)
    _check(out, _oracle(q, k, v, S, scale), TOL[dtype])


# The matrix-tile form of the live partials (a candidate; kernels/attention/decode.metal, attention_decode_block_tiles):
# its weights are rounded to the input type for the second product (as the prefill kernel's), so its bound is the
# prefill kernel's 2u (u = 2^-9 bf16, 2^-11 fp16) against the fp32 oracle.
TILE_TOL = {"bfloat16": 2 * 2.0**-9, "float16": 2 * 2.0**-11}


@needs_sim
@settings(deadline=None, max_examples=16)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 2), D=st.sampled_from([64, 128, 256]),
    capacity=st.sampled_from([8, 37, 300]), fill=st.floats(0.0, 1.0), block_rows=st.sampled_from([8, 16, 64]),
    simdgroups=st.sampled_from([None, 1, 2]), staged=st.booleans(), dtype=st.sampled_from(["bfloat16", "float16"]),
    sharp=st.booleans(), seed=st.integers(0, 2**16),
)
def test_matrix_tile_partials_match_reference(B, Hkv, D, capacity, fill, block_rows, simdgroups, staged, dtype, sharp,
                                              seed):
    """The matrix-tile partials over a buffer's capacity: the G = 8 heads of a KV head as a tile's rows, one
    simdgroup a block, tiles loaded from device memory or K/V rows staged through threadgroup memory; rows past the
    live length hold NaN (a product that read them would show it: the last partial chunk, fewer than 8 live rows in
    all), partials and output poisoned, the merge unchanged."""
    rng = np.random.default_rng(seed)
    q, k, v = _problem(rng, B, Hkv, 8, D, capacity, DTYPES[dtype])
    S = 1 + int(fill * (capacity - 1))
    dead = mx.arange(capacity).reshape(1, 1, -1, 1) >= S
    k, v = mx.where(dead, NAN, k).astype(k.dtype), mx.where(dead, NAN, v).astype(v.dtype)
    scale = 1.0 if sharp else D**-0.5
    with record_launches() as rec:
        out = ak.decode_attention_tiles_live(q, k, v, mx.array([S - 1], dtype=mx.int32), scale=scale,
                                             backend=KERNEL_BACKEND, block_rows=block_rows, simdgroups=simdgroups,
                                             staged=staged, init_value=NAN)
    assert rec.names() == ["attention_decode_block_partials_live_tiles", "attention_decode_merge_live_blocks"]
    blocks = -(-capacity // block_rows)  # from the capacity, not S
    sg = rec[0].kwargs["threadgroup"][1]
    assert sg == (simdgroups or (2 if staged and D == 256 else ak.TILE_SIMDGROUPS))  # 32 KiB
    assert rec[0].kwargs["grid"] == (32 * -(-(B * Hkv * blocks) // sg), sg, 1)
    _check(out, _oracle(q, k, v, S, scale), TILE_TOL[dtype])


@needs_sim
def test_matrix_tile_partials_at_qwen36_shape_with_a_moving_max():
    """Qwen3.6's shape (16 heads over 2 KV heads, D 256) at 1,000 live rows of 1,280, scores rising along the rows
    (each block's maximum is its last rows'), the product's block rows and simdgroups; a row's bits the same
    alone and in a batch of 3."""
    rng = np.random.default_rng(7)
    q, k, v = _problem(rng, 1, 2, 8, 256, 1280, mx.bfloat16)
    ramp = mx.linspace(0.0, 3.0, 1280).reshape(1, 1, -1, 1)
    k = (k.astype(mx.float32) + ramp * q.astype(mx.float32).reshape(1, 2, 8, 256).mean(axis=2, keepdims=True)
         ).astype(mx.bfloat16)
    last = mx.array([999], dtype=mx.int32)
    out = ak.decode_attention_tiles_live(q, k, v, last, scale=256**-0.5, backend=KERNEL_BACKEND, init_value=NAN)
    _check(out, _oracle(q, k, v, 1000, 256**-0.5), TILE_TOL["bfloat16"])
    staged = ak.decode_attention_tiles_live(q, k, v, last, scale=256**-0.5, backend=KERNEL_BACKEND, staged=True)
    assert bool(mx.array_equal(staged, out).item())  # the same products on the same values: the same bits
    q3, k3, v3 = (mx.concatenate([x, _rand(rng, x.shape, x.dtype), _rand(rng, x.shape, x.dtype)]) for x in (q, k, v))
    out3 = ak.decode_attention_tiles_live(q3, k3, v3, last, scale=256**-0.5, backend=KERNEL_BACKEND)
    assert bool(mx.array_equal(out3[:1], out).item())


@needs_sim
@pytest.mark.parametrize("capacity, S, block_rows", [(64, 61, 16), (40, 5, 16), (300, 293, 64), (300, 131, 8)],
                         ids=["partial-last-chunk", "under-8-rows", "partial-last-block", "one-chunk-blocks"])
def test_matrix_tile_staged_form_has_the_same_bits_where_the_forms_differ(capacity, S, block_rows):
    """The staged form reads the same rows into the same products as the form from memory: the same bits, also
    where their code differs (a last chunk of fewer than 8 live rows: a window ending at the last row, V staged
    with zeros under 8 rows in all)."""
    rng = np.random.default_rng(11)
    q, k, v = _problem(rng, 1, 1, 8, 64, capacity, mx.bfloat16)
    last = mx.array([S - 1], dtype=mx.int32)
    forms = [ak.decode_attention_tiles_live(q, k, v, last, scale=0.125, backend=KERNEL_BACKEND, block_rows=block_rows,
                                           simdgroups=2, staged=staged, init_value=NAN) for staged in (False, True)]
    _check(forms[0], _oracle(q, k, v, S, 0.125), TILE_TOL["bfloat16"])
    assert bool(mx.array_equal(forms[1], forms[0]).item())


@needs_sim
@pytest.mark.skipif(KERNEL_BACKEND != "sim", reason="the race check is the simulator's")
@pytest.mark.parametrize("staged", [False, True], ids=["tiles-from-memory", "staged"])
@pytest.mark.parametrize("capacity, S", [(64, 61), (40, 5)], ids=["partial-last-chunk", "under-8-rows"])
def test_matrix_tile_partials_race_check(monkeypatch, capacity, S, staged):
    """The simulator's race check on the per-simdgroup scores, weights and staged V (simdgroup barriers only)."""
    monkeypatch.setenv("LILY_MSL_RACE", "1")
    rng = np.random.default_rng(3)
    q, k, v = _problem(rng, 1, 1, 8, 64, capacity, mx.bfloat16)
    out = ak.decode_attention_tiles_live(q, k, v, mx.array([S - 1], dtype=mx.int32), scale=0.125,
                                         backend=KERNEL_BACKEND, block_rows=16, simdgroups=2, staged=staged,
                                         init_value=NAN)
    _check(out, _oracle(q, k, v, S, 0.125), TILE_TOL["bfloat16"])


def test_matrix_tile_partials_refuse_other_shapes():
    q, k = mx.zeros((1, 12, 1, 64), mx.bfloat16), mx.zeros((1, 2, 16, 64), mx.bfloat16)  # G = 6
    assert "G = 6" in ak.tiles_problem(q, k, k)
    q32, k32 = q.astype(mx.float32)[:, :8], k[:, :1].astype(mx.float32)
    assert "16-bit" in ak.tiles_problem(q32, k32, k32)
    short = mx.zeros((1, 1, 7, 64), mx.bfloat16)
    assert ">= 8" in ak.tiles_problem(mx.zeros((1, 8, 1, 64), mx.bfloat16), short, short)
    # What the merge after the partials does not take (head dims outside the decode kernels'), and mixed types.
    for d in (16, 40):
        qd, kd = mx.zeros((1, 8, 1, d), mx.bfloat16), mx.zeros((1, 1, 16, d), mx.bfloat16)
        assert "head dim" in ak.tiles_problem(qd, kd, kd)
    q8 = mx.zeros((1, 8, 1, 64), mx.bfloat16)
    k16 = mx.zeros((1, 1, 16, 64), mx.float16)
    assert "dtypes" in ak.tiles_problem(q8, k16, k16)
    assert ak.tiles_problem(q8, k16.astype(mx.bfloat16), k16.astype(mx.bfloat16)) is None
    with pytest.raises(ValueError, match="G = 6"):
        ak.decode_attention_tiles_live(q, k, k, mx.array([3], dtype=mx.int32), scale=1.0, backend="sim")
    q8, k8 = mx.zeros((1, 8, 1, 256), mx.bfloat16), mx.zeros((1, 1, 16, 256), mx.bfloat16)
    with pytest.raises(ValueError, match="32 KiB"):  # Apple's limit: 8 simdgroups at D = 256
        ak.decode_attention_tiles_live(q8, k8, k8, mx.array([3], dtype=mx.int32), scale=1.0, backend="sim",
                                       simdgroups=8)


def test_matrix_tile_partials_compile_for_cuda():
    q, k = mx.zeros((1, 16, 1, 256), mx.bfloat16), mx.zeros((1, 2, 64, 256), mx.bfloat16)
    _assert_compiles_for_cuda(
        "attention_decode_block_partials_live_tiles",
        [q, k, k, mx.zeros((1,)), mx.zeros((1,), mx.int32), mx.zeros((4,), mx.int32)], [mx.float32] * 3,
        [[("InT", mx.bfloat16), ("D", 256), ("SG", sg), ("BRM", brm), ("STAGED", staged)]
         for sg, brm, staged in ((4, 128, 0), (2, 64, 0), (2, 128, 1))])


def test_the_live_form_widens_its_threadgroups_on_cuda():
    """The live form's simdgroups a threadgroup are a function of the buffer's capacity and the backend alone:
    8 on CUDA from LIVE_WIDE_MIN_CAPACITY rows (0: timed faster at 4K, 32K and 128K), else the default 4 (Metal
    and the simulator keep the form they always ran); a threshold, where one is set, is a capacity."""
    wide, narrow = ak.LIVE_WIDE_SIMDGROUPS, ak.DECODE_SIMDGROUPS
    assert (wide, narrow, ak.LIVE_WIDE_MIN_CAPACITY) == (8, 4, 0)
    assert {ak.live_simdgroups(cap, "cuda") for cap in (1024, 5120, 32 * 1024, 128 * 1024 + 1024)} == {wide}
    assert {ak.live_simdgroups(128 * 1024, b) for b in ("metal", "sim", "reference")} == {narrow}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ak, "LIVE_WIDE_MIN_CAPACITY", 32 * 1024)
        assert [ak.live_simdgroups(cap, "cuda") for cap in (32 * 1024 - 1, 32 * 1024)] == [narrow, wide]


@needs_sim
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fixed_block_kernels_qwen36_shape(dtype):
    """Qwen3.6's shape (16 query heads over 2 KV heads, D = 256) through the schedule's geometry at a
    context that is no multiple of the block, 16-byte loads, a late maximum (scores rise along the
    sequence, so every step moves the running max and rescales)."""
    rng = np.random.default_rng(11)
    S = 1000
    q, k, v = _problem(rng, 1, 2, 8, 256, S, DTYPES[dtype], spare=7)
    ramp = mx.linspace(0.0, 3.0, S + 7).reshape(1, 1, -1, 1)
    k = (k.astype(mx.float32) + ramp * q.astype(mx.float32).mean(axis=1, keepdims=True)).astype(k.dtype)
    plan = ak.fixed_block_plan(S, 256, 2)
    assert plan.blocks == -(-S // plan.block_rows) and plan.blocks > 1
    with record_launches() as rec:
        out = ak.decode_attention_fixed_blocks(q, k, v, scale=0.25, kv_length=S, backend=KERNEL_BACKEND,
                                               init_value=NAN)
    assert rec.names() == ["attention_decode_block_partials", "attention_decode_merge_blocks"]
    assert rec[0].kwargs["grid"] == (32 * 2 * plan.blocks, ak.DECODE_SIMDGROUPS, 1)
    assert rec[0].template["R"] == ak.DECODE_ROWS_PER_STEP and rec[0].template["GT"] == 8
    assert rec[1].kwargs["grid"] == (32 * 16 * 2, plan.merge_simdgroups, 1)  # (head, half of D) per threadgroup
    _check(out, _oracle(q, k, v, S, 0.25), TOL[dtype])


def test_fixed_block_schedule_depends_on_the_context_only():
    """Rows per block: a power of two from the context length alone, at least FIXED_BLOCK_MIN_ROWS;
    enough blocks to fill a GPU at long context; the whole plan (blocks, merge geometry) is a
    function of S and D, whatever the batch."""
    assert [ak.fixed_block_rows(S) for S in (1, 4096, 32768, 65536, 131072)] == [64, 64, 128, 256, 512]
    for S in (1, 63, 64, 65, 4095, 4097, 50000, 131072, 10**6):
        br = ak.fixed_block_rows(S)
        assert br & (br - 1) == 0 and ak.FIXED_BLOCK_MIN_ROWS <= br <= ak.FIXED_BLOCK_MAX_ROWS
        plans = {ak.fixed_block_plan(S, 256, n)[:2] + ak.fixed_block_plan(S, 256, n)[3:] for n in (2, 4, 16, 64)}
        assert len(plans) == 1
        nb = -(-S // br)
        assert (nb - 1) * br < S <= nb * br
    assert ak.fixed_block_plan(32768, 256, 2).partial_threadgroups >= 512


# ---------------------------------------------------------------------------------------------
# the split over a batch's rows (op attention_decode_batch): each row's blocks from its own left padding


def _rows_alone(q, k, v, pads, S, target, **kw):
    """Each row of a left-padded batch alone: its live keys in a buffer of their own, through the single sequence's
    split with the block size and simdgroups the row's own length gives."""
    outs = []
    for b, pad in enumerate(pads):
        L = S - pad
        outs.append(ak.decode_attention_fixed_blocks(
            q[b:b + 1], k[b:b + 1, :, pad:S], v[b:b + 1, :, pad:S], kv_length=L, block_rows=ak.fixed_block_rows(L, target),
            simdgroups=ak.batch_simdgroups(KERNEL_BACKEND), **kw))
    return outs


@needs_sim
@settings(deadline=None, max_examples=16)
@given(
    B=st.integers(1, 3), Hkv=st.integers(1, 2), G=st.sampled_from([1, 4, 8]), D=st.sampled_from([64, 128, 256]),
    S=st.sampled_from([1, 9, 130, 300]), target=st.sampled_from([1, 3, 8, 128]),
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]), state=st.sampled_from(SWITCH_STATES),
    spare=st.sampled_from([0, 5]), sharp=st.booleans(), min_rows=st.sampled_from([4, 16, 64]), data=st.data(),
)
def test_batch_rows_split_matches_reference_and_each_row_alone(B, Hkv, G, D, S, target, dtype, state, spare, sharp,
                                                               min_rows, data):
    """Rows of a BatchKVCache-like buffer with drawn left padding (a row may hold one key; every row's blocks of its
    own size, from many short blocks (the schedule's smallest block lowered) with a short last one up to one block,
    rows of one launch with different block sizes): each row bit for bit the same sequence alone in the single
    sequence's split with its own block size, and the fp32 oracle over its live keys; partials and output poisoned
    (NaN), so a row's blocks past its own count must be skipped by the merge."""
    pads = data.draw(st.lists(st.integers(0, S - 1), min_size=B, max_size=B), label="pads")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    q, k, v = _problem(rng, B, Hkv, G, D, S, DTYPES[dtype], spare)
    packed, coalesced = state
    scale = 1.0 if sharp else D**-0.5
    kw = dict(scale=scale, gqa_packed=packed, coalesced=coalesced, backend=KERNEL_BACKEND, init_value=NAN)
    with mock.patch.object(ak, "FIXED_BLOCK_MIN_ROWS", min_rows):
        batch = ak.decode_attention_fixed_blocks_rows(q, k, v, mx.array(pads), kv_length=S, target_blocks=target, **kw)
        alones = _rows_alone(q, k, v, pads, S, target, **kw)
    for b, (pad, alone) in enumerate(zip(pads, alones)):
        assert bool(mx.array_equal(batch[b:b + 1], alone).item()), (b, pad)
        _check(batch[b:b + 1], _oracle(q[b:b + 1], k[b:b + 1, :, pad:], v[b:b + 1, :, pad:], S - pad, scale), TOL[dtype])


@needs_sim
def test_batch_rows_bits_do_not_depend_on_the_other_rows():
    """One sequence's row in batches of other companions, other left padding and other padded lengths (a longer
    companion pads it more, a shorter one not at all), at the schedule's own target: the same bits every time."""
    rng = np.random.default_rng(31)
    Hkv, G, D, L = 2, 8, 128, 200
    q0, k0, v0 = _problem(rng, 1, Hkv, G, D, L, mx.bfloat16)
    kw = dict(scale=0.1, backend=KERNEL_BACKEND, init_value=NAN, target_blocks=4)
    outs = []
    for others in ([], [50], [700], [5, 450]):
        S = max([L, *others])
        rows = [(q0, k0, v0, L)] + [(*_problem(rng, 1, Hkv, G, D, n, mx.bfloat16), n) for n in others]
        pads = [S - n for *_, n in rows]
        pad_rows = lambda x, p: mx.concatenate([_rand(rng, (1, Hkv, p, D), mx.bfloat16), x], axis=2)
        q = mx.concatenate([r[0] for r in rows])
        k = mx.concatenate([pad_rows(r[1], p) for r, p in zip(rows, pads)])
        v = mx.concatenate([pad_rows(r[2], p) for r, p in zip(rows, pads)])
        outs.append(ak.decode_attention_fixed_blocks_rows(q, k, v, mx.array(pads), kv_length=S, **kw)[:1])
    for out in outs[1:]:
        assert bool(mx.array_equal(out, outs[0]).item())


@needs_sim
def test_batch_rows_through_a_batch_kv_cache_and_its_filter():
    """The op over mlx_lm's BatchKVCache as the server drives it: a step, then ``filter`` drops a row (which trims the
    common left padding, so every kept row's keys move in the buffer): the kept rows' bits are the same as the same
    rows' in a batch built without the dropped row, and match stock's masked attention."""
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import BatchKVCache

    rng = np.random.default_rng(32)
    Hkv, G, D = 2, 8, 64
    lengths = [40, 9, 25]  # prompt rows; the first is the longest: dropping it trims 15 rows of everyone's padding
    S = max(lengths)
    q, k, v = _problem(rng, 3, Hkv, G, D, S + 1, mx.bfloat16)

    def step(rows):
        pads = [S - lengths[i] for i in rows]
        cache = _filled_cache(BatchKVCache, k[mx.array(rows), :, :S], v[mx.array(rows), :, :S], left_padding=pads)
        return cache

    def attend(cache, rows):
        mask = create_attention_mask(mx.zeros((len(rows), 1, 8)), cache)
        keys, values = cache.update_and_fetch(k[mx.array(rows), :, S:], v[mx.array(rows), :, S:])
        out = ak.decode_attention_fixed_blocks_rows_from_cache(KERNEL_BACKEND)(
            q[mx.array(rows)], keys, values, scale=0.125, mask=mask, cache=cache)
        want = attref.attention_reference(*(x.astype(mx.float32) for x in (q[mx.array(rows)], keys, values)),
                                          scale=0.125, mask=mask).astype(q.dtype)
        _check(out, want, TOL["bfloat16"])
        return out

    full = step([0, 1, 2])
    full.filter(mx.array([1, 2]))  # the longest row leaves: the common padding (15 rows) is trimmed
    assert full.left_padding.tolist() == [16, 0]
    kept = attend(full, [1, 2])
    fresh = attend(step([1, 2]), [1, 2])
    assert bool(mx.array_equal(kept, fresh).item())


def test_row_blocks_bound_is_the_most_blocks_a_row_can_have():
    # the kernels double MIN_ROWS up to MAX_ROWS (attention_row_block_rows): the host's schedule only while both are
    # powers of two
    for rows in (ak.FIXED_BLOCK_MIN_ROWS, ak.FIXED_BLOCK_MAX_ROWS):
        assert rows & (rows - 1) == 0, rows
    for target in (1, 3, 4, 128):
        for S in (1, 63, 64, 65, 200, 256, 257, 1000, 5000):
            counts = [-(-L // ak.fixed_block_rows(L, target)) for L in range(1, S + 1)]
            assert ak.row_blocks_bound(S, target) == max(counts), (target, S)


@needs_sim
@pytest.mark.skipif(KERNEL_BACKEND != "sim", reason="the race check is the simulator's")
def test_batch_rows_split_race_check(monkeypatch):
    """The simulator's race check on the row partials' threadgroup merge, rows with one and several blocks."""
    monkeypatch.setenv("LILY_MSL_RACE", "1")
    rng = np.random.default_rng(33)
    q, k, v = _problem(rng, 2, 1, 4, 64, 70, mx.bfloat16)
    out = ak.decode_attention_fixed_blocks_rows(q, k, v, mx.array([0, 66]), scale=0.125, kv_length=70,
                                                target_blocks=2, backend=KERNEL_BACKEND, init_value=NAN)
    for b, pad in enumerate((0, 66)):
        _check(out[b:b + 1], _oracle(q[b:b + 1], k[b:b + 1, :, pad:], v[b:b + 1, :, pad:], 70 - pad, 0.125),
               TOL["bfloat16"])


def test_batch_rows_split_compiles_for_cuda():
    q, k = mx.zeros((2, 16, 1, 256), mx.bfloat16), mx.zeros((2, 2, 8, 256), mx.bfloat16)
    starts = mx.zeros((2,), mx.int32)
    _assert_compiles_for_cuda(
        "attention_decode_block_partials_rows", [q, k, k, mx.zeros((1,)), starts, mx.zeros((8,), mx.int32)],
        [mx.float32] * 3,
        [[("InT", mx.bfloat16), ("D", 256), ("GT", 8 if packed else 1), ("SG", ak.batch_simdgroups("cuda")),
          ("R", ak.rows_per_step(8 if packed else 1)), ("COALESCED", int(coalesced))]
         for packed, coalesced in SWITCH_STATES])
    _assert_compiles_for_cuda(
        "attention_decode_merge_row_blocks",
        [mx.zeros((32, 2)), mx.zeros((32, 2)), mx.zeros((32, 2, 256)), starts, mx.zeros((6,), mx.int32)],
        [mx.bfloat16], [[("InT", mx.bfloat16), ("D", 256), ("MV", 4), ("MW", ak.MERGE_SIMDGROUPS)]])


@needs_sim
@pytest.mark.parametrize("long_path", [False, True])
def test_decode_kernels_batch_invariant(long_path):
    """A row's output is bitwise the same alone and in a batch of 3 (other rows hold other data): the
    geometry and the fixed-block plan depend only on the row's own length."""
    rng = np.random.default_rng(12)
    q, k, v = _problem(rng, 3, 2, 8, 128, 150, mx.bfloat16, spare=2)
    run = ak.decode_attention_fixed_blocks if long_path else ak.decode_attention
    kw = dict(scale=0.2, kv_length=150, backend=KERNEL_BACKEND, init_value=NAN)
    batch = run(q, k, v, **kw)
    for b in range(3):
        alone = run(q[b:b + 1], k[b:b + 1], v[b:b + 1], **kw)
        assert bool(mx.array_equal(alone, batch[b:b + 1]).item()), b


@needs_sim
def test_long_context_decode_takes_the_fixed_block_kernels(monkeypatch):
    """From the fixed-block threshold on (lowered here from 32K) Qwen3.6's head shape (D = 256, G = 8)
    decodes through the two fixed-block launches, with the cache read in place and the schedule's
    block size; below it, or with fixed_block_attention off, through the one-pass kernel; all match
    stock's attention."""
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    monkeypatch.setattr(ak, "FIXED_BLOCK_MIN_CONTEXT", 64)
    monkeypatch.setattr(ak, "FIXED_BLOCK_TARGET_BLOCKS", 4)
    monkeypatch.setattr(ak, "FIXED_BLOCK_MIN_ROWS", 16)
    rng = np.random.default_rng(6)
    q, k, v = _problem(rng, 1, 2, 8, 256, 100, mx.bfloat16)
    for rows, off, want in ((100, (), ["attention_decode_block_partials", "attention_decode_merge_blocks"]),
                            (100, ("fixed_block_attention",), ["attention_decode"]),
                            (50, (), ["attention_decode"])):
        cache = _filled_cache(KVCache, k[:, :, :rows - 1], v[:, :, :rows - 1])
        keys, values = cache.update_and_fetch(k[:, :, rows - 1:rows], v[:, :, rows - 1:rows])
        with switches.overrides(disable=off), record_launches() as rec:
            out = att.attention(q, keys, values, scale=0.0625, mask=None, cache=cache)
        assert rec.names() == want, (rows, off, rec.names())
        if want[0] == "attention_decode_block_partials":
            assert ak.fixed_block_rows(rows) == 32  # 100 / 4 blocks -> 32 rows
            assert rec[0].kwargs["grid"][0] == 32 * 2 * 4  # Hkv threadgroups per block (G packed), 4 blocks
        _check(out, _oracle(q, keys, values, rows, 0.0625), TOL["bfloat16"])


def test_fixed_block_kernels_enabled_where_they_passed_on_a_gpu():
    """The fixed-block kernels run on CUDA (these tests passed on an H200, and they beat stock's SDPA
    there from 32K); the one-pass kernel does not (stock's SDPA is faster on a large GPU)."""
    assert ak.LONG_BACKENDS == frozenset({"sim", "cuda"}) and ak.DECODE_BACKENDS == frozenset({"sim"})


def test_fixed_block_kernels_compile_for_cuda():
    """The block-partials kernel in every switch state and rows per step, its live-length form, and the merge
    kernel at each slice width, translate and compile."""
    from lily_mlx.msl.cuda import metal_kernel, wrap_like_mlx
    from lily_dev.compile_check import compile_cuda, compiler_available
    from lily_mlx.core.kernel_registry import kernel_source

    if compiler_available() is None:
        pytest.skip("no CUDA compiler (NVRTC or nvcc) installed")

    def build(name):
        spec = ak.KERNELS[name]
        header, body = kernel_source(spec)
        return metal_kernel(spec.name, list(spec.input_names), list(spec.output_names), body, header=header)

    partials, merge = build("attention_decode_block_partials"), build("attention_decode_merge_blocks")
    q, k = mx.zeros((1, 16, 1, 256), mx.bfloat16), mx.zeros((1, 2, 8, 256), mx.bfloat16)
    units = []
    for (packed, coalesced), rows in zip(SWITCH_STATES, (4, 2, 1, 4)):
        template = [("InT", mx.bfloat16), ("D", 256), ("GT", 8 if packed else 1), ("SG", ak.DECODE_SIMDGROUPS),
                    ("R", rows), ("COALESCED", int(coalesced))]
        units.append(wrap_like_mlx(partials, [q, k, k, mx.zeros((1,)), mx.zeros((6,), mx.int32)],
                                   [mx.float32] * 3, template=template)[1])
    live_parts = [mx.zeros((16, 2)), mx.zeros((16, 2)), mx.zeros((16, 2, 256))]
    merge_template = [("InT", mx.bfloat16), ("D", 256), ("MV", 4), ("MW", ak.MERGE_SIMDGROUPS)]
    for name, gate in (("attention_decode_merge_live_blocks", []),
                       ("attention_decode_merge_live_blocks_gated", [mx.zeros((1, 1, 16 * 256), mx.bfloat16)])):
        units.append(wrap_like_mlx(build(name), live_parts + gate + [mx.zeros((1,), mx.int32), mx.zeros((2,), mx.int32)],
                                   [mx.bfloat16], template=merge_template)[1])
    live = build("attention_decode_block_partials_live")
    for sg in (ak.DECODE_SIMDGROUPS, ak.LIVE_WIDE_SIMDGROUPS):
        live_template = [(name, sg if name == "SG" else value) for name, value in template]
        units.append(wrap_like_mlx(live, [q, k, k, mx.zeros((1,)), mx.zeros((1,), mx.int32), mx.zeros((5,), mx.int32)],
                                   [mx.float32] * 3, template=live_template)[1])
    parts = [mx.zeros((16, 2)), mx.zeros((16, 2)), mx.zeros((16, 2, 256)), mx.zeros((1,), mx.int32)]
    for D, mv in ((256, 4), (64, 2)):
        units.append(wrap_like_mlx(merge, parts, [mx.bfloat16],
                                   template=[("InT", mx.bfloat16), ("D", D), ("MV", mv), ("MW", ak.MERGE_SIMDGROUPS)])[1])
    for unit in units:
        ok, log = compile_cuda(unit)
        assert ok, log
        assert "attention_u4" in unit


@needs_sim
def test_microbench_cases_for_the_bench_harness():
    """The attention cases the kernels mode times (small contexts here): each runs, and the lily cases
    compute the same attention as stock's fused kernel."""
    from lily_dev import attention_bench

    cases = attention_bench.microbench_cases(backend=KERNEL_BACKEND, contexts=(100,), prefill_cached=(),
                                             qk_prep_chunks=(), kv_bits=(),
                                             batch_compositions=(attention_bench.BATCH_LENGTHS,))
    # the other batches timed by default: 1, 2 and 8 rows, distinct names
    assert sorted(len(c) for c in attention_bench.BATCH_COMPOSITIONS) == [1, 2, 4, 8]
    names = [name for name, *_ in cases]
    assert names == ["attention_stock_sdpa_S100", "attention_stock_sdpa_x8_S100", "attention_decode_gqa_S100",
                     "attention_decode_per_head_S100", "attention_fixed_blocks_auto_S100",
                     "attention_fixed_blocks_auto_small_S100", "attention_fixed_blocks_auto_r2_S100",
                     "attention_fixed_blocks_auto_sg8_S100", "attention_fixed_blocks_auto_small_sg8_S100",
                     "attention_fixed_blocks_auto_small_r2_S100", "attention_fixed_blocks_auto_per_head_S100",
                     "attention_fixed_blocks_auto_gt4_S100", "attention_fixed_blocks_auto_x8_S100",
                     "attention_fixed_blocks_auto_gt4_x8_S100", "attention_in_buffer_masked_sdpa_x8_S100",
                     "attention_fixed_blocks_live_x8_S100", "attention_fixed_blocks_live_sg4_x8_S100",
                     "attention_fixed_blocks_live_sg8_x8_S100", "attention_batch_stock_masked_sdpa_b4_x8_S100",
                     "attention_batch_rows_b4_x8_S100", "attention_batch_rows_t32_b4_x8_S100",
                     "attention_batch_rows_t8_b4_x8_S100", "attention_batch_rows_sg4_b4_x8_S100",
                     "attention_batch_one_pass_b4_x8_S100"]
    one = (2 * 2 * 100 * 256 + 2 * 16 * 256) * 2, 4 * 16 * 100 * 256
    live = 100 + 50 + 25 + 12  # the batch's rows: S, S / 2, S / 4, S / 8 keys
    batch = 8 * (2 * 2 * live * 256 + 2 * 4 * 16 * 256) * 2, 8 * 4 * 16 * live * 256
    for name, run_once, nbytes, flops in cases:
        run_once()
        times = 8 if "_x8_" in name else 1
        want = batch if "_batch_" in name else (times * one[0], times * one[1])
        assert (nbytes, flops) == want, name
    # the variants compute the same attention
    rng = np.random.default_rng(9)
    q, k, v = _problem(rng, 1, 2, 8, 256, 300, mx.bfloat16)
    want = _oracle(q, k, v, 300, 0.0625)
    for variant in attention_bench.FIXED_BLOCK_VARIANTS:
        _check(attention_bench._fixed_blocks(q, k, v, 0.0625, KERNEL_BACKEND, 300, variant), want, TOL["bfloat16"])
