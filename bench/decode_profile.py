"""Host cost of one decode step: graph-build time, evaluation time, primitives, pipelined tok/s.

    python -m bench.run --mode decode-profile --context 4096 [--size full] [--engines stock,lily]

Per engine, on one model in one process (engines alternate order every round): the context is
prefilled once per round into a fresh cache, then ``--profile-steps`` decode steps are

- built (the model call and the greedy pick: Python and MLX graph construction, no evaluation) and
  evaluated, each timed on its own: ``build_ms``, ``eval_ms`` (medians over steps and rounds);
- run pipelined as MLX-LM's ``generate_step`` does (the next step is built while the last one
  evaluates, ``mx.async_eval``): ``decode_tok_s``;
- and one step's graph is exported (``mx.export_to_dot``) to count its primitives, not counting
  views (reshape, slice, transpose, broadcast, ...), which launch no kernel.

Writes ``decode_profile.json``: ``{"environment": ..., "context": N, "engines": {"stock":
{"primitives_per_step", "build_ms", "eval_ms", "decode_tok_s", ...}, "lily": {...}}}``.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from lily_dev.graph_only import count_primitives
from lily_mlx.core import switches
from lily_mlx.core.kernel_registry import record_launches

from .e2e import Engines, switches_off, validate_engine

# Primitives that only describe a view of their input (no kernel of their own on any backend).
VIEW_PRIMITIVES = frozenset({
    "Reshape", "Slice", "Transpose", "Broadcast", "AsStrided", "ExpandDims", "Squeeze", "Flatten",
    "Unflatten", "StopGradient", "Depends", "AsType_view", "BroadcastAxes",
})


def _prefill(model, context: int, vocab: int, seed: int, step: int = 2048):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, vocab, (context,), key=mx.random.key(seed))
    for start in range(0, context - 1, step):
        model(tokens[None, start:min(start + step, context - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    mx.clear_cache()
    return tokens[-1:], cache


def _step(model, y, cache):
    """One greedy decode step from the last token of each row, y [B] -> [B]."""
    logits = model(y[:, None], cache=cache)
    return mx.argmax(logits[:, -1, :], axis=-1)


def _own(value):
    """A new array object for an array (``a[i] = v`` mutates the object: caches must not share them);
    lists element-wise; anything else as is."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, (list, tuple)):  # (a quantized KV cache's (packed, scales, biases) is a tuple)
        return type(value)(_own(v) for v in value)
    return value


def clone_cache(cache):
    """A prompt cache with the same contents as ``cache``: new cache objects holding new array objects
    over the same data (the first write of a copy gives it its own buffer)."""
    clones = []
    for c in cache:
        new = type(c).__new__(type(c))
        new.__dict__.update({k: _own(v) for k, v in c.__dict__.items()})
        clones.append(new)
    return clones


def pipelined_decode(model, y, cache, steps: int):
    """``steps`` decode steps pipelined as MLX-LM's ``generate_step`` (build step n + 1 while step n
    evaluates) from last token ``y``: (tokens per second, the last token)."""
    nxt = _step(model, y, cache)
    mx.async_eval(nxt)
    t0 = time.perf_counter()
    for _ in range(steps):
        following = _step(model, nxt, cache)
        mx.async_eval(following)
        nxt.tolist()  # the host waits for the token(s), as generate_step's .item() (BatchGenerator's .tolist())
        nxt = following
    nxt.tolist()
    return steps / (time.perf_counter() - t0), nxt


def profile_engine(model, context: int, steps: int, vocab: int, seed: int, prefilled=None,
                   detail: bool = True) -> Dict:
    """One round for the engine in force: build/eval split, primitives, pipelined decode.
    ``prefilled``: (last token, cache) to decode from (a copy is used), else this engine prefills.
    ``detail=False`` leaves out the primitive count and the per-kernel timing (the ablations need only
    the build/eval split and the pipelined rate)."""
    if prefilled is None:
        y, cache = _prefill(model, context, vocab, seed)
    else:
        y, cache = prefilled[0], clone_cache(prefilled[1])
    mx.eval(_step(model, y, cache))  # first decode step: compiles, allocates

    primitives, launches, kernel_ms = {}, [], {}
    if detail and _grows_kv_cache(cache):
        # Not the step that grows the KV caches (every 256 tokens: a zeros array and a concatenation per
        # cache and per K/V, 40 primitives at Qwen3.6), so the count is an ordinary step's.
        y = _step(model, y, cache)
        mx.eval(y)
    if detail:
        # lily's custom-kernel launches of one step, by kernel. Built launch by launch (a traced piece's
        # launches are replayed in C++, unseen by the record), so the count is the step's kernels either way.
        with switches.overrides(disable=["compiled_decode"]), record_launches() as launches:
            nxt = _step(model, y, cache)
        primitives = count_primitives(nxt)
        mx.eval(nxt)
        y = nxt
        kernel_ms = kernel_times(launches)

    build, evaluate = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt = _step(model, y, cache)
        t1 = time.perf_counter()
        mx.eval(nxt)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        evaluate.append(t2 - t1)
        y = nxt

    rate, _ = pipelined_decode(model, y, cache, steps)
    non_view = sum(n for name, n in primitives.items() if name not in VIEW_PRIMITIVES)
    return {"build_s": build, "eval_s": evaluate, "decode_tok_s": rate,
            "primitives_per_step": non_view, "primitives": primitives,
            "kernel_launches_per_step": len(launches),
            "kernel_launches": launches.counts() if detail else {}, "kernel_ms": kernel_ms}


