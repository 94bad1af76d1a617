"""Where the host time of a decode step's graph build goes: Python's profiler over the build alone.

    python -m bench.build_profile --engine lily --context 4096 --steps 16 [--size full] [--top 30]

Prefills ``--context`` tokens, decodes a few warm-up steps (traces and kernels compiled), then builds
``--steps`` decode steps under ``cProfile`` with each step's evaluation outside the profiled region, and
prints the functions by their own time and by cumulative time, per step. ``--mode decode-profile``
gives the build's total; this says which Python functions make it up (the kernels' launch wrappers,
the patched layers, MLX-LM's own code), so that host work can be moved to patch time or into traces.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats


def profile_build(model, engine: str, context: int, steps: int, warmup: int = 4, top: int = 30) -> str:
    """Markdown-ish text: the top functions of ``steps`` decode-step builds by tottime and cumtime."""
    import mlx.core as mx

    from bench.decode_profile import _prefill, _step
    from bench.e2e import Engines, switches_off, validate_engine
    from lily_mlx.core import switches

    validate_engine(engine)
    engines = Engines(model)
    engines.use(engine)
    vocab = model.args.text_config["vocab_size"]
    profiler = cProfile.Profile()
    try:
        with switches.overrides(disable=switches_off(engine)):
            y, cache = _prefill(model, context, vocab, seed=0)
            for _ in range(warmup):
                y = _step(model, y, cache)
                mx.eval(y)
            for _ in range(steps):
                profiler.enable()
                y = _step(model, y, cache)
                profiler.disable()
                mx.eval(y)
    finally:
        engines.use("stock")
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    total = stats.total_tt
    out.write(f"build of {steps} decode steps at context {context}, engine {engine}: "
              f"{1e3 * total / steps:.2f} ms per step under cProfile (profiling adds its own cost)\n\n")
    for key in ("tottime", "cumulative"):
        out.write(f"--- by {key} ---\n")
        stats.sort_stats(key).print_stats(top)
    return out.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="lily", help="stock, stock-kernels, lily or lily-off:<switch>[+<switch>]")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16, help="profiled decode-step builds")
    ap.add_argument("--warmup", type=int, default=4, help="decode steps before profiling")
    ap.add_argument("--size", default="full", help="random model size (bench.model_setup), or --model")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of a random model")
    ap.add_argument("--top", type=int, default=30, help="functions listed per ordering")
    args = ap.parse_args(argv)
    from bench.model_setup import load_model

    model, description = load_model(args.model, args.size)
    print(f"[build-profile] {description}; engine {args.engine}, context {args.context}", flush=True)
    print(profile_build(model, args.engine, args.context, args.steps, args.warmup, args.top), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
