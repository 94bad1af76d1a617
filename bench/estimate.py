"""How long the sweep's and the ablations' rows take on the H200: the figures behind ``--plan`` and
``--stop-at``.

Rates measured on one H200 (MLX 0.32.4 CUDA, 2026-11-30, docs/results/2026-11-30-*): prefill tok/s at
4K-32K stock ~250-290, stock-kernels ~1,900-2,000, lily ~2,600; pipelined decode ~30-70 tok/s; the
random full-size model builds in ~1 s. Estimates take the slow end. Above 32K the ten attention layers'
quadratic prefill work is added (81,920 N^2 FLOPs for an N-token causal prompt, at an assumed
100 TFLOP/s: +1 s at 32K, +3.5 s at 64K, +14 s at 128K). A first-time kernel compile is not a rate: it is
``FIRST_COMPILE_S`` per process (a fresh machine; MLX keeps compiled kernels under /tmp/mlx, so a later
process on the same machine pays less) plus ``VARIANT_COMPILE_S`` per lily-off state in the ablations.

``Clock`` corrects the estimates with what the rows of this process actually took, so ``--stop-at``
stops before a row that would not finish in time.
"""

from __future__ import annotations

import time
from typing import Dict, Iterable, Optional, Sequence

PREFILL_TPS = {"stock": 250.0, "stock-kernels": 1900.0, "lily": 2500.0}
# lily with one switch off prefills at this fraction of lily's rate (H200, 2026-11-30 ablations).
OFF_PREFILL_FACTOR = {"fused_dequant": 0.5, "gpu_routing": 0.75, "adaptive_tile": 0.8}
PREFILL_OVERHEAD_S = 0.25  # per prefill: first token, allocation, a clear_cache
ATTENTION_FLOPS_PER_TOKEN2 = 81920.0  # 10 layers x 16 heads x head dim 256 x 2 matmuls x 2 FLOPs / 2 (causal)
ATTENTION_FLOPS_PER_S = 1.0e14
DECODE_TPS = 35.0
DECODE_OVERHEAD_S = 0.5  # per decode run: the first step, copying the shared cache
FIRST_COMPILE_S = 100.0  # per process on a fresh machine (~1-2 min measured)
VARIANT_COMPILE_S = 15.0  # per lily-off:<switch> state in the ablations (2-28 s measured)
MODEL_BUILD_S = 10.0  # the random full-size model (~1 s on the H200) plus imports


def base(engine: str) -> str:
    return engine.split("@", 1)[0]


def prefill_s(engine: str, n: int) -> float:
    """Seconds for one prefill of ``n`` tokens by ``engine``."""
    engine = base(engine)
    if engine.startswith("lily-off:"):
        factor = min(OFF_PREFILL_FACTOR.get(s, 0.9) for s in engine[len("lily-off:"):].split("+"))
        rate = PREFILL_TPS["lily"] * factor
    else:
        rate = PREFILL_TPS.get(engine, PREFILL_TPS["stock"])
    return PREFILL_OVERHEAD_S + n / rate + ATTENTION_FLOPS_PER_TOKEN2 * n * n / ATTENTION_FLOPS_PER_S


def decode_s(tokens: int) -> float:
    """Seconds for one engine to decode ``tokens`` tokens (generate_step, pipelined)."""
    return DECODE_OVERHEAD_S + (tokens + 1) / DECODE_TPS


def profile_s(steps: int) -> float:
    """Seconds of one engine's decode-profile round: ``steps`` steps built and evaluated one by one, then
    ``steps`` pipelined, plus the first step."""
    return DECODE_OVERHEAD_S + steps * (1.0 / 25.0 + 1.0 / DECODE_TPS)


def e2e_row_s(length: int, engines: Sequence[str], rounds: int, gen_tokens: int, prefill: bool, decode: bool,
              shared_prefill: bool = False, max_prefill: Optional[Dict[str, int]] = None) -> float:
    """Seconds for one length of the e2e sweep (every round, every engine)."""
    max_prefill = max_prefill or {}
    own = [e for e in engines if length <= max_prefill.get(e, length)]
    per_round = 0.0
    if shared_prefill:
        shared = "lily" if "lily" in engines else engines[0]
        measured = own if prefill else []
        per_round += sum(prefill_s(e, length) for e in measured)
        if shared not in measured:  # the shared cache is prefilled either way
            per_round += prefill_s(shared, length)
        if decode:
            per_round += len(engines) * decode_s(gen_tokens)
    else:
        per_round += sum(prefill_s(e, length) + (decode_s(gen_tokens) if decode else 0.2) for e in own)
    return rounds * per_round


def ablation_prefill_s(switch: str, length: int, rounds: int, warmup: int = 256) -> float:
    """One prefill ablation: both engines warmed at ``warmup`` tokens, then ``rounds`` rounds."""
    engines = ("lily", f"lily-off:{switch}")
    warm = sum(prefill_s(e, min(length, warmup)) + decode_s(1) for e in engines) + VARIANT_COMPILE_S
    return warm + rounds * sum(prefill_s(e, length) for e in engines)


def ablation_decode_group_s(switches: Iterable[str], length: int, rounds: int, steps: int) -> float:
    """One decode-profile run at ``length``: lily and each switch off, one shared prefill per round."""
    n_engines = 1 + len(list(switches))
    compile_s = (n_engines - 1) * VARIANT_COMPILE_S
    return compile_s + rounds * (prefill_s("lily", length) + n_engines * profile_s(steps))


class Clock:
    """``fits(estimate)``: would a row estimated at ``estimate`` seconds end before ``stop_at`` (wall clock,
    ``time.time()``)? Estimates are scaled by how long this process's finished rows took against theirs
    (never below 0.8 of the estimate)."""

    def __init__(self, stop_at: Optional[float]):
        self.stop_at = stop_at
        self.estimated = 0.0
        self.spent = 0.0

    @property
    def factor(self) -> float:
        if self.estimated <= 0:
            return 1.0
        return min(4.0, max(0.8, self.spent / self.estimated))

    def left(self) -> Optional[float]:
        return None if self.stop_at is None else self.stop_at - time.time()

    def fits(self, estimate: float) -> bool:
        left = self.left()
        return left is None or estimate * self.factor <= left

    def record(self, estimate: float, spent: float) -> None:
        self.estimated += estimate
        self.spent += spent


def pack_calls(items: Sequence[tuple], call_s: float, overhead_s: float) -> list:
    """Greedy split of ``(name, seconds)`` items, in order, into calls of at most ``call_s`` seconds each
    (``overhead_s`` per call: compiles, model build). An item longer than a call gets a call of its own."""
    calls, current, used = [], [], overhead_s
    for name, seconds in items:
        if current and used + seconds > call_s:
            calls.append((current, used))
            current, used = [], overhead_s
        current.append((name, seconds))
        used += seconds
    if current:
        calls.append((current, used))
    return calls
