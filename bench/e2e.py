"""End-to-end sweep: stock MLX-LM vs lily-mlx on one model in one process.

Both engines run MLX-LM's fastest direct generation path (``generate_step``, greedy) on the same
weights: ``lily_mlx.patch(model)`` / ``lily_mlx.unpatch(model)`` switch the model between them. In
every round the two engines run in alternating order; the reported numbers are medians over rounds.
prompt_tps counts the prompt tokens over the time to the first generated token (MLX-LM's
convention); generation_tps the tokens after the first over the time after it; peak memory is
``mx.get_peak_memory() / 1e9`` with the peak reset before each run.

``shared_prefill``: each length is prefilled once per round by one engine (lily when it runs: the
fastest) and every engine decodes from its own copy of that cache (``decode_profile.clone_cache``), so
the decode points at 32K-128K need no engine-by-engine prefill. Prompt tok/s is still each engine's own
prefill, up to ``max_prefill[engine]`` tokens (stock on CUDA prefills ~270 tok/s: a 128K prompt alone
takes ~8 minutes); beyond that the row says it was not measured and why. Peak memory is reported per
engine without the shared cache the harness holds meanwhile (its bytes are subtracted), so it is what
the engine's own run needs.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from lily_mlx.core import switches

K = 1024
# The write-up's ten prompt lengths (prefill) and ten context lengths (decode): 256 ... 128K.
SWEEP_LENGTHS = (256, 512, 1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K)


def length_label(n: int) -> str:
    return f"{n // K}K" if n >= K and n % K == 0 else str(n)


def parse_lengths(text: str) -> List[int]:
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        if part:
            out.append(int(float(part[:-1]) * K) if part.endswith("K") else int(part))
    return out


ABLATION_PREFIX = "lily-off:"
# lily with trial kernels on (``lily-trial:attention_prefill+attention_decode``): what LILY_TRIAL_OPS does,
# per engine, so that a trial kernel is A/B-timed against lily in one process.
TRIAL_PREFIX = "lily-trial:"
# The fair baseline: stock MLX-LM running its own Gated DeltaNet Metal kernels (through the bridge on
# CUDA, the simulator on sim), as it does on a Mac. Plain "stock" on CUDA runs a per-token op loop.
STOCK_KERNELS = "stock-kernels"
# Engine modifiers, after the engine's name:
# - ``@eval-per-layer``: evaluate after every decoder layer of a prefill chunk (one host wait per layer). A
#   diagnostic, not an optimisation: it tests whether peak memory comes from the host encoding a whole chunk ahead of
#   the GPU (docs/moe.md, "Peak memory"). ``stock@eval-per-layer``, ``lily@eval-per-layer``.
# - ``@chunk-N``: prefill in chunks of N tokens instead of the run's ``--prefill-step-size``, so that two chunk sizes
#   are timed in one process, alternating (``lily,lily@chunk-4096``).
# - ``@off-a+b``: switches a and b off as well, for an engine whose name cannot say so (a trial kernel with one of its
#   switches off: ``lily-trial:linear_gemv,lily-trial:linear_gemv@off-gemv_input_norm``).
# - ``@again``: the same engine under a second name, to read the harness's noise from an A/A run (``lily,lily@again``:
#   in ``bench.decode_ab`` on a middling H100 host medians of the same engine differed by up to ~1 %, its turns by up to
#   13 %: docs/results/2026-12-06-h100-gqa-packing-launch-cost/).
# Any of them may be given, in any order.
EVAL_PER_LAYER = "@eval-per-layer"
AGAIN_MODIFIER = "@again"
CHUNK_MODIFIER = "@chunk-"
OFF_MODIFIER = "@off-"


def _split_modifiers(engine: str) -> Tuple[str, bool, Optional[int], Tuple[str, ...]]:
    """``engine`` -> (base engine, eval per layer, chunk size or None, switches off by ``@off-``). Raises ValueError
    on a bad chunk size."""
    base, per_layer, chunk, off = engine, False, None, ()
    while True:
        if base.endswith(EVAL_PER_LAYER):
            base, per_layer = base[: -len(EVAL_PER_LAYER)], True
            continue
        if base.endswith(AGAIN_MODIFIER):
            base = base[: -len(AGAIN_MODIFIER)]
            continue
        at = base.rfind(OFF_MODIFIER)
        if at >= 0 and "@" not in base[at + len(OFF_MODIFIER):]:
            off = tuple(switches.parse_list(base[at + len(OFF_MODIFIER):].replace("+", ","))) + off
            base = base[:at]
            continue
        at = base.rfind(CHUNK_MODIFIER)
        if at >= 0 and "@" not in base[at + len(CHUNK_MODIFIER):]:
            text = base[at + len(CHUNK_MODIFIER):]
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"engine {engine!r}: {CHUNK_MODIFIER}N needs a positive whole number of tokens, "
                                 f"not {text!r}")
            base, chunk = base[:at], int(text)
            continue
        return base, per_layer, chunk, off


def base_engine(engine: str) -> str:
    """The engine without its modifiers: ``lily@eval-per-layer`` -> ``lily``, ``lily@chunk-4096`` -> ``lily``."""
    return _split_modifiers(engine)[0]


def evaluates_per_layer(engine: str) -> bool:
    return _split_modifiers(engine)[1]


def chunk_size(engine: str, requested: int) -> int:
    """The prompt chunk size ``engine`` asks for: its ``@chunk-N`` modifier, else the run's ``requested``."""
    chunk = _split_modifiers(engine)[2]
    return requested if chunk is None else chunk


