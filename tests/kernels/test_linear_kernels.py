"""The dense 4-bit row GEMV (``kernels/linear/gemv.metal``, op ``linear_gemv``, switch ``dense_gemv``)
against an fp64 oracle, on the kernel test backend (the simulator in CI,
``LILY_TEST_KERNEL_BACKEND=cuda`` through the bridge); then its dispatch in a patched model.

The oracle: the weights dequantised by MLX on the CPU (scale * q + bias in fp32), the product in
float64. The kernel rounds once to the activation type at the end; its fp32 sums run over K in chunks
of 32 per lane, then across lanes: a random-walk error of a few fp32 units of sum(|x| |w|) per element.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lily_mlx.core import switches
from lily_mlx.core.kernel_registry import record_launches
from lily_mlx.ops.linear import kernels as lk
from lily_dev.moe_testing import simulator_problem
from tests.kernels.kernel_backend import KERNEL_BACKEND, kernel_backend_problem
from tests.kernels.model_checks import one_decode_step

SETTINGS = settings(deadline=None, max_examples=12, derandomize=True)
SIM_PROBLEM = kernel_backend_problem() or (simulator_problem() if KERNEL_BACKEND == "sim" else None)
needs_sim = pytest.mark.skipif(SIM_PROBLEM is not None, reason=str(SIM_PROBLEM))
EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -23}
GEMV = "linear_gemv_q4"


def _weights(n: int, k: int, group_size: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    w = mx.array((0.05 * rng.standard_normal((n, k))).astype(np.float32)).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=4, stream=mx.cpu)
    return wq, scales, biases


def _oracle(x: mx.array, wq, scales, biases, group_size: int):
    """(x . W^T in float64, |x| . |W|^T) with W as MLX dequantises it, on the CPU."""
    w = mx.dequantize(wq, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=4,
                      stream=mx.cpu)
    w64 = np.asarray(w, dtype=np.float64)
    x64 = np.asarray(x.astype(mx.float32), dtype=np.float64).reshape(-1, w64.shape[1])
    return x64 @ w64.T, np.abs(x64) @ np.abs(w64).T


def _assert_close(got: mx.array, want: np.ndarray, magnitude: np.ndarray, dtype: str, k: int):
    got64 = np.asarray(got.astype(mx.float32), dtype=np.float64).reshape(want.shape)
    assert not np.isnan(got64).any(), "an output element was not written (poisoned with NaN)"
    # one rounding to the activation type, plus the fp32 sums' error (a random walk over K terms)
    tol = EPS[dtype] * np.abs(want) + 4 * np.sqrt(k) * 2.0 ** -24 * magnitude + 1e-30
    bad = np.abs(got64 - want) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements off, worst {np.abs(got64 - want)[bad].max()}"


@needs_sim
@SETTINGS
@given(rows=st.sampled_from([1, 2, 3, 8, 9, 13]), k_gs=st.sampled_from([(96, 32), (128, 64), (384, 128), (1024, 64),
                                                                       (2176, 64), (2048, 32)]),
       n=st.sampled_from([1, 3, 8, 37]), dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
       seed=st.integers(0, 1000))
def test_gemv_q4_matches_the_oracle(rows, k_gs, n, dtype, seed):
    """Every output written (poisoned outputs) and within one rounding of the type of the fp64 oracle
    (MLX's own quantised matmul is not: it rounds the activation-type partial sums, e.g. 0.3086 for
    0.3067 at K = 96 in bf16, where this kernel gives 0.3066); shapes cover K tails (pieces not a
    multiple of the 64 a simdgroup steps), N not a multiple of the 8 outputs per threadgroup, and more
    rows than one threadgroup takes."""
    k, gs = k_gs
    dt = getattr(mx, dtype)
    wq, scales, biases = _weights(n, k, gs, dt, seed)
    x = mx.array(np.random.default_rng(seed + 1).standard_normal((rows, 1, k)).astype(np.float32)).astype(dt)
    got = lk.gemv_q4(x, wq, scales, biases, gs, backend=KERNEL_BACKEND, init_value=float("nan"))
    assert got.shape == (rows, 1, n) and got.dtype == dt
    want, magnitude = _oracle(x, wq, scales, biases, gs)
    _assert_close(got, want, magnitude, dtype, k)


@needs_sim
@pytest.mark.parametrize("rows", [1, 5, 8, 11])
def test_gemv_q4_row_alone_equals_row_in_batch(rows, monkeypatch):
    """Batch invariance: each row of x has the bits it has alone, whatever the batch's size and the
    other rows (rows past 8 run in a second threadgroup row with fewer valid rows)."""
    monkeypatch.setenv("LILY_MSL_RACE", "1")
    wq, scales, biases = _weights(24, 640, 64, mx.bfloat16, 3)
    x = mx.array(np.random.default_rng(9).standard_normal((rows, 1, 640)).astype(np.float32)).astype(mx.bfloat16)
    batch = lk.gemv_q4(x, wq, scales, biases, 64, backend=KERNEL_BACKEND)
    for i in {0, rows // 2, rows - 1}:
        alone = lk.gemv_q4(x[i:i + 1], wq, scales, biases, 64, backend=KERNEL_BACKEND)
        assert mx.array_equal(batch[i:i + 1], alone).item(), i


def _rms_norm_oracle(x: mx.array, norm_weight: mx.array, eps: float) -> mx.array:
    """The norm as stock computes it (MLX's rms_norm on the CPU): the GEMV with the norm inside may differ from it in
    the last bit of an element, where its own sum of squares rounds the other way."""
    return mx.fast.rms_norm(x, norm_weight, eps, stream=mx.cpu)


@needs_sim
@SETTINGS
@given(rows=st.sampled_from([1, 2, 3, 8, 9]), k_gs=st.sampled_from([(96, 32), (128, 64), (1024, 64), (2176, 64),
                                                                  (2048, 128)]),
       n=st.sampled_from([1, 5, 8, 37]), dtype=st.sampled_from(["bfloat16", "float16"]),
       scale=st.sampled_from([0.01, 1.0, 40.0]), seed=st.integers(0, 1000))
def test_gemv_q4_rms_norm_matches_the_oracle(rows, k_gs, n, dtype, scale, seed):
    """``linear_gemv_q4_rms_norm`` (switch gemv_input_norm): x normalised inside the GEMV with stock's rounding points.
    Against the fp64 product of stock's norm output: within one rounding of the type, plus one unit of the type per
    normalised element (its sum of squares is the kernel's own), plus the fp32 sums' walk; every output written
    (poisoned); inputs from tiny to large (the norm's scale must not show)."""
    k, gs = k_gs
    dt = getattr(mx, dtype)
    rng = np.random.default_rng(seed)
    wq, scales, biases = _weights(n, k, gs, dt, seed)
    x = mx.array((scale * rng.standard_normal((rows, 1, k))).astype(np.float32)).astype(dt)
    weight = mx.array((1.0 + 0.2 * rng.standard_normal(k)).astype(np.float32)).astype(dt)
    got = lk.gemv_q4_rms_norm(x, weight, 1e-6, wq, scales, biases, gs, backend=KERNEL_BACKEND,
                              init_value=float("nan"))
    assert got.shape == (rows, 1, n) and got.dtype == dt
    want, magnitude = _oracle(_rms_norm_oracle(x, weight, 1e-6), wq, scales, biases, gs)
    got64 = np.asarray(got.astype(mx.float32), dtype=np.float64).reshape(want.shape)
    assert not np.isnan(got64).any(), "an output element was not written (poisoned with NaN)"
    tol = EPS[dtype] * (np.abs(want) + magnitude) + 4 * np.sqrt(k) * 2.0 ** -24 * magnitude + 1e-30
    bad = np.abs(got64 - want) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements off, worst {np.abs(got64 - want)[bad].max()}"


@needs_sim
def test_gemv_q4_rms_norm_equals_the_gemv_of_the_same_norm():
    """Where the kernel's sum of squares rounds as MLX's (Qwen3.6's width, bf16, these draws), the norm inside the GEMV
    gives the plain GEMV's bits over stock's norm output: the normalised values are rounded at stock's points and then
    take the GEMV's own arithmetic."""
    rng = np.random.default_rng(5)
    wq, scales, biases = _weights(40, 2048, 64, mx.bfloat16, 5)
    x = mx.array(rng.standard_normal((3, 1, 2048)).astype(np.float32)).astype(mx.bfloat16)
    weight = mx.array((1.0 + 0.2 * rng.standard_normal(2048)).astype(np.float32)).astype(mx.bfloat16)
    fused = lk.gemv_q4_rms_norm(x, weight, 1e-6, wq, scales, biases, 64, backend=KERNEL_BACKEND)
    plain = lk.gemv_q4(_rms_norm_oracle(x, weight, 1e-6), wq, scales, biases, 64, backend=KERNEL_BACKEND)
    assert mx.array_equal(fused, plain).item()


@needs_sim
@pytest.mark.parametrize("rows", [1, 8, 11])
def test_gemv_q4_rms_norm_row_alone_equals_row_in_batch(rows, monkeypatch):
    """Batch invariance with the norm inside: a row's sum of squares and products are its own, whatever the batch
    (race-checked)."""
    monkeypatch.setenv("LILY_MSL_RACE", "1")
    rng = np.random.default_rng(rows)
    wq, scales, biases = _weights(24, 640, 64, mx.bfloat16, 3)
    x = mx.array(rng.standard_normal((rows, 1, 640)).astype(np.float32)).astype(mx.bfloat16)
    weight = mx.array((1.0 + 0.2 * rng.standard_normal(640)).astype(np.float32)).astype(mx.bfloat16)
    batch = lk.gemv_q4_rms_norm(x, weight, 1e-5, wq, scales, biases, 64, backend=KERNEL_BACKEND)
    for i in {0, rows // 2, rows - 1}:
        alone = lk.gemv_q4_rms_norm(x[i:i + 1], weight, 1e-5, wq, scales, biases, 64, backend=KERNEL_BACKEND)
        assert mx.array_equal(batch[i:i + 1], alone).item(), i


def test_rms_norm_reason_refuses_a_norm_it_does_not_compute():
    x = mx.zeros((1, 1, 128), mx.bfloat16)
    assert lk.rms_norm_reason(x, mx.ones((128,), mx.bfloat16)) is None
    assert "norm weight" in lk.rms_norm_reason(x, mx.ones((64,), mx.bfloat16))
    assert "norm weight" in lk.rms_norm_reason(x, mx.ones((128,), mx.float32))


def test_gemv_reason_refuses_what_it_does_not_compute():
    x = mx.zeros((1, 1, 128), mx.bfloat16)
    wq, scales, biases = _weights(8, 128, 64, mx.bfloat16, 0)
    assert lk.gemv_reason(x, wq, scales, biases, 64, 4, "affine") is None
    w8, s8, b8 = mx.quantize(mx.zeros((8, 128), mx.bfloat16), group_size=64, bits=8, stream=mx.cpu)
    assert "4-bit affine only" in lk.gemv_reason(x, w8, s8, b8, 64, 8, "affine")
    assert "4-bit affine only" in lk.gemv_reason(x, wq, scales, None, 64, 4, "affine")
    assert "group size" in lk.gemv_reason(x, wq, scales, biases, 16, 4, "affine")
    assert "K a multiple of 32" in lk.gemv_reason(mx.zeros((1, 1, 96), mx.bfloat16), wq, scales, biases, 64, 4,
                                                   "affine")
    assert "activations" in lk.gemv_reason(x.astype(mx.float32), wq, scales, biases, 64, 4, "affine")


# ----------------------------------------------------------------------------------------------
# Dispatch in a patched model


@pytest.fixture(scope="module")
def embedded_model():
    import mlx_lm

    from lily_mlx.models.embedded import EMBEDDED_DIR

    model, tokenizer = mlx_lm.load(str(EMBEDDED_DIR))
    return model, tokenizer


@needs_sim
def test_patched_quantized_linear_runs_the_gemv_for_decode_calls_only(embedded_model, monkeypatch):
    """A patched model's QuantizedLinear, its trial kernel on: a decode call (one token per sequence)
    launches the GEMV, within one rounding of the fp64 oracle; a prefill chunk, a 2-D input, training
    mode, switch dense_gemv off and LILY_REFERENCE_OPS=linear run MLX's matmul (no launch, stock's bits);
    without LILY_TRIAL_OPS no launch either; unpatch restores the class."""
    import lily_mlx
    from lily_mlx.core import dispatch

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    monkeypatch.setenv("LILY_TRIAL_OPS", "linear_gemv")  # a trial kernel on every backend
    model, _ = embedded_model
    lily_mlx.patch(model)
    try:
        proj = model.layers[0].linear_attn.out_proj
        assert type(proj).__name__ == "LilyQuantizedLinear" and isinstance(proj, nn.QuantizedLinear)
        stock_call = nn.QuantizedLinear.__call__
        k = proj.weight.shape[1] * 8
        rng = np.random.default_rng(0)
        decode = mx.array(rng.standard_normal((3, 1, k)).astype(np.float32)).astype(mx.bfloat16)
        prefill = mx.array(rng.standard_normal((1, 5, k)).astype(np.float32)).astype(mx.bfloat16)
        with record_launches() as rec:
            y = proj(decode)
            mx.eval(y)
        assert rec.names() == [GEMV]
        want, magnitude = _oracle(decode, proj.weight, proj.scales, proj.biases, proj.group_size)
        _assert_close(y, want, magnitude, "bfloat16", k)

        def no_launch(x):
            with record_launches() as rec:
                y = proj(x)
                mx.eval(y)
            assert rec.names() == []
            assert mx.array_equal(y, stock_call(proj, x)).item()

        no_launch(prefill)
        no_launch(decode.reshape(3, k))  # 2-D: its rows may be one sequence's tokens, not a decode call
        with switches.overrides(disable=["dense_gemv"]):
            no_launch(decode)
        proj.train()
        no_launch(decode)
        proj.eval()
        monkeypatch.setenv("LILY_REFERENCE_OPS", "linear")
        dispatch.invalidate()
        no_launch(decode)
        monkeypatch.delenv("LILY_REFERENCE_OPS")
        monkeypatch.delenv("LILY_TRIAL_OPS")
        lily_mlx.patch(model)  # the plan is resolved at patch time
        no_launch(decode)
    finally:
        monkeypatch.delenv("LILY_REFERENCE_OPS", raising=False)
        lily_mlx.unpatch(model)
        dispatch.invalidate()
    assert type(model.layers[0].linear_attn.out_proj) is nn.QuantizedLinear


@needs_sim
def test_fused_in_projections_and_single_pieces_give_the_same_bits(embedded_model, monkeypatch):
    """A DeltaNet layer's in-projections as one GEMV over the concatenated weight (fused_in_proj, calls
    of up to 7 rows) and each module's own GEMV (larger batches) give the same bits: each output row's
    arithmetic depends on its weight row and x alone."""
    import lily_mlx
    from lily_mlx.core import projections

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    monkeypatch.setenv("LILY_TRIAL_OPS", "linear_gemv")
    model, _ = embedded_model
    lily_mlx.patch(model)
    try:
        mixer = model.layers[0].linear_attn
        names = projections.GROUPS["GatedDeltaNet"]
        record = projections.current(mixer, names)
        assert record is not None
        x = mx.array(np.random.default_rng(2).standard_normal((2, 1, mixer.in_proj_z.weight.shape[1] * 8))
                     .astype(np.float32)).astype(mx.bfloat16)
        with record_launches() as rec:
            fused = projections.run(record, x)
            pieces = [getattr(mixer, name)(x) for name in names]
            mx.eval(fused, pieces)
        assert rec.names() == [GEMV] * (1 + len(names))
        for a, b in zip(fused, pieces):
            assert mx.array_equal(a, b).item()
    finally:
        lily_mlx.unpatch(model)


@needs_sim
def test_a_decode_step_takes_the_input_norm_inside_the_gemv(embedded_model, monkeypatch):
    """The patched embedded model, trial GEMV on, one decode step: with switch gemv_input_norm each decoder layer's
    in-projection launch is the GEMV with the norm inside (one a layer) and MLX's norm of the layer input is never
    evaluated; the step's logits are those of the step with the switch off (the norm a launch of its own) within
    bf16 noise, and its greedy token the same."""
    import lily_mlx

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    monkeypatch.setenv("LILY_TRIAL_OPS", "linear_gemv")
    model, tokenizer = embedded_model
    lily_mlx.patch(model)
    try:
        logits = {}
        for on in (True, False):
            # (the folds off: the layers' in-projections are GEMV launches of their own then)
            out, names = one_decode_step(model, tokenizer, "The decoder layer's input norm",
                                         disable=["fused_in_proj_step", "fused_qkv_prep"]
                                         + ([] if on else ["gemv_input_norm"]),
                                         enable=["gemv_input_norm"] if on else [])
            n_layers = len(model.layers)
            assert names.count("linear_gemv_q4_rms_norm") == (n_layers if on else 0), names
            logits[on] = out.astype(mx.float32)
        diff = mx.abs(logits[True] - logits[False]).max().item()
        assert diff <= 0.05 * mx.abs(logits[False]).max().item(), diff
        assert mx.array_equal(mx.argmax(logits[True], -1), mx.argmax(logits[False], -1)).item()
    finally:
        lily_mlx.unpatch(model)


def test_gemv_fits_its_threadgroup_on_the_h200_without_spills():
    """ptxas (sm_90a): the GEMV's registers times its threads fit an SM, and it neither spills nor keeps
    arrays in local memory (a stack frame: its loops must unroll), for calls of 1 to 8 rows (its
    accumulators grow with the rows a threadgroup takes)."""
    from lily_dev import compile_check, resource_usage

    if compile_check.nvcc_path() is None:
        pytest.skip("nvcc (CUDA toolkit) not installed")
    for name, (unit, threads) in resource_usage.linear_gemv_units().items():
        u = resource_usage.ptxas_usage(unit)
        assert 0 < u["registers"] * threads <= resource_usage.REGISTERS_PER_SM, (name, u)
        assert u["spill_stores"] == 0 and u["spill_loads"] == 0 and u["stack"] == 0, (name, u)
