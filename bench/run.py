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

The e2e sweep resumes: ``results.json`` is written after every length, and a run with the same
``--out`` and the same sweep (engines, lengths, rounds, ...) keeps the lengths already there and runs
the rest; a different sweep in that folder is refused (``--fresh`` starts over). ``--stop-at`` (wall
clock, ``date +%s``) ends a call before a length that would not finish in time (``bench/estimate.py``),
so a device call's time limit never cuts a length in half; ``--plan`` prints what would run, with
estimated seconds, and runs nothing.
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
from typing import Dict, List, Optional

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
    from .host_speed import graph_build_us

    info["host_build_us_per_1000_ops"] = round(graph_build_us(), 1)  # this host's speed now (bench.host_speed)
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
                        "lily-trial:<op>[+<op>] (lily with trial kernels on); "
                        "any of them + '@eval-per-layer' evaluates after every layer of a prefill chunk "
                        "(a peak-memory diagnostic), + '@chunk-N' prefills in chunks of N tokens instead of "
                        "--prefill-step-size (e.g. lily,lily@chunk-4096: two chunk sizes alternating in one process)")
    p.add_argument("--warmup-length", type=int, default=256, help="one untimed run per engine first")
    p.add_argument("--kernel-prefill-tokens", type=int, default=2048)
    p.add_argument("--op-cases", default="auto", choices=("auto", "on", "off"),
                   help="kernels mode: also time the op modules' own microbench cases (auto: on a GPU)")
    p.add_argument("--op-match", default=None, metavar="REGEX",
                   help="kernels mode: only the op cases whose name this regular expression finds")
    p.add_argument("--context", type=int, default=4096, help="decode-profile: context length before decoding")
    p.add_argument("--profile-steps", type=int, default=16, help="decode-profile: timed decode steps per round")
    p.add_argument("--shared-prefill", action="store_true",
                   help="prefill the context once per round (with lily) and decode every engine from a copy of that "
                        "cache (long contexts: stock's CUDA prefill takes minutes). decode-profile and e2e; in e2e each "
                        "engine's prompt tok/s is still its own prefill, up to --max-prefill-length")
    p.add_argument("--max-prefill-length", default=None, metavar="ENGINE=LEN[,...]",
                   help="e2e: the longest prompt an engine prefills itself, e.g. stock=16K (beyond it the table says "
                        "n/m; with --shared-prefill the engine still decodes there, from the shared cache)")
    p.add_argument("--stop-at", type=float, default=None, metavar="EPOCH_S",
                   help="e2e: start no length that would end after this wall-clock time (seconds since the epoch, "
                        "`date +%%s`); the next run with the same --out continues")
    p.add_argument("--fresh", action="store_true", help="e2e: ignore the sweep already in --out (start over)")
    p.add_argument("--plan", action="store_true",
                   help="e2e: print the lengths still to run with estimated H200 seconds (bench/estimate.py), run nothing")
    p.add_argument("--plan-call-seconds", type=float, default=480.0,
                   help="--plan: split the remaining lengths into device calls of at most this many seconds")
    p.add_argument("--host-profile", default=None, metavar="ENGINE",
                   help="decode-profile: also cProfile ENGINE's graph building (host_profile_<ENGINE>.txt)")
    p.add_argument("--out", default=None, help="directory for results.json, tables and plot")
    return p


class SweepMismatch(SystemExit):
    pass


