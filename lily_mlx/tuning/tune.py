"""``python -m lily_mlx tune``: on this machine and backend, check every kernel against its reference,
time every kernel-vs-reference choice and every switch A/B, check the MoE block's batch invariance, and write the
tune profile patch() applies (``core.tune_profile``) plus a Markdown report. How to use it: docs/usage.md.

Choices are per op and per switch, not per shape class: a token's result must not depend on the call
it comes in (batch invariance), and MLX-LM pads a 1-token prompt chunk alone (a decode-shaped call)
to the batch's longest chunk, so an op choosing differently at T = 1 and T > 1 would compute the same
token two ways. The timings of each shape class are in the report; the choice weighs them equally
(geometric mean of the time ratios).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..core import dispatch, switches, tune_profile
from ..core.kernel_registry import record_launches
from . import layers
from .layers import LayerCache, LayerCase, ShapeClass

FULL_CLASSES = (layers.decode(1024), layers.decode(16 * 1024), layers.decode(16 * 1024, kv_bits=4),
                layers.decode(16 * 1024, batch=4), layers.prefill(512), layers.prefill(2048), layers.prefill(8192))
QUICK_CLASSES = (layers.decode(32), layers.decode(32, kv_bits=4), layers.decode(32, batch=4), layers.prefill(32))

SLOWER = 1.03  # a kernel (switch state) loses only beyond this time ratio: below it is timing noise
# Largest |kernel - reference| of a layer's output (or cache) over its largest |reference|: bf16
# rounding measures up to 0.034 on the embedded model (decode attention, then its 4-bit o_proj); a
# wrong kernel is O(1), also where only a few rows are wrong (a relative L2 norm would dilute those).
TOLERANCE = 0.1

NEVER_ALONE = "kept: its kernel does not run on its own at these shapes (part of another op's kernel)"

# The DeltaNet decode kernel computes a token with the arithmetic of the prefill kernels (batch
# invariance: a 1-token prompt chunk alone is a decode step). When one of those runs its reference,
# the decode op must too, so that decode-shaped calls take the prefill path, the same ops.
FOLLOWS = {"deltanet_decode": ("deltanet_gates", "deltanet_scan", "deltanet_gated_norm")}


def _say(message: str) -> None:
    print(f"[tune] {message}", flush=True)


# --------------------------------------------------------------------------------------------------
# Variants: which ops run their reference, which switches are off


@contextlib.contextmanager
def variant(reference: Sequence[str] = (), disable: Sequence[str] = ()):
    """Run a block with these ops on their reference and these switches off (the dispatch plan is
    resolved for it, as patch() does, so calls inside see one dict lookup as always)."""
    saved = os.environ.get("LILY_REFERENCE_OPS", "")
    os.environ["LILY_REFERENCE_OPS"] = ",".join(sorted(reference))
    dispatch.resolve()
    try:
        with switches.overrides(disable=disable):
            yield
    finally:  # variants nest (a cache is filled inside a check)
        os.environ["LILY_REFERENCE_OPS"] = saved
        dispatch.resolve()


def _error(got: mx.array, want: mx.array) -> float:
    """Largest |difference| relative to the largest |reference| value (inf for NaN or inf, or for
    another shape)."""
    if got.shape != want.shape:
        return math.inf
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    err = float(mx.max(mx.abs(got - want)).item())
    scale = float(mx.max(mx.abs(want)).item())
    return err / max(scale, 1e-30) if math.isfinite(err) else math.inf


class Bench:
    """The model's layers at the shape classes; runs a call sequence for a check or a timing."""

    def __init__(self, model, classes: Sequence[ShapeClass], seed: int = 0):
        self.model, self.classes, self.seed = model, tuple(classes), seed
        self.cases = layers.layer_cases(model)
        self._caches: Dict[Tuple[str, str], LayerCache] = {}

    def classes_for(self, family: str) -> List[ShapeClass]:
        """The shape classes at which a layer of ``family`` is checked and timed (``ShapeClass.applies_to``)."""
        return [c for c in self.classes if c.applies_to(family)]

    def cache(self, case: LayerCase, shape: ShapeClass) -> LayerCache:
        key = (case.family, shape.name)
        if key not in self._caches:
            with variant(reference=tuple(self.cases)):  # every variant starts from the same context
                self._caches[key] = LayerCache(self.model, case, shape.context, self.seed + 1, shape.kv_bits,
                                               shape.batch)
        return self._caches[key]

    def call(self, case: LayerCase, shape: ShapeClass) -> Callable[[], List[mx.array]]:
        """One call at the shape class from the rewound cache: (output, cache arrays) to evaluate."""
        cache = self.cache(case, shape)
        x = case.inputs(shape.tokens, self.seed + 2, shape.rows)

        def run():
            return [case(x, cache.rewind()), *cache.arrays()]

        return run

    def check_outputs(self, case: LayerCase, shape: ShapeClass) -> List[mx.array]:
        """The call at the shape class, the cache it leaves (recurrent and conv state, KV), and one
        decode step on that cache: each compared with the reference's on its own scale."""
        cache = self.cache(case, shape)
        outs = [case(case.inputs(shape.tokens, self.seed + 2, shape.rows), cache.rewind())]
        outs += cache.state()
        outs.append(case(case.inputs(1, self.seed + 3, shape.rows), cache.cache))
        mx.eval(outs)
        return outs


