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


# ----------------------------------------------------------------------------------------------
# bf16 accuracy rule for the DeltaNet forwards with kernels

# Stock's own bf16 error against the same module in fp32 (same bf16-valued weights and inputs),
# relative L2, 99th percentile over 1,150 random cases of the forward tests' space (qwen3_5 and
# qwen3_next, B 1-3, a 1/2/7-token prompt with no/left/right padding then two decode steps; output of
# every turn, final recurrent state): measured with ``measure_stock_bf16_errors`` (run this module:
# ``python -m tests.ops.deltanet_cases``): output 0.0219 (median 0.0056, max 0.17, over 3,450 turn
# outputs), state 0.0063 (median 0.0051, max 0.0070).
STOCK_BF16_P99 = {"output": 0.022, "state": 0.0064}
# Lily's error may be at most this multiple of it. Lily keeps fp32 where stock rounds to bf16 (beta,
# the softplus, conv output, y) but rounds in other places, and one turn's output is only B x hidden
# values, so per input either engine may be the closer one: over the same 1,150 cases lily's largest
# output error was 1.7x and its largest state error 0.7x stock's 99th percentile. A broken kernel is off
# by 0.1 or more.
BF16_ERROR_FACTOR = 3.0


def assert_as_accurate_as_stock(got: mx.array, stock: mx.array, exact: mx.array, what: str, where: str = "") -> None:
    """bf16 rule: lily's relative L2 error against the fp32 oracle ``exact`` within
    ``BF16_ERROR_FACTOR`` x stock's 99th-percentile error for ``what`` ("output" or "state")."""
    err, err_stock = rel_l2(got, exact), rel_l2(stock, exact)
    bound = BF16_ERROR_FACTOR * STOCK_BF16_P99[what]
    assert err <= bound, f"{where}: {what} error vs fp32 {err:.4g} > {bound:.4g} (stock on this input: {err_stock:.4g})"


def measure_stock_bf16_errors(cases: int = 1150, seed: int = 0):
    """Stock's bf16 error against fp32 over random cases: {"output": [...], "state": [...]}. The source of
    ``STOCK_BF16_P99`` (a few minutes on a CPU)."""
    from mlx.utils import tree_map

    rng0 = np.random.default_rng(seed)
    errors = {"output": [], "state": []}
    for _ in range(cases):
        kind = str(rng0.choice(["qwen3_5", "qwen3_next"]))
        B, S = int(rng0.integers(1, 4)), int(rng0.choice([1, 2, 7]))
        padding, case_seed = str(rng0.choice(["none", "left", "lengths"])), int(rng0.integers(0, 2**16))
        rng = np.random.default_rng(case_seed)
        left = [int(x) for x in rng.integers(0, S, size=B)] if padding == "left" else None
        lengths = [int(x) for x in rng.integers(1, S + 1, size=B)] if padding == "lengths" else None
        turns = [random_inputs(B, S, 32, mx.bfloat16, case_seed)] + [
            random_inputs(B, 1, 32, mx.bfloat16, case_seed + i) for i in (1, 2)]
        results = []
        for dtype in (mx.bfloat16, mx.float32):
            module = make_module(kind, 2, 4, 64, 64, dtype=mx.bfloat16, seed=case_seed)
            module.update(tree_map(lambda p: p.astype(dtype), module.parameters()))
            cache = make_cache(B, left_padding=left, lengths=lengths)
            outs, masks = [], []
            for i, h in enumerate(turns):
                mask = ssm_mask(h, cache)
                masks.append(mask)
                outs.append(module(h.astype(dtype), mask=mask, cache=cache))
                if i == 0 and lengths is not None:
                    cache.finalize()
            results.append((outs, cache[1]))
        (outs, state), (outs_exact, state_exact) = results
        for o, e, m in zip(outs, outs_exact, masks):
            keep = (lambda a: a) if m is None else (lambda a, m=m: mx.where(m[..., None], a, 0))
            errors["output"].append(rel_l2(keep(o), keep(e)))
        errors["state"].append(rel_l2(state, state_exact))
    return errors


if __name__ == "__main__":
    measured = measure_stock_bf16_errors()
    for name, values in measured.items():
        q = np.quantile(values, [0.5, 0.99, 1.0])
        print(f"{name}: median {q[0]:.4g}, p99 {q[1]:.4g}, max {q[2]:.4g} over {len(values)}")
