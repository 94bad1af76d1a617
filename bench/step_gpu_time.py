"""GPU time of one decode step, kernel by kernel, under NVIDIA Nsight Compute: does the step wait on
the GPU or on the host?

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --log-file step.csv \\
        python -m bench.step_gpu_time --engine lily --context 4096 --steps 2
    python -m bench.step_gpu_time --summarise step.csv [--steps 2]

    python -m bench.step_gpu_time --compare lily,lily-off:split_router [--out DIR]

The first command prefills ``--context`` tokens of the full-size random model, decodes a few warm-up
steps, and decodes ``--steps`` more between cudaProfilerStart / cudaProfilerStop, so Nsight Compute
measures those steps' kernels only (each replayed alone: their GPU durations, not the pipelined step).
With ``--prefill-chunk L`` the profiled unit is a prompt chunk instead: after ``--context`` cached tokens,
``--steps`` chunks of L tokens are prefilled as ``generate`` does (the cache evaluated, no logits), after one
chunk of the same length on a throwaway cache that compiles every kernel.
The second prints the sum per step and a table by kernel name. The third runs the first for each engine
in turn (``ncu`` on the PATH) and prints one table of GPU ms per step and kernels per step by engine,
then each engine's table. Compare the sum with the step's pipelined time from ``--mode decode-profile``:
a sum well below it means the GPU waits on the host. Before the engines it profiles a 1 GiB copy the same way
(``--copy-probe``), so that the decode attention kernels' GB/s line gives their share of a copy at the same clocks.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import glob
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Optional


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


def _engine_model(engine: str, what: str):
    """(the full-size model patched as ``engine`` runs it, its vocabulary size, the engine's switch overrides)."""
    from bench.e2e import Engines, switches_off, validate_engine
    from bench.model_setup import load_model
    from lily_mlx.core import switches

    validate_engine(engine)
    model, description = load_model(None, "full")
    print(f"[step-gpu-time] {description}; engine {engine}, {what}", flush=True)
    Engines(model).use(engine)
    return model, model.args.text_config["vocab_size"], switches.overrides(disable=switches_off(engine))


def profile(engine: str, context: int, steps: int, warmup: int) -> None:
    import mlx.core as mx

    from bench.decode_profile import _prefill, _step

    model, vocab, overrides = _engine_model(engine, f"context {context}")
    with overrides:
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


def profile_prefill(engine: str, context: int, chunk: int, steps: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, vocab, overrides = _engine_model(engine, f"chunks of {chunk} after {context} tokens")
    tokens = mx.random.randint(0, vocab, (1, context + chunk * steps), key=mx.random.key(0))

    def prefill(cache, begin: int, end: int) -> None:
        model(tokens[:, begin:end], cache=cache)
        mx.eval([c.state for c in cache])

    with overrides:
        prefill(make_prompt_cache(model), 0, chunk)  # compiles this chunk length's kernels
        cache = make_prompt_cache(model)
        for begin in range(0, context, 2048):
            prefill(cache, begin, min(begin + 2048, context))
        mx.clear_cache()
        start, stop, lib = _profiler()
        mx.synchronize()
        rc = start()
        for i in range(steps):
            prefill(cache, context + i * chunk, context + (i + 1) * chunk)
        mx.synchronize()
        stop()
    print(f"[step-gpu-time] profiled {steps} chunks (profiler API from {lib}, start rc {rc})", flush=True)


def kernel_times(path: str):
    """(us by kernel name, launches by kernel name) summed over an ``ncu --csv`` log's
    ``gpu__time_duration.sum`` rows (other lines of the log are skipped)."""
    total = collections.Counter()
    count = collections.Counter()
    for name, us in _durations(path):
        total[name] += us
        count[name] += 1
    return total, count


def _durations(path: str):
    """(kernel name cut at its arguments, microseconds) of each ``gpu__time_duration.sum`` row of an ``ncu --csv``
    log, in launch order (ncu writes ns, us or ms; other lines of the log are skipped)."""
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "nsecond")
        us = value / 1e3 if unit.startswith("n") else value if unit.startswith("u") else value * 1e3
        yield row["Kernel Name"].split("(")[0].split("<")[0].strip(), us


def summarise(path: str, steps: int, unit: str = "decode step") -> str:
    """Markdown: the profiled kernels' GPU time per step (or prompt chunk: ``unit``), by kernel name."""
    total, count = kernel_times(path)
    all_us = sum(total.values())
    out = [f"GPU time per {unit}: {all_us / steps / 1e3:.3f} ms over {sum(count.values()) // steps} kernels "
           f"(each kernel replayed alone by Nsight Compute)", "",
           "| kernel | launches/step | us/step | share |", "|---|---|---|---|"]
    for name, us in total.most_common():
        out.append(f"| {name[:90]} | {count[name] / steps:g} | {us / steps:.1f} | {100 * us / all_us:.1f} % |")
    return "\n".join(out)


def apply_settings(settings) -> None:
    """``MODULE.NAME=VALUE`` each (a Python literal): set a module constant before anything runs (kernel layouts
    that are constants of the product, such as ``lily_mlx.ops.moe.kernels.GEMV_LAYOUT={'gate_up': (16, 512), 'down': (32, 256)}``)."""
    import ast
    import importlib

    for setting in settings:
        target, _, value = setting.partition("=")
        module, _, name = target.rpartition(".")
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise SystemExit(f"--set {setting}: {module} has no {name}")
        setattr(mod, name, ast.literal_eval(value))


def attention_bandwidth(total, steps: int, context: int, copy_gbs: Optional[float] = None) -> str:
    """A line: the decode attention kernels' GPU time a step (``total``: us by kernel name over ``steps`` steps) and
    the K/V bytes a step reads at ``context`` cached rows in the full-size model (every full-attention layer's K and V
    of every KV head, bf16), as GB/s: issue 13's kernel bandwidth, against the device's copy ceiling (``copy_gbs``:
    the copy probe profiled the same way, else left out). Empty where no attention kernel ran."""
    from lily_mlx.models.qwen3_6 import QWEN3_6_35B_A3B_TEXT_CONFIG as cfg

    partials = sum(us for name, us in total.items() if "attention_decode_block_partials" in name) / steps
    merge = sum(us for name, us in total.items() if "attention_decode_merge" in name) / steps
    if not partials:
        return ""
    layers = cfg["num_hidden_layers"] // cfg["full_attention_interval"]
    nbytes = layers * 2 * context * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    both, alone = nbytes / (partials + merge) / 1e3, nbytes / partials / 1e3
    line = (f"attention kernels: partials {partials:.1f} + merge {merge:.1f} us a step for {nbytes / 1e9:.3f} GB of K/V "
            f"({layers} layers, {context} rows): {both:.0f} GB/s ({alone:.0f} GB/s for the partials alone)")
    if copy_gbs:
        line += (f"; {100 * both / copy_gbs:.0f} % ({100 * alone / copy_gbs:.0f} %) of the copy ceiling, "
                 f"{copy_gbs:.0f} GB/s (a 1 GiB copy profiled the same way)")
    return line


def ncu_command(engine: str, context: int, steps: int, log: str, ncu: str = "ncu", chunk: int = 0, settings=(),
                clock_control: str = "base", cache_control: str = "all") -> list:
    """The Nsight Compute command that profiles one engine's process (``clock_control``: ncu's ``--clock-control``,
    "base" locks the SM clock to its base, 1.5 GHz on the H200, as every table before 2026-12-04 was measured;
    "none" leaves the clocks as the e2e runs find them; ``cache_control``: ncu's ``--cache-control``, "all"
    flushes the caches before each kernel, as every table before 2026-12-04 was measured, "none" leaves in L2 what
    the kernels before left there, as a step runs). ``engine`` None: the copy probe's process instead."""
    cmd = [ncu, "--clock-control", clock_control, "--cache-control", cache_control, "--profile-from-start", "off",
           "--metrics", "gpu__time_duration.sum", "--csv", "--log-file", log]
    if engine is None:
        return cmd + [sys.executable, "-m", "bench.step_gpu_time", "--copy-probe"]
    return cmd + child_command(engine, context, steps, chunk, settings)


def child_command(engine: str, context: int, steps: int, chunk: int = 0, settings=()) -> list:
    """The profiled process: this module's decode steps (or prompt chunks) of ``engine`` at ``context``, with the
    module constants ``settings`` set in it."""
    cmd = [sys.executable, "-m", "bench.step_gpu_time", "--engine", engine, "--context", str(context), "--steps",
           str(steps)] + (["--prefill-chunk", str(chunk)] if chunk else [])
    return cmd + [a for setting in settings for a in ("--set", setting)]


# The copy ceiling beside the kernel table: the kernels mode's copy (``x * 1.0`` over 1 GiB of fp32: read and write
# each byte once), profiled by the same ncu settings, so that the attention kernels' GB/s are held against a copy at
# the same clocks.
COPY_PROBE_ELEMENTS = 256 * 1024 * 1024
COPY_PROBE_REPEATS = 3


def profile_copy() -> None:
    import mlx.core as mx

    x = mx.random.uniform(shape=(COPY_PROBE_ELEMENTS,))
    mx.eval(x)
    mx.eval(x * 1.0)  # compiled and warm before the profiled range
    start, stop, lib = _profiler()
    mx.synchronize()
    start()
    for _ in range(COPY_PROBE_REPEATS):
        mx.eval(x * 1.0)
    mx.synchronize()
    stop()
    print(f"[step-gpu-time] profiled {COPY_PROBE_REPEATS} copies of {x.nbytes / 2**30:.0f} GiB", flush=True)


def copy_ceiling(path: str, nbytes: int = 4 * COPY_PROBE_ELEMENTS) -> Optional[float]:
    """GB/s (read + write) of the copy probe's log: its median launch, or None when the log holds none."""
    rows = [us for _, us in _durations(path)]
    if not rows:
        return None
    return 2 * nbytes / statistics.median(rows) / 1e3


def compare(engines, context: int, steps: int, out_dir: str, ncu: str = "ncu", chunk: int = 0,
            settings=(), clock_control: str = "base", cache_control: str = "all") -> str:
    """Profile each engine in its own process under Nsight Compute; Markdown: a comparison table, then
    each engine's kernel table. ``chunk`` > 0: prompt chunks of that length instead of decode steps."""
    unit = f"prompt chunk of {chunk} tokens" if chunk else "decode step"
    os.makedirs(out_dir, exist_ok=True)
    rows, tables = [], []
    copy_gbs = None
    if not chunk:
        log = os.path.join(out_dir, "ncu_copy_probe.csv")
        proc = subprocess.run(ncu_command(None, 0, 0, log, ncu, clock_control=clock_control,
                                          cache_control=cache_control), capture_output=True, text=True)
        copy_gbs = copy_ceiling(log) if proc.returncode == 0 and os.path.exists(log) else None
        print(f"[step-gpu-time] copy probe: {copy_gbs or 0:.0f} GB/s", flush=True)
    for engine in engines:
        log = os.path.join(out_dir, f"ncu_{engine.replace(':', '_').replace('+', '_')}.csv")
        cmd = ncu_command(engine, context, steps, log, ncu, chunk, settings, clock_control, cache_control)
        print(f"[step-gpu-time] {engine}: {' '.join(cmd[:8])} ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(log):
            rows.append(f"| {engine} | failed (exit {proc.returncode}) | - |")
            print(proc.stdout[-2000:] + proc.stderr[-2000:], flush=True)
            continue
        total, count = kernel_times(log)
        rows.append(f"| {engine} | {sum(total.values()) / steps / 1e3:.3f} | {sum(count.values()) / steps:g} |")
        bandwidth = "" if chunk else attention_bandwidth(total, steps, context, copy_gbs)
        tables.append(f"### {engine}\n\n" + summarise(log, steps, unit) + (f"\n\n{bandwidth}" if bandwidth else ""))
    clocks = "SM clock locked to base" if clock_control == "base" else f"clock control {clock_control}"
    clocks += ", caches flushed before each kernel" if cache_control == "all" else f", cache control {cache_control}"
    head = [f"GPU time per {unit} at context {context} (Nsight Compute, kernels replayed alone, {steps} steps, "
            f"{clocks})",
            "", f"| engine | GPU ms per {unit} | kernels per {unit} |", "|---|---|---|"]
    return "\n".join(head + rows) + "\n\n" + "\n\n".join(tables)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="lily", help="stock, stock-kernels, lily or lily-off:<switch>")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2, help="profiled decode steps")
    ap.add_argument("--warmup", type=int, default=4, help="decode steps before profiling")
    ap.add_argument("--prefill-chunk", type=int, default=0, metavar="L",
                    help="profile --steps prompt chunks of L tokens after --context cached ones, not decode steps")
    ap.add_argument("--summarise", metavar="CSV", help="print the table from an ncu --csv log instead")
    ap.add_argument("--copy-probe", action="store_true",
                    help="profile a 1 GiB copy instead of decode steps (--compare runs it to hold the attention "
                         "kernels' GB/s against a copy at the same clocks)")
    ap.add_argument("--compare", metavar="ENGINES", help="comma-separated engines, each profiled under ncu in its "
                    "own process (ncu on the PATH); prints the comparison")
    ap.add_argument("--out", default=None, help="--compare: folder for the ncu logs and step_gpu_time.md")
    ap.add_argument("--clock-control", choices=("base", "none"), default="base",
                    help="--compare: ncu's clock control; base (its default, as the tables before 2026-12-04) locks "
                         "the SM clock to its base, none leaves it as the e2e runs find it")
    ap.add_argument("--cache-control", choices=("all", "none"), default="all",
                    help="--compare: ncu's cache control; all (its default, as the tables before 2026-12-04) flushes "
                         "the caches before each kernel, none leaves in L2 what the kernels before left there")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant (a Python literal) before profiling, in every engine's process "
                         "(repeatable), e.g. lily_mlx.ops.attention.kernels.LIVE_WIDE_MIN_CAPACITY=0")
    args = ap.parse_args(argv)
    apply_settings(args.set)
    if args.summarise:
        unit = f"prompt chunk of {args.prefill_chunk} tokens" if args.prefill_chunk else "decode step"
        print(summarise(args.summarise, args.steps, unit))
        return 0
    if args.compare:
        out_dir = args.out or tempfile.mkdtemp(prefix="step_gpu_time_")
        text = compare([e.strip() for e in args.compare.split(",") if e.strip()], args.context, args.steps, out_dir,
                       chunk=args.prefill_chunk, settings=args.set, clock_control=args.clock_control,
                       cache_control=args.cache_control)
        with open(os.path.join(out_dir, "step_gpu_time.md"), "w") as f:
            f.write(text + "\n")
        print(text)
        return 0
    if args.copy_probe:
        profile_copy()
    elif args.prefill_chunk:
        profile_prefill(args.engine, args.context, args.prefill_chunk, args.steps)
    else:
        profile(args.engine, args.context, args.steps, args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
