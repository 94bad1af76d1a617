"""``attention_qk_prep_from_hidden`` (switch ``fused_qkv_prep``, with the trial row GEMV): an attention layer's decode q/k/v
projection computed inside its q/k preparation kernel. Its oracle is the two launches it replaces: the row GEMV
(``linear_gemv_q4``, or ``linear_gemv_q4_rms_norm`` with the layer's input norm inside) over the fused q/k/v
projection, then ``attention_qk_prep`` reading that output in place (the values: the GEMV's rows). It must give their
bits. On the kernel test backend (the simulator in CI, ``LILY_TEST_KERNEL_BACKEND=cuda`` through the bridge), then in a
patched model."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from lily_mlx.ops.attention import kernels as ak
from lily_mlx.ops.linear import kernels as lk
from tests.kernels.kernel_backend import KERNEL_BACKEND
from tests.kernels.model_checks import one_decode_step
from tests.kernels.test_attention_qk_prep import SIM_MISSING

needs_sim = pytest.mark.skipif(SIM_MISSING is not None, reason=f"{KERNEL_BACKEND} kernels not available: {SIM_MISSING}")
KERNEL = "attention_qk_prep_from_hidden"
NAN = float("nan")


def _problem(rng, B, H, Hkv, D, hd, gs, dims, dtype, norm):
    def rand(shape, scale=1.0):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)

    wq, scales, biases = mx.quantize(rand(((2 * H + 2 * Hkv) * D, hd), 0.05), group_size=gs, bits=4, stream=mx.cpu)
    q_norm, k_norm = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)
    q_norm.weight, k_norm.weight = rand((D,), 0.2) + 1, rand((D,), 0.2) + 1
    heads = dict(n_heads=H, n_kv_heads=Hkv, q_norm=q_norm, k_norm=k_norm,
                 rope=nn.RoPE(dims, traditional=False, base=1e7))
    in_norm = (rand((hd,), 0.2) + 1, 1e-6) if norm else None
    return rand((B, 1, hd), 3.0), (wq, scales, biases), heads, in_norm


def _two_launches(x, weights, gs, heads, in_norm, offset, poison):
    """The path the kernel replaces: the GEMV over the whole q/k/v projection, then the q/k preparation in place."""
    wq, scales, biases = weights
    if in_norm is None:
        y = lk.gemv_q4(x, wq, scales, biases, gs, backend=KERNEL_BACKEND, init_value=poison)
    else:
        y = lk.gemv_q4_rms_norm(x, in_norm[0], in_norm[1], wq, scales, biases, gs, backend=KERNEL_BACKEND,
                                init_value=poison)
    queries, keys, gate = ak.qk_prep(y, None, offset=offset, backend=KERNEL_BACKEND, init_value=poison, **heads)
    B, H, Hkv = x.shape[0], heads["n_heads"], heads["n_kv_heads"]
    D = wq.shape[0] // (2 * H + 2 * Hkv)
    values = y[..., (2 * H + Hkv) * D:].reshape(B, 1, Hkv, D).transpose(0, 2, 1, 3)
    return queries, keys, values, gate


def _one_launch(x, weights, gs, heads, in_norm, offset, poison):
    return ak.qkv_prep_from_hidden(x, *weights, gs, offset=offset, in_norm=in_norm, backend=KERNEL_BACKEND,
                                   init_value=poison, **heads)


@needs_sim
@settings(deadline=None, max_examples=10)
@example(B=1, heads=(16, 2), D=256, dims=64, hd_gs=(2048, 64), norm=True, dtype="bfloat16", offset=4095,
         per_row=False, seed=0)  # Qwen3.6's shape
@given(B=st.integers(1, 3), heads=st.sampled_from([(4, 2), (2, 1), (8, 8)]), D=st.sampled_from([32, 64, 128]),
       dims=st.sampled_from([2, 16, 32]), hd_gs=st.sampled_from([(96, 32), (128, 64), (256, 128)]),
       norm=st.booleans(), dtype=st.sampled_from(["bfloat16", "float16"]), offset=st.integers(0, 5000),
       per_row=st.booleans(), seed=st.integers(0, 2**16))
def test_qkv_prep_from_hidden_is_bitwise_the_gemv_then_the_q_k_preparation(B, heads, D, dims, hd_gs, norm, dtype,
                                                                          offset, per_row, seed):
    """Queries, keys, values and gate bit for bit those of the row GEMV (with the layer's input norm inside or not)
    followed by the q/k preparation, on hypothesis shapes (head layouts, head dims, rotated dims, input widths with
    their group sizes, a scalar or a per-row offset); every output of both paths poisoned with NaN and then with a
    finite value."""
    (H, Hkv), (hd, gs) = heads, hd_gs
    rng = np.random.default_rng(seed)
    x, weights, kw, in_norm = _problem(rng, B, H, Hkv, D, hd, gs, dims, getattr(mx, dtype), norm)
    pos = mx.array((offset + np.arange(B)).astype(np.int32)) if per_row else offset
    for poison in (NAN, 7.0):
        want = _two_launches(x, weights, gs, kw, in_norm, pos, poison)
        got = _one_launch(x, weights, gs, kw, in_norm, pos, poison)
        for name, g, w in zip(("queries", "keys", "values", "gate"), got, want):
            assert not bool(mx.any(mx.isnan(g)).item()), f"{name}: unwritten elements"
            assert g.shape == w.shape and g.dtype == w.dtype and mx.array_equal(g, w).item(), (name, poison)


@needs_sim
@pytest.mark.skipif(KERNEL_BACKEND != "sim", reason="the race check is the simulator's")
def test_qkv_prep_from_hidden_race_check(monkeypatch):
    """The simulator's race check: the staged input row and the projected rows shared through threadgroup memory, the
    norm's row between one simdgroup's lanes."""
    monkeypatch.setenv("LILY_MSL_RACE", "1")
    x, weights, kw, in_norm = _problem(np.random.default_rng(3), 2, 4, 2, 64, 128, 64, 32, mx.bfloat16, True)
    for g, w in zip(_one_launch(x, weights, 64, kw, in_norm, 17, NAN), _two_launches(x, weights, 64, kw, in_norm, 17,
                                                                                        NAN)):
        assert mx.array_equal(g, w).item()


def test_qkv_prep_from_hidden_reason_refuses_what_it_does_not_compute():
    x, (wq, scales, biases), _, _ = _problem(np.random.default_rng(0), 1, 4, 2, 64, 128, 64, 32, mx.bfloat16, False)
    ok = (wq, scales, biases, 64, 4, "affine", 4, 2)
    assert ak.qkv_prep_from_hidden_reason(x, *ok) is None
    assert ak.qkv_prep_from_hidden_reason(x, *ok, mx.ones((128,), mx.bfloat16)) is None
    assert "4-bit affine" in ak.qkv_prep_from_hidden_reason(x, wq, scales, None, 64, 4, "affine", 4, 2)
    assert "one token" in ak.qkv_prep_from_hidden_reason(mx.zeros((1, 3, 128), mx.bfloat16), *ok)
    assert "blocks" in ak.qkv_prep_from_hidden_reason(x, wq, scales, biases, 64, 4, "affine", 5, 2)
    assert "activations" in ak.qkv_prep_from_hidden_reason(x.astype(mx.float32), *ok)
    assert "norm weight" in ak.qkv_prep_from_hidden_reason(x, *ok, mx.ones((64,), mx.bfloat16))


@pytest.fixture(scope="module")
def embedded_model():
    import mlx_lm

    from lily_mlx.models.embedded import EMBEDDED_DIR

    return mlx_lm.load(str(EMBEDDED_DIR))


@needs_sim
def test_a_decode_step_prepares_each_attention_layer_from_its_input(embedded_model, monkeypatch):
    """The patched embedded model, trial GEMV on: one decode step launches the kernel once per attention layer (no q/k/v
    GEMV and no separate q/k preparation there), and its logits equal, bit for bit, those of the step with switch
    fused_qkv_prep off."""
    import lily_mlx

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    monkeypatch.setenv("LILY_TRIAL_OPS", "linear_gemv")
    model, tokenizer = embedded_model
    n_attention = sum(not layer.is_linear for layer in model.layers)
    lily_mlx.patch(model)
    try:
        logits, launched = {}, {}
        for on in (True, False):
            logits[on], launched[on] = one_decode_step(model, tokenizer, "An attention layer from its input",
                                                       disable=[] if on else ["fused_qkv_prep"])
        assert launched[True].count(KERNEL) == n_attention and "attention_qk_prep" not in launched[True]
        assert KERNEL not in launched[False] and launched[False].count("attention_qk_prep") == n_attention
        assert mx.array_equal(logits[True], logits[False]).item()
    finally:
        lily_mlx.unpatch(model)


def test_qkv_prep_from_hidden_fits_the_h200_without_spills():
    """ptxas (sm_90a) at Qwen3.6's shape (16 query / 2 key-value heads of 256, 64 rotated, hidden 2048, groups of 64),
    with and without the input norm inside: its registers times 512 threads fit an SM, no spills. (Its 32-byte stack
    frame is CUDA's sine and cosine, whose slow path for large angles reduces them in local memory: attention_qk_prep
    has it too.)"""
    from lily_dev import compile_check, resource_usage
    from lily_mlx.core.kernel_registry import float32_scalar

    if compile_check.nvcc_path() is None:
        pytest.skip("nvcc (CUDA toolkit) not installed")
    H, Hkv, D, hd, gs = 16, 2, 256, 2048, 64
    spec = ak.KERNELS[KERNEL]
    bf = mx.bfloat16
    wq, scales, biases = mx.quantize(mx.zeros(((2 * H + 2 * Hkv) * D, hd), bf), group_size=gs, bits=4, stream=mx.cpu)
    for norm in (0, 1):
        inputs = [mx.zeros((1, 1, hd), bf), mx.ones((hd,), bf), float32_scalar(1e-6), wq, scales, biases,
                  mx.ones((D,), bf), mx.ones((D,), bf), mx.zeros((8,), mx.int32), float32_scalar(1e-6),
                  float32_scalar(1.0), float32_scalar(1.0), spec.pack(B=1, H=H, Hkv=Hkv)]
        template = [("T", bf), ("D", D), ("DIMS", 64), ("GS", gs), ("NORM", norm), ("Hd", hd), ("U", ak.QKV_PREP_UNROLL)]
        u = resource_usage.ptxas_usage(resource_usage._cuda_unit(spec, inputs, [bf] * 4, template))
        assert 0 < u["registers"] * 32 * ak.QKV_PREP_SIMDGROUPS <= resource_usage.REGISTERS_PER_SM, (norm, u)
        assert u["spill_stores"] == 0 and u["spill_loads"] == 0, (norm, u)