def switches_off(engine: str) -> Tuple[str, ...]:
    """Switches an engine runs with off: ``lily-off:gpu_routing+fused_dequant`` -> both; ``lily`` -> none; an
    ``@off-`` modifier's too (``lily-trial:linear_gemv@off-gemv_input_norm`` -> gemv_input_norm).

    An ablation engine is lily-mlx with those switches off (the write-up's ablation variants), so
    ``--engines stock,lily,lily-off:register_scan`` measures one switch end to end."""
    base, _, _, off = _split_modifiers(engine)
    if not base.startswith(ABLATION_PREFIX):
        return off
    return tuple(switches.parse_list(base[len(ABLATION_PREFIX):].replace("+", ","))) + off


def trial_ops(engine: str) -> Tuple[str, ...]:
    """Trial kernels an engine turns on: ``lily-trial:a+b`` -> ("a", "b"); any other engine -> ()."""
    engine = base_engine(engine)
    if not engine.startswith(TRIAL_PREFIX):
        return ()
    return tuple(n.strip() for n in engine[len(TRIAL_PREFIX):].split("+") if n.strip())


def is_lily(engine: str) -> bool:
    engine = base_engine(engine)
    return engine == "lily" or engine.startswith(ABLATION_PREFIX) or engine.startswith(TRIAL_PREFIX)


def validate_engine(engine: str) -> None:
    """Raise ValueError unless ``engine`` is stock, lily, lily-off:<switches> or lily-trial:<ops>,
    optionally with the @eval-per-layer, @chunk-N, @off-<switches> and @again modifiers (unknown switch names are
    reported by ``switches_off``)."""
    base = base_engine(engine)
    if base not in ("stock", STOCK_KERNELS, "lily") and not base.startswith((ABLATION_PREFIX, TRIAL_PREFIX)):
        raise ValueError(f"unknown engine {engine!r}: use stock, {STOCK_KERNELS}, lily, "
                         f"{ABLATION_PREFIX}<switch>[+<switch>] or {TRIAL_PREFIX}<op>[+<op>], each optionally "
                         f"followed by {EVAL_PER_LAYER}, {CHUNK_MODIFIER}N, {OFF_MODIFIER}<switch>[+<switch>] and/or "
                         f"{AGAIN_MODIFIER}")
    switches_off(engine)
    ops = trial_ops(engine)
    if base.startswith(TRIAL_PREFIX):
        from lily_mlx.ops import load_all

        trials = sorted(name for name, op in load_all().items() if op.trial_backends)
        unknown = [n for n in ops if n not in trials]
        if not ops or unknown:
            raise ValueError(f"engine {engine!r}: not a trial kernel {unknown or ops}; trial kernels: {', '.join(trials)}")


class _EvalAfterPrefillLayer:
    """Mixed into a decoder layer's class: evaluate its output when it processed more than one token."""

    def __call__(self, x, *args, **kwargs):
        out = super().__call__(x, *args, **kwargs)
        if x.ndim == 3 and x.shape[1] > 1:
            mx.eval(out)
        return out


def set_eval_per_layer(model, on: bool) -> None:
    """Swap every decoder layer's class to (or back from) one that evaluates after prefill chunks."""
    for layer in model.layers:
        cls = type(layer)
        wrapped = issubclass(cls, _EvalAfterPrefillLayer)
        if on and not wrapped:
            layer.__class__ = type(cls.__name__, (_EvalAfterPrefillLayer, cls), {})
        elif not on and wrapped:
            layer.__class__ = cls.__mro__[2]