def e2e_setup(args) -> Dict:
    """The sweep this command asks for: lengths, engines, rounds per length and what identifies it
    (``config``: a resumed sweep must match it)."""
    lo, hi = e2e.parse_lengths(args.min_length)[0], e2e.parse_lengths(args.max_length)[0]
    lengths = e2e.parse_lengths(args.lengths) if args.lengths else list(e2e.SWEEP_LENGTHS)
    lengths = [n for n in lengths if lo <= n <= hi]
    decode = [] if args.prefill_only else lengths
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    for engine in engines:
        e2e.validate_engine(engine)  # before minutes of model building and warm-up
    max_prefill = e2e.parse_max_prefill(args.max_prefill_length)
    unknown = sorted(set(max_prefill) - set(engines))
    if unknown:
        raise SystemExit(f"--max-prefill-length names engines not in --engines: {', '.join(unknown)}")
    long_from = e2e.parse_lengths(args.long_from)[0]
    long_rounds = args.long_rounds or args.rounds
    rounds = {e2e.length_label(n): (long_rounds if n >= long_from else args.rounds) for n in lengths}
    model = args.model or f"random {args.size}" + (f", {args.num_layers} layers" if args.num_layers else "")
    config = {"engines": list(engines), "lengths": [e2e.length_label(n) for n in lengths],
              "decode_lengths": [e2e.length_label(n) for n in decode], "rounds": rounds,
              "gen_tokens": args.gen_tokens, "prefill_step_size": args.prefill_step_size,
              "shared_prefill": bool(args.shared_prefill),
              "max_prefill": {e: e2e.length_label(n) for e, n in max_prefill.items()},
              "model": model, "seed": args.seed, "lily_backend": _backend(args)}
    return {"lengths": lengths, "decode": decode, "engines": engines, "max_prefill": max_prefill,
            "rounds": rounds, "config": config}


def _backend(args) -> str:
    from lily_mlx.core.backend import resolve_backend

    try:
        return resolve_backend()
    except RuntimeError:  # --plan for another machine (LILY_BACKEND=cuda on a CPU): the name asked for
        if args.plan:
            return os.environ["LILY_BACKEND"].strip().lower()
        raise


def resume_rows(previous: Optional[dict], config: dict, out_dir: Path) -> List[dict]:
    """The rows of an earlier run of this sweep in ``out_dir`` (none if there was none); refuses a
    different sweep, naming what differs."""
    sweep = (previous or {}).get("e2e")
    if not sweep:
        return []
    old = sweep.get("config")
    if old is None:
        raise SweepMismatch(f"{out_dir / 'results.json'} holds a sweep without a recorded configuration (made "
                            "before the sweep could resume): use another --out, or --fresh to overwrite it")
    diff = [f"  {k}: results.json has {old.get(k)!r}, this command {config.get(k)!r}"
            for k in sorted(set(old) | set(config)) if old.get(k) != config.get(k)]
    if diff:
        raise SweepMismatch(f"{out_dir / 'results.json'} holds another sweep; to continue it, repeat its command "
                            "(same engines, lengths, rounds, ...). Differences:\n" + "\n".join(diff) +
                            "\nOr use another --out, or --fresh to start over in this one.")
    wanted = set(config["lengths"])
    return [r for r in sweep.get("rows", []) if r["label"] in wanted]


def e2e_row_estimate(setup: Dict, args, length: int) -> float:
    from . import estimate

    return estimate.e2e_row_s(length, setup["engines"], setup["rounds"][e2e.length_label(length)],
                              args.gen_tokens, True, length in setup["decode"], args.shared_prefill,
                              setup["max_prefill"])


