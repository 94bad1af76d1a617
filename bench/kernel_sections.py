"""Where one kernel launch of a decode step spends its time: Nsight Compute's full sections of the first launch whose
name matches, summarised (the launch's shape, occupancy, issue rate, memory throughput), and its stall samples by
instruction (the instructions most samples sit on, with their main stall reason).

    python -m bench.kernel_sections --kernel block_partials_live --context 4096 --out DIR   # two ncu runs
    python -m bench.kernel_sections --details DIR/details.txt --source DIR/source.csv     # summary of saved logs

Each ncu run profiles a ``bench.step_gpu_time`` child (the full-size random model at ``--context``, one decode step
after the warm-up) with ``-k regex:KERNEL -c 1``: ``--set full --page details`` (the sections) and ``--set full --page
source --print-source sass --csv`` (samples by instruction). The 2026-12-04 run of the live partials kernel found
42 % of its samples at 4K waiting on one load (docs/results/2026-12-04-h200-long-context-decode/, part 5), which is
what this makes one command.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import os
import re
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

# The details page's metrics worth a line (name as ncu prints it -> what the summary calls it).
DETAIL_METRICS = {
    "Duration": "duration",
    "SM Frequency": "SM clock",
    "Grid Size": "threadgroups",
    "Block Size": "threads a threadgroup",
    "Registers Per Thread": "registers a thread",
    "Block Limit Registers": "threadgroups an SM by registers",
    "Achieved Active Warps Per SM": "warps an SM (achieved)",
    "Active Warps Per Scheduler": "warps a scheduler",
    "Warp Cycles Per Issued Instruction": "cycles between a warp's instructions",
    "Issue Slots Busy": "issue slots busy",
    "Executed Instructions": "instructions executed",
    "DRAM Throughput": "DRAM throughput",
    "L1/TEX Cache Throughput": "L1 throughput",
    "L2 Cache Throughput": "L2 throughput",
}
_METRIC_LINE = re.compile(r"^\s{4}(\S.*?)\s{2,}(?:(\S+)\s+)?([\d,]+(?:\.\d+)?)\s*$")


def parse_details(text: str) -> Dict[str, Tuple[str, str]]:
    """{metric name: (unit, value)} of the first launch on an ``ncu --page details`` print (the first value of a name
    that several sections print)."""
    found: Dict[str, Tuple[str, str]] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m and m.group(1) not in found:
            found[m.group(1)] = (m.group(2) or "", m.group(3))
    return found


def details_table(text: str) -> str:
    found = parse_details(text)
    rows = ["| | value |", "|---|---|"]
    for name, label in DETAIL_METRICS.items():
        if name in found:
            unit, value = found[name]
            rows.append(f"| {label} | {value}{' ' + unit if unit and unit not in ('block', 'warp') else ''} |")
    return "\n".join(rows)


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except (TypeError, ValueError):
        return 0.0


def parse_source(text: str) -> List[dict]:
    """The rows of an ``ncu --page source --print-source sass --csv`` print (one an instruction, in address order)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        return []
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def source_summary(rows: List[dict], top: int = 8) -> str:
    """Stall samples by reason, then the ``top`` instructions by samples with their main reason and share."""
    if not rows:
        return "(no source rows)"
    samples = "Warp Stall Sampling (All Samples)"
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    total = sum(_number(r.get(samples)) for r in rows)
    if not total:
        return "(no stall samples)"
    by_reason = collections.Counter()
    for r in rows:
        for k in reasons:
            by_reason[k] += _number(r.get(k))
    out = [f"{len(rows)} instructions, {total:.0f} stall samples; by reason: "
           + ", ".join(f"{k[len('stall_'):]} {100 * v / total:.0f} %" for k, v in by_reason.most_common(5) if v), "",
           "| # | instruction | samples | share | main reason | executions |", "|---|---|---|---|---|---|"]
    ranked = sorted(range(len(rows)), key=lambda i: -_number(rows[i].get(samples)))[:top]
    for i in ranked:
        r = rows[i]
        main = max(reasons, key=lambda k: _number(r.get(k)))
        out.append(f"| {i} | `{r.get('Source', '').strip()[:60]}` | {_number(r.get(samples)):.0f} | "
                   f"{100 * _number(r.get(samples)) / total:.1f} % | {main[len('stall_'):]} | "
                   f"{r.get('Instructions Executed', '')} |")
    return "\n".join(out)


def _read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def commands(kernel: str, context: int, engine: str, ncu: str = "ncu", clock_control: str = "base",
             settings=()) -> List[List[str]]:
    """The two ncu commands, the details print's and the source print's (each to standard output)."""
    from bench.step_gpu_time import child_command

    child = child_command(engine, context, 1, settings=settings)
    base = [ncu, "--clock-control", clock_control, "--profile-from-start", "off", "--set", "full",
            "-k", f"regex:{kernel}", "-c", "1"]
    return [base + ["--page", "details"] + child,
            base + ["--page", "source", "--print-source", "sass", "--csv"] + child]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", help="a regular expression on the kernel's name (the first launch in the step)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--engine", default="lily")
    ap.add_argument("--clock-control", choices=("base", "none"), default="base")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="a module constant in the profiled process (as bench.step_gpu_time --set)")
    ap.add_argument("--out", default=".", help="folder for details.txt, source.csv and sections.md")
    ap.add_argument("--details", help="summarise this saved details print instead of profiling")
    ap.add_argument("--source", help="summarise this saved source print (csv, or .csv.gz) instead of profiling")
    ap.add_argument("--top", type=int, default=8, help="instructions listed by samples")
    args = ap.parse_args(argv)
    if not (args.details or args.source):
        if not args.kernel:
            ap.error("--kernel is required unless --details / --source name saved prints")
        os.makedirs(args.out, exist_ok=True)
        args.details, args.source = os.path.join(args.out, "details.txt"), os.path.join(args.out, "source.csv")
        for cmd, path in zip(commands(args.kernel, args.context, args.engine, clock_control=args.clock_control,
                                      settings=args.set),
                             (args.details, args.source)):
            print(f"[kernel-sections] {' '.join(cmd[:12])} ... > {path}", flush=True)
            with open(path, "w") as f:
                subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
    parts = [f"# {args.kernel or 'saved prints'} (context {args.context})" if args.kernel else "# saved prints"]
    if args.details and os.path.exists(args.details):
        parts += ["", details_table(_read(args.details))]
    if args.source and os.path.exists(args.source):
        parts += ["", source_summary(parse_source(_read(args.source)), args.top)]
    text = "\n".join(parts)
    if args.kernel:
        with open(os.path.join(args.out, "sections.md"), "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
