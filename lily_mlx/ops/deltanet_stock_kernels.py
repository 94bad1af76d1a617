"""MLX-LM's own Gated DeltaNet Metal kernels, run on any kernel backend (for comparisons).

MLX-LM builds its DeltaNet kernels only where Metal is available. To time and check ours against
them where they are not native (the CPU simulator; an NVIDIA GPU through the Metal->CUDA bridge), their
``metal_kernel`` arguments are captured from ``mlx_lm.models.gated_delta`` and rebuilt with a
backend's factory; MLX-LM's own dispatch (grid, threadgroup, template) then launches them. On a Mac
the rebuilt kernels are the same ``mx.fast.metal_kernel`` objects MLX-LM makes itself.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Dict, Optional, Tuple
from unittest import mock

import mlx.core as mx

from ..backend import resolve_backend

# MLX-LM's kernel names -> the module attribute its dispatch reads.
_MODULE_ATTRS = {
    "gated_delta_step": "_gated_delta_kernel",
    "gated_delta_step_packed_btree": "_gated_delta_kernel_packed",
}


def mlx_lm_kernel_args() -> Dict[str, dict]:
    """{kernel name: metal_kernel keyword arguments} for MLX-LM's GDN kernels (generic, masked,
    vector-gated, packed), read from ``mlx_lm.models.gated_delta`` without a Metal device."""
    from mlx_lm.models import gated_delta as gd

    captured: Dict[str, dict] = {}

    def capture(**kwargs):
        captured[kwargs["name"]] = kwargs
        return kwargs

    with mock.patch.object(mx.metal, "is_available", return_value=True), \
            mock.patch.object(mx.fast, "metal_kernel", side_effect=capture):
        gd._make_gated_delta_kernel(has_mask=False, vectorized=False)
        gd._make_gated_delta_kernel(has_mask=True, vectorized=False)
        gd._make_gated_delta_kernel(has_mask=False, vectorized=True)
        gd._make_gated_delta_packed_kernel()
    return captured


def mlx_lm_kernels(factory: Callable) -> Dict[str, Callable]:
    """MLX-LM's generic and packed scan kernels built with a ``metal_kernel``-compatible factory."""
    args = mlx_lm_kernel_args()
    return {attr: factory(**args[name]) for name, attr in _MODULE_ATTRS.items()}


@lru_cache(maxsize=None)
def _kernels_for_backend(backend: str) -> Dict[str, Callable]:
    from ..kernel_registry import metal_kernel_factory

    return mlx_lm_kernels(metal_kernel_factory(backend))


def mlx_lm_scan(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                *, packed: bool, backend: Optional[str] = None,
                kernels: Optional[Dict[str, Callable]] = None) -> Tuple[mx.array, mx.array]:
    """MLX-LM's unmasked scalar-gate scan with its generic or packed kernel, built for ``backend``
    (or given as ``kernels``, from :func:`mlx_lm_kernels`):
    q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv] fp32, state [B, Hv, Dv, Dk] fp32
    -> (y [B, T, Hv, Dv], new state). Packed needs Dk = 128 and Dv % 8 == 0 (MLX-LM's rule)."""
    from mlx_lm.models import gated_delta as gd

    kernels = kernels or _kernels_for_backend(backend or resolve_backend())
    with mock.patch.object(gd, "_gated_delta_kernel", kernels["_gated_delta_kernel"]), \
            mock.patch.object(gd, "_gated_delta_kernel_packed", kernels["_gated_delta_kernel_packed"]), \
            mock.patch.object(gd, "_ENABLE_GDN_PACKED", True):
        return gd._gated_delta_kernel_impl(q, k, v, g, beta, state, None, allow_packed=packed)
