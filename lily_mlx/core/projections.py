"""Input projections of a decode step as one quantised matmul (switches ``fused_in_proj``,
``fused_qkv_proj``).

A Qwen3.5/3.6 DeltaNet layer projects its input four times (``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``; Qwen3-Next: ``in_proj_qkvz``, ``in_proj_ba``) and an attention layer three
times (``q_proj``, ``k_proj``, ``v_proj``), each an MLX quantised matmul over the same input. In a decode
step each of them is one primitive to build and evaluate and one short kernel (the b and a projections
have 32 output rows: the launch is all latency). :func:`prepare` concatenates a layer's projection
weights once, at patch time, and hands each projection module a view of its rows of the concatenation
(no second copy of the weights); :func:`run` then computes the group as one matmul and splits its output (:func:`fused_for` says
whether a call takes that path).

Same bits: a quantised matmul computes each output element from its weight row and the input alone,
in an order that does not depend on the other rows, as long as MLX picks the same kernel for the
concatenation as for each piece. MLX picks its vector kernel (qmv) for a few rows and a tiled GEMM
(whose split-K and alignment choices depend on N) from there on, so the fused path runs for calls of at
most :data:`MAX_ROWS` rows (a decode step of up to that many sequences); prefill chunks keep one matmul
per projection. Checked bit for bit on the CPU (tests/core/test_projections.py) and on the GPU through
``bench/projection_bits.py``.

The concatenation belongs to the arrays the modules held at patch time: if a projection's weights are
replaced later (``load_weights``, ``update``, LoRA, sharding) the group is prepared again on its next
call, or runs unfused where it cannot be (a piece no longer quantised alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import switches
from .dispatch import REFERENCE, op_backend

# Calls of at most this many rows (batch x tokens) take the fused matmul: MLX's quantised matmul runs
# its vector kernel there on every backend it has (Metal: below 13 rows at the smallest; CUDA: below 8),
# so the concatenation and each piece get the same kernel and the same bits.
MAX_ROWS = 7

# Stock class name -> the projections fused, in output order (all read the layer's input).
GROUPS: Dict[str, Tuple[str, ...]] = {
    "GatedDeltaNet": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "Qwen3NextGatedDeltaNet": ("in_proj_qkvz", "in_proj_ba"),
    "Qwen3NextAttention": ("q_proj", "k_proj", "v_proj"),
}

def _mlx_quantized_matmul(x, weight, scales, biases, group_size, bits, mode):
    return mx.quantized_matmul(x, weight, scales=scales, biases=biases, transpose=True, group_size=group_size,
                               bits=bits, mode=mode)


# The matmul :func:`run` computes a group with: MLX's, until the linear op family registers its own
# (``lily_mlx.ops.linear``: the row GEMV for a decode call, switch ``dense_gemv``; core imports no family).
QUANTIZED_MATMUL = [_mlx_quantized_matmul]

# A decode call's input norm handed to the projections that take its output (switch ``gemv_input_norm``): a
# decoder layer notes (normed, x, norm) when it normalises its input, and a projection handed that very array
# may compute the norm from x inside its GEMV; the norm's own primitive is then left unused, so MLX never
# builds it into the step. Matched by identity, so any other array (or a note another thread overwrote) is
# projected as it is. Core only keeps the note: the linear family reads it.
_INPUT_NORM: list = [None]


def note_input_norm(normed: mx.array, x: mx.array, norm) -> None:
    """``normed`` is ``norm(x)`` (an ``nn.RMSNorm``): a projection of it may compute it from x itself."""
    _INPUT_NORM[0] = (normed, x, norm)


def input_norm_of(normed: mx.array):
    """(x, norm) when ``normed`` is the array last noted by :func:`note_input_norm`, else None."""
    noted = _INPUT_NORM[0]
    return (noted[1], noted[2]) if noted is not None and noted[0] is normed else None


def forget_input_norm() -> None:
    _INPUT_NORM[0] = None


def _no_gemv(x: mx.array, record: "FusedProjection"):
    return None


# Whether the linear family's row GEMV computes ``matmul(record, x)`` for this call, and from what: (backend, the
# GEMV's input, the ``nn.RMSNorm`` computed inside it or None), else None (MLX's matmul). A kernel that takes a
# projection's rows into its own work (a DeltaNet decode step from the layer's input) asks this, so that it gives
# the GEMV's bits. Filled by ``lily_mlx.ops.linear`` (core imports no family).
GEMV_PLAN = [_no_gemv]

# A kernel that computes a projection's rows itself stages the layer's input row in threadgroup memory (2 bytes an
# element): 16 KB at most, within Apple GPUs' 32 KB beside its own arrays.
FOLD_MAX_HIDDEN = 8192
FOLD_GROUP_SIZES = (32, 64, 128)


def fold_reason(x: mx.array, weight: mx.array, scales: mx.array, biases: Optional[mx.array], group_size: int,
                bits: int, mode: str, in_norm_weight: Optional[mx.array] = None) -> Optional[str]:
    """Why a decode kernel cannot compute this 4-bit projection of x [B, 1, Hd] itself by the row GEMV's arithmetic
    (``GEMV_PLAN``'s folds: rows of W [N, Hd / 8] inside the kernel after the projection, the input norm's weight
    [Hd] inside too when given); None when it can. The kernel's own row layout is its caller's to check."""
    if mode != "affine" or bits != 4 or biases is None or group_size not in FOLD_GROUP_SIZES:
        return f"{mode} {bits}-bit projection, group size {group_size} (4-bit affine, {FOLD_GROUP_SIZES})"
    hd = x.shape[-1]
    if x.ndim != 3 or x.shape[1] != 1 or hd % 32 or weight.ndim != 2 or weight.shape[1] * 8 != hd:
        return f"input {tuple(x.shape)} for projection {tuple(weight.shape)} (one token, K % 32 == 0)"
    if hd > FOLD_MAX_HIDDEN:
        return f"hidden size {hd} > {FOLD_MAX_HIDDEN} (the input row is staged in threadgroup memory)"
    if x.dtype not in (mx.bfloat16, mx.float16) or scales.dtype != x.dtype or biases.dtype != x.dtype:
        return f"activations {x.dtype} with scales {scales.dtype} (bfloat16 or float16, alike)"
    if in_norm_weight is not None and (in_norm_weight.shape != (hd,) or in_norm_weight.dtype != x.dtype):
        return f"input norm weight {tuple(in_norm_weight.shape)} {in_norm_weight.dtype} for input {tuple(x.shape)}"
    return None


_ATTR = "_lily_fused_projections"  # in the module's __dict__: not a parameter, not saved


@dataclass(frozen=True)
class FusedProjection:
    """One layer's projections as one quantised weight; ``pieces`` are the arrays (weight, scales,
    biases or None) each module held when fused, views of the concatenation."""

    names: Tuple[str, ...]
    weight: mx.array  # [sum N, K * bits / 32] uint32
    scales: mx.array
    biases: Optional[mx.array]
    split_at: Tuple[int, ...]  # output offsets where each piece after the first starts
    group_size: int
    bits: int
    mode: str
    pieces: Tuple[Tuple[mx.array, mx.array, Optional[mx.array]], ...]


@dataclass(frozen=True)
class _Unfusable:
    """The arrays seen when a group could not be fused, so that it is not tried again per call."""

    reason: str
    pieces: Tuple[Tuple[mx.array, mx.array, Optional[mx.array]], ...]


def _held(module, names) -> Tuple[Tuple[mx.array, mx.array, Optional[mx.array]], ...]:
    """(weight, scales, biases) of each projection as the module holds them now (None where absent)."""
    out = []
    for name in names:
        piece = module.get(name)
        if piece is None:
            return ()
        out.append((piece.get("weight"), piece.get("scales"), piece.get("biases")))
    return tuple(out)


def holds(module, names, pieces) -> bool:
    """Whether ``module`` still holds ``pieces`` (a record's arrays) as its ``names`` (identity only: cheap
    enough for every call of a replayed decode step; :func:`current` also prepares the group again)."""
    for name, (weight, scales, biases) in zip(names, pieces):
        piece = module.get(name)
        if (piece is None or piece.get("weight") is not weight or piece.get("scales") is not scales
                or piece.get("biases") is not biases):
            return False
    return len(names) == len(pieces)


def _unfusable_reason(module, names) -> Optional[str]:
    pieces = [module.get(name) for name in names]
    if any(not isinstance(p, nn.QuantizedLinear) for p in pieces):
        return "not every projection is an nn.QuantizedLinear"
    if any("bias" in p for p in pieces):
        return "a projection has an additive bias"
    first = pieces[0]
    key = (first.group_size, first.bits, first.mode, first["weight"].shape[-1], first["weight"].dtype,
           first["scales"].dtype, "biases" in first)
    for p in pieces[1:]:
        if (p.group_size, p.bits, p.mode, p["weight"].shape[-1], p["weight"].dtype, p["scales"].dtype,
                "biases" in p) != key:
            return "projections quantised differently"
    if any(p["weight"].ndim != 2 for p in pieces):
        return "weights are not 2-D"
    return None


def prepare(module, names: Sequence[str]) -> Optional[FusedProjection]:
    """Concatenate ``names`` of ``module`` into one quantised weight and point each projection at its
    rows of it. Returns the record (also kept on the module), or None where the group cannot be fused."""
    names = tuple(names)
    reason = _unfusable_reason(module, names)
    if reason is not None:
        module.__dict__.setdefault(_ATTR, {})[names] = _Unfusable(reason, _held(module, names))
        return None
    pieces = [module[name] for name in names]
    has_biases = "biases" in pieces[0]
    weight = mx.concatenate([p["weight"] for p in pieces], axis=0)
    scales = mx.concatenate([p["scales"] for p in pieces], axis=0)
    biases = mx.concatenate([p["biases"] for p in pieces], axis=0) if has_biases else None
    mx.eval(weight, scales, biases)
    split_at, start = [], 0
    for p in pieces:
        rows = p["weight"].shape[0]
        # A row slice of a row-contiguous array: MLX evaluates it as a view of the same buffer.
        p["weight"] = weight[start:start + rows]
        p["scales"] = scales[start:start + rows]
        if has_biases:
            p["biases"] = biases[start:start + rows]
        mx.eval(p["weight"], p["scales"], p.get("biases"))
        start += rows
        split_at.append(start)
    first = pieces[0]
    record = FusedProjection(names, weight, scales, biases, tuple(split_at[:-1]), first.group_size,
                             first.bits, first.mode, _held(module, names))
    module.__dict__.setdefault(_ATTR, {})[names] = record
    return record


def prepare_model(model) -> int:
    """:func:`prepare` every layer of ``model`` that has a group (:data:`GROUPS`, matched on the stock
    class name, the class's MRO included). Returns the number of groups fused."""
    fused = 0
    for module in model.modules():
        names = next((GROUPS[c.__name__] for c in type(module).__mro__ if c.__name__ in GROUPS), None)
        if names is not None and current(module, names) is not None:
            fused += 1
    return fused


def current(module, names: Tuple[str, ...]) -> Optional[FusedProjection]:
    """The module's fused record for ``names`` if it still matches the arrays the module holds
    (prepared again once if they were replaced), else None."""
    records = module.__dict__.get(_ATTR)
    record = records.get(names) if records else None
    if record is not None and holds(module, names, record.pieces):
        return record if isinstance(record, FusedProjection) else None
    if not _held(module, names):
        return None
    return prepare(module, names)


def fused_for(module, names: Tuple[str, ...], x: mx.array) -> Optional[FusedProjection]:
    """The record to run ``names`` of ``module`` on input x [..., K] as one matmul, or None where the
    fused path does not apply (more than :data:`MAX_ROWS` rows, the group cannot be fused). Call it
    outside a trace: inside one the module's arrays are placeholders."""
    if x.size > MAX_ROWS * x.shape[-1]:
        return None
    return current(module, names)


def for_call(module, names: Tuple[str, ...], x: mx.array, *, switch: str, op: str) -> Optional[FusedProjection]:
    """:func:`fused_for` where the layer takes the fused path at all: switch ``switch`` on, op ``op`` off
    its reference (the reference backend, ``LILY_REFERENCE_OPS``), the module not training."""
    if not switches.is_enabled(switch) or getattr(module, "training", False) or op_backend(op) == REFERENCE:
        return None
    return fused_for(module, names, x)


def matmul(record: FusedProjection, x: mx.array) -> mx.array:
    """The group's outputs side by side from one quantised matmul: x [..., K] -> [..., sum N_i] (piece i at
    ``record.split_at``; a consumer may read them in place instead of splitting)."""
    return QUANTIZED_MATMUL[0](x, record.weight, record.scales, record.biases, record.group_size, record.bits,
                               record.mode)


def split(record: FusedProjection, y: mx.array) -> List[mx.array]:
    """``matmul``'s output as one [..., N_i] per projection."""
    return mx.split(y, list(record.split_at), axis=-1)


def run(record: FusedProjection, x: mx.array) -> List[mx.array]:
    """``[module.<name>(x) for name in record.names]`` from one quantised matmul: x [..., K] ->
    one [..., N_i] per projection."""
    return split(record, matmul(record, x))
