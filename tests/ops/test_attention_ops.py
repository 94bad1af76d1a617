"""Attention ops vs plain math (numpy, float64): q/k preparation, prefill/decode attention over a
cache (GQA, masks incl. batched left padding), quantized KV, the fixed-block algorithm, the
long-context path, and the op registry."""

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, strategies as st
from mlx_lm.models.base import create_causal_mask

from lily_mlx.core import switches
from lily_mlx.ops import OPS, op_backend
from lily_mlx.ops.attention import kernels as ak
from lily_mlx.ops.attention import layer as att
from lily_mlx.ops.attention import reference as attref


def np64(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


# --- q/k preparation ----------------------------------------------------------------------------

def rms_norm_math(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_math(x, dims, base, positions):
    """Non-traditional partial RoPE: rotate (x[i], x[i + dims/2]) for i < dims/2, rest unchanged.
    x: [B, heads, L, D]; positions: [B, L]."""
    half = dims // 2
    inv_freq = base ** (-np.arange(half) * 2.0 / dims)  # [half]
    theta = positions[:, None, :, None] * inv_freq  # [B, 1, L, half]
    cos, sin = np.cos(theta), np.sin(theta)
    x1, x2 = x[..., :half], x[..., half:dims]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:dims] = x1 * sin + x2 * cos
    return out


@given(
    batch=st.integers(1, 3), length=st.integers(1, 7), n_kv=st.sampled_from([1, 2]),
    gqa=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([16, 32, 64]),
    partial=st.sampled_from([0.25, 0.5, 1.0]), per_row_offset=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_qk_prep_vs_math(batch, length, n_kv, gqa, head_dim, partial, per_row_offset, seed):
    H, D = n_kv * gqa, head_dim
    rng = np.random.default_rng(seed)
    q_out = rng.standard_normal((batch, length, H * 2 * D)).astype(np.float32)
    k_out = rng.standard_normal((batch, length, n_kv * D)).astype(np.float32)
    v_out = rng.standard_normal((batch, length, n_kv * D)).astype(np.float32)
    q_norm, k_norm = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)
    q_norm.weight = mx.array(1 + 0.1 * rng.standard_normal(D).astype(np.float32))
    k_norm.weight = mx.array(1 + 0.1 * rng.standard_normal(D).astype(np.float32))
    dims = int(D * partial)
    rope = nn.RoPE(dims, traditional=False, base=10000.0)
    if per_row_offset:  # BatchKVCache: one offset per sequence (negative while in left padding)
        offsets = rng.integers(-3, 40, size=batch)
        offset = mx.array(offsets.astype(np.int32))
    else:
        offsets = np.full(batch, int(rng.integers(0, 40)))
        offset = int(offsets[0])

    q, k, v, gate = att.qk_prep(mx.array(q_out), mx.array(k_out), mx.array(v_out), n_heads=H,
                                n_kv_heads=n_kv, q_norm=q_norm, k_norm=k_norm, rope=rope,
                                offset=offset)

    positions = offsets[:, None] + np.arange(length)[None]  # [B, L]
    per_head = q_out.astype(np.float64).reshape(batch, length, H, 2 * D)
    q_ref = rms_norm_math(per_head[..., :D], np64(q_norm.weight), 1e-6).transpose(0, 2, 1, 3)
    k_ref = rms_norm_math(k_out.astype(np.float64).reshape(batch, length, n_kv, D),
                          np64(k_norm.weight), 1e-6).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(np64(q), rope_math(q_ref, dims, 10000.0, positions), atol=2e-4)
    np.testing.assert_allclose(np64(k), rope_math(k_ref, dims, 10000.0, positions), atol=2e-4)
    np.testing.assert_array_equal(np64(v), v_out.reshape(batch, length, n_kv, D).transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(np64(gate), per_head[..., D:].reshape(batch, length, H * D))


# --- attention over a cache ----------------------------------------------------------------------

def attention_math(q, k, v, scale, mask):
    """softmax(q k^T * scale + mask) v in numpy; query head h attends to KV head h // (H / Hkv).
    mask: None, bool (True = visible) or additive, broadcastable to [B, H, L, S]."""
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    q = q.reshape(B, Hkv, H // Hkv, L, D)
    s = q @ k[:, :, None].swapaxes(-1, -2) * scale  # [B, Hkv, groups, L, S]
    if mask is not None:
        mask = np.broadcast_to(mask, (B, H, L, S)).reshape(s.shape)
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    with np.errstate(invalid="ignore"):  # fully masked rows give NaN; callers skip them
        s = s - s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        out = (p / p.sum(axis=-1, keepdims=True)) @ v[:, :, None]
    return out.reshape(B, H, L, D)


@st.composite
def attention_cases(draw):
    batch = draw(st.integers(1, 3))
    length = draw(st.sampled_from([1, 1, 2, 3, 5, 8]))  # decode rows often
    cached = draw(st.integers(0, 40))
    mask_kind = draw(st.sampled_from(["none", "causal", "bool", "left_padding", "additive"]))
    if mask_kind == "none" and length > 1:
        mask_kind = "causal"
    return dict(
        batch=batch, length=length, cached=cached, mask_kind=mask_kind,
        n_kv=draw(st.sampled_from([1, 2])), gqa=draw(st.sampled_from([1, 2, 4, 8])),
        head_dim=draw(st.sampled_from([16, 64, 128])),
        left_padding=[draw(st.integers(0, cached + length - 1)) for _ in range(batch)],
        seed=draw(st.integers(0, 2**16)),
    )


def make_attention_inputs(case):
    B, L, D = case["batch"], case["length"], case["head_dim"]
    H, Hkv, S = case["n_kv"] * case["gqa"], case["n_kv"], case["cached"] + case["length"]
    rng = np.random.default_rng(case["seed"])
    q = rng.standard_normal((B, H, L, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    kind = case["mask_kind"]
    valid = np.ones((B, 1, L), dtype=bool)  # query rows with at least one visible key
    if kind == "none":
        mask = mask_np = None
    elif kind == "causal":
        mask = "causal"
        mask_np = np.asarray(create_causal_mask(L, case["cached"]))
    elif kind == "bool":  # an arbitrary bool mask; keep every row's last key visible
        mask_np = rng.random((B, 1, L, S)) < 0.7
        mask_np[..., -1] = True
        mask = mx.array(mask_np)
    elif kind == "left_padding":  # what BatchKVCache.make_mask gives mlx_lm's BatchGenerator
        mask = create_causal_mask(L, case["cached"], left_padding=mx.array(case["left_padding"]))
        mask_np = np.asarray(mask)
        valid = mask_np.any(axis=-1)[:, :, :]  # rows entirely in the padding have nothing to see
    else:  # additive float mask
        mask_np = (rng.standard_normal((B, 1, L, S)) * 2).astype(np.float32)
        mask = mx.array(mask_np)
    return q, k, v, mask, mask_np, valid


@given(attention_cases())
def test_attention_vs_math(case):
    q, k, v, mask, mask_np, valid = make_attention_inputs(case)
    scale = 1 / math.sqrt(case["head_dim"])
    out = att.attention(mx.array(q), mx.array(k), mx.array(v), scale=scale, mask=mask)
    ref = attention_math(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), scale,
                         mask_np)
    rows = np.broadcast_to(valid[..., None], ref.shape)  # [B, H, L, D]
    np.testing.assert_allclose(np64(out)[rows], ref[rows], atol=2e-5, rtol=1e-4)


@given(attention_cases(), st.sampled_from([1, 3, 4, 16, 64]))
def test_blockwise_attention_vs_math(case, block_size):
    q, k, v, mask, mask_np, valid = make_attention_inputs(case)
    if isinstance(mask, str):
        mask = mx.array(mask_np)
    scale = 1 / math.sqrt(case["head_dim"])
    out = attref.blockwise_attention(mx.array(q), mx.array(k), mx.array(v), scale=scale, mask=mask,
                                  block_size=block_size)
    ref = attention_math(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), scale,
                         mask_np)
    rows = np.broadcast_to(valid[..., None], ref.shape)
    np.testing.assert_allclose(np64(out)[rows], ref[rows], atol=2e-5, rtol=1e-4)


@given(batch=st.integers(1, 2), length=st.sampled_from([1, 3]), cached=st.integers(0, 20),
       gqa=st.sampled_from([1, 2, 4, 8]), bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_quantized_kv_attention_vs_math_on_dequantized_cache(batch, length, cached, gqa, bits, seed):
    """Quantized KV caches hand out (packed, scales, biases); stock attends over them directly.
    Oracle: plain math over the dequantized cache."""
    from mlx_lm.models.cache import QuantizedKVCache

    D, Hkv, S = 64, 2, cached + length
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, Hkv * gqa, length, D)).astype(np.float32)
    k = mx.array(rng.standard_normal((batch, Hkv, S, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((batch, Hkv, S, D)).astype(np.float32))
    cache = QuantizedKVCache(group_size=32, bits=bits)
    qk, qv = cache.update_and_fetch(k, v)
    mask = "causal" if length > 1 else None
    out = att.attention(mx.array(q), qk, qv, scale=D**-0.5, mask=mask, cache=cache)
    k_dq = np64(mx.dequantize(*qk, group_size=32, bits=bits))
    v_dq = np64(mx.dequantize(*qv, group_size=32, bits=bits))
    mask_np = np.asarray(create_causal_mask(length, cached)) if length > 1 else None
    ref = attention_math(q.astype(np.float64), k_dq, v_dq, D**-0.5, mask_np)
    np.testing.assert_allclose(np64(out), ref, atol=1e-4, rtol=1e-3)


# --- long-context path ---------------------------------------------------------------------------

@switches.overrides(enable=["fixed_block_attention"])  # whatever LILY_DISABLE says
def test_decode_path_rules():
    """The write-up's rule, on every backend: the row's context >= 32K, D = 256, G = 8."""
    n = ak.FIXED_BLOCK_MIN_CONTEXT
    assert att.decode_path(n, 256, 8) == "fixed_block"
    assert att.decode_path(n - 1, 256, 8) == "ordinary"
    assert att.decode_path(n, 128, 8) == "ordinary"
    assert att.decode_path(n, 256, 4) == "ordinary"
    with switches.overrides(disable=["fixed_block_attention"]):
        assert att.decode_path(4 * n, 256, 8) == "ordinary"


@switches.overrides(enable=["fixed_block_attention"])
def test_long_context_decode_vs_blockwise_and_math(monkeypatch):
    """A real 32K-token decode step at the Qwen3.6 attention shape (head dim 256, 8 query heads per
    KV head) goes through the long-context op; it agrees with the fixed-block algorithm and math."""
    S, D, H, Hkv = ak.FIXED_BLOCK_MIN_CONTEXT, 256, 8, 1
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, H, 1, D)).astype(np.float32)
    k = rng.standard_normal((1, Hkv, S, D)).astype(np.float32)
    v = rng.standard_normal((1, Hkv, S, D)).astype(np.float32)
    calls = []
    real = att.long_context_attention
    monkeypatch.setattr(att, "long_context_attention",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = att.attention(mx.array(q), mx.array(k), mx.array(v), scale=D**-0.5)
    assert calls, "a 32K decode step at head dim 256, GQA 8 must take the long-context op"
    blocks = attref.blockwise_attention(mx.array(q), mx.array(k), mx.array(v), scale=D**-0.5)
    ref = attention_math(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                         D**-0.5, None)
    np.testing.assert_allclose(np64(out), ref, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(np64(blocks), ref, atol=1e-5, rtol=1e-4)


# --- registry ------------------------------------------------------------------------------------

def test_ops_registered_with_their_switches():
    ops = {name: op for name, op in OPS.items() if op.family == "attention"}
    assert set(ops) == {"attention_qk_prep", "attention_prefill", "attention_decode", "attention_decode_long",
                        "attention_decode_batch", "attention_decode_quantized", "attention_qkv_proj"}
    assert ops["attention_qk_prep"].switches == ("fused_qk_prep",)
    assert set(ops["attention_decode"].switches) == {"coalesced_kv", "gqa_packing"}
    assert "fixed_block_attention" in ops["attention_decode_long"].switches
    used = {s for op in ops.values() for s in op.switches}
    assert used == {n for n, s in switches.SWITCHES.items() if s.family == "attention"}
    # A GPU backend once the kernel tests pass there and the kernel wins (the fixed-block kernels on the
    # H200; the one-pass kernel loses to stock's SDPA on a large GPU; the prefill kernel is not yet timed).
    with_kernels = {"attention_decode": frozenset({"sim"}), "attention_decode_long": frozenset({"sim", "cuda"}),
                    "attention_prefill": frozenset({"sim"}), "attention_qk_prep": frozenset({"sim", "cuda", "metal"}),
                    "attention_decode_quantized": frozenset({"sim", "cuda"}),  # timed on an H100; Metal: trial
                    "attention_decode_batch": frozenset({"sim", "cuda"}),  # timed on an H100; Metal: trial
                    # MLX's own quantised matmul over concatenated weights: every backend (same bits)
                    "attention_qkv_proj": frozenset({"metal", "sim", "cuda"})}
    for op in ops.values():
        assert op.kernel_backends == with_kernels.get(op.name, frozenset())
        # Every other GPU backend has the kernel as a trial kernel (on where a tune profile measured it faster).
        assert op.trial_backends == frozenset({"metal", "cuda"}) - op.kernel_backends
        for backend in ("metal", "cuda", "sim", "reference"):
            expected = backend if backend in op.kernel_backends else "reference"  # no profile: trials off
            assert op_backend(op.name, backend) == expected
