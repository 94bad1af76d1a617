"""``core.compiled``: a piece traced once and replayed computes what the eager piece computes, reads the
owner's current weights, and a piece that cannot be traced runs eagerly (weights untouched)."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from lily_mlx.core import compiled, switches
from tests.kernels.test_compiled_decode import _class_name


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


@pytest.mark.parametrize("off", ["compiled_decode", "compiled_layers", "compiled_attention", "one_trace_attention"])
def test_decode_traces_give_the_bits_of_steps_built_op_by_op(monkeypatch, off):
    """The embedded model's greedy decode logits and MLX-LM's batched generation (batch cache: offsets and
    masks as arrays) are bitwise the same with every trace on as with ``off`` off: whole decoder layers
    (compiled_layers: a DeltaNet layer in one trace, an attention layer in one over its KV buffer or two around
    its cache: one_trace_attention, batch caches), the
    attention layers' own pieces (compiled_attention, the cache offset an input), and all of them
    (compiled_decode: every step built op by op). Traced on the CPU here (plain MLX ops on the reference
    backend, the traceable backends widened for the test); with the kernels on a GPU:
    tests/kernels/test_compiled_decode.py."""
    import mlx_lm

    from lily_mlx import patch as lily_patch
    from lily_mlx.models import embedded
    from tests.kernels.test_batch_invariance import PROMPTS, _batched_generation
    from tests.kernels.test_compiled_decode import _greedy_logits

    monkeypatch.setenv("LILY_BACKEND", "reference")
    monkeypatch.setattr(compiled, "COMPILE_BACKENDS", compiled.COMPILE_BACKENDS | {"reference"})
    model, tokenizer = mlx_lm.load(str(embedded.EMBEDDED_DIR))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    lily_patch.patch(model)
    try:
        with switches.overrides(disable=[off]):
            built, _ = _greedy_logits(model, prompts[2])
            built_rows = _batched_generation(model, [prompts[r] for r in (3, 1, 0)])
        traced, _ = _greedy_logits(model, prompts[2])
        traced_rows = _batched_generation(model, [prompts[r] for r in (3, 1, 0)])
        traces = [(_class_name(m), k, v) for _, m in model.named_modules()
                  for k, v in m.__dict__.get("_lily_compiled", {}).items()]
        assert all(v is not compiled._FAILED for _, _, v in traces)
        # every layer traced whole: DeltaNet layers in one trace, attention layers over the plain cache's buffer in
        # one (kv_write_in_trace, one_trace_attention; with the latter off in two, the first writing the buffer),
        # over the batch cache in two around its update (built between them)
        assert {k[0] for owner, k, _ in traces if owner.endswith("DecoderLayer")} == {
            "layer", "prep", "layer_in_buffer", "out"} | ({"prep_in_buffer"} if off == "one_trace_attention" else set())
        if off == "compiled_decode":  # no piece was ever traced on its own
            assert {owner for owner, _, _ in traces} == {"LilyDecoderLayer"}
    finally:
        lily_patch.unpatch(model)
    for step, (a, b) in enumerate(zip(traced, built)):
        assert mx.array_equal(a, b).item(), f"step {step}"
    for r, (got, want) in enumerate(zip(traced_rows, built_rows)):
        for step, (a, b) in enumerate(zip(got, want)):
            assert mx.array_equal(a, b).item(), f"row {r}, step {step}"


def test_decode_across_the_kv_buffers_growth(monkeypatch):
    """``kv_write_in_trace``: a decode step writes its keys and values into the plain KV cache's buffer and
    attends over the whole buffer with the rows past the offset masked (in one trace of the whole layer, or two
    with ``one_trace_attention`` off) (the reference backend: no live-length
    kernels). Across the buffer's growth (256 -> 256 + ``BUFFER_GROWTH_ROWS`` rows: the growth step is built by
    MLX-LM's ``update_and_fetch`` with the larger step, the steps after it trace anew for the new capacity and the
    old capacity's trace is dropped) the traced steps give the bits of the steps built op by op, and the switch
    off (stock's update and attention over the live rows) gives the same bits on the CPU (masked scores weigh
    exactly 0); the cache's live rows end as MLX-LM's own update leaves them."""
    from lily_mlx.ops.attention.layer import BUFFER_GROWTH_ROWS
    import mlx_lm

    from lily_mlx import patch as lily_patch
    from lily_mlx.models import embedded
    from tests.kernels.test_compiled_decode import _greedy_logits

    monkeypatch.setenv("LILY_BACKEND", "reference")
    monkeypatch.setattr(compiled, "COMPILE_BACKENDS", compiled.COMPILE_BACKENDS | {"reference"})
    model, _ = mlx_lm.load(str(embedded.EMBEDDED_DIR))
    prompt = mx.random.randint(0, 1000, (250,), key=mx.random.key(7)).tolist()
    steps = 12  # offsets 250 .. 261: the step at 256 grows the buffer

    def greedy():
        return _greedy_logits(model, prompt, steps=steps)

    lily_patch.patch(model)
    try:
        with switches.overrides(disable=["compiled_decode"], enable=["kv_write_in_trace"]):
            built, _ = greedy()
        with switches.overrides(disable=["kv_write_in_trace"]):
            unbuffered, stock_cache = greedy()
        with switches.overrides(enable=["kv_write_in_trace"], disable=["one_trace_attention"]):
            two_traces, _ = greedy()
        with switches.overrides(enable=["kv_write_in_trace", "one_trace_attention"]):
            traced, cache = greedy()
        attention_layers = [layer for layer in model.layers if not layer.is_linear]
        for layer in attention_layers:
            for kind in ("layer_in_buffer", "prep_in_buffer"):  # one trace a step, or two (one_trace_attention off)
                kept = [k for k in layer.__dict__["_lily_compiled"] if k[0] == kind]
                assert [k[-1] for k in kept] == [256 + BUFFER_GROWTH_ROWS], (kind, kept)  # 256 rows' trace dropped
    finally:
        lily_patch.unpatch(model)
    for step, (a, b, c, d) in enumerate(zip(traced, built, unbuffered, two_traces)):
        assert mx.array_equal(a, b).item(), f"step {step}"
        assert mx.array_equal(a, c).item(), f"step {step}"
        assert mx.array_equal(a, d).item(), f"step {step}"
    for mine, stock in zip(cache, stock_cache):
        if hasattr(stock, "offset") and not isinstance(stock.offset, mx.array):
            assert mine.offset == stock.offset == len(prompt) + steps
            assert stock.keys.shape[2] == 512 and mine.keys.shape[2] == 256 + BUFFER_GROWTH_ROWS
            assert mine.keys.shape[:2] + mine.keys.shape[3:] == stock.keys.shape[:2] + stock.keys.shape[3:]
            live = slice(0, stock.offset)
            assert mx.array_equal(mine.keys[..., live, :], stock.keys[..., live, :]).item()
            assert mx.array_equal(mine.values[..., live, :], stock.values[..., live, :]).item()


def test_decode_steps_replay_their_resolved_path_until_something_changes(monkeypatch):
    """After one step through the layer traces, a decoder layer replays it (``compiled.LayerStep``): later
    steps skip the per-call path choices. The replay gives the built steps' bits, and it is not used once a
    switch changes (the path is chosen again) nor after a projection's weights are replaced (the fused
    in-projections are prepared again: the logits follow the new weights, as the built steps do). Every op
    on its reference but the fused in-projections (MLX's own matmul, taken off the reference backend so that
    they run fused), all traced on the CPU."""
    import mlx_lm

    from lily_mlx import patch as lily_patch
    from lily_mlx.core import dispatch
    from lily_mlx.models import embedded
    from lily_mlx.ops import load_all
    from lily_mlx.ops.moe import layer as moe_layer
    from tests.kernels.test_batch_invariance import PROMPTS
    from tests.kernels.test_compiled_decode import STEPS, _greedy_logits

    fused_ops = {"deltanet_in_proj", "attention_qkv_proj"}
    monkeypatch.setenv("LILY_BACKEND", "sim")
    monkeypatch.setenv("LILY_REFERENCE_OPS", ",".join(sorted(set(load_all()) - fused_ops)))
    monkeypatch.setattr(compiled, "COMPILE_BACKENDS", compiled.COMPILE_BACKENDS | {"reference", "sim"})
    chosen = []  # decode calls that chose their path (the others replayed)
    real = moe_layer._traced_layer
    monkeypatch.setattr(moe_layer, "_traced_layer", lambda *a: chosen.append(1) or real(*a))
    model, tokenizer = mlx_lm.load(str(embedded.EMBEDDED_DIR))
    prompt = tokenizer.encode(PROMPTS[2])
    n_layers = len(model.layers)
    lily_patch.patch(model)
    try:
        with switches.overrides(disable=["compiled_decode"]):
            built, _ = _greedy_logits(model, prompt)
        chosen.clear()
        traced, _ = _greedy_logits(model, prompt)
        assert len(chosen) == n_layers  # the first step chose, the other STEPS - 1 replayed
        assert all(dispatch.op_backend(op) == "sim" for op in fused_ops)
        again, _ = _greedy_logits(model, prompt)  # a new cache of the same kind: every step replayed
        assert len(chosen) == n_layers
        assert all(mx.array_equal(a, b).item() for a, b in zip(again, built))
        assert all(mx.array_equal(a, b).item() for a, b in zip(traced, built))

        chosen.clear()
        with switches.overrides(disable=["fused_add_norm"]):
            _greedy_logits(model, prompt)
        assert len(chosen) == n_layers  # chosen again under the override
        _greedy_logits(model, prompt)
        assert len(chosen) == 2 * n_layers  # and again after it
        chosen.clear()
        with switches.overrides(disable=["layer_replay"]):
            unreplayed, _ = _greedy_logits(model, prompt)
        assert len(chosen) == n_layers * STEPS  # the switch off: every step chooses
        assert all(mx.array_equal(a, b).item() for a, b in zip(unreplayed, built))
        _greedy_logits(model, prompt)  # replays made again

        deltanet = next(layer for layer in model.layers if layer.is_linear).linear_attn
        attention = next(layer for layer in model.layers if not layer.is_linear).self_attn
        for module in (deltanet.in_proj_qkv, attention.k_proj):
            out_dims, in_dims = module.weight.shape[0], module.weight.shape[1] * 32 // module.bits
            linear = nn.Linear(in_dims, out_dims, bias=False)
            linear.set_dtype(module.scales.dtype)
            fresh = nn.QuantizedLinear.from_linear(linear, group_size=module.group_size, bits=module.bits)
            module.update(fresh.parameters())
        chosen.clear()
        traced_new, _ = _greedy_logits(model, prompt)
        # the two layers whose projections changed chose again (once), the rest replayed; with constant_weights on
        # at patch time any weight change makes every layer's traces again (and preparing the fused projections anew
        # at the first step is one more change: the layers after it choose once more at the next step)
        if getattr(type(model.layers[0]), "_lily_reports_weights", False):
            assert n_layers <= len(chosen) <= 2 * n_layers
        else:
            assert len(chosen) == 2
        with switches.overrides(disable=["compiled_decode"]):
            built_new, _ = _greedy_logits(model, prompt)
    finally:
        lily_patch.unpatch(model)
    assert len(traced_new) == STEPS + 1
    assert all(mx.array_equal(a, b).item() for a, b in zip(traced_new, built_new))
    assert not mx.array_equal(traced_new[-1], traced[-1]).item()


def test_layer_traces_with_a_quantized_kv_cache(monkeypatch):
    """MLX-LM's generate_step with --kv-bits (the attention layers' cache turns into a QuantizedKVCache
    mid-generation): tokens and log-probabilities with the layer traces are those of the steps built op by
    op, and the tokens are stock's (reference backend, traces widened to it as above)."""
    import mlx_lm
    from mlx_lm.generate import generate_step

    from lily_mlx import patch as lily_patch
    from lily_mlx.models import embedded

    monkeypatch.setenv("LILY_BACKEND", "reference")
    monkeypatch.setattr(compiled, "COMPILE_BACKENDS", compiled.COMPILE_BACKENDS | {"reference"})
    model, tokenizer = mlx_lm.load(str(embedded.EMBEDDED_DIR))
    prompt = mx.array(tokenizer.encode("Return the value of the parameter named in the request"))

    def run():
        steps = generate_step(prompt, model, kv_bits=4, kv_group_size=64, quantized_kv_start=4)
        return [(int(token), logprobs) for (token, logprobs), _ in zip(steps, range(12))]

    stock = run()
    lily_patch.patch(model)
    try:
        with switches.overrides(disable=["compiled_decode"]):
            built = run()
        traced = run()
        assert any(m.__dict__.get("_lily_compiled") for _, m in model.named_modules())
    finally:
        lily_patch.unpatch(model)
    assert [t for t, _ in traced] == [t for t, _ in built] == [t for t, _ in stock]
    assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(traced, built))