def print_plan(setup: Dict, args, done: List[dict]) -> None:
    from . import estimate

    done_labels = {r["label"] for r in done}
    items = []
    log(f"[plan] e2e sweep, engines {', '.join(setup['engines'])}"
        + (", shared prefill" if args.shared_prefill else "")
        + (f", prefill limits {setup['config']['max_prefill']}" if setup["max_prefill"] else "")
        + "; estimates from the H200 figures in bench/estimate.py")
    for n in setup["lengths"]:
        label = e2e.length_label(n)
        seconds = e2e_row_estimate(setup, args, n)
        own = [e for e in setup["engines"] if n <= setup["max_prefill"].get(e, n)]
        status = "done" if label in done_labels else f"~{seconds:.0f} s"
        log(f"[plan] {label:>5}: {setup['rounds'][label]} round(s), prefill by {', '.join(own)}; {status}")
        if label not in done_labels:
            items.append((label, seconds))
    overhead = estimate.FIRST_COMPILE_S + estimate.MODEL_BUILD_S
    total = sum(sec for _, sec in items)
    log(f"[plan] left: {len(items)} of {len(setup['lengths'])} lengths, ~{total:.0f} s of runs "
        f"+ ~{overhead:.0f} s per call (first-time compiles, model build, warm-up)")
    for i, (call, seconds) in enumerate(estimate.pack_calls(items, args.plan_call_seconds, overhead), 1):
        log(f"[plan] call {i}: {', '.join(name for name, _ in call)} ~{seconds:.0f} s")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    # A tune profile on this machine would change what the "lily" engines run: benchmarks measure
    # lily's defaults unless LILY_TUNE is set explicitly.
    os.environ.setdefault("LILY_TUNE", "off")
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    out_dir = Path(args.out) if args.out else None
    previous = None
    if out_dir and (out_dir / "results.json").exists() and not args.fresh:
        previous = json.loads((out_dir / "results.json").read_text())
    setup, done = None, []
    if "e2e" in modes:
        setup = e2e_setup(args)
        if out_dir:
            done = resume_rows(previous, setup["config"], out_dir)
        if args.plan:
            print_plan(setup, args, done)
            return 0
    elif args.plan:
        raise SystemExit("--plan plans the e2e sweep: add --mode e2e")
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    results = {"environment": environment(), "args": vars(args)}
    if previous:  # keep what the folder holds (a resumed sweep's rows; other modes' results)
        results = {**previous, **results}
    log(f"[bench] {json.dumps(results['environment'])}")

    def save():
        if out_dir:  # whole or not at all: a process killed while writing leaves the last complete file
            tmp = out_dir / "results.json.tmp"
            tmp.write_text(json.dumps(results, indent=1, default=str))
            os.replace(tmp, out_dir / "results.json")

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

    remaining = []
    if setup is not None:
        done_labels = {r["label"] for r in done}
        remaining = [n for n in setup["lengths"] if e2e.length_label(n) not in done_labels]
    model = None
    if {"kernels", "decode-profile"} & set(modes) or remaining:
        model, desc = __import__("bench.model_setup", fromlist=["load_model"]).load_model(
            args.model, args.size, args.seed, args.num_layers, log=log)
        results["model"] = desc
        vocab = model.args.text_config["vocab_size"] if hasattr(model, "args") and hasattr(model.args, "text_config") else 32000

    if "kernels" in modes:
        from . import kernels

        ceil = kernels.ceilings(log=log)
        calls = kernels.record_kernel_calls(model, args.kernel_prefill_tokens, vocab, log=log)
        text_config = getattr(getattr(model, "args", None), "text_config", None) or {}
        rows = kernels.microbench(calls, ceil, log=log, top_k=text_config.get("num_experts_per_tok"))
        results["kernels"] = {"ceilings": ceil, "rows": rows, "prefill_tokens": args.kernel_prefill_tokens}
        text = kernels.table_markdown(rows, ceil) + "\n"
        if args.op_cases == "on" or (args.op_cases == "auto" and mx.default_device() == mx.gpu):
            results["kernels"]["op_cases"] = cases = kernels.op_cases(ceil=ceil, log=log, match=args.op_match)
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

    if setup is not None:
        run_sweep(args, setup, done, remaining, model, vocab if model is not None else None, results, save, out_dir)
    save()
    return 0