class Engines:
    """Switch one model between stock MLX-LM and lily-mlx (with or without ablated switches)."""

    def __init__(self, model, lily_available: bool = True):
        self.model = model
        self.lily_available = lily_available

    def use(self, engine: str) -> None:
        import lily_mlx

        from lily_dev.deltanet_stock_kernels import set_stock_kernels

        set_eval_per_layer(self.model, False)  # lily's patch swaps classes too: never stack on ours
        self._set_trial_ops(trial_ops(engine))
        patched = lily_mlx.is_patched(self.model)
        set_stock_kernels(False)
        if is_lily(engine) and not patched:
            lily_mlx.patch(self.model)
        elif not is_lily(engine) and patched:
            lily_mlx.unpatch(self.model)
        if base_engine(engine) == STOCK_KERNELS:
            set_stock_kernels(True)
        set_eval_per_layer(self.model, evaluates_per_layer(engine))


    _user_trials = None  # LILY_TRIAL_OPS as the user set it, while an engine overrides it

    def _set_trial_ops(self, ops: Tuple[str, ...]) -> None:
        """LILY_TRIAL_OPS for this engine (the user's own value for engines that name none); the dispatch
        plan is resolved again on its next use."""
        from lily_mlx.core import dispatch

        if Engines._user_trials is None:
            Engines._user_trials = os.environ.get("LILY_TRIAL_OPS", "")
        value = ",".join(ops) if ops else Engines._user_trials
        if os.environ.get("LILY_TRIAL_OPS", "") != value:
            if value:
                os.environ["LILY_TRIAL_OPS"] = value
            else:
                os.environ.pop("LILY_TRIAL_OPS", None)
            dispatch.invalidate()


def warm_long_context(model, engines: Sequence[str], lengths: Sequence[int], log=print) -> None:
    """One untimed decode step of one attention layer at the long-context threshold, per lily engine, if
    any of ``lengths`` reaches it: the decode kernels used only from there (fixed-block attention, from
    32K) are then compiled before the first timed token at a long length, not inside it (their variants
    do not depend on the context beyond the threshold). The short warm-up run never reaches them."""
    from mlx_lm.models.cache import KVCache

    from lily_mlx.ops.attention.kernels import FIXED_BLOCK_MIN_CONTEXT

    if max(lengths, default=0) < FIXED_BLOCK_MIN_CONTEXT:
        return
    layer = next((l for l in model.layers if hasattr(l, "self_attn")), None)
    if layer is None:
        return
    attn, hidden = layer.self_attn, layer.input_layernorm.weight.shape[0]
    dtype = layer.input_layernorm.weight.dtype
    shape = (1, attn.num_key_value_heads, FIXED_BLOCK_MIN_CONTEXT, attn.head_dim)
    sw = Engines(model)
    for engine in engines:
        if not is_lily(engine):
            continue
        sw.use(engine)
        cache = KVCache()
        cache.update_and_fetch(mx.zeros(shape, dtype), mx.zeros(shape, dtype))
        with switches.overrides(disable=switches_off(engine)):
            mx.eval(attn(mx.zeros((1, 1, hidden), dtype), cache=cache))
        log(f"[warmup] {engine}: one attention decode step at context {length_label(FIXED_BLOCK_MIN_CONTEXT)}")
    sw.use("stock")


def chunk_warmup_lengths(lengths: Sequence[int], step: int, first: int = 0) -> List[int]:
    """Prompt lengths whose untimed runs prefill every chunk size the timed ``lengths`` will (MLX-LM prefills all
    but a prompt's last token in chunks of ``step``: full chunks and one remainder), each as one chunk, plus
    ``first`` (the plain warm-up length) if given. lily's kernels have variants by chunk size (the MoE tiles adapt
    to the rows an expert gets), compiled on first use: without these runs round 1's first prefill of each new chunk
    size carries the compiles (2026-12-04: lily at 4K 2,200 tok/s in round 1, 7,000 in round 2)."""
    chunks = set()
    for length in lengths:
        prefilled = length - 1
        if prefilled <= 0:
            continue
        chunks.add(min(prefilled, step))
        if prefilled > step and prefilled % step:
            chunks.add(prefilled % step)
    return sorted({c + 1 for c in chunks} | ({first} if first else set()))


def prefill_step(engine: str, requested: int) -> int:
    """The chunk size ``engine`` prefills with (call under the engine's switch state): its ``@chunk-N`` or
    ``requested``, through lily's ``chunked_prefill`` switch for lily engines."""
    step = chunk_size(engine, requested)
    if is_lily(engine):
        from lily_mlx.patch import prefill_step_size

        return prefill_step_size(step)
    return step


