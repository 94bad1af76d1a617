"""Small random 4-bit Qwen3.5/3.6/Next checkpoints in MLX-LM's format, built in seconds.

The integration tests run on the embedded model when it is present; these random checkpoints cover
what it does not: the other supported architectures (``qwen3_5`` dense, ``qwen3_next``) and tensor
sharding over 2 ranks (every sharded quantised projection keeps whole 64-wide groups per rank, so MLP
widths are 128). Weights come from MLX's default initialisers under a fixed seed, are cast to bf16 and
quantised with MLX-LM's own ``quantize_model`` (4-bit g64, routers and shared-expert gates 8-bit, the
model's ``quant_predicate``); the tokenizer is a byte-level BPE trained offline on stdlib docstrings.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 512
EOS = "<|im_end|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", EOS]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Shared by all three architectures: 4 layers (3 DeltaNet + 1 gated attention), GQA 8:1,
# DeltaNet with twice as many value heads as key heads, partial RoPE 0.25.
_COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
}
_MOE = {
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
}
_ROPE = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
         "mrope_section": [2, 1, 1], "mrope_interleaved": True}


def config_for(model_type: str) -> dict:
    """config.json (unquantised) for a tiny model of ``model_type``."""
    if model_type == "qwen3_5_moe":
        return {"model_type": model_type, **_COMMON, **_MOE, "intermediate_size": 128,
                "rope_parameters": dict(_ROPE)}
    if model_type == "qwen3_5":
        return {"model_type": model_type, **_COMMON, "intermediate_size": 128,
                "rope_parameters": dict(_ROPE)}
    if model_type == "qwen3_next":
        return {"model_type": model_type, **_COMMON, **_MOE, "intermediate_size": 128,
                "mlp_only_layers": [], "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
    raise ValueError(model_type)


def _corpus() -> list:
    import argparse
    import collections
    import json as json_mod
    import pathlib
    import textwrap

    docs = []
    for mod in (argparse, collections, json_mod, pathlib, textwrap):
        docs.append(mod.__doc__ or "")
        for name in sorted(dir(mod)):
            doc = getattr(getattr(mod, name), "__doc__", None)
            if isinstance(doc, str):
                docs.append(doc)
    return docs


def _write_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB_SIZE
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": SPECIALS[0],
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.token_to_id(EOS)


def build_random_model(out_dir, model_type: str = "qwen3_5_moe", seed: int = 0) -> Path:
    """Write a random 4-bit tiny ``model_type`` checkpoint into ``out_dir``; returns the folder."""
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    from lily_mlx.models.qwen3_6 import random_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = config_for(model_type)
    config["eos_token_id"] = _write_tokenizer(out)
    model, config = random_model(config, seed)
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")
    return out
