"""The dense 4-bit row GEMV (op ``linear_gemv``) against MLX's quantised matmul at Qwen3.6-35B-A3B's
decode projection shapes, on the default device (``LILY_BACKEND`` picks lily's kernel backend).

    python -m bench.linear_gemv [--rows 1,4] [--reps 30] [--out DIR]

Per (projection, rows): correctness first (both against an fp64 oracle of the same dequantised weights
on the CPU: the largest error in units of the output's magnitude), then the median time of one call
over ``--reps`` timed rounds of 20 back-to-back calls each (warm-up first, fresh random inputs per
shape, the engines alternating round by round), and the weight bytes read per second (packed weights,
scales, biases). Prints a Markdown table and writes ``linear_gemv.md`` / ``.json`` under ``--out``.

GPU time per kernel (no host time in it), on an NVIDIA GPU:

    ncu --metrics gpu__time_duration.sum -k "regex:linear_gemv|qmv" --csv \
        python -m bench.linear_gemv --rows 1,4 --reps 1 > ncu.csv
    python -m bench.linear_gemv --from-ncu ncu.csv

prints, per run of consecutive launches of one kernel and grid (in the benchmark's order: per shape and
rows, stock then lily, the error check, the warm-up round, the timed round), their count and median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from lily_mlx.core.dispatch import op_backend
from lily_mlx.ops import load_all
from lily_mlx.ops.linear import kernels as lk

HIDDEN = 2048
SHAPES = {  # Qwen3.6-35B-A3B decode projections: (N outputs, K inputs)
    "deltanet in_proj (qkv+z+b+a)": (12352, HIDDEN),
    "deltanet out_proj": (HIDDEN, 4096),
    "attention q+k+v": (9216, HIDDEN),
    "attention o_proj": (HIDDEN, 4096),
    "lm_head": (248320, HIDDEN),
}
CALLS_PER_ROUND = 20


def _weights(n: int, k: int, seed: int):
    w = (mx.random.normal((n, k), key=mx.random.key(seed)) * k ** -0.5).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    mx.eval(wq, s, b)
    return wq, s, b


def _engines(wq, s, b):
    load_all()
    backend = op_backend("linear_gemv")

    def lily(x):
        return lk.gemv_q4(x, wq, s, b, 64, backend)

    def stock(x):
        return mx.quantized_matmul(x, wq, scales=s, biases=b, transpose=True, group_size=64, bits=4)

    return {"stock": stock, "lily": lily}


def _max_error(y: mx.array, x: mx.array, wq, s, b) -> float:
    w = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=4, stream=mx.cpu)
    want = np.asarray(x.astype(mx.float32), dtype=np.float64).reshape(-1, w.shape[1]) @ np.asarray(w, np.float64).T
    got = np.asarray(y.astype(mx.float32), dtype=np.float64).reshape(want.shape)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _round_us(fn, x) -> float:
    t0 = time.perf_counter()
    ys = [fn(x) for _ in range(CALLS_PER_ROUND)]
    mx.eval(ys)
    return (time.perf_counter() - t0) / CALLS_PER_ROUND * 1e6


def ncu_runs(path: str) -> list:
    """[(kernel, grid, [us, ...])] of an ``ncu --csv`` log: consecutive launches of one kernel and grid."""
    import csv
    import io

    text = Path(path).read_text()
    rows = csv.DictReader(io.StringIO(text[text.find('"ID"'):]))
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    runs = []
    for r in rows:
        if r["Metric Name"] != "gpu__time_duration.sum":
            continue
        us = float(r["Metric Value"].replace(",", "")) * scale[r["Metric Unit"]]
        key = ("lily" if "linear_gemv" in r["Kernel Name"] else "stock", r["Grid Size"])
        if runs and runs[-1][:2] == key:
            runs[-1][2].append(us)
        else:
            runs.append((*key, [us]))
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-ncu", default=None, help="summarise an ncu --csv log of this benchmark and exit")
    ap.add_argument("--rows", default="1,4", help="rows of x per call (decode batch sizes)")
    ap.add_argument("--reps", type=int, default=30, help="timed rounds per engine and shape")
    ap.add_argument("--out", default=None, help="folder for linear_gemv.md / .json")
    args = ap.parse_args(argv)
    if args.from_ncu:
        print("| kernel | grid | launches | median us |\n|---|---|---|---|")
        for engine, grid, times in ncu_runs(args.from_ncu):
            print(f"| {engine} | {grid} | {len(times)} | {statistics.median(times):.1f} |")
        return 0
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for seed, (name, (n, k)) in enumerate(SHAPES.items()):
        wq, s, b = _weights(n, k, seed)
        nbytes = wq.nbytes + s.nbytes + b.nbytes
        engines = _engines(wq, s, b)
        for rows in rows_list:
            x = mx.random.normal((rows, 1, k), key=mx.random.key(100 + seed)).astype(mx.bfloat16)
            errors = {e: _max_error(fn(x), x, wq, s, b) for e, fn in engines.items()}
            for fn in engines.values():
                _round_us(fn, x)  # warm-up: build and compile
            times = {e: [] for e in engines}
            for r in range(args.reps):
                order = list(engines) if r % 2 == 0 else list(reversed(engines))
                for e in order:
                    times[e].append(_round_us(engines[e], x))
            row = {"projection": name, "N": n, "K": k, "rows": rows, "weight_MB": nbytes / 1e6}
            for e in engines:
                us = statistics.median(times[e])
                row[e] = {"us": us, "GB_s": nbytes / us / 1e3, "max_rel_error": errors[e]}
            results.append(row)
            print(f"{name} rows={rows}: stock {row['stock']['us']:.1f} us, lily {row['lily']['us']:.1f} us", flush=True)
    lines = ["| projection | N x K | rows | weights MB | stock us | stock GB/s | lily us | lily GB/s | stock / lily | "
             "max rel error stock / lily |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        st, li = r["stock"], r["lily"]
        lines.append(f"| {r['projection']} | {r['N']} x {r['K']} | {r['rows']} | {r['weight_MB']:.1f} | {st['us']:.1f} | "
                     f"{st['GB_s']:.0f} | {li['us']:.1f} | {li['GB_s']:.0f} | {st['us'] / li['us']:.2f} | "
                     f"{st['max_rel_error']:.1e} / {li['max_rel_error']:.1e} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "linear_gemv.md").write_text(f"Dense 4-bit GEMV at decode shapes ({mx.default_device()}, "
                                            f"{CALLS_PER_ROUND} calls per round, median of {args.reps})\n\n{table}\n")
        (out / "linear_gemv.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
