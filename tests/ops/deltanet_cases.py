"""Shared builders for the Gated DeltaNet tests: stock modules with random weights, random inputs,
caches and masks as MLX-LM's batched generator passes them."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.base import create_ssm_mask
from mlx_lm.models.cache import ArraysCache


def _randomise(module, seed: int, dtype):
    """Random weights (norm weight, dt_bias, A_log included) so no parameter is a trivial 1."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, p in tree_flatten(module.parameters()):
        if name.endswith("A_log"):
            x = np.log(rng.uniform(0.5, 16.0, p.shape))
        elif name.endswith("dt_bias"):
            x = rng.uniform(-1.0, 2.0, p.shape)
        elif name.endswith("norm.weight"):
            x = rng.uniform(0.5, 1.5, p.shape)
        else:
            fan_in = p.shape[-1] if p.ndim > 1 else 1
            x = rng.standard_normal(p.shape) / np.sqrt(fan_in)
        params[name] = mx.array(x.astype(np.float32)).astype(dtype)
    module.update(tree_unflatten(list(params.items())))
    module.eval()
    return module


def make_module(kind: str, Hk: int, Hv: int, Dk: int, Dv: int, hidden: int = 32, conv: int = 4,
                dtype=mx.float32, seed: int = 0):
    """A stock qwen3_5 ``GatedDeltaNet`` or qwen3_next ``Qwen3NextGatedDeltaNet``."""
    common = dict(
        hidden_size=hidden, linear_num_value_heads=Hv, linear_num_key_heads=Hk, linear_key_head_dim=Dk,
        linear_value_head_dim=Dv, linear_conv_kernel_dim=conv, rms_norm_eps=1e-6,
    )
    if kind == "qwen3_5":
        module = qwen3_5.GatedDeltaNet(qwen3_5.TextModelArgs(model_type="qwen3_5", num_attention_heads=2, **common))
    else:
        module = qwen3_next.Qwen3NextGatedDeltaNet(SimpleNamespace(**common))
    return _randomise(module, seed, dtype)


def random_inputs(B: int, S: int, hidden: int, dtype, seed: int) -> mx.array:
    rng = np.random.default_rng(seed + 1000)
    return mx.array(rng.standard_normal((B, S, hidden)).astype(np.float32)).astype(dtype)


def make_cache(B: int, left_padding=None, lengths=None, prefilled: ArraysCache | None = None) -> ArraysCache:
    """An ``ArraysCache(2)`` as the model makes it; ``left_padding``/``lengths`` as the batched
    generator sets them (``ArraysCache(2, left_padding)`` then ``prepare(lengths=...)``)."""
    cache = ArraysCache(2, left_padding=left_padding)
    if prefilled is not None:
        cache.cache = list(prefilled.cache)
    if lengths is not None:
        cache.prepare(lengths=lengths)
    return cache


def ssm_mask(h: mx.array, cache) -> mx.array | None:
    """The mask the stock model passes its DeltaNet layers."""
    return create_ssm_mask(h, cache)


def rand_array(rng, shape, dtype, scale: float = 1.0) -> mx.array:
    """scale * N(0, 1) drawn in fp32 from a numpy Generator, cast to ``dtype``."""
    return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)


def rel_l2(x: mx.array, y: mx.array) -> float:
    x = np.array(x.astype(mx.float32), dtype=np.float64)
    y = np.array(y.astype(mx.float32), dtype=np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def same(x: mx.array, y: mx.array) -> bool:
    """Bitwise equality (NaN-safe)."""
    return x.shape == y.shape and x.dtype == y.dtype and bool(
        mx.all(mx.logical_or(x == y, mx.logical_and(mx.isnan(x), mx.isnan(y)))).item()
    )
