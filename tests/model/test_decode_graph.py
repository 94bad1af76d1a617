"""A decode step's graph on lily's CUDA path, checked on any machine (``lily_dev.graph_only``: every kernel a
placeholder, everything else as the GPU builds it): which kernels a step launches, which MLX ops it builds
besides, that the layer traces hold the same launches as a step built op by op, and how much Python a
replayed step runs. These are issue 12's structure (launches and primitives per step, host work per step)
as tests that fail when a change adds work to every decode step; the numbers themselves are measured on
the GPU (``bench.run --mode decode-profile``)."""

import contextlib
import cProfile
import pstats

import mlx.core as mx
import pytest

import lily_mlx
from bench.decode_profile import VIEW_PRIMITIVES, _prefill, _step
from bench.model_setup import build_random_model, model_config
from lily_dev.graph_only import count_step, cuda_graph_only, fast_op_calls
from lily_mlx.core import switches
from lily_mlx.core.kernel_registry import record_launches

LAYERS = 4  # three DeltaNet layers and one attention layer (Qwen3.6 attends every 4th layer)
VOCAB = 1024

# The launches of one decoder layer's decode step, by its mixer (the MoE block's three are in both).
MOE = {"moe_residual_norm_router_logits_q": 1, "moe_gemv_gate_up_swiglu_routed": 1, "moe_gemv_down_combine": 1}
DELTANET = {"deltanet_decode_conv_fused": 1, **MOE}
ATTENTION = {"attention_qk_prep": 1, "attention_decode_block_partials_live": 1, "attention_decode_merge_live_blocks": 1,
             **MOE}
# What a step must not build on the kernels' path: stock's attention, the MoE block's gathered matmuls, the
# KV cache's whole-buffer update.
STOCK_ONLY = ("Softmax", "Matmul", "ScaledDotProductAttention", "GatherQMM", "GatherMM", "SliceUpdate",
              "DynamicSliceUpdate")
# Non-view primitives of a decode step as the GPU counts them (issue 12 asks <= 250 at Qwen3.6's 40 layers; 347 on
# 2026-12-04, docs/decode.md): a DeltaNet layer's input RMSNorm, fused in-projection, conv-step kernel, out_proj and
# the MoE block's 3 kernels; an attention layer's input RMSNorm, fused q/k/v, q/k preparation, 2 KV-row scatters,
# partials, merge, output gate (Sigmoid, Multiply), o_proj and the MoE block's 3; the embedding's 3 Gathers and its
# dequantisation, the final RMSNorm, lm_head and the greedy pick. A change that adds or removes primitives in every
# step changes these on purpose.
PRIMITIVES_DELTANET_LAYER = 7
PRIMITIVES_ATTENTION_LAYER = 13
PRIMITIVES_OUTSIDE_LAYERS = 7
# Python calls of one replayed decode step at LAYERS layers, measured 2026-12-04: 230 (lily's own code, MLX-LM's model
# loop, and ~20 of the harness's stand-ins for the final norm and the embedding): a bound with room for small
# changes, not a target. Raise it only for a reason.
PYTHON_CALLS_PER_STEP = 270


@contextlib.contextmanager
def _on_the_cuda_path(model):
    """``model`` patched on lily's CUDA path with placeholder kernels, unpatched after (a patch may touch modules that
    models share, such as MLX-LM's default SwiGLU activation: no test leaves it changed for the next)."""
    with cuda_graph_only():
        lily_mlx.patch(model)
        try:
            yield
        finally:
            lily_mlx.unpatch(model)


@pytest.fixture
def decoding():
    """(model, last token, cache) a few decode steps in, lily's CUDA path with placeholder kernels."""
    model = build_random_model(model_config("tiny", LAYERS), seed=0, log=None)
    with _on_the_cuda_path(model):
        y, cache = _prefill(model, 40, VOCAB, 0)
        for _ in range(3):  # traced, then replayed
            y = _step(model, y, cache)
            mx.eval(y)
        yield model, y, cache


