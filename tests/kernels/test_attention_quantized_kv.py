"""Decode attention over a quantized KV cache (MLX-LM's ``QuantizedKVCache``, ``--kv-bits``): the kernels
``attention_decode_quantized`` and ``attention_decode_block_partials_quantized`` (kernels/attention/decode.metal,
``AttentionQuantizedRows``) read the packed rows and dequantise them in registers.

The oracle: the cache's rows dequantised in fp32 (``mx.dequantize`` with fp32 scales and biases), then
``attention_reference`` in fp32, delivered in the queries' dtype; outputs poisoned with NaN so unwritten elements
show. Then: at least as close to that oracle as stock's quantized attention, the dispatch (a decode step over a
``QuantizedKVCache`` takes the kernels, the fixed-block split from the threshold; other bit widths and masks fall
back to stock, logged once), the race check, the CUDA compile, and the patched embedded model generating with
``kv_bits`` against stock.
"""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from lily_mlx.core import switches
from lily_mlx.core.kernel_registry import record_launches
from lily_mlx.ops.attention import kernels as ak
from lily_mlx.ops.attention import layer as att
from lily_mlx.ops.attention import reference as attref
from lily_mlx.ops.deltanet import kernels as deltanet_kernels
from tests.kernels.kernel_backend import KERNEL_BACKEND, kernel_backend_problem
from tests.kernels.kernel_backend import attention_kernels_on_test_backend  # noqa: F401 (autouse fixture)
from tests.kernels.model_checks import check_fallbacks_match_stock
from tests.ops.deltanet_cases import rel_l2

SIM_MISSING = kernel_backend_problem() or deltanet_kernels.backend_unavailable_reason(KERNEL_BACKEND)
needs_sim = pytest.mark.skipif(SIM_MISSING is not None, reason=f"{KERNEL_BACKEND} kernels not available: {SIM_MISSING}")

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
TOL = {"float32": 1e-5, "bfloat16": 2e-3, "float16": 2e-3}
NAN = float("nan")


def _rand(rng, shape, dtype):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _quantized_problem(rng, B, Hkv, G, D, rows, dtype, bits, group_size):
    """queries [B, Hq, 1, D]; keys / values as a quantized cache's (packed, scales, biases) of ``rows`` rows."""
    q = _rand(rng, (B, Hkv * G, 1, D), dtype)
    k = tuple(mx.quantize(_rand(rng, (B, Hkv, rows, D), dtype), group_size=group_size, bits=bits))
    v = tuple(mx.quantize(_rand(rng, (B, Hkv, rows, D), dtype), group_size=group_size, bits=bits))
    return q, k, v


def _dequantized(parts, S, bits, group_size):
    packed, scales, biases = (x[:, :, :S] for x in parts)
    return mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)


def _oracle(q, k, v, S, scale, bits, group_size):
    f32 = [_dequantized(x, S, bits, group_size) for x in (k, v)]
    return attref.attention_reference(q.astype(mx.float32), *f32, scale=scale).astype(q.dtype)


def _check(out, ref, tol):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not bool(mx.any(mx.isnan(out)).item()), "unwritten output"
    assert rel_l2(out, ref) < tol


def _stock_quantized_attention(q, k, v, *, scale, bits, group_size):
    """Stock's quantized attention on the CPU stream: MLX's CUDA backend (0.32.4) raises "No implementation" at some
    of its shapes and gave every head one head's output at another (H100, 2026-12-05), so the comparison with stock
    stays meaningful on every kernel backend."""
    with mx.stream(mx.cpu):
        out = quantized_scaled_dot_product_attention(q, k, v, scale=scale, mask=None, group_size=group_size, bits=bits)
        mx.eval(out)
    return out


# the launches of a decode step over a quantized cache: the fixed-block split, or the one-pass kernel
SPLIT = ["attention_decode_block_partials_quantized", "attention_decode_merge_blocks"]
ONE_PASS = ["attention_decode_quantized"]
# what a step below the fixed-block threshold launches: a GPU takes the split at every context (kernels.py)
SHORT = SPLIT if KERNEL_BACKEND in ak.QUANTIZED_SPLIT_BACKENDS else ONE_PASS


