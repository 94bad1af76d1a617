"""One-off device check: the fixed-block kernels over the live rows against their live-length form, with and
without spare capacity, alternating, 8 calls an evaluation (medians of 30). Prints a table."""
import statistics
import time

import mlx.core as mx

from lily_mlx.ops.attention import kernels as ak


def main():
    scales = [0.0625 * (1 + 1e-3 * i) for i in range(8)]
    print("| S | spare | fixed blocks (live rows) us | live-length form us | BR / NB live |")
    print("|---|---|---|---|---|")
    for S in (4096, 8192, 32768):
        for spare in (0, 256, 1024):
            q = mx.random.normal((1, 16, 1, 256)).astype(mx.bfloat16)
            k = mx.random.normal((1, 2, S + spare, 256)).astype(mx.bfloat16)
            v = mx.random.normal((1, 2, S + spare, 256)).astype(mx.bfloat16)
            last = mx.array([S - 1], dtype=mx.int32)
            mx.eval(q, k, v, last)
            kl, vl = k[:, :, :S], v[:, :, :S]

            def auto():
                mx.eval([ak.decode_attention_fixed_blocks(q, k, v, scale=s, kv_length=S, backend="cuda")
                         for s in scales])

            def live():
                mx.eval([ak.decode_attention_fixed_blocks_live(q, k, v, last, scale=s, backend="cuda")
                         for s in scales])

            times = {auto: [], live: []}
            for f in (auto, live):
                f(); f()
            for i in range(30):
                for f in ((auto, live) if i % 2 == 0 else (live, auto)):
                    t = time.perf_counter()
                    f()
                    times[f].append((time.perf_counter() - t) * 1e6)
            plan = ak.fixed_block_plan(S + spare, 256, 2)
            print(f"| {S} | {spare} | {statistics.median(times[auto]):.1f} | {statistics.median(times[live]):.1f} "
                  f"| {plan.block_rows} / {plan.blocks} |")
            del kl, vl


if __name__ == "__main__":
    main()