def test_sharded_layers_keep_their_collectives_out_of_traces(monkeypatch):
    """After MLX-LM's shard() (a one-rank group here) the attention projections and MoE blocks hold
    all_sum: no layer or attention trace is made (the DeltaNet mixers' own traces stop before their
    all_sum, as before), and decode runs."""
    import mlx_lm

    from lily_mlx import patch as lily_patch
    from lily_mlx.models import embedded
    from tests.kernels.test_compiled_decode import _greedy_logits

    monkeypatch.setenv("LILY_BACKEND", "reference")
    monkeypatch.setattr(compiled, "COMPILE_BACKENDS", compiled.COMPILE_BACKENDS | {"reference"})
    model, tokenizer = mlx_lm.load(str(embedded.EMBEDDED_DIR))
    model.shard(mx.distributed.init())
    lily_patch.patch(model)
    try:
        _greedy_logits(model, tokenizer.encode("Return the value"))
        owners = {_class_name(m) for _, m in model.named_modules() if m.__dict__.get("_lily_compiled")}
    finally:
        lily_patch.unpatch(model)
    assert owners <= {"LilyGatedDeltaNet"}, owners


@pytest.mark.parametrize("model_type, owners", [("qwen3_next", {"LilyQwen3NextDecoderLayer"}),
                                                ("qwen3_5", {"LilyQwen3NextAttention", "LilyGatedDeltaNet"})])