@needs_sim
@settings(deadline=None, max_examples=30)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 2, 3, 8]), D=st.sampled_from([64, 128, 256]),
    S=st.sampled_from([1, 7, 33, 130]), spare=st.sampled_from([0, 5]), bits=st.sampled_from([2, 4, 8]),
    group_size=st.sampled_from([32, 64, 128]), dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
    packed=st.booleans(), block_rows=st.sampled_from([None, 16, 64]), rows=st.sampled_from([1, 4]),
    sharp=st.booleans(), seed=st.integers(0, 2**16),
)
def test_quantized_decode_kernels_match_the_dequantized_oracle(B, Hkv, G, D, S, spare, bits, group_size, dtype,
                                                               packed, block_rows, rows, sharp, seed):
    """The one-pass kernel (block_rows None) and the fixed-block split on drawn shapes, bit widths and group sizes,
    over a buffer with spare rows past the live ones, a sharp softmax (the running max moves) or the usual one."""
    if D % group_size:
        group_size = D
    rng = np.random.default_rng(seed)
    q, k, v = _quantized_problem(rng, B, Hkv, G, D, S + spare, DTYPES[dtype], bits, group_size)
    scale = 1.0 if sharp else D**-0.5
    out = ak.decode_attention_quantized(q, k, v, scale=scale, bits=bits, group_size=group_size, kv_length=S,
                                        gqa_packed=packed, fixed_blocks=block_rows is not None, block_rows=block_rows,
                                        rows=rows, backend=KERNEL_BACKEND, init_value=NAN)
    _check(out, _oracle(q, k, v, S, scale, bits, group_size), TOL[dtype])


@needs_sim
@settings(deadline=None, max_examples=20)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 3, 8]), D=st.sampled_from([64, 128, 256]),
    S=st.sampled_from([1, 40, 300]), spare=st.sampled_from([0, 9, 200]), bits=st.sampled_from([2, 4, 8]),
    group_size=st.sampled_from([32, 64, 128]), dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
    packed=st.booleans(), gated=st.booleans(), block_rows=st.sampled_from([None, 16, 128]), seed=st.integers(0, 2**16),
)
def test_quantized_live_length_form_matches_the_dequantized_oracle(B, Hkv, G, D, S, spare, bits, group_size, dtype,
                                                                   packed, gated, block_rows, seed):
    """The live-length form over a quantized cache's whole buffers (``kv_write_in_trace``): blocks over the
    capacity (the schedule's rows a block, or ``block_rows`` drawn), the live
    rows 0 .. last_row read from an array, with and without the output gate in the merge; partials and outputs
    poisoned."""
    if D % group_size:
        group_size = D
    rng = np.random.default_rng(seed)
    q, k, v = _quantized_problem(rng, B, Hkv, G, D, S + spare, DTYPES[dtype], bits, group_size)
    gate = _rand(rng, (B, 1, Hkv * G * D), DTYPES[dtype]) if gated else None
    out = ak.decode_attention_quantized_live(q, k, v, mx.array([S - 1], dtype=mx.int32), scale=D**-0.5, bits=bits,
                                             group_size=group_size, gqa_packed=packed, backend=KERNEL_BACKEND,
                                             init_value=NAN, gate=gate, block_rows=block_rows)
    want = _oracle(q, k, v, S, D**-0.5, bits, group_size)
    if gated:
        want = (want.astype(mx.float32).transpose(0, 2, 1, 3).reshape(B, 1, -1)
                * mx.sigmoid(gate.astype(mx.float32))).astype(want.dtype)
    _check(out, want, TOL[dtype] if not gated else 4 * TOL[dtype])