def _expected_launches(model):
    layers = model.language_model.model.layers
    counts = {}
    for layer in layers:
        for name, n in (DELTANET if layer.is_linear else ATTENTION).items():
            counts[name] = counts.get(name, 0) + n
    return counts, sum(layer.is_linear for layer in layers), sum(not layer.is_linear for layer in layers)


def _built_step(model, y, cache):
    """One step built op by op (no traces), its launches recorded, its graph counted before evaluation (the GPU's
    kinds), and the calls of MLX's fused ops it made."""
    with switches.overrides(disable=["compiled_decode"]), record_launches() as launches, fast_op_calls() as fast:
        nxt = _step(model, y, cache)
    kinds = count_step(nxt)
    mx.eval(nxt)
    return nxt, launches.counts(), kinds, fast


def test_a_decode_step_runs_the_kernels_and_builds_little_else(decoding):
    model, y, cache = decoding
    expected, n_deltanet, n_attention = _expected_launches(model)
    _, launches, kinds, fast = _built_step(model, y, cache)
    assert launches == expected
    assert kinds.get("CustomKernel") == sum(expected.values())
    assert fast == {"RMSNorm": n_deltanet + n_attention + 1, "Quantize": 1}, fast  # input norms, final norm; embedding
    non_view = sum(n for k, n in kinds.items() if k not in VIEW_PRIMITIVES)
    assert non_view == (PRIMITIVES_DELTANET_LAYER * n_deltanet + PRIMITIVES_ATTENTION_LAYER * n_attention
                        + PRIMITIVES_OUTSIDE_LAYERS), kinds
    # DeltaNet: fused in-projection and out_proj; attention: fused q/k/v and o_proj; the lm_head.
    assert kinds.get("QuantizedMatmul") == 2 * n_deltanet + 2 * n_attention + 1
    assert kinds.get("ScatterAxis") == 2 * n_attention  # the step's K and V rows into the cache's buffer
    assert not [k for k in STOCK_ONLY if k in kinds], kinds


def test_the_traced_step_holds_the_built_steps_launches(decoding):
    model, y, cache = decoding
    y, _, built, fast = _built_step(model, y, cache)
    traced = count_step(_step(model, y, cache))  # through the layers' traces (replayed)
    for kind in ("CustomKernel", "RMSNorm", "QuantizedMatmul", "ScatterAxis"):
        assert traced.get(kind) == built.get(kind), kind
    non_view = lambda counts: sum(n for k, n in counts.items() if k not in VIEW_PRIMITIVES)  # noqa: E731
    assert non_view(traced) <= non_view(built)  # a trace fuses elementwise chains, never adds


def test_a_replayed_step_runs_little_python(decoding):
    model, y, cache = decoding
    profile = cProfile.Profile()
    profile.enable()
    nxt = _step(model, y, cache)
    profile.disable()
    mx.eval(nxt)
    calls = pstats.Stats(profile).total_calls
    assert calls <= PYTHON_CALLS_PER_STEP, (
        f"a replayed decode step of {LAYERS} layers made {calls} Python calls (bound {PYTHON_CALLS_PER_STEP}): "
        "something now runs per call that could be resolved once")


def _without_attention_kernels(counts):
    return {k: n for k, n in counts.items() if not k.startswith("attention_decode")}


def test_a_quantized_kv_cache_keeps_every_other_kernel(decoding):
    """``--kv-bits``: MLX-LM swaps an attention layer's cache for a ``QuantizedKVCache``: that layer writes the step's
    quantised row into the buffers and attends with the quantized kernels' live-length form in place of the plain
    cache's (``kv_write_in_trace``), and every other launch of the step stays, traced or built."""
    from mlx_lm.generate import maybe_quantize_kv_cache

    model, y, cache = decoding
    expected, _, _ = _expected_launches(model)
    n_attention = sum(not layer.is_linear for layer in model.language_model.model.layers)
    expected = {**_without_attention_kernels(expected), "attention_decode_block_partials_live_quantized": n_attention,
                "attention_decode_merge_live_blocks": n_attention}
    maybe_quantize_kv_cache(cache, 0, 64, 4)
    assert any(type(c).__name__ == "QuantizedKVCache" for c in cache)
    for _ in range(3):  # traced and replayed with the new cache type
        y = _step(model, y, cache)
        mx.eval(y)
    _, launches, kinds, fast = _built_step(model, y, cache)
    assert launches == expected
    n_attention = sum(not layer.is_linear for layer in model.language_model.model.layers)
    assert "SliceUpdate" not in kinds and kinds.get("ScatterAxis") == 6 * n_attention  # a row into 3 parts a side
    traced = count_step(_step(model, y, cache))
    assert traced.get("CustomKernel") == kinds.get("CustomKernel")


