"""``core.lookahead`` (switch ``bounded_lookahead``): in a prefill chunk each layer's output is submitted
when built and the host waits for the layer two back; decode steps are untouched; results are bitwise
those with the switch off; inside a function transformation nothing is submitted (no error)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from lily_mlx import patch
from lily_mlx.core import lookahead, switches


@pytest.fixture(scope="module")
def model():
    from bench.model_setup import load_model

    model, _ = load_model(None, "tiny", log=None)
    patch(model)
    return model


@pytest.fixture
def spy(monkeypatch):
    """Record the real mx.async_eval / mx.eval calls (they still run)."""
    calls = []
    real_async, real_eval = mx.async_eval, mx.eval

    def async_eval(*args):
        out = real_async(*args)  # raises inside a function transformation: nothing recorded
        calls.append(("submit", args[0]))
        return out

    def evaluate(*args):
        calls.append(("wait", args[0]))
        return real_eval(*args)

    monkeypatch.setattr(mx, "async_eval", async_eval)
    monkeypatch.setattr(mx, "eval", evaluate)
    lookahead.clear()
    return calls


def _prefill_and_step(model, tokens):
    cache = make_prompt_cache(model)
    logits = model(tokens[None], cache=cache)
    mx.eval(logits)
    step = model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
    mx.eval(step)
    return logits, step


def test_prefill_layers_are_submitted_and_the_host_waits_two_layers_back(model, spy, monkeypatch):
    monkeypatch.setattr(lookahead, "MIN_TOKENS", 40)  # the tiny model's test chunk
    tokens = mx.arange(40) % 97
    n_layers = len(model.layers)
    logits, step = _prefill_and_step(model, tokens)
    submitted = [a for kind, a in spy if kind == "submit"]
    assert len(submitted) == n_layers and all(a.shape[1] == 40 for a in submitted)  # prefill only, not decode
    for i, a in enumerate(submitted):  # layer i's output submitted, then the wait for layer i - DEPTH
        pos = next(j for j, (kind, b) in enumerate(spy) if kind == "submit" and b is a)
        if i >= lookahead.DEPTH:
            kind, b = spy[pos + 1]
            assert kind == "wait" and b is submitted[i - lookahead.DEPTH]

    spy.clear()
    with switches.overrides(disable=["bounded_lookahead"]):
        logits_off, step_off = _prefill_and_step(model, tokens)
    assert not [kind for kind, _ in spy if kind == "submit"]
    assert mx.array_equal(logits, logits_off).item() and mx.array_equal(step, step_off).item()


def test_chunks_below_the_minimum_are_left_alone(model, spy):
    """A short multi-token call (e.g. a speculative-decoding verify step) runs as stock schedules it."""
    _prefill_and_step(model, mx.arange(lookahead.MIN_TOKENS - 1) % 97)
    assert not [kind for kind, _ in spy if kind == "submit"]


def test_inside_mx_compile_nothing_is_submitted(model, spy, monkeypatch):
    monkeypatch.setattr(lookahead, "MIN_TOKENS", 2)
    tokens = (mx.arange(12) % 31)[None]
    cache = make_prompt_cache(model)
    eager = model(tokens, cache=cache)
    mx.eval(eager)
    compiled = mx.compile(lambda t: model(t))  # no cache: a pure function of the tokens
    want = model(tokens)
    spy.clear()
    got = compiled(tokens)
    mx.eval(got)
    assert not [kind for kind, _ in spy if kind == "submit"]
    assert mx.allclose(got, want, atol=1e-4).item()
