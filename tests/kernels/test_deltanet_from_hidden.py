"""``deltanet_decode_from_hidden`` (switch ``fused_in_proj_step``, with the trial row GEMV): a DeltaNet decode step from
the layer's input, each value head computing the in-projection rows it needs by the row GEMV's arithmetic (the layer's
input norm inside with ``gemv_input_norm``), then the fused conv step. Its oracle is the two launches it replaces:
``linear_gemv_q4`` / ``linear_gemv_q4_rms_norm`` over the whole fused in-projection, then
``deltanet_decode_conv_fused`` reading that output in place; it must give their bits. On the kernel test backend (the
simulator in CI, ``LILY_TEST_KERNEL_BACKEND=cuda`` through the bridge), then in a patched model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from lily_mlx.ops.deltanet import kernels as dk
from lily_mlx.ops.linear import kernels as lk
from tests.kernels.kernel_backend import KERNEL_BACKEND
from tests.kernels.model_checks import one_decode_step
from tests.kernels.test_deltanet_kernels import NAN, SIM_MISSING, _bitwise, _conv_step_problem
from tests.ops.deltanet_cases import rand_array as _rand

needs_sim = pytest.mark.skipif(SIM_MISSING is not None, reason=f"{KERNEL_BACKEND} kernels not available: {SIM_MISSING}")
KERNEL = "deltanet_decode_from_hidden"


def _in_projection(rng, Hk, Hv, D, hd, group_size, dt):
    """A fused in-projection W [q|k|v, z, b, a; Hd] quantised as MLX does (4-bit affine)."""
    rows = 2 * Hk * D + 2 * Hv * D + 2 * Hv
    w = _rand(rng, (rows, hd), dt, 0.05)
    return mx.quantize(w, group_size=group_size, bits=4, stream=mx.cpu)


def _two_launches(x, wq, scales, biases, gs, in_norm, p, Hk, Hv, D, poison):
    """The path the kernel replaces: the row GEMV over the whole in-projection (with the input norm inside, if any),
    then the conv step reading its output in place."""
    if in_norm is None:
        y = lk.gemv_q4(x, wq, scales, biases, gs, backend=KERNEL_BACKEND, init_value=poison)
    else:
        y = lk.gemv_q4_rms_norm(x, in_norm[0], in_norm[1], wq, scales, biases, gs, backend=KERNEL_BACKEND,
                                init_value=poison)
    C = 2 * Hk * D + Hv * D
    return dk.decode_conv(y, p["conv_state"], p["conv_weight"], p["mask"], None, None, p["A_log"], p["dt_bias"],
                          p["state"], None, p["weight"], 1e-6, Hk, D, Hv, D, lengths=p["lengths"],
                          backend=KERNEL_BACKEND, init_value=poison, joint=(C, C + Hv * D, C + Hv * D + Hv))


def _one_launch(x, wq, scales, biases, gs, in_norm, p, Hk, Hv, D, poison):
    return dk.decode_from_hidden(x, wq, scales, biases, gs, p["conv_state"], p["conv_weight"], p["mask"], p["A_log"],
                                 p["dt_bias"], p["state"], p["weight"], 1e-6, Hk, D, Hv, D, in_norm=in_norm,
                                 lengths=p["lengths"], backend=KERNEL_BACKEND, init_value=poison)


@needs_sim
@settings(deadline=None, max_examples=10)
@example(B=1, Hk=16, rep=2, D=128, hd_gs=(2048, 64), norm=True, dtype="bfloat16", with_conv_state=True,
         with_state=True, with_mask=False, with_lengths=False, seed=0)  # Qwen3.6's shape
@given(B=st.integers(1, 3), Hk=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2]), D=st.sampled_from([32, 64, 128]),
       hd_gs=st.sampled_from([(96, 32), (128, 64), (256, 128), (320, 64)]), norm=st.booleans(),
       dtype=st.sampled_from(["bfloat16", "float16"]), with_conv_state=st.booleans(), with_state=st.booleans(),
       with_mask=st.booleans(), with_lengths=st.booleans(), seed=st.integers(0, 2**16))
def test_decode_from_hidden_is_bitwise_the_gemv_then_the_conv_step(B, Hk, rep, D, hd_gs, norm, dtype, with_conv_state,
                                                                   with_state, with_mask, with_lengths, seed):
    """The gated output, the new conv state and the new recurrent state bit for bit those of the row GEMV (with the
    layer's input norm inside or not) followed by the conv-step kernel, on hypothesis shapes (input widths with a
    tail of pieces, several batch rows, masks, conv-state lengths); every output of both paths poisoned with NaN and
    then with a finite value, so an element either leaves unwritten shows."""
    Hv, (hd, gs) = Hk * rep, hd_gs
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(seed)
    p, _ = _conv_step_problem(rng, B, Hk, Hv, D, 4, dt, with_conv_state, with_state, with_mask, with_lengths)
    wq, scales, biases = _in_projection(rng, Hk, Hv, D, hd, gs, dt)
    x = _rand(rng, (B, 1, hd), dt, 3.0)
    in_norm = (_rand(rng, (hd,), dt, 0.2) + 1, 1e-6) if norm else None
    for poison in (NAN, 7.0):
        want = _two_launches(x, wq, scales, biases, gs, in_norm, p, Hk, Hv, D, poison)
        got = _one_launch(x, wq, scales, biases, gs, in_norm, p, Hk, Hv, D, poison)
        for name, g, w in zip(("out", "conv state", "recurrent state"), got, want):
            assert not bool(mx.any(mx.isnan(g)).item()), f"{name}: unwritten elements"
            assert _bitwise(g, w), (name, poison)


@needs_sim
@pytest.mark.skipif(KERNEL_BACKEND != "sim", reason="the race check is the simulator's")
def test_decode_from_hidden_race_check(monkeypatch):
    """The simulator's race check: the projected rows shared through threadgroup memory (one barrier), then the conv
    step's own."""
    monkeypatch.setenv("LILY_MSL_RACE", "1")
    rng = np.random.default_rng(4)
    p, _ = _conv_step_problem(rng, 2, 2, 4, 32, 4, mx.bfloat16, True, True, True, False)
    wq, scales, biases = _in_projection(rng, 2, 4, 32, 128, 64, mx.bfloat16)
    x = _rand(rng, (2, 1, 128), mx.bfloat16)
    in_norm = (_rand(rng, (128,), mx.bfloat16, 0.2) + 1, 1e-6)
    for g, w in zip(_one_launch(x, wq, scales, biases, 64, in_norm, p, 2, 4, 32, NAN),
                    _two_launches(x, wq, scales, biases, 64, in_norm, p, 2, 4, 32, NAN)):
        assert _bitwise(g, w)


