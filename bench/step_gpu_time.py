"""GPU time of one decode step, kernel by kernel, under NVIDIA Nsight Compute: does the step wait on
the GPU or on the host?

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --log-file step.csv \\
        python -m bench.step_gpu_time --engine lily --context 4096 --steps 2
    python -m bench.step_gpu_time --summarise step.csv [--steps 2]

The first command prefills ``--context`` tokens of the full-size random model, decodes a few warm-up
steps, and decodes ``--steps`` more between cudaProfilerStart / cudaProfilerStop, so Nsight Compute
measures those steps' kernels only (each replayed alone: their GPU durations, not the pipelined step).
The second prints the sum per step and a table by kernel name. Compare the sum with the step's
pipelined time from ``--mode decode-profile``: a sum well below it means the GPU waits on the host.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import glob
import os
import sys


def _profiler():
    """(start, stop) callables of the CUDA runtime's profiler API, or raise."""
    candidates = []
    with open("/proc/self/maps") as maps:  # the runtime MLX loaded, if any, first
        candidates += sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    try:
        import nvidia.cuda_runtime  # the pip package MLX's CUDA wheel depends on

        for root in nvidia.cuda_runtime.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "lib", "libcudart.so*")))
    except ImportError:
        pass
    candidates += ["libcudart.so.12", "libcudart.so.13", "libcudart.so"]
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        return lib.cudaProfilerStart, lib.cudaProfilerStop, name
    lib = ctypes.CDLL("libcuda.so.1")
    return lib.cuProfilerStart, lib.cuProfilerStop, "libcuda.so.1"


def profile(engine: str, context: int, steps: int, warmup: int) -> None:
    import mlx.core as mx

    from bench.decode_profile import _prefill, _step
    from bench.e2e import Engines, switches_off, validate_engine
    from bench.model_setup import load_model
    from lily_mlx.core import switches

    validate_engine(engine)
    model, description = load_model(None, "full")
    print(f"[step-gpu-time] {description}; engine {engine}, context {context}", flush=True)
    Engines(model).use(engine)
    vocab = model.args.text_config["vocab_size"]
    with switches.overrides(disable=switches_off(engine)):
        y, cache = _prefill(model, context, vocab, seed=0)
        for _ in range(warmup):
            y = _step(model, y, cache)
            mx.eval(y)
        start, stop, lib = _profiler()
        mx.synchronize()
        rc = start()
        for _ in range(steps):
            y = _step(model, y, cache)
            mx.eval(y)
        mx.synchronize()
        stop()
    print(f"[step-gpu-time] profiled {steps} steps (profiler API from {lib}, start rc {rc})", flush=True)


def summarise(path: str, steps: int) -> str:
    """Markdown: the profiled kernels' GPU time per step, by kernel name."""
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    total = collections.Counter()
    count = collections.Counter()
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "nsecond")
        us = value / 1e3 if unit.startswith("n") else value if unit.startswith("u") else value * 1e3
        name = row["Kernel Name"].split("(")[0].split("<")[0].strip()
        total[name] += us
        count[name] += 1
    all_us = sum(total.values())
    out = [f"GPU time per decode step: {all_us / steps / 1e3:.3f} ms over {sum(count.values()) // steps} kernels "
           f"(each kernel replayed alone by Nsight Compute)", "",
           "| kernel | launches/step | us/step | share |", "|---|---|---|---|"]
    for name, us in total.most_common():
        out.append(f"| {name[:90]} | {count[name] / steps:g} | {us / steps:.1f} | {100 * us / all_us:.1f} % |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="lily", help="stock, stock-kernels, lily or lily-off:<switch>")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2, help="profiled decode steps")
    ap.add_argument("--warmup", type=int, default=4, help="decode steps before profiling")
    ap.add_argument("--summarise", metavar="CSV", help="print the table from an ncu --csv log instead")
    args = ap.parse_args(argv)
    if args.summarise:
        print(summarise(args.summarise, args.steps))
        return 0
    profile(args.engine, args.context, args.steps, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
