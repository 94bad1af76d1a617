"""Does lily-mlx on this machine's kernel backend compute stock MLX-LM's function? A quick model-level
check before benchmarking: the same random model, unpatched vs patched, prefill logits and a few
greedy decode steps compared. Exit status 0 when they agree within bf16 tolerance.

    python -m bench.smoke [--size full --num-layers 4] [--prompt 300]
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import numpy as np


def compare(model, prompt_len: int, decode_steps: int, vocab: int, seed: int = 0) -> dict:
    import lily_mlx
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.random.randint(0, vocab, (1, prompt_len), key=mx.random.key(seed))
    out = {}
    for engine in ("stock", "lily"):
        if engine == "lily":
            lily_mlx.patch(model)
        cache = make_prompt_cache(model)
        logits = [model(prompt, cache=cache)[:, -1].astype(mx.float32)]
        tok = mx.argmax(logits[-1], axis=-1)
        toks = [int(tok.item())]
        for _ in range(decode_steps):
            logits.append(model(tok[:, None], cache=cache)[:, -1].astype(mx.float32))
            tok = mx.argmax(logits[-1], axis=-1)
            toks.append(int(tok.item()))
        out[engine] = (np.stack([np.array(x) for x in logits]), toks)
        if engine == "lily":
            lily_mlx.unpatch(model)
    s, l_ = out["stock"][0], out["lily"][0]
    scale = float(np.max(np.abs(s)))
    return {
        "prompt_len": prompt_len,
        "max_abs_diff": float(np.max(np.abs(s - l_))),
        "logit_scale": scale,
        "rel_diff": float(np.max(np.abs(s - l_)) / max(scale, 1e-6)),
        "same_argmax_first": out["stock"][1][0] == out["lily"][1][0],
        "stock_tokens": out["stock"][1],
        "lily_tokens": out["lily"][1],
        "finite": bool(np.isfinite(l_).all()),
    }


def main(argv=None) -> int:
    from bench.model_setup import load_model
    from lily_mlx.backend import resolve_backend

    p = argparse.ArgumentParser(prog="python -m bench.smoke")
    p.add_argument("--size", default="full", choices=("full", "tiny"))
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--prompt", default="300,40", help="prompt lengths")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--tolerance", type=float, default=5e-2, help="max |diff| / max |logit|")
    args = p.parse_args(argv)
    model, desc = load_model(None, args.size, 0, args.num_layers, log=print)
    vocab = model.args.text_config["vocab_size"]
    ok = True
    for n in (int(x) for x in args.prompt.split(",")):
        r = compare(model, n, args.decode_steps, vocab)
        r.update(backend=resolve_backend(), model=desc)
        good = r["finite"] and r["rel_diff"] <= args.tolerance
        ok &= good
        print(f"[smoke] {'ok' if good else 'MISMATCH'} {json.dumps(r)}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
