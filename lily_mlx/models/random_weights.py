"""Full-size random 4-bit Qwen3.6-35B-A3B checkpoints for benchmarks, written directly in quantised form.

    python -m lily_mlx build-random --out DIR [--skew 1.5] [--layers N] [--seed 0]

The checkpoint has the tensor names, shapes and dtypes of ``mlx-community/Qwen3.6-35B-A3B-4bit`` as
MLX-LM holds it after ``sanitize`` (so nothing is converted at load time): 4-bit affine group-64
weights packed in uint32 with bf16 scales and biases, 8-bit routers (``mlp.gate``) and shared-expert
gates, bf16 norms / conv1d (MLX layout ``[C, K, 1]``) / ``dt_bias``, fp32 ``A_log``. Stock
``mlx_lm.load`` loads it. The tokenizer is the embedded model's (ids beyond its vocabulary simply
never occur).

How values are made (no weight matrix ever exists in bf16 in full: projections are drawn directly
as packed nibbles, the embedding is quantised 32K rows at a time; each shard is generated with ``mx.random``
and written before the next one starts, so memory stays at about one shard, ~5 GB):

- A 4-bit weight is uniform random nibbles ``q`` (random uint32 words), with per-group
  ``scale = std / 4.61 * U(0.75, 1.25)`` (4.61 is the std of a uniform nibble) and
  ``bias = -7.5 * scale``: dequantised values have mean 0 and std ``std``.
- ``std`` is ``fan_in ** -0.5`` for input projections, divided by ``sqrt(2 * layers)`` for the
  projections that write into the residual stream (o_proj, out_proj, expert and shared down_proj),
  so the residual stream stays O(1) through all 40 layers; norms are 1; ``A_log = log U(1, 16)``
  and ``dt_bias = 1`` (MLX-LM's own init ranges); conv1d taps have std ``K ** -0.5``.
- Every tensor's values depend only on ``seed`` and its name, so the same seed gives the same file.

Skewed routing (``skew > 0``): real routers send many more tokens to some experts than to others.
Here channel 0 of every token embedding is a constant ``SINK_VALUE`` (a "massive activation", as
real LLMs have), so after each RMSNorm every token carries a positive component on channel 0.
Router row ``e`` gets weight ``skew * g_e / SINK_VALUE`` on that channel, with ``g_e ~ N(0, 1)``
drawn per layer: expert ``e``'s logit is shifted by about ``skew * g_e`` for every token, against
random logit noise of std about 1. ``skew = 0`` gives near-uniform routing; ``skew = 1.5`` makes a
handful of experts per layer take a large share of the assignments (different experts per layer).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import qwen3_6

SINK_VALUE = 4.0
SHARD_BYTES = 5 * 1024**3
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple
    dtype: str  # "uint32", "bfloat16", "float32"
    make: Callable  # key -> mx.array (lazy)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (2 if self.dtype == "bfloat16" else 4)


def _key(seed: int, name: str):
    import mlx.core as mx

    return mx.random.key((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))


def _level_std(bits: int) -> float:
    levels = 2**bits
    return math.sqrt((levels * levels - 1) / 12.0)


def _quantized(prefix: str, lead: tuple, out_dim: int, in_dim: int, std: float, bits: int = 4):
    """Specs for ``{prefix}.weight/scales/biases`` of a random affine-quantised [*lead, out, in]."""
    import mlx.core as mx

    g = qwen3_6.GROUP_SIZE
    shape_w = (*lead, out_dim, in_dim * bits // 32)
    shape_s = (*lead, out_dim, in_dim // g)
    level_scale = std / _level_std(bits)
    mid = (2**bits - 1) / 2.0

    # All three parts get the matrix's key: the words from one half of it, the per-group jitter
    # (shared by scales and biases, bias = -mid * scale) from the other.
    def weight(key):
        # Uniform 16-bit halves viewed as uint32 words: every nibble / byte is uniform.
        halves = (*shape_w[:-1], 2 * shape_w[-1])
        k = mx.random.split(key)[0]
        return mx.random.randint(0, 1 << 16, halves, dtype=mx.uint16, key=k).view(mx.uint32)

    def jitter(key):
        return mx.random.uniform(0.75, 1.25, shape_s, key=mx.random.split(key)[1])

    def scales(key):
        return (level_scale * jitter(key)).astype(mx.bfloat16)

    def biases(key):
        return (-mid * level_scale * jitter(key)).astype(mx.bfloat16)

    return [
        TensorSpec(f"{prefix}.weight", shape_w, "uint32", weight),
        TensorSpec(f"{prefix}.scales", shape_s, "bfloat16", scales),
        TensorSpec(f"{prefix}.biases", shape_s, "bfloat16", biases),
    ]


def _shared_parts(prefix: str, shapes: tuple, dtypes: tuple, build: Callable) -> list[TensorSpec]:
    """Specs for ``{prefix}.weight/scales/biases`` computed together by ``build(key)`` (one lazy
    ``mx.quantize``): the first part asked for builds the triple, the others reuse it."""
    made = {}

    def part(index):
        def make(key):
            if "parts" not in made:
                made["parts"], made["left"] = build(key), 3
            out = made["parts"][index]
            made["left"] -= 1
            if made["left"] == 0:
                made.clear()  # written: drop the references
            return out

        return make

    return [
        TensorSpec(f"{prefix}.{suffix}", shape, dtype, part(i))
        for i, (suffix, shape, dtype) in enumerate(zip(("weight", "scales", "biases"), shapes, dtypes))
    ]


def _quantized_from_float(prefix: str, shape: tuple, make_float: Callable, bits: int):
    """Specs for a small weight built in bf16 first, then quantised with ``mx.quantize``."""
    import mlx.core as mx

    g = qwen3_6.GROUP_SIZE
    out_dim, in_dim = shape

    def build(key):
        return mx.quantize(make_float(key).astype(mx.bfloat16), group_size=g, bits=bits)

    shapes = ((out_dim, in_dim * bits // 32), (out_dim, in_dim // g), (out_dim, in_dim // g))
    return _shared_parts(prefix, shapes, ("uint32", "bfloat16", "bfloat16"), build)


def _filled(name: str, shape: tuple, value: float, dtype: str = "bfloat16"):
    import mlx.core as mx

    return TensorSpec(name, shape, dtype, lambda key: mx.full(shape, value, getattr(mx, dtype)))


def _embedding_specs(prefix: str, vocab: int, hidden: int, chunk_rows: int = 32768):
    """Token embeddings, std 1, channel 0 = SINK_VALUE, quantised 4-bit chunk by chunk of rows."""
    import mlx.core as mx

    g = qwen3_6.GROUP_SIZE
    n_chunks = -(-vocab // chunk_rows)

    def build(key):
        keys = mx.random.split(key, num=n_chunks)
        parts = ([], [], [])
        for c, start in enumerate(range(0, vocab, chunk_rows)):
            rows = min(chunk_rows, vocab - start)
            w = mx.random.normal((rows, hidden), key=keys[c])
            w = mx.concatenate([mx.full((rows, 1), SINK_VALUE), w[:, 1:]], axis=1)  # sink channel
            for dst, src in zip(parts, mx.quantize(w.astype(mx.bfloat16), group_size=g, bits=4)):
                dst.append(src)
        return tuple(mx.concatenate(p, axis=0) for p in parts)

    shapes = ((vocab, hidden // 8), (vocab, hidden // g), (vocab, hidden // g))
    return _shared_parts(prefix, shapes, ("uint32", "bfloat16", "bfloat16"), build)


def _router_specs(prefix: str, experts: int, hidden: int, skew: float):
    """8-bit router: random rows plus the per-expert skew on the sink channel (see module doc)."""
    import mlx.core as mx

    def make_float(key):
        k_w, k_g = mx.random.split(key)
        w = mx.random.normal((experts, hidden), key=k_w) * hidden**-0.5
        if skew > 0:
            hot = mx.random.normal((experts, 1), key=k_g) * (skew / SINK_VALUE)
            w = mx.concatenate([hot, w[:, 1:]], axis=1)
        return w

    return _quantized_from_float(prefix, (experts, hidden), make_float, qwen3_6.GATE_BITS)


def checkpoint_specs(text_cfg: dict, *, skew: float = 0.0) -> list[TensorSpec]:
    """Every tensor of the sanitised quantised checkpoint, in file order, with its generator
    (a function of a key; ``write_random_checkpoint`` derives the keys from the seed and names)."""
    import mlx.core as mx

    H = text_cfg["hidden_size"]
    L = text_cfg["num_hidden_layers"]
    V = text_cfg["vocab_size"]
    E = text_cfg["num_experts"]
    I = text_cfg["moe_intermediate_size"]
    Is = text_cfg["shared_expert_intermediate_size"]
    Hq, Hkv, D = text_cfg["num_attention_heads"], text_cfg["num_key_value_heads"], text_cfg["head_dim"]
    Hk, Hv = text_cfg["linear_num_key_heads"], text_cfg["linear_num_value_heads"]
    Dk, Dv = text_cfg["linear_key_head_dim"], text_cfg["linear_value_head_dim"]
    K = text_cfg["linear_conv_kernel_dim"]
    key_dim, value_dim = Hk * Dk, Hv * Dv
    conv_dim = 2 * key_dim + value_dim
    residual = 1.0 / math.sqrt(2 * L)  # scale of projections that write into the residual stream

    root = "language_model.model"
    specs = _embedding_specs(f"{root}.embed_tokens", V, H)
    for i in range(L):
        p = f"{root}.layers.{i}"
        specs += [
            _filled(f"{p}.input_layernorm.weight", (H,), 1.0),
            _filled(f"{p}.post_attention_layernorm.weight", (H,), 1.0),
        ]
        if qwen3_6.is_linear_layer(text_cfg, i):
            a = f"{p}.linear_attn"
            specs += _quantized(f"{a}.in_proj_qkv", (), conv_dim, H, H**-0.5)
            specs += _quantized(f"{a}.in_proj_z", (), value_dim, H, H**-0.5)
            specs += _quantized(f"{a}.in_proj_b", (), Hv, H, H**-0.5)
            specs += _quantized(f"{a}.in_proj_a", (), Hv, H, H**-0.5)
            specs += [
                TensorSpec(
                    f"{a}.conv1d.weight", (conv_dim, K, 1), "bfloat16",
                    lambda key, s=(conv_dim, K, 1): (mx.random.normal(s, key=key) * K**-0.5).astype(mx.bfloat16),
                ),
                _filled(f"{a}.dt_bias", (Hv,), 1.0),
                TensorSpec(
                    f"{a}.A_log", (Hv,), "float32",
                    lambda key, n=Hv: mx.log(mx.random.uniform(1.0, 16.0, (n,), key=key)),
                ),
                _filled(f"{a}.norm.weight", (Dv,), 1.0),
            ]
            specs += _quantized(f"{a}.out_proj", (), H, value_dim, value_dim**-0.5 * residual)
        else:
            a = f"{p}.self_attn"
            specs += _quantized(f"{a}.q_proj", (), 2 * Hq * D, H, H**-0.5)  # queries and gate
            specs += _quantized(f"{a}.k_proj", (), Hkv * D, H, H**-0.5)
            specs += _quantized(f"{a}.v_proj", (), Hkv * D, H, H**-0.5)
            specs += _quantized(f"{a}.o_proj", (), H, Hq * D, (Hq * D) ** -0.5 * residual)
            specs += [_filled(f"{a}.q_norm.weight", (D,), 1.0), _filled(f"{a}.k_norm.weight", (D,), 1.0)]
        m = f"{p}.mlp"
        specs += _router_specs(f"{m}.gate", E, H, skew)
        specs += _quantized(f"{m}.switch_mlp.gate_proj", (E,), I, H, H**-0.5)
        specs += _quantized(f"{m}.switch_mlp.up_proj", (E,), I, H, H**-0.5)
        specs += _quantized(f"{m}.switch_mlp.down_proj", (E,), H, I, I**-0.5 * residual)
        specs += _quantized(f"{m}.shared_expert.gate_proj", (), Is, H, H**-0.5)
        specs += _quantized(f"{m}.shared_expert.up_proj", (), Is, H, H**-0.5)
        specs += _quantized(f"{m}.shared_expert.down_proj", (), H, Is, Is**-0.5 * residual)
        specs += _quantized_from_float(
            f"{m}.shared_expert_gate", (1, H),
            lambda key, n=H: mx.random.normal((1, n), key=key) * n**-0.5,
            qwen3_6.GATE_BITS,
        )
    specs.append(_filled(f"{root}.norm.weight", (H,), 1.0))
    specs += _quantized("language_model.lm_head", (), V, H, H**-0.5)
    return specs


def _spec_key(spec: TensorSpec, seed: int):
    # weight / scales / biases of one quantised matrix must describe the same matrix: they get the
    # key of the module (the name without the suffix); other tensors (norms, A_log) their own.
    name = spec.name
    for suffix in (".weight", ".scales", ".biases"):
        if name.endswith(suffix) and spec.dtype != "float32":
            return _key(seed, name[: -len(suffix)])
    return _key(seed, name)


def _shard_plan(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    shards, current, size = [], [], 0
    for spec in specs:
        if current and size + spec.nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        shards.append(current)
    return shards


def _copy_tokenizer(out_dir: Path, log) -> int:
    """Copy the embedded model's tokenizer (or train it, seconds) and return its eos id."""
    from .embedded import EMBEDDED_DIR
    from .tokenizer import IM_END, load_fast_tokenizer

    if all((EMBEDDED_DIR / f).exists() for f in _TOKENIZER_FILES):
        for f in _TOKENIZER_FILES:
            shutil.copy(EMBEDDED_DIR / f, out_dir / f)
    else:
        from .corpus import load_corpus
        from .tokenizer import save_tokenizer, train_tokenizer

        if log:
            log("embedded model not built: training its tokenizer")
        save_tokenizer(train_tokenizer(load_corpus().train, 1024), out_dir)
    return load_fast_tokenizer(out_dir).token_to_id(IM_END)