def chunk_sizes(engines: Sequence[str], requested: int) -> List[int]:
    """Every chunk size the engines ask for (sorted, distinct): what the warm-up has to compile for."""
    return sorted({chunk_size(e, requested) for e in engines})


def run_once(model, prompt: mx.array, gen_tokens: int, prefill_step_size: int) -> Dict:
    """One generation: the prompt, then ``gen_tokens`` tokens (the first ends the prefill timing)."""
    from mlx_lm.generate import generate_step

    mx.clear_cache()
    mx.reset_peak_memory()
    tokens = []
    tic = time.perf_counter()
    t_first = None
    for n, (tok, _) in enumerate(generate_step(prompt, model, max_tokens=gen_tokens + 1,
                                                sampler=lambda lp: mx.argmax(lp, axis=-1),
                                                prefill_step_size=prefill_step_size)):
        if n == 0:
            t_first = time.perf_counter()
        tokens.append(int(tok))
    t_end = time.perf_counter()
    prompt_time = t_first - tic
    gen_time = t_end - t_first
    return {
        "prompt_tokens": int(prompt.size),
        "prompt_tps": prompt.size / prompt_time,
        "generation_tokens": len(tokens) - 1,
        "generation_tps": (len(tokens) - 1) / gen_time if len(tokens) > 1 and gen_time > 0 else float("nan"),
        "peak_memory": mx.get_peak_memory() / 1e9,
        "tokens": tokens[:16],
    }


def cache_bytes(cache) -> int:
    """Bytes of the arrays a prompt cache holds (KV buffers, DeltaNet states)."""
    import mlx.core as mx_

    total = 0
    for c in cache:
        for v in c.__dict__.values():
            for a in (v if isinstance(v, list) else [v]):
                if isinstance(a, mx_.array):
                    total += a.nbytes
    return total