def test_batched_generation_runs_one_launch_per_kernel_for_all_rows():
    """MLX-LM's batched generation (the server's path: rows of different lengths, left-padded ``BatchKVCache``):
    each MoE and DeltaNet kernel takes every row in one launch, as a single row's step does; each attention layer
    attends over the batch's rows with the split over their own blocks (op ``attention_decode_batch``: two launches)
    after stock's cache update; the same traced or built."""
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import make_prompt_cache

    model = build_random_model(model_config("tiny", LAYERS), seed=0, log=None)
    counted = []

    class Counting:  # what the generator calls the model with, its step's graph counted first (every placeholder,
        def __call__(self, inputs, cache=None):  # MLX's fused ops with the launches, as "CustomKernel")
            out = model(inputs, cache=cache)
            counted.append(count_step(out))
            mx.eval(out)
            return out

    with _on_the_cuda_path(model):
        prompts = [list(range(5, 5 + n)) for n in (30, 12, 21)]
        batch = PromptProcessingBatch(Counting(), list(range(len(prompts))),
                                      [make_prompt_cache(model) for _ in prompts])
        batch.prompt([p[:-1] for p in prompts])
        generation = batch.generate([[p[-1]] for p in prompts])
        for _ in range(3):
            generation.next()
        traced = counted[-1]
        with switches.overrides(disable=["compiled_decode"]), record_launches() as launches:
            generation.next()
        built = counted[-1]
    expected, _, _ = _expected_launches(model)
    n_attention = sum(not layer.is_linear for layer in model.language_model.model.layers)
    assert launches.counts() == {**_without_attention_kernels(expected),
                                 "attention_decode_block_partials_rows": n_attention,
                                 "attention_decode_merge_row_blocks": n_attention}
    assert "Softmax" not in built and "ScatterAxis" not in built  # lily's attention; stock's cache update
    for kind in ("CustomKernel", "QuantizedMatmul", "Softmax"):
        assert traced.get(kind) == built.get(kind), kind


def test_constant_weights_on_the_cuda_path():
    """``constant_weights`` on at patch time, on the CUDA path: every decoder layer's traces hold its weights as
    constants, the traced step holds the built step's launches and primitives, and decoding moves no weights epoch
    (nothing is set into a module, so nothing is traced again)."""
    from lily_mlx.core import generation

    model = build_random_model(model_config("tiny", LAYERS), seed=0, log=None)
    with switches.overrides(enable=["constant_weights"]), _on_the_cuda_path(model):
        y, cache = _prefill(model, 40, VOCAB, 0)
        for _ in range(3):
            y = _step(model, y, cache)
            mx.eval(y)
        epoch = generation.weights_epoch()
        y, _, built, fast = _built_step(model, y, cache)
        traced = count_step(_step(model, y, cache))
        for _ in range(3):
            y = _step(model, y, cache)
            mx.eval(y)
        assert generation.weights_epoch() == epoch
        layers = model.language_model.model.layers
        assert all(layer.__dict__.get("_lily_constant_weights") == (epoch, True) for layer in layers)
    non_view = lambda counts: sum(n for k, n in counts.items() if k not in VIEW_PRIMITIVES)  # noqa: E731
    for kind in ("CustomKernel", "RMSNorm", "QuantizedMatmul", "ScatterAxis"):
        assert traced.get(kind) == built.get(kind), kind
    assert non_view(traced) <= non_view(built)


