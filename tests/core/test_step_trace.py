"""Switch ``step_trace``: a one-token decode step of the whole text model replays one trace. Traced on the CPU here
(the embedded model, plain MLX ops on the reference backend, the traceable backends widened for the test); with the
kernels on a GPU: tests/kernels/test_compiled_decode.py; the step's launches and Python calls on the CUDA path
without a GPU: tests/model/test_decode_graph.py."""

import contextlib

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import KVCache

from lily_mlx import patch as lily_patch
from lily_mlx.core import compiled, dispatch, step_trace, switches
from lily_mlx.models import embedded
from tests.kernels.test_compiled_decode import _greedy_logits


@pytest.fixture
def model(monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "reference")
    monkeypatch.setattr(compiled, "COMPILE_BACKENDS", compiled.COMPILE_BACKENDS | {"reference"})
    model, _ = mlx_lm.load(str(embedded.EMBEDDED_DIR))
    return model


@contextlib.contextmanager
def _patched_with_step_trace(model):
    """``model`` patched with the switch on, decoding with it on (inner overrides turn it off), unpatched after."""
    with switches.overrides(enable=["step_trace"]):
        lily_patch.patch(model)
        try:
            yield
        finally:
            lily_patch.unpatch(model)


def _traces(model):
    """The text model's step traces: signature -> made (True) or given up (False)."""
    text_model = model.language_model
    return {k: v[1] is not None for k, v in text_model.__dict__.get(step_trace._TRACES, {}).items()}


def _counting_calls(monkeypatch):
    """Counts the decoder layers' forward calls (a replayed step trace makes none)."""
    from lily_mlx.ops.moe import layer

    calls = []
    original = layer._replayed

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(layer, "_replayed", counted)
    return calls


def _assert_same(got, want):
    for step, (a, b) in enumerate(zip(got, want)):
        assert mx.array_equal(a, b).item(), f"step {step}"


def test_step_trace_gives_the_built_bits_across_the_kv_buffers_growth(model, monkeypatch):
    """Greedy decode from a 250-token prompt for 12 steps (the step at 256 grows the KV buffers): the steps through the
    step trace have the bits of the steps built op by op and of the layers' own replays, the caches end the same
    (offsets, live rows, DeltaNet states); the trace is made at the second step of each buffer capacity and the
    steps after it replay it without calling a decoder layer."""
    prompt = mx.random.randint(0, 1000, (250,), key=mx.random.key(7)).tolist()
    with _patched_with_step_trace(model):
        with switches.overrides(disable=["compiled_decode"]):
            built, built_cache = _greedy_logits(model, prompt, steps=12)
        with switches.overrides(disable=["step_trace"]):
            replayed, _ = _greedy_logits(model, prompt, steps=12)
        calls = _counting_calls(monkeypatch)
        traced, cache = _greedy_logits(model, prompt, steps=12)
        made = _traces(model)
    _assert_same(traced, built)
    _assert_same(traced, replayed)
    # offsets 250 .. 261; capacity 256 for the first 6 steps (traced at the second), the growth step, then the new
    # capacity (its first step makes the layers' replays, the second traces)
    assert list(made.values()) == [True, True] and [k[3] for k in made] == [(256,), (256 + 1024,)], made
    layers = len(model.layers)
    # the decoder layers run in 5 of the 12 steps: each capacity's first (its replays made) and second (traced from
    # them), and the growth step (no room in the buffers); the other 7 replay the step trace
    assert len(calls) == layers * 5, len(calls)
    for mine, want in zip(cache, built_cache):
        if type(mine) is KVCache:
            assert mine.offset == want.offset == len(prompt) + 12
            live = slice(0, want.offset)
            assert mx.array_equal(mine.keys[..., live, :], want.keys[..., live, :]).item()
            assert mx.array_equal(mine.values[..., live, :], want.values[..., live, :]).item()
        else:
            for a, b in zip(mine.cache, want.cache):
                assert mx.array_equal(a, b).item()


