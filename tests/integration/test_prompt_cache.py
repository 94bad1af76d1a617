"""Prompt caches with a patched model: same cache formats and contents as stock, save/load across
engines, multi-turn reuse, and MLX-LM's batched generator (what mlx_lm.server uses) with B > 1."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

import lily_mlx
from lily_mlx.core import switches

TURNS = [
    "Return a shallow copy of the mapping.",
    " Now explain what happens to nested values.",
    " And what does a deep copy do instead?",
]


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "reference")
    switches.reset()


@pytest.fixture
def model(loaded_model):
    m, tok = loaded_model
    lily_mlx.unpatch(m)
    yield m, tok
    lily_mlx.unpatch(m)


def generate_turn(model, tokens, cache, n=12):
    """Greedy continuation of ``tokens`` on ``cache`` (updated in place, as MLX-LM's chat does)."""
    out = [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n, prompt_cache=cache)]
    return out


def conversation(model, tok, cache):
    """Three turns on one cache; each turn's prompt also feeds back the previous reply."""
    replies, previous = [], []
    for text in TURNS:
        reply = generate_turn(model, previous + tok.encode(text), cache)
        replies.append(reply)
        previous = reply[-1:]  # the last sampled token has not been through the model yet
    return replies


def cache_arrays(cache):
    out = []

    def walk(x):
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        else:
            out.append(x)

    walk([c.state for c in cache])
    return out


def assert_same_cache(a, b):
    assert [type(c) for c in a] == [type(c) for c in b]
    arrays_a, arrays_b = cache_arrays(a), cache_arrays(b)
    assert len(arrays_a) == len(arrays_b)
    for x, y in zip(arrays_a, arrays_b):
        if not isinstance(x, mx.array):  # None or an int offset
            assert x == y
            continue
        assert x.shape == y.shape and x.dtype == y.dtype
        assert mx.array_equal(x, y).item()


def test_multi_turn_cache_identical_to_stock(model):
    m, tok = model
    stock_cache = make_prompt_cache(m)
    stock = conversation(m, tok, stock_cache)
    lily_mlx.patch(m)
    lily_cache = make_prompt_cache(m)
    assert conversation(m, tok, lily_cache) == stock
    assert_same_cache(lily_cache, stock_cache)


@pytest.mark.parametrize("saver,loader", [("lily", "stock"), ("stock", "lily"), ("lily", "lily")])
def test_saved_cache_continues_identically(model, tmp_path, saver, loader):
    """Turn 1 by one engine, cache saved to disk, loaded, turns 2-3 by the other engine: the same
    tokens as stock doing all three turns on one in-memory cache."""
    m, tok = model
    stock = conversation(m, tok, make_prompt_cache(m))

    if saver == "lily":
        lily_mlx.patch(m)
    cache = make_prompt_cache(m)
    first = generate_turn(m, tok.encode(TURNS[0]), cache)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache, {"engine": saver})
    lily_mlx.unpatch(m)

    if loader == "lily":
        lily_mlx.patch(m)
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"engine": saver}
    assert_same_cache(loaded, cache)
    replies, previous = [first], first[-1:]
    for text in TURNS[1:]:
        reply = generate_turn(m, previous + tok.encode(text), loaded)
        replies.append(reply)
        previous = reply[-1:]
    assert replies == stock


def test_batched_generation_identical_to_stock(model):
    """MLX-LM's BatchGenerator (mlx_lm.server's path): B = 3 prompts of different lengths, so the
    batch is left-padded and the DeltaNet caches carry per-row lengths."""
    m, tok = model
    prompts = [tok.encode(t) for t in (TURNS[0], TURNS[1] + TURNS[2], "Return")]
    # The docstring model ends a document within a few tokens; stopping only at <|im_end|> (which it
    # never emits) keeps every row generating, so the comparison covers all 24 tokens of each row.
    eos = set(tok.eos_token_ids)
    tok._eos_token_ids = {tok.convert_tokens_to_ids("<|im_end|>")}
    try:
        stock = batch_generate(m, tok, prompts, max_tokens=24, return_token_ids=True).token_ids
        lily_mlx.patch(m)
        lily = batch_generate(m, tok, prompts, max_tokens=24, return_token_ids=True).token_ids
    finally:
        tok._eos_token_ids = eos
    assert lily == stock
    assert len(stock) == 3 and all(len(row) == 24 for row in stock)
