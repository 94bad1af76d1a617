"""Qwen3.6 configurations in the layout of ``mlx-community/Qwen3.6-35B-A3B-4bit``'s config.json.

The checkpoint's config has ``model_type: qwen3_5_moe`` at the top and the language model's fields
nested under ``text_config`` (MLX-LM's ``qwen3_5_moe`` reads it that way). Quantisation is 4-bit
affine with group 64 everywhere, except the MoE routers (``mlp.gate``) and the shared-expert gates
(``mlp.shared_expert_gate``), which are 8-bit: that is what MLX-LM's ``quant_predicate`` for this
model produces, recorded per module in ``quantization``.
"""

from __future__ import annotations

import copy

QWEN3_6_MODEL_TYPE = "qwen3_5_moe"
QWEN3_6_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"

GROUP_SIZE = 64
BITS = 4
GATE_BITS = 8  # routers and shared-expert gates

# Qwen/Qwen3.6-35B-A3B's text_config (language model only; the vision tower is not used by MLX-LM).
QWEN3_6_35B_A3B_TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text",
    "attention_bias": False,
    "attn_output_gate": True,
    "dtype": "bfloat16",
    "eos_token_id": 248044,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 512,
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 16,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 248320,
}

# The embedded tiny model: every ratio of the real one that the kernels care about (8 query heads per
# KV head, twice as many DeltaNet value heads as key heads, 3 DeltaNet layers per attention layer,
# partial RoPE 0.25, top-k of many experts plus a gated shared expert); all widths multiples of 64 so
# 4-bit group-64 quantisation applies to every projection, DeltaNet key dim a multiple of 32.
TINY_TEXT_OVERRIDES = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "mtp_num_hidden_layers": 0,
    # rotary dims = 64 * 0.25 = 16 -> 8 frequencies, split over (t, h, w) like [11, 11, 10] of 32
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [3, 3, 2],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
}


def layer_types(num_layers: int, interval: int) -> list[str]:
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def text_config(overrides: dict | None = None) -> dict:
    """The real text_config with ``overrides`` applied (``layer_types`` follows the layer count)."""
    cfg = copy.deepcopy(QWEN3_6_35B_A3B_TEXT_CONFIG)
    for key, value in (overrides or {}).items():
        if key == "rope_parameters":
            cfg["rope_parameters"] = {**cfg["rope_parameters"], **value}
        else:
            cfg[key] = copy.deepcopy(value)
    cfg["layer_types"] = layer_types(cfg["num_hidden_layers"], cfg["full_attention_interval"])
    cfg["partial_rotary_factor"] = cfg["rope_parameters"]["partial_rotary_factor"]
    return cfg


def quantization_config(text_cfg: dict) -> dict:
    """MLX-LM's ``quantization`` entry for a quantised checkpoint of ``text_cfg``."""
    q = {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"}
    if text_cfg["num_experts"] > 0:
        for i in range(text_cfg["num_hidden_layers"]):
            for name in ("mlp.gate", "mlp.shared_expert_gate"):
                q[f"language_model.model.layers.{i}.{name}"] = {
                    "group_size": GROUP_SIZE,
                    "bits": GATE_BITS,
                }
    return q


def model_config(text_cfg: dict, *, eos_token_id: int | None = None) -> dict:
    """A top-level config.json (unquantised) around ``text_cfg``."""
    cfg = {
        "architectures": [QWEN3_6_ARCHITECTURE],
        "model_type": QWEN3_6_MODEL_TYPE,
        "text_config": copy.deepcopy(text_cfg),
        "tie_word_embeddings": False,
    }
    if eos_token_id is not None:
        cfg["eos_token_id"] = eos_token_id
        cfg["text_config"]["eos_token_id"] = eos_token_id
    return cfg


def is_linear_layer(text_cfg: dict, layer: int) -> bool:
    """True for a Gated DeltaNet layer, False for a full-attention layer (MLX-LM's rule)."""
    return (layer + 1) % text_cfg["full_attention_interval"] != 0


def quantise_like_checkpoint(model, config: dict):
    """bf16 (A_log stays fp32, MLX-LM's cast_predicate), then MLX-LM's quantize_model: 4-bit g64
    everywhere, 8-bit routers and shared-expert gates (the model's quant_predicate). Lazy: nothing is
    evaluated, so a caller can evaluate layer by layer. Returns (model, config with quantization)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.utils import quantize_model

    cast = getattr(model, "cast_predicate", lambda path: True)

    def to_bf16(path, value):
        if cast(path) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(mx.bfloat16)
        return value

    model.update(tree_map_with_path(to_bf16, model.parameters()))
    return quantize_model(model, config, group_size=GROUP_SIZE, bits=BITS, mode="affine",
                          quant_predicate=getattr(model, "quant_predicate", None))


def random_model(config: dict, seed: int = 0):
    """The one random-weight builder: MLX-LM's model for ``config`` (any supported architecture),
    MLX's default initialisers under ``seed``, quantised like the checkpoint. Lazy (nothing evaluated).
    Returns (model, config with quantization). Used by the benchmarks (full size, in process), the
    test checkpoints of each architecture and, after training, the embedded model."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    return quantise_like_checkpoint(model, config)
