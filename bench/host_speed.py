"""How fast this host builds MLX graphs right now: a reference figure recorded beside decode measurements.

A decode step on a fast GPU is bound by the host (the step's graph build and MLX's per-launch work at
evaluation), and the hosts of the GPU machine moved by up to ~1.5x between calls minutes apart
(docs/results/2026-12-03-h200-down-combine/: lily 130.4 tok/s in bursts in one call, 192.9 end to end in the
next). A decode rate from one call is comparable with another call's only together with this figure; engines
compared within one call need none.

    python -m bench.host_speed            # prints microseconds to build 1,000 MLX ops
    python -m bench.host_speed --traces   # and what one call of an ``mx.compile`` trace costs here, by the
                                          # arrays it captures (its owner's weights) and the ops it replays

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


def call_us(fn, calls: int, warmup: int = 20) -> float:
    """Microseconds per call of ``fn`` (host time: whatever it builds is not evaluated), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def trace_call_us(arrays: int, ops: int, calls: int = 2000) -> float:
    """Median-of-3 microseconds for one call of an ``mx.compile`` trace of ``ops`` element-wise ops whose
    owner module holds ``arrays`` weight arrays (``inputs=owner``, as lily's decode traces are made): MLX
    flattening the owner's weights, matching the trace and rebuilding its graph, nothing evaluated. A decoder
    layer's trace captures ~45 arrays; what a call costs beyond this grid's prediction is the trace's own."""
    import mlx.nn as nn

    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = [mx.ones((4,)) for _ in range(arrays)]

    owner = Owner()

    def fn(x):
        for i in range(ops // 2):
            x = x * 1.0001 + (owner.weights[i % arrays] if arrays else 1.0)
        return x

    traced = mx.compile(fn, inputs=owner) if arrays else mx.compile(fn)
    x = mx.ones((4,))
    mx.eval(x)
    return statistics.median(call_us(lambda: traced(x), calls) for _ in range(3))


def trace_cost_table(arrays=(0, 45, 200), ops=(2, 32, 128)) -> str:
    lines = ["| captured arrays | " + " | ".join(f"{n} ops: us/call" for n in ops) + " |",
             "|---|" + "---|" * len(ops)]
    for a in arrays:
        lines.append(f"| {a} | " + " | ".join(f"{trace_call_us(a, n):.1f}" for n in ops) + " |")
    return "\n".join(lines)


def _node_chain(kind: str):
    """(x, one node of ``kind`` applied to x) for the node-kind table, or None where this device has no such
    node (a custom kernel needs Metal or CUDA)."""
    if kind == "matmul":
        x = mx.ones((1, 64), dtype=mx.bfloat16)
        w = mx.ones((64, 64), dtype=mx.bfloat16)
        return x, lambda a: a @ w
    if kind == "reshape (view)":
        x = mx.ones((1, 64), dtype=mx.bfloat16)
        return x, lambda a: a.reshape(64, 1) if a.shape == (1, 64) else a.reshape(1, 64)
    if kind == "rms_norm":
        x = mx.ones((1, 64), dtype=mx.bfloat16)
        w = mx.ones((64,), dtype=mx.bfloat16)
        return x, lambda a: mx.fast.rms_norm(a, w, 1e-6)
    if kind == "custom kernel":
        if mx.default_device().type != mx.gpu:
            return None
        from .launch_cost import raw_kernel

        kernel = raw_kernel("")
        x = mx.ones((4,), dtype=mx.float32)
        return x, lambda a: kernel(inputs=[a], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                                   threadgroup=(32, 1, 1))[0]
    raise ValueError(kind)


def node_kind_us(kind: str, nodes: int = 16, calls: int = 1000):
    """(us per node kept, us per node dropped) for a trace of ``nodes`` nodes of one kind, no owner, the
    fixed cost of a trivial trace taken off; None where the device has no such node."""
    made = _node_chain(kind)
    if made is None:
        return None
    x, one = made

    def chain(a):
        for _ in range(nodes):
            a = one(a)
        return a

    traced, trivial = mx.compile(chain), mx.compile(lambda a: a + 1)
    mx.eval(x)
    kept = []
    base = call_us(lambda: trivial(x), calls)
    keep = call_us(lambda: kept.append(traced(x)), calls)
    kept.clear()
    drop = call_us(lambda: traced(x), calls)
    return (keep - base) / nodes, (drop - base) / nodes


def node_kind_table(kinds=("matmul", "rms_norm", "reshape (view)", "custom kernel")) -> str:
    lines = ["| node kind (16 in one trace) | us per node, outputs kept | us per node, outputs dropped |",
             "|---|---|---|"]
    for kind in kinds:
        got = node_kind_us(kind)
        lines.append(f"| {kind} | " + ("n/a | n/a" if got is None else f"{got[0]:.2f} | {got[1]:.2f}") + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.host_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--traces", action="store_true",
                        help="also time one call of an mx.compile trace by captured arrays and replayed ops")
    args = parser.parse_args(argv)
    print(f"{graph_build_us():.0f} us to build {BUILD_OPS:,} MLX ops (median of 9)")
    if args.traces:
        print(f"\none call of an mx.compile trace on {mx.default_device()}:\n")
        print(trace_cost_table())
        print(f"\nreplaying a trace's nodes, by kind (each a separate op that the trace cannot fuse):\n")
        print(node_kind_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
