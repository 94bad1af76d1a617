"""Forwards of the linear family: ``nn.QuantizedLinear``'s call and the fused projections' matmul
(``lily_mlx.core.projections``), each by the row GEMV for a decode call's rows where it applies.

A decode call is one token per sequence (x [B, 1, K]; a 2-D x [N, K] is not one: its rows may be one
sequence's tokens): the kernel then takes every row, however many sequences the batch holds. Prefill
chunks, training mode, switch ``dense_gemv`` off and shapes the kernel does not compute run MLX's quantised
matmul. Not batch invariant as it stands: a prompt's one-token chunk alone takes the GEMV and the same chunk
padded into a batch takes MLX's matmul (hence a trial kernel: ``kernels.GEMV_BACKENDS``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ...core import projections, switches
from ...core.dispatch import REFERENCE, op_backend
from ...core.log import log_once
from . import kernels
from .reference import quantized_matmul_reference


def _gemv_backend(x: mx.array, weight, scales, biases, group_size: int, bits: int, mode: str) -> Optional[str]:
    """The backend the row GEMV runs on for this call, or None (MLX's matmul)."""
    if x.ndim < 3 or x.shape[-2] != 1 or not switches.is_enabled("dense_gemv"):  # [..., 1, K]: one token a sequence
        return None
    backend = op_backend("linear_gemv")
    if backend == REFERENCE:
        return None
    reason = kernels.gemv_reason(x, weight, scales, biases, group_size, bits, mode)
    if reason is not None:
        log_once(f"linear_gemv:{reason}", f"linear_gemv: {reason}, using MLX's quantised matmul")
        return None
    return backend


def quantized_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: Optional[mx.array], group_size: int,
                     bits: int, mode: str = "affine") -> mx.array:
    """x [..., K] . W^T: the row GEMV for a decode call where it applies, else MLX's quantised matmul."""
    backend = _gemv_backend(x, weight, scales, biases, group_size, bits, mode)
    if backend is None:
        return quantized_matmul_reference(x, weight, scales, biases, group_size, bits, mode)
    source = _input_norm_source(x)
    if source is not None:
        x_in, norm = source
        return kernels.gemv_q4_rms_norm(x_in, norm["weight"], norm.eps, weight, scales, biases, group_size, backend)
    return kernels.gemv_q4(x, weight, scales, biases, group_size, backend)


def gemv_plan(x: mx.array, record: projections.FusedProjection):
    """(backend, the GEMV's input, the norm inside or None) when ``quantized_matmul`` computes ``record``'s projection
    of x by the row GEMV, else None (``projections.GEMV_PLAN``)."""
    backend = _gemv_backend(x, record.weight, record.scales, record.biases, record.group_size, record.bits, record.mode)
    if backend is None:
        return None
    source = _input_norm_source(x)
    return (backend, x, None) if source is None else (backend, source[0], source[1])


def _input_norm_source(x: mx.array):
    """(the norm's input, the ``nn.RMSNorm``) when x is a decoder layer's input norm that the GEMV may compute
    itself (switch ``gemv_input_norm``; ``projections.note_input_norm``), else None."""
    source = projections.input_norm_of(x)
    if source is None or not switches.is_enabled("gemv_input_norm"):
        return None
    reason = kernels.rms_norm_reason(source[0], source[1]["weight"])
    if reason is not None:
        log_once(f"gemv_input_norm:{reason}", f"gemv_input_norm: {reason}; the norm as its own launch")
        return None
    return source


def quantized_linear_forward(self, x: mx.array) -> mx.array:
    """``nn.QuantizedLinear.__call__`` with the decode GEMV (stock's call while training)."""
    if self.training:
        return self._lily_stock_class.__call__(self, x)
    y = quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), self.group_size, self.bits,
                         self.mode)
    if "bias" in self:
        y = y + self["bias"]
    return y
