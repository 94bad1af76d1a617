"""Plain-MLX references of the MoE op family (Qwen3-Next / Qwen3.5 / Qwen3.6 sparse MoE block).

Every function here is the oracle its kernel is tested against, and the path lily-mlx runs when no
kernel applies. The forward pieces use exactly the MLX primitives stock MLX-LM uses, in the same
order (``Qwen3NextSparseMoeBlock.__call__`` and ``SwitchGLU``), so the reference path is bit-identical
to stock.

Routing bookkeeping convention (shared with the kernels): assignments are the flattened top-k
indices, assignment ``a = token * k + j``. Expert-contiguous order ("slots") is the *stable* order by
expert: slot ``offsets[e] + r`` holds the r-th assignment (in assignment order) routed to expert e.
"""

from __future__ import annotations

from typing import Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# ----------------------------------------------------------------------------------------------
# Router


def router_reference(gates: mx.array, top_k: int, norm_topk_prob: bool) -> Tuple[mx.array, mx.array]:
    """Router logits -> (expert indices, routing weights), as stock computes them.

    gates: [..., E] router logits. Returns inds [..., k] uint32 and scores [..., k] (gates' dtype).
    """
    gates = mx.softmax(gates, axis=-1, precise=True)
    inds = mx.argpartition(gates, kth=-top_k, axis=-1)[..., -top_k:]
    inds = mx.stop_gradient(inds)
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


# ----------------------------------------------------------------------------------------------
# Routing bookkeeping (integer, exact)


def routing_histogram_reference(inds: mx.array, num_experts: int) -> mx.array:
    """Rows per expert. inds: any shape of expert ids -> counts [E] int32."""
    flat = inds.reshape(-1).astype(mx.int32)
    onehot = flat[:, None] == mx.arange(num_experts, dtype=mx.int32)[None, :]  # [A, E]
    return onehot.astype(mx.int32).sum(axis=0).astype(mx.int32)


def routing_offsets_reference(counts: mx.array) -> mx.array:
    """Exclusive prefix scan of counts [E] -> offsets [E + 1] int32 (offsets[E] = total rows)."""
    zero = mx.zeros((1,), dtype=mx.int32)
    return mx.concatenate([zero, mx.cumsum(counts.astype(mx.int32))]).astype(mx.int32)


def routing_scatter_reference(inds: mx.array) -> Tuple[mx.array, mx.array]:
    """Expert-contiguous order of the assignments and its inverse.

    Returns sorted_rows [A] int32 (slot -> assignment index) and slot_of_row [A] int32
    (assignment -> slot). Stable: within an expert, assignments keep their order.
    """
    flat = inds.reshape(-1).astype(mx.int32)
    a = flat.size
    # A stable sort key: expert * A + assignment index (unique, so any sort is stable).
    key = flat.astype(mx.int64) * a + mx.arange(a, dtype=mx.int64)
    sorted_rows = mx.argsort(key).astype(mx.int32)
    slot_of_row = mx.argsort(sorted_rows).astype(mx.int32)
    return sorted_rows, slot_of_row


def tile_rows_for_count(count: int, adaptive: bool, small_rows: int = 16, large_rows: int = 32) -> int:
    """The tile rule: experts with at least ``large_rows`` rows use ``large_rows``-row tiles."""
    return large_rows if (adaptive and count >= large_rows) else small_rows


def routing_block_map_reference(counts, tile_rows: int, experts=None) -> np.ndarray:
    """Blocks of at most ``tile_rows`` rows covering each expert's slots, in expert order.

    counts: [E] (array-like). ``experts``: optional boolean mask of the experts this map covers.
    Returns int32 [n_blocks, 3] rows of (expert, first slot, rows). Host-side (its length is
    data-dependent); the GPU kernel writes the same rows into a padded map.
    """
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    out = []
    for e, c in enumerate(counts):
        if experts is not None and not experts[e]:
            continue
        for start in range(0, int(c), tile_rows):
            out.append((e, offsets[e] + start, min(tile_rows, int(c) - start)))
    return np.asarray(out, dtype=np.int32).reshape(-1, 3)


# ----------------------------------------------------------------------------------------------
# Expert GEMMs


def is_quantized_switch_linear(layer) -> bool:
    return hasattr(layer, "scales") and hasattr(layer, "bits")


