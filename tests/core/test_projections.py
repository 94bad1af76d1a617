"""``lily_mlx.core.projections`` (switches ``fused_in_proj``, ``fused_qkv_proj``): a layer's input
projections as one quantised matmul over their concatenated weights.

Oracle: each projection module called on its own (MLX's quantised matmul, stock's computation). The
fused path must give the same bits for every call size it takes, leave the modules' weights holding
the same values (views of the concatenation), follow weights replaced after patching, refuse groups it
cannot fuse, and cut the decode step's quantised matmuls by the projections it merges."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from lily_mlx import patch, unpatch
from lily_mlx.core import switches
from lily_mlx.core import projections


@pytest.fixture(autouse=True)
def on_the_cpu():
    """MLX's CPU quantised matmul (the test machines'); the GPU gets the same check from
    bench/projection_bits.py."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


class Layer(nn.Module):
    """Four quantised projections of one input, as a Qwen3.5 DeltaNet layer holds them."""

    def __init__(self, K: int, sizes, bits: int = 4, group_size: int = 64, seed: int = 0):
        super().__init__()
        keys = mx.random.split(mx.random.key(seed), len(sizes))
        for name, n, key in zip([f"proj_{i}" for i in range(len(sizes))], sizes, keys):
            linear = nn.Linear(K, n, bias=False)
            linear.weight = mx.random.normal((n, K), key=key) * K ** -0.5
            setattr(self, name, nn.QuantizedLinear.from_linear(linear, group_size=group_size, bits=bits))

    @property
    def names(self):
        return tuple(sorted(k for k in self if k.startswith("proj_")))

    def separately(self, x):
        return [getattr(self, name)(x) for name in self.names]


def _equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


@settings(max_examples=25, deadline=None)
@given(
    K=st.sampled_from([64, 128, 512, 2048]),
    sizes=st.lists(st.sampled_from([8, 32, 64, 96, 256, 1024]), min_size=2, max_size=4),
    rows=st.integers(1, projections.MAX_ROWS),
    lead=st.sampled_from(["batch", "tokens"]),
    bits=st.sampled_from([4, 8]),
    dtype=st.sampled_from([mx.bfloat16, mx.float16]),
    seed=st.integers(0, 2**16),
)
def test_fused_matmul_has_the_bits_of_each_projection(K, sizes, rows, lead, bits, dtype, seed):
    layer = Layer(K, sizes, bits=bits, seed=seed)
    x = mx.random.normal((rows, 1, K) if lead == "batch" else (1, rows, K), key=mx.random.key(seed + 1))
    x = x.astype(dtype)
    want = layer.separately(x)
    before = [(p.weight, p.scales, p.biases) for p in (getattr(layer, n) for n in layer.names)]
    record = projections.prepare(layer, layer.names)
    assert record is not None and projections.fused_for(layer, layer.names, x) is record
    # The modules now hold views of the concatenation, with the values they held before.
    for name, old in zip(layer.names, before):
        piece = getattr(layer, name)
        assert all(_equal(a, b) for a, b in zip((piece.weight, piece.scales, piece.biases), old))
    got = projections.run(record, x)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert _equal(g, w)
    assert all(_equal(g, w) for g, w in zip(layer.separately(x), want))  # views: same module outputs


def test_calls_of_more_rows_run_unfused():
    layer = Layer(128, [64, 32])
    projections.prepare(layer, layer.names)
    K = 128
    assert projections.fused_for(layer, layer.names, mx.zeros((1, projections.MAX_ROWS, K))) is not None
    assert projections.fused_for(layer, layer.names, mx.zeros((projections.MAX_ROWS, 1, K))) is not None
    assert projections.fused_for(layer, layer.names, mx.zeros((1, projections.MAX_ROWS + 1, K))) is None
    assert projections.fused_for(layer, layer.names, mx.zeros((2, 4, K))) is None


def test_replaced_weights_are_fused_again_not_replayed_stale():
    layer = Layer(128, [64, 32, 32], seed=1)
    projections.prepare(layer, layer.names)
    fresh = Layer(128, [64, 32, 32], seed=2)
    layer.load_weights(tree_flatten(fresh.parameters()))
    x = mx.random.normal((1, 1, 128), key=mx.random.key(3)).astype(mx.bfloat16)
    record = projections.fused_for(layer, layer.names, x)
    assert record is not None
    for g, w in zip(projections.run(record, x), fresh.separately(x)):
        assert _equal(g, w)


