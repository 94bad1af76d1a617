"""Gated DeltaNet kernels (kernels/deltanet/deltanet.metal) in the CPU simulator vs the reference ops.

Every kernel variant (register scan, blockwise scan, gates, gated norm, fused and unfused decode, the
conv + q/k-norm kernel) on hypothesis-drawn shapes, outputs poisoned with NaN so unwritten elements
show. The oracle is the reference op evaluated in fp32 on the same (bf16-valued) inputs, delivered in
the output's dtype; tolerances: relative L2 < 2e-3 with bf16 activations, < 1e-5 in fp32; the state is
fp32 throughout. The one-kernel decode from the in_proj output (fused_conv_step) is held to the bits of
the two kernels it replaces. The forwards are compared with the stock modules themselves.
"""

import contextlib
import logging
import os

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from mlx.utils import tree_map

from lily_mlx.core import dispatch, switches
from lily_mlx.core.kernel_registry import record_launches
from lily_mlx.core.log import reset_log_once
from lily_mlx.ops.deltanet import kernels as dk
from lily_mlx.ops.deltanet import layer as deltanet
from lily_mlx.ops.deltanet import reference as ref
from tests.kernels.kernel_backend import KERNEL_BACKEND, kernel_backend_problem
from tests.kernels.model_checks import decided_positions
from tests.kernels.model_checks import teacher_forced_logits as shared_teacher_forced_logits
from tests.ops.deltanet_cases import (
    assert_as_accurate_as_stock,
    make_cache,
    make_module,
    random_inputs,
    rel_l2,
    same,
    ssm_mask,
)
from tests.ops.deltanet_cases import rand_array as _rand

SIM_MISSING = kernel_backend_problem() or dk.backend_unavailable_reason(KERNEL_BACKEND)
needs_sim = pytest.mark.skipif(SIM_MISSING is not None, reason=f"{KERNEL_BACKEND} kernels not available: {SIM_MISSING}")

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
TOL = {"float32": 1e-5, "bfloat16": 2e-3}
NAN = float("nan")
# Small heads for most examples (the simulator runs every thread); the Qwen3.6 head shape once below.
HEAD_DIMS = [(32, 32), (64, 64), (32, 64)]


