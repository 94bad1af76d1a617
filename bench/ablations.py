"""The write-up's ablation table in one command: each switch on vs off at the write-up's length.

    python -m bench.ablations --out results/ablations            # full-size random model
    python -m bench.ablations --plan --out results/ablations     # what would run, estimated seconds
    python -m bench.ablations --size tiny --lengths-scale 0.0625  # a quick run anywhere

Each ablation is lily-mlx against itself with one switch off (the write-up's ablation variant), same
process, same weights, engines alternating order every round, medians. Prefill switches: prompt tok/s
(``bench/e2e.py``'s runs, after one untimed run of both engines: a switch state's first call compiles
its kernels). Decode switches: ``bench/decode_profile.py`` (every decode switch at one context in one
run: lily and each lily-off engine decode from copies of one cache prefilled once per round by lily,
so 32K-128K contexts cost one prefill per round): pipelined decode tok/s, the write-up's metric, and
the graph-build / evaluation time of one step, steadier than the end-to-end decode rate on a GPU
whose rate moves between rounds (docs/results/2026-11-30-h200-ablations-4k).

Every switch of ``lily_mlx.core.switches`` is listed; one whose op has no kernel on this backend (or
at all) is listed, not timed: it changes nothing here. The write-up's gain stands beside ours.
Results: ablations.md, ablations.json (written after every ablation; a later run with the same
``--out`` and settings keeps those and runs the rest, ``--fresh`` starts over) and ablations.png.
``--stop-at`` (wall clock, ``date +%s``) starts nothing that would not finish in time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from . import e2e, estimate

K = 1024
# (switch, phase, length, the write-up's gain in %, as "on / off - 1"; None where it gives none)
ABLATIONS = (
    ("fused_dequant", "prefill", 512, 77.4),
    ("gpu_routing", "prefill", 512, 89.0),
    ("adaptive_tile", "prefill", 2 * K, 13.2),
    ("register_scan", "prefill", 2 * K, 5.6),
    ("staged_scan", "prefill", 2 * K, None),
    ("fused_combine", "prefill", 2 * K, None),
    ("register_tiles", "prefill", 2 * K, None),
    ("tall_register_blocks", "prefill", 2 * K, None),
    ("chunked_prefill", "prefill", 16 * K, None),
    ("bounded_lookahead", "prefill", 16 * K, None),
    ("compiled_decode", "decode", 4 * K, None),
    ("compiled_layers", "decode", 4 * K, None),
    ("compiled_attention", "decode", 4 * K, None),
    ("layer_replay", "decode", 4 * K, None),
    ("constant_weights", "decode", 4 * K, None),
    ("step_trace", "decode", 4 * K, None),
    ("kv_write_in_trace", "decode", 4 * K, None),
    ("one_trace_attention", "decode", 4 * K, None),
    ("device_positions", "decode", 4 * K, None),
    ("fused_output_gate", "decode", 4 * K, None),
    ("fused_conv_step", "decode", 4 * K, None),
    ("fused_recurrent_norm", "decode", 4 * K, None),
    ("row_gemv", "decode", 4 * K, None),
    ("fused_expert_up", "decode", 4 * K, None),
    ("split_router", "decode", 4 * K, None),
    ("fused_topk_gemv", "decode", 4 * K, None),
    ("fused_down_combine", "decode", 4 * K, None),
    ("fused_residual", "decode", 4 * K, None),
    ("fused_add_norm", "decode", 4 * K, None),
    ("fused_norm_router", "decode", 4 * K, None),
    ("fused_next_norm", "decode", 4 * K, None),
    ("fused_in_proj", "decode", 4 * K, None),
    ("fused_qkv_proj", "decode", 4 * K, None),
    ("fused_expert_down", "decode", 4 * K, None),
    ("fused_combine", "decode", 4 * K, None),
    ("fused_qk_prep", "decode", 4 * K, None),
    ("dense_gemv", "decode", 4 * K, None),
    ("gemv_input_norm", "decode", 4 * K, None),
    ("fused_in_proj_step", "decode", 4 * K, None),
    ("fused_qkv_prep", "decode", 4 * K, None),
    ("split_k_gate_up", "decode", 4 * K, None),
    ("direct_down_combine", "decode", 4 * K, None),
    ("down_combine_ring", "decode", 4 * K, None),
    ("down_combine_simd_barriers", "decode", 4 * K, None),
    ("coalesced_kv", "decode", 3840, 2.1),
    ("gqa_packing", "decode", 32 * K, 23.8),
    ("fixed_block_attention", "decode", 32 * K, 7.7),
    ("fixed_block_attention", "decode", 64 * K, 27.4),
    ("fixed_block_attention", "decode", 128 * K, 40.2),
)

NO_KERNEL = "no kernel yet"


def _with_the_trial_gemv(switch: str) -> str:
    """Why a switch that acts only with the trial row GEMV has no ablation row, and how to time it."""
    from lily_mlx.core import switches

    off = not switches.SWITCHES[switch].default
    return (("off by default and " if off else "") + "acts only with the trial row GEMV: time it with "
            + (f"LILY_ENABLE={switch} " if off else "")
            + f"bench.decode_ab --engines lily-trial:linear_gemv,lily-trial:linear_gemv@off-{switch} "
            "(bench/device_decode_checks.sh PART=44)")
# Switches that act without a kernel of their own (not read by an op).
GENERATION_LEVEL = {
    "chunked_prefill": "no kernel: MLX-LM's prompt chunk size (caps peak memory, not a speed switch)",
    "constant_weights": ("acts only if on when the model is patched: time it in a process with "
                         "LILY_ENABLE=constant_weights (bench.decode_ab --engines lily,lily-off:constant_weights)"),
    "step_trace": ("acts only if on when the model is patched: time it in a process with LILY_ENABLE=step_trace "
                   "(bench.decode_ab --engines lily,lily-off:step_trace)"),
    "split_k_gate_up": ("off by default (a candidate), so lily and lily-off:split_k_gate_up are one configuration: "
                        "time it with LILY_ENABLE=split_k_gate_up (bench/device_decode_checks.sh PART=30)"),
    "direct_down_combine": ("off by default (a candidate), so lily and lily-off:direct_down_combine are one "
                            "configuration: time it with LILY_ENABLE=direct_down_combine "
                            "(bench/device_decode_checks.sh PART=36)"),
    **{name: _with_the_trial_gemv(name) for name in ("gemv_input_norm", "fused_in_proj_step", "fused_qkv_prep")},
}


# Decode-attention switches: which attention op a Qwen3.6 decode step (D = 256, G = 8) runs at a context
# decides whether the switch reaches a kernel there (layer.decode_path's rule).
ATTENTION_DECODE_SWITCHES = ("coalesced_kv", "gqa_packing", "fixed_block_attention")


def attention_ops_at(switch: str, length: int) -> set:
    """The attention ops a Qwen3.6 decode step at ``length`` runs with ``switch`` on or off (the layer's
    own rule, ``decode_path``, with the fixed blocks allowed)."""
    from lily_mlx.core import switches
    from lily_mlx.ops.attention import kernels as ak
    from lily_mlx.ops.attention import layer as att

    with switches.overrides(enable=["fixed_block_attention"]):
        fixed = att.decode_path(length, ak.FIXED_BLOCK_HEAD_DIM, ak.FIXED_BLOCK_GQA_FACTOR) == "fixed_block"
    if not fixed:
        return {"attention_decode"}
    return {"attention_decode_long", "attention_decode"} if switch == "fixed_block_attention" \
        else {"attention_decode_long"}


def skip_reason(switch: str, backend: str, time_all: bool = False, length: Optional[int] = None) -> Optional[str]:
    """Why ``switch`` is not timed on ``backend`` (None: it is). ``time_all`` times every switch that has a
    kernel on some backend (harness tests on the reference backend). With ``length``, a decode-attention
    switch is timed only where a step at that context reaches a kernel of this backend (on CUDA a step
    below the fixed-block threshold takes stock's SDPA, switch on or off)."""
    from lily_mlx.core.compiled import COMPILE_BACKENDS
    from lily_mlx.ops import load_all

    if switch in GENERATION_LEVEL:
        return GENERATION_LEVEL[switch]
    if switch == "bounded_lookahead":  # when the host waits, not which kernel: acts on every backend
        return None
    if switch in ("kv_write_in_trace", "device_positions"):  # the KV write, the attention over the buffer and the
        return None                                           # step's position array: act on every backend
    if switch in ("compiled_decode", "compiled_layers", "compiled_attention", "layer_replay", "one_trace_attention"):
        if backend in COMPILE_BACKENDS or time_all:
            return None
        return f"traces Metal/CUDA kernels only ({backend} runs them uncompiled)"
    ops = [op for op in load_all().values() if switch in op.switches]
    anywhere = sorted(set().union(*(op.kernel_backends for op in ops))) if ops else []
    if not anywhere:
        return NO_KERNEL
    if time_all:
        return None
    if backend not in anywhere:
        return f"no kernel on {backend} yet (kernels: {', '.join(anywhere)})"
    if length is not None and switch in ATTENTION_DECODE_SWITCHES:
        runs = attention_ops_at(switch, length)
        if switch == "fixed_block_attention" and runs == {"attention_decode"}:
            return f"at {e2e.length_label(length)} both states take the ordinary decode path (below the fixed-block threshold)"
        if not any(op.name in runs and backend in op.kernel_backends for op in ops):
            return (f"at {e2e.length_label(length)} a decode step runs {', '.join(sorted(runs))}, "
                    f"which has no kernel on {backend} (stock's attention, switch on or off)")
    return None


def has_kernel(switch: str) -> bool:
    """Whether any op that reads ``switch`` has a kernel at all (else the switch changes nothing)."""
    return skip_reason(switch, "metal", time_all=True) is None


def key(switch: str, length: int, phase: Optional[str] = None) -> str:
    return f"{switch}@{e2e.length_label(length)}" + (f":{phase}" if phase else "")


def plan_rows(only=None, max_length: int = 128 * K, scale: float = 1.0) -> List[Dict]:
    """The ablations to run, in the table's order, at their (scaled) lengths."""
    return [{"switch": s, "phase": ph, "length": max(8, int(n * scale)), "writeup_pct": wu}
            for s, ph, n, wu in ABLATIONS if (only is None or s in only) and n <= max_length]


def units(rows: List[Dict], backend: str, time_all: bool) -> List[Dict]:
    """Work units: one per prefill ablation, one per decode context (all its switches in one
    decode-profile run), one per skipped row; in the order of the table's first row of each unit."""
    out, decode_at = [], {}
    for row in rows:
        reason = skip_reason(row["switch"], backend, time_all, row["length"] if row["phase"] == "decode" else None)
        if reason:
            out.append({"kind": "skip", "rows": [row], "reason": reason})
        elif row["phase"] == "prefill":
            out.append({"kind": "prefill", "rows": [row], "length": row["length"]})
        else:
            if row["length"] not in decode_at:
                decode_at[row["length"]] = {"kind": "decode", "rows": [], "length": row["length"]}
                out.append(decode_at[row["length"]])
            decode_at[row["length"]]["rows"].append(row)
    return out


def unit_estimate(unit: Dict, args) -> float:
    if unit["kind"] == "skip":
        return 0.0
    if unit["kind"] == "prefill":
        return estimate.ablation_prefill_s(unit["rows"][0]["switch"], unit["length"], args.rounds)
    return estimate.ablation_decode_group_s([r["switch"] for r in unit["rows"]], unit["length"],
                                            rounds_for(args, unit["length"]), args.profile_steps)


def rounds_for(args, length: int) -> int:
    return args.long_rounds if length >= e2e.parse_lengths(args.long_from)[0] else args.decode_rounds


def run_prefill(model, switch: str, length: int, rounds: int, step: int, vocab: int, log=print) -> Dict:
    engines = ("lily", f"{e2e.ABLATION_PREFIX}{switch}")
    # Untimed runs per engine first, one per chunk size this length prefills: a switch state's first call of a
    # chunk size compiles its kernels (on a fresh GPU machine that took seconds and turned one round's tok/s into
    # a compile time; the MoE tiles have variants by chunk size).
    warm = e2e.chunk_warmup_lengths([length], step)
    e2e.sweep(model, warm, warm, warm, 1, 2, step, engines, vocab, seed=999, log=lambda m: None)
    (row,) = e2e.sweep(model, [length], [length], [], rounds, 1, step, engines, vocab, log=log)
    on, off = row["lily"], row[engines[1]]
    return {"on": on["prompt_tps"], "off": off["prompt_tps"], "metric": "prompt_tps",
            "gain_pct": 100.0 * (on["prompt_tps"] / off["prompt_tps"] - 1.0), "rounds": rounds,
            "peak_gb_on": on["peak_memory"], "peak_gb_off": off["peak_memory"],
            "trials_on": [t["prompt_tps"] for t in on["trials"]],
            "trials_off": [t["prompt_tps"] for t in off["trials"]]}


def run_decode(model, switches_: List[str], length: int, rounds: int, steps: int, vocab: int,
               log=print) -> Dict[str, Dict]:
    """lily and lily-off:<switch> for each switch at one context: decode_profile with one shared prefill
    per round. -> switch -> row fields."""
    from . import decode_profile

    engines = ["lily"] + [f"{e2e.ABLATION_PREFIX}{s}" for s in switches_]
    profile = decode_profile.run(model, length, engines, rounds, steps, vocab, log=log, shared_prefill=True,
                                 detail=False)
    lily = profile["engines"]["lily"]
    out = {}
    for s, engine in zip(switches_, engines[1:]):
        off = profile["engines"][engine]
        out[s] = {"on": lily["decode_tok_s"], "off": off["decode_tok_s"], "metric": "decode_tok_s (pipelined)",
                  "gain_pct": 100.0 * (lily["decode_tok_s"] / off["decode_tok_s"] - 1.0), "rounds": rounds,
                  "steps": steps, "eval_ms_on": lily["eval_ms"], "eval_ms_off": off["eval_ms"],
                  "build_ms_on": lily["build_ms"], "build_ms_off": off["build_ms"],
                  "eval_gain_pct": 100.0 * (off["eval_ms"] / lily["eval_ms"] - 1.0),
                  "rounds_on": lily["decode_tok_s_rounds"], "rounds_off": off["decode_tok_s_rounds"],
                  "shared_prefill": True}
    return out


def table_markdown(rows: List[Dict]) -> str:
    lines = ["| switch | phase | length | lily tok/s | switch off tok/s | gain (ours) | gain (write-up) | "
             "eval ms/step on / off | build ms/step on / off | peak GB on / off |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = e2e.length_label(r["length"])
        wu = "-" if r.get("writeup_pct") is None else f"+{r['writeup_pct']:.1f} %"
        if r.get("skipped"):
            lines.append(f"| `{r['switch']}` | {r['phase']} | {label} | - | - | {r['skipped']} | {wu} | - | - | - |")
            continue
        ev = bd = peak = "-"
        if r.get("eval_ms_on") is not None:
            ev = f"{r['eval_ms_on']:.2f} / {r['eval_ms_off']:.2f}"
            bd = f"{r['build_ms_on']:.2f} / {r['build_ms_off']:.2f}"
        if r.get("peak_gb_on") is not None and r.get("peak_gb_off") is not None:  # prefill rows
            peak = f"{r['peak_gb_on']:.2f} / {r['peak_gb_off']:.2f}"
        lines.append(f"| `{r['switch']}` | {r['phase']} | {label} | {r['on']:,.1f} | {r['off']:,.1f} | "
                     f"{r['gain_pct']:+.1f} % | {wu} | {ev} | {bd} | {peak} |")
    return "\n".join(lines)


NOTES = ("Prefill rows: prompt tok/s, medians over rounds (both engines run once untimed first). Decode rows: "
         "pipelined decode tok/s (as generate_step decodes), and one step's graph build and evaluation time "
         "(medians over rounds x steps), all engines at one context decoding from copies of one cache "
         "prefilled once per round by lily. Gain = lily / switch off - 1. Peak GB (prefill rows): "
         "mx.get_peak_memory() / 1e9 of each engine's own runs (bounded_lookahead is about this column).")


def plot(rows: List[Dict], path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    timed = [r for r in rows if not r.get("skipped")]
    if not timed:
        return None
    labels = [f"{r['switch']}\n@{e2e.length_label(r['length'])}" for r in timed]
    xs = range(len(timed))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(timed)), 4))
    ax.bar([x - 0.2 for x in xs], [r["gain_pct"] for r in timed], 0.4, label="lily-mlx (this run)")
    ax.bar([x + 0.2 for x in xs], [r.get("writeup_pct") or 0.0 for r in timed], 0.4, label="write-up (M5 Max)")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("gain with the switch on, %")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ablations", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint path or repo (default: random weights in process)")
    p.add_argument("--size", default="full", choices=("full", "tiny"))
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--only", default=None, help="comma-separated switches (default: every ablation)")
    p.add_argument("--max-length", default="128K", help="skip ablations at longer lengths")
    p.add_argument("--lengths-scale", type=float, default=1.0, help="multiply every length (quick runs)")
    p.add_argument("--rounds", type=int, default=3, help="prefill ablations: rounds")
    p.add_argument("--decode-rounds", type=int, default=4, help="decode ablations: rounds (one shared prefill each)")
    p.add_argument("--long-rounds", type=int, default=2, help="decode ablations at contexts >= --long-from: rounds")
    p.add_argument("--long-from", default="32K")
    p.add_argument("--profile-steps", type=int, default=None,
                   help="decode ablations: steps timed per engine and round, one by one and pipelined "
                        "(default: --gen-tokens)")
    p.add_argument("--gen-tokens", type=int, default=32, help="default for --profile-steps")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--time-all", action="store_true",
                   help="also time switches whose kernels do not run on this backend (harness tests)")
    p.add_argument("--out", required=True, help="folder for ablations.md / .json / .png")
    p.add_argument("--fresh", action="store_true", help="ignore the ablations already in --out (start over)")
    p.add_argument("--resume", action="store_true", help="(the default now: kept for old command lines)")
    p.add_argument("--stop-at", type=float, default=None, metavar="EPOCH_S",
                   help="start no ablation that would end after this wall-clock time (`date +%%s`)")
    p.add_argument("--plan", action="store_true", help="print what would run, with estimated H200 seconds; run nothing")
    p.add_argument("--plan-backend", default=None,
                   help="--plan: the backend whose kernels decide what is timed (default: this machine's)")
    p.add_argument("--plan-call-seconds", type=float, default=480.0)
    return p


