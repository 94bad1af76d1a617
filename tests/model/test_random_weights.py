"""Random 4-bit Qwen3.6 checkpoints: the full-size code path at a tiny size. Stock ``mlx_lm.load``
loads them strictly (every tensor name, shape and dtype as MLX-LM's quantised model has them, no
conversion), the forward is finite and sane, skew concentrates routing, and seeds are reproducible."""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from lily_mlx.models import qwen3_6, random_weights

TINY = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "head_dim": 64,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 32,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "vocab_size": 1024,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("random")
    plain = random_weights.write_random_checkpoint(root / "plain", seed=0, config_overrides=TINY, log=None)
    skewed = random_weights.write_random_checkpoint(
        root / "skewed", seed=0, skew=2.0, config_overrides=TINY, log=None
    )
    return plain, skewed


def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.glob("model*.safetensors"))}


def _expected_parameters(config):
    """Names, shapes, dtypes of MLX-LM's own quantised model for this config."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5_moe
    from mlx_lm.utils import quantize_model

    plain = {k: v for k, v in config.items() if not k.startswith("quantization")}
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(plain))
    model, qconfig = quantize_model(model, plain, group_size=64, bits=4, mode="affine")
    params = {}
    for name, value in tree_flatten(model.parameters()):
        dtype = value.dtype
        if dtype == mx.float32 and not name.endswith("A_log"):
            dtype = mx.bfloat16  # the checkpoint's dtype (MLX-LM's cast_predicate keeps A_log fp32)
        params[name] = (tuple(value.shape), dtype)
    return params, qconfig["quantization"]


def test_tensors_match_mlx_lm_quantised_model(checkpoints):
    plain, _ = checkpoints
    config = json.loads((plain / "config.json").read_text())
    expected, expected_quant = _expected_parameters(config)
    written = {}
    for f in plain.glob("model*.safetensors"):
        written.update({k: (tuple(v.shape), v.dtype) for k, v in mx.load(str(f)).items()})
    assert written == expected
    assert config["quantization"] == expected_quant  # 8-bit routers / shared-expert gates recorded


def test_loads_with_stock_mlx_lm_and_runs(checkpoints):
    for path in checkpoints:
        model, tokenizer = mlx_lm.load(str(path))  # strict: every weight present, nothing extra
        tokens = mx.array(np.random.default_rng(0).integers(0, 1024, (2, 33)))
        logits = model(tokens).astype(mx.float32)
        assert logits.shape == (2, 33, 1024)
        assert bool(mx.all(mx.isfinite(logits)))
        std = float(mx.std(logits))
        assert 0.2 < std < 5.0  # neither dead nor exploding through the layers
        assert tokenizer.encode("def f(x): return x")  # the embedded model's tokenizer


def _routing_counts(model, tokens):
    """Per layer: how many of the tokens' top-k slots each expert gets (stock routing rule)."""
    lm = model.language_model.model
    h = lm.embed_tokens(tokens)
    counts = []
    for layer in lm.layers:
        x = layer.post_attention_layernorm(h)
        gates = mx.softmax(layer.mlp.gate(x).astype(mx.float32), axis=-1)
        k = layer.mlp.top_k
        inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
        counts.append(np.bincount(np.array(inds).ravel(), minlength=layer.mlp.num_experts))
        h = layer(h, mask=None if layer.is_linear else "causal")
    return counts


def test_skew_concentrates_routing(checkpoints):
    tokens = mx.array(np.random.default_rng(1).integers(0, 1024, (1, 256)))
    shares = []
    for path in checkpoints:
        model, _ = mlx_lm.load(str(path))
        # share of all assignments taken by the 4 busiest of 32 experts (uniform: 4/32 = 12.5 %)
        per_layer = [np.sort(c)[::-1][:4].sum() / c.sum() for c in _routing_counts(model, tokens)]
        shares.append(float(np.mean(per_layer)))
    plain, skewed = shares
    assert plain < 0.3, plain
    assert skewed > 0.4 and skewed > plain + 0.15, (plain, skewed)


def test_same_seed_same_bytes_other_seed_differs(tmp_path, checkpoints):
    plain, _ = checkpoints
    again = random_weights.write_random_checkpoint(tmp_path / "again", seed=0, config_overrides=TINY, log=None)
    assert _digests(again) == _digests(plain)
    other = random_weights.write_random_checkpoint(tmp_path / "other", seed=1, config_overrides=TINY, log=None)
    assert _digests(other) != _digests(plain)


def test_sharded_output_and_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    rc = random_weights.main(
        ["--out", str(out), "--layers", "4", "--shard-gb", "0.0005", "--skew", "1"]
        + [f"--set={k}={json.dumps(v)}" for k, v in TINY.items() if k != "num_hidden_layers"]
    )
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == str(out.resolve()) and any("shard 2/" in line for line in lines)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    model, _ = mlx_lm.load(str(out))
    assert bool(mx.all(mx.isfinite(model(mx.array([[1, 2, 3]])))))


def test_full_size_plan_matches_qwen3_6_35b_a3b():
    """The default (full-size) plan: the real config and ~19.5 GB, without generating anything."""
    cfg = qwen3_6.text_config()
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_experts"], cfg["vocab_size"]) == (
        2048, 40, 256, 248320
    )
    specs = random_weights.checkpoint_specs(cfg)
    total = sum(s.nbytes for s in specs)
    assert 19.0e9 < total < 20.5e9, total
    names = {s.name for s in specs}
    assert "language_model.model.layers.39.self_attn.q_proj.weight" in names
    assert "language_model.model.layers.38.linear_attn.A_log" in names
    expert = next(s for s in specs if s.name.endswith("layers.0.mlp.switch_mlp.gate_proj.weight"))
    assert expert.shape == (256, 512, 2048 // 8)
    shards = random_weights._shard_plan(specs, random_weights.SHARD_BYTES)
    assert all(sum(s.nbytes for s in sh) <= random_weights.SHARD_BYTES for sh in shards if len(sh) > 1)


def test_consistency_tool_on_random_checkpoint_reference_backend(monkeypatch, checkpoints):
    """Skewed routing (experts with zero rows) through lily's reference path: exactly stock."""
    from lily_mlx import consistency

    monkeypatch.setenv("LILY_BACKEND", "reference")
    model, _ = mlx_lm.load(str(checkpoints[1]))
    tokens = np.random.default_rng(2).integers(0, 1024, 49)
    for mode in consistency.MODES:
        r = consistency.compare_engines(model, tokens, positions=48, mode=mode)
        assert (r.top1_agreement_pct, r.max_abs_logit_diff) == (100.0, 0.0), r