def _mask(rng, B, T):
    """Left padding and per-row lengths, as ``ArraysCache.make_mask`` builds them."""
    pos = np.arange(T)
    left = rng.integers(0, max(1, T // 2), size=B)
    end = np.maximum(rng.integers(1, T + 1, size=B), left + 1)
    return mx.array((pos[None] >= left[:, None]) & (pos[None] < end[:, None]))


def _problem(rng, B, T, Hk, Hv, Dk, Dv, dt, with_state, with_mask):
    q, k = ref.qk_norm(_rand(rng, (B, T, Hk, Dk), dt), _rand(rng, (B, T, Hk, Dk), dt), Dk)
    v = _rand(rng, (B, T, Hv, Dv), dt)
    a, b = _rand(rng, (B, T, Hv), dt), _rand(rng, (B, T, Hv), dt)
    A_log = mx.array(np.log(rng.uniform(0.5, 16, Hv)).astype(np.float32)).astype(dt)
    dt_bias = _rand(rng, (Hv,), dt)
    state = _rand(rng, (B, Hv, Dv, Dk), mx.float32, 0.1) if with_state else None
    mask = _mask(rng, B, T) if with_mask else None
    return q, k, v, a, b, A_log, dt_bias, state, mask


def _f32(*arrays):
    return [None if x is None else (x.astype(mx.float32) if x.dtype in (mx.bfloat16, mx.float16) else x)
            for x in arrays]


def _check_scan(y, state, y_ref, state_ref, mask, tol):
    """y (model dtype) against the fp32 oracle delivered in y's dtype, so that rounding the result
    itself (up to 2^-8 relative per element in bf16) is not counted as kernel error; state fp32."""
    assert not bool(mx.any(mx.isnan(y)).item()) and not bool(mx.any(mx.isnan(state)).item()), "unwritten output"
    y_ref = y_ref.astype(y.dtype)
    if mask is not None:
        live = mask[..., None, None]
        assert bool(mx.all(mx.where(live, True, y == 0)).item()), "masked positions must be 0"
        y, y_ref = mx.where(live, y, 0), mx.where(live, y_ref, 0)
    assert rel_l2(y, y_ref) < tol
    assert rel_l2(state, state_ref) < max(tol, 1e-5)


@needs_sim
@settings(deadline=None, max_examples=14)
@given(
    B=st.integers(1, 3), T=st.sampled_from([1, 2, 7, 64, 257]), Hk=st.sampled_from([1, 2]),
    rep=st.sampled_from([1, 2]), dims=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from(list(DTYPES)),
    with_state=st.booleans(), with_mask=st.booleans(), register=st.booleans(), seed=st.integers(0, 2**16),
    partials=st.sampled_from([dk.ROW_SUM_PARTIALS, 1, 2, 8]),
)
def test_scan_kernels_match_reference(B, T, Hk, rep, dims, dtype, with_state, with_mask, register, seed, partials):
    rng = np.random.default_rng(seed)
    Dk, Dv = dims
    if T == 257:
        B, rep = 1, 1  # keep the simulator's work bounded
    q, k, v, a, b, A_log, dt_bias, state, mask = _problem(
        rng, B, T, Hk, Hk * rep, Dk, Dv, DTYPES[dtype], with_state, with_mask)
    g, beta = ref.gates(*_f32(a, b, A_log, dt_bias))
    y_ref, s_ref = ref.scan_ops(*_f32(q, k, v), g, beta, state, mask)
    y, s = dk.scan(q, k, v, g, beta, state, mask, register=register, backend=KERNEL_BACKEND, init_value=NAN, block=5,
                   partials=partials)
    assert y.dtype == q.dtype and s.dtype == mx.float32
    _check_scan(y, s, y_ref, s_ref, mask, TOL[dtype])


@needs_sim
@settings(deadline=None, max_examples=12)
@given(
    B=st.integers(1, 2), T=st.sampled_from([1, 7, 16, 17, 40]), Hk=st.sampled_from([1, 2]),
    rep=st.sampled_from([1, 2]), dims=st.sampled_from(HEAD_DIMS + [(128, 32), (256, 32)]),
    dtype=st.sampled_from(list(DTYPES)), with_state=st.booleans(), with_mask=st.booleans(),
    seed=st.integers(0, 2**16), partials=st.sampled_from([dk.ROW_SUM_PARTIALS, 1]),
)
def test_staged_scan_is_bitwise_the_register_scan(B, T, Hk, rep, dims, dtype, with_state, with_mask, seed, partials):
    """deltanet_scan_staged (inputs staged through threadgroup memory, chunks of 16 / 8 tokens) gives
    deltanet_scan_register's bits (so the decode kernels' too: batch invariance), across chunk tails."""
    rng = np.random.default_rng(seed)
    Dk, Dv = dims
    q, k, v, a, b, A_log, dt_bias, state, mask = _problem(
        rng, B, T, Hk, Hk * rep, Dk, Dv, DTYPES[dtype], with_state, with_mask)
    g, beta = ref.gates(*_f32(a, b, A_log, dt_bias))
    y0, s0 = dk.scan(q, k, v, g, beta, state, mask, backend=KERNEL_BACKEND, init_value=NAN, partials=partials)
    y1, s1 = dk.scan(q, k, v, g, beta, state, mask, staged=True, backend=KERNEL_BACKEND, init_value=NAN,
                     partials=partials)
    assert not bool(mx.any(mx.isnan(y1)).item()) and not bool(mx.any(mx.isnan(s1)).item()), "unwritten output"
    assert same(y1, y0) and same(s1, s0)


@needs_sim
def test_staged_scan_qwen36_head_shape():
    """Qwen3.6's head shape across a chunk boundary (18 tokens), state and mask: the register scan's bits
    and the fp32 oracle's accuracy."""
    rng = np.random.default_rng(12)
    q, k, v, a, b, A_log, dt_bias, state, mask = _problem(rng, 1, 18, 16, 32, 128, 128, mx.bfloat16, True, True)
    g, beta = ref.gates(*_f32(a, b, A_log, dt_bias))
    y, s = dk.scan(q, k, v, g, beta, state, mask, staged=True, backend=KERNEL_BACKEND, init_value=NAN)
    y_reg, s_reg = dk.scan(q, k, v, g, beta, state, mask, backend=KERNEL_BACKEND, init_value=NAN)
    assert same(y, y_reg) and same(s, s_reg)
    y_ref, s_ref = ref.scan_ops(*_f32(q, k, v), g, beta, state, mask)
    _check_scan(y, s, y_ref, s_ref, mask, 2e-3)


@needs_sim
def test_blockwise_scan_materialises_every_block():
    rng = np.random.default_rng(7)
    q, k, v, a, b, A_log, dt_bias, state, _ = _problem(rng, 2, 11, 1, 2, 32, 32, mx.float32, True, False)
    g, beta = ref.gates(a, b, A_log, dt_bias)
    y, s, blocks = dk.scan(q, k, v, g, beta, state, register=False, backend=KERNEL_BACKEND, init_value=NAN, block=4,
                           return_block_states=True)
    assert blocks.shape == (4, 3, 32, 32)
    for blk, t_end in enumerate((4, 8, 11)):
        _, s_ref = ref.scan_ops(q[:, :t_end], k[:, :t_end], v[:, :t_end], g[:, :t_end], beta[:, :t_end], state)
        assert rel_l2(blocks.reshape(2, 2, 3, 32, 32)[:, :, blk], s_ref) < 1e-5
    assert same(s, blocks.reshape(2, 2, 3, 32, 32)[:, :, -1])


@needs_sim
@pytest.mark.parametrize("register", [True, False])
def test_scan_qwen36_head_shape(register):
    """Qwen3.6's per-rank head shape: Hk=16, Hv=32, Dk=Dv=128 (bf16), initial state and a mask."""
    rng = np.random.default_rng(11)
    q, k, v, a, b, A_log, dt_bias, state, mask = _problem(rng, 1, 7, 16, 32, 128, 128, mx.bfloat16, True, True)
    g, beta = ref.gates(*_f32(a, b, A_log, dt_bias))
    y_ref, s_ref = ref.scan_ops(*_f32(q, k, v), g, beta, state, mask)
    y, s = dk.scan(q, k, v, g, beta, state, mask, register=register, backend=KERNEL_BACKEND, init_value=NAN)
    _check_scan(y, s, y_ref, s_ref, mask, 2e-3)


@needs_sim
@pytest.mark.parametrize("fused", [True, False])
def test_decode_qwen36_head_shape(fused):
    """Decode at Qwen3.6's per-rank head shape (16 simdgroups = 512 threads per head), B = 2, bf16."""
    rng = np.random.default_rng(12)
    q, k, v, a, b, A_log, dt_bias, state, _ = _problem(rng, 2, 1, 16, 32, 128, 128, mx.bfloat16, True, False)
    z, w = _rand(rng, (2, 1, 32, 128), mx.bfloat16), _rand(rng, (128,), mx.bfloat16)
    out_ref, s_ref = ref.decode_step(*_f32(q, k, v, a, b, A_log, dt_bias), state, *_f32(z, w), 1e-6)
    out, s = dk.decode(q, k, v, a, b, A_log, dt_bias, state, z, w, 1e-6, fused=fused, backend=KERNEL_BACKEND, init_value=NAN)
    _check_scan(out, s, out_ref, s_ref, None, 2e-3)


@needs_sim
@settings(deadline=None, max_examples=8)
@given(B=st.integers(1, 3), T=st.sampled_from([1, 3, 300]), Hv=st.sampled_from([1, 2, 32]),
       dtype=st.sampled_from(list(DTYPES)), f32_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_gates_kernel_matches_reference(B, T, Hv, dtype, f32_bias, seed):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    a, b = _rand(rng, (B, T, Hv), dt, 3.0), _rand(rng, (B, T, Hv), dt, 3.0)
    A_log = mx.array(np.log(rng.uniform(0.5, 16, Hv)).astype(np.float32))
    dt_bias = _rand(rng, (Hv,), mx.float32 if f32_bias else dt)
    g_ref, beta_ref = ref.gates(*_f32(a, b, A_log, dt_bias))
    g, beta = dk.gates(a, b, A_log, dt_bias, backend=KERNEL_BACKEND, init_value=NAN)
    assert g.dtype == mx.float32 and beta.dtype == mx.float32
    assert rel_l2(g, g_ref) < 1e-5 and rel_l2(beta, beta_ref) < 1e-5


@needs_sim
@settings(deadline=None, max_examples=8)
@given(rows=st.integers(1, 9), Dv=st.sampled_from([32, 64, 128]), dtype=st.sampled_from(list(DTYPES)),
       seed=st.integers(0, 2**16))
def test_gated_norm_kernel_matches_reference(rows, Dv, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    x, z = _rand(rng, (rows, 1, Dv), dt), _rand(rng, (rows, 1, Dv), dt)
    w = _rand(rng, (Dv,), dt)
    out = dk.gated_norm(x, z, w, 1e-6, backend=KERNEL_BACKEND, init_value=NAN)
    assert out.dtype == dt
    assert rel_l2(out, ref.gated_rms_norm(*_f32(x, z, w), 1e-6).astype(dt)) < TOL[dtype]


@needs_sim
@settings(deadline=None, max_examples=14)
@given(
    B=st.integers(1, 3), Hk=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2]), dims=st.sampled_from(HEAD_DIMS),
    dtype=st.sampled_from(list(DTYPES)), with_state=st.booleans(), with_mask=st.booleans(),
    fused=st.booleans(), seed=st.integers(0, 2**16),
)
def test_decode_kernels_match_reference(B, Hk, rep, dims, dtype, with_state, with_mask, fused, seed):
    rng = np.random.default_rng(seed)
    Dk, Dv = dims
    Hv = Hk * rep
    dt = DTYPES[dtype]
    q, k, v, a, b, A_log, dt_bias, state, _ = _problem(rng, B, 1, Hk, Hv, Dk, Dv, dt, with_state, False)
    # Decode rows of a batch that finished early are masked out.
    mask = mx.array(rng.random((B, 1)) < 0.7) if with_mask else None
    z, w = _rand(rng, (B, 1, Hv, Dv), dt), _rand(rng, (Dv,), dt)
    out_ref, s_ref = ref.decode_step(*_f32(q, k, v, a, b, A_log, dt_bias), state, *_f32(z, w), 1e-6, mask)
    out, s = dk.decode(q, k, v, a, b, A_log, dt_bias, state, z, w, 1e-6, mask, fused=fused, backend=KERNEL_BACKEND,
                       init_value=NAN)
    _check_scan(out, s, out_ref, s_ref, mask, TOL[dtype])


@needs_sim
@settings(deadline=None, max_examples=10)
@given(
    B=st.integers(1, 3), Hk=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2]), dims=st.sampled_from(HEAD_DIMS),
    conv=st.sampled_from([2, 4]), dtype=st.sampled_from(list(DTYPES)), with_state=st.booleans(),
    with_mask=st.booleans(), seed=st.integers(0, 2**16),
)
def test_decode_conv_qk_norm_kernel_matches_reference(B, Hk, rep, dims, conv, dtype, with_state, with_mask, seed):
    """conv1d + SiLU + conv-state shift + q/k normalisation of one decode token."""
    import mlx.nn as nn

    rng = np.random.default_rng(seed)
    Dk, Dv = dims
    Hv = Hk * rep
    dt = DTYPES[dtype]
    C = 2 * Hk * Dk + Hv * Dv
    conv1d = nn.Conv1d(C, C, kernel_size=conv, groups=C, bias=False)
    conv1d.weight = _rand(rng, (C, conv, 1), dt, 0.5)
    qkv = _rand(rng, (B, 1, C), dt)
    conv_state = _rand(rng, (B, conv - 1, C), dt) if with_state else None
    mask = mx.array(rng.random((B, 1)) < 0.7) if with_mask else None

    q, k, v, new_state = dk.conv_qk_norm_decode(qkv, conv_state, conv1d.weight, mask, Hk, Dk, Hv, Dv,
                                                backend=KERNEL_BACKEND, init_value=NAN)
    # Reference chain (stock's) in fp32 on the same inputs; the state shift must be exact.
    state0 = conv_state if with_state else mx.zeros((B, conv - 1, C), dt)
    conv_input = ref.conv_input_with_state(qkv, state0, mask)
    assert same(new_state, ref.next_conv_state(conv_input, conv - 1, None, 1))
    conv1d_f32 = nn.Conv1d(C, C, kernel_size=conv, groups=C, bias=False)
    conv1d_f32.weight = conv1d.weight.astype(mx.float32)
    out = ref.conv1d_silu(conv_input.astype(mx.float32), conv1d_f32)
    q_raw, k_raw, v_ref = mx.split(out, [Hk * Dk, 2 * Hk * Dk], -1)
    q_ref, k_ref = ref.qk_norm(q_raw.reshape(B, 1, Hk, Dk), k_raw.reshape(B, 1, Hk, Dk), Dk)
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref.reshape(B, 1, Hv, Dv))):
        assert got.dtype == dt and not bool(mx.any(mx.isnan(got)).item())
        assert rel_l2(got, want.astype(dt)) < TOL[dtype]


