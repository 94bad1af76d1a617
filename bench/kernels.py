"""Kernel microbenchmarks: each lily-mlx kernel alone at the model's shapes, against the device's
measured ceilings (a large copy for bandwidth, a large bf16 matmul for arithmetic).

The kernels and their exact arguments are captured from the model itself: one prefill chunk and one
decode step of the patched model run with a recording wrapper around the kernel registry's factory,
so every kernel is timed with the inputs, grid and template the model really uses (first call of each
kernel per phase). Achieved bandwidth counts each input and output byte once (a lower bound on the
traffic), except that a decode GEMV reads only its token's experts of a stacked expert array ([E, ...]): top_k / E
of it (until 2026-12-05 the whole stack was counted, and the routed decode GEMVs showed 160-250 % of copy). Each
evaluation repeats the call on the same inputs, so a decode kernel's weights (~10 MB for Qwen3.6's gate+up) are
served from the L2 cache after the first call: its GB/s is not DRAM's; the op cases (``lily_dev.moe_bench``) read
new experts each call. TFLOP/s is given for the grouped GEMMs only (2 * rows * out * in, gate+up counted twice).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Tuple

import mlx.core as mx


def _time(fn: Callable[[], object], iters: int, per_eval: int = 8, warmup: int = 2) -> float:
    """Seconds per call: ``per_eval`` independent calls evaluated together, ``iters`` times."""
    for _ in range(warmup):
        mx.eval([fn() for _ in range(per_eval)])
    mx.synchronize()
    tic = time.perf_counter()
    for _ in range(iters):
        mx.eval([fn() for _ in range(per_eval)])
    mx.synchronize()
    return (time.perf_counter() - tic) / (iters * per_eval)


def ceilings(log=print) -> Dict[str, float]:
    """Measured copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s)."""
    gpu = mx.default_device() == mx.gpu
    x = mx.random.uniform(shape=((256 if gpu else 4) * 1024 * 1024,)).astype(mx.float32)  # 1 GiB on a GPU
    mx.eval(x)
    t = _time(lambda: x * 1.0, iters=5, per_eval=2)
    copy_gbs = 2 * x.nbytes / t / 1e9
    del x
    n = 8192 if gpu else 512
    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    b = mx.random.normal((n, n)).astype(mx.bfloat16)
    mx.eval(a, b)
    t = _time(lambda: a @ b, iters=5, per_eval=2)
    mm_tflops = 2 * n ** 3 / t / 1e12
    out = {"copy_GBps": copy_gbs, "matmul_bf16_TFLOPs": mm_tflops}
    if log:
        log(f"[kernels] ceilings: copy {copy_gbs:,.0f} GB/s, bf16 matmul {mm_tflops:,.1f} TFLOP/s")
    return out


def record_kernel_calls(model, prefill_tokens: int, vocab_size: int, log=print) -> List[Tuple]:
    """[(phase, kernel name, kernel, call kwargs)] from one prefill chunk and one decode step of the
    patched model (the model is left unpatched)."""
    import lily_mlx
    from lily_mlx.core import switches
    from lily_mlx.core.kernel_registry import record_launches
    from mlx_lm.models.cache import make_prompt_cache

    calls: List[Tuple] = []
    try:
        lily_mlx.patch(model)
        cache = make_prompt_cache(model)
        prompt = mx.random.randint(0, vocab_size, (1, prefill_tokens), key=mx.random.key(1))
        for phase, tokens in (("prefill", prompt), ("decode", prompt[:, -1:])):
            # Launches built while a decode step is traced (compiled_decode, on Metal and CUDA) hold the trace's
            # placeholder arrays, which cannot be evaluated or re-run: record the launches of a step built op by op.
            with switches.overrides(disable=["compiled_decode"]), record_launches() as record:
                mx.eval(model(tokens, cache=cache))
            calls += [(phase, launch.name, launch.kernel, launch.kwargs) for launch in record]
        mx.eval([kw["inputs"] for _, _, _, kw in calls])
    finally:
        lily_mlx.unpatch(model)
    if log:
        log(f"[kernels] recorded {len(calls)} kernel calls "
            f"({len({(p, n) for p, n, _, _ in calls})} distinct kernel/phase pairs)")
    return calls


def _flops(name: str, kwargs) -> float:
    if "gemm" not in name:
        return 0.0
    x = kwargs["inputs"][0]
    out_size = 1
    for d in kwargs["output_shapes"][0]:
        out_size *= d
    return 2.0 * out_size * x.shape[-1] * (2 if "gate_up" in name else 1)


def bytes_read(phase: str, name: str, kwargs, top_k: int = None) -> int:
    """Bytes a call reads and writes, each once: its inputs and outputs, with a decode GEMV's stacked expert arrays
    (3-D, more than ``top_k`` along the first axis: the routed experts' weights, scales and biases) counted for the
    ``top_k`` experts one token reads."""
    nbytes = 0
    for a in kwargs["inputs"]:
        if not isinstance(a, mx.array):
            continue
        if top_k and phase == "decode" and "gemv" in name and a.ndim == 3 and a.shape[0] > top_k:
            nbytes += a.nbytes * top_k // a.shape[0]
        else:
            nbytes += a.nbytes
    for shape, dtype in zip(kwargs["output_shapes"], kwargs["output_dtypes"]):
        n = 1
        for d in shape:
            n *= d
        nbytes += n * dtype.size
    return nbytes


def microbench(calls: List[Tuple], ceil: Dict[str, float], iters: int = 20, log=print,
               top_k: int = None) -> List[Dict]:
    """Each recorded kernel/phase pair timed alone (8 calls an evaluation); ``top_k``: the model's experts a token
    (``bytes_read``)."""
    rows, seen = [], set()
    for phase, name, kernel, kwargs in calls:
        if (phase, name) in seen:
            continue
        seen.add((phase, name))
        t = _time(lambda: kernel(**kwargs), iters=iters)
        nbytes = bytes_read(phase, name, kwargs, top_k)
        flops = _flops(name, kwargs)
        row = {"phase": phase, "kernel": name, "us": t * 1e6, "bytes": nbytes, "GBps": nbytes / t / 1e9,
               "pct_copy": 100 * nbytes / t / 1e9 / ceil["copy_GBps"],
               "grid": list(kwargs["grid"]), "threadgroup": list(kwargs["threadgroup"])}
        if flops:
            row.update(flops=flops, TFLOPs=flops / t / 1e12,
                       pct_matmul=100 * flops / t / 1e12 / ceil["matmul_bf16_TFLOPs"])
        rows.append(row)
        if log:
            extra = f", {row['TFLOPs']:.2f} TFLOP/s ({row['pct_matmul']:.1f}%)" if flops else ""
            log(f"[kernels] {phase:>7} {name}: {row['us']:.1f} us, {row['GBps']:.1f} GB/s "
                f"({row['pct_copy']:.1f}% of copy){extra}")
    return rows


def table_markdown(rows: List[Dict], ceil: Dict[str, float]) -> str:
    lines = [f"Ceilings: copy {ceil['copy_GBps']:,.0f} GB/s, bf16 matmul {ceil['matmul_bf16_TFLOPs']:,.1f} TFLOP/s.",
             "", "| phase | kernel | us | GB/s | % copy | TFLOP/s | % matmul |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        tf = f"{r['TFLOPs']:.2f} | {r['pct_matmul']:.1f}" if "TFLOPs" in r else "- | -"
        lines.append(f"| {r['phase']} | {r['kernel']} | {r['us']:.1f} | {r['GBps']:.1f} | {r['pct_copy']:.1f} | {tf} |")
    return "\n".join(lines)


def op_cases(families=("moe", "deltanet", "attention"), min_seconds: float = 0.2, max_iters: int = 50,
             ceil: Dict[str, float] = None, log=print, match: str = None) -> List[Dict]:
    """Each family's microbenchmarks (``lily_dev.<family>_bench.microbench_cases()`` ->
    ``[(name, run_once, bytes_moved, flops)]``, each at Qwen3.6 shapes, lily and stock paths), timed
    here against the ceilings. ``match``: a regular expression; only cases whose name it finds run."""
    import importlib
    import re

    rows = []
    for family in families:
        try:
            cases = importlib.import_module(f"lily_dev.{family}_bench").microbench_cases()
        except Exception as e:  # a family's cases failing to build is reported, the rest still run
            rows.append({"family": family, "error": f"{type(e).__name__}: {e}"})
            log(f"[kernels] {family}: microbench cases failed: {e}")
            continue
        for name, run_once, nbytes, flops in cases:
            if match is not None and not re.search(match, name):
                continue
            try:
                run_once()
                run_once()
                n, tic = 0, time.perf_counter()
                while n < max_iters and (n < 3 or time.perf_counter() - tic < min_seconds):
                    run_once()
                    n += 1
                t = (time.perf_counter() - tic) / n
            except Exception as e:
                rows.append({"family": family, "case": name, "error": f"{type(e).__name__}: {e}"})
                log(f"[kernels] {family} {name}: failed: {e}")
                continue
            row = {"family": family, "case": name, "us": t * 1e6, "bytes": nbytes, "flops": flops,
                   "GBps": nbytes / t / 1e9, "TFLOPs": flops / t / 1e12}
            if ceil:
                row["pct_copy"] = 100 * row["GBps"] / ceil["copy_GBps"]
                row["pct_matmul"] = 100 * row["TFLOPs"] / ceil["matmul_bf16_TFLOPs"]
            rows.append(row)
            log(f"[kernels] {family} {name}: {row['us']:.1f} us, {row['GBps']:.1f} GB/s, {row['TFLOPs']:.2f} TFLOP/s")
    return rows


def op_cases_markdown(rows: List[Dict]) -> str:
    lines = ["| family | case | us | GB/s | % copy | TFLOP/s | % matmul |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r.get('case', '-')} | failed: {r['error'][:80]} | | | | |")
        else:
            lines.append(f"| {r['family']} | {r['case']} | {r['us']:.1f} | {r['GBps']:.1f} | {r.get('pct_copy', 0):.1f} | "
                         f"{r['TFLOPs']:.2f} | {r.get('pct_matmul', 0):.1f} |")
    return "\n".join(lines)
