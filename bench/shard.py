"""lily-mlx on a model sharded over the ranks of ``mx.distributed`` (tensor parallel, ``model.shard()``).

Every rank builds the same random Qwen3.6-35B-A3B model from the seed (no checkpoint), shards it over
the group when there is more than one rank, checks stock against lily on a short prompt, then times
each engine at each length with bench/e2e.py's sweep (prompt tok/s to the first token, decode tok/s
after it, peak memory; medians over rounds, engine order alternating). Rank 0 writes ``results.json``
and ``shard.md`` into ``--out``; the other ranks print nothing of their own.

Two ranks, one per GPU (``mlx.launch --backend nccl`` gives rank r ``CUDA_VISIBLE_DEVICES=r``)::

    mlx.launch --backend nccl -n 2 -- python -m bench.shard --out out/shard-2
    python -m bench.shard --out out/shard-1                       # the same on one GPU (no launcher)
    python -m bench.shard --merge out/shard-1 out/shard-2 --out out/shard   # one table: 1 GPU vs 2 ranks

On CPU (CI, quick tries): ``mlx.launch --backend ring -n 2 -- python -m bench.shard --size tiny
--lengths 64,128 --gen-tokens 4 --rounds 1 --out /tmp/x``. Without ``mlx.launch`` on PATH:
``python -c "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())" ...``.

What the numbers are: rank 0's clock (every all-reduce waits for both ranks, so it is the sharded
system's rate) and rank 0's peak memory (one rank's share). The correctness check (before timing,
recorded, never aborting the timing) is bench/smoke.py's: greedy tokens of stock and lily, and both
in bf16 judged against an fp32 oracle, on the model as it runs here (sharded or not). Its logits are
kept (``check_logits.npz``) so that ``--merge`` can also compare sharded lily with one-device lily.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def launched() -> bool:
    """Started by ``mlx.launch`` (it gives every rank ``MLX_RANK``)."""
    return "MLX_RANK" in os.environ


def pin_gpu_to_rank() -> None:
    """One GPU per rank on one host, before MLX starts CUDA.

    MLX's CUDA backend computes on device 0 of the devices a process sees, while its NCCL group calls
    ``cudaSetDevice(rank % visible)``: two ranks that both see every GPU would both compute on GPU 0.
    ``mlx.launch --backend nccl`` prevents that by giving rank r ``CUDA_VISIBLE_DEVICES=r``; a rank
    started another way without ``CUDA_VISIBLE_DEVICES`` gets the same here. Harmless without CUDA."""
    if launched() and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["MLX_RANK"]


pin_gpu_to_rank()  # before anything imports mlx

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from . import e2e  # noqa: E402

DEFAULT_ENGINES = f"{e2e.STOCK_KERNELS},lily"


def default_backend() -> str:
    return "nccl" if mx.distributed.is_available("nccl") else "ring"


def init_group(backend: str):
    """The group of all ranks, or None when this process runs alone (no launcher, or one rank)."""
    if not launched():
        return None
    group = mx.distributed.init(strict=True, backend=backend)
    return group if group.size() > 1 else None


def model_config(size: str, num_layers=None) -> dict:
    """bench/model_setup.py's config; ``tiny`` with MoE widths of 128, so that each of 2 ranks keeps whole
    64-wide quantisation groups of the experts' and the shared expert's down projections (tiny's own 64
    would leave half a group per rank). The one-device run uses the same widths: same model."""
    from .model_setup import model_config as base

    config = base(size, num_layers)
    if size == "tiny":
        config["text_config"].update(moe_intermediate_size=128, shared_expert_intermediate_size=128)
    return config


def weights_fingerprint(model) -> float:
    """A sum over every parameter (as fp32): equal on every rank when each built the same weights."""
    from mlx.utils import tree_flatten

    total = mx.array(0.0)
    for _, v in tree_flatten(model.parameters()):
        total = total + v.astype(mx.float32).sum()
    return total.item()


def gather_floats(group, values) -> list:
    """Each rank's ``values`` (a list of floats), as a list per rank; [values] without a group."""
    if group is None:
        return [list(values)]
    out = mx.distributed.all_gather(mx.array([values], dtype=mx.float32), group=group)
    return out.tolist()