def test_step_trace_follows_replaced_weights_and_comes_back_after_a_toggle(model):
    """Weights set into the model (the lm_head's, the final norm's, a DeltaNet projection's) make the step traces
    again, so the steps keep the built steps' bits; a switch turned off and on again, and the dispatch plan resolved
    again from the same environment, find the trace kept."""
    prompt = list(range(3, 40))
    with _patched_with_step_trace(model):
        def both():
            with switches.overrides(disable=["compiled_decode"]):
                built, _ = _greedy_logits(model, prompt)
            traced, _ = _greedy_logits(model, prompt)
            _assert_same(traced, built)
            return traced

        before = both()
        made = _traces(model)
        assert True in made.values()
        with switches.overrides(disable=["gqa_packing"]):
            pass
        dispatch.invalidate()  # (the plan resolved again from the same environment: the same choices)
        again, _ = _greedy_logits(model, prompt)
        assert _traces(model) == made  # the same state: the kept trace, none made
        _assert_same(again, before)

        text_model = model.language_model
        text_model.lm_head.update({"scales": text_model.lm_head.scales * 1.5})
        after_head = both()
        assert not mx.array_equal(after_head[-1], before[-1]).item()
        text_model.model.norm.weight = text_model.model.norm.weight * 0.5
        after_norm = both()
        assert not mx.array_equal(after_norm[-1], after_head[-1]).item()
        deltanet = next(layer for layer in model.layers if layer.is_linear).linear_attn
        deltanet.out_proj.update({"biases": deltanet.out_proj.biases + 0.01})
        after_projection = both()
        assert not mx.array_equal(after_projection[-1], after_norm[-1]).item()
    assert step_trace._TRACES not in model.language_model.__dict__  # unpatch drops them


def test_step_trace_needs_the_switch_when_the_model_is_patched(model, caplog):
    """Turned on after the model was patched, the switch finds modules that do not report weight changes: the step is
    built layer by layer (said once), with the same bits."""
    prompt = list(range(3, 30))
    lily_patch.patch(model)
    try:
        replayed, _ = _greedy_logits(model, prompt)
        with switches.overrides(enable=["step_trace"]):
            with caplog.at_level("INFO", logger="lily_mlx"):
                late, _ = _greedy_logits(model, prompt)
            assert set(_traces(model).values()) == {False}
    finally:
        lily_patch.unpatch(model)
    _assert_same(late, replayed)
    assert "step_trace: not used for this model" in caplog.text


def test_batched_generation_keeps_its_layer_by_layer_steps(model):
    """MLX-LM's batch caches (offsets and masks as arrays) are not ones a step trace moves on: a batch decodes as
    without the switch, bit for bit."""
    from tests.kernels.test_batch_invariance import _batched_generation

    rows = [list(range(3, 3 + n)) for n in (9, 4, 13)]
    with _patched_with_step_trace(model):
        with switches.overrides(disable=["step_trace"]):
            want = _batched_generation(model, rows)
        got = _batched_generation(model, rows)
        assert not _traces(model)
    for r, (a_row, b_row) in enumerate(zip(got, want)):
        for step, (a, b) in enumerate(zip(a_row, b_row)):
            assert mx.array_equal(a, b).item(), f"row {r}, step {step}"


def test_step_traces_keep_neither_the_model_nor_the_caches_alive(monkeypatch):
    """A step trace's function refers to its model (a cycle the garbage collector must free, or a deleted 20 GB model
    would stay in memory) and reads the caches only while it is traced (a request's caches are freed with it)."""
    import gc
    import weakref

    from mlx_lm.models.cache import make_prompt_cache

    monkeypatch.setenv("LILY_BACKEND", "reference")
    monkeypatch.setattr(compiled, "COMPILE_BACKENDS", compiled.COMPILE_BACKENDS | {"reference"})
    model, _ = mlx_lm.load(str(embedded.EMBEDDED_DIR))  # (not the fixture's: it holds its model until teardown)
    with switches.overrides(enable=["step_trace"]):
        lily_patch.patch(model)
        cache = make_prompt_cache(model)
        logits = model(mx.array([list(range(3, 20))]), cache=cache)
        for _ in range(4):
            logits = model(mx.argmax(logits[:, -1], axis=-1)[:, None], cache=cache)
        mx.eval(logits)
        assert list(_traces(model).values()) == [True]
    # (modules models share, such as MLX-LM's default SwiGLU, get their stock class back after: unpatch would drop the
    # traces this test is about)
    # (held weakly: the watching and guarding classes cover the whole tree, the outer model included)
    watched = [weakref.ref(m) for m in {id(m): m for m in model.modules()
                                        if type(m).__dict__.get("_lily_watch_only")}.values()]
    text_model, first_cache = weakref.ref(model.language_model), weakref.ref(cache[0])
    del model, cache, logits
    gc.collect()
    alive = text_model() is not None or first_cache() is not None
    for module in filter(None, (ref() for ref in watched)):  # what outlives the model: modules models share
        module.__class__ = type(module)._lily_stock_class
    assert not alive


