"""Batch invariance with the kernels on (simulator): a row's results are bitwise independent of the
other rows of its batch, for prefill and decode, in every switch state.

MLX-LM's batched generator (``PromptProcessingBatch`` / ``GenerationBatch``: what ``mlx_lm.server``
and ``batch_generate`` run) pads the prompt chunks of a batch to the longest one and gives each row
its next segment chunk, so one row's chunk of T tokens (alone) is T_max tokens in a batch, and a
chunk of a single token alone (a 2-token prompt; Qwen3.6's 1-token thinking tail segment) is
indistinguishable from a decode step; decode steps share one [B, 1] call. The property the kernels
keep is therefore per token: a token's result depends neither on how many rows or tokens share the
call nor on the tile sizes / paths the other tokens make the kernels pick.

The tests compare bitwise (``mx.array_equal``): op level (MoE block, DeltaNet layer, decode
attention) over decode-sized and prefill-sized calls, then the embedded model through MLX-LM's own
batch classes with B = 1, 2 and 5 and mixed prompt lengths (prefill logits of every valid position
and a few decode steps). Stock MLX-LM on the CPU is itself batch invariant on the same model (the
reference backend is stock's computation), so any difference is lily's.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest

from lily_mlx.core import switches
from lily_mlx.ops.deltanet import layer as deltanet
from lily_mlx.ops.moe import kernels as mk
from lily_dev.moe_testing import make_inputs, make_sparse_moe_block, simulator_problem
from tests.ops.deltanet_cases import make_cache, make_module, random_inputs, ssm_mask

SIM_PROBLEM = simulator_problem(need_matrix=True)
pytestmark = pytest.mark.skipif(SIM_PROBLEM is not None, reason=f"simulator unavailable: {SIM_PROBLEM}")

# Switches whose kernels run in a batched call on the simulator (the MoE and DeltaNet ones; the decode-attention
# switches, coalesced_kv, gqa_packing and fixed_block_attention, choose among the attention kernels of a plain cache
# and of MLX-LM's batch cache: the attention tests below cover them directly). The remaining switches have no kernel
# yet.
MOE_SWITCHES = ("fused_dequant", "gpu_routing", "adaptive_tile", "fused_combine")
DELTANET_SWITCHES = ("register_scan", "staged_scan", "fused_recurrent_norm", "fused_conv_step")
STATES = [()] + [(name,) for name in MOE_SWITCHES + DELTANET_SWITCHES]
STATE_IDS = ["all-on"] + [f"{name}-off" for name in MOE_SWITCHES + DELTANET_SWITCHES]


@pytest.fixture
def sim(monkeypatch):
    """The simulator, with stock's ops on MLX's CPU backend too: MLX's own quantized matmuls (the
    router, the shared expert, the projections) are not batch invariant on MLX CUDA (measured on an
    H200: bench/batch_invariance.py), and these tests are about lily's kernels."""
    monkeypatch.setenv("LILY_BACKEND", "sim")
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a, b).item())


def _max_diff(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())


# ----------------------------------------------------------------------------------------------
# MoE block


def _tile_rows(inds: mx.array, num_experts: int, adaptive: bool) -> set:
    counts = np.bincount(np.array(inds).reshape(-1), minlength=num_experts)
    return {int(t) for t in mk.host_block_map(counts, adaptive)[:, 3]}


@pytest.mark.parametrize("off,on", [((), ())] + [((n,), ()) for n in MOE_SWITCHES] + [((), ("split_k_gate_up",))],
                         ids=["all-on"] + [f"{n}-off" for n in MOE_SWITCHES] + ["split_k_gate_up-on"])
def test_moe_token_result_independent_of_the_call(sim, off, on):
    """One token's MoE output, alone ([1, 1, D]: decode size, 4 assignments) equals the same token's
    output in a decode batch of 16 rows (64 assignments), in a prefill chunk, and in a padded batch
    of 3 x 48 tokens whose skewed routing gives loaded experts 32-row GEMM tiles."""
    from lily_mlx.ops.moe import sparse_moe_forward

    block = make_sparse_moe_block(num_experts=16, top_k=4, seed=3, skew=3.0)
    block.eval()
    x = make_inputs(3, 48, 128, seed=7, mean=0.3)
    with switches.overrides(disable=off, enable=on):
        alone = [sparse_moe_forward(block, x[0:1, t:t + 1]) for t in range(16)]
        mx.eval(alone)
        decode_batch = sparse_moe_forward(block, x[0, :16, None])  # [16, 1, D]
        chunk = sparse_moe_forward(block, x[0:1, :16])  # [1, 16, D]
        batch = sparse_moe_forward(block, x)  # [3, 48, D]
        mx.eval(decode_batch, chunk, batch)
    inds = mx.argpartition(block.gate(x), kth=-4, axis=-1)[..., -4:]
    if "adaptive_tile" not in off:  # the big call mixes 16- and 32-row tiles; a lone token has 16
        assert _tile_rows(inds, 16, True) == {16, 32}
        assert _tile_rows(inds[0, :1], 16, True) == {16}
    for t in range(16):
        for name, got in (("decode batch of 16", decode_batch[t:t + 1]), ("prefill chunk", chunk[:, t:t + 1]),
                          ("3 x 48 batch", batch[0:1, t:t + 1])):
            assert _equal(got, alone[t]), (
                f"token {t}: {name} differs from the token alone by {_max_diff(got, alone[t])}")


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet layer


