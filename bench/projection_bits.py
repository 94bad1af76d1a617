"""Whether MLX's quantised matmul gives one projection's rows the same bits alone and inside a
concatenation of projections, on the default device, at Qwen3.6-35B-A3B's projection shapes: the
condition under which ``lily_mlx.core.projections`` (switches ``fused_in_proj``, ``fused_qkv_proj``)
may run a layer's projections as one matmul. Also times one decode-row call both ways.

    python -m bench.projection_bits [--rows 1,2,3,4,7,8,16,64,512] [--seeds 3]

Prints one table row per (group, call shape): bit-identical or the largest difference, and the fused
path's choice (``fused`` if the row count is at most ``projections.MAX_ROWS``). Exits 1 if a row count
the fused path takes gives different bits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx

from lily_mlx.core import projections

HIDDEN = 2048
GROUPS = {  # Qwen3.6-35B-A3B: output rows of each projection, in the fused order
    "deltanet in_proj (qkv, z, b, a)": (8192, 4096, 32, 32),
    "attention (q, k, v)": (8192, 512, 512),
}


def _quantized(rows: int, key) -> tuple:
    w = (mx.random.normal((rows, HIDDEN), key=key) * HIDDEN ** -0.5).astype(mx.bfloat16)
    return mx.quantize(w, group_size=64, bits=4)


def _matmul(x, w, s, b):
    return mx.quantized_matmul(x, w, scales=s, biases=b, transpose=True, group_size=64, bits=4)


def _median_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,16,64,512", help="row counts (comma separated)")
    ap.add_argument("--seeds", type=int, default=3, help="random weights and inputs per case")
    args = ap.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"device {mx.default_device()}, MLX {mx.__version__}, projections.MAX_ROWS = {projections.MAX_ROWS}")
    print("| group | call shape | path | bits |")
    print("|---|---|---|---|")
    bad = 0
    for name, sizes in GROUPS.items():
        for rows in rows_list:
            for shape in ((rows, 1, HIDDEN), (1, rows, HIDDEN)) if rows > 1 else ((1, 1, HIDDEN),):
                worst = 0.0
                for seed in range(args.seeds):
                    keys = mx.random.split(mx.random.key(seed), len(sizes) + 1)
                    pieces = [_quantized(n, k) for n, k in zip(sizes, keys[1:])]
                    cat = [mx.concatenate([p[i] for p in pieces], axis=0) for i in range(3)]
                    x = mx.random.normal(shape, key=keys[0]).astype(mx.bfloat16)
                    alone = mx.concatenate([_matmul(x, *p) for p in pieces], axis=-1)
                    fused = _matmul(x, *cat)
                    diff = float(mx.max(mx.abs(alone.astype(mx.float32) - fused.astype(mx.float32))).item())
                    worst = max(worst, diff)
                path = "fused" if rows <= projections.MAX_ROWS else "unfused"
                verdict = "identical" if worst == 0 else f"differ (max {worst:.3g})"
                bad += path == "fused" and worst != 0
                print(f"| {name} | {list(shape)} | {path} | {verdict} |", flush=True)
    print("\nOne decode row, ms per call (median of 50, each evaluated alone):")
    print("| group | projections one by one | one fused matmul + split |")
    print("|---|---|---|")
    for name, sizes in GROUPS.items():
        keys = mx.random.split(mx.random.key(7), len(sizes) + 1)
        pieces = [_quantized(n, k) for n, k in zip(sizes, keys[1:])]
        cat = [mx.concatenate([p[i] for p in pieces], axis=0) for i in range(3)]
        mx.eval(pieces, cat)
        splits = list(mx.array(sizes).cumsum().tolist()[:-1])
        x = mx.random.normal((1, 1, HIDDEN), key=keys[0]).astype(mx.bfloat16)
        t_alone = _median_ms(lambda: [_matmul(x, *p) for p in pieces])
        t_fused = _median_ms(lambda: mx.split(_matmul(x, *cat), splits, axis=-1))
        print(f"| {name} | {t_alone:.3f} | {t_fused:.3f} |")
    if bad:
        print(f"\n{bad} call shape(s) the fused path takes give different bits: lower projections.MAX_ROWS")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