def test_a_prompt_cache_carried_across_requests(model):
    """A conversation on one prompt cache through MLX-LM's ``generate_step`` (as the server reuses a cache: a second
    request continues the first's), then a fresh cache of another length: every step's log-probabilities are the
    layers' own replays', bit for bit, while the step traces carry over between requests with the same KV capacity."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    requests = [list(range(5, 40)), list(range(60, 75)), list(range(100, 190))]

    def conversation():
        out, cache = [], make_prompt_cache(model)
        for i, prompt in enumerate(requests):
            if i == 2:
                cache = make_prompt_cache(model)  # (a new request with its own cache)
            for _, logprobs in generate_step(mx.array(prompt), model, max_tokens=6, prompt_cache=cache,
                                             sampler=lambda lp: mx.argmax(lp, axis=-1)):
                out.append(logprobs)
        return out

    with _patched_with_step_trace(model):
        with switches.overrides(disable=["step_trace"]):
            want = conversation()
        got = conversation()
        assert True in _traces(model).values()
    _assert_same(got, want)
    assert len(got) == len(want) == 18


def test_a_step_that_cannot_be_traced_whole_leaves_the_caches_as_they_were(model, monkeypatch, caplog):
    """With no layer replay marked shape-stable, tracing the whole step stops at the first decoder layer: the caches
    get their states and offsets back, the step is built layer by layer (said once), and decoding keeps the built
    steps' bits."""
    prompt = list(range(3, 40))
    with _patched_with_step_trace(model):
        with switches.overrides(disable=["compiled_decode"]):
            built, built_cache = _greedy_logits(model, prompt)
        monkeypatch.setattr(compiled, "shape_stable", lambda replay: replay)
        with caplog.at_level("INFO", logger="lily_mlx"):
            got, cache = _greedy_logits(model, prompt)
        assert set(_traces(model).values()) == {False}
    _assert_same(got, built)
    assert "could not be traced whole" in caplog.text
    for mine, want in zip(cache, built_cache):
        assert getattr(mine, "offset", None) == getattr(want, "offset", None)


@pytest.mark.parametrize("model_type, traced", [("qwen3_next", True), ("qwen3_5", False)])
def test_step_trace_on_the_other_architectures(monkeypatch, tmp_path, model_type, traced):
    """Qwen3-Next (its ``Model`` patched, MoE layers traced whole: the step is traced whole) and dense Qwen3.5 (a dense
    MLP: its layers are not traced whole, so neither is the step): the built steps' bits either way."""
    from tests.integration.tiny_models import build_random_model

    monkeypatch.setenv("LILY_BACKEND", "reference")
    monkeypatch.setattr(compiled, "COMPILE_BACKENDS", compiled.COMPILE_BACKENDS | {"reference"})
    model, tokenizer = mlx_lm.load(str(build_random_model(tmp_path, model_type, seed=1)))
    prompt = tokenizer.encode("hello world test")
    with switches.overrides(enable=["step_trace"]):
        lily_patch.patch(model)
        try:
            with switches.overrides(disable=["compiled_decode"]):
                built, _ = _greedy_logits(model, prompt)
            got, _ = _greedy_logits(model, prompt)
            text_model = next(m for m in model.modules() if step_trace._TRACES in m.__dict__)
            made = [v[1] is not None for v in text_model.__dict__[step_trace._TRACES].values()]
        finally:
            lily_patch.unpatch(model)
    assert made == [traced], made
    _assert_same(got, built)