def _grows_kv_cache(cache) -> bool:
    """Whether the next one-token step enlarges one of the caches' key buffers (MLX-LM's ``KVCache``
    allocates ``step`` rows at a time)."""
    for c in cache:
        keys = getattr(c, "keys", None)
        if isinstance(keys, mx.array) and getattr(c, "offset", 0) + 1 > keys.shape[2]:
            return True
    return False


def kernel_times(launches, reps: int = 10) -> Dict[str, float]:
    """GPU ms per step of each lily kernel: all of one step's launches of that kernel re-run together
    from the step's own inputs, one evaluation per repeat (so one synchronisation per kernel kind, not
    per launch), median of ``reps``."""
    by_name: Dict[str, list] = {}
    for launch in launches:
        by_name.setdefault(launch.name, []).append(launch)
    out = {}
    for name, group in by_name.items():
        def once(group=group):
            mx.eval([launch.kernel(**launch.kwargs) for launch in group])

        once()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(times)
    return out


def host_profile(model, engine: str, context: int, steps: int, vocab: int, seed: int = 0, top: int = 30) -> str:
    """cProfile of building ``steps`` decode steps' graphs (evaluation excluded): where host time goes.
    The functions by their own time, then by cumulative time (which layer, op or launch wrapper holds
    the time spent under it); ``lily-off:<switch>`` engines run with those switches off."""
    import cProfile
    import io
    import pstats

    Engines(model).use(engine)
    profiler = cProfile.Profile()
    try:
        with switches.overrides(disable=switches_off(engine)):
            y, cache = _prefill(model, context, vocab, seed)
            mx.eval(_step(model, y, cache))
            for _ in range(steps):
                profiler.enable()
                nxt = _step(model, y, cache)
                profiler.disable()
                mx.eval(nxt)
                y = nxt
    finally:
        Engines(model).use("stock")
    out = io.StringIO()
    out.write(_trace_call_costs(model, engine, context, steps, vocab, seed))
    stats = pstats.Stats(profiler, stream=out)
    out.write(f"build of {steps} decode steps at context {context}, engine {engine}: "
              f"{1e3 * stats.total_tt / steps:.2f} ms per step under cProfile (the profiler adds its own cost)\n")
    for order in ("tottime", "cumulative"):
        out.write(f"\n--- by {order} ---\n")
        stats.sort_stats(order).print_stats(top)
    out.write("\n--- callers of the functions with the most own time ---\n")
    stats.sort_stats("tottime").print_callers(12)
    return out.getvalue()


