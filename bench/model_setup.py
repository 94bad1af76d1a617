"""Models for the benchmark: a real checkpoint, or Qwen3.6-35B-A3B's architecture with random 4-bit
weights built in process (no checkpoint on disk, seconds on a GPU).

The in-process model is MLX-LM's own ``qwen3_5_moe.Model`` from the real config, initialised by MLX's
default initialisers under a seed, cast to bf16 (A_log stays fp32, as MLX-LM's ``cast_predicate``) and
quantised by MLX-LM's ``quantize_model`` with the model's ``quant_predicate`` (4-bit group 64; routers and
shared-expert gates 8-bit): the layout of ``mlx-community/Qwen3.6-35B-A3B-4bit``. Layers are
evaluated one at a time so the fp32 initial weights never exist all at once.
"""

from __future__ import annotations

import copy
import time
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from lily_mlx.models.qwen3_6 import (BITS, GROUP_SIZE, QWEN3_6_35B_A3B_TEXT_CONFIG, QWEN3_6_MODEL_TYPE,
                                     TINY_TEXT_OVERRIDES)

SIZES = ("full", "tiny")


def model_config(size: str = "full", num_layers: Optional[int] = None) -> dict:
    """Top-level config (``text_config`` nested) of Qwen3.6-35B-A3B or its tiny sibling."""
    text = copy.deepcopy(QWEN3_6_35B_A3B_TEXT_CONFIG)
    if size == "tiny":
        text.update(copy.deepcopy(TINY_TEXT_OVERRIDES))
    elif size != "full":
        raise ValueError(f"size must be one of {SIZES}")
    if num_layers:
        text["num_hidden_layers"] = int(num_layers)
    text["mtp_num_hidden_layers"] = 0
    return {"model_type": QWEN3_6_MODEL_TYPE, "text_config": text,
            "quantization": {"group_size": GROUP_SIZE, "bits": BITS}}


def build_random_model(config: dict, seed: int = 0, log=print) -> nn.Module:
    """MLX-LM's model for ``config`` with random weights, quantised like the 4-bit checkpoint
    (``lily_mlx.models.qwen3_6.random_model``), evaluated one layer at a time."""
    from lily_mlx.models.qwen3_6 import random_model

    t0 = time.perf_counter()
    model, _ = random_model(config, seed)
    # Evaluate piece by piece: the fp32/bf16 initial weights of one layer at a time.
    lm = model.language_model
    mx.eval(lm.model.embed_tokens.parameters())
    for i, layer in enumerate(lm.model.layers):
        mx.eval(layer.parameters())
        if log and (i % 10 == 9 or i == len(lm.model.layers) - 1):
            log(f"[model] built layer {i + 1}/{len(lm.model.layers)} ({time.perf_counter() - t0:.1f} s)")
    mx.eval(model.parameters())
    model.eval()  # inference mode, as mlx_lm.load leaves a model (lily's ops run kernels only then)
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if log:
        log(f"[model] random {config['text_config']['num_hidden_layers']}-layer model: {nbytes / 1e9:.2f} GB "
            f"of weights in {time.perf_counter() - t0:.1f} s")
    return model


def load_model(path: Optional[str], size: str = "full", seed: int = 0, num_layers: Optional[int] = None,
               log=print) -> Tuple[nn.Module, str]:
    """(model, description): a checkpoint at ``path`` through MLX-LM's loader, else a random model."""
    if path:
        from mlx_lm import load

        model, _ = load(path)
        return model, f"checkpoint {path}"
    config = model_config(size, num_layers)
    model = build_random_model(config, seed=seed, log=log)
    layers = config["text_config"]["num_hidden_layers"]
    return model, f"Qwen3.6-35B-A3B architecture ({size}, {layers} layers), random 4-bit weights, seed {seed}"