# ----------------------------------------------------------------------------------------------
# deltanet_decode_conv_fused (switch fused_conv_step): bit for bit the two kernels it replaces

CONV_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def _conv_step_problem(rng, B, Hk, Hv, D, conv, dt, with_conv_state, with_state, with_mask, with_lengths):
    import mlx.nn as nn

    C = 2 * Hk * D + Hv * D
    conv1d = nn.Conv1d(C, C, kernel_size=conv, groups=C, bias=False)
    conv1d.weight = _rand(rng, (C, conv, 1), dt, 0.5)
    return dict(
        qkv=_rand(rng, (B, 1, C), dt),
        conv_state=_rand(rng, (B, conv - 1, C), dt) if with_conv_state else None,
        conv_weight=conv1d.weight,
        mask=mx.array(rng.random((B, 1)) < 0.6) if with_mask else None,
        lengths=mx.array(rng.integers(-1, 3, size=B).astype(np.int32)) if with_lengths else None,  # clamped to [0, 1]
        a=_rand(rng, (B, 1, Hv), dt), b=_rand(rng, (B, 1, Hv), dt),
        A_log=mx.array(np.log(rng.uniform(0.5, 16, Hv)).astype(np.float32)).astype(dt),
        dt_bias=_rand(rng, (Hv,), dt),
        state=_rand(rng, (B, Hv, D, D), mx.float32, 0.1) if with_state else None,
        z=_rand(rng, (B, 1, Hv, D), dt), weight=_rand(rng, (D,), dt),
    ), conv1d