def _trace_call_costs(model, engine: str, context: int, steps: int, vocab: int, seed: int) -> str:
    """Without the profiler: a step's build time, and how much of it is spent inside trace calls
    (``compiled.call``: MLX flattening the owner's weights and replaying the recorded graph) and inside
    decoder layers' replays (``layer_replay``: their traces called directly, the cache updated and, in an
    attention layer, its attention built) by the kind of piece, against the Python around them."""
    from lily_mlx.core import compiled
    from lily_mlx.ops.moe import layer as moe_layer

    inner, inner_replay = compiled.call, moe_layer._replayed
    spent: Dict[str, List[float]] = {}

    def timed(owner, key, fn, args, **kw):
        t0 = time.perf_counter()
        out = inner(owner, key, fn, args, **kw)
        kind = f"{type(owner).__name__}:{key[0] if isinstance(key, tuple) and key else key}"
        spent.setdefault(kind, []).append(time.perf_counter() - t0)
        return out

    nodes: Dict[str, int] = {}

    def replay_kind(layer) -> str:
        return f"replay:{'linear' if getattr(layer, 'is_linear', False) else 'attention'} layer"

    def timed_replay(layer, *args):
        t0 = time.perf_counter()
        out = inner_replay(layer, *args)
        spent.setdefault(replay_kind(layer), []).append(time.perf_counter() - t0)
        return out

    def counted_replay(layer, *args):  # (an untimed step) the graph nodes a replay adds, once per kind
        out = inner_replay(layer, *args)
        kind = replay_kind(layer)
        if out is not None and kind not in nodes:
            nodes[kind] = sum(count_primitives(out).values()) - sum(count_primitives(args[0]).values())
        return out

    Engines(model).use(engine)
    builds = []
    try:
        with switches.overrides(disable=switches_off(engine)):
            y, cache = _prefill(model, context, vocab, seed)
            mx.eval(_step(model, y, cache))
            compiled.call, moe_layer._replayed = timed, timed_replay
            for _ in range(steps):
                t0 = time.perf_counter()
                nxt = _step(model, y, cache)
                builds.append(time.perf_counter() - t0)
                mx.eval(nxt)
                y = nxt
            compiled.call, moe_layer._replayed = inner, counted_replay
            y = _step(model, y, cache)
            mx.eval(y)
            moe_layer._replayed = inner_replay
            anatomy = _replay_anatomy(model, cache)
    finally:
        compiled.call, moe_layer._replayed = inner, inner_replay
        Engines(model).use("stock")
    build_ms = 1e3 * statistics.median(builds)
    lines = [f"build of one decode step at context {context}, engine {engine}, without the profiler: "
             f"{build_ms:.2f} ms (median of {steps})", "",
             "| piece (owner:kind) | calls/step | median us/call | ms/step | graph nodes/call (views too) |",
             "|---|---|---|---|---|"]
    in_traces = 0.0
    for kind, times in sorted(spent.items(), key=lambda kv: -sum(kv[1])):
        per_step = 1e3 * sum(times) / steps
        in_traces += per_step
        lines.append(f"| {kind} | {len(times) / steps:.0f} | {1e6 * statistics.median(times):.1f} | {per_step:.2f} "
                     f"| {nodes.get(kind, '')} |")
    lines.append(f"\ninside trace calls and replays {in_traces:.2f} ms/step, the rest of the build "
                 f"{build_ms - in_traces:.2f} ms/step\n")
    return "\n".join(lines + [anatomy, "\n"])