def correctness(model, prompt_len: int, decode_steps: int, vocab: int, seed: int, tolerance: float):
    """bench/smoke.py's check on this (maybe sharded) model: (summary, logits by name)."""
    from . import smoke

    e2e.Engines(model).use("stock")  # unpatched, stock's own DeltaNet path (what smoke compares)
    r = smoke.compare(model, prompt_len, decode_steps, vocab, seed=seed, keep_logits=True)
    logits = r.pop("logits")
    r["same_tokens"] = r["stock_tokens"] == r["lily_tokens"]
    r["agrees"] = smoke.agrees(r, tolerance)
    r["tolerance"] = tolerance
    return r, logits


def save_logits(path: Path, logits: dict) -> None:
    """float16 where lossless enough (bf16 logits fit it exactly in its normal range): 2x smaller."""
    arrays = {k: (v.astype(np.float16) if np.abs(v).max() < 6e4 else v) for k, v in logits.items()}
    np.savez_compressed(path, **arrays)


def check_line(c: dict) -> str:
    return (f"greedy tokens stock == lily: {c['same_tokens']} ({c['stock_tokens']} / {c['lily_tokens']}); "
            f"fp32 lily vs stock {c['fp32_lily_vs_stock']:.2e} of the largest logit (tolerance "
            f"{c['tolerance']:g}); bf16 vs the fp32 oracle: stock {c['bf16_stock_vs_fp32']:.4f}, lily "
            f"{c['bf16_lily_vs_fp32']:.4f}; bf16 lily vs stock {c['rel_diff']:.4f}; "
            f"{'agrees' if c['agrees'] else 'MISMATCH'}")