# Python calls of a decode step replayed from the whole step's trace (switch step_trace) at LAYERS layers: the cache
# states gathered and set back, one trace call; measured 2026-12-04: 61 (the harness's step and MLX-LM's outer model
# call included), against 230 a step of layer replays. A bound, not a target.
PYTHON_CALLS_PER_TRACED_STEP = 80


def test_step_trace_on_the_cuda_path():
    """``step_trace`` on at patch time, on the CUDA path: a decode step replays one trace of the whole model, which
    holds the built step's launches and primitives, in a few dozen Python calls (no decoder layer runs)."""
    model = build_random_model(model_config("tiny", LAYERS), seed=0, log=None)
    with switches.overrides(enable=["step_trace"]), _on_the_cuda_path(model):
        y, cache = _prefill(model, 40, VOCAB, 0)
        for _ in range(3):  # built (the layers' replays made), traced whole, replayed whole
            y = _step(model, y, cache)
            mx.eval(y)
        y, launches, built, fast = _built_step(model, y, cache)
        for _ in range(2):  # (the built step moved the switch generation: made again, then replayed)
            y = _step(model, y, cache)
            mx.eval(y)
        profile = cProfile.Profile()
        profile.enable()
        nxt = _step(model, y, cache)
        profile.disable()
        traced = count_step(nxt)
        made = model.language_model.__dict__["_lily_step_traces"]
        assert [v[1] is not None for v in made.values()] == [True]
    calls = pstats.Stats(profile).total_calls
    assert calls <= PYTHON_CALLS_PER_TRACED_STEP, calls
    non_view = lambda counts: sum(n for k, n in counts.items() if k not in VIEW_PRIMITIVES)  # noqa: E731
    for kind in ("CustomKernel", "RMSNorm", "QuantizedMatmul", "ScatterAxis", "Gather", "ArgReduce"):
        assert traced.get(kind) == built.get(kind), kind
    assert non_view(traced) <= non_view(built)


def test_a_decode_at_a_new_capacity_compiles_no_new_kernel():
    """The launches (kernel and template arguments) of decode steps at contexts whose KV buffers differ in size are
    the same set: a cache growing into a new capacity compiles nothing (once the merge's simdgroups followed the
    block count, and each new capacity's first step compiled a merge, ~2.5 s of NVRTC on the H100)."""
    model = build_random_model(model_config("tiny", LAYERS), seed=0, log=None)
    kernels_at = {}
    with _on_the_cuda_path(model):
        for context in (40, 600, 2100):
            y, cache = _prefill(model, context, VOCAB, 0)
            with switches.overrides(disable=["compiled_decode"]), record_launches() as launches:
                mx.eval(_step(model, y, cache))
            kernels_at[context] = {(launch.name, tuple(sorted(launch.template.items()))) for launch in launches}
    assert kernels_at[40] == kernels_at[600] == kernels_at[2100], kernels_at


def test_a_quantized_step_follows_its_op_switched_in_the_process(monkeypatch):
    """The quantized op put on its reference between two steps (as a tune profile or LILY_REFERENCE_OPS can): the next
    traced step attends with stock's masked attention, not a trace kept from the kernel's form."""
    from lily_mlx.core import dispatch
    from mlx_lm.models.cache import KVCache

    model = build_random_model(model_config("tiny", LAYERS), seed=0, log=None)
    n_attention = sum(not layer.is_linear for layer in model.language_model.model.layers)
    with _on_the_cuda_path(model):
        y, cache = _prefill(model, 40, VOCAB, 0)
        for i, c in enumerate(cache):
            if type(c) is KVCache:
                cache[i] = c.to_quantized(group_size=64, bits=4)
        kinds = []
        for reference in (False, True):
            if reference:
                monkeypatch.setenv("LILY_REFERENCE_OPS", "attention_decode_quantized")
                dispatch.invalidate()
            for _ in range(3):
                y = _step(model, y, cache)
                mx.eval(y)
            kinds.append(count_step(_step(model, y, cache)))
    assert kinds[1].get("CustomKernel") == kinds[0].get("CustomKernel") - 2 * n_attention, kinds