def _launches(run: Callable[[], List[mx.array]]) -> Dict[str, int]:
    with record_launches() as rec:
        mx.eval(run())
    return rec.counts()


def time_pair(run, enter_a, enter_b, rounds: int, reps: int) -> Tuple[float, float]:
    """Median seconds per ``run()`` in variants A and B (``enter_*()``: context managers): rounds
    alternate which goes first (drift and background load hit both alike); each variant is warmed up
    first (compilation)."""
    times: Tuple[List[float], List[float]] = ([], [])
    for enter in (enter_a, enter_b):
        with enter():
            mx.eval(run())
    for r in range(rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            with (enter_a, enter_b)[i]():
                start = time.perf_counter()
                for _ in range(reps):
                    mx.eval(run())
                times[i].append((time.perf_counter() - start) / reps)
    return statistics.median(times[0]), statistics.median(times[1])


def _geomean(ratios: Sequence[float]) -> float:
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def _classes_for(phase: str, classes: Sequence[ShapeClass], family: str) -> List[ShapeClass]:
    return [c for c in classes if (phase == "both" or c.phase == phase) and c.applies_to(family)]


# --------------------------------------------------------------------------------------------------
# The three steps


def kernel_ops(bench: Bench, backend: str):
    from ..ops import OPS

    return [op for op in OPS.values()
            if (backend in op.kernel_backends or backend in op.trial_backends) and op.family in bench.cases]


def decide_trials(ops, backend: str, op_rows: List[dict], pinned: Dict[str, str]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """Trial kernels (``Op.trial_backends``) run only where measured faster than their reference beyond
    noise (time ratio below 1 / SLOWER). Returns (op -> why it stays on its reference, op -> why it runs)."""
    ratios: Dict[str, List[float]] = {}
    for row in op_rows:
        ratios.setdefault(row["op"], []).append(row["ratio"])
    off, on = {}, {}
    for op in ops:
        if backend in op.kernel_backends or op.name in pinned:
            continue
        if op.name not in ratios:
            off[op.name] = "trial kernel: it does not run alone at these shapes, so it stays off"
            continue
        g = _geomean(ratios[op.name])
        if g < 1 / SLOWER:
            on[op.name] = f"trial kernel faster than its reference here (time x{g:.2f})"
        else:
            off[op.name] = f"trial kernel not faster than its reference here (time x{g:.2f})"
    return off, on


def check_kernels(bench: Bench, ops) -> Tuple[List[dict], Dict[str, str], Dict[str, str]]:
    """Step 1: each op's kernel alone (every other op on its reference) against all references, in
    the default switch state and with each of its switches that are on by default off (a switch off by default, a
    candidate, is off in the default check already), at every shape class; then each family's kernels together.
    Returns (rows, op -> why pinned, switch -> why never off)."""
    plans = [(op, off, shape) for op in ops
             for off in [()] + [(s,) for s in op.switches if switches.SWITCHES[s].default]
             for shape in bench.classes_for(op.family)]
    families = sorted({op.family for op in ops})
    total = len(plans) + sum(len(bench.classes_for(family)) for family in families)
    want: Dict[Tuple[str, str], List[mx.array]] = {}
    for family in families:
        with variant(reference=tuple(bench.cases)):
            for shape in bench.classes_for(family):
                want[family, shape.name] = bench.check_outputs(bench.cases[family], shape)
    rows, pinned, bad_off = [], {}, {}

    def check(n, label, family, shape, reference, off):
        failure = None
        with variant(reference=reference, disable=off), record_launches() as rec:
            try:
                got = bench.check_outputs(bench.cases[family], shape)
            except Exception as e:  # a kernel that fails to build or run here counts as wrong, not fatal
                failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        err = math.inf if failure else max(_error(g, w) for g, w in zip(got, want[family, shape.name]))
        ran = bool(rec) or failure is not None
        ok = err <= TOLERANCE
        verdict = (f"FAILED ({failure})" if failure else f"{'ok' if ok else 'DIFFERS'} (error {err:.2g})" if ran
                   else "its kernel does not run alone here (part of another op's kernel)")
        _say(f"check {n}/{total} {label} @ {shape.name}: {verdict}")
        row = {"what": label, "class": shape.name, "ran": ran, "error": err, "ok": ok or not ran}
        if failure:
            row["failure"] = failure
        return row

    n = 0
    for op, off, shape in plans:
        n += 1
        label = op.name + (f" ({off[0]} off)" if off else "")
        row = check(n, label, op.family, shape, [o.name for o in ops if o is not op], off)
        rows.append(row)
        if not row["ok"]:
            why = (f"kernel failed at {shape.name} ({row['failure']})" if "failure" in row else
                   f"kernel differs from its reference at {shape.name} (error {row['error']:.2g})")
            if off:
                bad_off.setdefault(off[0], f"off variant of {op.name}: {why}")
            else:
                pinned.setdefault(op.name, why)
    for family in families:
        mine = [op.name for op in ops if op.family == family]
        for shape in bench.classes_for(family):
            n += 1
            row = check(n, f"{family} kernels together", family, shape,
                        [f for f in families if f != family], ())
            rows.append(row)
            if not row["ok"] and not any(name in pinned for name in mine):
                for name in mine:  # no single op to blame: the family runs its references
                    pinned.setdefault(name, f"{family} kernels together differ from their references "
                                            f"at {shape.name} (error {row['error']:.2g})")
    return rows, pinned, bad_off


def time_ops(bench: Bench, ops, pinned: Dict[str, str], rounds: int, reps: int):
    """Step 2a: each op kernel vs reference (all other choices as shipped) at each shape class where
    its kernel runs. Returns (rows, op -> why it takes its reference)."""
    todo = [(op, shape) for op in ops if op.name not in pinned for shape in bench.classes_for(op.family)]
    rows, ratios = [], {}
    base = tuple(pinned)
    for n, (op, shape) in enumerate(todo, 1):
        run = bench.call(bench.cases[op.family], shape)
        kernel = functools.partial(variant, reference=base)
        reference = functools.partial(variant, reference=base + (op.name,))
        with kernel():
            launched = _launches(run)
        with reference():
            runs_here = launched != _launches(run)
        if not runs_here:
            _say(f"time {n}/{len(todo)} {op.name} @ {shape.name}: its kernel does not run here")
            continue
        t_kernel, t_ref = time_pair(run, kernel, reference, rounds, reps)
        ratio = t_kernel / t_ref
        ratios.setdefault(op.name, []).append(ratio)
        rows.append({"op": op.name, "class": shape.name, "kernel_ms": 1e3 * t_kernel,
                     "reference_ms": 1e3 * t_ref, "ratio": ratio})
        _say(f"time {n}/{len(todo)} {op.name} @ {shape.name}: kernel {1e3 * t_kernel:.3f} ms, "
             f"reference {1e3 * t_ref:.3f} ms (x{ratio:.2f})")
    slower = {}
    for name, rs in ratios.items():
        g = _geomean(rs)
        if g > SLOWER:
            slower[name] = f"kernel slower than its reference (time x{g:.2f})"
    return rows, slower


def follow(pinned: Dict[str, str]) -> Dict[str, str]:
    """The ops that must follow a pinned op to its reference (:data:`FOLLOWS`)."""
    out = {}
    for name, leaders in FOLLOWS.items():
        lead = next((op for op in leaders if op in pinned), None)
        if lead is not None and name not in pinned:
            out[name] = f"follows {lead} to its reference (batch invariance)"
    return out


def time_switches(bench: Bench, ops, pinned: Dict[str, str], bad_off: Dict[str, str], rounds: int,
                  reps: int):
    """Step 2b: each switch on vs off, in its phase's shape classes, with the op choices made.
    Returns (rows, switch -> why it is off, switch -> why not timed)."""
    live = {}  # switch -> families whose ops read it and run their kernel
    for op in ops:
        if op.name not in pinned:
            for name in op.switches:
                live.setdefault(name, set()).add(op.family)
    untimed = {s: "its ops run their reference here" for s, sw in switches.SWITCHES.items()
               if s not in live and sw.family != "generation"}
    untimed.update({s: "generation level (how prompts are chunked, traced or scheduled), not a kernel choice"
                    for s, sw in switches.SWITCHES.items() if sw.family == "generation"})
    # A profile turns switches off, never on: a switch off by default stays off, untimed (LILY_ENABLE turns it on).
    default_off = {s: "off by default (LILY_ENABLE turns it on)" for s, sw in switches.SWITCHES.items() if not sw.default}
    live = {s: families for s, families in live.items() if s not in default_off}
    todo = [(name, family, shape) for name in live for family in sorted(live[name])
            for shape in _classes_for(switches.SWITCHES[name].phase, bench.classes, family)]
    base = tuple(pinned)
    rows, ratios = [], {}
    for n, (name, family, shape) in enumerate(todo, 1):
        run = bench.call(bench.cases[family], shape)
        t_on, t_off = time_pair(run, functools.partial(variant, reference=base),
                                functools.partial(variant, reference=base, disable=(name,)), rounds, reps)
        ratios.setdefault(name, []).append(t_on / t_off)
        rows.append({"switch": name, "family": family, "class": shape.name, "on_ms": 1e3 * t_on,
                     "off_ms": 1e3 * t_off, "ratio": t_on / t_off})
        _say(f"time {n}/{len(todo)} switch {name} @ {shape.name}: on {1e3 * t_on:.3f} ms, "
             f"off {1e3 * t_off:.3f} ms (x{t_on / t_off:.2f})")
    off = dict(default_off)
    for name, rs in ratios.items():
        g = _geomean(rs)
        if g > SLOWER and name not in bad_off:
            off[name] = f"slower on than off (time x{g:.2f})"
    return rows, off, untimed


def _moe_invariance_once(bench: Bench, label: str) -> dict:
    """One token's output of the MoE decoder layer's work after its mixer (``post_mixer``: residual add, norm,
    router, experts, combine; every op lily's) alone, in a decode batch and in a prompt chunk past the decode
    forms' size, compared bitwise. Returns a row for the report."""
    from ..ops.moe.kernels import LARGE_TILE, PER_ASSIGNMENT_MAX
    from ..ops.moe.layer import post_mixer

    case = bench.cases["moe"]
    layer = bench.model.layers[case.index]
    top_k, experts = layer.mlp.top_k, layer.mlp.switch_mlp.gate_proj["scales"].shape[0]
    per_call = max(1, PER_ASSIGNMENT_MAX // top_k)  # tokens a call of the decode forms takes
    # The chunk: past the decode forms, and with as many rows an expert on average as the large tiles take (a
    # prompt chunk's tiles: 1,024 tokens at Qwen3.6's 256 experts, top-8), at most MLX-LM's chunk of 2,048.
    batch = min(8, per_call)
    chunk = min(max(2 * per_call + 1, -(-LARGE_TILE * experts // top_k)), 2048)
    hidden = case.norm.weight.shape[-1]
    k1, k2 = mx.random.split(mx.random.key(bench.seed + 5))
    x = mx.random.normal((1, chunk, hidden), key=k1).astype(case.dtype)
    mixed = (0.5 * mx.random.normal((1, chunk, hidden), key=k2)).astype(case.dtype)
    row = {"what": label, "tokens": [1, batch, chunk]}
    try:
        whole = post_mixer(layer, x, mixed)  # [1, chunk, hidden]
        tokens = sorted({0, batch - 1, chunk - 1})
        alone = [post_mixer(layer, x[:, t:t + 1], mixed[:, t:t + 1]) for t in tokens]
        rows = post_mixer(layer, x[0, :batch, None], mixed[0, :batch, None])  # [batch, 1, hidden]
        mx.eval(whole, alone, rows)
        row["equal"] = (all(bool(mx.array_equal(a[0, 0], whole[0, t]).item()) for a, t in zip(alone, tokens))
                        and bool(mx.array_equal(rows[:, 0], whole[0, :batch]).item()))
    except Exception as e:  # as in the checks: a failure here is a finding, not the end of the run
        row["equal"], row["failure"] = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return row


def check_invariance(bench: Bench, pinned: Dict[str, str], off: Dict[str, str],
                     bad_off: Optional[Dict[str, str]] = None) -> Tuple[List[dict], Dict[str, str]]:
    """Step 3: batch invariance on this device, with the choices made. The MoE decode forms (row GEMVs, up to
    ``PER_ASSIGNMENT_MAX`` expert assignments a call) and the GEMM tiles of larger calls are written to give a
    token the same bits (every product added in K order; docs/moe.md), which the simulator and the bridge show;
    Apple does not document the order inside its ``simdgroup_matrix`` multiply-accumulate, so it is checked where
    the profile is made. Where the token's bits differ, ``row_gemv`` off (decode calls then take the GEMM tiles
    too) is checked and, when that holds, chosen (not where step 1 found row_gemv's off state wrong: ``bad_off``).
    Returns (rows, switch -> why off)."""
    if "moe" not in bench.cases:
        return [], {}
    rows, turned_off = [], {}
    tries = [()] if "row_gemv" in off or "row_gemv" in (bad_off or {}) else [(), ("row_gemv",)]
    for extra in tries:
        label = "MoE token alone / in a decode batch / in a prompt chunk" + (f" ({extra[0]} off)" if extra else "")
        with variant(reference=tuple(pinned), disable=tuple(off) + extra):
            row = _moe_invariance_once(bench, label)
        rows.append(row)
        failure = f" ({row['failure']})" if "failure" in row else ""
        _say(f"invariance: {label}: {'bitwise equal' if row['equal'] else 'DIFFER' + failure}")
        if row["equal"]:
            if extra:
                first = rows[0]
                why = (f"the check failed with it on ({first['failure']})" if "failure" in first else
                       "with it on a token's MoE output differs between a decode call and a prompt chunk")
                turned_off[extra[0]] = f"batch invariance: {why} on this device"
            return rows, turned_off
    stock = sorted(name for name in pinned if name.startswith("moe_"))
    gemv_off = bool(tries[-1]) or "row_gemv" in off
    _say("warning: the MoE block is not batch invariant on this device"
         + (" even with row_gemv off" if gemv_off else "") + " (a token's bits depend on the call it comes in)"
         + (f"; {', '.join(stock)} run(s) MLX's own ops here" if stock else "") + "; the report says so")
    return rows, turned_off


# --------------------------------------------------------------------------------------------------
# The command


def tune(model, model_name: str, classes: Sequence[ShapeClass], rounds: int, reps: int,
         command: str = "") -> dict:
    """Check, time and decide on an already loaded model; returns the profile (a dict)."""
    import lily_mlx
    from ..core.backend import resolve_backend

    lily_mlx.patch(model)
    backend = resolve_backend()
    for name in switches.SWITCHES:  # measured from the shipped defaults, whatever the environment says
        switches.set_enabled(name, switches.SWITCHES[name].default)
    bench = Bench(model, classes)
    ops = kernel_ops(bench, backend)
    trial = {op.name for op in ops if backend not in op.kernel_backends}
    # The trial kernels it decides are checked and timed like the others (every op family has a case:
    # layers.layer_cases); one it had no case for would stay as the environment says (off unless LILY_TRIAL_OPS
    # names it), so that every check and timing is of what ships.
    with dispatch.trial_kernels_on(trial):
        _say(f"backend {backend}, device {tune_profile.device_name()}; {len(ops)} ops with kernels: "
             f"{', '.join(op.name + (' (trial)' if op.name in trial else '') for op in ops)}; shape classes: "
             f"{', '.join(c.name for c in classes)}")
        check_rows, wrong, bad_off = check_kernels(bench, ops)
        pinned = dict(wrong)
        pinned.update(follow(pinned))
        op_rows, slower = time_ops(bench, ops, pinned, rounds, reps)
        pinned.update(slower)
        trials_off, trials_on = decide_trials(ops, backend, op_rows, pinned)
        pinned.update(trials_off)
        pinned.update(follow(pinned))
        switch_rows, off, untimed = time_switches(bench, ops, pinned, bad_off, rounds, reps)
        invariance_rows, not_invariant = check_invariance(bench, pinned, off, bad_off)
        off.update(not_invariant)
    timed = {row["op"] for row in op_rows}
    return {
        "format": tune_profile.FORMAT,
        "key": tune_profile.device_key(backend),
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "model": model_name,
        "classes": [c.name for c in classes],
        "rounds": rounds,
        "tolerance": TOLERANCE,
        "slower_ratio": SLOWER,
        "ops": {op.name: {"choice": "reference" if op.name in pinned else "kernel",
                          **({"trial": True} if op.name in trial else {}),
                          **({"reason": pinned[op.name]} if op.name in pinned else
                             {"reason": trials_on[op.name]} if op.name in trials_on else
                             {} if op.name in timed else {"note": NEVER_ALONE})} for op in ops},
        "switches": {name: {"choice": "off" if name in off else "on",
                            **({"reason": off[name]} if name in off else
                               {"note": untimed[name]} if name in untimed else
                               {"note": bad_off[name]} if name in bad_off else {})}
                     for name in switches.SWITCHES},
        "checks": check_rows,
        "op_timings": op_rows,
        "switch_timings": switch_rows,
        "invariance": invariance_rows,
    }


def _unwritable_folder(folder) -> Optional[str]:
    """Why the profile could not be written into ``folder`` (made if missing), or None."""
    from pathlib import Path

    path = Path(folder).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return None
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def write(profile: dict, folder) -> Tuple[str, str]:
    """Write ``<key>.json`` and ``<key>.md`` into ``folder``; returns their paths."""
    from pathlib import Path

    from .report import markdown

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / tune_profile.profile_filename(profile["key"])
    path.write_text(json.dumps(profile, indent=1) + "\n")
    report = path.with_suffix(".md")
    report.write_text(markdown(profile))
    return str(path), str(report)


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    from ..core.backend import CHOICES

    parser = argparse.ArgumentParser(
        prog="python -m lily_mlx tune",
        description="Tune lily-mlx for this machine. (1) Check every kernel against its reference at the "
        "model's shapes: a kernel that differs is pinned to its reference. (2) Time each op's kernel against "
        "its reference, and each switch on against off, at the shape classes the model runs (decode at a "
        "few contexts, prefill chunks), alternating order, medians. (3) Check that a token's MoE output has the "
        "same bits alone, in a decode batch and in a prompt chunk (batch invariance; where it does not, row_gemv "
        "goes off if that restores it). (4) Write a profile (JSON) that "
        "patch() and --lily apply on this device, backend, MLX and lily-mlx version (an op whose kernel "
        "is slower takes its reference; a switch slower on is turned off), and a Markdown report to share. "
        "LILY_TUNE=off makes patch() ignore profiles.",
        epilog="Shape classes: " + ", ".join(c.name for c in FULL_CLASSES) + " (--quick: "
        + ", ".join(c.name for c in QUICK_CLASSES) + "); decode@N is one token after N in the cache (/kv4: a 4-bit "
        "cache; /b4: a server's batch of 4 rows of N, N/2, N/4 and N/8), "
        "prefill@N a prompt chunk of N tokens. Choices are per op and per switch, not per shape class: a "
        "token must get the same arithmetic alone (a 1-token prompt chunk is decode-shaped) and padded into "
        "a batch's longer chunk. On a Mac: python -m lily_mlx tune --model mlx-community/Qwen3.6-35B-A3B-4bit",
    )
    parser.add_argument("--model", default=None,
                        help="model folder or Hugging Face repo; tune with the model you run, the choices "
                        "depend on its shapes (default: the embedded tiny model)")
    parser.add_argument("--quick", action="store_true",
                        help="one small decode and one small prefill shape, 3 rounds: a smoke run (minutes "
                        "on the simulator), not a profile to trust for speed")
    parser.add_argument("--out", default=None,
                        help="folder for the profile and report (default: LILY_TUNE_DIR, else "
                        "~/.cache/lily_mlx/tune: where patch() looks)")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds per A/B (default 5; --quick 3)")
    parser.add_argument("--lily-backend", choices=CHOICES, type=str.lower, default=None,
                        help="kernel backend to tune (sets LILY_BACKEND; default auto)")
    args = parser.parse_args(argv)
    folder = args.out or str(tune_profile.tune_dir())
    problem = _unwritable_folder(folder)
    if problem:  # said now, not after minutes of measuring
        from_env = not args.out and os.environ.get(tune_profile.TUNE_DIR_ENV)
        parser.error(f"cannot write the profile to {folder}: {problem}" + (
            f" (from {tune_profile.TUNE_DIR_ENV}; --out picks another folder)" if from_env else ""))
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1 (got {args.rounds})")

    if args.lily_backend:
        os.environ["LILY_BACKEND"] = args.lily_backend
    # The measurement starts from the shipped choices: no profile, no user overrides.
    ignored = [v for v in ("LILY_REFERENCE_OPS", "LILY_DISABLE", "LILY_ENABLE") if os.environ.get(v)]
    if ignored:
        _say(f"ignoring {', '.join(ignored)} while tuning (every choice is measured from the defaults)")
    for var in ignored:
        os.environ.pop(var)
    os.environ[tune_profile.TUNE_ENV] = "off"

    from ..core.backend import resolve_backend
    from ..core.environment import LilyConfigError
    from ..patch import check_environment

    try:
        check_environment()
        backend = resolve_backend()
    except (LilyConfigError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if backend == "reference":
        print("error: nothing to tune on the reference backend (no kernels run); on a Mac the backend is "
              "metal, elsewhere pick one with --lily-backend", file=sys.stderr)
        return 2

    import mlx_lm

    model_name = args.model
    if model_name is None:
        from ..models.embedded import embedded_model_path

        model_name = str(embedded_model_path())
    classes = QUICK_CLASSES if args.quick else FULL_CLASSES
    rounds = args.rounds or (3 if args.quick else 5)
    reps = 2 if args.quick else 3
    start = time.perf_counter()
    model, _ = mlx_lm.load(model_name)
    command = "python -m lily_mlx tune " + " ".join(argv if argv is not None else sys.argv[1:])
    profile = tune(model, model_name, classes, rounds, reps, command=command.strip())
    path, report = write(profile, folder)
    pinned = {k: v for k, v in profile["ops"].items() if v["choice"] == "reference"}
    off = {k: v for k, v in profile["switches"].items() if v["choice"] == "off"}
    _say(f"done in {time.perf_counter() - start:.0f} s: {len(pinned)} op(s) on their reference"
         + "".join(f"\n  {k}: {v['reason']}" for k, v in pinned.items())
         + f"\n  {len(off)} switch(es) off" + "".join(f"\n  {k}: {v['reason']}" for k, v in off.items()))
    _say(f"profile: {path}")
    _say(f"report:  {report}")
    if args.out and os.path.abspath(folder) != os.path.abspath(str(tune_profile.tune_dir())):
        _say(f"patch() reads profiles from {tune_profile.tune_dir()}; set LILY_TUNE_DIR={folder} to use this one")
    return 0
