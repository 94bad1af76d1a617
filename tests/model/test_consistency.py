"""The consistency tool: its metrics against hand-computed values, and lily vs stock on the embedded
model with the reference backend (must be exactly stock: 100 % agreement, zero logit difference)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lily_mlx import consistency


def test_metrics_from_logits_by_hand():
    stock = np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]])
    lily = stock.copy()
    lily[1] = [0.0, 1.0, 1.5]  # top-1 changes at position 1
    lily[3, 2] = 0.25
    targets = np.array([0, 1, 2, 1])
    r = consistency.metrics_from_logits(lily, stock, targets)

    def ppl(logits):
        logz = np.log(np.exp(logits).sum(-1))
        return math.exp(np.mean(logz - logits[np.arange(4), targets]))

    assert r.positions == 4
    assert r.top1_agreement_pct == pytest.approx(75.0)
    assert r.max_abs_logit_diff == pytest.approx(1.5)
    assert r.perplexity_stock == pytest.approx(ppl(stock))
    assert r.perplexity_lily == pytest.approx(ppl(lily))
    assert r.perplexity_delta_pct == pytest.approx(100 * (ppl(lily) - ppl(stock)) / ppl(stock))
    assert "top-1 agreement 75.00 %" in r.summary()


def test_identical_engines_give_perfect_scores():
    logits = np.random.default_rng(0).normal(size=(16, 50))
    r = consistency.metrics_from_logits(logits, logits.copy(), np.arange(16))
    assert (r.top1_agreement_pct, r.max_abs_logit_diff, r.perplexity_delta_pct) == (100.0, 0.0, 0.0)


@pytest.fixture
def embedded_dir():
    from lily_mlx.models import embedded

    assert embedded._is_complete(embedded.EMBEDDED_DIR), f"the embedded model is part of the tree: {embedded.EMBEDDED_DIR}"
    return embedded.EMBEDDED_DIR


@pytest.mark.parametrize("mode", consistency.MODES)
def test_embedded_model_reference_backend_is_exactly_stock(monkeypatch, embedded_dir, mode):
    monkeypatch.setenv("LILY_BACKEND", "reference")
    r = consistency.run_consistency(embedded_dir, positions=192, mode=mode)
    assert r.backend == "reference" and r.positions == 192 and r.mode == mode
    assert r.top1_agreement_pct == 100.0
    assert r.max_abs_logit_diff == 0.0
    assert r.perplexity_lily == r.perplexity_stock and r.perplexity_delta_pct == 0.0
    assert r.perplexity_stock < 1024 / 4  # a trained model on held-out text, not noise


def test_compare_engines_restores_patch_state(monkeypatch, embedded_dir):
    import lily_mlx
    import mlx_lm

    monkeypatch.setenv("LILY_BACKEND", "reference")
    model, tokenizer = mlx_lm.load(str(embedded_dir))
    tokens = tokenizer.encode(consistency.default_text())
    consistency.compare_engines(model, tokens, positions=8, mode="prefill")
    assert not lily_mlx.is_patched(model)
    lily_mlx.patch(model)
    consistency.compare_engines(model, tokens, positions=8, mode="prefill")
    assert lily_mlx.is_patched(model)


def test_cli_prints_both_modes(monkeypatch, capsys, embedded_dir):
    monkeypatch.setenv("LILY_BACKEND", "auto")
    assert consistency.main(["--model", str(embedded_dir), "--positions", "32", "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "backend reference" in out
    assert out.count("top-1 agreement 100.00 %") == 2 and out.count("max |logit diff| 0") == 2


def readme_consistency_sentence(decode, prefill) -> str:
    """The README's consistency figures, written from the tool's results (two decimals)."""
    return (f"top-1 agreement with stock is {decode.top1_agreement_pct:.2f} % (decode) / "
            f"{prefill.top1_agreement_pct:.2f} % (prefill), perplexity {decode.perplexity_delta_pct:+.2f} % / "
            f"{prefill.perplexity_delta_pct:+.2f} %")


@pytest.mark.slow
def test_readme_figures_are_what_the_command_prints():
    """README.md quotes `python -m lily_mlx consistency --backend sim`; run it and compare."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith("LILY_")}
    proc = subprocess.run([sys.executable, "-m", "lily_mlx", "consistency", "--backend", "sim", "--json"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    results = {r["mode"]: consistency.ConsistencyResult(**r) for r in json.loads(proc.stdout)}
    expected = readme_consistency_sentence(results["decode"], results["prefill"])
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert expected in readme, f"README.md should say: {expected!r}"


def test_oracle_scores_both_engines_and_puts_the_weights_back(monkeypatch, embedded_dir):
    """``--oracle``: each engine against stock with every floating-point parameter in float32. On the reference
    backend lily is stock, so both score alike; the oracle differs from stock (MLX's CPU quantised matmul sums in
    bf16) yet agrees on most tokens; the model's own arrays are back after (stock's logits unchanged)."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten

    monkeypatch.setenv("LILY_BACKEND", "reference")
    model, tokenizer = mlx_lm.load(str(embedded_dir))
    tokens = np.asarray(tokenizer.encode(consistency.default_text()), dtype=np.int64)[:33]
    before = consistency._engine_logits(model, tokens, "decode")
    arrays = {k: v for k, v in tree_flatten(model.parameters())}
    r = consistency.compare_engines(model, tokens, positions=32, mode="decode", oracle=True)
    assert r.oracle_lily == r.oracle_stock
    assert 0 < r.oracle_stock.mean_abs_logit_diff < 0.5 and r.oracle_stock.top1_agreement_pct >= 80
    for k, v in tree_flatten(model.parameters()):  # (patching may hand a projection a view of the same values)
        assert v.dtype == arrays[k].dtype and bool(mx.array_equal(v, arrays[k]).item()), k
    assert np.array_equal(consistency._engine_logits(model, tokens, "decode"), before)
    assert "fp32 oracle: lily top-1" in r.summary() and r.to_dict()["oracle_lily"]["top1_agreement_pct"] > 0


@pytest.mark.parametrize("positions", ["0", "-5"])
def test_positions_below_one_are_a_usage_error(positions, capsys):
    """(-5 once meant tokens[:-4]: tens of thousands of decode steps; 0 a reshape traceback.)"""
    with pytest.raises(SystemExit) as exit_info:
        consistency.main(["--positions", positions])
    assert exit_info.value.code == 2 and "--positions must be at least 1" in capsys.readouterr().err
