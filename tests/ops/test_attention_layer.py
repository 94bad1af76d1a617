"""attention_forward vs stock mlx_lm Qwen3NextAttention: bit-identical on the reference backend.

Both engines run the same chunk sequence (prefill chunks, then decode steps) on their own caches,
built the way mlx_lm builds them, with masks made as the model makes them (create_attention_mask).
"""

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given, strategies as st
from mlx_lm.models import qwen3_next
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from lily_mlx.core import switches
from lily_mlx.core.log import reset_log_once
from lily_mlx.ops import attention as att

HIDDEN = 64


def make_attention(n_heads, n_kv_heads, head_dim, partial=0.25, dtype=mx.float32, quantize=False,
                   seed=0, rope_theta=10000.0, group_size=32):
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=HIDDEN, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=head_dim,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, shared_expert_intermediate_size=32, mlp_only_layers=[],
        moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=32, rope_theta=rope_theta,
        partial_rotary_factor=partial, max_position_embeddings=4096,
    )
    mx.random.seed(seed)
    module = qwen3_next.Qwen3NextAttention(args)
    # Non-trivial norm weights (stock initialises them to ones).
    module.q_norm.weight = 1.0 + 0.1 * mx.random.normal((head_dim,))
    module.k_norm.weight = 1.0 + 0.1 * mx.random.normal((head_dim,))
    if quantize:
        nn.quantize(module, group_size=group_size, bits=4)
    module.set_dtype(dtype)
    return module.eval()  # inference mode, as mlx_lm.load leaves a model


def make_cache(kind, batch, left_padding):
    if kind == "none":
        return None
    if kind == "kv":
        return KVCache()
    if kind == "quantized":
        return QuantizedKVCache(group_size=32, bits=8)
    if kind == "rotating":
        return RotatingKVCache(max_size=8, keep=0)
    if kind == "batch":
        return BatchKVCache(left_padding=left_padding)
    raise ValueError(kind)


def run_chunks(forward, module, xs, cache):
    """Feed chunks as the model does; returns the outputs (evaluated) of every chunk."""
    outs = []
    for x in xs:
        mask = create_attention_mask(x, cache)
        out = forward(module, x, mask=mask, cache=cache)
        mx.eval(out)
        outs.append(out)
    return outs


def stock_forward(module, x, mask=None, cache=None):
    return qwen3_next.Qwen3NextAttention.__call__(module, x, mask=mask, cache=cache)