def _two_kernels(x, Hk, Hv, D, init_value):
    """The path deltanet_decode_conv_fused replaces: the conv + q/k-norm kernel, then the fused decode."""
    q, k, v, conv_state = dk.conv_qk_norm(x["qkv"], x["conv_state"], x["conv_weight"], x["mask"], Hk, D, Hv, D,
                                          lengths=x["lengths"], backend=KERNEL_BACKEND, init_value=init_value)
    out, state = dk.decode(q, k, v, x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], x["z"], x["weight"],
                           1e-6, x["mask"], fused=True, backend=KERNEL_BACKEND, init_value=init_value)
    return out, conv_state, state


def _one_kernel(x, Hk, Hv, D, init_value):
    return dk.decode_conv(x["qkv"], x["conv_state"], x["conv_weight"], x["mask"], x["a"], x["b"], x["A_log"],
                          x["dt_bias"], x["state"], x["z"], x["weight"], 1e-6, Hk, D, Hv, D, lengths=x["lengths"],
                          backend=KERNEL_BACKEND, init_value=init_value)


def _bitwise(got, want):
    return got.shape == want.shape and got.dtype == want.dtype and bool(mx.array_equal(got, want).item())


@needs_sim
@settings(deadline=None, max_examples=12)
@example(B=1, Hk=16, rep=2, D=128, conv=4, dtype="bfloat16", with_conv_state=True, with_state=True,
         with_mask=False, with_lengths=False, seed=0)  # Qwen3.6's per-rank head shape
@example(B=4, Hk=2, rep=2, D=64, conv=4, dtype="float16", with_conv_state=True, with_state=True,
         with_mask=True, with_lengths=True, seed=1)
@given(
    B=st.integers(1, 4), Hk=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2]), D=st.sampled_from([32, 64, 128]),
    conv=st.sampled_from([2, 4]), dtype=st.sampled_from(list(CONV_DTYPES)), with_conv_state=st.booleans(),
    with_state=st.booleans(), with_mask=st.booleans(), with_lengths=st.booleans(), seed=st.integers(0, 2**16),
)
def test_decode_conv_fused_kernel_is_bitwise_the_two_kernels(B, Hk, rep, D, conv, dtype, with_conv_state, with_state,
                                                             with_mask, with_lengths, seed):
    """deltanet_decode_conv_fused against deltanet_conv_qk_norm_decode + deltanet_decode_fused on the same
    inputs: the gated output, the new conv state and the new recurrent state bit for bit. Every output
    of both paths is poisoned, with NaN and then with a finite value, so an element either path leaves
    unwritten shows (a NaN never equals; the second poison catches an output that is legitimately NaN-free
    only by accident of the first)."""
    Hv = Hk * rep
    rng = np.random.default_rng(seed)
    x, _ = _conv_step_problem(rng, B, Hk, Hv, D, conv, CONV_DTYPES[dtype], with_conv_state, with_state, with_mask,
                              with_lengths)
    for poison in (NAN, 7.0):
        want = _two_kernels(x, Hk, Hv, D, poison)
        got = _one_kernel(x, Hk, Hv, D, poison)
        for name, g, w in zip(("out", "conv state", "recurrent state"), got, want):
            assert not bool(mx.any(mx.isnan(g)).item()), f"{name}: unwritten elements"
            assert _bitwise(g, w), (name, poison, float(mx.max(mx.abs(g.astype(mx.float32) - w.astype(mx.float32)))))
    C = x["qkv"].shape[-1]
    assert got[0].shape == (B, 1, Hv, D) and got[1].shape == (B, conv - 1, C) and got[2].shape == (B, Hv, D, D)
    # The fused in-projection's output read in place (qkv | z | b | a in one row): the same bits.
    y = mx.concatenate([x["qkv"], x["z"].reshape(B, 1, Hv * D), x["b"], x["a"]], axis=-1)
    joint = (C, C + Hv * D, C + Hv * D + Hv)
    in_place = dk.decode_conv(y, x["conv_state"], x["conv_weight"], x["mask"], None, None, x["A_log"], x["dt_bias"],
                              x["state"], None, x["weight"], 1e-6, Hk, D, Hv, D, lengths=x["lengths"],
                              backend=KERNEL_BACKEND, init_value=NAN, joint=joint)
    for name, g, w in zip(("out", "conv state", "recurrent state"), in_place, got):
        assert _bitwise(g, w), f"{name} from the fused in-projection's row"
    with pytest.raises(ValueError, match="offsets"):
        dk.decode_conv(y, x["conv_state"], x["conv_weight"], x["mask"], None, None, x["A_log"], x["dt_bias"],
                       x["state"], None, x["weight"], 1e-6, Hk, D, Hv, D, backend=KERNEL_BACKEND,
                       joint=(C, C + Hv * D + 1, C + Hv * D + Hv))


