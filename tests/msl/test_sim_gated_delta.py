"""MLX-LM's own Gated DeltaNet Metal kernels (mlx_lm/models/gated_delta.py), run unmodified through
the simulator: generic, masked, vectorised-gate and packed variants agree with ``gated_delta_ops``;
the packed kernel is bit-identical to the explicit-tree comparator (MLX-LM's GPU contract)."""

from unittest import mock

import mlx.core as mx
import mlx_lm.models.gated_delta as gd
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lily_mlx.msl import sim
from lily_dev.deltanet_stock_kernels import mlx_lm_kernel_args


@pytest.fixture(scope="module")
def sim_kernels():
    kernels = {attr: sim.metal_kernel(**kw) for attr, kw in mlx_lm_kernel_args().items()}
    with mock.patch.multiple(gd, _ENABLE_GDN_PACKED=True, **kernels):
        yield kernels


def _inputs(B, T, Hk, Hv, Dk, Dv, dtype, vec_gate, masked, seed):
    rng = np.random.default_rng(seed)
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))
    q, k = f(B, T, Hk, Dk), f(B, T, Hk, Dk)
    q = (q / mx.linalg.norm(q, axis=-1, keepdims=True) * Dk ** -0.5).astype(dtype)
    k = (k / mx.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = f(B, T, Hv, Dv).astype(dtype)
    gshape = (B, T, Hv, Dk) if vec_gate else (B, T, Hv)
    g = mx.exp(-mx.array(rng.uniform(0.0, 1.0, gshape).astype(np.float32)))
    beta = mx.sigmoid(f(B, T, Hv)).astype(dtype)
    state = f(B, Hv, Dv, Dk) * 0.1
    mask = mx.array(rng.uniform(size=(B, T)) > 0.3) if masked else None
    return q, k, v, g, beta, state, mask


def _close(a, b, dtype):
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    return np.allclose(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)), rtol=tol, atol=tol)


@settings(max_examples=8, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 4), Hk=st.integers(1, 2), rep=st.sampled_from([1, 2]),
       Dk=st.sampled_from([32, 64, 128]), Dv=st.sampled_from([8, 16]), dtype=st.sampled_from([mx.float32, mx.bfloat16]),
       vec_gate=st.booleans(), masked=st.booleans(), seed=st.integers(0, 1000))
def test_unpacked_kernels_match_gated_delta_ops(sim_kernels, B, T, Hk, rep, Dk, Dv, dtype, vec_gate, masked, seed):
    q, k, v, g, beta, state, mask = _inputs(B, T, Hk, Hk * rep, Dk, Dv, dtype, vec_gate, masked, seed)
    y, s = gd.gated_delta_kernel_unpacked(q, k, v, g, beta, state, mask)
    y_ref, s_ref = gd.gated_delta_ops(q, k, v, g, beta, state, mask)
    assert y.dtype == y_ref.dtype and s.dtype == mx.float32
    if masked:
        # the kernels write y = 0 where the mask is off; the ops reference computes y there anyway
        keep = mask[:, :, None, None]
        y, y_ref = mx.where(keep, y, 0), mx.where(keep, y_ref, 0)
    assert _close(y, y_ref, dtype)
    assert np.allclose(np.array(s), np.array(s_ref), rtol=1e-5, atol=1e-5)


@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 4), Hk=st.integers(1, 2), rep=st.sampled_from([1, 2]),
       Dv=st.sampled_from([8, 16, 24]), dtype=st.sampled_from([mx.float32, mx.bfloat16]), seed=st.integers(0, 1000))
