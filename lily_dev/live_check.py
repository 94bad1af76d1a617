"""Device check of the fixed-block decode attention's geometry, over a KV buffer with spare rows (switch
kv_write_in_trace): stock's SDPA and the fixed blocks over the live rows, the live-length form as the product runs
it, candidates for its schedule (rows per block) and its merge (simdgroups a threadgroup, fp32 a lane a load), and the
matrix-tile partials (``kernels.decode_attention_tiles_live``, a candidate) at several rows a block.
8 calls an evaluation, variants rotating each round, medians. Prints a Markdown table (us per 8 calls).

    LILY_BACKEND=cuda python -m lily_dev.live_check [--contexts 4096,32768,131072] [--spare 1024] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from lily_mlx.core.backend import resolve_backend
from lily_mlx.ops.attention import kernels as ak

CALLS = 8


def variants(S: int, spare: int):
    """name -> keyword arguments of ``decode_attention_fixed_blocks_live`` (None: a form over the live rows)."""
    br = ak.live_block_rows(S + spare)
    return {
        "stock SDPA, live rows": None,
        "fixed blocks, live rows": None,
        "live form (product)": {},
        "live, merge MW = 32": {"merge_simdgroups": 32},
        "live, merge MV = 1": {"merge_lane_floats": 1},
        "live, merge MW = 4, MV = 1": {"merge_simdgroups": 4, "merge_lane_floats": 1},
        "live, half the rows a block": {"block_rows": max(1, br // 2)},
        "live, 2x rows a block": {"block_rows": 2 * br},
        **{f"tiles, {rows} rows a block": {"tiles": True, "block_rows": rows} for rows in TILE_BLOCK_ROWS},
        **{f"tiles staged, {rows} rows a block": {"tiles": True, "block_rows": rows, "staged": True}
           for rows in TILE_BLOCK_ROWS},
    }


TILE_BLOCK_ROWS = (64, 128, 256, 512)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--spare", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)
    backend = resolve_backend()
    scales = [0.0625 * (1 + 1e-3 * i) for i in range(CALLS)]
    contexts = [int(c) for c in args.contexts.split(",")]
    table = {}
    for S in contexts:
        q = mx.random.normal((1, 16, 1, 256)).astype(mx.bfloat16)
        k = mx.random.normal((1, 2, S + args.spare, 256)).astype(mx.bfloat16)
        v = mx.random.normal((1, 2, S + args.spare, 256)).astype(mx.bfloat16)
        kl, vl = mx.contiguous(k[:, :, :S]), mx.contiguous(v[:, :, :S])
        last = mx.array([S - 1], dtype=mx.int32)
        mx.eval(q, k, v, kl, vl, last)
        runs = {}
        for name, kw in variants(S, args.spare).items():
            if name.startswith("stock"):
                runs[name] = lambda: [mx.fast.scaled_dot_product_attention(q, kl, vl, scale=s) for s in scales]
            elif kw is None:
                runs[name] = lambda: [ak.decode_attention_fixed_blocks(q, k, v, scale=s, kv_length=S, backend=backend)
                                      for s in scales]
            elif kw.get("tiles"):
                runs[name] = lambda kw=kw: [ak.decode_attention_tiles_live(q, k, v, last, scale=s, backend=backend,
                                                                           block_rows=kw["block_rows"],
                                                                           staged=kw.get("staged", False))
                                            for s in scales]
            else:
                runs[name] = lambda kw=kw: [ak.decode_attention_fixed_blocks_live(q, k, v, last, scale=s,
                                                                                  backend=backend, **kw)
                                            for s in scales]
        want = mx.fast.scaled_dot_product_attention(q, kl, vl, scale=scales[0])
        for name, run in runs.items():  # correctness first: each form against stock's
            got = run()[0]
            err = (mx.linalg.norm((got - want).astype(mx.float32)) / mx.linalg.norm(want.astype(mx.float32))).item()
            assert err < 1e-2, (S, name, err)
        times = {name: [] for name in runs}
        names = list(runs)
        for r in range(args.rounds + 2):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                t = time.perf_counter()
                mx.eval(runs[name]())
                if r >= 2:  # two warm-up rounds
                    times[name].append((time.perf_counter() - t) * 1e6)
        table[S] = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"[live_check] S={S} done", flush=True)
    print(f"\n{CALLS} calls an evaluation, {args.spare} spare rows in the buffer, medians of {args.rounds} rounds "
          f"(us), backend {backend}:\n")
    print("| variant | " + " | ".join(f"S = {S}" for S in contexts) + " |")
    print("|---|" + "---|" * len(contexts))
    for name in variants(contexts[0], args.spare):
        print(f"| {name} | " + " | ".join(f"{table[S][name]:.1f}" for S in contexts) + " |")


if __name__ == "__main__":
    main()