@pytest.mark.parametrize("change, reason", [
    (lambda layer: setattr(layer, "proj_1", nn.Linear(128, 32, bias=False)), "nn.QuantizedLinear"),
    (lambda layer: setattr(layer, "proj_1", Layer(128, [32], bits=8).proj_0), "quantised differently"),
    (lambda layer: setattr(layer.proj_1, "bias", mx.zeros((32,))), "additive bias"),
])
def test_groups_that_cannot_be_fused_run_unfused_and_are_not_retried(change, reason):
    layer = Layer(128, [64, 32])
    change(layer)
    x = mx.zeros((1, 1, 128))
    assert projections.prepare(layer, layer.names) is None
    marker = layer.__dict__[projections._ATTR][layer.names]
    assert reason in marker.reason
    assert projections.fused_for(layer, layer.names, x) is None
    assert layer.__dict__[projections._ATTR][layer.names] is marker  # not prepared again per call


# --------------------------------------------------------------------------------------------------
# The model


@pytest.fixture(scope="module")
def tiny():
    from bench.model_setup import load_model

    model, _ = load_model(None, "tiny", log=None)
    return model


def _decode_steps(model, prompt, steps: int = 2):
    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)
    out = [logits[:, -1]]
    for _ in range(steps):
        y = mx.argmax(out[-1], axis=-1)[:, None]
        out.append(model(y, cache=cache)[:, -1])
        mx.eval(out[-1])
    return mx.stack(out), cache


def test_model_decode_same_bits_and_fewer_matmuls(tiny, monkeypatch):
    """The patched tiny model on the simulator: logits bit for bit with the switches on and off, and
    one decode step calls MLX's quantised matmul (4 - 1) times fewer per DeltaNet layer and (3 - 1)
    times fewer per attention layer (the real op, counted as it is called; dense_gemv off, which with its
    trial kernel on takes the decode projections off MLX's matmul: tests/kernels/test_linear_kernels.py)."""
    monkeypatch.setenv("LILY_BACKEND", "sim")
    model = tiny
    off = ("fused_in_proj", "fused_qkv_proj")
    patch(model)
    try:
        prompt = mx.random.randint(0, 1000, (2, 5), key=mx.random.key(0))
        with switches.overrides(disable=off):
            want, _ = _decode_steps(model, prompt)
        got, cache = _decode_steps(model, prompt)
        assert _equal(got, want)

        calls = []
        real = mx.quantized_matmul

        def counted(*args, **kwargs):
            calls.append(args[1].shape)
            return real(*args, **kwargs)

        monkeypatch.setattr(mx, "quantized_matmul", counted)
        y = mx.zeros((2, 1), dtype=mx.int32)
        with switches.overrides(disable=["dense_gemv"]):
            mx.eval(model(y, cache=cache))
        fused = len(calls)
        with switches.overrides(disable=off + ("dense_gemv",)):
            mx.eval(model(y, cache=cache))
        unfused = len(calls) - fused
    finally:
        unpatch(model)
    deltanet = sum(hasattr(layer, "linear_attn") for layer in model.layers)
    attention = len(model.layers) - deltanet
    assert deltanet and attention
    assert unfused - fused == 3 * deltanet + 2 * attention, (unfused, fused)


def test_a_row_has_the_same_bits_fused_alone_and_unfused_in_a_larger_batch():
    """Batch invariance across the MAX_ROWS boundary: a decode row alone (fused matmul) and the same row
    in a batch of MAX_ROWS + 2 rows (one matmul per projection) get the same bits."""
    layer = Layer(256, [128, 64, 32, 32], seed=5)
    projections.prepare(layer, layer.names)
    batch = mx.random.normal((projections.MAX_ROWS + 2, 1, 256), key=mx.random.key(9)).astype(mx.bfloat16)
    assert projections.fused_for(layer, layer.names, batch) is None
    together = layer.separately(batch)
    for row in (0, 4, projections.MAX_ROWS + 1):
        record = projections.fused_for(layer, layer.names, batch[row:row + 1])
        assert record is not None
        for alone, full in zip(projections.run(record, batch[row:row + 1]), together):
            assert _equal(alone, full[row:row + 1])


def test_prepare_keeps_one_copy_of_the_weights():
    """The modules hold views of the concatenation: after the pieces are freed, the same memory."""
    import gc

    layer = Layer(512, [1024, 512, 64, 64], seed=3)
    mx.eval(layer.parameters())
    gc.collect()
    before = mx.get_active_memory()
    projections.prepare(layer, layer.names)
    gc.collect()
    after = mx.get_active_memory()
    weights = sum(v.nbytes for _, v in tree_flatten(layer.parameters()))
    assert abs(after - before) < 0.05 * weights, (before, after, weights)