def run_markdown(results: dict) -> str:
    lines = [f"world size {results['world_size']} ({results['backend'] or 'one process'}), {results['model']}, "
             f"lily backend {results['environment']['lily_backend']}", ""]
    if results.get("check"):
        c = results["check"]
        lines += [f"Check ({c['prompt_len']}-token prompt, {c.get('layers', '?')}-layer model): {check_line(c)}", ""]
    if results.get("e2e"):
        lines.append(e2e.table_markdown(results["e2e"]["rows"]))
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from .run import environment
    from .model_setup import build_random_model

    os.environ.setdefault("LILY_TUNE", "off")  # lily's defaults, not this machine's tune profile
    backend = args.backend or default_backend()
    group = init_group(backend)
    world, rank = (group.size(), group.rank()) if group else (1, 0)

    if rank > 0:
        sys.stdout = open(os.devnull, "w")  # MLX-LM's prints too; errors still reach stderr

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    for engine in engines:
        e2e.validate_engine(engine)
    lengths = [] if args.lengths.strip().lower() in ("", "none") else e2e.parse_lengths(args.lengths)
    if not lengths and not args.check_prompt:
        raise SystemExit("--lengths none needs the check (--check-prompt > 0): nothing would run")
    out_dir = Path(args.out) if args.out else None
    if out_dir and rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    env = environment()
    env["command"] = " ".join(["python -m bench.shard"] + sys.argv[1:])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    env["cuda_visible_devices_per_rank"] = [
        int(v) if v >= 0 else None
        for (v,) in gather_floats(group, [float(visible) if visible.isdigit() else -1.0])]
    results = {"world_size": world, "backend": backend if group else None, "environment": env,
               "args": vars(args)}
    log(f"[shard] world size {world}, backend {results['backend']}, {json.dumps(env)}")

    def save():
        if out_dir and rank == 0:
            (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))

    if args.check_prompt:
        # On a model of --check-layers layers (same widths, same seed), as bench.smoke: through 40 random
        # layers any rounding difference (a reordered all-reduce included) grows to the size of the logits,
        # and the check says nothing.
        t0 = time.perf_counter()
        check_model = build_random_model(model_config(args.size, args.check_layers), seed=args.seed, log=log)
        if group is not None:
            check_model.shard(group)
            mx.eval(check_model.parameters())
        check_vocab = model_config(args.size, args.check_layers)["text_config"]["vocab_size"]
        check, logits = correctness(check_model, args.check_prompt, args.check_steps, check_vocab, args.seed,
                                    args.tolerance)
        del check_model
        mx.clear_cache()
        check["layers"] = args.check_layers
        check["seconds"] = round(time.perf_counter() - t0, 1)
        results["check"] = check
        log(f"[check] {args.check_layers} layers: {check_line(check)} ({check['seconds']} s)")
        if out_dir and rank == 0:
            save_logits(out_dir / "check_logits.npz", logits)

    if not lengths:  # --lengths none: the check alone
        save()
        log(f"[shard] check only (--lengths none): {json.dumps(results.get('check'))}")
        return 0

    config = model_config(args.size, args.num_layers)
    model = build_random_model(config, seed=args.seed, log=log)
    layers = config["text_config"]["num_hidden_layers"]
    results["model"] = (f"Qwen3.6-35B-A3B architecture ({args.size}, {layers} layers), random 4-bit weights, "
                        f"seed {args.seed}")
    vocab = config["text_config"]["vocab_size"]
    prints = [p for (p,) in gather_floats(group, [weights_fingerprint(model)])]
    results["same_weights_on_ranks"] = len(set(prints)) == 1
    if not results["same_weights_on_ranks"]:
        log(f"[shard] WARNING: the ranks built different weights (fingerprints {prints})")
    if group is not None:
        t0 = time.perf_counter()
        model.shard(group)
        mx.eval(model.parameters())
        mx.clear_cache()
        log(f"[shard] sharded over {world} ranks in {time.perf_counter() - t0:.1f} s")
    save()

    log(f"[e2e] lengths {[e2e.length_label(n) for n in lengths]}, {args.rounds} rounds, engines {engines}, "
        f"{args.gen_tokens} decode tokens")
    t0 = time.perf_counter()
    if args.warmup_length:
        e2e.sweep(model, [args.warmup_length], [], [args.warmup_length], 1, 4, args.prefill_step_size,
                  engines, vocab, seed=args.seed + 999, log=lambda m: log("[warmup] " + m))

    def on_row(rows, complete=False):
        for row in rows:
            toks = [row[e]["tokens"] for e in engines]
            row["same_tokens"] = all(t == toks[0] for t in toks)
        results["e2e"] = {"rows": rows, "seconds": time.perf_counter() - t0, "complete": complete}
        save()

    rows = e2e.sweep(model, lengths, lengths, lengths, args.rounds, args.gen_tokens, args.prefill_step_size,
                     engines, vocab, seed=args.seed, log=log, on_row=on_row)
    on_row(rows, complete=True)
    text = run_markdown(results)
    log(text)
    if out_dir and rank == 0:
        (out_dir / "shard.md").write_text(text)
    return 0


# ---------------------------------------------------------------------------------------------------
# --merge: one device vs several ranks


def _rel(a, b, scale: float) -> dict:
    """max |a - b| / scale over the positions both runs reached from the same tokens: up to and including
    the first whose greedy token differs (each run then continues from its own token)."""
    a, b = a.astype(np.float32), b.astype(np.float32)
    differ = np.nonzero(a.argmax(-1) != b.argmax(-1))[0]
    rows = int(differ[0]) + 1 if differ.size else len(a)
    return {"rel": float(np.max(np.abs(a[:rows] - b[:rows])) / max(scale, 1e-6)), "positions": rows,
            "of": len(a)}


