"""The embedded default model: a tiny Qwen3.6 (``qwen3_5_moe``) trained on stdlib docstrings, 4-bit.

It has the exact architecture MLX-LM runs for Qwen3.6-35B-A3B (Gated DeltaNet and gated full
attention layers, sparse MoE with a sigmoid-gated shared expert), at small widths, so every lily-mlx
op and kernel path runs on it in seconds. It is trained briefly in MLX on the CPU so its next-token
distribution is peaked (greedy decoding gives stable, non-trivial text and ties are rare), then
quantised like the real checkpoint with MLX-LM's own utilities, and saved in MLX-LM's format so
stock ``mlx_lm.load`` loads it.

    python -m lily_mlx embedded-model            # print the folder (build it first if missing)
    python -m lily_mlx embedded-model --rebuild --out DIR

The shipped copy lives in ``lily_mlx/embedded/qwen3_6_tiny``; see docs/embedded-model.md.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import qwen3_6
from .corpus import load_corpus
from .tokenizer import END_OF_TEXT, IM_END, save_tokenizer, train_tokenizer

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "embedded" / "qwen3_6_tiny"
HELDOUT_FILE = "heldout.txt"
BUILD_INFO_FILE = "build_info.json"
GENERATION_CONFIG_FILE = "generation_config.json"
HELDOUT_EVAL_TOKENS = 1024  # perplexity recorded in build_info.json
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 64
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01


def embedded_model_path() -> Path:
    """Folder of the embedded model; built if it is missing (minutes to tens of minutes on a CPU)."""
    if not _is_complete(EMBEDDED_DIR):
        build_embedded_model(EMBEDDED_DIR)
    return EMBEDDED_DIR


def _is_complete(path: Path) -> bool:
    return all((path / name).exists() for name in _REQUIRED_FILES)


def _say(log, message: str) -> None:
    if log is not None:
        log(message)


def _token_stream(tokenizer, docs: list[str]) -> np.ndarray:
    """All documents as one int32 token stream, separated by the end-of-text token."""
    sep = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tokenizer.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(sep)
    return np.asarray(ids, dtype=np.int32)


def generation_config(tokenizer) -> dict:
    """generation_config.json as Qwen's checkpoints have it: generation stops at the end of a chat
    turn (``<|im_end|>``, config.json's eos) and at the end of a document (``<|endoftext|>``, the
    separator the model was trained with). MLX-LM's ``load`` takes these eos ids over config.json's."""
    im_end, end_of_text = tokenizer.token_to_id(IM_END), tokenizer.token_to_id(END_OF_TEXT)
    return {"eos_token_id": [im_end, end_of_text], "pad_token_id": end_of_text}


def _build_stock_model(config: dict, seed: int):
    import mlx.core as mx
    from mlx_lm.models import qwen3_5_moe

    mx.random.seed(seed)
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def _lr_schedule(settings: TrainSettings):
    """Linear warmup then cosine decay to 10 % (a plain function of the step, so it is exact)."""

    def lr(step):
        import mlx.core as mx

        step = step.astype(mx.float32)
        warm = step / settings.warmup_steps
        frac = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
        cos = 0.1 + 0.45 * (1.0 + mx.cos(math.pi * mx.clip(frac, 0.0, 1.0)))
        return settings.learning_rate * mx.where(step < settings.warmup_steps, warm, cos)

    return lr


def train(model, tokens: np.ndarray, settings: TrainSettings, seed: int, log=None) -> list[float]:
    """Next-token cross-entropy training in fp32; batches are random windows of ``tokens``."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    rng = np.random.default_rng(seed)
    optimizer = optim.AdamW(learning_rate=_lr_schedule(settings), weight_decay=settings.weight_decay)

    def loss_fn(model, inputs, targets):
        logits = model(inputs)  # [B, T, V]
        return nn.losses.cross_entropy(logits, targets, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    model.train()
    losses = []
    start = time.time()
    T = settings.seq_len
    for step in range(settings.steps):
        offsets = rng.integers(0, len(tokens) - T - 1, size=settings.batch_size)
        window = np.stack([tokens[o : o + T + 1] for o in offsets])  # [B, T + 1]
        batch = mx.array(window)
        loss, grads = loss_and_grad(model, batch[:, :-1], batch[:, 1:])
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)
        losses.append(loss.item())
        if step % 50 == 0 or step == settings.steps - 1:
            _say(log, f"  step {step:4d}/{settings.steps}  loss {losses[-1]:.3f}  ({time.time() - start:.0f} s)")
    model.eval()
    return losses


def heldout_perplexity(model, tokens: np.ndarray, window: int = 256) -> float:
    """Teacher-forced perplexity of ``model`` over ``tokens`` in windows of ``window`` tokens."""
    import mlx.core as mx
    import mlx.nn as nn

    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        chunk = mx.array(tokens[start : start + window + 1])[None]
        if chunk.shape[1] < 2:
            break
        logits = model(chunk[:, :-1]).astype(mx.float32)
        nll = nn.losses.cross_entropy(logits, chunk[:, 1:], reduction="sum")
        total += nll.item()
        count += chunk.shape[1] - 1
    return math.exp(total / count)