@needs_sim
@pytest.mark.skipif(KERNEL_BACKEND != "sim", reason="the race check is the simulator's")
def test_decode_conv_fused_kernel_race_check(monkeypatch):
    """The simulator's race check on the conv rows and the read-outs shared through threadgroup memory
    (the state loads come before the conv rows' barrier)."""
    monkeypatch.setenv("LILY_MSL_RACE", "1")
    rng = np.random.default_rng(3)
    x, _ = _conv_step_problem(rng, 2, 2, 4, 64, 4, mx.bfloat16, True, True, True, False)
    for g, w in zip(_one_kernel(x, 2, 4, 64, NAN), _two_kernels(x, 2, 4, 64, NAN)):
        assert _bitwise(g, w)


@needs_sim
def test_decode_conv_fused_kernel_refuses_what_it_does_not_compute():
    """Dv != Dk, several tokens, a bf16 recurrent state: the launcher refuses (the layer runs the two
    kernels there); decode_conv_unsupported_reason names each case."""
    import mlx.nn as nn

    rng = np.random.default_rng(0)
    x, conv1d = _conv_step_problem(rng, 1, 1, 2, 32, 4, mx.float32, True, True, False, False)
    assert dk.decode_conv_unsupported_reason(conv1d, x["qkv"], 1, 32, 2, 32, x["conv_state"], x["state"]) is None
    with pytest.raises(ValueError, match="Dv != Dk"):
        dk.decode_conv(x["qkv"], x["conv_state"], x["conv_weight"], None, x["a"], x["b"], x["A_log"], x["dt_bias"],
                       x["state"], x["z"], x["weight"], 1e-6, 1, 32, 1, 64, backend=KERNEL_BACKEND)
    with pytest.raises(ValueError, match="float32"):
        dk.decode_conv(x["qkv"], x["conv_state"], x["conv_weight"], None, x["a"], x["b"], x["A_log"], x["dt_bias"],
                       x["state"].astype(mx.bfloat16), x["z"], x["weight"], 1e-6, 1, 32, 2, 32, backend=KERNEL_BACKEND)
    wide = nn.Conv1d(128, 128, kernel_size=4, groups=128, bias=False)  # Hk=1, Dk=32, Hv=1, Dv=64
    assert "Dv=64 != Dk=32" in dk.decode_conv_unsupported_reason(wide, mx.zeros((1, 1, 128)), 1, 32, 1, 64)
    assert "one decode token" in dk.decode_conv_unsupported_reason(conv1d, mx.zeros((1, 2, 128)), 1, 32, 2, 32)
    assert "float32" in dk.decode_conv_unsupported_reason(conv1d, x["qkv"], 1, 32, 2, 32, None,
                                                          x["state"].astype(mx.bfloat16))
    assert "conv state" in dk.decode_conv_unsupported_reason(conv1d, x["qkv"], 1, 32, 2, 32,
                                                             x["conv_state"].astype(mx.bfloat16))


@needs_sim
@settings(deadline=None, max_examples=6)
@given(kind=st.sampled_from(["qwen3_5", "qwen3_next"]), B=st.integers(1, 3), S=st.sampled_from([1, 3]),
       padding=st.sampled_from(["none", "left", "lengths"]), seed=st.integers(0, 2**16))
def test_fused_conv_step_forward_is_bitwise_the_two_kernels(kind, B, S, padding, seed):
    """The forward (embedded-model head shape, bf16) through a cache: a prompt chunk then two decode
    steps, with fused_conv_step on and off: every output and both final states bit for bit, and the
    switch picks the kernels (one launch per decode step, or two)."""
    module = make_module(kind, 2, 4, 64, 64, dtype=mx.bfloat16, seed=seed)
    rng = np.random.default_rng(seed)
    left = [int(x) for x in rng.integers(0, S, size=B)] if padding == "left" else None
    lengths = [int(x) for x in rng.integers(1, S + 1, size=B)] if padding == "lengths" else None
    turns = [random_inputs(B, S, 32, mx.bfloat16, seed)] + [random_inputs(B, 1, 32, mx.bfloat16, seed + i)
                                                            for i in (1, 2)]
    runs = {}
    for on in (True, False):
        # the eager path (a traced decode replays without launching: tests/kernels/test_compiled_decode.py)
        state = dict(disable=["compiled_decode"] + ([] if on else ["fused_conv_step"]),
                     enable=["fused_recurrent_norm"] + (["fused_conv_step"] if on else []))
        with switches.overrides(**state), _lily_backend(KERNEL_BACKEND), record_launches() as rec:
            runs[on] = _turns(module, FORWARDS[kind], turns, left, lengths)
        decode = [n for n in rec.names() if "decode" in n and n != "deltanet_conv_qk_norm_decode"]
        per_step = ["deltanet_decode_conv_fused"] if on else ["deltanet_decode_fused"]
        assert decode == per_step * (len(turns) - (S > 1)), rec.names()
    (outs1, _, cache1), (outs0, _, cache0) = runs[True], runs[False]
    for turn, (o1, o0) in enumerate(zip(outs1, outs0)):
        assert _bitwise(o1, o0), f"turn {turn}"
    assert _bitwise(cache1[0], cache0[0]) and _bitwise(cache1[1], cache0[1])


