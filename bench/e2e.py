"""End-to-end sweep: stock MLX-LM vs lily-mlx on one model in one process.

Both engines run MLX-LM's fastest direct generation path (``generate_step``, greedy) on the same
weights: ``lily_mlx.patch(model)`` / ``lily_mlx.unpatch(model)`` switch the model between them. In
every round the two engines run in alternating order; the reported numbers are medians over rounds.
prompt_tps counts the prompt tokens over the time to the first generated token (MLX-LM's
convention); generation_tps the tokens after the first over the time after it; peak memory is
``mx.get_peak_memory() / 1e9`` with the peak reset before each run.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

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
# The fair baseline: stock MLX-LM running its own Gated DeltaNet Metal kernels (through the bridge on
# CUDA, the simulator on sim), as it does on a Mac. Plain "stock" on CUDA runs a per-token op loop.
STOCK_KERNELS = "stock-kernels"
# Engine modifier: evaluate after every decoder layer of a prefill chunk (one host wait per layer).
# A diagnostic, not an optimisation: it tests whether peak memory comes from the host encoding a whole
# chunk ahead of the GPU (docs/moe.md, "Peak memory"). ``stock@eval-per-layer``, ``lily@eval-per-layer``.
EVAL_PER_LAYER = "@eval-per-layer"


def base_engine(engine: str) -> str:
    """The engine without its modifier: ``lily@eval-per-layer`` -> ``lily``."""
    return engine[: -len(EVAL_PER_LAYER)] if engine.endswith(EVAL_PER_LAYER) else engine


def switches_off(engine: str) -> Tuple[str, ...]:
    """Switches an engine runs with off: ``lily-off:gpu_routing+fused_dequant`` -> both; ``lily`` -> none.

    An ablation engine is lily-mlx with those switches off (the write-up's ablation variants), so
    ``--engines stock,lily,lily-off:register_scan`` measures one switch end to end."""
    engine = base_engine(engine)
    if not engine.startswith(ABLATION_PREFIX):
        return ()
    return tuple(switches.parse_list(engine[len(ABLATION_PREFIX):].replace("+", ",")))


def is_lily(engine: str) -> bool:
    engine = base_engine(engine)
    return engine == "lily" or engine.startswith(ABLATION_PREFIX)


def validate_engine(engine: str) -> None:
    """Raise ValueError unless ``engine`` is stock, lily or lily-off:<switches>, optionally with
    the @eval-per-layer modifier (unknown switch names are reported by ``switches_off``)."""
    base = base_engine(engine)
    if base not in ("stock", STOCK_KERNELS, "lily") and not base.startswith(ABLATION_PREFIX):
        raise ValueError(f"unknown engine {engine!r}: use stock, {STOCK_KERNELS}, lily or "
                         f"{ABLATION_PREFIX}<switch>[+<switch>], each optionally followed by {EVAL_PER_LAYER}")
    switches_off(engine)


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
        patched = lily_mlx.is_patched(self.model)
        set_stock_kernels(False)
        if is_lily(engine) and not patched:
            lily_mlx.patch(self.model)
        elif not is_lily(engine) and patched:
            lily_mlx.unpatch(self.model)
        if base_engine(engine) == STOCK_KERNELS:
            set_stock_kernels(True)
        set_eval_per_layer(self.model, engine.endswith(EVAL_PER_LAYER))


def prefill_step(engine: str, requested: int) -> int:
    """The chunk size ``engine`` prefills with (call under the engine's switch state)."""
    if is_lily(engine):
        from lily_mlx.patch import prefill_step_size

        return prefill_step_size(requested)
    return requested


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


def sweep(model, lengths: Sequence[int], prefill_lengths: Sequence[int], decode_lengths: Sequence[int],
          rounds: int, gen_tokens: int, prefill_step_size: int, engines=("stock", "lily"),
          vocab_size: int = 248320, seed: int = 0, log=print, rounds_for=None, on_row=None) -> List[Dict]:
    """Per length: each round runs every engine once (order alternating by round).
    ``rounds_for(length)`` may give fewer rounds to long lengths; ``on_row(rows)`` runs after each
    length (incremental saving)."""
    for engine in engines:
        validate_engine(engine)
    sw = Engines(model)
    rows = []
    for length in lengths:
        gen = gen_tokens if length in decode_lengths else 1
        prompt = mx.random.randint(0, vocab_size, (length,), key=mx.random.key(seed + length))
        per_engine: Dict[str, List[Dict]] = {e: [] for e in engines}
        n_rounds = rounds_for(length) if rounds_for else rounds
        for r in range(n_rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for engine in order:
                sw.use(engine)
                with switches.overrides(disable=switches_off(engine)):
                    res = run_once(model, prompt, gen, prefill_step(engine, prefill_step_size))
                per_engine[engine].append(res)
                log(f"[e2e] {length_label(length):>5} round {r + 1}/{n_rounds} {engine:>5}: "
                    f"prompt_tps={res['prompt_tps']:.3f}, generation_tps={res['generation_tps']:.3f}, "
                    f"peak_memory={res['peak_memory']:.3f}")
        row = {"length": length, "label": length_label(length), "prefill": length in prefill_lengths,
               "decode": length in decode_lengths, "generation_tokens": gen - 1 if gen > 1 else 0}
        for engine, runs in per_engine.items():
            row[engine] = {
                "prompt_tps": statistics.median(x["prompt_tps"] for x in runs),
                "generation_tps": statistics.median(x["generation_tps"] for x in runs) if gen > 1 else None,
                "peak_memory": max(x["peak_memory"] for x in runs),
                "trials": [{k: v for k, v in x.items() if k != "tokens"} for x in runs],
                "tokens": runs[0]["tokens"],
            }
        if "stock" in per_engine and "lily" in per_engine:
            s, l_ = row["stock"], row["lily"]
            row["prefill_ratio"] = l_["prompt_tps"] / s["prompt_tps"]
            row["decode_ratio"] = (l_["generation_tps"] / s["generation_tps"]) if gen > 1 else None
            row["same_tokens"] = s["tokens"] == l_["tokens"]
        if STOCK_KERNELS in per_engine and "lily" in per_engine:  # the fair baseline (README headline)
            s, l_ = row[STOCK_KERNELS], row["lily"]
            row["prefill_ratio_vs_stock_kernels"] = l_["prompt_tps"] / s["prompt_tps"]
            row["decode_ratio_vs_stock_kernels"] = (l_["generation_tps"] / s["generation_tps"]) if gen > 1 else None
        for engine in per_engine:
            if engine.startswith(ABLATION_PREFIX) and "lily" in per_engine:
                a, l_ = row[engine], row["lily"]
                row[engine]["prefill_vs_lily"] = l_["prompt_tps"] / a["prompt_tps"]
                row[engine]["decode_vs_lily"] = (l_["generation_tps"] / a["generation_tps"]) if gen > 1 else None
        row["rounds"] = n_rounds
        rows.append(row)
        if on_row:
            on_row(rows)
    sw.use("stock")
    return rows


def table_markdown(rows: List[Dict]) -> str:
    """The engines' table (medians): stock, stock-kernels (where run) and lily, with lily's ratios."""
    fair = any(STOCK_KERNELS in r for r in rows)
    head = "| length | stock prefill tok/s |" + (f" {STOCK_KERNELS} prefill tok/s |" if fair else "")
    head += " lily prefill tok/s | ratio |" + (f" ratio vs {STOCK_KERNELS} |" if fair else "")
    head += " stock decode tok/s |" + (f" {STOCK_KERNELS} decode tok/s |" if fair else "")
    head += " lily decode tok/s | ratio |" + (f" ratio vs {STOCK_KERNELS} |" if fair else "")
    head += " peak GB stock" + (f" / {STOCK_KERNELS}" if fair else "") + " / lily | same tokens |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def f(x, nd=1):
        return "-" if x is None else f"{x:,.{nd}f}"

    for r in rows:
        s, k, l_ = r.get("stock", {}), r.get(STOCK_KERNELS, {}), r.get("lily", {})
        pre, dec = r["prefill"], r["decode"]
        cells = [r["label"], f(s.get("prompt_tps") if pre else None)]
        cells += [f(k.get("prompt_tps") if pre else None)] if fair else []
        cells += [f(l_.get("prompt_tps") if pre else None), f(r.get("prefill_ratio") if pre else None, 3)]
        cells += [f(r.get("prefill_ratio_vs_stock_kernels") if pre else None, 3)] if fair else []
        cells += [f(s.get("generation_tps") if dec else None)]
        cells += [f(k.get("generation_tps") if dec else None)] if fair else []
        cells += [f(l_.get("generation_tps") if dec else None), f(r.get("decode_ratio") if dec else None, 3)]
        cells += [f(r.get("decode_ratio_vs_stock_kernels") if dec else None, 3)] if fair else []
        peaks = [s.get("peak_memory")] + ([k.get("peak_memory")] if fair else []) + [l_.get("peak_memory")]
        cells += [" / ".join(f(p, 2) for p in peaks), str(r.get("same_tokens", "-"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ablation_markdown(rows: List[Dict]) -> str:
    """Per ablation engine: what the switch buys end to end (lily with it on / lily with it off)."""
    engines = sorted({e for r in rows for e in r if isinstance(e, str) and e.startswith(ABLATION_PREFIX)})
    if not engines:
        return ""
    lines = ["| length | switch(es) off | prefill tok/s off | lily prefill tok/s | on/off | "
             "decode tok/s off | lily decode tok/s | on/off |", "|---|---|---|---|---|---|---|---|"]

    def f(x, nd=1):
        return "-" if x is None else f"{x:,.{nd}f}"

    for r in rows:
        for e in engines:
            a, l_ = r.get(e), r.get("lily")
            if not a or not l_:
                continue
            dec = r["decode"]
            lines.append(f"| {r['label']} | {e[len(ABLATION_PREFIX):]} | {f(a['prompt_tps'])} | "
                         f"{f(l_['prompt_tps'])} | {f(a.get('prefill_vs_lily'), 3)} | "
                         f"{f(a.get('generation_tps') if dec else None)} | "
                         f"{f(l_.get('generation_tps') if dec else None)} | "
                         f"{f(a.get('decode_vs_lily') if dec else None, 3)} |")
    return "\n".join(lines)


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