def _one_step_caches(rng, Hq, rows, D, bits, q_dtype):
    """q [1, Hq, 1, D] in ``q_dtype``, the step's gate, K / V [1, 2, rows, D] bf16, and two QuantizedKVCaches of the
    first rows - 1 rows: ``ours`` (for the step under test) and ``stock``, which took the last row through MLX-LM's
    ``update_and_fetch`` (its live (keys, values) returned too)."""
    q, gate = _rand(rng, (1, Hq, 1, D), q_dtype), _rand(rng, (1, 1, Hq * D), q_dtype)
    k, v = _rand(rng, (1, 2, rows, D), mx.bfloat16), _rand(rng, (1, 2, rows, D), mx.bfloat16)
    ours, stock = QuantizedKVCache(group_size=64, bits=bits), QuantizedKVCache(group_size=64, bits=bits)
    for cache in (ours, stock):
        cache.update_and_fetch(k[:, :, :rows - 1], v[:, :, :rows - 1])
    live = stock.update_and_fetch(k[:, :, rows - 1:], v[:, :, rows - 1:])
    return q, gate, k[:, :, rows - 1:], v[:, :, rows - 1:], ours, stock, live


@needs_sim
def test_a_row_written_into_the_buffers_is_the_cache_update(monkeypatch):
    """``attend_in_buffer`` over a quantized cache's buffers (a step with ``kv_write_in_trace``): the row quantised
    and written at the offset gives the buffers MLX-LM's ``update_and_fetch`` gives, bit for bit, and the attention
    over them is the oracle's, gated (two launches: the live-length partials and the merge)."""
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    q, gate, k_row, v_row, ours, stock, _ = _one_step_caches(np.random.default_rng(12), 16, 100, 256, 4, mx.bfloat16)
    with record_launches() as rec:
        out, k_buffer, v_buffer = att.attend_in_buffer(q, k_row, v_row, gate, ours.keys, ours.values,
                                                       mx.array(99, dtype=mx.int32), scale=0.0625)
    assert rec.names()[0] == "attention_decode_block_partials_live_quantized" and len(rec) == 2
    for mine, theirs in zip((*k_buffer, *v_buffer), (*stock.keys, *stock.values)):
        assert mine.shape == theirs.shape and bool(mx.array_equal(mine, theirs).item())
    want = _oracle(q, stock.keys, stock.values, 100, 0.0625, 4, 64).astype(mx.float32)
    want = want.transpose(0, 2, 1, 3).reshape(1, 1, -1) * mx.sigmoid(gate.astype(mx.float32))
    assert rel_l2(out.astype(mx.float32), want) < 4 * TOL["bfloat16"]


@needs_sim
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fixed_blocks", [False, True], ids=["one-pass", "fixed-blocks"])
def test_at_least_as_close_to_the_oracle_as_stock_at_qwen36_shape(bits, fixed_blocks):
    """Qwen3.6's heads (16 over 2, D = 256, bf16) and MLX-LM's default group of 64: the kernels' error against the
    fp32 oracle is no larger than stock's quantized attention's (stock rounds the scores and the weights to bf16;
    measured on the development CPU: 0.0016 against 0.031-0.038)."""
    rng = np.random.default_rng(bits)
    q, k, v = _quantized_problem(rng, 1, 2, 8, 256, 200, mx.bfloat16, bits, 64)
    want = _oracle(q, k, v, 200, 0.0625, bits, 64).astype(mx.float32)
    ours = ak.decode_attention_quantized(q, k, v, scale=0.0625, bits=bits, group_size=64, fixed_blocks=fixed_blocks,
                                         backend=KERNEL_BACKEND, init_value=NAN)
    stock = _stock_quantized_attention(q, k, v, scale=0.0625, group_size=64, bits=bits)
    assert rel_l2(ours.astype(mx.float32), want) < TOL["bfloat16"]
    assert rel_l2(ours.astype(mx.float32), want) <= rel_l2(stock.astype(mx.float32), want)


@needs_sim
def test_gqa_packing_states_compute_the_same_function():
    rng = np.random.default_rng(4)
    q, k, v = _quantized_problem(rng, 2, 2, 4, 128, 40, mx.float32, 4, 32)
    outs = [ak.decode_attention_quantized(q, k, v, scale=0.1, bits=4, group_size=32, gqa_packed=p,
                                          backend=KERNEL_BACKEND, init_value=NAN) for p in (True, False)]
    assert rel_l2(outs[1], outs[0]) < 1e-6