def _replay_anatomy(model, cache, calls: int = 400) -> str:
    """What one layer replay's host time is made of (the first DeltaNet decoder layer that has one): the replay
    as a decode step calls it, its trace called alone (outputs dropped at once, or kept so that nothing is freed
    while timing), a trivial trace with the same owner (MLX flattening the layer's weights) and without one,
    and the graph nodes one call adds (all outputs, views too). The layer's cache is put back before every call,
    so every call sees the same inputs and no graph grows from call to call."""
    from lily_mlx.ops.moe import layer as moe_layer

    from .host_speed import call_us

    found = [(i, layer) for i, layer in enumerate(model.layers)
             if getattr(layer, "is_linear", False) and moe_layer._REPLAY in layer.__dict__]
    if not found:
        return "(no DeltaNet layer replay to dissect)"
    i, layer = found[0]
    _, replay = layer.__dict__[moe_layer._REPLAY]
    env = dict(zip(replay.__code__.co_freevars, (c.cell_contents for c in replay.__closure__ or ())))
    traced, weights = env.get("traced"), env.get("weights", ())
    c = cache[i]
    states = (c[0], c[1])
    weight = layer.input_layernorm.weight
    x = mx.zeros((1, 1, weight.shape[-1]), dtype=weight.dtype)
    mx.eval(x)

    def restore():
        c[0], c[1] = states

    def full():
        restore()
        return replay(x, None, c, (), ())

    if full() is None:
        return "(the replay does not take a maskless one-row call)"
    kept = []
    rows = [("the replay, as a decode step calls it", call_us(full, calls))]
    if traced is not None:
        rows.append(("its trace called alone, outputs dropped", call_us(lambda: traced(x, *states, *weights), calls)))
        rows.append(("its trace called alone, outputs kept",
                     call_us(lambda: kept.append(traced(x, *states, *weights)), calls)))
        kept.clear()
        nodes = sum(count_primitives(traced(x, *states, *weights)).values()) - sum(
            count_primitives([x, *states, *weights]).values())
    else:
        nodes = None
    trivial_owned = mx.compile(lambda a: a + 1, inputs=layer)
    trivial = mx.compile(lambda a: a + 1)
    rows.append(("a trivial trace owned by the layer", call_us(lambda: trivial_owned(x), calls)))
    rows.append(("a trivial trace without an owner", call_us(lambda: trivial(x), calls)))
    restore()
    lines = [f"\nanatomy of decoder layer {i}'s replay (DeltaNet; {len(tree_flatten(layer.parameters()))} weight "
             f"arrays; its trace adds {nodes} graph nodes a call, views too), median of {calls} calls:", "",
             "| call | us |", "|---|---|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in rows]
    return "\n".join(lines)


def run(model, context: int, engines: Sequence[str], rounds: int, steps: int, vocab: int, seed: int = 0,
        log=print, shared_prefill: bool = False, detail: bool = True) -> Dict:
    """``shared_prefill``: each round prefills the context once (with lily when it is among the engines:
    stock's prefill on CUDA runs ~290 tok/s, minutes at 128K) and every engine decodes from a copy of
    that cache; the decode timings then share one cache's contents (its values differ from an engine's
    own prefill by rounding only, which does not change what a decode step costs)."""
    for engine in engines:
        validate_engine(engine)
    switcher = Engines(model)
    per_engine: Dict[str, List[Dict]] = {e: [] for e in engines}
    prefill_engine = "lily" if "lily" in engines else engines[0]
    prefilled = None
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        prefilled = None
        if shared_prefill:
            switcher.use(prefill_engine)
            prefilled = _prefill(model, context, vocab, seed + r)
            log(f"[decode-profile] round {r + 1}/{rounds}: context {context} prefilled once with {prefill_engine}")
        for engine in order:
            switcher.use(engine)
            with switches.overrides(disable=switches_off(engine)):  # lily-off:<switch> engines
                result = profile_engine(model, context, steps, vocab, seed + r, prefilled, detail)
            per_engine[engine].append(result)
            log(f"[decode-profile] round {r + 1}/{rounds} {engine}: build "
                f"{1e3 * statistics.median(result['build_s']):.2f} ms, eval "
                f"{1e3 * statistics.median(result['eval_s']):.2f} ms, {result['decode_tok_s']:.1f} tok/s"
                + (f", {result['primitives_per_step']} primitives" if detail else ""))
    switcher.use("stock")
    out = {}
    for engine, results in per_engine.items():
        build = [t for res in results for t in res["build_s"]]
        evaluate = [t for res in results for t in res["eval_s"]]
        out[engine] = {
            "primitives_per_step": results[-1]["primitives_per_step"],
            "build_ms": 1e3 * statistics.median(build),
            "build_ms_range": [1e3 * min(build), 1e3 * max(build)],
            "eval_ms": 1e3 * statistics.median(evaluate),
            "decode_tok_s": statistics.median(res["decode_tok_s"] for res in results),
            "decode_tok_s_rounds": [res["decode_tok_s"] for res in results],
            "primitives": results[-1]["primitives"],
            "kernel_launches_per_step": results[-1]["kernel_launches_per_step"],
            "kernel_launches": results[-1]["kernel_launches"],
            "kernel_ms": {k: statistics.median(res["kernel_ms"][k] for res in results)
                          for k in results[-1]["kernel_ms"]},
        }
    if prefilled is not None:
        del prefilled
        mx.clear_cache()
    return {"context": context, "rounds": rounds, "steps": steps, "shared_prefill": shared_prefill,
            "prefill_engine": prefill_engine if shared_prefill else None, "engines": out}


def table_markdown(profile: Dict) -> str:
    lines = [f"Decode step at context {profile['context']} (medians of {profile['rounds']} rounds x "
             f"{profile['steps']} steps)", "",
             "| engine | graph build ms/step | eval ms/step | pipelined decode tok/s | non-view primitives/step "
             "| lily kernel launches/step |",
             "|---|---|---|---|---|---|"]
    for engine, row in profile["engines"].items():
        lines.append(f"| {engine} | {row['build_ms']:.2f} | {row['eval_ms']:.2f} | {row['decode_tok_s']:.1f} | "
                     f"{row['primitives_per_step']:,} | {row.get('kernel_launches_per_step', 0):,} |")
    counted = {e: row["primitives"] for e, row in profile["engines"].items() if row.get("primitives")}
    if counted:  # what a step is made of: the fusion targets (docs/decode.md)
        kinds = sorted({k for c in counted.values() for k in c if k not in VIEW_PRIMITIVES},
                       key=lambda k: -max(c.get(k, 0) for c in counted.values()))
        lines += ["", "Non-view primitives per step by kind:", "",
                  "| primitive | " + " | ".join(counted) + " |", "|---|" + "---|" * len(counted)]
        for kind in kinds:
            lines.append(f"| {kind} | " + " | ".join(f"{c.get(kind, 0):,}" for c in counted.values()) + " |")
    timed = {e: row["kernel_ms"] for e, row in profile["engines"].items() if row.get("kernel_ms")}
    if timed:
        lines += ["", "GPU ms per step of each lily kernel (one step's launches of it re-run together, median):", "",
                  "| engine | kernel | launches/step | ms/step |", "|---|---|---|---|"]
        for engine, times in timed.items():
            counts = profile["engines"][engine]["kernel_launches"]
            for name, ms in sorted(times.items(), key=lambda kv: -kv[1]):
                lines.append(f"| {engine} | {name} | {counts.get(name, 0)} | {ms:.3f} |")
    return "\n".join(lines)