def assert_identical(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert mx.array_equal(a, b, equal_nan=True).item(), f"max |diff| {mx.abs(a - b).max()}"


def cache_arrays(cache):
    if cache is None:
        return []
    out = []
    for s in (cache.keys, cache.values):
        out.extend(s if isinstance(s, (list, tuple)) else [s])
    return out


@st.composite
def layer_cases(draw):
    kind = draw(st.sampled_from(["none", "kv", "quantized", "rotating", "batch"]))
    gqa = draw(st.sampled_from([1, 2, 4, 8]))
    n_kv_heads = draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([32, 64]))
    batch = draw(st.integers(1, 3))
    if kind == "none":
        chunks = [draw(st.integers(1, 9))]  # without a cache the layer sees one whole sequence
    else:
        chunks = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
        chunks += [1] * draw(st.integers(0, 3))  # decode steps
    left_padding = [draw(st.integers(0, chunks[0] - 1)) for _ in range(batch)]
    return dict(
        kind=kind, n_heads=gqa * n_kv_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        batch=batch, chunks=chunks, left_padding=left_padding,
        partial=draw(st.sampled_from([0.25, 0.5, 1.0])),
        dtype=draw(st.sampled_from([mx.float32, mx.bfloat16])),
        quantize=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@given(layer_cases())
def test_attention_forward_identical_to_stock(case):
    module = make_attention(case["n_heads"], case["n_kv_heads"], case["head_dim"], case["partial"],
                            case["dtype"], case["quantize"], case["seed"])
    mx.random.seed(case["seed"] + 1)
    xs = [mx.random.normal((case["batch"], t, HIDDEN)).astype(case["dtype"]) for t in case["chunks"]]
    caches = [make_cache(case["kind"], case["batch"], case["left_padding"]) for _ in range(2)]
    ours = run_chunks(att.attention_forward, module, xs, caches[0])
    stock = run_chunks(stock_forward, module, xs, caches[1])
    for a, b in zip(ours, stock):
        assert_identical(a, b)
    for a, b in zip(cache_arrays(caches[0]), cache_arrays(caches[1])):
        assert_identical(a, b)
    if caches[0] is not None:
        assert mx.array_equal(mx.array(caches[0].offset), mx.array(caches[1].offset)).item()


@pytest.mark.parametrize("flipped", [n for n, s in switches.SWITCHES.items() if s.family == "attention"])
def test_every_attention_switch_keeps_stock_results(flipped):
    """Reference backend: no switch state changes stock's computation (bit for bit). Which kernel
    variant each state runs on the simulator: tests/kernels/test_switch_paths.py."""
    module = make_attention(8, 1, 32, seed=3)
    mx.random.seed(4)
    xs = [mx.random.normal((2, t, HIDDEN)) for t in (5, 1, 1)]
    stock = run_chunks(stock_forward, module, xs, KVCache())
    with switches.overrides(disable=[flipped]):
        ours = run_chunks(att.attention_forward, module, xs, KVCache())
    for a, b in zip(ours, stock):
        assert_identical(a, b)


def test_sharded_module_head_counts_read_at_call_time():
    """Rank 0 of a 2-way tensor split, as qwen3_5.Model.shard() leaves the module: half the heads."""
    module = make_attention(8, 2, 32, seed=5)
    H, Hkv, D = 8, 2, 32
    module.q_proj.weight = module.q_proj.weight[: H // 2 * 2 * D]  # per head [queries, gate]
    module.k_proj.weight = module.k_proj.weight[: Hkv // 2 * D]
    module.v_proj.weight = module.v_proj.weight[: Hkv // 2 * D]
    module.o_proj.weight = module.o_proj.weight[:, : H // 2 * D]
    module.num_attention_heads //= 2
    module.num_key_value_heads //= 2
    mx.random.seed(6)
    xs = [mx.random.normal((1, t, HIDDEN)) for t in (3, 1)]
    ours = run_chunks(att.attention_forward, module, xs, KVCache())
    stock = run_chunks(stock_forward, module, xs, KVCache())
    for a, b in zip(ours, stock):
        assert_identical(a, b)


def test_empty_chunk_rejected_like_stock():
    """Stock cannot take a 0-token chunk (reshape with -1 of an empty array); neither do we."""
    module = make_attention(4, 2, 32)
    x = mx.zeros((2, 0, HIDDEN))
    for forward in (stock_forward, att.attention_forward):
        cache = KVCache()
        with pytest.raises(ValueError):
            mx.eval(forward(module, x, mask=None, cache=cache))


def test_sim_backend_unsupported_shapes_fall_back_to_reference(monkeypatch, caplog):
    monkeypatch.setenv("LILY_BACKEND", "sim")
    reset_log_once()
    module = make_attention(4, 1, 32, seed=7)
    mx.random.seed(8)
    xs = [mx.random.normal((1, t, HIDDEN)) for t in (4, 1)]
    stock = run_chunks(stock_forward, module, xs, KVCache())
    # (the q/k preparation kernel takes head dim 32: off here, this test is about the attention kernels; the
    # decode step over the live rows, then over the KV buffer with kv_write_in_trace)
    for in_buffer, decode_op in ((False, "attention_decode"), (True, "attention_decode_long")):
        off = ["fused_qk_prep"] + ([] if in_buffer else ["kv_write_in_trace"])
        with caplog.at_level("INFO", logger="lily_mlx"), switches.overrides(disable=off):
            ours = run_chunks(att.attention_forward, module, xs, KVCache())
        for a, b in zip(ours, stock):
            assert_identical(a, b)
        assert "attention_prefill: head dim 32 not in" in caplog.text  # the prefill kernel's shape rules
        assert f"{decode_op}: head dim 32 not in" in caplog.text  # the decode kernels' shape rules
        reset_log_once()
        caplog.clear()


@pytest.mark.parametrize("kind", ["kv", "batch", "quantized"])
def test_qwen3_6_attention_shape(kind):
    """The real layer's head shape: 16 query heads, 2 KV heads (GQA 8), head dim 256, partial RoPE
    0.25, bf16, 4-bit weights; a 7-token prefill chunk, a 4-token chunk, then decode steps."""
    module = make_attention(16, 2, 256, partial=0.25, dtype=mx.bfloat16, quantize=True, seed=9,
                            rope_theta=10_000_000.0, group_size=64)
    mx.random.seed(10)
    xs = [mx.random.normal((2, t, HIDDEN)).astype(mx.bfloat16) for t in (7, 4, 1, 1, 1)]
    caches = [make_cache(kind, 2, [3, 0]) for _ in range(2)]
    ours = run_chunks(att.attention_forward, module, xs, caches[0])
    stock = run_chunks(stock_forward, module, xs, caches[1])
    for a, b in zip(ours, stock):
        assert_identical(a, b)


def test_the_offset_array_is_shared_only_between_equal_offsets():
    """A decode step's attention layers share one offset array (made once a step): the same array for the same
    offset, a new one with the new value when the offset moves (never a stale value)."""
    caches = [KVCache() for _ in range(3)]
    for cache, offset in zip(caches, (5, 5, 6)):
        cache.offset = offset
    from lily_mlx.ops.attention.layer import _positions

    first, second, third = (_positions(c) for c in caches)
    assert first is second and first.item() == 5
    assert third.item() == 6
    caches[0].offset = 5
    assert _positions(caches[0]).item() == 5


def test_device_positions_follow_the_last_step_without_a_host_write(monkeypatch):
    """switch ``device_positions``: the position of offset n + 1 is the last step's wide array plus one (made on the
    GPU; no host-made array), a jump in the offset (a new prompt) makes a fresh one from the host; the step's
    layers share one; every value is the offset, read through a scalar view of a POSITION_WIDTH-wide array."""
    from lily_mlx.ops.attention import layer

    host_made = []
    full = mx.full
    monkeypatch.setattr(mx, "full", lambda *a, **k: host_made.append(a) or full(*a, **k))
    monkeypatch.setattr(layer, "_last_position", (-1, None, None))
    cache = KVCache()
    with switches.overrides(enable=["device_positions"]):
        for offset in (7, 8, 9, 20, 21):
            cache.offset = offset
            position = layer._positions(cache)
            assert layer._positions(cache) is position  # one a step
            wide = layer._last_position[2]
            assert position.shape == () and position.dtype == mx.int32 and position.item() == offset
            assert wide.shape == (layer.POSITION_WIDTH,) and wide.tolist() == [offset] * layer.POSITION_WIDTH
    assert [a[1] for a in host_made] == [7, 20]
    cache.offset = 22  # switch off: the host's scalar
    assert layer._positions(cache).item() == 22 and layer._last_position[2] is None


@given(batch=st.integers(1, 3), kv_heads=st.sampled_from([1, 2]), head_dim=st.sampled_from([8, 64, 256]),
       capacity=st.integers(1, 300), data=st.data(), dtype=st.sampled_from([mx.bfloat16, mx.float16, mx.float32]))
def test_the_kv_row_written_by_a_scatter_is_the_slice_update(batch, kv_heads, head_dim, capacity, data, dtype):
    """``write_row`` (a scatter along the rows, the form a decode step writes its KV row with) leaves the buffer as
    ``mx.slice_update`` at the same dynamic start does: the row at the position, every other row untouched."""
    from lily_mlx.ops.attention.layer import write_row

    position = data.draw(st.integers(0, capacity - 1))
    key = mx.random.key(capacity * 7 + position)
    k1, k2 = mx.random.split(key)
    buffer = mx.random.normal((batch, kv_heads, capacity, head_dim), key=k1).astype(dtype)
    row = mx.random.normal((batch, kv_heads, 1, head_dim), key=k2).astype(dtype)
    at = mx.array(position, dtype=mx.int32)
    got = write_row(buffer, row, at)
    want = mx.slice_update(buffer, row, at.reshape(1), axes=(2,))
    assert got.shape == buffer.shape and got.dtype == dtype
    assert mx.array_equal(got, want).item()
    assert mx.array_equal(got[:, :, position], row[:, :, 0]).item()