def run_sweep(args, setup, done, remaining, model, vocab, results, save, out_dir) -> None:
    """The e2e sweep's lengths not in ``done``, saving after each; then the tables and plot of all rows."""
    from . import estimate

    lengths, engines = setup["lengths"], setup["engines"]
    clock = estimate.Clock(args.stop_at)
    log(f"[e2e] lengths {[e2e.length_label(n) for n in lengths]}, rounds {setup['rounds']}, engines {engines}, "
        f"{args.gen_tokens} decode tokens" + (", shared prefill" if args.shared_prefill else "")
        + (f", prefill limits {setup['config']['max_prefill']}" if setup["max_prefill"] else ""))
    if done:
        log(f"[e2e] resuming {out_dir}: {', '.join(r['label'] for r in done)} already measured, "
            f"{len(remaining)} length(s) left")
    calls = results.setdefault("e2e_calls", [])
    call = {"date": results["environment"]["date"], "lengths": []}
    calls.append(call)
    t0 = time.perf_counter()
    by_label = {r["label"]: r for r in done}

    def ordered():
        return [by_label[e2e.length_label(n)] for n in lengths if e2e.length_label(n) in by_label]

    def store(complete: bool):
        results["e2e"] = {"config": setup["config"], "rows": ordered(), "complete": complete,
                          "seconds": sum(c.get("seconds", 0.0) for c in calls[:-1]) + time.perf_counter() - t0}
        call["seconds"] = time.perf_counter() - t0
        save()

    if remaining and args.warmup_length:
        # the warm-up compiles every engine's kernels (a fresh machine: minutes, bench/estimate.py)
        first = e2e_row_estimate(setup, args, remaining[0]) + estimate.FIRST_COMPILE_S
        if not clock.fits(first):
            log(f"[e2e] stopping before {e2e.length_label(remaining[0])}: ~{first:.0f} s estimated, "
                f"{clock.left():.0f} s left before --stop-at; the next run with this --out continues")
            remaining = []
        else:
            # (then every chunk size the timed lengths prefill, each engine up to what it prefills itself)
            warm = sorted({n for step in e2e.chunk_sizes(engines, args.prefill_step_size)
                           for n in e2e.chunk_warmup_lengths(remaining, step, args.warmup_length)})
            e2e.sweep(model, warm, [], warm, 1, 4, args.prefill_step_size, engines, vocab, seed=args.seed + 999,
                      log=lambda m: log("[warmup] " + m), max_prefill=setup["max_prefill"])
            e2e.warm_long_context(model, engines, remaining, log=log)
    pending = {}

    def before_row(length: int) -> bool:
        est = e2e_row_estimate(setup, args, length)
        left = clock.left()
        if not clock.fits(est):
            log(f"[e2e] stopping before {e2e.length_label(length)}: ~{est * clock.factor:.0f} s estimated, "
                f"{left:.0f} s left before --stop-at; the next run with this --out continues")
            return False
        index = lengths.index(length) + 1
        log(f"[e2e] {e2e.length_label(length)} ({index}/{len(lengths)}): ~{est * clock.factor:.0f} s estimated, "
            f"{time.perf_counter() - t0:.0f} s into this run" + ("" if left is None else f", {left:.0f} s left"))
        pending.update(length=length, est=est, t=time.perf_counter())
        return True

    def on_row(rows_so_far):
        row = rows_so_far[-1]
        by_label[row["label"]] = row
        call["lengths"].append(row["label"])
        clock.record(pending["est"], time.perf_counter() - pending["t"])
        store(complete=False)

    if remaining:
        e2e.sweep(model, remaining, remaining, [n for n in remaining if n in setup["decode"]], args.rounds,
                  args.gen_tokens, args.prefill_step_size, engines, vocab, seed=args.seed, log=log,
                  rounds_for=lambda n: setup["rounds"][e2e.length_label(n)], on_row=on_row,
                  shared_prefill=args.shared_prefill, max_prefill=setup["max_prefill"], before_row=before_row)
    rows = ordered()
    complete = len(rows) == len(lengths)
    store(complete)
    table = e2e.table_markdown(rows)
    ablations = e2e.ablation_markdown(rows)
    if ablations:
        table += "\n\nSwitch ablations (lily with the switch on / off):\n\n" + ablations
    variants = e2e.variant_markdown(rows)
    if variants:
        table += "\n\nEngines with a modifier against lily:\n\n" + variants
    if not complete:
        missing = [e2e.length_label(n) for n in lengths if e2e.length_label(n) not in by_label]
        table += (f"\n\nIncomplete: {', '.join(missing)} not measured yet; the same command with this --out "
                  "continues.")
    log(table)
    if out_dir:
        (out_dir / "e2e.md").write_text(table + "\n")
        env = results["environment"]
        title = (f"{results.get('model', '')} | {env['device'].get('device_name', env['default_device'])} | "
                 f"mlx {env['mlx']}, mlx-lm {env['mlx_lm']}, lily backend {env['lily_backend']}")
        if rows:
            e2e.plot(rows, str(out_dir / "e2e.png"), title)
    log(f"[e2e] {'complete' if complete else 'incomplete'}: {len(rows)}/{len(lengths)} lengths, "
        f"{time.perf_counter() - t0:.0f} s in this run")


if __name__ == "__main__":
    sys.exit(main())