def prefill_keep(model, prompt: mx.array, prefill_step_size: int) -> Tuple[Dict, Tuple[mx.array, list]]:
    """``run_once`` with no decode tokens that keeps its cache: (result, (next input token, cache)).

    Timed exactly as ``run_once`` times the prompt (``generate_step`` to its first token). When the
    first token is yielded, ``generate_step`` has already queued the next step, so the cache holds the
    prompt and the first token and the next input is that step's token (caught from the sampler)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    mx.clear_cache()
    mx.reset_peak_memory()
    cache = make_prompt_cache(model)
    sampled = []

    def sampler(logprobs):
        tok = mx.argmax(logprobs, axis=-1)
        sampled.append(tok)
        return tok

    tic = time.perf_counter()
    first = None
    for tok, _ in generate_step(prompt, model, max_tokens=1, sampler=sampler, prompt_cache=cache,
                                prefill_step_size=prefill_step_size):
        first = int(tok)
        break
    t_first = time.perf_counter()
    following = sampled[-1]
    mx.eval(following, [c.state for c in cache])
    res = {"prompt_tokens": int(prompt.size), "prompt_tps": prompt.size / (t_first - tic),
           "generation_tokens": 0, "generation_tps": float("nan"),
           "peak_memory": mx.get_peak_memory() / 1e9, "tokens": [first]}
    return res, (following.reshape(1), cache)


def decode_from(model, token: mx.array, cache, gen_tokens: int, held_bytes: int = 0) -> Dict:
    """Decode ``gen_tokens`` + 1 tokens from ``cache`` (a copy the caller made) starting at ``token``, through
    ``generate_step`` as ``run_once`` decodes: decode tok/s counts the tokens after the first. Peak memory
    leaves out ``held_bytes`` (the shared cache the harness keeps meanwhile)."""
    from mlx_lm.generate import generate_step

    mx.clear_cache()
    mx.reset_peak_memory()
    tokens = []
    t_first = None
    for n, (tok, _) in enumerate(generate_step(token, model, max_tokens=gen_tokens + 1, prompt_cache=cache,
                                                sampler=lambda lp: mx.argmax(lp, axis=-1))):
        if n == 0:
            t_first = time.perf_counter()
        tokens.append(int(tok))
    gen_time = time.perf_counter() - t_first
    return {"generation_tokens": len(tokens) - 1,
            "generation_tps": (len(tokens) - 1) / gen_time if len(tokens) > 1 and gen_time > 0 else float("nan"),
            "peak_memory": (mx.get_peak_memory() - held_bytes) / 1e9, "tokens": tokens[:16]}


def parse_max_prefill(text: Optional[str]) -> Dict[str, int]:
    """``"stock=16K,stock-kernels=128K"`` -> {"stock": 16384, ...}: the longest prompt each named engine
    prefills itself (others: every length)."""
    out = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        if "=" not in part:
            raise ValueError(f"--max-prefill-length takes ENGINE=LENGTH[,ENGINE=LENGTH]: {part!r}")
        engine, length = part.split("=", 1)
        validate_engine(engine.strip())
        out[engine.strip()] = parse_lengths(length)[0]
    return out


# Rounds of one engine at one length whose rates differ more than this: said in the log and the row (``uneven``), as
# likely a compile or another one-time cost inside a timed run (2026-12-05, H100: a merge compiled in round 1's decode
# at a new KV capacity, 26.8 against 178.5 tok/s in round 2), not the engine's rate; the median of two such rounds is
# their mean.
UNEVEN_ROUNDS = 2.0


def uneven_rounds(runs: Sequence[Dict], metric: str) -> Optional[float]:
    """The ratio of the fastest to the slowest of ``runs``' ``metric`` where it exceeds ``UNEVEN_ROUNDS``, else
    None."""
    values = [x.get(metric) for x in runs]
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v)) and v > 0]
    if len(values) < 2 or max(values) / min(values) <= UNEVEN_ROUNDS:
        return None
    return max(values) / min(values)


def _median(values) -> Optional[float]:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else None


def sweep(model, lengths: Sequence[int], prefill_lengths: Sequence[int], decode_lengths: Sequence[int],
          rounds: int, gen_tokens: int, prefill_step_size: int, engines=("stock", "lily"),
          vocab_size: int = 248320, seed: int = 0, log=print, rounds_for=None, on_row=None,
          shared_prefill: bool = False, max_prefill: Optional[Dict[str, int]] = None,
          before_row: Optional[Callable[[int], bool]] = None) -> List[Dict]:
    """Per length: each round runs every engine once (order alternating by round).
    ``rounds_for(length)`` may give fewer rounds to long lengths; ``on_row(rows)`` runs after each
    length (incremental saving); ``before_row(length)`` returning False stops the sweep there (a time
    limit: the rows so far are returned). ``max_prefill``: engine -> longest prompt it prefills itself;
    ``shared_prefill``: decode from one cache per round (module docstring). Without ``shared_prefill`` an
    engine is not run at all beyond its ``max_prefill``."""
    for engine in engines:
        validate_engine(engine)
    max_prefill = dict(max_prefill or {})
    sw = Engines(model)
    rows = []
    shared_engine = ("lily" if "lily" in engines else engines[0]) if shared_prefill else None
    for length in lengths:
        if before_row is not None and not before_row(length):
            break
        gen = gen_tokens if length in decode_lengths else 1
        prompt = mx.random.randint(0, vocab_size, (length,), key=mx.random.key(seed + length))
        per_engine: Dict[str, List[Dict]] = {e: [] for e in engines}
        own = {e: length <= max_prefill.get(e, length) for e in engines}
        n_rounds = rounds_for(length) if rounds_for else rounds
        for r in range(n_rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            if shared_prefill:
                _shared_round(model, sw, prompt, length, order, own, shared_engine, length in prefill_lengths,
                              gen if length in decode_lengths else 0, prefill_step_size, per_engine,
                              f"round {r + 1}/{n_rounds}", log)
                continue
            for engine in order:
                if not own[engine]:
                    continue
                sw.use(engine)
                with switches.overrides(disable=switches_off(engine)):
                    res = run_once(model, prompt, gen, prefill_step(engine, prefill_step_size))
                per_engine[engine].append(res)
                log(f"[e2e] {length_label(length):>5} round {r + 1}/{n_rounds} {engine:>5}: "
                    f"prompt_tps={res['prompt_tps']:.3f}, generation_tps={res['generation_tps']:.3f}, "
                    f"peak_memory={res['peak_memory']:.3f}")
        row = {"length": length, "label": length_label(length), "prefill": length in prefill_lengths,
               "decode": length in decode_lengths, "generation_tokens": gen - 1 if gen > 1 else 0}
        if shared_prefill:
            row["shared_prefill"] = shared_engine
        for engine, runs in per_engine.items():
            entry = {
                "prompt_tps": _median(x.get("prompt_tps") for x in runs),
                "generation_tps": _median(x.get("generation_tps") for x in runs) if gen > 1 else None,
                "peak_memory": max((x["peak_memory"] for x in runs), default=None),
                "trials": [{k: v for k, v in x.items() if k != "tokens"} for x in runs],
                "tokens": runs[0]["tokens"] if runs else [],
            }
            for metric in ("prompt_tps", "generation_tps") if gen > 1 else ("prompt_tps",):
                spread = uneven_rounds(runs, metric)
                if spread is not None and own[engine]:
                    entry.setdefault("uneven", {})[metric] = round(spread, 2)
                    log(f"[e2e] {length_label(length):>5} {engine}: {metric} differs {spread:.1f}x between rounds "
                        f"({', '.join(f'{x[metric]:.1f}' for x in runs)}): a one-time cost (a compile?) in a timed run")
            if not own[engine]:
                entry["prompt_tps"] = None
                entry["not_measured"] = {
                    "what": "prefill" if shared_prefill else "prefill and decode",
                    "why": f"--max-prefill-length {engine}={length_label(max_prefill[engine])}"}
                if shared_prefill:
                    entry["peak_memory_decode_only"] = True
            row[engine] = entry
        if "stock" in per_engine and "lily" in per_engine:
            s, l_ = row["stock"], row["lily"]
            row["prefill_ratio"] = _ratio(l_["prompt_tps"], s["prompt_tps"])
            row["decode_ratio"] = _ratio(l_["generation_tps"], s["generation_tps"]) if gen > 1 else None
            row["same_tokens"] = (s["tokens"] == l_["tokens"]) if s["tokens"] and l_["tokens"] else None
        if STOCK_KERNELS in per_engine and "lily" in per_engine:  # the fair baseline (README headline)
            s, l_ = row[STOCK_KERNELS], row["lily"]
            row["prefill_ratio_vs_stock_kernels"] = _ratio(l_["prompt_tps"], s["prompt_tps"])
            row["decode_ratio_vs_stock_kernels"] = _ratio(l_["generation_tps"], s["generation_tps"]) if gen > 1 else None
        for engine in per_engine:
            if (engine.startswith(ABLATION_PREFIX) or is_variant(engine)) and "lily" in per_engine:
                a, l_ = row[engine], row["lily"]
                row[engine]["prefill_vs_lily"] = _ratio(l_["prompt_tps"], a["prompt_tps"])
                row[engine]["decode_vs_lily"] = _ratio(l_["generation_tps"], a["generation_tps"]) if gen > 1 else None
        row["rounds"] = n_rounds
        rows.append(row)
        if on_row:
            on_row(rows)
    sw.use("stock")
    return rows


def _ratio(a, b) -> Optional[float]:
    return a / b if a is not None and b else None


def _shared_round(model, sw, prompt, length, order, own, shared_engine, prefill, gen, step, per_engine, label,
                  log) -> None:
    """One round of a shared-prefill length: every engine's own prefill (timed; the shared engine's
    cache is kept), then every engine's decode from a copy of that cache. Appends one trial per engine:
    prompt_tps (None where the engine did not prefill), generation_tps, peak memory of its runs."""
    from .decode_profile import clone_cache

    trials: Dict[str, Dict] = {e: {"prompt_tps": None} for e in order}
    shared = None
    held = 0
    for engine in order:  # prefill, alternating order like every other run
        if not own[engine] or not (prefill or engine == shared_engine):
            continue
        sw.use(engine)
        with switches.overrides(disable=switches_off(engine)):
            if engine == shared_engine:
                res, shared = prefill_keep(model, prompt, prefill_step(engine, step))
            else:
                res = run_once(model, prompt, 0, prefill_step(engine, step))
                res["peak_memory"] -= held / 1e9
        if engine == shared_engine:
            held = cache_bytes(shared[1])
        trials[engine].update(prompt_tps=res["prompt_tps"], prefill_peak_memory=res["peak_memory"],
                              peak_memory=res["peak_memory"], tokens=res["tokens"])
        log(f"[e2e] {length_label(length):>5} {label} {engine:>5}: prompt_tps={res['prompt_tps']:.3f}, "
            f"peak_memory={res['peak_memory']:.3f}" + (" (its cache is the shared one)" if engine == shared_engine else ""))
    if shared is None:  # the shared engine prefills only for the others (not timed here)
        sw.use(shared_engine)
        with switches.overrides(disable=switches_off(shared_engine)):
            _, shared = prefill_keep(model, prompt, prefill_step(shared_engine, step))
        held = cache_bytes(shared[1])
        log(f"[e2e] {length_label(length):>5} {label}: prefilled once with {shared_engine} (shared cache)")
    if gen > 0:
        for engine in order:  # decode, every engine from its own copy of the shared cache
            sw.use(engine)
            with switches.overrides(disable=switches_off(engine)):
                res = decode_from(model, shared[0], clone_cache(shared[1]), gen, held)
            t = trials[engine]
            t.update(generation_tokens=res["generation_tokens"], generation_tps=res["generation_tps"],
                     decode_peak_memory=res["peak_memory"], tokens=res["tokens"],
                     peak_memory=max(t.get("peak_memory", 0.0), res["peak_memory"]))
            log(f"[e2e] {length_label(length):>5} {label} {engine:>5}: generation_tps={res['generation_tps']:.3f} "
                f"from the shared cache, peak_memory={res['peak_memory']:.3f}")
    for engine, t in trials.items():
        if "peak_memory" in t:
            t.setdefault("tokens", [])
            per_engine[engine].append(t)
    del shared
    mx.clear_cache()


NOT_MEASURED = "n/m"


def table_markdown(rows: List[Dict]) -> str:
    """The engines' table (medians): stock, stock-kernels (where run) and lily, with lily's ratios; cells an
    engine did not measure read ``n/m`` (the notes under the table say why)."""
    fair = any(STOCK_KERNELS in r for r in rows)
    head = "| length | stock prefill tok/s |" + (f" {STOCK_KERNELS} prefill tok/s |" if fair else "")
    head += " lily prefill tok/s | ratio |" + (f" ratio vs {STOCK_KERNELS} |" if fair else "")
    head += " stock decode tok/s |" + (f" {STOCK_KERNELS} decode tok/s |" if fair else "")
    head += " lily decode tok/s | ratio |" + (f" ratio vs {STOCK_KERNELS} |" if fair else "")
    head += " peak GB stock" + (f" / {STOCK_KERNELS}" if fair else "") + " / lily | same tokens |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(x, nd=1):
        return "-" if x is None else f"{x:,.{nd}f}"

    def cell(entry, key, shown, nd=1):
        if not shown:
            return "-"
        missing = (entry or {}).get("not_measured")
        if missing and (key == "prompt_tps" or "decode" in missing["what"]):
            return NOT_MEASURED
        return f((entry or {}).get(key), nd)

    def peak(entry):
        if not entry or entry.get("peak_memory") is None:
            return NOT_MEASURED if entry and entry.get("not_measured") else "-"
        return f(entry["peak_memory"], 2) + ("*" if entry.get("peak_memory_decode_only") else "")

    for r in rows:
        s, k, l_ = r.get("stock"), r.get(STOCK_KERNELS), r.get("lily")
        pre, dec = r["prefill"], r["decode"]
        cells = [r["label"], cell(s, "prompt_tps", pre)]
        cells += [cell(k, "prompt_tps", pre)] if fair else []
        cells += [cell(l_, "prompt_tps", pre), f(r.get("prefill_ratio") if pre else None, 3)]
        cells += [f(r.get("prefill_ratio_vs_stock_kernels") if pre else None, 3)] if fair else []
        cells += [cell(s, "generation_tps", dec)]
        cells += [cell(k, "generation_tps", dec)] if fair else []
        cells += [cell(l_, "generation_tps", dec), f(r.get("decode_ratio") if dec else None, 3)]
        cells += [f(r.get("decode_ratio_vs_stock_kernels") if dec else None, 3)] if fair else []
        peaks = [s] + ([k] if fair else []) + [l_]
        same = r.get("same_tokens")
        cells += [" / ".join(peak(p) for p in peaks), "-" if same is None else str(same)]
        lines.append("| " + " | ".join(cells) + " |")
    notes = notes_markdown(rows)
    return "\n".join(lines) + ("\n\n" + notes if notes else "")


def notes_markdown(rows: List[Dict]) -> str:
    """What the table's marks mean: engines not measured at some lengths (and why), the shared prefill."""
    notes = []
    missing: Dict[Tuple[str, str, str], List[str]] = {}
    for r in rows:
        for engine, entry in r.items():
            if isinstance(entry, dict) and entry.get("not_measured"):
                m = entry["not_measured"]
                missing.setdefault((engine, m["what"], m["why"]), []).append(r["label"])
    for (engine, what, why), labels in missing.items():
        extra = (" (a prompt that long takes minutes per run at its prefill rate); its decode at these contexts "
                 "runs from the shared cache" if what == "prefill" else " (a prompt that long takes minutes)")
        notes.append(f"- {NOT_MEASURED}: {engine} {what} not measured at {', '.join(labels)}: {why}{extra}.")
    for r in rows:
        for engine, entry in r.items():
            for metric, spread in (entry.get("uneven") or {}).items() if isinstance(entry, dict) else ():
                what = "prefill" if metric == "prompt_tps" else "decode"
                notes.append(f"- {r['label']}, {engine}: {what} rates differ {spread:.1f}x between rounds "
                             f"(more than {UNEVEN_ROUNDS:g}x): a one-time cost in a timed run; read the rounds in the "
                             "JSON's trials, not the median.")
    shared = sorted({r["shared_prefill"] for r in rows if r.get("shared_prefill")})
    if shared:
        labels = [r["label"] for r in rows if r.get("shared_prefill")]
        notes.append(f"- Decode at {', '.join(labels)}: every engine decodes from its own copy of one cache per round, "
                     f"prefilled by {', '.join(shared)} (--shared-prefill); prompt tok/s is each engine's own prefill. "
                     "Peak memory leaves out the shared cache the harness holds meanwhile; * = decode only "
                     "(the engine did not prefill that length).")
    return "\n".join(notes)