@needs_sim
@pytest.mark.skipif(KERNEL_BACKEND != "sim", reason="the race check is the simulator's")
@pytest.mark.parametrize("form", ["one-pass", "fixed-blocks", "live"])
def test_quantized_decode_kernels_race_check(monkeypatch, form):
    """The simulator's race check (threadgroup memory of the simdgroups' merge), a partial last step."""
    monkeypatch.setenv("LILY_MSL_RACE", "1")
    rng = np.random.default_rng(3)
    q, k, v = _quantized_problem(rng, 1, 1, 8, 64, 45, mx.bfloat16, 4, 64)
    if form == "live":
        out = ak.decode_attention_quantized_live(q, k, v, mx.array([40], dtype=mx.int32), scale=0.125, bits=4,
                                                 group_size=64, backend=KERNEL_BACKEND, init_value=NAN)
    else:
        out = ak.decode_attention_quantized(q, k, v, scale=0.125, bits=4, group_size=64, kv_length=41,
                                            fixed_blocks=form == "fixed-blocks", block_rows=16,
                                            backend=KERNEL_BACKEND, init_value=NAN)
    _check(out, _oracle(q, k, v, 41, 0.125, 4, 64), TOL["bfloat16"])


def test_quantized_problem_names_what_the_kernels_do_not_take():
    rng = np.random.default_rng(8)
    q, k, v = _quantized_problem(rng, 1, 2, 4, 64, 9, mx.bfloat16, 4, 32)
    assert ak.quantized_problem(q, k, v, 4, 32) is None
    k3 = tuple(mx.quantize(_rand(rng, (1, 2, 9, 64), mx.bfloat16), group_size=32, bits=3))
    cases = [
        ((q, k3, k3, 3, 32), "3-bit KV cache"),
        ((q, k, v, 4, 64), "quantized K/V part"),  # the arrays were packed with groups of 32
        ((q[:, :, :, :32], k, v, 4, 32), "head dim 32"),
        ((mx.concatenate([q, q]), k, v, 4, 32), "do not match"),
        ((q.astype(mx.float16), k, v, 4, 32), "quantized K/V part"),  # scales of another dtype than the queries
        ((mx.concatenate([q, q], axis=2), k, v, 4, 32), "L=2"),
        ((q, k[:2], v[:2], 4, 32), "2 arrays a side"),
        ((q[:, :3], k, v, 4, 32), "not a multiple of Hkv"),
    ]
    for args, reason in cases:
        problem = ak.quantized_problem(*args)
        assert problem is not None and reason in problem, (reason, problem)
    with pytest.raises(ValueError, match="3-bit"):
        ak.decode_attention_quantized(q, k3, k3, scale=0.1, bits=3, group_size=32, backend="sim")
    for live in (0, 10):  # rows the buffer of 9 does not hold, or none
        with pytest.raises(ValueError, match="live rows in a buffer of 9"):
            ak.decode_attention_quantized(q, k, v, scale=0.1, bits=4, group_size=32, kv_length=live, backend="sim")


@needs_sim
@pytest.mark.skipif(KERNEL_BACKEND != "sim", reason="the simulator's own refusal (MLX's custom kernels raise their own)")
def test_no_gradient_through_a_kernel_in_either_mode():
    """Reverse and forward mode through a simulated kernel are an error naming the fix, not silent zeros; outside a
    transformation its outputs are computed at once, so another thread can use them."""
    import threading

    from lily_mlx.msl.sim.kernel import NO_GRADIENT

    rng = np.random.default_rng(11)
    q, k, v = _quantized_problem(rng, 1, 1, 2, 64, 5, mx.float32, 4, 64)

    def attend(x):
        return ak.decode_attention_quantized(x, k, v, scale=0.1, bits=4, group_size=64, backend=KERNEL_BACKEND)

    with pytest.raises(ValueError, match="model.train"):
        mx.grad(lambda x: attend(x).sum())(q)
    with pytest.raises(ValueError, match="model.train"):
        mx.jvp(attend, [q], [mx.ones_like(q)])
    out, seen = attend(q), []
    thread = threading.Thread(target=lambda: seen.append(float(mx.sum(out).item())))
    thread.start()
    thread.join()
    assert seen and "lily_mlx.unpatch" in NO_GRADIENT