def merge_check(base_dir: Path, other_dir: Path) -> dict:
    """Sharded vs one-device logits of the correctness check (same prompt, same weights), relative to
    the one-device fp32 oracle's largest logit, with the yardstick: sharded stock vs one-device stock
    (the all-reduce of bf16 partials is the only new rounding)."""
    paths = [d / "check_logits.npz" for d in (base_dir, other_dir)]
    if not all(p.exists() for p in paths):
        return {}
    one, sh = (np.load(p) for p in paths)
    scale = float(np.max(np.abs(one["stock_fp32"].astype(np.float32))))
    return {
        "lily_sharded_vs_one": _rel(sh["lily_bf16"], one["lily_bf16"], scale),
        "stock_sharded_vs_one": _rel(sh["stock_bf16"], one["stock_bf16"], scale),
        "lily_sharded_vs_fp32_oracle": _rel(sh["lily_bf16"], one["stock_fp32"], scale),
        "stock_sharded_vs_fp32_oracle": _rel(sh["stock_bf16"], one["stock_fp32"], scale),
        "lily_one_vs_fp32_oracle": _rel(one["lily_bf16"], one["stock_fp32"], scale),
        "fp32_lily_sharded_vs_one": _rel(sh["lily_fp32"], one["lily_fp32"], scale),
    }