def _fmt(x, nd=1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def _beside_lily_markdown(rows: List[Dict], select: Callable[[str], bool], header: str,
                          cells: Callable[[str, Dict, Dict, bool], List[str]]) -> str:
    """A table of the engines ``select`` picks, each row beside lily's at one length: ``cells(engine, its entry,
    lily's entry, decode measured)`` after the length. Empty without such engines."""
    engines = sorted({e for r in rows for e in r if isinstance(e, str) and select(e)})
    if not engines:
        return ""
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        for e in engines:
            a, l_ = r.get(e), r.get("lily")
            if a and l_:
                lines.append("| " + " | ".join([r["label"], *cells(e, a, l_, r["decode"])]) + " |")
    return "\n".join(lines)


def ablation_markdown(rows: List[Dict]) -> str:
    """Per ablation engine: what the switch buys end to end (lily with it on / lily with it off)."""
    return _beside_lily_markdown(
        rows, lambda e: e.startswith(ABLATION_PREFIX),
        "| length | switch(es) off | prefill tok/s off | lily prefill tok/s | on/off | decode tok/s off | "
        "lily decode tok/s | on/off |",
        lambda e, a, l_, dec: [e[len(ABLATION_PREFIX):], _fmt(a.get("prompt_tps")), _fmt(l_.get("prompt_tps")),
                               _fmt(a.get("prefill_vs_lily"), 3), _fmt(a.get("generation_tps") if dec else None),
                               _fmt(l_.get("generation_tps") if dec else None),
                               _fmt(a.get("decode_vs_lily") if dec else None, 3)])


def is_variant(engine: str) -> bool:
    """An engine with a modifier (``lily@chunk-4096``, ``stock@eval-per-layer``): compared with lily in its own
    table."""
    return engine != base_engine(engine)


def variant_markdown(rows: List[Dict]) -> str:
    """Per engine with a modifier: its prefill, decode and peak memory next to lily's, and it / lily."""
    return _beside_lily_markdown(
        rows, is_variant,
        "| length | engine | prefill tok/s | lily prefill tok/s | it / lily | decode tok/s | lily decode tok/s | "
        "it / lily | peak GB it / lily |",
        lambda e, a, l_, dec: [e, _fmt(a.get("prompt_tps")), _fmt(l_.get("prompt_tps")),
                               _fmt(_ratio(a.get("prompt_tps"), l_.get("prompt_tps")), 3),
                               _fmt(a.get("generation_tps") if dec else None),
                               _fmt(l_.get("generation_tps") if dec else None),
                               _fmt(_ratio(a.get("generation_tps"), l_.get("generation_tps")) if dec else None, 3),
                               f"{_fmt(a.get('peak_memory'), 2)} / {_fmt(l_.get('peak_memory'), 2)}"])


def plot(rows: List[Dict], path: str, title: str) -> Optional[str]:
    """Throughput vs length, both engines (PNG). Returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, flag, name in ((axes[0], "prompt_tps", "prefill", "prefill (prompt tok/s)"),
                                (axes[1], "generation_tps", "decode", "decode (generation tok/s)")):
        pts = [r for r in rows if r[flag]]
        labels = {"stock": "MLX-LM", STOCK_KERNELS: "MLX-LM + its own kernels", "lily": "lily-mlx"}
        for engine, style in (("stock", "o-"), (STOCK_KERNELS, "^:"), ("lily", "s--")):
            xs = [r["length"] for r in pts if r.get(engine) and r[engine].get(key)]
            ys = [r[engine][key] for r in pts if r.get(engine) and r[engine].get(key)]
            if xs:
                ax.plot(xs, ys, style, label=labels[engine])
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["length"] for r in pts])
        ax.set_xticklabels([r["label"] for r in pts], rotation=45)
        ax.set_xlabel("prompt length" if flag == "prefill" else "context length")
        ax.set_ylabel("tokens / s")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