def _deltanet_turns(module, h_prefill, lengths, decode_inputs):
    """Prefill (right-padded to ``lengths`` when given, as the batched generator does) then decode
    steps through one cache; returns (outputs per turn, conv state, recurrent state)."""
    B = h_prefill.shape[0]
    cache = make_cache(B, left_padding=[0] * B, lengths=lengths)
    outs = [deltanet.qwen3_5_deltanet_forward(module, h_prefill, mask=ssm_mask(h_prefill, cache), cache=cache)]
    cache.finalize()
    for h in decode_inputs:
        outs.append(deltanet.qwen3_5_deltanet_forward(module, h, mask=ssm_mask(h, cache), cache=cache))
    mx.eval(outs, cache.cache)
    return outs, cache[0], cache[1]


@pytest.mark.parametrize("off", [()] + [(n,) for n in DELTANET_SWITCHES],
                         ids=["all-on"] + [f"{n}-off" for n in DELTANET_SWITCHES])
def test_deltanet_row_result_independent_of_the_batch(sim, off):
    """Rows of lengths 1, 5 and 7 (embedded-model head shape): each row alone (its own chunk of
    1, 5 or 7 tokens; a 1-token chunk takes the decode kernels) equals the same row inside a
    right-padded batch of 7-token chunks, outputs and both states, then through two decode steps."""
    module = make_module("qwen3_5", 2, 4, 64, 64, dtype=mx.bfloat16, seed=11)
    lengths = [1, 5, 7]
    h = random_inputs(3, 7, 32, mx.bfloat16, seed=5)
    steps = [random_inputs(3, 1, 32, mx.bfloat16, seed=6 + i) for i in range(2)]
    with switches.overrides(disable=off), mock.patch.object(
            deltanet, "log_once", side_effect=lambda *a, **k: pytest.fail(f"a DeltaNet op fell back: {a}")):
        batch = _deltanet_turns(module, h, lengths, steps)
        for r, n in enumerate(lengths):
            alone = _deltanet_turns(module, h[r:r + 1, :n], None, [s[r:r + 1] for s in steps])
            got = [batch[0][0][r:r + 1, :n]] + [o[r:r + 1] for o in batch[0][1:]]
            for turn, (g, a) in enumerate(zip(got, alone[0])):
                assert _equal(g, a), f"row {r} (length {n}), turn {turn}: differs by {_max_diff(g, a)}"
            assert _equal(batch[1][r:r + 1], alone[1]), f"row {r}: conv state differs"
            assert _equal(batch[2][r:r + 1], alone[2]), f"row {r}: recurrent state differs"


def test_deltanet_chunking_does_not_change_a_token(sim):
    """The prompt in one chunk or in chunks of 3 + 1 + 3 tokens (prefill step sizes, prompt-cache
    segments): same outputs and states, bit for bit (a 1-token chunk runs the decode kernels)."""
    module = make_module("qwen3_5", 2, 4, 64, 64, dtype=mx.bfloat16, seed=12)
    h = random_inputs(1, 7, 32, mx.bfloat16, seed=9)
    whole = _deltanet_turns(module, h, None, [])
    cache = make_cache(1)
    parts = [deltanet.qwen3_5_deltanet_forward(module, h[:, a:b], mask=None, cache=cache)
             for a, b in ((0, 3), (3, 4), (4, 7))]
    mx.eval(parts, cache.cache)
    assert _equal(mx.concatenate(parts, axis=1), whole[0][0]), _max_diff(mx.concatenate(parts, axis=1), whole[0][0])
    assert _equal(cache[0], whole[1]) and _equal(cache[1], whole[2])


# ----------------------------------------------------------------------------------------------
# Decode attention kernel


