"""Host cost of building one kernel launch into the graph (no evaluation), per kind of launch.

    LILY_BACKEND=cuda python -m bench.launch_cost [--calls 20000]

A decode step is built in Python before the GPU runs it, so a launch's host cost counts as much as
its GPU time. This times, per call (median of 5 repeats of ``--calls`` calls, nothing evaluated):

- ``mx.add`` of two small arrays (an MLX built-in op);
- ``mx.quantized_matmul`` of one row (what stock runs for a decode projection);
- ``mx.fast.cuda_kernel`` (or ``metal_kernel``) with a one-line body and no header, and the same
  with a header the size of the bridge's CUDA prelude (does the per-call source assembly matter?);
- lily's combine kernel through the registry (the bridge's Python layer included).

Then the same launches' cost at *evaluation* (``--eval-launches`` launches built, one ``mx.eval``, per
launch): MLX's custom-kernel primitive hashes its whole source (header included) every time it is
evaluated, on Metal and CUDA alike, so a large header costs at every launch, not only when built.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def raw_kernel(header: str):
    body = "unsigned int i = threadIdx.x; if (i < 4) out[i] = inp[i];"
    if hasattr(mx.fast, "cuda_kernel") and mx.cuda.is_available():
        return mx.fast.cuda_kernel(name="lily_launch_cost", input_names=["inp"], output_names=["out"], source=body,
                                   header=header)
    body = "uint i = thread_position_in_grid.x; if (i < 4) out[i] = inp[i];"
    return mx.fast.metal_kernel(name="lily_launch_cost", input_names=["inp"], output_names=["out"], source=body,
                                header=header)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.launch_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--eval-launches", type=int, default=400)
    args = p.parse_args(argv)

    from lily_mlx.core.kernel_registry import get_kernel
    from lily_mlx.msl.cuda.kernel import prelude
    from lily_mlx.ops.moe import kernels as mk

    a = mx.ones((4,), mx.float32)
    x = mx.ones((1, 2048), mx.bfloat16)
    w, s, b = mx.quantize(mx.ones((512, 2048), mx.bfloat16), group_size=64, bits=4)
    mx.eval(a, x, w, s, b)
    padding = "// " + "x" * 96 + "\n"
    big_header = padding * (len(prelude()) // len(padding))
    small, big = raw_kernel(""), raw_kernel(big_header)

    def launch(kernel):
        return lambda: kernel(inputs=[a], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                              threadgroup=(32, 1, 1))

    y = mx.ones((8 + 1, 2048), mx.bfloat16)
    slots = mx.arange(8, dtype=mx.int32)
    scores = mx.ones((1, 8), mx.bfloat16)
    gate = mx.ones((1,), mx.float32)
    mx.eval(y, slots, scores, gate)
    rows = [
        ("mx.add (built-in op)", lambda: mx.add(a, a)),
        ("mx.quantized_matmul, 1 x 2048 -> 512, 4-bit", lambda: mx.quantized_matmul(x, w, s, b, True, 64, 4)),
        ("raw custom kernel, no header", launch(small)),
        (f"raw custom kernel, {len(big_header) // 1000} KB header", launch(big)),
        ("lily combine kernel (registry + bridge)",
         lambda: mk.combine_rows(y, slots, scores, gate=gate)),
    ]
    # A whole MoE block of a decode step (Qwen3.6 widths, fewer experts: the launches are the same),
    # built launch by launch vs replayed from its trace (switch compiled_decode).
    from lily_dev.moe_testing import make_sparse_moe_block
    from lily_mlx.core import switches
    from lily_mlx.ops.moe import sparse_moe_forward

    block = make_sparse_moe_block(hidden=2048, expert_width=512, num_experts=32, top_k=8, shared_width=512)
    token = mx.ones((1, 1, 2048), mx.bfloat16)
    mx.eval(block.parameters(), token)

    def moe_block(compiled: bool):
        def run():
            with switches.overrides(disable=[] if compiled else ["compiled_decode"]):
                return sparse_moe_forward(block, token)
        return run

    rows += [("MoE decode block, launches built (4 kernels)", moe_block(False)),
             ("MoE decode block, replayed from its trace", moe_block(True))]
    kernel = get_kernel(mk.KERNELS["combine"])
    print(f"backend: {getattr(kernel, 'backend', '?')}; {args.calls} calls x 5 repeats, median us per call "
          "(graph build only, nothing evaluated)")
    print("| launch | host us per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {per_call_us(fn, args.calls):.2f} |")
    print(f"\nEvaluation: {args.eval_launches} launches built, then one mx.eval; median of 5, us per launch "
          "(build excluded)")
    print("| launch | eval us per launch |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {per_launch_eval_us(fn, args.eval_launches):.2f} |")
    return 0


def per_launch_eval_us(fn, launches: int, repeats: int = 5) -> float:
    """Host + device time of evaluating ``launches`` independent launches of ``fn`` at once, per launch."""
    mx.eval([fn() for _ in range(8)])
    times = []
    for _ in range(repeats):
        outs = [fn() for _ in range(launches)]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        times.append((time.perf_counter() - t0) / launches * 1e6)
    return statistics.median(times)


if __name__ == "__main__":
    raise SystemExit(main())