def expert_linear_reference(layer, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
    """One expert projection of SwitchGLU (``QuantizedSwitchLinear`` / ``SwitchLinear``), as stock.

    Quantized: ``mx.gather_qmm`` (the grouped 4-bit GEMM of prefill, the gather GEMV of decode).
    """
    if is_quantized_switch_linear(layer):
        y = mx.gather_qmm(
            x,
            layer["weight"],
            layer["scales"],
            layer.get("biases"),
            rhs_indices=indices,
            transpose=True,
            group_size=layer.group_size,
            bits=layer.bits,
            mode=layer.mode,
            global_scale=getattr(layer, "global_scale", None),
            sorted_indices=sorted_indices,
        )
    else:
        y = mx.gather_mm(x, layer["weight"].swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
    if "bias" in layer:
        y = y + mx.expand_dims(layer["bias"][indices], -2)
    return y


def gather_sort_reference(x: mx.array, indices: mx.array):
    """Stock's row sort by expert: x [..., 1, 1, D], indices [..., k]."""
    *_, m = indices.shape
    indices = indices.flatten()
    order = mx.argsort(indices)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // m], indices[order], inv_order


def scatter_unsort_reference(x: mx.array, inv_order: mx.array, shape=None) -> mx.array:
    x = x[inv_order]
    if shape is not None:
        x = mx.unflatten(x, 0, shape)
    return x


def switch_glu_reference(switch_mlp, x: mx.array, indices: mx.array) -> mx.array:
    """``SwitchGLU.__call__``: x [..., D], indices [..., k] -> [..., k, D]."""
    x = mx.expand_dims(x, (-2, -3))
    indices = mx.stop_gradient(indices)
    do_sort = indices.size >= 64
    idx = indices
    inv_order = None
    if do_sort:
        x, idx, inv_order = gather_sort_reference(x, indices)
    x_up = expert_linear_reference(switch_mlp.up_proj, x, idx, sorted_indices=do_sort)
    x_gate = expert_linear_reference(switch_mlp.gate_proj, x, idx, sorted_indices=do_sort)
    x = expert_linear_reference(switch_mlp.down_proj, switch_mlp.activation(x_up, x_gate), idx, sorted_indices=do_sort)
    if do_sort:
        x = scatter_unsort_reference(x, inv_order, indices.shape)
    return x.squeeze(-2)


def combine_reference(y: mx.array, scores: mx.array) -> mx.array:
    """Weighted sum over the k experts of each token: y [..., k, D], scores [..., k] -> [..., D]."""
    return (y * scores[..., None]).sum(axis=-2)


def shared_expert_reference(block, x: mx.array) -> mx.array:
    """Sigmoid-gated shared expert of the block."""
    shared_y = block.shared_expert(x)
    return mx.sigmoid(block.shared_expert_gate(x)) * shared_y


# ----------------------------------------------------------------------------------------------
# Decode (expert GEMV) pieces: gate+up+SwiGLU, and down + routing weights + shared expert.
# Stock decode runs SwitchGLU unsorted (indices.size < 64, mx.gather_qmm -> gather GEMV).


def expert_up_reference(switch_mlp, x: mx.array, indices: mx.array) -> mx.array:
    """Gate and up projections with SwiGLU for unsorted (decode) rows: x [..., D] -> [..., k, 1, I]."""
    x = mx.expand_dims(x, (-2, -3))
    x_up = expert_linear_reference(switch_mlp.up_proj, x, indices)
    x_gate = expert_linear_reference(switch_mlp.gate_proj, x, indices)
    return switch_mlp.activation(x_up, x_gate)


def expert_down_reference(switch_mlp, h: mx.array, indices: mx.array, scores: mx.array, shared_y: mx.array) -> mx.array:
    """Down projection, routing-weighted sum and the (already gated) shared expert: -> [..., D]."""
    y = expert_linear_reference(switch_mlp.down_proj, h, indices).squeeze(-2)
    return combine_reference(y, scores) + shared_y


# ----------------------------------------------------------------------------------------------
# Dequantisation (the fused_dequant=off ablation and the GEMM tests)


def dequantize_experts_reference(layer, dtype=mx.bfloat16) -> mx.array:
    """All experts' weights [E, O, K] in ``dtype`` (w = scale * q + bias)."""
    w = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    return w.astype(dtype)


def swiglu_reference(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up
