"""Decode A/B in short alternating bursts: which engine decodes faster on this host, robust to the host's
speed drifting during the run (decode is host-bound, and on a shared machine the host's speed moved by
up to 40 % between rounds of ``--mode decode-profile``).

    python -m bench.decode_ab --size full --context 4096 --engines lily,lily-off:split_router \\
        [--bursts 16] [--burst-steps 8] [--out DIR]

The context is prefilled once (by lily when it is among the engines); each engine decodes from its own
copy of that cache, pipelined as MLX-LM's ``generate_step`` does, ``--burst-steps`` tokens at a time,
and the engines take turns burst by burst (the order reversed every other turn). Each burst gives a rate;
each turn gives every engine's rate relative to the first engine's in the same turn, seconds apart. The
table: median rate per engine and the median of the per-turn ratios (the figure to decide on), with the
ratios' spread. Written to ``DIR/decode_ab.md`` / ``decode_ab.json`` with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List, Sequence

from lily_mlx.core import switches

from .decode_profile import _prefill, clone_cache, pipelined_decode
from .e2e import Engines, switches_off, validate_engine


def _burst(model, state, steps: int) -> float:
    """``steps`` pipelined decode steps from ``state`` = [last token, cache] (updated); tokens per second."""
    rate, state[0] = pipelined_decode(model, state[0], state[1], steps)
    return rate


def run(model, engines: Sequence[str], context: int, bursts: int, burst_steps: int, vocab: int, seed: int = 0,
        log=print) -> Dict:
    for engine in engines:
        validate_engine(engine)
    switcher = Engines(model)
    switcher.use("lily" if "lily" in engines else engines[0])
    y0, cache0 = _prefill(model, context, vocab, seed)
    states = {}
    for engine in engines:  # each engine's own cache copy, warmed up (compiles, traces, plans)
        switcher.use(engine)
        with switches.overrides(disable=switches_off(engine)):
            states[engine] = [y0, clone_cache(cache0)]
            _burst(model, states[engine], 2)
    rates: Dict[str, List[float]] = {e: [] for e in engines}
    ratios: Dict[str, List[float]] = {e: [] for e in engines}
    for turn in range(bursts):
        order = list(engines) if turn % 2 == 0 else list(reversed(engines))
        turn_rates = {}
        for engine in order:
            switcher.use(engine)
            with switches.overrides(disable=switches_off(engine)):
                turn_rates[engine] = _burst(model, states[engine], burst_steps)
        for engine in engines:
            rates[engine].append(turn_rates[engine])
            ratios[engine].append(turn_rates[engine] / turn_rates[engines[0]])
        log(f"[decode-ab] turn {turn + 1}/{bursts}: " + ", ".join(f"{e} {turn_rates[e]:.1f}" for e in engines)
            + " tok/s")
    switcher.use("stock")
    return {"context": context, "bursts": bursts, "burst_steps": burst_steps, "engines": {
        e: {"tok_s": statistics.median(rates[e]), "tok_s_bursts": rates[e],
            "ratio": statistics.median(ratios[e]), "ratio_range": [min(ratios[e]), max(ratios[e])]}
        for e in engines}}


def table_markdown(result: Dict) -> str:
    engines = list(result["engines"])
    first = engines[0]
    lines = [f"Decode at context {result['context']}: {result['bursts']} turns of {result['burst_steps']} pipelined "
             f"steps per engine, engines alternating burst by burst", "",
             f"| engine | median tok/s | median ratio to {first} in the same turn | ratio range |", "|---|---|---|---|"]
    for e in engines:
        r = result["engines"][e]
        lines.append(f"| {e} | {r['tok_s']:.1f} | {r['ratio']:.3f} | {r['ratio_range'][0]:.3f} - "
                     f"{r['ratio_range'][1]:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="lily,stock-kernels",
                    help="comma-separated: stock, stock-kernels, lily, lily-off:<switch>[+<switch>]; the first "
                    "is the one the others are compared with")
    ap.add_argument("--context", type=int, default=4096, help="tokens in the cache before decoding")
    ap.add_argument("--bursts", type=int, default=16, help="turns (each engine decodes one burst per turn)")
    ap.add_argument("--burst-steps", type=int, default=8, help="pipelined decode steps per burst")
    ap.add_argument("--size", default="full", help="random model size (bench.model_setup), or --model")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of a random model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for decode_ab.md and decode_ab.json")
    args = ap.parse_args(argv)
    from .model_setup import load_model

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    model, description = load_model(args.model, args.size, args.seed)
    vocab = model.args.text_config["vocab_size"] if hasattr(model.args, "text_config") else model.args.vocab_size
    result = run(model, engines, args.context, args.bursts, args.burst_steps, vocab, args.seed)
    result["model"] = description
    text = table_markdown(result)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_ab.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "decode_ab.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
