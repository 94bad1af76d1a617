"""Numerical consistency of lily-mlx vs stock MLX-LM, teacher-forced (the write-up's method).

    python -m lily_mlx consistency [--model M] [--positions 192] [--text-file F] [--mode decode]

Both engines score the same reference token sequence: at each of ``positions`` positions each engine
predicts the next token from the same reference prefix, so an early difference cannot steer later
inputs. The engines are the same loaded weights in one process, patched (``lily_mlx.patch``) and
stock (``lily_mlx.unpatch``). Reported: top-1 agreement (%), perplexity of each engine on the
reference tokens, the relative perplexity delta (%), and the largest |logit difference|.

Modes: ``decode`` feeds one token per step through a prompt cache (the generation path, where the
decode kernels run); ``prefill`` scores the whole sequence in one forward pass (the prefill kernels).
The default model is the embedded one; the default text its held-out docstrings (never trained on).

``--oracle`` also scores both engines against an fp32 oracle: stock MLX-LM on the same quantised weights with
every floating-point parameter (scales, biases, norms, embeddings) in float32, so activations and sums are fp32.
Stock itself is not that oracle: MLX's CPU quantised matmul accumulates in the activation type (bf16), so on the
CPU a more exact kernel agrees less with stock while agreeing more with the oracle.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import numpy as np

from lily_mlx.core.backend import CHOICES as BACKEND_CHOICES

MODES = ("decode", "prefill")


@dataclass(frozen=True)
class ConsistencyResult:
    model: str
    mode: str  # "decode" or "prefill"
    backend: str  # lily-mlx backend in force (metal, cuda, sim, reference)
    positions: int
    top1_agreement_pct: float
    perplexity_lily: float
    perplexity_stock: float
    perplexity_delta_pct: float  # (lily - stock) / stock * 100
    max_abs_logit_diff: float
    oracle_lily: Optional["OracleScores"] = None  # with --oracle: each engine against the fp32 oracle
    oracle_stock: Optional["OracleScores"] = None

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        line = (
            f"{self.mode:7s} positions {self.positions}  top-1 agreement {self.top1_agreement_pct:.2f} %  "
            f"perplexity lily {self.perplexity_lily:.4f} / stock {self.perplexity_stock:.4f} "
            f"({self.perplexity_delta_pct:+.4f} %)  max |logit diff| {self.max_abs_logit_diff:.6g}"
        )
        if self.oracle_lily is not None:
            line += (f"\n{'':7s} fp32 oracle: lily {self.oracle_lily.summary()}; "
                     f"stock {self.oracle_stock.summary()}")
        return line


@dataclass(frozen=True)
class OracleScores:
    """One engine's logits against the fp32 oracle's."""

    top1_agreement_pct: float
    mean_abs_logit_diff: float
    max_abs_logit_diff: float
    perplexity_oracle: float

    def summary(self) -> str:
        return (f"top-1 {self.top1_agreement_pct:.2f} %, mean |logit diff| {self.mean_abs_logit_diff:.4g}, "
                f"max {self.max_abs_logit_diff:.4g}")


def oracle_scores(logits: np.ndarray, oracle: np.ndarray, targets: np.ndarray) -> OracleScores:
    return OracleScores(
        top1_agreement_pct=float(100.0 * np.mean(logits.argmax(-1) == oracle.argmax(-1))),
        mean_abs_logit_diff=float(np.abs(logits - oracle).mean()),
        max_abs_logit_diff=float(np.abs(logits - oracle).max()),
        perplexity_oracle=_perplexity(oracle, targets),
    )


def fp32_oracle_logits(model, tokens: np.ndarray, mode: str) -> np.ndarray:
    """Stock's logits with the model's floating-point parameters in float32 (the quantised weights as they are);
    the model's own arrays are put back after."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    saved = tree_flatten(model.parameters())
    try:
        model.set_dtype(mx.float32)
        return _engine_logits(model, tokens, mode)
    finally:
        model.update(tree_unflatten(saved))


