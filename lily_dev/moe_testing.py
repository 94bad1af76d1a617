"""Builders of stock MoE blocks and routings for the MoE tests and microbenchmarks."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def make_sparse_moe_block(
    hidden: int = 128,
    expert_width: int = 64,
    num_experts: int = 16,
    top_k: int = 4,
    shared_width: int = 64,
    norm_topk_prob: bool = True,
    quantized: bool = True,
    bits: int = 4,
    group_size: int = 64,
    dtype=mx.bfloat16,
    seed: int = 0,
    skew: float = 0.0,
    hot_expert: int = 0,
):
    """A stock ``Qwen3NextSparseMoeBlock`` with random weights, quantised like the Qwen3.6 checkpoint
    (experts and shared expert ``bits``-bit affine, router and shared-expert gate 8-bit).

    ``skew`` > 0 adds a bias towards ``hot_expert`` to the router (for inputs with a positive mean),
    to make skewed routings; at large values every token picks it.
    """
    from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

    args = SimpleNamespace(
        hidden_size=hidden,
        moe_intermediate_size=expert_width,
        shared_expert_intermediate_size=shared_width,
        norm_topk_prob=norm_topk_prob,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
    )
    mx.random.seed(seed)
    block = Qwen3NextSparseMoeBlock(args)
    # Larger router weights than the default init, so the routing is peaked like a trained model's.
    gate_w = mx.random.normal((num_experts, hidden)) * (2.0 / np.sqrt(hidden))
    if skew:
        gate_w[hot_expert] = gate_w[hot_expert] + skew / hidden
    block.gate.weight = gate_w
    block.set_dtype(dtype)
    if quantized:
        def predicate(path, module):
            if not hasattr(module, "to_quantized"):
                return False
            if path.endswith("shared_expert_gate") or path == "gate":
                return {"group_size": 64, "bits": 8} if module.weight.shape[-1] % 64 == 0 else False
            return {"group_size": group_size, "bits": bits} if module.weight.shape[-1] % group_size == 0 else False

        nn.quantize(block, class_predicate=predicate)
    mx.eval(block.parameters())
    return block.eval()  # inference mode, as mlx_lm.load leaves a model (training runs stock's ops)


def make_inputs(batch: int, tokens: int, hidden: int, seed: int = 0, mean: float = 0.0, dtype=mx.bfloat16):
    """Activations [B, T, D] ~ N(mean, 1)."""
    key = mx.random.key(seed)
    return (mx.random.normal((batch, tokens, hidden), key=key) + mean).astype(dtype)


def make_routing(kind: str, tokens: int, top_k: int, num_experts: int, seed: int = 0) -> np.ndarray:
    """Expert indices [tokens, top_k] (int) of a given kind.

    uniform: k distinct experts per token, uniformly at random; skewed: distinct experts drawn with
    Zipf-like weights (a few hot experts, many empty ones); one: every assignment to one expert
    (duplicates within a token); empty: only a few experts used.
    """
    rng = np.random.default_rng(seed)
    if kind == "one":
        return np.full((tokens, top_k), rng.integers(num_experts), dtype=np.int64)
    if kind == "uniform":
        p = np.ones(num_experts)
    elif kind == "skewed":
        p = 1.0 / (1.0 + np.arange(num_experts)) ** 1.5
        p = p[rng.permutation(num_experts)]
    elif kind == "empty":
        used = rng.choice(num_experts, size=min(num_experts, max(top_k, 2)), replace=False)
        p = np.zeros(num_experts)
        p[used] = 1.0
    else:
        raise ValueError(f"unknown routing kind {kind!r}")
    p = p / p.sum()
    k = min(top_k, int((p > 0).sum()))
    rows = [rng.choice(num_experts, size=k, replace=False, p=p) for _ in range(tokens)]
    out = np.asarray(rows, dtype=np.int64).reshape(tokens, k)
    if k < top_k:  # fewer usable experts than k: repeat (duplicate ids are legal for the kernels)
        out = np.concatenate([out, out[:, : top_k - k]], axis=1)
    return out


def simulator_problem(need_matrix: bool = False):
    """Why the CPU simulator cannot run kernels here (None if it can). The one named precondition is a
    C++ compiler; anything else wrong with the simulator fails the tests instead of skipping them.
    ``need_matrix`` is kept for callers: ``simdgroup_matrix`` needs nothing more."""
    from lily_mlx.msl.sim import build

    try:
        build.compiler()
    except build.CompileError as e:
        return str(e)
    return None


def routing_with_counts(counts, top_k: int, seed: int = 0) -> np.ndarray:
    """Expert indices [tokens, top_k] in which expert e has exactly ``counts[e]`` assignments
    (sum(counts) must be a multiple of top_k). A token's k experts are distinct whenever every count
    is at most the number of tokens (as a router's top-k gives them); tokens and slots shuffled."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total % top_k:
        raise ValueError(f"{total} assignments are not a multiple of top_k={top_k}")
    tokens = total // top_k
    flat = np.repeat(np.arange(counts.size), counts)
    # Column-major fill: an expert's run of c <= tokens assignments lands on c different tokens.
    out = flat.reshape(top_k, tokens).T.copy()
    rng = np.random.default_rng(seed)
    out = out[rng.permutation(tokens)]
    for row in out:
        rng.shuffle(row)
    return out


@contextlib.contextmanager
def regtile_down_columns(columns):
    """Down's register tiles at these columns per threadgroup (widest first, e.g. (128, 64)), then as before
    (``REGTILE_DOWN_COLUMNS``; the column rule's cache is cleared on the way in and on the way out)."""
    from lily_mlx.ops.moe import kernels as mk

    saved = mk.REGTILE_DOWN_COLUMNS
    mk.REGTILE_DOWN_COLUMNS = columns
    mk.regtile_columns.cache_clear()
    try:
        yield
    finally:
        mk.REGTILE_DOWN_COLUMNS = saved
        mk.regtile_columns.cache_clear()
