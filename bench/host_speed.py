"""How fast this host builds MLX graphs right now: a reference figure recorded beside decode measurements.

A decode step on a fast GPU is bound by the host (the step's graph build and MLX's per-launch work at
evaluation), and the hosts of the GPU machine moved by up to ~1.5x between calls minutes apart
(docs/results/2026-12-03-h200-down-combine/: lily 130.4 tok/s in bursts in one call, 192.9 end to end in the
next). A decode rate from one call is comparable with another call's only together with this figure; engines
compared within one call need none.

    python -m bench.host_speed            # prints microseconds to build 1,000 MLX ops

``bench.run`` records it in every results file's ``environment`` and ``bench.decode_ab`` at the start and the
end of its run.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

BUILD_OPS = 1000  # element-wise ops per timed chain


def graph_build_us(ops: int = BUILD_OPS, repeats: int = 9) -> float:
    """Median microseconds to build (not evaluate) a chain of ``ops`` element-wise ops on a [1, 1, 2048] bf16
    array, scaled to 1,000 ops: the Python and MLX work a decode step's build is made of."""
    x = mx.zeros((1, 1, 2048), dtype=mx.bfloat16)
    mx.eval(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = x
        for i in range(ops):
            y = y * 1.5 if i % 2 else y + 1.0
        times.append(time.perf_counter() - t0)
        del y  # never evaluated
    return statistics.median(times) * 1e6 * 1000 / ops


def main() -> int:
    print(f"{graph_build_us():.0f} us to build {BUILD_OPS:,} MLX ops (median of 9)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