def test_traces_of_the_other_architectures(monkeypatch, tmp_path, model_type, owners):
    """Qwen3-Next (MoE: whole layers traced) and dense Qwen3.5 (a dense MLP: the layers are not traced
    whole, the attention and DeltaNet pieces are): traced decode steps have the bits of steps built op by op."""
    import mlx_lm

    from lily_mlx import patch as lily_patch
    from tests.integration.tiny_models import build_random_model
    from tests.kernels.test_compiled_decode import _greedy_logits

    monkeypatch.setenv("LILY_BACKEND", "reference")
    monkeypatch.setattr(compiled, "COMPILE_BACKENDS", compiled.COMPILE_BACKENDS | {"reference"})
    model, tokenizer = mlx_lm.load(str(build_random_model(tmp_path, model_type, seed=1)))
    lily_patch.patch(model)
    try:
        with switches.overrides(disable=["compiled_decode"]):
            built, _ = _greedy_logits(model, tokenizer.encode("hello world test"))
        traced, _ = _greedy_logits(model, tokenizer.encode("hello world test"))
        got = {_class_name(m) for _, m in model.named_modules() if m.__dict__.get("_lily_compiled")}
    finally:
        lily_patch.unpatch(model)
    assert got == owners
    for step, (a, b) in enumerate(zip(traced, built)):
        assert mx.array_equal(a, b).item(), f"step {step}"


