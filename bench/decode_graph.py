"""A decode step of lily's CUDA path as a graph, on any machine (``lily_dev.graph_only``: the kernels as
placeholders): its launches by kernel, its primitives by kind (built op by op and through the layer traces),
the Python calls of a replayed step and the host's build time of it here.

    python -m bench.decode_graph                       # Qwen3.6's 40 layers at the tiny random model's widths
    python -m bench.decode_graph --layers 4 --steps 50
    python -m bench.decode_graph --kv-bits 4           # over quantized KV caches (MLX-LM's --kv-bits)
    python -m bench.decode_graph --batch-contexts 40,20,10,5  # a server's batch (MLX-LM's batch caches)

For issue 12's structure (<= 250 non-view primitives a step) without a GPU: the kinds and the count are the
GPU's (MLX's fused ``rms_norm`` and ``dequantize``, which a CPU computes from their parts, are placeholders
too, counted by their GPU names). The build time is this host's, for comparing changes in one run (the
placeholders cost less to build than the kernels they stand for); the GPU machine's is measured by
``bench.run --mode decode-profile``."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import mlx.core as mx

VOCAB = 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=40, help="decoder layers (every 4th attends; default 40)")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed for the build time (median)")
    p.add_argument("--context", type=int, default=40, help="prompt tokens before the decode steps")
    p.add_argument("--kv-bits", type=int, default=0, choices=(0, 2, 3, 4, 5, 6, 8),
                   help="quantise the attention layers' KV caches after the prompt, as MLX-LM's --kv-bits (groups of "
                        "64; 0: plain caches)")
    p.add_argument("--batch-contexts", default="",
                   help="comma-separated prompt lengths of a server's batch (rows prefilled alone, merged into MLX-LM's "
                        "batch caches as its BatchGenerator merges them; replaces --context)")
    args = p.parse_args(argv)
    batch = [int(n) for n in args.batch_contexts.split(",") if n.strip()]
    if batch and args.kv_bits:
        p.error("--batch-contexts takes plain caches (MLX-LM has no batched quantized cache)")

    import lily_mlx
    from lily_dev.graph_only import count_step, cuda_graph_only
    from lily_mlx.core import switches
    from lily_mlx.core.kernel_registry import record_launches

    from .decode_ab import batch_prefill
    from .decode_profile import VIEW_PRIMITIVES, _prefill, _step
    from .model_setup import build_random_model, model_config

    model = build_random_model(model_config("tiny", args.layers), seed=0, log=None)
    with cuda_graph_only():
        lily_mlx.patch(model)
        y, cache = batch_prefill(model, batch, VOCAB, 0) if batch else _prefill(model, args.context, VOCAB, 0)
        if args.kv_bits:
            from mlx_lm.generate import maybe_quantize_kv_cache

            maybe_quantize_kv_cache(cache, 0, 64, args.kv_bits)
        for _ in range(3):
            y = _step(model, y, cache)
            mx.eval(y)
        with switches.overrides(disable=["compiled_decode"]), record_launches() as launches:
            nxt = _step(model, y, cache)
        built = count_step(nxt)
        mx.eval(nxt)
        traced = count_step(_step(model, nxt, cache))
        y = nxt = _step(model, nxt, cache)  # (the graph counted above is dropped unevaluated)
        mx.eval(y)
        profile = cProfile.Profile()
        profile.enable()
        y = _step(model, y, cache)
        profile.disable()
        mx.eval(y)
        builds = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            nxt = _step(model, y, cache)
            builds.append(time.perf_counter() - t0)
            mx.eval(nxt)
            y = nxt

    kv = (f", {args.kv_bits}-bit KV caches" if args.kv_bits else "") + (
        f", a batch of {len(batch)} rows at contexts {', '.join(map(str, batch))}" if batch else "")
    print(f"decode step of {args.layers} layers (lily's CUDA path, kernels as placeholders{kv})")
    print("\n| kernel | launches a step |\n|---|---|")
    for name, n in sorted(launches.counts().items(), key=lambda t: -t[1]):
        print(f"| {name} | {n} |")
    print("\n| primitive | built | traced |\n|---|---|---|")
    kinds = sorted(set(built) | set(traced), key=lambda k: (k in VIEW_PRIMITIVES, -built.get(k, 0)))
    for kind in kinds:
        view = " (view)" if kind in VIEW_PRIMITIVES else ""
        print(f"| {kind}{view} | {built.get(kind, 0)} | {traced.get(kind, 0)} |")
    non_view = lambda c: sum(n for k, n in c.items() if k not in VIEW_PRIMITIVES)  # noqa: E731
    print(f"| non-view, in all | {non_view(built)} | {non_view(traced)} |")
    print(f"\nPython calls of a replayed step: {pstats.Stats(profile).total_calls}")
    print(f"graph build on this host: {statistics.median(builds) * 1e3:.3f} ms a step (median of {args.steps})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