# ---------------------------------------------------------------------------------------------
# dispatch through the attention op


def _cache_step(k, v, bits, group_size, rows):
    """A QuantizedKVCache that took ``rows - 1`` rows, then this step's row: (cache, live keys, live values)."""
    cache = QuantizedKVCache(group_size=group_size, bits=bits)
    cache.update_and_fetch(k[:, :, :rows - 1], v[:, :, :rows - 1])
    keys, values = cache.update_and_fetch(k[:, :, rows - 1:rows], v[:, :, rows - 1:rows])
    return cache, keys, values


@needs_sim
@pytest.mark.parametrize("packed", [True, False])
def test_decode_over_a_quantized_cache_takes_the_kernel(monkeypatch, packed):
    """One query row over a QuantizedKVCache (its buffers read in place, spare capacity unread): the one-pass
    kernel (the fixed-block split on a GPU), against the oracle over the cache's rows."""
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    rng = np.random.default_rng(5)
    q = _rand(rng, (2, 8, 1, 128), mx.bfloat16)
    k, v = _rand(rng, (2, 2, 20, 128), mx.bfloat16), _rand(rng, (2, 2, 20, 128), mx.bfloat16)
    cache, keys, values = _cache_step(k, v, 4, 64, 20)
    assert cache.keys[0].shape[2] > keys[0].shape[2]
    with switches.overrides(disable=[] if packed else ["gqa_packing"]), record_launches() as rec:
        out = att.attention(q, keys, values, scale=0.125, mask=None, cache=cache)
    assert rec.names() == SHORT
    assert dict(rec[0].template)["GT"] == (4 if packed else 1)
    assert (dict(rec[0].template)["BITS"], dict(rec[0].template)["GROUP"]) == (4, 64)
    _check(out, _oracle(q, keys, values, 20, 0.125, 4, 64), TOL["bfloat16"])


@needs_sim
def test_long_context_decode_over_a_quantized_cache_takes_the_fixed_blocks(monkeypatch):
    """From the fixed-block threshold (lowered here from 32K) Qwen3.6's head shape takes the split's two launches,
    below it the one-pass kernel (a GPU: the split at every context), with fixed_block_attention off the one-pass
    kernel; a cache made by ``KVCache.to_quantized`` (as
    MLX-LM's ``--kv-bits`` makes it, its whole buffer quantised) too."""
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    monkeypatch.setattr(ak, "FIXED_BLOCK_MIN_CONTEXT", 64)
    monkeypatch.setattr(ak, "FIXED_BLOCK_TARGET_BLOCKS", 4)
    monkeypatch.setattr(ak, "FIXED_BLOCK_MIN_ROWS", 16)
    rng = np.random.default_rng(6)
    q = _rand(rng, (1, 16, 1, 256), mx.bfloat16)
    k, v = _rand(rng, (1, 2, 100, 256), mx.bfloat16), _rand(rng, (1, 2, 100, 256), mx.bfloat16)
    for rows, off, want in ((100, (), SPLIT), (100, ("fixed_block_attention",), ONE_PASS), (50, (), SHORT)):
        cache, keys, values = _cache_step(k, v, 8, 64, rows)
        with switches.overrides(disable=off), record_launches() as rec:
            out = att.attention(q, keys, values, scale=0.0625, mask=None, cache=cache)
        assert rec.names() == want, (rows, off, rec.names())
        _check(out, _oracle(q, keys, values, rows, 0.0625, 8, 64), TOL["bfloat16"])
    plain = KVCache()
    plain.update_and_fetch(k[:, :, :99], v[:, :, :99])
    cache = plain.to_quantized(group_size=64, bits=4)
    keys, values = cache.update_and_fetch(k[:, :, 99:], v[:, :, 99:])
    assert cache.keys[0].shape[2] > 100  # the plain buffer's spare rows, quantised
    with record_launches() as rec:
        out = att.attention(q, keys, values, scale=0.0625, mask=None, cache=cache)
    assert rec.names() == SPLIT
    _check(out, _oracle(q, keys, values, 100, 0.0625, 4, 64), TOL["bfloat16"])