def settings(args, backend: str, model_desc: str) -> Dict:
    """What a resumed table must share with the run that began it."""
    return {"rounds": args.rounds, "decode_rounds": args.decode_rounds, "long_rounds": args.long_rounds,
            "long_from": args.long_from, "profile_steps": args.profile_steps,
            "prefill_step_size": args.prefill_step_size, "lengths_scale": args.lengths_scale,
            "time_all": args.time_all, "model": model_desc, "lily_backend": backend}


def main(argv=None) -> int:
    # A tune profile on this machine would change what the "lily" engines run: benchmarks measure
    # lily's defaults unless LILY_TUNE is set explicitly.
    os.environ.setdefault("LILY_TUNE", "off")
    args = parser().parse_args(argv)
    if args.profile_steps is None:
        args.profile_steps = args.gen_tokens
    from lily_mlx.core import switches
    from lily_mlx.core.backend import resolve_backend

    only = switches.parse_list(args.only) if args.only else None
    out = Path(args.out)
    store = out / "ablations.json"
    backend = args.plan_backend if args.plan and args.plan_backend else resolve_backend()
    model_key = args.model or f"random {args.size}" + (f", {args.num_layers} layers" if args.num_layers else "")
    config = settings(args, backend, model_key)
    done: Dict[str, Dict] = {}
    previous: Dict = {}
    if store.exists() and not args.fresh:
        previous = json.loads(store.read_text())
        old = previous.get("settings")
        if old is not None and old != config:
            diff = "\n".join(f"  {k}: ablations.json has {old.get(k)!r}, this command {config.get(k)!r}"
                             for k in sorted(set(old) | set(config)) if old.get(k) != config.get(k))
            raise SystemExit(f"{store} holds ablations made with other settings; repeat that command to continue "
                             f"it, or use another --out, or --fresh. Differences:\n{diff}")
        if old is None:
            previous = {}  # written before ablations could resume: start over
        else:
            done = {key(r["switch"], r["length"], r["phase"]): r for r in previous["rows"] if not r.get("skipped")}
    rows = plan_rows(only, e2e.parse_lengths(args.max_length)[0], args.lengths_scale)
    work = units(rows, backend, args.time_all)

    def todo(unit):
        return unit["kind"] != "skip" and any(key(r["switch"], r["length"], r["phase"]) not in done
                                              for r in unit["rows"])

    if args.plan:
        print(f"[plan] ablations on backend {backend}; estimates from the H200 figures in bench/estimate.py")
        items = []
        for unit in work:
            names = ", ".join(f"{r['switch']}@{e2e.length_label(r['length'])}" for r in unit["rows"])
            if unit["kind"] == "skip":
                print(f"[plan] not timed: {names} ({unit['reason']})")
            elif not todo(unit):
                print(f"[plan] done: {names}")
            else:
                seconds = unit_estimate(unit, args)
                print(f"[plan] {unit['kind']} {names}: ~{seconds:.0f} s")
                items.append((names, seconds))
        overhead = estimate.FIRST_COMPILE_S + estimate.MODEL_BUILD_S
        print(f"[plan] left: ~{sum(s for _, s in items):.0f} s of runs + ~{overhead:.0f} s per call")
        for i, (call, seconds) in enumerate(estimate.pack_calls(items, args.plan_call_seconds, overhead), 1):
            print(f"[plan] call {i}: {'; '.join(n for n, _ in call)} ~{seconds:.0f} s")
        return 0

    from .model_setup import load_model
    from .run import environment

    out.mkdir(parents=True, exist_ok=True)
    clock = estimate.Clock(args.stop_at)
    model = vocab = None
    desc = previous.get("model")
    results = {"environment": environment(), "settings": config, "args": vars(args), "rows": [],
               "notes": NOTES, "complete": False}
    call = {"date": results["environment"]["date"], "ran": []}
    results["calls"] = previous.get("calls", []) + [call]
    t0 = time.perf_counter()

    def rows_now() -> List[Dict]:
        table = []
        for unit in work:
            for r in unit["rows"]:
                k = key(r["switch"], r["length"], r["phase"])
                if unit["kind"] == "skip":
                    table.append({**r, "skipped": unit["reason"]})
                elif k in done:
                    table.append({**done[k], "writeup_pct": r["writeup_pct"]})
        planned = {key(r["switch"], r["length"], r["phase"]) for u in work for r in u["rows"]}
        return table + [r for k, r in done.items() if k not in planned]  # kept from other --only runs

    def save():
        results["rows"] = rows_now()
        results["model"] = desc
        tmp = store.with_suffix(".json.tmp")  # whole or not at all
        tmp.write_text(json.dumps(results, indent=1, default=str))
        os.replace(tmp, store)

    stopped = False
    pending = [u for u in work if todo(u)]
    for i, unit in enumerate(pending, 1):
        names = ", ".join(f"{r['switch']}@{e2e.length_label(r['length'])}" for r in unit["rows"])
        est = unit_estimate(unit, args)
        if model is None:  # this process's first unit also builds the model and compiles lily's kernels
            est += estimate.FIRST_COMPILE_S + estimate.MODEL_BUILD_S
        if not clock.fits(est):
            print(f"[ablations] stopping before {names}: ~{est * clock.factor:.0f} s estimated, "
                  f"{clock.left():.0f} s left before --stop-at; the next run with this --out continues", flush=True)
            stopped = True
            break
        if model is None:
            model, desc = load_model(args.model, args.size, 0, args.num_layers, log=print)
            vocab = model.args.text_config["vocab_size"] if hasattr(model.args, "text_config") else 32000
        print(f"[ablations] {i}/{len(pending)} {unit['kind']} {names}: ~{est * clock.factor:.0f} s estimated, "
              f"{time.perf_counter() - t0:.0f} s so far", flush=True)
        started = time.perf_counter()
        log = lambda m: print("  " + m, flush=True)  # noqa: E731
        if unit["kind"] == "prefill":
            r = unit["rows"][0]
            measured = {r["switch"]: run_prefill(model, r["switch"], unit["length"], args.rounds,
                                                 args.prefill_step_size, vocab, log=log)}
        else:
            todo_rows = [r for r in unit["rows"] if key(r["switch"], r["length"], r["phase"]) not in done]
            measured = run_decode(model, [r["switch"] for r in todo_rows], unit["length"],
                                  rounds_for(args, unit["length"]), args.profile_steps, vocab, log=log)
        for r in unit["rows"]:
            if r["switch"] in measured:
                done[key(r["switch"], r["length"], r["phase"])] = {**r, **measured[r["switch"]]}
                call["ran"].append(key(r["switch"], r["length"], r["phase"]))
        call["seconds"] = time.perf_counter() - t0
        clock.record(est, time.perf_counter() - started)
        save()
    results["complete"] = not stopped and not any(todo(u) for u in work)
    save()
    table = table_markdown(results["rows"])
    text = f"{desc or model_key}\n\n{table}\n\n{NOTES}\n"
    if not results["complete"]:
        left = [f"{r['switch']}@{e2e.length_label(r['length'])}" for u in work if todo(u) for r in u["rows"]]
        text += f"\nIncomplete: {', '.join(left)} not measured yet; the same command with this --out continues.\n"
    print(table)
    (out / "ablations.md").write_text(text)
    plot(results["rows"], out / "ablations.png")
    print(f"[ablations] {'complete' if results['complete'] else 'incomplete'}, "
          f"{time.perf_counter() - t0:.0f} s in this run", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
