"""Our DeltaNet scan kernels next to MLX-LM's own (generic one-row-per-simdgroup and packed Dk=128),
all unmodified through the simulator on the same inputs, each against the fp32 reference: the stock
kernels are the comparison the GPU benchmarks make, so they must compute the same function here."""

from unittest import mock

import mlx.core as mx
import numpy as np
import pytest

from lily_mlx.ops.deltanet import kernels as dk
from lily_mlx.ops.deltanet import reference as ref
from lily_dev.deltanet_stock_kernels import mlx_lm_kernels, mlx_lm_scan
from tests.ops.deltanet_cases import rel_l2

SIM_MISSING = dk.backend_unavailable_reason("sim")
pytestmark = pytest.mark.skipif(SIM_MISSING is not None, reason=f"CPU simulator not available: {SIM_MISSING}")


@pytest.fixture(scope="module")
def stock_kernels():
    """MLX-LM's DeltaNet kernels built with the simulator (its makers need Metal)."""
    from lily_mlx.msl import sim

    return mlx_lm_kernels(sim.metal_kernel)


def _run_stock(kernels, packed, q, k, v, g, beta, state):
    return mlx_lm_scan(q, k, v, g, beta, state, packed=packed, kernels=kernels, init_value=float("nan"))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", [(2, 9, 1, 2, 128, 128), (1, 64, 2, 4, 64, 64)], ids=["Dk128", "Dk64"])
def test_our_and_stock_scan_kernels_agree(stock_kernels, shape, dtype):
    B, T, Hk, Hv, Dk, Dv = shape
    rng = np.random.default_rng(Dk + T)
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    q, k = ref.qk_norm(f(B, T, Hk, Dk).astype(dtype), f(B, T, Hk, Dk).astype(dtype), Dk)
    v = f(B, T, Hv, Dv).astype(dtype)
    g, beta = ref.gates(f(B, T, Hv), f(B, T, Hv), mx.log(mx.array(rng.uniform(1, 16, Hv).astype(np.float32))), f(Hv))
    state = 0.1 * f(B, Hv, Dv, Dk)
    up = lambda x: x.astype(mx.float32)  # noqa: E731
    y_ref, s_ref = ref.scan_ops(up(q), up(k), up(v), g, beta, state)

    results = {
        "lily_register": dk.scan(q, k, v, g, beta, state, register=True, backend="sim", init_value=float("nan")),
        "lily_blockwise": dk.scan(q, k, v, g, beta, state, register=False, backend="sim", init_value=float("nan")),
        "mlx_lm_generic": _run_stock(stock_kernels, False, q, k, v, g, beta, state),
    }
    if Dk == 128:
        results["mlx_lm_packed"] = _run_stock(stock_kernels, True, q, k, v, g, beta, state)
    tol = 1e-5 if dtype == mx.float32 else 2e-3
    for name, (y, s) in results.items():
        assert rel_l2(y, y_ref.astype(dtype)) < tol, name
        assert rel_l2(s, s_ref) < 1e-5, name
    # Kernel against kernel: same function on the same inputs.
    y0, s0 = results["mlx_lm_generic"]
    for name, (y, s) in results.items():
        assert rel_l2(y, y0) < tol and rel_l2(s, s0) < 1e-5, name


@pytest.mark.parametrize("packed", [False, True], ids=["generic", "packed"])
def test_mlx_lm_scan_launches_like_mlx_lm(stock_kernels, packed):
    """``mlx_lm_scan`` (the benchmarks' stock-kernel comparator) launches MLX-LM's kernels exactly as
    MLX-LM's own dispatch does (bit-identical results), and computes the reference's function."""
    import mlx_lm.models.gated_delta as gd

    B, T, Hk, Hv, Dk, Dv = 2, 6, 1, 2, 128, 64
    rng = np.random.default_rng(7)
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    q, k = ref.qk_norm(f(B, T, Hk, Dk), f(B, T, Hk, Dk), Dk)
    v = f(B, T, Hv, Dv)
    g, beta = ref.gates(f(B, T, Hv), f(B, T, Hv), mx.log(mx.array(rng.uniform(1, 16, Hv).astype(np.float32))), f(Hv))
    state = 0.1 * f(B, Hv, Dv, Dk)
    y, s = mlx_lm_scan(q, k, v, g, beta, state, packed=packed, kernels=stock_kernels)
    with mock.patch.multiple(gd, _ENABLE_GDN_PACKED=True, **stock_kernels):
        y_mlx_lm, s_mlx_lm = gd._gated_delta_kernel_impl(q, k, v, g, beta, state, None, allow_packed=packed)
    assert mx.array_equal(y, y_mlx_lm).item() and mx.array_equal(s, s_mlx_lm).item()
    y_ref, s_ref = ref.scan_ops(q, k, v, g, beta, state)
    assert rel_l2(y, y_ref) < 1e-5 and rel_l2(s, s_ref) < 1e-5