@needs_sim
def test_decode_step_reads_the_fused_in_projection_in_place(monkeypatch):
    """With fused_in_proj, a decode step's DeltaNet kernel reads q|k|v, z, b and a from the one matmul's output
    (no split of it); the step's output and states are the bits of the same step with the projections apart."""
    from lily_mlx.core import projections

    import mlx.nn as nn

    # 8 value heads, hidden 256: MLX's CUDA matmul gave NaN for the 4-wide b / a projections of a smaller module
    # (H200, 2026-12-02), which made both sides NaN and the bitwise comparison meaningless.
    module = make_module("qwen3_5", 2, 8, 64, 64, hidden=256, dtype=mx.bfloat16, seed=5)
    nn.quantize(module, group_size=64, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    splits, matmuls = [], []
    real_split, real_matmul = projections.split, projections.matmul
    monkeypatch.setattr(projections, "split", lambda record, y: splits.append(y.shape) or real_split(record, y))
    monkeypatch.setattr(projections, "matmul", lambda record, x: matmuls.append(x.shape) or real_matmul(record, x))
    runs = {}
    for fused in (True, False):
        state = dict(disable=["compiled_decode"] + ([] if fused else ["fused_in_proj"]))
        with switches.overrides(**state), _lily_backend(KERNEL_BACKEND), record_launches() as rec:
            cache = make_cache(2)
            outs = [deltanet.qwen3_5_deltanet_forward(module, random_inputs(2, 1, 256, mx.bfloat16, 5 + i),
                                                      cache=cache) for i in range(3)]
            mx.eval(outs, cache[0], cache[1])
        assert all(mx.all(mx.isfinite(a)).item() for a in outs + [cache[0], cache[1]]), "non-finite output"
        assert rec.names() == ["deltanet_decode_conv_fused"] * 3, rec.names()
        runs[fused] = outs + [cache[0], cache[1]]
    assert matmuls == [(2, 1, 256)] * 3 and splits == []  # one matmul per step, its output never split
    for got, want in zip(runs[True], runs[False]):
        assert _bitwise(got, want)


@needs_sim
def test_fused_conv_step_falls_back_to_the_two_kernels_where_dv_differs(caplog):
    """Dv = 2 Dk: the fused kernel does not apply; the conv kernel and the decode kernel run (said once)."""
    module = make_module("qwen3_5", 1, 2, 32, 64, dtype=mx.bfloat16, seed=4)
    reset_log_once()
    with _lily_backend(KERNEL_BACKEND), caplog.at_level(logging.INFO, logger="lily_mlx"), record_launches() as rec:
        for _ in range(2):
            mx.eval(deltanet.qwen3_5_deltanet_forward(module, random_inputs(1, 1, 32, mx.bfloat16, 4),
                                                      cache=make_cache(1)))
    assert rec.names() == ["deltanet_conv_qk_norm_decode", "deltanet_decode_fused"] * 2, rec.names()
    notes = [r.getMessage() for r in caplog.records if r.name == "lily_mlx"]
    assert len(notes) == 1 and "Dv=64 != Dk=32" in notes[0], notes
    reset_log_once()


# ----------------------------------------------------------------------------------------------
# the forwards, LILY_BACKEND=sim


FORWARDS = {"qwen3_5": deltanet.qwen3_5_deltanet_forward, "qwen3_next": deltanet.qwen3_next_deltanet_forward}


@contextlib.contextmanager
def _lily_backend(name):
    saved = os.environ.get("LILY_BACKEND")
    os.environ["LILY_BACKEND"] = name
    dispatch.invalidate()
    try:
        yield
    finally:
        if saved is None:
            del os.environ["LILY_BACKEND"]
        else:
            os.environ["LILY_BACKEND"] = saved
        dispatch.invalidate()


def _turns(module, forward, turns, left_padding, lengths):
    cache = make_cache(turns[0].shape[0], left_padding=left_padding, lengths=lengths)
    outs, masks = [], []
    for i, h in enumerate(turns):
        mask = ssm_mask(h, cache)
        masks.append(mask)
        outs.append(forward(module, h, mask=mask, cache=cache))
        if i == 0 and lengths is not None:
            cache.finalize()
    mx.eval(outs, cache.cache)
    return outs, masks, cache


@needs_sim
@settings(deadline=None, max_examples=8)
@example(kind="qwen3_next", B=1, S=2, padding="left", dtype="bfloat16", register=False, fused=False, conv_step=True,
         seed=990)
@given(kind=st.sampled_from(list(FORWARDS)), B=st.integers(1, 3), S=st.sampled_from([1, 2, 7]),
       padding=st.sampled_from(["none", "left", "lengths"]), dtype=st.sampled_from(list(DTYPES)),
       register=st.booleans(), fused=st.booleans(), conv_step=st.booleans(), seed=st.integers(0, 2**16))
def test_forward_with_sim_kernels_matches_stock(kind, B, S, padding, dtype, register, fused, conv_step, seed):
    """Embedded-model head shape (Hk=2, Hv=4, Dk=Dv=64): prefill then two decode steps through a cache."""
    dt = DTYPES[dtype]
    module = make_module(kind, 2, 4, 64, 64, dtype=dt, seed=seed)
    rng = np.random.default_rng(seed)
    # Left padding (batched prompts), or per-row lengths (right padding) as the batched generator sets.
    left = [int(x) for x in rng.integers(0, S, size=B)] if padding == "left" else None
    lengths = [int(x) for x in rng.integers(1, S + 1, size=B)] if padding == "lengths" else None
    turns = [random_inputs(B, S, 32, dt, seed)] + [random_inputs(B, 1, 32, dt, seed + i) for i in (1, 2)]
    named = (("register_scan", register), ("fused_recurrent_norm", fused), ("fused_conv_step", conv_step))
    off = [n for n, on in named if not on]
    outs0, masks, cache0 = _turns(module, type(module).__call__, turns, left, lengths)
    with switches.overrides(disable=off, enable=[n for n, on in named if on]), \
            _lily_backend(KERNEL_BACKEND), record_launches() as rec:
        outs1, _, cache1 = _turns(module, FORWARDS[kind], turns, left, lengths)
    used = set(rec.names())
    scan_kernel = "deltanet_scan_staged" if register else "deltanet_scan_blockwise"  # staged_scan on
    other_scan = "deltanet_scan_blockwise" if register else "deltanet_scan_register"
    assert S == 1 or scan_kernel in used, used
    assert register or "deltanet_scan_staged" not in used, used
    assert ("deltanet_decode_fused" in used) == (fused and not conv_step), used
    assert ("deltanet_decode_conv_fused" in used) == (fused and conv_step), used  # decode: one kernel
    assert other_scan not in used or (not fused and other_scan == "deltanet_scan_register"), used  # unfused decode: T = 1 scan
    assert ("deltanet_conv_qk_norm_decode" in used) == (S > 1 or not (fused and conv_step)), used
    live = [lambda x, m=m: x if m is None else mx.where(m[..., None], x, 0) for m in masks]
    # (padded positions are discarded by the model; stock leaves a value there, the kernels 0)
    if dtype == "float32":
        for o0, o1, keep in zip(outs0, outs1, live):
            assert rel_l2(keep(o1), keep(o0)) < 1e-4
        assert rel_l2(cache1[1], cache0[1]) < 1e-5
    else:
        # bf16: stock rounds beta, the softplus, the conv output and y to bf16 on the way where the
        # kernels keep fp32, so both are judged against the same module in fp32 on the same
        # (bf16-valued) weights and inputs, by the rule of tests/ops/deltanet_cases.py (a multiple of
        # stock's own 99th-percentile error over 1,150 random cases of this test's space; per example
        # either engine may be the closer one).
        exact = make_module(kind, 2, 4, 64, 64, dtype=dt, seed=seed)
        exact.update(tree_map(lambda p: p.astype(mx.float32), exact.parameters()))
        up = [h.astype(mx.float32) for h in turns]
        outs_exact, _, cache_exact = _turns(exact, type(exact).__call__, up, left, lengths)
        for turn, (o0, o1, oe, keep) in enumerate(zip(outs0, outs1, outs_exact, live)):
            assert_as_accurate_as_stock(keep(o1), keep(o0), keep(oe), "output", f"turn {turn}")
        assert_as_accurate_as_stock(cache1[1], cache0[1], cache_exact[1], "state", "final state")
    assert same(cache1[0], cache0[0])  # the conv state is moved, not computed: exact


@needs_sim
@pytest.mark.parametrize("kind", list(FORWARDS))
def test_caches_interchange_with_stock(kind):
    """A cache filled by stock continues under lily's kernels and vice versa (same formats)."""
    module = make_module(kind, 2, 4, 64, 64, seed=9)
    prompt, steps = random_inputs(2, 5, 32, mx.float32, 9), [random_inputs(2, 1, 32, mx.float32, 10 + i) for i in range(2)]
    stock = type(module).__call__

    def run(first, then):
        cache = make_cache(2)
        first(module, prompt, cache=cache)
        outs = [then(module, h, cache=cache) for h in steps]
        mx.eval(outs, cache.cache)
        return outs, cache

    with _lily_backend(KERNEL_BACKEND):
        ref_outs, ref_cache = run(stock, stock)
        for first, then in ((stock, FORWARDS[kind]), (FORWARDS[kind], stock)):
            outs, cache = run(first, then)
            for o, o_ref in zip(outs, ref_outs):
                assert rel_l2(o, o_ref) < 1e-4
            assert cache[1].dtype == mx.float32 and rel_l2(cache[1], ref_cache[1]) < 1e-5
            assert cache[0].dtype == ref_cache[0].dtype and rel_l2(cache[0], ref_cache[0]) < 1e-5


def test_unsupported_shapes_fall_back_to_reference(monkeypatch, caplog):
    """Dk=16 has no kernel: the forward is bitwise stock (no simulator needed), launches nothing and
    says so once (one log line per op and reason, however many calls)."""
    monkeypatch.setenv("LILY_BACKEND", "sim")
    reset_log_once()
    module = make_module("qwen3_5", 1, 2, 16, 16, seed=2)
    h = random_inputs(2, 3, 32, mx.float32, 2)
    with caplog.at_level(logging.INFO, logger="lily_mlx"), record_launches() as rec:
        outs = [deltanet.qwen3_5_deltanet_forward(module, h) for _ in range(3)]
    for out in outs:
        assert same(out, type(module).__call__(module, h))
    assert rec.names() == []
    notes = [r.getMessage() for r in caplog.records if r.name == "lily_mlx"]
    assert notes and all("Dk=16" in n for n in notes), notes
    assert len(notes) == len(set(notes)), f"a reason logged more than once: {notes}"
    assert any(n.startswith("deltanet_scan:") for n in notes), notes
    assert dk.supports(mx.zeros((1, 1, 1, 16)), mx.zeros((1, 1, 2, 16))) is not None
    assert dk.supports(mx.zeros((1, 1, 16, 128), mx.bfloat16), mx.zeros((1, 1, 32, 128), mx.bfloat16)) is None
    assert dk.supports(mx.zeros((1, 1, 2, 64)), mx.zeros((1, 1, 4, 64))) is None
    reset_log_once()


@needs_sim
@pytest.mark.slow
@pytest.mark.parametrize("off", [(), ("register_scan",), ("staged_scan",), ("fused_recurrent_norm",),
                                 ("fused_conv_step",)])
def test_embedded_model_greedy_tokens_match_stock(monkeypatch, off):
    """The patched embedded model with the DeltaNet kernels simulated, in every switch state: the
    free-running greedy tokens equal stock's up to stock's first near-tie, and teacher-forced along
    stock's tokens (prefill, then one decode step per token) lily picks stock's token wherever stock's
    top-2 margin is not a near-tie."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from lily_mlx import patch as lily_patch
    from lily_mlx.models.embedded import EMBEDDED_DIR, _is_complete

    assert _is_complete(EMBEDDED_DIR), f"the embedded model is part of the tree: {EMBEDDED_DIR}"
    model, tokenizer = load(str(EMBEDDED_DIR))
    prompt = mx.array(tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the"))
    n = 32

    def greedy():
        return [int(t) for t, _ in zip((tok for tok, _ in generate_step(prompt, model, max_tokens=n)), range(n))]

    def teacher_forced_logits(tokens):
        return shared_teacher_forced_logits(model, prompt, tokens)

    stock_tokens = greedy()
    stock_logits = teacher_forced_logits(stock_tokens)
    decided, first_tie = decided_positions(stock_logits)

    # Only the DeltaNet ops go to the simulator (the other families keep their reference path).
    monkeypatch.setattr(deltanet, "op_backend", lambda name, backend=None: KERNEL_BACKEND)
    lily_patch.patch(model)
    try:
        with switches.overrides(disable=list(off) + ["compiled_decode"]), record_launches() as rec:
            lily_tokens = greedy()
            lily_choice = np.array(mx.argmax(teacher_forced_logits(stock_tokens), axis=-1))
        used = set(rec.names())
        scan = ("deltanet_scan_blockwise" if "register_scan" in off else
                "deltanet_scan_register" if "staged_scan" in off else "deltanet_scan_staged")
        assert {scan, "deltanet_gates", "deltanet_gated_norm", "deltanet_conv_qk_norm_decode"} <= used, used
        if "register_scan" in off:  # the register scan may run only as the T = 1 scan of an unfused decode
            assert "deltanet_decode_conv_fused" in used and "deltanet_scan_register" not in used, used
        fused = "fused_recurrent_norm" not in off
        assert ("deltanet_decode_fused" in used) == (fused and "fused_conv_step" in off), used
        assert ("deltanet_decode_conv_fused" in used) == (fused and "fused_conv_step" not in off), used
        assert decided.sum() >= n // 2, "the embedded model should be decided at most positions"
        assert lily_tokens[:first_tie] == stock_tokens[:first_tie]
        assert (lily_choice == np.array(stock_tokens))[decided].all()
    finally:
        lily_patch.unpatch(model)


@needs_sim
def test_embedded_model_decode_logits_identical_with_fused_conv_step(monkeypatch):
    """The patched embedded model (DeltaNet ops simulated, bf16): prefill, then teacher-forced decode
    steps; the logits of every step bit for bit the same with fused_conv_step on (one DeltaNet launch
    per layer and decode step) and off (two)."""
    from mlx_lm import load

    from lily_mlx import patch as lily_patch
    from lily_mlx.models.embedded import EMBEDDED_DIR, _is_complete

    assert _is_complete(EMBEDDED_DIR), f"the embedded model is part of the tree: {EMBEDDED_DIR}"
    model, tokenizer = load(str(EMBEDDED_DIR))
    prompt = mx.array(tokenizer.encode("def fibonacci(n):"))
    tokens = tokenizer.encode(" Return the n-th Fibonacci number.")[:8]
    n_deltanet = sum(hasattr(layer, "linear_attn") for layer in model.layers)
    monkeypatch.setattr(deltanet, "op_backend", lambda name, backend=None: KERNEL_BACKEND)
    lily_patch.patch(model)
    try:
        logits = {}
        for on in (True, False):
            with switches.overrides(disable=["compiled_decode"] + ([] if on else ["fused_conv_step"]),
                                    enable=["fused_recurrent_norm"]), \
                    record_launches() as rec:
                logits[on] = shared_teacher_forced_logits(model, prompt, tokens)
            counts = rec.counts()
            steps = len(tokens) - 1
            if on:
                assert counts.get("deltanet_decode_conv_fused") == steps * n_deltanet, counts
                assert "deltanet_decode_fused" not in counts, counts
            else:
                assert counts.get("deltanet_decode_fused") == steps * n_deltanet, counts
                assert "deltanet_decode_conv_fused" not in counts, counts
    finally:
        lily_patch.unpatch(model)
    assert logits[True].shape == (len(tokens), logits[True].shape[1])
    assert bool(mx.array_equal(logits[True], logits[False]).item())


# ----------------------------------------------------------------------------------------------
# inputs outside the kernels: refused by the launchers, reference path in the forwards


def test_launchers_refuse_vector_gates_and_non_fp32_states():
    """A vector gate g [B, T, Hv, Dk] (MLX-LM's gated_delta accepts one) or a bf16 state would give a
    wrong answer or a compile error in the kernels: the launchers refuse them with the reason."""
    rng = np.random.default_rng(0)
    q, k, v, a, b, A_log, dt_bias, state, mask = _problem(rng, 1, 3, 1, 2, 32, 32, mx.float32, True, False)
    g, beta = ref.gates(a, b, A_log, dt_bias)
    with pytest.raises(ValueError, match="one decay per head"):
        dk.scan(q, k, v, mx.broadcast_to(g[..., None], (*g.shape, 32)), beta, state, backend="sim")
    with pytest.raises(ValueError, match="float32"):
        dk.scan(q, k, v, g, beta, state.astype(mx.bfloat16), backend="sim")
    z, weight = _rand(rng, (1, 1, 2, 32), mx.float32), _rand(rng, (32,), mx.float32)
    with pytest.raises(ValueError, match="float32"):
        dk.decode(q[:, :1], k[:, :1], v[:, :1], a[:, :1], b[:, :1], A_log, dt_bias,
                  state.astype(mx.bfloat16), z, weight, 1e-6, backend="sim")


@needs_sim
@settings(max_examples=4)
@given(kind=st.sampled_from(sorted(FORWARDS)), T=st.sampled_from([1, 5]), seed=st.integers(0, 2**16))
def test_bf16_recurrent_state_takes_the_reference_path(kind, T, seed):
    """A cache holding a bf16 state (MLX-LM accepts one): the scan takes its reference (the kernels
    keep the state in fp32), so the forward on the kernel backend matches stock's module call to fp32
    rounding (the gates and conv kernels still run), the new state in stock's dtype."""
    module = make_module(kind, 1, 2, 32, 32, seed=seed)
    h = random_inputs(1, T, 32, mx.float32, seed)
    rng = np.random.default_rng(seed)
    prefilled = make_cache(1)
    prefilled[0] = _rand(rng, (1, 3, module.conv_dim), mx.float32)
    prefilled[1] = _rand(rng, (1, 2, 32, 32), mx.float32, 0.1).astype(mx.bfloat16)
    stock_cache, lily_cache = make_cache(1, prefilled=prefilled), make_cache(1, prefilled=prefilled)
    expected = type(module).__call__(module, h, cache=stock_cache)
    with _lily_backend(KERNEL_BACKEND):
        out = FORWARDS[kind](module, h, cache=lily_cache)
    assert rel_l2(out, expected) < 1e-5
    assert lily_cache[1].dtype == stock_cache[1].dtype
    assert rel_l2(lily_cache[1], stock_cache[1]) < 1e-5
