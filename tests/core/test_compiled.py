"""``core.compiled``: a piece traced once and replayed computes what the eager piece computes, reads the
owner's current weights, and a piece that cannot be traced runs eagerly (weights untouched)."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from lily_mlx.core import compiled, switches


@pytest.fixture
def owner():
    mx.random.seed(3)
    module = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 32))
    nn.quantize(module, group_size=64, bits=4)
    return module


def test_trace_replays_the_eager_piece_with_current_weights(owner):
    fn = lambda x: mx.sigmoid(owner(x)) * 2  # noqa: E731
    for step in range(3):
        x = mx.random.normal((1, 128))
        got = compiled.call(owner, "k", fn, (x,))
        assert got is not None and mx.array_equal(got, fn(x)).item(), step
    traces = owner.__dict__["_lily_compiled"]
    assert list(traces) == ["k"]
    x = mx.random.normal((1, 128))
    before = compiled.call(owner, "k", fn, (x,))
    other = nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 32))
    nn.quantize(other, group_size=64, bits=4)
    owner.update(other.parameters())  # new weights, same shapes: the trace reads them at each call
    after = compiled.call(owner, "k", fn, (x,))
    assert mx.array_equal(after, fn(x)).item() and not mx.array_equal(after, before).item()


def test_a_piece_that_cannot_be_traced_runs_eagerly(owner):
    calls = []

    def host_sync(x):  # reads a value on the host: not traceable
        calls.append(1)
        return owner(x) * float(mx.sum(x).item())

    weights = [a for a in owner.parameters()["layers"][0].values()]
    x = mx.random.normal((1, 128))
    assert compiled.call(owner, "sync", host_sync, (x,)) is None
    assert compiled.call(owner, "sync", host_sync, (x,)) is None  # no second trace attempt
    assert len(calls) == 1
    # the weights are the module's own again, not the trace's placeholders
    assert all(a is b for a, b in zip(owner.parameters()["layers"][0].values(), weights))
    mx.eval(host_sync(x))


def test_only_traceable_backends_with_the_switch_on():
    assert compiled.enabled("cuda") and compiled.enabled("metal", "cuda")
    assert not compiled.enabled("sim") and not compiled.enabled("cuda", "reference")
    with switches.overrides(disable=["compiled_decode"]):
        assert not compiled.enabled("cuda")


def test_traces_do_not_keep_a_deleted_model_alive():
    """A trace holds its owner (the implicit input) and the owner holds its traces: a cycle the garbage
    collector must free, or a deleted 20 GB model would stay in memory."""
    import gc
    import weakref

    module = nn.Linear(64, 64)
    fn = lambda x: module(x) * 2  # noqa: E731
    mx.eval(compiled.call(module, "k", fn, (mx.ones((1, 64)),)))
    ref = weakref.ref(module)
    del module, fn
    gc.collect()
    assert ref() is None
