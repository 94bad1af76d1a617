"""The MoE grouped GEMMs' tile forms side by side, at Qwen3.6's shapes (256 experts, top-8, hidden 2048,
expert width 512, skewed routing, bf16): simdgroup tiles, register tiles, register tiles with down at 64
columns a threadgroup (TN = 4, the default) and at 128 (TN = 8), the register tiles over 64 threads (8 rows a
thread in 32-row tiles) and over 256 threads on a block map with 64-row tiles for experts of >= 64 rows, and the
64-thread gate/up with the loops over its staged weight columns rolled (local memory under ptxas: the form before
2026-12-04), and the 64-thread gate/up with the K-split candidate's arithmetic (2 and 4 ranges; the last four are
not product paths). Times each on this backend (medians of evaluated calls)
and prints a Markdown table of microseconds and TFLOP/s; ``--once`` runs each register-tile GEMM once
(a target for a profiler such as ``ncu -k regex:regtile``).

    python -m bench.gemm_tiles --variants [--tokens 512,2048,8192] [--out variants.md]
    ncu --set full -k regex:regtile -c 4 python -m bench.gemm_tiles --tokens 2048 --once
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable, Dict, List

import mlx.core as mx
import numpy as np

from lily_dev.moe_bench import EXPERT_WIDTH, HIDDEN, NUM_EXPERTS, TOP_K, _SwitchGLU
from lily_dev.moe_testing import make_routing, regtile_down_columns
from lily_mlx.core.dispatch import op_backend
from lily_mlx.ops.moe import kernels as mk


def median_us(fn: Callable[[], mx.array], rounds: int = 15) -> float:
    """Median microseconds of ``rounds`` evaluated calls of ``fn``, after two warm-up calls."""
    mx.eval(fn())
    mx.eval(fn())
    times = []
    for _ in range(rounds):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e6


def cases(tokens: int, sw, backend: str) -> Dict[str, tuple]:
    inds = mx.array(make_routing("skewed", tokens, TOP_K, NUM_EXPERTS, seed=tokens).astype(np.uint32))
    x = mx.random.normal((tokens, HIDDEN), key=mx.random.key(tokens)).astype(mx.bfloat16)
    h = mx.random.normal((tokens * TOP_K, EXPERT_WIDTH), key=mx.random.key(1)).astype(mx.bfloat16)
    s = mk.routing_schedule(inds, NUM_EXPERTS, True, True, backend)
    mx.eval(x, h, *s.values())
    # The same routing with 64-row tiles for experts of >= 64 rows (only the 256-thread register tiles take them).
    huge = mx.array(mk.host_block_map(np.asarray(s["counts"]), True, huge_min_rows=mk.HUGE_TILE))
    a = tokens * TOP_K
    up_flops, down_flops = 4 * a * HIDDEN * EXPERT_WIDTH, 2 * a * EXPERT_WIDTH * HIDDEN

    def up(tiles, blocks=s["blocks"], split=1):
        return lambda: mk.gemm_gate_up_swiglu(x, s["sorted_rows"], blocks, sw.gate_proj, sw.up_proj, TOP_K, True,
                                              s["counts"], backend, tiles=tiles, k_split=split)

    def down(tiles, blocks=s["blocks"]):
        return lambda: mk.gemm_down(h, blocks, sw.down_proj, True, s["counts"], backend, tiles=tiles)

    return {"gate_up simdgroup": (up("simdgroup"), up_flops, None),
            "gate_up register": (up("register"), up_flops, None),
            "gate_up register, 64 threads": (up("register64"), up_flops, None),
            "gate_up register, 64 threads, staged columns in local memory": (up("register64_rolled"), up_flops, None),
            "gate_up register, 256 threads, 64-row tiles": (up("register256", huge), up_flops, None),
            # the K-split candidate's arithmetic (docs/moe.md): what prefill would pay for the split GEMV's bits
            "gate_up register, 64 threads, K split 2": (up("register64", split=2), up_flops, None),
            "gate_up register, 64 threads, K split 4": (up("register64", split=4), up_flops, None),
            "down simdgroup": (down("simdgroup"), down_flops, None),
            "down register, 64 columns (TN 4)": (down("register"), down_flops, (64,)),
            "down register, 128 columns (TN 8)": (down("register"), down_flops, (128, 64)),
            "down register, 64 threads": (down("register64"), down_flops, (64,)),
            "down register, 256 threads, 64-row tiles": (down("register256", huge), down_flops, (64,))}


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gemm_tiles", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--variants", action="store_true", help="time every variant and print the table")
    ap.add_argument("--once", action="store_true", help="run each register-tile GEMM once (for a profiler)")
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    backend = op_backend("moe_grouped_gemm")
    sw = _SwitchGLU()
    token_counts = [int(t) for t in args.tokens.split(",")]
    if args.once:
        for tokens in token_counts:
            c = cases(tokens, sw, backend)
            for name in ("gate_up register", "down register, 64 columns (TN 4)",
                         "gate_up register, 64 threads", "down register, 64 threads"):
                mx.eval(c[name][0]())
        return 0
    lines = [f"MoE GEMM tile forms, backend {backend}, {mx.default_device()}: us (TFLOP/s), medians of 15 calls", "",
             "| GEMM | " + " | ".join(f"{t} tok" for t in token_counts) + " |",
             "|---|" + "---|" * len(token_counts)]
    rows: Dict[str, List[str]] = {}
    for tokens in token_counts:
        for name, (fn, flops, columns) in cases(tokens, sw, backend).items():
            with regtile_down_columns(columns) if columns else contextlib.nullcontext():
                us = median_us(fn)
            rows.setdefault(name, []).append(f"{us:,.0f} ({flops / us / 1e6:.1f})")
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows.items()]
    print_table(lines, args.out)
    return 0


def print_table(lines: List[str], out: str = None) -> None:
    """Print a Markdown table's lines, and write them to ``out`` too when given."""
    table = "\n".join(lines)
    print(table)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