@pytest.mark.parametrize("off", [(), ("coalesced_kv",), ("gqa_packing",)], ids=["all-on", "coalesced_kv-off", "gqa_packing-off"])
def test_decode_attention_kernel_rows_independent(sim, off):
    """The decode-attention kernel runs for a plain KVCache without a mask (B rows of one length);
    each row's output equals the row run alone. (MLX-LM's batch caches always pass a mask, so a
    batched row never takes the kernel, alone or not: the choice cannot depend on the other rows.)"""
    from mlx_lm.models.cache import KVCache

    from lily_mlx.ops.attention import layer as att

    rng = np.random.default_rng(3)
    B, Hkv, G, D, S = 3, 2, 4, 64, 12
    q = mx.array(rng.standard_normal((B, Hkv * G, 1, D)).astype(np.float32)).astype(mx.bfloat16)
    k = mx.array(rng.standard_normal((B, Hkv, S, D)).astype(np.float32)).astype(mx.bfloat16)
    v = mx.array(rng.standard_normal((B, Hkv, S, D)).astype(np.float32)).astype(mx.bfloat16)

    def run(rows):
        cache = KVCache()
        keys, values = cache.update_and_fetch(k[rows], v[rows])
        return att.attention(q[rows], keys, values, scale=D ** -0.5, mask=None, cache=cache)

    with switches.overrides(disable=off), mock.patch.object(att, "log_once",
                                                            side_effect=lambda *a, **k: pytest.fail(f"fell back: {a}")):
        batch = run(slice(0, B))
        for r in range(B):
            assert _equal(batch[r:r + 1], run(slice(r, r + 1))), f"row {r}"


@pytest.mark.parametrize("off", [(), ("coalesced_kv",), ("gqa_packing",), ("fixed_block_attention",)],
                         ids=["all-on", "coalesced_kv-off", "gqa_packing-off", "fixed_block_attention-off"])
