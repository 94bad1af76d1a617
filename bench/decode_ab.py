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
ratios' spread. Written to ``DIR/decode_ab.md`` / ``decode_ab.json`` with ``--out``. The host's speed at the start
and the end of the run (``bench.host_speed``: microseconds to build 1,000 MLX ops) heads the table: the rates of
two calls compare only with it.

``--batch-contexts 32768,16384,8192,4096`` decodes a server's batch instead: each context prefilled alone, then
the rows' caches merged as MLX-LM's ``BatchGenerator`` merges a batch's prompts (``BatchKVCache``: left-padded to the
longest), and every step decodes one token for each row; the rate counts the tokens of all rows (the ``bursts``
driver only).

``--drivers bursts,stream,generate-step,copy,e2e`` times each engine under several ways of driving the same decode,
each a column of its own (``ENGINE@DRIVER``): ``bursts`` (the loop above, on the default stream), ``stream``
(the same loop inside ``mx.stream`` of MLX-LM's ``generation_stream``, where ``generate_step`` runs the model),
``generate-step`` (MLX-LM's ``generate_step`` itself from the cache, greedy, with its log-probabilities;
timed from its first token, as the e2e harness times decode), ``copy`` (``generate_step`` from a fresh copy of the
cache before each burst), ``e2e`` (the e2e harness's own ``decode_from``: a fresh copy of the cache and
``mx.clear_cache()`` before each burst).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Sequence

import mlx.core as mx

from lily_mlx.core import switches

from .decode_profile import _prefill, clone_cache, pipelined_decode
from .e2e import Engines, switches_off, validate_engine
from .host_speed import graph_build_us


DRIVERS = ("bursts", "stream", "generate-step", "copy", "e2e")


def _burst(model, state, steps: int, driver: str = "bursts") -> float:
    """``steps`` pipelined decode steps from ``state`` = [last token, cache] (updated) as ``driver`` runs
    them (``DRIVERS``); tokens per second."""
    if driver == "bursts":
        rate, state[0] = pipelined_decode(model, state[0], state[1], steps)
        return rate
    from mlx_lm.generate import generate_step, generation_stream

    if driver == "stream":
        with mx.stream(generation_stream):
            rate, state[0] = pipelined_decode(model, state[0], state[1], steps)
        return rate
    if driver == "e2e":  # as the e2e harness decodes: from a fresh copy of the cache, MLX's buffer cache cleared
        from .e2e import decode_from

        cache = clone_cache(state[1])
        result = decode_from(model, state[0].reshape(1), cache, steps)
        # decode_from keeps its first 16 tokens: one of them is fed next (the tokens do not matter for the rate)
        state[0], state[1] = mx.array([result["tokens"][-1]], dtype=state[0].dtype), cache
        return result["generation_tps"]
    if driver == "copy":  # generate_step from a fresh copy of the cache (the e2e harness's copy, nothing else)
        state[1] = clone_cache(state[1])
    elif driver != "generate-step":
        raise ValueError(f"unknown decode driver {driver!r}: one of {', '.join(DRIVERS)}")
    # generate_step feeds its last token into one more step than it yields: the cache grows by steps + 2
    # and the burst's last yielded token is fed next (the tokens do not matter for the rate).
    t_first = last = None
    for n, (tok, _) in enumerate(generate_step(state[0].reshape(1), model, max_tokens=steps + 1,
                                                prompt_cache=state[1],
                                                sampler=lambda lp: mx.argmax(lp, axis=-1))):
        if n == 0:
            t_first = time.perf_counter()
        last = tok
    rate = steps / (time.perf_counter() - t_first)
    state[0] = mx.array([last], dtype=state[0].dtype)
    return rate


def _column(engine: str, driver: str, drivers: Sequence[str]) -> str:
    return engine if drivers == ("bursts",) else f"{engine}@{driver}"


def quantize_kv_caches(cache, bits: int, group_size: int = 64):
    """The prompt cache with its attention layers' caches quantised, as MLX-LM's ``--kv-bits`` makes them after the
    prompt (``maybe_quantize_kv_cache``)."""
    from mlx_lm.models.cache import KVCache

    return [c.to_quantized(group_size=group_size, bits=bits) if type(c) is KVCache else c for c in cache]


def batch_prefill(model, contexts: Sequence[int], vocab: int, seed: int):
    """A server's batch of rows of ``contexts`` tokens: each prefilled alone, then each layer's row caches merged
    (``BatchKVCache.merge``, ``ArraysCache.merge``: what ``BatchGenerator`` does when prompts join a batch). (last
    tokens [B], batch cache)."""
    rows = [_prefill(model, n, vocab, seed + i) for i, n in enumerate(contexts)]
    cache = [type(layer[0]).merge(list(layer)) for layer in zip(*(c for _, c in rows))]
    mx.eval([c.state for c in cache])
    return mx.concatenate([y for y, _ in rows]), cache


def run(model, engines: Sequence[str], context: int, bursts: int, burst_steps: int, vocab: int, seed: int = 0,
        log=print, drivers: Sequence[str] = ("bursts",), kv_bits: int = 0,
        batch_contexts: Sequence[int] = ()) -> Dict:
    for engine in engines:
        validate_engine(engine)
    drivers = tuple(drivers)
    for driver in drivers:
        if driver not in DRIVERS:
            raise ValueError(f"unknown decode driver {driver!r}: one of {', '.join(DRIVERS)}")
    if batch_contexts and (drivers != ("bursts",) or kv_bits):
        raise ValueError("a batch (--batch-contexts) decodes with the bursts driver over plain caches only")
    columns = [(_column(e, d, drivers), e, d) for e in engines for d in drivers]
    host_start = graph_build_us()
    switcher = Engines(model)
    switcher.use("lily" if "lily" in engines else engines[0])
    if batch_contexts:
        y0, cache0 = batch_prefill(model, batch_contexts, vocab, seed)
        context = max(batch_contexts)
    else:
        y0, cache0 = _prefill(model, context, vocab, seed)
    rows = len(batch_contexts) or 1  # tokens a step
    if kv_bits:
        cache0 = quantize_kv_caches(cache0, kv_bits)
    states = {}
    for name, engine, driver in columns:  # each column's own cache copy, warmed up (compiles, traces, plans)
        switcher.use(engine)
        with switches.overrides(disable=switches_off(engine)):
            states[name] = [y0, clone_cache(cache0)]
            _burst(model, states[name], 2, driver)
    names = [c[0] for c in columns]
    rates: Dict[str, List[float]] = {n: [] for n in names}
    ratios: Dict[str, List[float]] = {n: [] for n in names}
    for turn in range(bursts):
        order = list(columns) if turn % 2 == 0 else list(reversed(columns))
        turn_rates = {}
        for name, engine, driver in order:
            switcher.use(engine)
            with switches.overrides(disable=switches_off(engine)):
                turn_rates[name] = rows * _burst(model, states[name], burst_steps, driver)
        for name in names:
            rates[name].append(turn_rates[name])
            ratios[name].append(turn_rates[name] / turn_rates[names[0]])
        log(f"[decode-ab] turn {turn + 1}/{bursts}: " + ", ".join(f"{n} {turn_rates[n]:.1f}" for n in names)
            + " tok/s")
    switcher.use("stock")
    return {"context": context, "batch_contexts": list(batch_contexts), "kv_bits": kv_bits, "bursts": bursts,
            "burst_steps": burst_steps, "drivers": list(drivers),
            "host_build_us_per_1000_ops": [round(host_start, 1), round(graph_build_us(), 1)], "engines": {
        n: {"tok_s": statistics.median(rates[n]), "tok_s_bursts": rates[n],
            "ratio": statistics.median(ratios[n]), "ratio_range": [min(ratios[n]), max(ratios[n])]}
        for n in names}}


def table_markdown(result: Dict) -> str:
    engines = list(result["engines"])
    first = engines[0]
    kv = f" over a {result['kv_bits']}-bit KV cache" if result.get("kv_bits") else ""
    batch = result.get("batch_contexts")
    where = (f"a batch of {len(batch)} rows at contexts {', '.join(map(str, batch))} (tokens of all rows a second)"
             if batch else f"context {result['context']}")
    lines = [f"Decode at {where}{kv}: {result['bursts']} turns of {result['burst_steps']} pipelined "
             f"steps per engine, engines alternating burst by burst"]
    if "host_build_us_per_1000_ops" in result:
        start, end = result["host_build_us_per_1000_ops"]
        lines.append(f"(host: {start:.0f} / {end:.0f} us to build 1,000 MLX ops at the start / end of the run)")
    lines += ["", f"| engine | median tok/s | median ratio to {first} in the same turn | ratio range |",
              "|---|---|---|---|"]
    for e in engines:
        r = result["engines"][e]
        lines.append(f"| {e} | {r['tok_s']:.1f} | {r['ratio']:.3f} | {r['ratio_range'][0]:.3f} - "
                     f"{r['ratio_range'][1]:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="lily,stock-kernels",
                    help="comma-separated: stock, stock-kernels, lily, lily-off:<switch>[+<switch>], "
                    "lily-trial:<op>[+<op>], each optionally with bench.run's modifiers (@off-<switch>, @again: "
                    "the same engine under a second name, for an A/A run of the harness's noise); the first "
                    "is the one the others are compared with")
    ap.add_argument("--context", type=int, default=4096, help="tokens in the cache before decoding")
    ap.add_argument("--kv-bits", type=int, default=0, choices=(0, 2, 3, 4, 5, 6, 8),
                    help="quantise the attention layers' KV caches after the prompt, as MLX-LM's --kv-bits (groups of "
                    "64; 0: plain caches); e.g. --engines stock,lily,lily-trial:attention_decode_quantized")
    ap.add_argument("--batch-contexts", default="",
                    help="comma-separated contexts of a server's batch (e.g. 32768,16384,8192,4096): each prefilled "
                    "alone, merged into one batch cache as MLX-LM's BatchGenerator does, every step one token a row "
                    "(replaces --context)")
    ap.add_argument("--bursts", type=int, default=16, help="turns (each engine decodes one burst per turn)")
    ap.add_argument("--burst-steps", type=int, default=8, help="pipelined decode steps per burst")
    ap.add_argument("--drivers", default="bursts",
                    help=f"comma-separated ways to drive each engine's decode, one column each: {', '.join(DRIVERS)}")
    ap.add_argument("--size", default="full", help="random model size (bench.model_setup), or --model")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of a random model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for decode_ab.md and decode_ab.json")
    args = ap.parse_args(argv)
    from .model_setup import load_model

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    model, description = load_model(args.model, args.size, args.seed)
    vocab = model.args.text_config["vocab_size"] if hasattr(model.args, "text_config") else model.args.vocab_size
    drivers = [d.strip() for d in args.drivers.split(",") if d.strip()]
    batch_contexts = [int(n) for n in args.batch_contexts.split(",") if n.strip()]
    result = run(model, engines, args.context, args.bursts, args.burst_steps, vocab, args.seed, drivers=drivers,
                 kv_bits=args.kv_bits, batch_contexts=batch_contexts)
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