def _fresh_like(module):
    """A quantised projection of ``module``'s shape and quantisation with new random weights."""
    out_dims, in_dims = module.weight.shape[0], module.weight.shape[1] * 32 // module.bits
    linear = nn.Linear(in_dims, out_dims, bias=False)
    linear.set_dtype(module.scales.dtype)
    return nn.QuantizedLinear.from_linear(linear, group_size=module.group_size, bits=module.bits)


def test_constant_weights_give_the_built_bits_and_follow_replaced_weights(monkeypatch):
    """Switch ``constant_weights`` on when the model is patched: the decoder layers' traces hold their weights as
    constants. Decode steps through them have the bits of steps built op by op and make nothing again from step to
    step; weights replaced through the modules (a projection's ``update``; a module set in, then its weights
    updated) are followed as the built steps follow them; the patch report counts what it did without the switch;
    ``unpatch`` gives every module its stock class back."""
    import mlx_lm

    from lily_mlx import patch as lily_patch
    from lily_mlx.core import generation
    from lily_mlx.models import embedded
    from tests.kernels.test_compiled_decode import _greedy_logits

    monkeypatch.setenv("LILY_BACKEND", "reference")
    monkeypatch.setattr(compiled, "COMPILE_BACKENDS", compiled.COMPILE_BACKENDS | {"reference"})
    model, tokenizer = mlx_lm.load(str(embedded.EMBEDDED_DIR))
    prompt = tokenizer.encode("Return the value of the parameter named in the request")
    stock_classes = [type(m) for m in model.modules()]
    lily_patch.patch(model)
    report = lily_patch.patch_report(model).layers
    lily_patch.unpatch(model)
    mx.random.seed(11)

    def both():
        with switches.overrides(disable=["compiled_decode"]):
            built, _ = _greedy_logits(model, prompt)
        traced, _ = _greedy_logits(model, prompt)
        assert all(mx.array_equal(a, b).item() for a, b in zip(traced, built))
        return traced

    with switches.overrides(enable=["constant_weights"]):
        lily_patch.patch(model)
        try:
            assert lily_patch.patch_report(model).layers == report
            before = both()
            epoch = generation.weights_epoch()
            owners = [m for m in model.modules() if m.__dict__.get("_lily_compiled")]
            assert owners and all(m.__dict__["_lily_constant_weights"] == (epoch, True) for m in owners)
            again, _ = _greedy_logits(model, prompt)
            assert generation.weights_epoch() == epoch  # decoding sets nothing into the modules
            assert all(mx.array_equal(a, b).item() for a, b in zip(again, before))

            deltanet = next(layer for layer in model.layers if layer.is_linear).linear_attn
            deltanet.out_proj.update(_fresh_like(deltanet.out_proj).parameters())
            after_update = both()
            assert not mx.array_equal(after_update[-1], before[-1]).item()

            attention = next(layer for layer in model.layers if not layer.is_linear).self_attn
            attention.o_proj = _fresh_like(attention.o_proj)  # a module set in reports its own changes after
            after_module = both()
            attention.o_proj.update(_fresh_like(attention.o_proj).parameters())
            after_its_update = both()
            assert not mx.array_equal(after_its_update[-1], after_module[-1]).item()
        finally:
            lily_patch.unpatch(model)
    assert [type(m) for m in model.modules()] == stock_classes


def test_weights_held_in_a_plain_list_stay_trace_inputs():
    """An owner whose tree holds arrays or modules in a plain list (whose items change unseen) keeps its weights as
    the traces' implicit inputs with ``constant_weights`` on: a replaced list item is read at the next call."""
    from lily_mlx import patch as lily_patch

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.parts = [nn.Linear(8, 8)]
            self.norm = nn.RMSNorm(8)

    holder = Holder()
    lily_patch._report_weights(holder)
    assert getattr(type(holder.norm), "_lily_reports_weights", False)
    assert compiled._weights_watched(holder.norm) and not compiled._weights_watched(holder)
    fn = lambda x: holder.norm(holder.parts[0](x))  # noqa: E731
    x = mx.random.normal((1, 8))
    with switches.overrides(enable=["constant_weights"]):
        first = compiled.call(holder, "k", fn, (x,))
        holder.parts[0] = nn.Linear(8, 8)  # a list item: no module sees it
        second = compiled.call(holder, "k", fn, (x,))
    assert mx.array_equal(second, fn(x)).item() and not mx.array_equal(first, second).item()