@needs_sim
def test_a_row_written_into_the_buffers_falls_back_where_the_kernel_cannot_read_them(monkeypatch, caplog):
    """Queries in another dtype than the cache's scales (what the layer's check before the step cannot see): the row
    is written all the same, and stock's quantized attention over the whole buffers with the rows past the offset
    masked gives the step's output, said once; no launch. (Evaluated on the CPU stream: MLX's CUDA backend has no
    quantized matmul for this shape, for stock and so for the fallback alike; the path is chosen on the host.)"""
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    q, gate, k_row, v_row, ours, stock, (keys, values) = _one_step_caches(np.random.default_rng(13), 8, 30, 128, 8,
                                                                          mx.float32)
    with mx.stream(mx.cpu):
        want = quantized_scaled_dot_product_attention(mx.array(q), keys, values, scale=0.125, mask=None,
                                                      group_size=64, bits=8)  # (it scales its queries in place)
        want = want.transpose(0, 2, 1, 3).reshape(1, 1, -1) * mx.sigmoid(gate)
        with record_launches() as rec, caplog.at_level("INFO"):
            out, k_buffer, v_buffer = att.attend_in_buffer(q, k_row, v_row, gate, ours.keys, ours.values,
                                                           mx.array(29, dtype=mx.int32), scale=0.125)
        mx.eval(out, k_buffer, v_buffer, want)
    assert not rec.names()
    assert all(bool(mx.array_equal(a, b).item()) for a, b in zip((*k_buffer, *v_buffer), (*stock.keys, *stock.values)))
    assert rel_l2(out, want) < 1e-5
    assert any("using the reference" in r.getMessage() for r in caplog.records)


def _fallback_cases(rng):
    k, v = _rand(rng, (1, 2, 9, 64), mx.float32), _rand(rng, (1, 2, 9, 64), mx.float32)
    q = _rand(rng, (1, 8, 1, 64), mx.float32)
    three, six = QuantizedKVCache(group_size=32, bits=3), QuantizedKVCache(group_size=64, bits=6)
    tk, tv = three.update_and_fetch(k, v)
    sk, sv = six.update_and_fetch(k, v)
    eight = QuantizedKVCache(group_size=64, bits=8)
    ek, ev = eight.update_and_fetch(k, v)
    return [
        ("3-bit KV cache", q, tk, tv, None, three),
        ("6-bit KV cache", q, sk, sv, None, six),
        ("a mask", q, ek, ev, mx.ones((1, 1, 1, 9), dtype=mx.bool_), eight),
    ]


def test_other_quantized_caches_fall_back_to_stock(monkeypatch, caplog):
    """Bit widths whose elements straddle words, and masks: stock's quantized attention, no launch, each reason
    logged once (the cases run twice)."""
    monkeypatch.setenv("LILY_BACKEND", "sim")
    check_fallbacks_match_stock(att.quantized_decode_attention, _fallback_cases(np.random.default_rng(6)), caplog)