def teacher_forced_logits(model, prompt, tokens):
    """Logits predicting each of ``tokens`` from the same reference prefix: [len(tokens), vocab] fp32.

    ``prompt`` [P] is prefilled in one call; its last position predicts ``tokens[0]``, then each
    following step is fed the reference token, so an early difference between engines cannot steer
    later inputs. The one teacher-forcing loop of the project (tools and tests use it)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = [model(prompt[None], cache=cache)[0, -1]]
    for t in list(tokens)[:-1]:
        logits.append(model(mx.array([[int(t)]]), cache=cache)[0, -1])
        mx.eval(logits[-1])
    return mx.stack(logits).astype(mx.float32)  # [n, vocab]


def _engine_logits(model, tokens: np.ndarray, mode: str) -> np.ndarray:
    """fp32 logits [P, V] predicting tokens[1:] from each prefix of tokens[:-1]."""
    import mlx.core as mx

    inputs = mx.array(tokens[:-1].astype(np.int32))  # [P]
    if mode == "prefill":
        logits = model(inputs[None])[0].astype(mx.float32)  # [P, V]
        mx.eval(logits)
        return np.array(logits)
    if mode != "decode":
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    return np.array(teacher_forced_logits(model, inputs[:1], tokens[1:]))


def _perplexity(logits: np.ndarray, targets: np.ndarray) -> float:
    logits = logits.astype(np.float64)
    m = logits.max(axis=-1, keepdims=True)
    logz = (m[:, 0] + np.log(np.exp(logits - m).sum(axis=-1)))
    nll = logz - logits[np.arange(len(targets)), targets]
    return float(math.exp(nll.mean()))


def compare_engines(model, tokens, *, positions: int = 192, mode: str = "decode", name: str = "",
                    oracle: bool = False) -> ConsistencyResult:
    """Teacher-forced lily vs stock on an already loaded MLX-LM model (``oracle``: both against the fp32 oracle
    too); restores its patch state."""
    import lily_mlx
    from lily_mlx.core.backend import resolve_backend

    tokens = np.asarray(tokens, dtype=np.int64)
    if positions < 1:
        raise ValueError(f"positions must be at least 1, got {positions}")
    if len(tokens) < positions + 1:
        raise ValueError(f"need {positions + 1} reference tokens, got {len(tokens)}")
    tokens = tokens[: positions + 1]
    targets = tokens[1:]
    was_patched = lily_mlx.is_patched(model)
    try:
        stock = _engine_logits(lily_mlx.unpatch(model), tokens, mode)
        exact = fp32_oracle_logits(model, tokens, mode) if oracle else None
        lily = _engine_logits(lily_mlx.patch(model), tokens, mode)
    finally:
        (lily_mlx.patch if was_patched else lily_mlx.unpatch)(model)
    result = metrics_from_logits(lily, stock, targets, model=name, mode=mode, backend=resolve_backend())
    if exact is None:
        return result
    return replace(result, oracle_lily=oracle_scores(lily, exact, targets),
                   oracle_stock=oracle_scores(stock, exact, targets))


def metrics_from_logits(lily, stock, targets, *, model="", mode="decode", backend="") -> ConsistencyResult:
    """The consistency numbers from two engines' fp32 logits [P, V] for the targets [P]."""
    lily, stock, targets = np.asarray(lily), np.asarray(stock), np.asarray(targets)
    ppl_lily, ppl_stock = _perplexity(lily, targets), _perplexity(stock, targets)
    return ConsistencyResult(
        model=model,
        mode=mode,
        backend=backend,
        positions=len(targets),
        top1_agreement_pct=100.0 * float(np.mean(lily.argmax(-1) == stock.argmax(-1))),
        perplexity_lily=ppl_lily,
        perplexity_stock=ppl_stock,
        perplexity_delta_pct=100.0 * (ppl_lily - ppl_stock) / ppl_stock,
        max_abs_logit_diff=float(np.max(np.abs(lily - stock))),
    )


def default_text() -> str:
    """Held-out stdlib docstrings shipped with the embedded model (never trained on)."""
    from lily_mlx.models.embedded import HELDOUT_FILE, embedded_model_path

    return (embedded_model_path() / HELDOUT_FILE).read_text()


def run_consistency(
    model_path=None, *, positions: int = 192, text: str | None = None, mode: str = "decode"
) -> ConsistencyResult:
    """Load ``model_path`` (default: the embedded model) once and compare the two engines on it."""
    import mlx_lm

    if model_path is None:
        from lily_mlx.models.embedded import embedded_model_path

        model_path = embedded_model_path()
    model, tokenizer = mlx_lm.load(str(model_path))
    text = default_text() if text is None else text
    tokens = tokenizer.encode(text)
    return compare_engines(model, tokens, positions=positions, mode=mode, name=str(model_path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lily_mlx consistency",
        description="Teacher-forced lily-mlx vs stock MLX-LM on the same weights: top-1 agreement, "
        "perplexity of each engine, relative perplexity delta, max |logit difference|.",
    )
    parser.add_argument("--model", default=None, help="model folder or Hugging Face repo (default: embedded model)")
    parser.add_argument("--positions", type=int, default=192, help="scored positions (default 192)")
    parser.add_argument("--text-file", type=Path, default=None, help="reference text (default: held-out docstrings)")
    parser.add_argument("--mode", choices=MODES + ("both",), default="both",
                        help="decode: one token per step with a cache; prefill: one forward pass (default both)")
    parser.add_argument("--backend", default=None, choices=BACKEND_CHOICES, type=str.lower,
                        help="lily-mlx backend for the lily engine (default: LILY_BACKEND or auto)")
    parser.add_argument("--oracle", action="store_true",
                        help="also score both engines against an fp32 oracle (stock with every floating-point "
                        "parameter in float32): top-1 agreement and |logit difference| of each")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.positions < 1:
        parser.error(f"--positions must be at least 1 (got {args.positions})")
    if args.backend is not None:
        os.environ["LILY_BACKEND"] = args.backend  # read when patch() resolves the dispatch plan

    import mlx_lm

    model_path = args.model
    if model_path is None:
        from lily_mlx.models.embedded import embedded_model_path

        model_path = str(embedded_model_path())
    model, tokenizer = mlx_lm.load(str(model_path))
    text = args.text_file.read_text() if args.text_file else default_text()
    tokens = tokenizer.encode(text)
    modes = MODES if args.mode == "both" else (args.mode,)
    results = [
        compare_engines(model, tokens, positions=args.positions, mode=m, name=str(model_path), oracle=args.oracle)
        for m in modes
    ]
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        print(f"model {model_path}  backend {results[0].backend}")
        for r in results:
            print(r.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
