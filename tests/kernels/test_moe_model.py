"""The patched embedded model with the MoE prefill kernels on the simulator gives stock's greedy tokens.

Only the MoE ops are sent to the simulator (the other op families keep their reference path), so a
difference can only come from the MoE kernels. Prefill chunks (> 64 expert assignments) run the
routing and grouped-GEMM kernels; single-token decode steps run the same GEMMs with one block per
assignment (batch invariance: docs/moe.md).
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from lily_mlx.core import switches
from lily_mlx.ops.moe import kernels as moe_kernels
from lily_mlx.ops.moe import layer as moe
from tests.kernels.model_checks import decided_positions, teacher_forced_logits

# Long enough that the prefill chunk has >= 64 expert assignments (MLX-LM prefills all but the last
# prompt token before the first decode step).
PROMPT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n"
          "        return n\n    return")  # 47 tokens; stock's top-2 margin is clear at 14 of the 24 steps
MAX_TOKENS = 24


def _embedded_model_dir():
    from lily_mlx.models import embedded

    folder = Path(embedded.EMBEDDED_DIR)
    assert embedded._is_complete(folder), f"the embedded model is part of the tree: {folder}"
    return folder


@pytest.fixture(scope="module")
def embedded():
    import mlx_lm

    import lily_mlx.patch as lily_patch

    model, tokenizer = mlx_lm.load(str(_embedded_model_dir()))
    return model, tokenizer, lily_patch


def _greedy(model, prompt_ids, max_tokens=MAX_TOKENS):
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens, sampler=lambda l: mx.argmax(l, -1)):
        out.append(int(token))
    return out


@pytest.fixture
def moe_on_sim(monkeypatch):
    from lily_dev.moe_testing import simulator_problem

    problem = simulator_problem(need_matrix=True)
    if problem:
        pytest.skip(problem)
    monkeypatch.setenv("LILY_BACKEND", "reference")
    def on_sim(name, backend=None):
        return "sim" if name in ("moe_routing", "moe_grouped_gemm") else "reference"

    monkeypatch.setattr(moe, "op_backend", on_sim)
    monkeypatch.setattr(moe_kernels, "op_backend", on_sim)


@pytest.mark.slow
@pytest.mark.parametrize("disabled", [(), ("gpu_routing", "fused_dequant", "adaptive_tile", "fused_combine")],
                         ids=["all-on", "all-off"])
def test_embedded_model_greedy_tokens_match_stock(embedded, moe_on_sim, disabled):
    """Free-running greedy tokens equal stock's up to stock's first near-tie; teacher-forced along
    stock's tokens, lily picks stock's token wherever stock's top-2 margin is not a near-tie."""
    model, tokenizer, lily_patch = embedded
    prompt = tokenizer.encode(PROMPT)
    stock = _greedy(model, prompt)
    stock_logits = teacher_forced_logits(model, mx.array(prompt), stock)
    decided, first_tie = decided_positions(stock_logits)
    calls = []
    real = moe_kernels.sparse_moe_kernels

    def counted(*args, **kwargs):
        y = real(*args, **kwargs)
        calls.append(y is not None)
        return y

    lily_patch.patch(model)
    try:
        with switches.overrides(disable=disabled), pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe_kernels, "sparse_moe_kernels", counted)
            lily = _greedy(model, prompt)
            lily_choice = np.array(mx.argmax(teacher_forced_logits(model, mx.array(prompt), stock), axis=-1))
    finally:
        lily_patch.unpatch(model)
    assert calls and all(calls), "the MoE kernels did not run"
    assert decided.sum() >= len(stock) // 2, "the embedded model should be decided at most positions"
    assert lily[:first_tie] == stock[:first_tie], f"lily {lily} vs stock {stock} (first near-tie at {first_tie})"
    assert (lily_choice == np.array(stock))[decided].all(), (lily_choice, stock, decided)


@pytest.mark.slow
def test_embedded_model_teacher_forced_vs_fp32(embedded, moe_on_sim):
    """192 positions of held-out text in one prefill chunk (the kernels run on all of it), judged
    against the same model run in fp32 (an independent, more exact oracle): lily's logits must be no
    further from it than stock bf16's own, and its next-token agreement with it no worse than
    stock's minus a near-tie margin. (Measured at commit time, all switches on: RMS logit error vs
    fp32 0.05128 lily, 0.05125 stock; argmax agreement with fp32 96.4 % both; lily vs stock 96.9 %.
    The embedded model is small, so near-ties are common.)"""
    import mlx_lm

    from lily_mlx.models import embedded as emb

    model, tokenizer, lily_patch = embedded
    heldout = Path(emb.EMBEDDED_DIR) / emb.HELDOUT_FILE
    assert heldout.exists(), "the embedded model ships its held-out text"
    ids = mx.array(tokenizer.encode(heldout.read_text()[:4000])[:192])[None]
    model32, _ = mlx_lm.load(str(emb.EMBEDDED_DIR))
    model32.set_dtype(mx.float32)  # same 4-bit weights; scales, activations and the rest in fp32
    exact = model32(ids).astype(mx.float32)
    stock = model(ids).astype(mx.float32)
    lily_patch.patch(model)
    try:
        lily = model(ids).astype(mx.float32)
    finally:
        lily_patch.unpatch(model)

    def agree(a, b):
        return (mx.argmax(a, -1) == mx.argmax(b, -1)).astype(mx.float32).mean().item()

    def rms(a, b):
        return mx.sqrt(mx.mean((a - b) ** 2)).item()

    assert rms(lily, exact) <= 1.1 * rms(stock, exact), (rms(lily, exact), rms(stock, exact))
    assert agree(lily, exact) >= agree(stock, exact) - 0.04, (agree(lily, exact), agree(stock, exact))


def test_fused_residual_same_logits_and_the_combine_adds_it(embedded, moe_on_sim):
    """Switch fused_residual through the patched decoder layers: prefill and decode logits bit for bit
    with it on and off, and with it on every MoE layer's combine launch takes the layer's residual."""
    from mlx_lm.models.cache import make_prompt_cache

    from lily_mlx.core.kernel_registry import record_launches

    model, tokenizer, lily_patch = embedded
    prompt = mx.array(tokenizer.encode(PROMPT))[None]

    def run():
        cache = make_prompt_cache(model)
        out = [model(prompt, cache=cache)[:, -1]]
        for _ in range(2):
            out.append(model(mx.argmax(out[-1], axis=-1)[:, None], cache=cache)[:, -1])
        return mx.stack(out)

    lily_patch.patch(model)
    try:
        with record_launches() as rec:
            on = run()
            mx.eval(on)
        with switches.overrides(disable=("fused_residual",)):
            off = run()
    finally:
        lily_patch.unpatch(model)
    assert mx.array_equal(on, off).item()
    combines = [launch for launch in rec if launch.name == "moe_combine_weighted_rows"]
    assert len(combines) == 3 * len(model.layers)
    assert all(launch.kwargs["inputs"][4].size > 1 for launch in combines)  # the residual, not the placeholder
