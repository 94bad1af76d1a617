"""``compiled_decode`` (with ``compiled_layers`` and ``compiled_attention``) on a backend whose kernels
are MLX primitives (``LILY_TEST_KERNEL_BACKEND=cuda`` on an NVIDIA GPU, ``metal`` on a Mac): decode steps replayed from their traces give the bits of the
steps built launch by launch, alone (B = 1) and in MLX-LM's batched generation (masks, left padding).
The simulator computes eagerly and cannot be traced, so there these tests skip (CI covers the
tracing helper itself in tests/core/test_compiled.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from lily_mlx.core import compiled, switches
from tests.kernels.kernel_backend import KERNEL_BACKEND, kernel_backend_problem
from tests.kernels.test_batch_invariance import _batched_generation, embedded_model  # noqa: F401

pytestmark = pytest.mark.skipif(
    KERNEL_BACKEND not in compiled.COMPILE_BACKENDS or kernel_backend_problem() is not None,
    reason=f"kernel backend {KERNEL_BACKEND} runs eagerly (no traces) or is unavailable")

STEPS = 6


def _greedy_logits(model, prompt, steps=STEPS):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1:]
    out = [logits]
    for _ in range(steps):
        token = mx.argmax(logits[:, -1], axis=-1)[:, None]
        logits = model(token, cache=cache)
        out.append(logits)
    mx.eval(out)
    return out, cache


def _class_name(module) -> str:
    """A module's class name, the same with switch ``constant_weights`` on (whose lily classes add "Reporting")."""
    return type(module).__name__.removesuffix("Reporting")


def _assert_same_caches(got, want):
    """The caches' offsets (a KV cache's; a DeltaNet layer's ArraysCache has none) and state arrays, bit for bit."""
    for i, (ca, cb) in enumerate(zip(got, want)):
        assert getattr(ca, "offset", None) == getattr(cb, "offset", None), f"cache {i}"
        for a, b in zip(ca.state, cb.state):
            if isinstance(a, mx.array):
                assert mx.array_equal(a, b).item(), f"cache {i}"


def _traced_modules(model):
    return [m for _, m in model.named_modules() if m.__dict__.get("_lily_compiled")]


def test_decode_steps_from_traces_equal_built_steps(embedded_model, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    model, prompts = embedded_model
    with switches.overrides(disable=["compiled_decode"]):
        built, built_cache = _greedy_logits(model, prompts[2])
    traced, traced_cache = _greedy_logits(model, prompts[2])
    kinds = {_class_name(m) for m in _traced_modules(model)}
    # whole layers (compiled_layers): a DeltaNet layer in one trace, an attention layer in one where the step
    # attends over its KV buffer (kv_write_in_trace, one_trace_attention), else in two around its cache
    assert kinds and all(k.endswith("DecoderLayer") for k in kinds), kinds
    pieces = {key[0] for m in _traced_modules(model) for key in m.__dict__["_lily_compiled"]}
    assert "layer" in pieces and pieces <= {"layer", "layer_in_buffer", "prep", "out"}, pieces
    assert "layer_in_buffer" in pieces or {"prep", "out"} <= pieces, pieces
    for step, (a, b) in enumerate(zip(traced, built)):
        assert mx.array_equal(a, b).item(), f"step {step}"
    _assert_same_caches(traced_cache, built_cache)


def test_device_positions_give_the_same_traced_steps(embedded_model, monkeypatch):  # noqa: F811
    """``device_positions``: the traced steps read the step's position from a wide array made on the GPU from the
    last step's (a view of its element 0); the logits and caches are those of the host-made scalar, bit for bit."""
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    model, prompts = embedded_model
    host, host_cache = _greedy_logits(model, prompts[2])
    with switches.overrides(enable=["device_positions"]):
        device, device_cache = _greedy_logits(model, prompts[2])
    for step, (a, b) in enumerate(zip(device, host)):
        assert mx.array_equal(a, b).item(), f"step {step}"
    _assert_same_caches(device_cache, host_cache)


def test_batched_decode_from_traces_equals_built(embedded_model, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    model, prompts = embedded_model
    rows = [prompts[r] for r in (3, 1, 0)]
    with switches.overrides(disable=["compiled_decode"]):
        built = _batched_generation(model, rows)
    traced = _batched_generation(model, rows)
    for r, (got, want) in enumerate(zip(traced, built)):
        for step, (a, b) in enumerate(zip(got, want)):
            assert mx.array_equal(a, b).item(), f"row {r}, step {step}"


def test_decode_over_the_kv_buffer_matches_the_live_rows(embedded_model, monkeypatch):  # noqa: F811
    """``kv_write_in_trace`` on this backend: attending over the whole KV buffer with the rows past the offset
    masked computes the attention over the live rows (the switch off) up to the order of the GPU's sums,
    across the buffer's growth (a 250-token prompt, 12 steps: the step at 256 grows it): the same greedy
    tokens, logits within bf16 noise."""
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    model, _ = embedded_model
    prompt = mx.random.randint(0, 1000, (250,), key=mx.random.key(7)).tolist()
    with switches.overrides(disable=["kv_write_in_trace"]):
        live, _ = _greedy_logits(model, prompt, steps=12)
    with switches.overrides(enable=["kv_write_in_trace"]):
        buffered, _ = _greedy_logits(model, prompt, steps=12)
    for step, (a, b) in enumerate(zip(buffered, live)):
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        assert mx.array_equal(a.argmax(-1), b.argmax(-1)).item(), f"step {step}"
        rel = (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()
        assert rel < 1e-2, (step, rel)


def test_step_trace_gives_the_layer_steps_bits(embedded_model, monkeypatch):  # noqa: F811
    """``step_trace`` on this backend (on when the model is patched): greedy decode from a 250-token prompt across
    the KV buffers' growth replays one trace of the whole step at each capacity, bit for bit the steps of the layers'
    own replays and of the steps built launch by launch, caches included."""
    from lily_mlx import patch as lily_patch
    from lily_mlx.core import step_trace

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    model, _ = embedded_model
    prompt = mx.random.randint(0, 1000, (250,), key=mx.random.key(7)).tolist()
    with switches.overrides(disable=["compiled_decode"]):
        built, _ = _greedy_logits(model, prompt, steps=12)
    replayed, replayed_cache = _greedy_logits(model, prompt, steps=12)
    lily_patch.unpatch(model)
    try:
        with switches.overrides(enable=["step_trace"]):
            lily_patch.patch(model)
            traced, cache = _greedy_logits(model, prompt, steps=12)
            made = [v[1] is not None for v in model.language_model.__dict__[step_trace._TRACES].values()]
    finally:
        lily_patch.unpatch(model)
        lily_patch.patch(model)  # (the module's fixture: patched as before)
    assert made == [True, True], made
    for step, (a, b, c) in enumerate(zip(traced, replayed, built)):
        assert mx.array_equal(a, b).item(), f"step {step}"
        assert mx.array_equal(a, c).item(), f"step {step}"
    _assert_same_caches(cache, replayed_cache)