def merge(dirs, out: Path) -> int:
    runs = sorted(((json.loads((d / "results.json").read_text()), d) for d in dirs),
                  key=lambda x: x[0]["world_size"])
    if len(runs) != 2 or runs[0][0]["world_size"] == runs[1][0]["world_size"]:
        raise SystemExit("--merge takes two result folders of different world sizes (e.g. 1 and 2)")
    (one, base_dir), (sh, other_dir) = runs
    n = sh["world_size"]
    engines = [e for e in sh["args"]["engines"].split(",") if e in one["args"]["engines"].split(",")]
    rows = []
    by_len = {r["length"]: r for r in one.get("e2e", {}).get("rows", [])}
    for r2 in sh.get("e2e", {}).get("rows", []):
        r1 = by_len.get(r2["length"])
        if r1 is None:
            continue
        for e in engines:
            a, b = r1.get(e), r2.get(e)
            if not a or not b:
                continue
            pre = (a["prompt_tps"], b["prompt_tps"])
            dec = (a.get("generation_tps"), b.get("generation_tps"))
            rows.append({"engine": e, "length": r2["length"], "label": r2["label"],
                         "prompt_tps": pre, "prefill_speedup": pre[1] / pre[0],
                         "generation_tps": dec,
                         "decode_speedup": dec[1] / dec[0] if dec[0] and dec[1] else None,
                         "peak_memory": (a["peak_memory"], b["peak_memory"]),
                         "same_tokens": a["tokens"] == b["tokens"]})
    check = {"one": one.get("check"), "sharded": sh.get("check"), "logits": merge_check(base_dir, other_dir)}
    for key, engine in (("lily_sharded_vs_one_tokens", "lily"), ("stock_sharded_vs_one_tokens", "stock")):
        if check["one"] and check["sharded"]:
            check[key] = check["one"][f"{engine}_tokens"] == check["sharded"][f"{engine}_tokens"]

    def f(x, nd=1):
        return "-" if x is None else f"{x:,.{nd}f}"

    env = sh["environment"]
    lines = [f"# 1 device vs {n} ranks ({sh['backend']})", "",
             f"{sh.get('model', 'no timed run (--lengths none)')}; {env.get('device', {}).get('device_name', env['default_device'])}; mlx {env['mlx']}, "
             f"mlx-lm {env['mlx_lm']}, lily {env['lily_mlx']}, lily backend {env['lily_backend']}; "
             f"medians of {sh['args']['rounds']} rounds, {sh['args']['gen_tokens']} decode tokens; "
             f"GPUs per rank (CUDA_VISIBLE_DEVICES) {env.get('cuda_visible_devices_per_rank')}.", "",
             f"| engine | length | prefill tok/s 1 | prefill tok/s {n} ranks | speedup | decode tok/s 1 | "
             f"decode tok/s {n} ranks | speedup | peak GB 1 / per rank | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["length"], engines.index(r["engine"]))):
        lines.append(f"| {r['engine']} | {r['label']} | {f(r['prompt_tps'][0])} | {f(r['prompt_tps'][1])} | "
                     f"{f(r['prefill_speedup'], 2)}x | {f(r['generation_tps'][0])} | {f(r['generation_tps'][1])} | "
                     f"{f(r['decode_speedup'], 2)}x | {f(r['peak_memory'][0], 2)} / {f(r['peak_memory'][1], 2)} | "
                     f"{r['same_tokens']} |")
    lines.append("")
    for label, c in (("1 device", check["one"]), (f"{n} ranks", check["sharded"])):
        if c:
            lines.append(f"- Check on {label}: {check_line(c)}")
    if check.get("lily_sharded_vs_one_tokens") is not None:
        lines.append(f"- Greedy check tokens, {n} ranks == 1 device: lily {check['lily_sharded_vs_one_tokens']}, "
                     f"stock {check['stock_sharded_vs_one_tokens']}")
    lg = check["logits"]
    if lg:
        g = {k: f"{v['rel']:.2e} ({v['positions']}/{v['of']})" for k, v in lg.items()}
        lines.append(f"- Check logits, max |diff| / largest fp32 logit (positions compared: up to the first "
                     f"differing greedy token): lily {n} ranks vs 1 device {g['lily_sharded_vs_one']}; stock {n} "
                     f"ranks vs 1 device {g['stock_sharded_vs_one']} (the all-reduce's rounding); vs the fp32 "
                     f"oracle (1 device): lily {n} ranks {g['lily_sharded_vs_fp32_oracle']}, stock {n} ranks "
                     f"{g['stock_sharded_vs_fp32_oracle']}, lily 1 device {g['lily_one_vs_fp32_oracle']}; "
                     f"fp32 lily {n} ranks vs 1 device {g['fp32_lily_sharded_vs_one']}")
    if "same_weights_on_ranks" in sh:
        lines.append(f"- Same weights on every rank: {sh['same_weights_on_ranks']}")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"world_sizes": [one["world_size"], n], "rows": rows, "check": check,
         "runs": {str(one["world_size"]): one, str(n): sh}}, indent=1, default=str))
    (out / "shard.md").write_text(text)
    print(text)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.shard", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=None,
                   help="mx.distributed backend under mlx.launch (default: nccl where this MLX has it, else ring); "
                        "launch with the same --backend")
    p.add_argument("--size", default="full", choices=("full", "tiny"), help="random model size")
    p.add_argument("--num-layers", type=int, default=None, help="fewer layers (quick runs)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed (every rank builds the same model)")
    p.add_argument("--lengths", default="4K,32K",
                   help="prompt lengths (K = 1024), each also the decode context; 'none': the check alone")
    p.add_argument("--rounds", type=int, default=3, help="rounds per length (engine order alternates)")
    p.add_argument("--gen-tokens", type=int, default=32, help="decode tokens timed after the first")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--engines", default=DEFAULT_ENGINES,
                   help=f"comma-separated, as bench.run's: {e2e.STOCK_KERNELS} (stock MLX-LM with its own GDN "
                        f"kernels, the fair baseline), lily, stock (stock on CUDA prefills ~290 tok/s: 32K "
                        f"takes ~2 min a run), lily-off:<switch>")
    p.add_argument("--warmup-length", type=int, default=256, help="one untimed run per engine first (0: none)")
    p.add_argument("--check-prompt", type=int, default=64,
                   help="prompt length of the stock-vs-lily check before timing (0: no check)")
    p.add_argument("--check-steps", type=int, default=4, help="greedy decode steps of the check")
    p.add_argument("--check-layers", type=int, default=4,
                   help="layers of the check's model (same widths and seed as the timed model; few, so that "
                        "rounding differences stay small enough to judge)")
    p.add_argument("--tolerance", type=float, default=1e-3, help="check: fp32 max |lily - stock| / max |logit|")
    p.add_argument("--merge", nargs=2, metavar="DIR", default=None,
                   help="no run: merge a 1-device and a sharded result folder into one table in --out")
    p.add_argument("--out", default=None, help="results.json, shard.md (and check_logits.npz) go here")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.merge:
        if not args.out:
            raise SystemExit("--merge needs --out")
        return merge([Path(d) for d in args.merge], Path(args.out))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