def test_quantized_kernels_compile_for_cuda():
    """The three kernels at Qwen3.6's shape in bf16, for each bit width and both GQA states, translate and compile."""
    from lily_mlx.core.kernel_registry import kernel_source
    from lily_mlx.msl.cuda import metal_kernel, wrap_like_mlx
    from lily_dev.compile_check import compile_cuda, compiler_available

    if compiler_available() is None:
        pytest.skip("no CUDA compiler (NVRTC or nvcc) installed")
    q = mx.zeros((1, 16, 1, 256), mx.bfloat16)
    units = []
    for name, outputs, n_params in (("attention_decode_quantized", [mx.bfloat16], 4),
                                    ("attention_decode_block_partials_quantized", [mx.float32] * 3, 6),
                                    ("attention_decode_block_partials_live_quantized", [mx.float32] * 3, 5)):
        spec = ak.KERNELS[name]
        header, body = kernel_source(spec)
        kernel = metal_kernel(spec.name, list(spec.input_names), list(spec.output_names), body, header=header)
        for bits, gt in ((2, 8), (4, 8), (8, 8), (4, 1)):
            k = [mx.zeros((1, 2, 8, 256 * bits // 32), mx.uint32), mx.zeros((1, 2, 8, 4), mx.bfloat16),
                 mx.zeros((1, 2, 8, 4), mx.bfloat16)]
            sg = ak.LIVE_WIDE_SIMDGROUPS if "live" in name else ak.DECODE_SIMDGROUPS  # (the live form's on CUDA)
            template = [("InT", mx.bfloat16), ("D", 256), ("GT", gt), ("SG", sg),
                        ("R", ak.rows_per_step(gt)), ("COALESCED", 1), ("BITS", bits), ("GROUP", 64)]
            last_row = [mx.zeros((1,), mx.int32)] if "live" in name else []
            units.append(wrap_like_mlx(kernel, [q, *k, *k, mx.zeros((1,)), *last_row, mx.zeros((n_params,), mx.int32)],
                                       outputs, template=template)[1])
    for unit in units:
        ok, log = compile_cuda(unit)
        assert ok, log


@needs_sim
def test_quantized_microbench_cases_for_the_bench_harness():
    """The kernels mode's quantized-cache cases (a small context here): each runs with the bytes of the packed rows,
    and lily's forms compute the fp32 oracle over the dequantised rows (not stock's result: on CUDA that was wrong
    at this shape, see ``_stock_quantized_attention``)."""
    from lily_dev import attention_bench

    rng = np.random.default_rng(10)
    q = _rand(rng, (1, 16, 1, 256), mx.bfloat16)
    k, v = _rand(rng, (1, 2, 100, 256), mx.bfloat16), _rand(rng, (1, 2, 100, 256), mx.bfloat16)
    cases = attention_bench.quantized_kv_cases(q, k, v, [0.0625] * 8, KERNEL_BACKEND, "100", 4)
    assert [name for name, *_ in cases] == ["attention_quantized_stock_b4_x8_S100", "attention_quantized_lily_b4_x8_S100",
                                            "attention_quantized_lily_blocks_b4_x8_S100"]
    packed_rows = 2 * 2 * 100 * (256 // 2 + 2 * 4 * 2)  # K and V: 4-bit elements, a scale and a bias a group of 64
    for name, run_once, nbytes, flops in cases:
        run_once()
        assert (nbytes, flops) == (8 * (packed_rows + 2 * 16 * 256 * 2), 8 * 4 * 16 * 100 * 256), name
    kq, vq = tuple(mx.quantize(k, group_size=64, bits=4)), tuple(mx.quantize(v, group_size=64, bits=4))
    want = _oracle(q, kq, vq, 100, 0.0625, 4, 64)
    for fixed in (False, True):
        ours = ak.decode_attention_quantized(q, kq, vq, scale=0.0625, bits=4, group_size=64, fixed_blocks=fixed,
                                             backend=KERNEL_BACKEND, init_value=NAN)
        _check(ours, want, TOL["bfloat16"])


# ---------------------------------------------------------------------------------------------
# the patched embedded model generating with a quantized KV cache

LOGIT_TOL = 2e-2  # relative L2 of a position's bf16 logits (as tests/kernels/test_attention_kernels.py)


def _teacher_forced_with_kv_bits(model, prompt, tokens, bits):
    """``teacher_forced_logits`` with the attention layers' caches quantised after the prompt, as MLX-LM's
    ``--kv-bits`` does (``maybe_quantize_kv_cache``): [len(tokens), vocab] fp32."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = [model(prompt[None], cache=cache)[0, -1]]
    cache = [c.to_quantized(group_size=64, bits=bits) if type(c) is KVCache else c for c in cache]
    for t in list(tokens)[:-1]:
        logits.append(model(mx.array([[int(t)]]), cache=cache)[0, -1])
        mx.eval(logits[-1])
    return mx.stack(logits).astype(mx.float32)


def _backend_gap(model, prompt, tokens) -> float:
    """0 where the kernels run on the CPU (the simulator); on a GPU backend stock's own gap between that backend's ops
    and the CPU's over plain caches (the largest relative L2 of a position's logits), which lily's side, on the GPU,
    carries against stock's quantized-cache side, on the CPU stream."""
    if KERNEL_BACKEND == "sim":
        return 0.0
    from mlx_lm.models.cache import make_prompt_cache

    def plain():
        cache = make_prompt_cache(model)
        out = [model(prompt[None], cache=cache)[0, -1]]
        for t in list(tokens)[:-1]:
            out.append(model(mx.array([[int(t)]]), cache=cache)[0, -1])
            mx.eval(out[-1])
        return mx.stack(out).astype(mx.float32)

    on_gpu = plain()
    with mx.stream(mx.cpu):
        on_cpu = plain()
    return max(rel_l2(a, b) for a, b in zip(on_gpu, on_cpu))


@needs_sim
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("write_in_trace", [True, False], ids=["in-buffer", "update-and-fetch"])
def test_embedded_model_decodes_with_kv_bits_like_stock(monkeypatch, bits, write_in_trace):
    """Stock's greedy tokens teacher-forced through the patched model with quantised KV caches (attention on the
    simulated kernels, the other families on their references): every decode step through a quantized kernel (with
    kv_write_in_trace the step's row quantised and written into the buffers and the live-length partials over them;
    without it MLX-LM's update_and_fetch and the kernels over the live rows), logits within bf16 noise of stock's
    with the same caches, stock's token wherever stock is decided."""
    from mlx_lm import load

    from lily_mlx import patch as lily_patch
    from lily_mlx.models.embedded import EMBEDDED_DIR
    from tests.kernels.model_checks import decided_positions

    model, tokenizer = load(str(EMBEDDED_DIR))
    prompt = mx.array(tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the"))
    n = 8
    with mx.stream(mx.cpu):  # stock on the CPU stream (see _stock_quantized_attention)
        stock_logits = _teacher_forced_with_kv_bits(model, prompt, [0] * n, bits)  # the tokens stock picks, greedily:
        tokens = [int(mx.argmax(stock_logits[0]).item())]
        for _ in range(n - 1):
            tokens.append(int(mx.argmax(_teacher_forced_with_kv_bits(model, prompt, tokens + [0], bits)[-1]).item()))
        stock_logits = _teacher_forced_with_kv_bits(model, prompt, tokens, bits)
    decided, _ = decided_positions(stock_logits)
    tol = LOGIT_TOL + _backend_gap(model, prompt, tokens)

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    monkeypatch.setenv("LILY_REFERENCE_OPS", "moe,deltanet")
    lily_patch.patch(model)
    try:  # every step built op by op, so that each launches (a traced step's replay records none)
        off = ["compiled_decode"] + ([] if write_in_trace else ["kv_write_in_trace"])
        with switches.overrides(disable=off), record_launches() as rec:
            logits = _teacher_forced_with_kv_bits(model, prompt, tokens, bits)
    finally:
        lily_patch.unpatch(model)
    n_attention = sum(not layer.is_linear for layer in model.language_model.model.layers)
    partials = "attention_decode_block_partials_live_quantized" if write_in_trace else SHORT[0]
    assert rec.names().count(partials) == (n - 1) * n_attention, rec.names()
    for pos in range(n):
        assert rel_l2(logits[pos], stock_logits[pos]) < tol, (pos, rel_l2(logits[pos], stock_logits[pos]), tol)
    assert decided.sum() >= n // 2
    assert (np.array(mx.argmax(logits, axis=-1)) == np.array(tokens))[decided].all()
