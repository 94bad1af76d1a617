"""LoRA / DoRA adapters (MLX-LM's tuner layers) and lily-mlx: its kernels read a layer's base weights (the fused
projections, the MoE expert GEMMs, the router), so an adapter would be left out. A model with adapters is never
patched (an error naming the fix, ``mlx_lm.fuse``; ``strict=False``: a warning and a stock model), and adapters set
into a patched model are refused before anything changes. Adapters are made by MLX-LM's own ``linear_to_lora_layers``
and loaded by its own ``load_adapters`` (``--adapter-path``)."""

from __future__ import annotations

import json
import subprocess
import warnings

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.lora import LoRALinear, LoRASwitchLinear
from mlx_lm.tuner.utils import linear_to_lora_layers

import lily_mlx
from lily_mlx.patch import adapter_modules, is_patched

from .conftest import PROMPT, generated_text, mlx_lm_command, subprocess_env

LORA = {"rank": 4, "scale": 20.0, "dropout": 0.0}
ADAPTED_LAYERS = 2


@pytest.fixture(scope="module")
def adapter_path(model_path, tmp_path_factory):
    """An adapter folder as ``mlx_lm.lora`` writes it, for the last two layers, with non-zero ``lora_b`` (a fresh
    adapter is the identity)."""
    model, _ = mlx_lm.load(str(model_path))
    model.freeze()
    linear_to_lora_layers(model, ADAPTED_LAYERS, LORA)
    key = mx.random.key(7)
    for _, m in model.named_modules():
        if "lora_b" in m:
            key, sub = mx.random.split(key)
            m.lora_b = 0.05 * mx.random.normal(m.lora_b.shape, key=sub)
    folder = tmp_path_factory.mktemp("adapters")
    mx.save_safetensors(str(folder / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": ADAPTED_LAYERS, "lora_parameters": LORA}))
    return folder


def _logits(model, tokenizer):
    out = model(mx.array(tokenizer.encode(PROMPT))[None])
    mx.eval(out)
    return out


def test_load_with_adapters_is_an_error_naming_the_fix(model_path, adapter_path):
    with pytest.raises(ValueError, match=r"LoRA / DoRA adapters on \d+ module\(s\).*mlx_lm\.fuse"):
        lily_mlx.load(str(model_path), adapter_path=str(adapter_path))


def test_load_with_adapters_not_strict_is_stock_with_its_adapters(model_path, adapter_path, monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "sim")  # where the kernels would run (and leave the adapters out)
    stock, tokenizer = mlx_lm.load(str(model_path), adapter_path=str(adapter_path))
    base, _ = mlx_lm.load(str(model_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = lily_mlx.load(str(model_path), adapter_path=str(adapter_path), strict=False)
    assert any("LoRA / DoRA adapters" in str(w.message) and "unpatched" in str(w.message) for w in caught)
    assert not is_patched(model) and adapter_modules(model)
    want = _logits(stock, tokenizer)
    assert not mx.array_equal(want, _logits(base, tokenizer))  # the adapters change the model
    assert mx.array_equal(_logits(model, tokenizer), want)


def test_adapters_set_into_a_patched_model_are_refused_before_any_change(model_path, monkeypatch):
    """MLX-LM adds adapters with ``update_modules`` on each decoder layer (``linear_to_lora_layers``, also under
    ``load_adapters``), or a caller assigns one; either is refused while the model is patched, and nothing changed."""
    monkeypatch.setenv("LILY_BACKEND", "sim")
    model, tokenizer = mlx_lm.load(str(model_path))
    lily_mlx.patch(model)
    before = _logits(model, tokenizer)
    with pytest.raises(ValueError, match="adapters set into a model patched by lily-mlx.*unpatch"):
        linear_to_lora_layers(model, ADAPTED_LAYERS, LORA)
    attention = next(layer.self_attn for layer in model.layers if hasattr(layer, "self_attn"))
    with pytest.raises(ValueError, match="adapters set into a model patched by lily-mlx"):
        attention.q_proj = LoRALinear.from_base(attention.q_proj, r=4)
    # Into a module that runs stock's code (the MoE block's SwitchGLU), and the whole tree's update_modules from the
    # outer model: refused too, before anything changes.
    switch_mlp = next(layer.mlp.switch_mlp for layer in model.layers)
    with pytest.raises(ValueError, match="adapters set into a model patched by lily-mlx"):
        switch_mlp.gate_proj = LoRASwitchLinear.from_base(switch_mlp.gate_proj, r=4)
    tree = {"layers": [{"mlp": {"shared_expert": {"gate_proj": LoRALinear.from_base(layer.mlp.shared_expert.gate_proj,
                                                                                    r=4)}}}
                       for layer in model.layers]}
    with pytest.raises(ValueError, match="adapters set into a model patched by lily-mlx"):
        model.language_model.model.update_modules(tree)
    assert adapter_modules(model) == [] and is_patched(model)
    assert mx.array_equal(_logits(model, tokenizer), before)

    lily_mlx.unpatch(model)  # the way to adapters: unpatch first
    linear_to_lora_layers(model, ADAPTED_LAYERS, LORA)
    assert len(adapter_modules(model)) > 0
    with pytest.raises(ValueError, match="LoRA / DoRA adapters on"):
        lily_mlx.patch(model)
    assert not is_patched(model)


def test_mlx_lm_generate_lily_with_adapter_path_is_a_clear_error(installed_hook, model_path, adapter_path, tmp_path):
    args = ["--model", str(model_path), "--adapter-path", str(adapter_path), "--prompt", PROMPT,
            "--max-tokens", "8", "--ignore-chat-template"]
    stock = subprocess.run(mlx_lm_command("generate") + args, capture_output=True, text=True, cwd=tmp_path,
                           env=subprocess_env(), timeout=300)
    assert stock.returncode == 0, stock.stderr[-2000:]
    generated_text(stock.stdout)  # stock MLX-LM runs the adapters as before
    lily = subprocess.run(mlx_lm_command("generate") + args + ["--lily"], capture_output=True, text=True,
                          cwd=tmp_path, env=subprocess_env(), timeout=300)
    assert lily.returncode != 0
    last = lily.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --lily: LoRA / DoRA adapters on") and "mlx_lm.fuse" in last, lily.stderr[-2000:]