def test_decode_from_hidden_reason_refuses_what_it_does_not_compute():
    rng = np.random.default_rng(0)
    wq, scales, biases = _in_projection(rng, 2, 4, 32, 128, 64, mx.bfloat16)
    x = mx.zeros((1, 1, 128), mx.bfloat16)
    ok = (wq, scales, biases, 64, 4, "affine", 2, 32, 4, 32)
    assert dk.decode_from_hidden_reason(x, *ok) is None
    assert dk.decode_from_hidden_reason(x, *ok, mx.ones((128,), mx.bfloat16)) is None
    assert "4-bit affine" in dk.decode_from_hidden_reason(x, wq, scales, None, 64, 4, "affine", 2, 32, 4, 32)
    assert "4-bit affine" in dk.decode_from_hidden_reason(x, wq, scales, biases, 16, 4, "affine", 2, 32, 4, 32)
    assert "one token" in dk.decode_from_hidden_reason(mx.zeros((1, 2, 128), mx.bfloat16), *ok)
    assert "rows" in dk.decode_from_hidden_reason(x, wq, scales, biases, 64, 4, "affine", 2, 32, 2, 32)
    assert "K % 32" in dk.decode_from_hidden_reason(mx.zeros((1, 1, 96), mx.bfloat16), *ok)
    assert "activations" in dk.decode_from_hidden_reason(x.astype(mx.float32), *ok)
    assert "norm weight" in dk.decode_from_hidden_reason(x, *ok, mx.ones((64,), mx.bfloat16))
    wide = mx.zeros((1, 1, 8192 + 32), mx.bfloat16)
    wq_wide, s_wide, b_wide = _in_projection(rng, 2, 4, 32, 8192 + 32, 32, mx.bfloat16)
    assert "hidden size" in dk.decode_from_hidden_reason(wide, wq_wide, s_wide, b_wide, 32, 4, "affine", 2, 32, 4, 32)


