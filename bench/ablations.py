"""The write-up's ablation table in one command: each switch on vs off at the write-up's length.

    python -m bench.ablations --out results/ablations            # full-size random model
    python -m bench.ablations --size tiny --lengths-scale 0.0625  # a quick run anywhere

Each ablation is lily-mlx against itself with one switch off (the write-up's ablation variant),
same process, same weights, engines alternating order every round, medians: prefill tok/s for the
prefill switches, decode tok/s for the decode ones. Switches whose op has no kernel yet are listed,
not timed (they change nothing). The write-up's gain is printed next to ours. Results: ablations.md,
ablations.json (written after every ablation; ``--resume`` skips the ones already there) and
ablations.png.
"""

from __future__ import annotations

import argparse
import os
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from . import e2e

K = 1024
# (switch, phase, length, the write-up's gain in %, as "on / off - 1"; None where it gives none)
ABLATIONS = (
    ("fused_dequant", "prefill", 512, 77.4),
    ("gpu_routing", "prefill", 512, 89.0),
    ("adaptive_tile", "prefill", 2 * K, 13.2),
    ("register_scan", "prefill", 2 * K, 5.6),
    ("fused_combine", "prefill", 2 * K, None),
    ("fused_recurrent_norm", "decode", 4 * K, None),
    ("coalesced_kv", "decode", 3840, 2.1),
    ("gqa_packing", "decode", 32 * K, 23.8),
    ("fixed_block_attention", "decode", 32 * K, 7.7),
    ("fixed_block_attention", "decode", 64 * K, 27.4),
    ("fixed_block_attention", "decode", 128 * K, 40.2),
    ("row_gemv", "decode", 4 * K, None),
    ("fused_expert_up", "decode", 4 * K, None),
    ("fused_expert_down", "decode", 4 * K, None),
    ("fused_qk_prep", "decode", 4 * K, None),
)


WARMUP_LENGTH = 256


def has_kernel(switch: str) -> bool:
    """Whether any op that reads ``switch`` has a kernel at all (else the switch changes nothing)."""
    from lily_mlx.ops import load_all

    return any(op.kernel_backends for op in load_all().values() if switch in op.switches)


def key(switch: str, length: int) -> str:
    return f"{switch}@{e2e.length_label(length)}"


def run_one(model, switch: str, phase: str, length: int, rounds: int, gen_tokens: int, step: int, vocab: int,
            log=print) -> Dict:
    engines = ("lily", f"{e2e.ABLATION_PREFIX}{switch}")
    decode = phase == "decode"
    # One untimed short run per engine first: a switch state's first call compiles its kernels (on a
    # fresh GPU machine that took seconds and turned one round's tok/s into a compile time).
    warm = min(length, WARMUP_LENGTH)
    e2e.sweep(model, [warm], [warm], [warm], 1, 2, step, engines, vocab, seed=999, log=lambda m: None)
    (row,) = e2e.sweep(model, [length], [] if decode else [length], [length] if decode else [], rounds,
                       gen_tokens if decode else 1, step, engines, vocab, log=log)
    metric = "generation_tps" if decode else "prompt_tps"
    on, off = row["lily"][metric], row[engines[1]][metric]
    return {"switch": switch, "phase": phase, "length": length, "metric": metric, "on": on, "off": off,
            "gain_pct": 100.0 * (on / off - 1.0), "rounds": rounds}


def table_markdown(rows: List[Dict]) -> str:
    lines = ["| switch | phase | length | lily tok/s | switch off tok/s | gain (ours) | gain (write-up) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        label = e2e.length_label(r["length"])
        wu = "-" if r.get("writeup_pct") is None else f"+{r['writeup_pct']:.1f} %"
        if r.get("skipped"):
            lines.append(f"| `{r['switch']}` | {r['phase']} | {label} | - | - | {r['skipped']} | {wu} |")
        else:
            lines.append(f"| `{r['switch']}` | {r['phase']} | {label} | {r['on']:,.1f} | {r['off']:,.1f} | "
                         f"{r['gain_pct']:+.1f} % | {wu} |")
    return "\n".join(lines)


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


def main(argv=None) -> int:
    # A tune profile on this machine would change what the "lily" engines run: benchmarks measure
    # lily's defaults unless LILY_TUNE is set explicitly.
    os.environ.setdefault("LILY_TUNE", "off")
    from .model_setup import load_model
    from .run import environment

    p = argparse.ArgumentParser(prog="python -m bench.ablations", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint path or repo (default: random weights in process)")
    p.add_argument("--size", default="full", choices=("full", "tiny"))
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--only", default=None, help="comma-separated switches (default: every ablation)")
    p.add_argument("--max-length", default="128K", help="skip ablations at longer lengths")
    p.add_argument("--lengths-scale", type=float, default=1.0, help="multiply every length (quick runs)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--out", required=True, help="folder for ablations.md / .json / .png")
    p.add_argument("--resume", action="store_true", help="keep the ablations already in ablations.json")
    args = p.parse_args(argv)

    from lily_mlx.core import switches

    only = switches.parse_list(args.only) if args.only else None
    max_len = e2e.parse_lengths(args.max_length)[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "ablations.json"
    done = {}
    if args.resume and store.exists():
        done = {key(r["switch"], r["length"]): r for r in json.loads(store.read_text())["rows"]}
    plan = [(s, ph, max(8, int(n * args.lengths_scale)), wu) for s, ph, n, wu in ABLATIONS
            if (only is None or s in only) and n <= max_len]
    model, desc = load_model(args.model, args.size, 0, args.num_layers, log=print)
    vocab = model.args.text_config["vocab_size"] if hasattr(model.args, "text_config") else 32000
    results = {"environment": environment(), "model": desc, "args": vars(args), "rows": []}
    t0 = time.perf_counter()
    for i, (switch, phase, length, writeup) in enumerate(plan, 1):
        print(f"[ablations] {i}/{len(plan)} {switch} @ {e2e.length_label(length)} ({phase}), "
              f"{time.perf_counter() - t0:.0f} s so far", flush=True)
        if key(switch, length) in done:
            row = done[key(switch, length)]
        elif not has_kernel(switch):
            row = {"switch": switch, "phase": phase, "length": length, "skipped": "no kernel yet"}
        else:
            row = run_one(model, switch, phase, length, args.rounds, args.gen_tokens, args.prefill_step_size,
                          vocab, log=lambda m: print("  " + m, flush=True))
        row["writeup_pct"] = writeup
        results["rows"].append(row)
        store.write_text(json.dumps(results, indent=1, default=str))
    table = table_markdown(results["rows"])
    print(table)
    (out / "ablations.md").write_text(f"{desc}\n\n{table}\n")
    plot(results["rows"], out / "ablations.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
