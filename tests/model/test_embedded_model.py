"""The shipped embedded model: loads with stock MLX-LM, exact Qwen3.6 layout, quantised like the real
checkpoint, peaked on held-out text; and a few-step smoke of the build pipeline (determinism)."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from lily_mlx.models import embedded, qwen3_6  # noqa: E402

pytestmark = pytest.mark.skipif(
    not embedded._is_complete(embedded.EMBEDDED_DIR), reason="embedded model not shipped in this tree"
)


@pytest.fixture(scope="module")
def loaded():
    model, tokenizer, config = mlx_lm.load(str(embedded.EMBEDDED_DIR), return_config=True)
    return model, tokenizer, config


def model_vocab(loaded):
    return loaded[0].language_model.args.vocab_size


def test_config_layout_is_mlx_community_qwen3_6(loaded):
    raw = json.loads((embedded.EMBEDDED_DIR / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe"
    tc = raw["text_config"]
    # Every key of the real Qwen3.6-35B-A3B text_config is there.
    assert set(qwen3_6.QWEN3_6_35B_A3B_TEXT_CONFIG) <= set(tc)
    assert tc["layer_types"] == qwen3_6.layer_types(tc["num_hidden_layers"], 4)
    assert raw["tie_word_embeddings"] is False and tc["tie_word_embeddings"] is False
    q = raw["quantization"]
    assert (q["group_size"], q["bits"], q["mode"]) == (64, 4, "affine")
    assert raw["quantization_config"] == q


def test_architecture_ratios(loaded):
    model, _, _ = loaded
    args = model.language_model.args
    kinds = [layer.is_linear for layer in model.layers]
    assert kinds == [True, True, True, False] * (len(kinds) // 4) and len(kinds) >= 4
    assert args.num_attention_heads // args.num_key_value_heads == 8
    assert args.num_key_value_heads >= 2
    assert args.linear_num_value_heads > args.linear_num_key_heads
    assert args.linear_key_head_dim % 32 == 0
    assert args.num_experts >= 16 and args.num_experts_per_tok >= 4
    assert args.shared_expert_intermediate_size > 0
    assert args.partial_rotary_factor == 0.25
    attn = next(layer.self_attn for layer in model.layers if not layer.is_linear)
    assert attn.rope.dims == int(args.head_dim * 0.25)
    for layer in model.layers:
        assert hasattr(layer.mlp, "shared_expert") and hasattr(layer.mlp, "shared_expert_gate")
        assert layer.mlp.switch_mlp.gate_proj.weight.shape[0] == args.num_experts


def test_quantisation_per_module(loaded):
    """4-bit g64 affine everywhere, 8-bit routers and shared-expert gates, bf16 scales/biases."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    import mlx.nn as nn

    model, _, _ = loaded
    quantized = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    seen = 0
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and not isinstance(module, quantized):
            pytest.fail(f"{name} is not quantised")
        if not isinstance(module, quantized):
            continue
        seen += 1
        gate = name.endswith("mlp.gate") or name.endswith("shared_expert_gate")
        assert module.bits == (8 if gate else 4), name
        assert module.group_size == 64 and module.mode == "affine", name
        assert module.scales.dtype == mx.bfloat16 and module.biases.dtype == mx.bfloat16, name
        assert module.weight.dtype == mx.uint32, name
    assert seen > 40
    for layer in model.layers:
        if layer.is_linear:
            assert layer.linear_attn.A_log.dtype == mx.float32  # MLX-LM's cast_predicate
            assert layer.linear_attn.conv1d.weight.dtype == mx.bfloat16


def test_tokenizer_and_chat_template(loaded):
    _, tokenizer, config = loaded
    text = "Return a new list containing all items from the iterable."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    # Generation stops at the end of a chat turn and at the end of a document, as in Qwen's checkpoints:
    # generation_config.json's eos ids, which MLX-LM's load takes over config.json's.
    eos = {tokenizer.vocab["<|im_end|>"], tokenizer.vocab["<|endoftext|>"]}
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_ids == eos
    assert config["eos_token_id"] == [tokenizer.vocab["<|im_end|>"], tokenizer.vocab["<|endoftext|>"]]
    raw = json.loads((embedded.EMBEDDED_DIR / "config.json").read_text())
    assert raw["eos_token_id"] == raw["text_config"]["eos_token_id"] == tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert len(tokenizer.vocab) == model_vocab(loaded)


def test_peaked_on_heldout_text(loaded):
    """Held-out docstrings (never trained on): perplexity far below the uniform baseline (= vocab),
    and greedy choices far from ties. One 256-token forward (MLX's CPU quantised matmul is slow)."""
    model, tokenizer, _ = loaded
    text = (embedded.EMBEDDED_DIR / embedded.HELDOUT_FILE).read_text()
    tokens = mx.array(tokenizer.encode(text)[:257])[None]
    logits = model(tokens[:, :-1])[0].astype(mx.float32)  # [256, V]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logprobs, tokens[0, 1:, None], axis=-1)
    ppl = math.exp(mx.mean(nll).item())
    vocab = model_vocab(loaded)
    assert ppl < vocab / 8, f"held-out perplexity {ppl:.1f} vs uniform {vocab}"
    top1 = np.array(mx.exp(mx.max(logprobs, axis=-1)))
    assert np.median(top1) > 20.0 / vocab


def test_cli_prints_folder_last(capsys):
    assert embedded.main([]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == str(embedded.EMBEDDED_DIR.resolve())
    assert embedded.embedded_model_path() == embedded.EMBEDDED_DIR


SMOKE = dict(
    settings=embedded.TrainSettings(steps=2, batch_size=2, seq_len=16, warmup_steps=1),
    max_corpus_chars=150_000,
    heldout_eval_tokens=32,
    log=None,
)


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.slow
def test_build_pipeline_smoke_and_determinism(tmp_path):
    """The full pipeline with 2 training steps: same seed -> identical bytes; loads with stock MLX-LM;
    quantisation config as the shipped model's; a different seed gives different weights."""
    a = embedded.build_embedded_model(tmp_path / "a", seed=0, **SMOKE)
    b = embedded.build_embedded_model(tmp_path / "b", seed=0, **SMOKE)
    assert _digest(a) == _digest(b)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    c = embedded.build_embedded_model(tmp_path / "c", seed=1, **SMOKE)
    assert _digest(a) != _digest(c)

    model, _ = mlx_lm.load(str(a))
    out = model(mx.array([[1, 5, 9, 200]]))
    assert out.shape == (1, 4, 1024) and bool(mx.all(mx.isfinite(out)))
    built = json.loads((a / "config.json").read_text())
    shipped = json.loads((embedded.EMBEDDED_DIR / "config.json").read_text())
    assert built["quantization"] == shipped["quantization"]
    generation = embedded.GENERATION_CONFIG_FILE  # the shipped file is the builder's
    assert (a / generation).read_bytes() == (embedded.EMBEDDED_DIR / generation).read_bytes()
    info = json.loads((a / embedded.BUILD_INFO_FILE).read_text())
    assert info["train_settings"]["steps"] == 2 and math.isfinite(info["heldout_perplexity"])