def test_batch_cache_attention_rows_independent(sim, off):
    """MLX-LM's batch cache (``BatchKVCache``, the server's batches) with the mask it makes for a decode step: the
    split over each row's own blocks (op ``attention_decode_batch``), or with ``fixed_block_attention`` off the one-pass
    kernel from each row's padding, gives each row the bits of the same row in a batch of its own (no padding), however
    long the other rows are."""
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import BatchKVCache

    from lily_mlx.ops.attention import layer as att

    rng = np.random.default_rng(4)
    Hkv, G, D = 2, 4, 64
    lengths = [12, 140, 3]  # keys a row holds after this step's

    def rand(shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    rows = [(rand((1, Hkv * G, 1, D)), rand((1, Hkv, n, D)), rand((1, Hkv, n, D))) for n in lengths]

    def run(which):
        S = max(lengths[i] for i in which)
        pads = [S - lengths[i] for i in which]
        pad = lambda x, p: mx.concatenate([mx.zeros((1, Hkv, p, D), x.dtype), x], axis=2)  # noqa: E731
        cache = BatchKVCache(pads)
        cache.update_and_fetch(mx.concatenate([pad(rows[i][1][:, :, :-1], p) for i, p in zip(which, pads)]),
                               mx.concatenate([pad(rows[i][2][:, :, :-1], p) for i, p in zip(which, pads)]))
        mask = create_attention_mask(mx.zeros((len(which), 1, 8)), cache)
        keys, values = cache.update_and_fetch(mx.concatenate([rows[i][1][:, :, -1:] for i in which]),
                                              mx.concatenate([rows[i][2][:, :, -1:] for i in which]))
        q = mx.concatenate([rows[i][0] for i in which])
        return att.attention(q, keys, values, scale=D ** -0.5, mask=mask, cache=cache)

    with switches.overrides(disable=off), mock.patch.object(att, "log_once",
                                                            side_effect=lambda *a, **k: pytest.fail(f"fell back: {a}")):
        batch = run([0, 1, 2])
        for r in range(len(lengths)):
            assert _equal(batch[r:r + 1], run([r])), f"row {r}"


# ----------------------------------------------------------------------------------------------
# The embedded model through MLX-LM's batched generator

# Row 0: a 2-token prompt (its 1-token prefill chunk is padded to the batch's longest chunk);
# row 1: short (alone, fewer than 64 expert assignments per chunk); rows 2-4 longer ones.
PROMPTS = [
    "def f",
    "Return a copy.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:",
    "Return a new dictionary with the keys of the mapping",
    "x = [i * i for i in range(10)]",
]
BATCHES = [[2, 0], [3, 1, 0, 4, 2]]  # B = 2 and B = 5 (orders mixed)
DECODE_STEPS = 2
CHECKED_ROWS = (0, 1, 2)  # compared with their B = 1 runs (each alone run costs time)


@pytest.fixture(scope="module")
def embedded_model():
    import mlx_lm

    from lily_mlx import patch as lily_patch
    from lily_mlx.models import embedded

    folder = Path(embedded.EMBEDDED_DIR)
    assert embedded._is_complete(folder), f"the embedded model is part of the tree: {folder}"
    model, tokenizer = mlx_lm.load(str(folder))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert len(prompts[0]) == 2 and 1 < len(prompts[1]) < 16 and max(map(len, prompts)) >= 30, [len(p) for p in prompts]
    lily_patch.patch(model)
    yield model, prompts
    lily_patch.unpatch(model)


def _batched_generation(model, prompts):
    """MLX-LM's own batch classes, as ``BatchGenerator`` drives them: the prompts less their last
    token in one (padded) prefill call, then greedy decode steps starting from each last token.
    Returns per row the logits of its valid prefill positions and of each decode step (fp32)."""
    from mlx_lm.generate import PromptProcessingBatch
    from mlx_lm.models.cache import make_prompt_cache

    calls = []

    class Recording:
        def __call__(self, inputs, cache=None):
            out = model(inputs, cache=cache)
            mx.eval(out)
            calls.append(out)
            return out

    B = len(prompts)
    batch = PromptProcessingBatch(Recording(), list(range(B)), [make_prompt_cache(model) for _ in prompts])
    batch.prompt([p[:-1] for p in prompts])
    generation = batch.generate([[p[-1]] for p in prompts])  # runs the first decode step
    for _ in range(DECODE_STEPS - 1):
        generation.next()
    prefill, steps = calls[0], calls[1:]
    assert len(steps) == DECODE_STEPS and prefill.shape[1] == max(len(p) - 1 for p in prompts)
    return [[prefill[r, :len(p) - 1]] + [s[r, -1:] for s in steps] for r, p in enumerate(prompts)]


@pytest.mark.slow
@pytest.mark.parametrize("off,on",
                         [(off, ()) for off in STATES] + [((), ("fused_next_norm",)), ((), ("split_k_gate_up",))],
                         ids=STATE_IDS + ["fused_next_norm-on", "split_k_gate_up-on"])
def test_embedded_model_rows_batch_invariant(sim, embedded_model, monkeypatch, off, on):
    """Rows 0-2 of PROMPTS (2, short and long prompts) in a B = 2 and a B = 5 batch of mixed prompts
    get the logits they get alone (B = 1), bit for bit, at every prefill position and every decode
    step; the MoE kernels run in every call."""
    model, prompts = embedded_model
    kernel_ran = []
    real = mk.sparse_moe_kernels

    def counted(*args, **kwargs):
        y = real(*args, **kwargs)
        kernel_ran.append(y is not None)
        return y

    monkeypatch.setattr(mk, "sparse_moe_kernels", counted)
    with switches.overrides(disable=off, enable=on):
        alone = {r: _batched_generation(model, [prompts[r]])[0] for r in CHECKED_ROWS}
        for order in BATCHES:
            got = _batched_generation(model, [prompts[r] for r in order])
            for i, r in enumerate(order):
                if r not in alone:
                    continue
                for step, (g, a) in enumerate(zip(got[i], alone[r])):
                    where = "prefill" if step == 0 else f"decode step {step}"
                    assert _equal(g, a), (f"B={len(order)}, prompt {r} ({len(prompts[r])} tokens), {where}: "
                                          f"logits differ from B=1 by up to {_max_diff(g, a)}")
    assert kernel_ran and all(kernel_ran), "the MoE kernels did not run in every call"


def test_embedded_model_rows_batch_invariant_on_the_reference_backend(embedded_model, monkeypatch):
    """The same check on the reference backend (stock's computation): stock MLX-LM on the CPU is
    batch invariant here, so a difference in the test above is lily's, not the harness's."""
    monkeypatch.setenv("LILY_BACKEND", "reference")
    model, prompts = embedded_model
    alone = {r: _batched_generation(model, [prompts[r]])[0] for r in CHECKED_ROWS}
    order = BATCHES[-1]
    got = _batched_generation(model, [prompts[r] for r in order])
    for i, r in enumerate(order):
        if r in alone:
            for g, a in zip(got[i], alone[r]):
                assert _equal(g, a), f"stock: prompt {r} differs by {_max_diff(g, a)}"
