"""The Python API of docs/usage.md on a checkpoint, one process per rank: stock, then lily on the same
weights; last-position logits (finite, largest value, argmax, lily vs stock) and 12 greedy tokens.

    python -m bench.api_check CKPT                                    # one device: load + lily_mlx.patch
    mlx.launch --backend nccl -n 2 -- python -m bench.api_check CKPT  # load + model.shard(group) + patch
    mlx.launch --backend ring -n 2 -- python -m bench.api_check CKPT --sharded-load   # MLX-LM's sharded_load

Rank 0 prints one ``API_CHECK {json}`` line. ``--sharded-load`` is MLX-LM's own loader; under MLX
0.32.4's NCCL backend it fails at its first collective (docs/usage.md), so the default shards after a
plain ``load`` as ``bench/shard.py`` does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PROMPT = "Write one sentence about the sea."


def load_model(path: str, group, sharded_load: bool):
    from mlx_lm.utils import load
    from mlx_lm.utils import sharded_load as mlx_lm_sharded_load

    if group.size() > 1 and sharded_load:
        return mlx_lm_sharded_load(path, tensor_group=group)
    model, tokenizer = load(path)
    if group.size() > 1:
        model.shard(group)
    return model, tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.api_check", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--sharded-load", action="store_true", help="MLX-LM's sharded_load instead of load + shard")
    p.add_argument("--max-tokens", type=int, default=12)
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import generate

    import lily_mlx

    group = mx.distributed.init()
    out = {"world_size": group.size(), "sharded_load": args.sharded_load}
    last = {}
    for engine in ("stock", "lily"):
        t0 = time.perf_counter()
        model, tokenizer = load_model(args.checkpoint, group, args.sharded_load)
        if engine == "lily":
            lily_mlx.patch(model)
        logits = model(mx.array(tokenizer.encode(PROMPT))[None]).astype(mx.float32)[0, -1]  # [V]
        text = generate(model, tokenizer, PROMPT, max_tokens=args.max_tokens, verbose=False)
        last[engine] = logits
        out[engine] = {"finite": bool(mx.isfinite(logits).all().item()),
                       "max_abs": float(mx.abs(logits).max().item()),
                       "argmax_last": int(mx.argmax(logits).item()), "text": text,
                       "seconds": round(time.perf_counter() - t0, 1)}
        del model
        mx.clear_cache()
    out["lily_vs_stock_rel"] = float((mx.abs(last["lily"] - last["stock"]).max()
                                      / mx.abs(last["stock"]).max()).item())
    out["same_text"] = out["stock"]["text"] == out["lily"]["text"]
    if group.rank() == 0:
        print("API_CHECK", json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