# ----------------------------------------------------------------------------------------------
# In a patched model


@pytest.fixture(scope="module")
def embedded_model():
    import mlx_lm

    from lily_mlx.models.embedded import EMBEDDED_DIR

    return mlx_lm.load(str(EMBEDDED_DIR))


@needs_sim
def test_a_decode_step_takes_each_deltanet_layer_from_its_input(embedded_model, monkeypatch):
    """The patched embedded model, trial GEMV on: one decode step launches the kernel once per DeltaNet layer (and no
    in-projection GEMV there), and its logits equal, bit for bit, those of the step with switch fused_in_proj_step off
    (the in-projection's GEMV with the input norm inside, then the conv step), whose launches it replaces."""
    import lily_mlx

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    monkeypatch.setenv("LILY_TRIAL_OPS", "linear_gemv")
    model, tokenizer = embedded_model
    n_deltanet = sum(layer.is_linear for layer in model.layers)
    lily_mlx.patch(model)
    try:
        logits, launched = {}, {}
        for on in (True, False):
            logits[on], launched[on] = one_decode_step(model, tokenizer, "A DeltaNet layer from its input",
                                                       disable=[] if on else ["fused_in_proj_step"],
                                                       enable=["gemv_input_norm"]
                                                       + (["fused_in_proj_step"] if on else []))
        assert launched[True].count(KERNEL) == n_deltanet, launched[True]
        assert KERNEL not in launched[False]
        assert (launched[False].count("linear_gemv_q4_rms_norm") - launched[True].count("linear_gemv_q4_rms_norm")
                == n_deltanet)
        assert mx.array_equal(logits[True], logits[False]).item()
    finally:
        lily_mlx.unpatch(model)


def test_decode_from_hidden_fits_the_h200_without_spills():
    """ptxas (sm_90a) at Qwen3.6's shape (16 key / 32 value heads of 128, hidden 2048, groups of 64), with and without
    the input norm inside: its registers times 512 threads fit an SM, no spills, no stack frame."""
    from lily_dev import compile_check, resource_usage
    from lily_mlx.core.kernel_registry import float32_scalar

    if compile_check.nvcc_path() is None:
        pytest.skip("nvcc (CUDA toolkit) not installed")
    Hk, Hv, D, hd, gs, K = 16, 32, 128, 2048, 64, 4
    C = 2 * Hk * D + Hv * D
    spec = dk.KERNELS[KERNEL]
    wq, scales, biases = mx.quantize(mx.zeros((C + Hv * D + 2 * Hv, hd), mx.bfloat16), group_size=gs, bits=4,
                                     stream=mx.cpu)
    bf = mx.bfloat16
    for norm in (0, 1):
        inputs = [mx.zeros((1, 1, hd), bf), mx.ones((hd,), bf), float32_scalar(1e-6), wq, scales, biases,
                  mx.zeros((1, K - 1, C), bf), mx.zeros((C, K, 1), bf), mx.array([True] * 8), mx.zeros((8,), mx.int32),
                  mx.zeros((Hv,), mx.float32), mx.zeros((Hv,), mx.float32), mx.zeros((1, Hv, D, D), mx.float32),
                  mx.ones((D,), bf), float32_scalar(1e-6), float32_scalar(1e-6),
                  spec.pack(B=1, Hk=Hk, Hv=Hv, C=C, has_conv_state=1, has_state=1, has_mask=0, has_lengths=0)]
        template = [("InT", bf), ("Dk", D), ("Dv", D), ("K", K), ("PARTIALS", dk.ROW_SUM_PARTIALS), ("GS", gs),
                    ("NORM", norm), ("Hd", hd), ("U", dk.FROM_HIDDEN_UNROLL)]
        unit = resource_usage._cuda_unit(spec, inputs, [bf, mx.float32, bf], template)
        u = resource_usage.ptxas_usage(unit)
        threads = 32 * D // dk.rows_per_simdgroup(D)
        assert 0 < u["registers"] * threads <= resource_usage.REGISTERS_PER_SM, (norm, u)
        assert u["spill_stores"] == 0 and u["spill_loads"] == 0 and u["stack"] == 0, (norm, u)
