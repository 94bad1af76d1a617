"""Reference of the linear family: MLX's quantised matmul, as ``nn.QuantizedLinear`` runs it."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx


def quantized_matmul_reference(x: mx.array, weight: mx.array, scales: mx.array, biases: Optional[mx.array],
                               group_size: int, bits: int, mode: str = "affine") -> mx.array:
    """x [..., K] . W^T -> [..., N] (W [N, K * bits / 32] packed)."""
    return mx.quantized_matmul(x, weight, scales=scales, biases=biases, transpose=True, group_size=group_size,
                               bits=bits, mode=mode)