@pytest.mark.parametrize("form", ["in-buffer", "update-and-fetch", "in-buffer-reference"])
def test_decode_over_a_quantized_kv_cache_on_the_cuda_path(monkeypatch, form):
    """``--kv-bits`` on lily's CUDA path (the quantized-cache attention kernel is on there by default), over the
    quantized caches MLX-LM makes after the prompt, a few steps in (built, traced, replayed): with
    ``kv_write_in_trace`` each attention layer quantises its row and writes it into the buffers (2 Quantize, 6
    scatters of one row, no slice update of MLX-LM's) and launches the live-length partials; without it MLX-LM's
    update and the fixed-block split (on a GPU at every context); with the op on its reference (as on Metal until its
    kernel is timed there) the same writes and stock's quantized attention over the masked buffers, no launch. A
    traced step holds the launches of a step built op by op; the caches' offsets move on by one a step."""
    from mlx_lm.models.cache import KVCache

    write_in_trace = form != "update-and-fetch"
    if form == "in-buffer-reference":
        monkeypatch.setenv("LILY_REFERENCE_OPS", "attention_decode_quantized")
    model = build_random_model(model_config("tiny", LAYERS), seed=0, log=None)
    partials = ("attention_decode_block_partials_live_quantized" if write_in_trace
                else "attention_decode_block_partials_quantized")
    merge = "attention_decode_merge_live_blocks" if write_in_trace else "attention_decode_merge_blocks"
    with _on_the_cuda_path(model), switches.overrides(disable=[] if write_in_trace else ["kv_write_in_trace"]):
        y, cache = _prefill(model, 40, VOCAB, 0)
        for i, c in enumerate(cache):
            if type(c) is KVCache:
                cache[i] = c.to_quantized(group_size=64, bits=4)
        n_attention = sum(not layer.is_linear for layer in model.language_model.model.layers)
        start = [c.offset for c in cache if hasattr(c, "offset")]
        for _ in range(3):  # built, traced, replayed
            y = _step(model, y, cache)
            mx.eval(y)
        assert [c.offset for c in cache if hasattr(c, "offset")] == [n + 3 for n in start]
        y, launches, built, fast = _built_step(model, y, cache)
        traced = count_step(_step(model, y, cache))
    if form == "in-buffer-reference":
        assert not any(name.startswith("attention_decode") for name in launches), launches
    else:
        assert launches.get(partials) == n_attention and launches.get(merge) == n_attention, launches
    assert "attention_decode_quantized" not in launches
    assert traced.get("CustomKernel") == built.get("CustomKernel")
    if write_in_trace:
        quantize = traced.get("Quantize", 0) - fast.get("Quantize", 0)  # (the embedding's dequantisation counts too)
        assert quantize == 2 * n_attention and traced.get("ScatterAxis") == 6 * n_attention, traced
        assert "SliceUpdate" not in traced


def test_the_decode_graph_tool_counts_a_servers_batch(capsys):
    """``python -m bench.decode_graph --batch-contexts``: a server's batch step counted on the CUDA path (rows prefilled
    alone and merged into MLX-LM's batch caches): its attention through the batch op's two kernels, and the table,
    the count and the build time printed; a batch over quantized caches is refused (MLX-LM has none)."""
    from bench import decode_graph

    assert decode_graph.main(["--layers", "4", "--steps", "2", "--batch-contexts", "12,5"]) == 0
    out = capsys.readouterr().out
    assert "a batch of 2 rows at contexts 12, 5" in out
    assert "| attention_decode_block_partials_rows | 1 |" in out and "| attention_decode_merge_row_blocks | 1 |" in out
    assert "| non-view, in all |" in out and "graph build on this host:" in out
    with pytest.raises(SystemExit):
        decode_graph.main(["--batch-contexts", "12,5", "--kv-bits", "4"])