def build_embedded_model(
    out_dir,
    seed: int = 0,
    *,
    steps: int | None = None,
    settings: TrainSettings | None = None,
    text_overrides: dict | None = None,
    max_corpus_chars: int = 2_000_000,
    heldout_eval_tokens: int = HELDOUT_EVAL_TOKENS,
    log=print,
) -> Path:
    """Train, quantise and save the embedded model into ``out_dir`` (replaced if it exists).

    ``steps`` shortens training (tests use a few steps to check the pipeline); ``text_overrides``
    change the architecture (the shipped model uses ``qwen3_6.TINY_TEXT_OVERRIDES``).
    """
    import mlx.core as mx

    out_dir = Path(out_dir)
    settings = settings or TrainSettings()
    if steps is not None:
        settings = TrainSettings(**{**settings.__dict__, "steps": steps})
    overrides = {**qwen3_6.TINY_TEXT_OVERRIDES, **(text_overrides or {})}
    previous_device = mx.default_device()
    mx.set_default_device(mx.cpu)  # the CPU's arithmetic, whatever accelerator the machine has
    try:
        return _build(out_dir, seed, settings, overrides, max_corpus_chars, heldout_eval_tokens, log)
    finally:
        mx.set_default_device(previous_device)


def _build(out_dir, seed, settings, overrides, max_corpus_chars, heldout_eval_tokens, log) -> Path:
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    t0 = time.time()

    _say(log, "[1/5] reading stdlib docstrings")
    corpus = load_corpus(max_chars=max_corpus_chars)
    _say(log, f"      {len(corpus.train)} training / {len(corpus.heldout)} held-out docstrings")

    _say(log, f"[2/5] training byte-level BPE tokenizer ({overrides['vocab_size']} tokens)")
    tokenizer = train_tokenizer(corpus.train, overrides["vocab_size"])
    tokens = _token_stream(tokenizer, corpus.train)
    heldout_tokens = np.asarray(tokenizer.encode(corpus.heldout_text).ids, dtype=np.int32)
    eos_id = tokenizer.token_to_id(IM_END)

    text_cfg = qwen3_6.text_config(overrides)
    config = qwen3_6.model_config(text_cfg, eos_token_id=eos_id)
    model = _build_stock_model(config, seed)

    _say(log, f"[3/5] training {settings.steps} steps on {len(tokens)} tokens (CPU, seed {seed})")
    losses = train(model, tokens, settings, seed, log=log)

    _say(log, "[4/5] quantising: 4-bit g64 affine, routers and shared-expert gates 8-bit")
    model, config = qwen3_6.quantise_like_checkpoint(model, config)
    ppl = heldout_perplexity(model, heldout_tokens[: heldout_eval_tokens + 1])
    _say(log, f"      held-out perplexity {ppl:.2f} (uniform: {overrides['vocab_size']})")

    _say(log, f"[5/5] saving to {out_dir}")
    with tempfile.TemporaryDirectory(dir=out_dir.parent if out_dir.parent.exists() else None) as tmp:
        tmp = Path(tmp)
        save_model(tmp, model)
        save_config(config, tmp / "config.json")
        save_tokenizer(tokenizer, tmp)
        (tmp / GENERATION_CONFIG_FILE).write_text(json.dumps(generation_config(tokenizer), indent=2) + "\n")
        (tmp / HELDOUT_FILE).write_text(corpus.heldout_text)
        info = {
            "seed": seed,
            "train_settings": settings.__dict__,
            "final_train_loss": losses[-1] if losses else None,
            "heldout_perplexity": ppl,
            "heldout_eval_tokens": heldout_eval_tokens,
            "corpus_sha256": corpus.sha256,
            "python": sys.version.split()[0],
            "mlx": mx.__version__,
            "build_seconds": round(time.time() - t0, 1),
        }
        (tmp / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(tmp, out_dir)
        out_dir.chmod(0o755)  # the temporary folder was private
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lily_mlx embedded-model",
        description="Print the embedded tiny Qwen3.6 model's folder (last line of output), "
        "building it first if it is missing.",
    )
    parser.add_argument("--rebuild", action="store_true", help="train and quantise it again")
    parser.add_argument("--out", type=Path, default=None, help="build into this folder instead")
    parser.add_argument("--seed", type=int, default=0, help="seed for init, batches (default 0)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 300)")
    args = parser.parse_args(argv)

    out = args.out or EMBEDDED_DIR
    if args.rebuild or args.steps is not None or not _is_complete(out):
        build_embedded_model(out, seed=args.seed, steps=args.steps)
    print(out.resolve(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
