"""Does lily-mlx on this machine's kernel backend compute stock MLX-LM's function? A quick model-level
check before benchmarking: the same random model, unpatched vs patched, prefill logits and a few
greedy decode steps compared, in fp32 (same function: tight) and in bf16 (against an fp32 oracle, no worse
than about twice stock's own rounding error). Exit status 0 when they agree.

    python -m bench.smoke [--size full --num-layers 4] [--prompt 300]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import mlx.core as mx
import numpy as np


def _run_engine(model, prompt, decode_steps: int, lily: bool):
    """Prefill logits of the last position plus ``decode_steps`` greedy steps: ([steps+1, V], tokens)."""
    import lily_mlx
    from mlx_lm.models.cache import make_prompt_cache

    if lily:
        lily_mlx.patch(model)
    try:
        cache = make_prompt_cache(model)
        logits = [model(prompt, cache=cache)[:, -1].astype(mx.float32)]
        tok = mx.argmax(logits[-1], axis=-1)
        toks = [int(tok.item())]
        for _ in range(decode_steps):
            logits.append(model(tok[:, None], cache=cache)[:, -1].astype(mx.float32))
            tok = mx.argmax(logits[-1], axis=-1)
            toks.append(int(tok.item()))
    finally:
        if lily:
            lily_mlx.unpatch(model)
    return np.stack([np.array(x) for x in logits]), toks


def _cast_floats(model, dtype) -> None:
    """Cast every floating parameter (norms, scales, biases; not packed weights) to ``dtype``."""
    from mlx.utils import tree_map

    floats = (mx.float32, mx.float16, mx.bfloat16)
    model.update(tree_map(lambda a: a.astype(dtype) if a.dtype in floats else a, model.parameters()))


def compare(model, prompt_len: int, decode_steps: int, vocab: int, seed: int = 0,
            keep_logits: bool = False) -> dict:
    """Stock vs lily on the same weights, judged against an fp32 oracle.

    bf16 rounding alone moves a random model's logits a lot (stock bf16 vs stock fp32 is often 10-20 %
    of the largest logit), so lily-vs-stock in bf16 says little. Instead: (1) in fp32 both engines must
    agree tightly (same function), (2) in bf16 lily's error against stock-fp32 must be no worse than
    about twice stock's own bf16 error. ``keep_logits`` adds the four logit arrays ([steps + 1, V] fp32
    numpy) under ``"logits"`` (to compare with another run's, e.g. sharded vs one device).
    """
    prompt = mx.random.randint(0, vocab, (1, prompt_len), key=mx.random.key(seed))
    original = model.parameters()  # restored exactly afterwards (A_log stays fp32, the rest bf16)
    s_bf, s_toks = _run_engine(model, prompt, decode_steps, lily=False)
    l_bf, l_toks = _run_engine(model, prompt, decode_steps, lily=True)
    _cast_floats(model, mx.float32)
    try:
        s_32, _ = _run_engine(model, prompt, decode_steps, lily=False)
        l_32, _ = _run_engine(model, prompt, decode_steps, lily=True)
    finally:
        model.update(original)
    scale = float(np.max(np.abs(s_32)))
    rel = lambda a, b: float(np.max(np.abs(a - b)) / max(scale, 1e-6))  # noqa: E731
    out = {
        "prompt_len": prompt_len,
        "logit_scale": scale,
        "rel_diff": rel(l_bf, s_bf),
        "fp32_lily_vs_stock": rel(l_32, s_32),
        "bf16_stock_vs_fp32": rel(s_bf, s_32),
        "bf16_lily_vs_fp32": rel(l_bf, s_32),
        "same_argmax_first": s_toks[0] == l_toks[0],
        "stock_tokens": s_toks,
        "lily_tokens": l_toks,
        "finite": bool(np.isfinite(l_bf).all() and np.isfinite(l_32).all()),
    }
    if keep_logits:
        out["logits"] = {"stock_bf16": s_bf, "lily_bf16": l_bf, "stock_fp32": s_32, "lily_fp32": l_32}
    return out


def agrees(r: dict, fp32_tol: float) -> bool:
    return (
        r["finite"]
        and r["fp32_lily_vs_stock"] <= fp32_tol
        and r["bf16_lily_vs_fp32"] <= 2.0 * r["bf16_stock_vs_fp32"] + 0.02
    )


def main(argv=None) -> int:
    from bench.model_setup import load_model
    from lily_mlx.core import dispatch
    from lily_mlx.core.backend import resolve_backend

    p = argparse.ArgumentParser(prog="python -m bench.smoke")
    p.add_argument("--size", default="full", choices=("full", "tiny"))
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--prompt", default="300,40", help="prompt lengths")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="fp32: max |lily - stock| / max |logit| allowed")
    p.add_argument("--per-family", action="store_true",
                   help="also compare with one op family's kernels at a time (others on the reference)")
    args = p.parse_args(argv)
    model, desc = load_model(None, args.size, 0, args.num_layers, log=print)
    vocab = model.args.text_config["vocab_size"]
    ok = True
    families = ("deltanet", "moe", "attention")
    variants = [("all", "")]
    if args.per_family:
        variants += [(f, ",".join(o for o in families if o != f)) for f in ("deltanet", "moe")]
    for label, forced in variants:
        os.environ["LILY_REFERENCE_OPS"] = forced
        dispatch.resolve()  # the plan reads the environment when resolved, not at each call
        for n in (int(x) for x in args.prompt.split(",")):
            t0 = time.perf_counter()
            r = compare(model, n, args.decode_steps, vocab)
            r.update(backend=resolve_backend(), model=desc, kernels=label,
                     seconds=round(time.perf_counter() - t0, 1))
            good = agrees(r, args.tolerance)
            if label == "all":
                ok &= good
            print(f"[smoke] {'ok' if good else 'MISMATCH'} {json.dumps(r)}", flush=True)
    os.environ.pop("LILY_REFERENCE_OPS", None)
    dispatch.invalidate()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