@pytest.mark.parametrize("input_norm, folds", [(True, True), (True, False), (False, True), (False, False)])
def test_the_dense_gemv_takes_each_layers_input_norm_and_projections(monkeypatch, input_norm, folds):
    """With the trial row GEMV (``LILY_TRIAL_OPS=linear_gemv``) every dense projection of a decode step is one of
    lily's launches. With switch ``gemv_input_norm`` each layer's input RMSNorm is computed inside the GEMV of the
    projection after it (``linear_gemv_q4_rms_norm``): the norms leave the step's graph (the final norm stays: stock's
    model code applies it), one primitive fewer a layer. With ``fused_in_proj_step`` and ``fused_qkv_prep`` (``folds``)
    a DeltaNet layer's in-projection is computed inside its step's kernel (``deltanet_decode_from_hidden``) and an
    attention layer's q/k/v projection inside its q/k preparation (``attention_qk_prep_from_hidden``), the input norm
    too where the GEMV would take it: one launch and one primitive fewer a layer. Built and traced alike; with
    ``fused_output_gate`` as well, the <= 250 of issue 12 at Qwen3.6's 40 layers (247)."""
    monkeypatch.setenv("LILY_TRIAL_OPS", "linear_gemv")
    model = build_random_model(model_config("tiny", LAYERS), seed=0, log=None)
    named = {"gemv_input_norm": input_norm, "fused_in_proj_step": folds, "fused_qkv_prep": folds}
    with switches.overrides(disable=[n for n, on in named.items() if not on],
                            enable=[n for n, on in named.items() if on]), _on_the_cuda_path(model):
        y, cache = _prefill(model, 40, VOCAB, 0)
        for _ in range(3):
            y = _step(model, y, cache)
            mx.eval(y)
        expected, n_deltanet, n_attention = _expected_launches(model)
        y, launches, built, _ = _built_step(model, y, cache)
        traced = count_step(_step(model, y, cache))
    layers = n_deltanet + n_attention
    normed = layers if input_norm else 0
    folded = layers if folds else 0
    assert launches.get("deltanet_decode_from_hidden", 0) == (n_deltanet if folds else 0), launches
    assert launches.get("deltanet_decode_conv_fused", 0) == (0 if folds else n_deltanet), launches
    assert launches.get("attention_qk_prep_from_hidden", 0) == (n_attention if folds else 0), launches
    assert launches.get("attention_qk_prep", 0) == (0 if folds else n_attention), launches
    # the in-projections a GEMV launch of their own takes, the norm inside: every layer's unless folded
    assert launches.get("linear_gemv_q4_rms_norm", 0) == (layers - folded if input_norm else 0), launches
    # in- and out-projections, lm_head
    assert launches.get("linear_gemv_q4") == 2 * layers + 1 - folded - (layers - folded if input_norm else 0), launches
    for counts in (built, traced):
        assert counts.get("RMSNorm") == layers + 1 - normed, counts
        assert "QuantizedMatmul" not in counts, counts
    non_view = sum(n for k, n in built.items() if k not in VIEW_PRIMITIVES)
    assert non_view == (PRIMITIVES_DELTANET_LAYER * n_deltanet + PRIMITIVES_ATTENTION_LAYER * n_attention
                        + PRIMITIVES_OUTSIDE_LAYERS - normed - folded), built


def test_the_input_norm_goes_inside_with_constant_weights(monkeypatch):
    """With ``constant_weights`` on at patch time a layer's input norm is a watch-only lily class over ``nn.RMSNorm``: it
    is still taken inside the trial GEMV's kernels (the norms leave the step, as without the switch)."""
    monkeypatch.setenv("LILY_TRIAL_OPS", "linear_gemv")
    model = build_random_model(model_config("tiny", LAYERS), seed=0, log=None)
    with switches.overrides(enable=["constant_weights", "gemv_input_norm", "fused_in_proj_step", "fused_qkv_prep"]), \
            _on_the_cuda_path(model):
        assert type(model.language_model.model.layers[0].input_layernorm).__name__ != "RMSNorm"
        y, cache = _prefill(model, 40, VOCAB, 0)
        for _ in range(3):
            y = _step(model, y, cache)
            mx.eval(y)
        y, launches, built, _ = _built_step(model, y, cache)
    assert built.get("RMSNorm") == 1, built  # the final norm alone
    assert launches.get("deltanet_decode_from_hidden") and launches.get("attention_qk_prep_from_hidden"), launches