def test_packed_kernel_bit_identical_to_xtree_and_close_to_ops(sim_kernels, B, T, Hk, rep, Dv, dtype, seed):
    q, k, v, g, beta, state, _ = _inputs(B, T, Hk, Hk * rep, 128, Dv, dtype, False, False, seed)
    calls = []
    packed = sim_kernels["_gated_delta_kernel_packed"]
    with mock.patch.object(gd, "_gated_delta_kernel_packed", lambda **kw: calls.append(1) or packed(**kw)):
        y, s = gd.gated_delta_kernel(q, k, v, g, beta, state)
    assert calls, "the packed kernel was not selected"
    y_x, s_x = gd.gated_delta_kernel_xtree(q, k, v, g, beta, state)
    assert np.array_equal(np.array(y.view(mx.uint16) if dtype == mx.bfloat16 else y.view(mx.uint32)),
                          np.array(y_x.view(mx.uint16) if dtype == mx.bfloat16 else y_x.view(mx.uint32)))
    assert np.array_equal(np.array(s.view(mx.uint32)), np.array(s_x.view(mx.uint32)))
    # simd_sum is the same butterfly, so the generic kernel is bit-identical too (as on Apple GPUs)
    y_u, s_u = gd.gated_delta_kernel_unpacked(q, k, v, g, beta, state)
    assert np.array_equal(np.array(s_u.view(mx.uint32)), np.array(s_x.view(mx.uint32)))
    y_ref, s_ref = gd.gated_delta_ops(q, k, v, g, beta, state)
    assert _close(y, y_ref, dtype)
    assert np.allclose(np.array(s), np.array(s_ref), rtol=1e-5, atol=1e-5)


def _planted(attr, old, new):
    kw = dict(mlx_lm_kernel_args()[attr])
    assert old in kw["source"], "planting site not found in mlx_lm's source"
    kw["source"] = kw["source"].replace(old, new, 1)
    kw["name"] += "_planted"
    return sim.metal_kernel(**kw)


def _run_generic(kernel, T=2, Dv=8):
    q, k, v, g, beta, state, _ = _inputs(1, T, 1, 2, 64, Dv, mx.float32, False, False, 0)
    out = kernel(inputs=[q, k, v, g, beta, state, T],
                 template=[("InT", mx.float32), ("StT", mx.float32), ("Dk", 64), ("Dv", Dv), ("Hk", 1), ("Hv", 2)],
                 grid=(32, Dv, 2), threadgroup=(32, 4, 1), output_shapes=[(1, T, 2, Dv), state.shape],
                 output_dtypes=[mx.float32, mx.float32])
    mx.eval(out)


def test_planted_out_of_bounds_write_in_mlx_lm_kernel_is_caught():
    bad = _planted("_gated_delta_kernel", "o_state[s_idx] = static_cast<StT>(state[i]);",
                   "o_state[s_idx + n_per_t] = static_cast<StT>(state[i]);")
    with pytest.raises(sim.OutOfBoundsError, match=r"`state_out`.*\n.*line \d+: o_state\[s_idx \+ n_per_t\]"):
        _run_generic(bad)


def test_planted_divergent_simd_sum_in_mlx_lm_kernel_is_caught():
    bad = _planted("_gated_delta_kernel", "kv_mem = simd_sum(kv_mem);",
                   "if (dk_idx < 16) kv_mem = simd_sum(kv_mem);")
    with pytest.raises(sim.DivergenceError, match="simd_sum"):
        _run_generic(bad)


def test_planted_missing_barrier_race_is_caught():
    # A staged variant of the decode step: q is shared through threadgroup memory. Without the
    # barrier between staging and use, the result depends on thread order.
    kw = dict(mlx_lm_kernel_args()["_gated_delta_kernel"])
    staged = kw["source"].replace(
        "for (int t = 0; t < T; ++t) {",
        "threadgroup float q_tg[Dk];\n"
        "        for (int t = 0; t < T; ++t) {\n"
        "          if (thread_position_in_threadgroup.y == 0) {\n"
        "            for (int i = 0; i < n_per_t; ++i) q_tg[n_per_t * dk_idx + i] = q_[n_per_t * dk_idx + i];\n"
        "          }\n"
        "          BARRIER_A\n", 1).replace(
        "out += state[i] * q_[s_idx];", "out += state[i] * q_tg[s_idx];", 1).replace(
        "// Increment data pointers to next time step", "BARRIER_B\n          // Increment data pointers", 1)
    barrier = "threadgroup_barrier(mem_flags::mem_threadgroup);"
    good = sim.metal_kernel(**{**kw, "name": "staged", "race_check": True,
                               "source": staged.replace("BARRIER_A", barrier).replace("BARRIER_B", barrier)})
    _run_generic(good)
    bad = sim.metal_kernel(**{**kw, "name": "staged_race", "race_check": True,
                              "source": staged.replace("BARRIER_A", "").replace("BARRIER_B", barrier)})
    with pytest.raises(sim.RaceError):
        _run_generic(bad)
