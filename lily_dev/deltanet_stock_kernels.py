"""MLX-LM's own Gated DeltaNet Metal kernels, run on any kernel backend (for comparisons).

MLX-LM builds its DeltaNet kernels only where Metal is available. To time and check ours against
them where they are not native (the CPU simulator; an NVIDIA GPU through the Metal->CUDA bridge), their
``metal_kernel`` arguments are captured from ``mlx_lm.models.gated_delta`` and rebuilt with a
backend's factory, then launched with MLX-LM's grid, threadgroup and template (a test pins the launch
to MLX-LM's own dispatch, bit for bit). On a Mac the rebuilt kernels are the same
``mx.fast.metal_kernel`` objects MLX-LM makes itself.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Dict, Optional, Tuple
from unittest import mock

import mlx.core as mx

from lily_mlx.core.backend import resolve_backend


def _makers():
    """MLX-LM's module attribute -> the maker call that builds that kernel."""
    from mlx_lm.models import gated_delta as gd

    return {
        "_gated_delta_kernel": lambda: gd._make_gated_delta_kernel(has_mask=False, vectorized=False),
        "_gated_delta_kernel_masked": lambda: gd._make_gated_delta_kernel(has_mask=True, vectorized=False),
        "_gated_delta_kernel_vec": lambda: gd._make_gated_delta_kernel(has_mask=False, vectorized=True),
        "_gated_delta_kernel_vec_masked": lambda: gd._make_gated_delta_kernel(has_mask=True, vectorized=True),
        "_gated_delta_kernel_xtree": gd._make_gated_delta_kernel_xtree,
        "_gated_delta_kernel_packed": gd._make_gated_delta_packed_kernel,
    }


def mlx_lm_kernel_args() -> Dict[str, dict]:
    """{module attribute: metal_kernel keyword arguments} for each of MLX-LM's GDN kernels (generic,
    masked, vector-gated, vector-gated masked, explicit-tree comparator, packed), read from
    ``mlx_lm.models.gated_delta`` without a Metal device (its makers return None without Metal, so
    Metal is reported available and the ``mx.fast.metal_kernel`` call is recorded instead)."""
    captured: Dict[str, dict] = {}
    for attr, make in _makers().items():
        calls = []
        with mock.patch.object(mx.metal, "is_available", return_value=True), \
                mock.patch.object(mx.fast, "metal_kernel", side_effect=lambda **kw: calls.append(kw) or kw):
            make()
        if len(calls) != 1:
            raise RuntimeError(f"MLX-LM's maker for {attr} built {len(calls)} kernels (expected 1)")
        captured[attr] = calls[0]
    return captured


def mlx_lm_kernels(factory: Callable) -> Dict[str, Callable]:
    """MLX-LM's GDN kernels built with a ``metal_kernel``-compatible factory, by module attribute."""
    return {attr: factory(**kw) for attr, kw in mlx_lm_kernel_args().items()}


@lru_cache(maxsize=None)
def _kernels_for_backend(backend: str) -> Dict[str, Callable]:
    from lily_mlx.core.kernel_registry import metal_kernel_factory

    return mlx_lm_kernels(metal_kernel_factory(backend))


def mlx_lm_scan(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                *, packed: bool, backend: Optional[str] = None, kernels: Optional[Dict[str, Callable]] = None,
                init_value: Optional[float] = None) -> Tuple[mx.array, mx.array]:
    """MLX-LM's unmasked scalar-gate scan with its generic or packed kernel, launched with the grid,
    threadgroup and template MLX-LM's own dispatch uses (a test pins them to it), built for
    ``backend`` or given as ``kernels`` (from :func:`mlx_lm_kernels`). No patching per call, so a
    benchmark times the kernel, not the plumbing.
    q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv] fp32, state [B, Hv, Dv, Dk] fp32
    -> (y [B, T, Hv, Dv], new state)."""
    kernels = kernels or _kernels_for_backend(backend or resolve_backend())
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    if packed:
        # MLX-LM's rule: each lane holds Dk / 4 state elements, 8 value rows per simdgroup.
        if Dk != 128 or Dv % 8 or g.ndim != 3 or g.dtype != mx.float32 or state.dtype != mx.float32:
            raise ValueError("MLX-LM's packed kernel needs Dk = 128, Dv % 8 == 0, a scalar fp32 gate and fp32 state")
        kernel, grid, threadgroup = kernels["_gated_delta_kernel_packed"], (32, Dv // 8, B * Hv), (32, 2, 1)
    else:
        kernel, grid, threadgroup = kernels["_gated_delta_kernel"], (32, Dv, B * Hv), (32, 4, 1)
    y, new_state = kernel(
        inputs=[q, k, v, g, beta, state, T],
        template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=grid, threadgroup=threadgroup,
        output_shapes=[(B, T, Hv, Dv), state.shape], output_dtypes=[q.dtype, state.dtype],
        init_value=init_value,
    )
    return y, new_state


# ----------------------------------------------------------------------------------------------
# Stock MLX-LM with its own kernels (the fair baseline: what a Mac's stock runs)

_STOCK_MODULES = ("mlx_lm.models.qwen3_5", "mlx_lm.models.qwen3_next")
_saved: Dict[str, object] = {}


def _gated_delta_update_with_kernels(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                                     use_kernel: bool = True, lower_bound=None, allow_neg_eigval: bool = False):
    """``mlx_lm.models.gated_delta.gated_delta_update`` with one change: its kernel path is taken on any
    device (MLX-LM takes it only where ``mx.metal.is_available()``). Same gates, same state, same
    dispatch into ``gated_delta_kernel`` (generic, masked, vector-gated or packed), whose kernel objects
    are MLX-LM's own Metal sources rebuilt for this backend (:func:`stock_kernels`)."""
    from mlx_lm.models import gated_delta as gd

    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    g = gd.compute_g(A_log, a, dt_bias) if lower_bound is None else gd.compute_lower_bound_g(
        A_log, a, dt_bias, lower_bound)
    if state is None:
        B, _, _, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if not use_kernel or k.shape[-1] < 32 or k.shape[-1] % 32 != 0:
        return gd.gated_delta_ops(q, k, v, g, beta, state, mask)
    return gd.gated_delta_kernel(q, k, v, g, beta, state, mask)


def stock_kernels_active() -> bool:
    return bool(_saved)


def set_stock_kernels(on: bool, backend: Optional[str] = None) -> None:
    """Make stock MLX-LM run its own Gated DeltaNet kernels on ``backend`` (the bridge on CUDA, the
    simulator on ``sim``): the fair baseline ``stock-kernels`` of the benchmarks, i.e. what stock runs
    on a Mac. Off restores MLX-LM exactly. Applies to unpatched (stock) layers only."""
    import importlib

    from mlx_lm.models import gated_delta as gd

    if on and not _saved:
        kernels = _kernels_for_backend(backend or resolve_backend())
        for attr, kernel in kernels.items():
            _saved[f"gd.{attr}"] = getattr(gd, attr)
            setattr(gd, attr, kernel)
        for name in _STOCK_MODULES:
            module = importlib.import_module(name)
            _saved[f"{name}.gated_delta_update"] = module.gated_delta_update
            module.gated_delta_update = _gated_delta_update_with_kernels
    elif not on and _saved:
        for key, value in _saved.items():
            owner, attr = key.rsplit(".", 1)
            target = gd if owner == "gd" else importlib.import_module(owner)
            setattr(target, attr, value)
        _saved.clear()
