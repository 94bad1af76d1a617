"""lily-mlx benchmark harness, one entry point for every backend (Metal on a Mac, CUDA on NVIDIA).

    python -m bench.run --mode e2e --max-length 16K --rounds 3 --out results/
    python -m bench.run --mode kernels --out results/
    python -m bench.run --mode bridge --out results/        # Metal->CUDA bridge checks (CUDA/sim)
    python -m bench.run --mode decode-profile --context 4096 --out results/   # host cost per decode step

Modes (comma-separated): ``e2e`` (stock MLX-LM vs lily-mlx sweep), ``kernels`` (each lily kernel alone
at the model's shapes vs the device's copy/matmul ceilings), ``bridge`` (bridge feature checks and
MLX-LM's GDN kernels through the bridge), ``decode-profile`` (graph-build and evaluation time,
primitives and pipelined tok/s of one decode step, per engine). The model is a checkpoint (``--model PATH``) or
Qwen3.6-35B-A3B's architecture with random 4-bit weights built in process (``--size full``; ``tiny``
for a quick run anywhere). Results: ``results.json`` plus Markdown tables and a PNG plot in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx

from . import e2e


def log(msg: str) -> None:
    print(msg, flush=True)


def environment() -> dict:
    import mlx_lm

    import lily_mlx
    from lily_mlx.core.backend import resolve_backend

    info = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "lily_mlx": lily_mlx.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "default_device": str(mx.default_device()), "lily_backend": resolve_backend(),
            "command": " ".join(["python -m bench.run"] + sys.argv[1:])}
    try:
        info["device"] = {k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in mx.device_info().items()}
    except Exception as e:  # older MLX or no GPU
        info["device"] = {"error": str(e)}
    return info


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="e2e", help="comma-separated: e2e, kernels, bridge, decode-profile")
    p.add_argument("--model", default=None, help="checkpoint path or repo (default: random weights in process)")
    p.add_argument("--size", default="full", choices=("full", "tiny"), help="random model size")
    p.add_argument("--num-layers", type=int, default=None, help="random model: fewer layers (quick runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", default=None, help="explicit lengths, e.g. 256,1K,4K (default: the ten of the write-up)")
    p.add_argument("--max-length", default="128K", help="limit the sweep to lengths <= this (e.g. 16K)")
    p.add_argument("--min-length", default="0", help="limit the sweep to lengths >= this")
    p.add_argument("--prefill-only", action="store_true", help="no decode tokens (prefill sweep only)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per length (engines alternate order each round)")
    p.add_argument("--long-from", default="16K", help="lengths >= this run --long-rounds rounds")
    p.add_argument("--long-rounds", type=int, default=None, help="rounds for long lengths (default: --rounds)")
    p.add_argument("--gen-tokens", type=int, default=64, help="tokens generated after the first (decode timing)")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--engines", default="stock,lily",
                   help="comma-separated: stock, stock-kernels (stock running MLX-LM's own Gated DeltaNet "
                        "kernels on this backend, as on a Mac: the fair baseline), lily, "
                        "lily-off:<switch>[+<switch>] (lily with switches off); "
                        "any of them + '@eval-per-layer' evaluates after every layer of a prefill chunk "
                        "(a peak-memory diagnostic)")
    p.add_argument("--warmup-length", type=int, default=256, help="one untimed run per engine first")
    p.add_argument("--kernel-prefill-tokens", type=int, default=2048)
    p.add_argument("--op-cases", default="auto", choices=("auto", "on", "off"),
                   help="kernels mode: also time the op modules' own microbench cases (auto: on a GPU)")
    p.add_argument("--context", type=int, default=4096, help="decode-profile: context length before decoding")
    p.add_argument("--profile-steps", type=int, default=16, help="decode-profile: timed decode steps per round")
    p.add_argument("--shared-prefill", action="store_true",
                   help="decode-profile: prefill the context once per round (with lily) and decode every engine "
                        "from a copy of that cache (long contexts: stock's CUDA prefill takes minutes)")
    p.add_argument("--host-profile", default=None, metavar="ENGINE",
                   help="decode-profile: also cProfile ENGINE's graph building (host_profile_<ENGINE>.txt)")
    p.add_argument("--out", default=None, help="directory for results.json, tables and plot")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    # A tune profile on this machine would change what the "lily" engines run: benchmarks measure
    # lily's defaults unless LILY_TUNE is set explicitly.
    os.environ.setdefault("LILY_TUNE", "off")
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    results = {"environment": environment(), "args": vars(args)}
    log(f"[bench] {json.dumps(results['environment'])}")

    def save():
        if out_dir:
            (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))

    if "bridge" in modes:
        from . import bridge_checks
        from lily_mlx.core.kernel_registry import metal_kernel_factory

        backend = results["environment"]["lily_backend"]
        if backend not in ("cuda", "sim", "metal"):
            log(f"[bridge] skipped: backend {backend!r} runs no kernels")
        else:
            checks, arrays = bridge_checks.run_all(metal_kernel_factory(backend), log=log)
            results["bridge"] = {"backend": backend, "checks": checks}
            if out_dir:
                import numpy as np

                np.savez_compressed(out_dir / f"bridge_outputs_{backend}.npz", **arrays)
            save()

    model = None
    if {"e2e", "kernels", "decode-profile"} & set(modes):
        model, desc = __import__("bench.model_setup", fromlist=["load_model"]).load_model(
            args.model, args.size, args.seed, args.num_layers, log=log)
        results["model"] = desc
        vocab = model.args.text_config["vocab_size"] if hasattr(model, "args") and hasattr(model.args, "text_config") else 32000

    if "kernels" in modes:
        from . import kernels

        ceil = kernels.ceilings(log=log)
        calls = kernels.record_kernel_calls(model, args.kernel_prefill_tokens, vocab, log=log)
        rows = kernels.microbench(calls, ceil, log=log)
        results["kernels"] = {"ceilings": ceil, "rows": rows, "prefill_tokens": args.kernel_prefill_tokens}
        text = kernels.table_markdown(rows, ceil) + "\n"
        if args.op_cases == "on" or (args.op_cases == "auto" and mx.default_device() == mx.gpu):
            results["kernels"]["op_cases"] = cases = kernels.op_cases(ceil=ceil, log=log)
            text += "\nOp microbenchmarks (lily_dev.<family>_bench.microbench_cases):\n\n" + kernels.op_cases_markdown(cases) + "\n"
        if out_dir:
            (out_dir / "kernels.md").write_text(text)
        save()

    if "decode-profile" in modes:
        from . import decode_profile

        engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
        profile = decode_profile.run(model, args.context, engines, args.rounds, args.profile_steps, vocab,
                                     seed=args.seed, log=log, shared_prefill=args.shared_prefill)
        results["decode_profile"] = profile
        log(decode_profile.table_markdown(profile))
        if out_dir:
            (out_dir / "decode_profile.json").write_text(json.dumps(
                {"environment": results["environment"], "model": results["model"], **profile}, indent=1))
            (out_dir / "decode_profile.md").write_text(decode_profile.table_markdown(profile) + "\n")
        if args.host_profile:
            text = decode_profile.host_profile(model, args.host_profile, args.context, args.profile_steps, vocab)
            log(text)
            if out_dir:
                (out_dir / f"host_profile_{args.host_profile}.txt").write_text(text)
        save()

    if "e2e" in modes:
        lo, hi = e2e.parse_lengths(args.min_length)[0], e2e.parse_lengths(args.max_length)[0]
        lengths = e2e.parse_lengths(args.lengths) if args.lengths else list(e2e.SWEEP_LENGTHS)
        lengths = [n for n in lengths if lo <= n <= hi]
        decode = [] if args.prefill_only else lengths
        engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
        for engine in engines:
            e2e.validate_engine(engine)  # before minutes of model building and warm-up
        log(f"[e2e] lengths {[e2e.length_label(n) for n in lengths]}, {args.rounds} rounds, engines {engines}, "
            f"{args.gen_tokens} decode tokens")
        t0 = time.perf_counter()
        if args.warmup_length:
            e2e.sweep(model, [args.warmup_length], [], [args.warmup_length], 1, 4, args.prefill_step_size,
                      engines, vocab, seed=args.seed + 999, log=lambda m: log("[warmup] " + m))
        long_from = e2e.parse_lengths(args.long_from)[0]
        long_rounds = args.long_rounds or args.rounds

        def partial(rows_so_far):
            results["e2e"] = {"rows": rows_so_far, "seconds": time.perf_counter() - t0, "complete": False}
            save()

        rows = e2e.sweep(model, lengths, lengths, decode, args.rounds, args.gen_tokens,
                         args.prefill_step_size, engines, vocab, seed=args.seed, log=log,
                         rounds_for=lambda n: long_rounds if n >= long_from else args.rounds, on_row=partial)
        results["e2e"] = {"rows": rows, "seconds": time.perf_counter() - t0, "complete": True}
        table = e2e.table_markdown(rows)
        ablations = e2e.ablation_markdown(rows)
        if ablations:
            table += "\n\nSwitch ablations (lily with the switch on / off):\n\n" + ablations
        log(table)
        if out_dir:
            (out_dir / "e2e.md").write_text(table + "\n")
            env = results["environment"]
            title = (f"{results['model']} | {env['device'].get('device_name', env['default_device'])} | "
                     f"mlx {env['mlx']}, mlx-lm {env['mlx_lm']}, lily backend {env['lily_backend']}")
            e2e.plot(rows, str(out_dir / "e2e.png"), title)
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