def write_random_checkpoint(
    out_dir,
    *,
    seed: int = 0,
    skew: float = 0.0,
    config_overrides: dict | None = None,
    shard_bytes: int = SHARD_BYTES,
    log=print,
) -> Path:
    """Write a random quantised Qwen3.6-35B-A3B checkpoint (or a resized one) to ``out_dir``."""
    import mlx.core as mx

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("model*.safetensors"):
        old.unlink()
    text_cfg = qwen3_6.text_config(config_overrides)
    if text_cfg["num_hidden_layers"] < text_cfg["full_attention_interval"]:
        # MLX-LM's qwen3_5 model indexes the first attention layer's cache unconditionally.
        raise ValueError(
            f"num_hidden_layers must be >= full_attention_interval "
            f"({text_cfg['full_attention_interval']}) so the model has an attention layer"
        )
    eos_id = _copy_tokenizer(out_dir, log)
    config = qwen3_6.model_config(text_cfg, eos_token_id=eos_id)
    config["quantization"] = qwen3_6.quantization_config(text_cfg)
    config["quantization_config"] = config["quantization"]
    config["lily_random_weights"] = {"seed": seed, "skew": skew, "sink_value": SINK_VALUE}
    (out_dir / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True) + "\n")

    specs = checkpoint_specs(text_cfg, skew=skew)
    shards = _shard_plan(specs, shard_bytes)
    total = sum(s.nbytes for s in specs)
    if log:
        log(f"writing {len(specs)} tensors, {total / 1e9:.2f} GB in {len(shards)} shard(s) to {out_dir}")
    weight_map = {}
    t0 = time.time()
    for n, shard in enumerate(shards, start=1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        arrays = {s.name: s.make(_spec_key(s, seed)) for s in shard}
        for s in shard:
            a = arrays[s.name]
            assert tuple(a.shape) == s.shape and a.dtype == getattr(mx, s.dtype), (s.name, a.shape, a.dtype)
        mx.eval(arrays)
        mx.save_safetensors(str(out_dir / fname), arrays, metadata={"format": "mlx"})
        weight_map.update({name: fname for name in arrays})
        del arrays
        if log:
            done = sum(x.nbytes for sh in shards[:n] for x in sh)
            log(f"  shard {n}/{len(shards)}: {shard[0].name} .. {shard[-1].name}  "
                f"({done / 1e9:.2f}/{total / 1e9:.2f} GB, {time.time() - t0:.0f} s)")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lily_mlx build-random",
        description="Write a random 4-bit Qwen3.6-35B-A3B checkpoint (mlx-community layout, "
        "loads with stock mlx_lm.load) for benchmarks. Full size is about 19.5 GB.",
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--skew", type=float, default=0.0,
        help="router skew: std of per-expert logit offsets vs ~1 for the random part "
        "(0 = near-uniform routing, 1.5 = a few hot experts per layer)",
    )
    parser.add_argument("--layers", type=int, default=None, help="number of layers (default 40)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=JSON",
        help="override a text_config field, e.g. --set num_experts=64 (repeatable)",
    )
    parser.add_argument("--shard-gb", type=float, default=5.0, help="shard size in GB (default 5)")
    args = parser.parse_args(argv)

    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = json.loads(value)
    if args.layers is not None:
        overrides["num_hidden_layers"] = args.layers
    out = write_random_checkpoint(
        args.out, seed=args.seed, skew=args.skew, config_overrides=overrides,
        shard_bytes=int(args.shard_gb * 1024**3),
    )
    print(out.resolve(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
