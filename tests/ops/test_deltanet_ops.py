"""Gated DeltaNet references vs stock MLX-LM: bitwise, on the reference backend.

Op level: our scan / gates / q-k norm / gated norm against ``mlx_lm.models.gated_delta`` and the stock
norm module. Module level: the lily forwards against the stock ``__call__`` of the same instance,
through prefill + decode with prompt caches, left padding and per-row lengths as MLX-LM's batched
generator passes them.
"""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mlx_lm.models import gated_delta as stock
from mlx_lm.models.qwen3_next import Qwen3NextRMSNormGated

from lily_mlx.ops import OPS, deltanet, op_backend
from lily_mlx.ops.deltanet import reference as ref
from tests.ops.deltanet_cases import make_cache, make_module, random_inputs, same, ssm_mask
from tests.ops.deltanet_cases import rand_array as _rand

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "reference")


def _mask(rng, B, T):
    """A left-padding x length mask like ``ArraysCache.make_mask``."""
    pos = np.arange(T)
    left = rng.integers(0, T, size=B)
    length = rng.integers(1, T + 1, size=B)
    return mx.array((pos[None] >= left[:, None]) & (pos[None] < np.maximum(length, left + 1)[:, None]))


def test_ops_registered():
    for name in ("deltanet_conv1d_silu", "deltanet_qk_norm", "deltanet_gates", "deltanet_scan",
                 "deltanet_decode", "deltanet_gated_norm"):
        assert OPS[name].family == "deltanet"
        assert op_backend(name) == "reference"
    assert OPS["deltanet_scan"].switches == ("register_scan", "staged_scan")
    assert OPS["deltanet_decode"].switches == ("fused_recurrent_norm", "fused_conv_step")


@settings(deadline=None, max_examples=25)
@given(
    B=st.integers(1, 3), T=st.sampled_from([1, 2, 3, 7, 9]), Hk=st.sampled_from([1, 2]),
    rep=st.sampled_from([1, 2]), Dk=st.sampled_from([8, 32]), Dv=st.sampled_from([8, 16]),
    dtype=st.sampled_from(list(DTYPES)), with_state=st.booleans(), with_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_scan_and_gates_match_stock(B, T, Hk, rep, Dk, Dv, dtype, with_state, with_mask, seed):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    Hv = Hk * rep
    q_raw, k_raw = _rand(rng, (B, T, Hk, Dk), dt), _rand(rng, (B, T, Hk, Dk), dt)
    q, k = ref.qk_norm(q_raw, k_raw, Dk)
    q0, k0 = stock.normalize_qk(q_raw, k_raw, inv_scale=Dk**-0.5, eps=1e-6)
    assert same(q, q0) and same(k, k0)
    v = _rand(rng, (B, T, Hv, Dv), dt)
    a, b = _rand(rng, (B, T, Hv), dt), _rand(rng, (B, T, Hv), dt)
    A_log = mx.array(np.log(rng.uniform(0.5, 16, Hv)).astype(np.float32)).astype(dt)
    dt_bias = _rand(rng, (Hv,), dt)
    state = _rand(rng, (B, Hv, Dv, Dk), mx.float32, 0.1) if with_state else None
    mask = _mask(rng, B, T) if with_mask else None

    g, beta = ref.gates(a, b, A_log, dt_bias)
    assert same(g, stock.compute_g(A_log, a, dt_bias))
    assert same(beta, mx.sigmoid(b))

    y, s = ref.scan_ops(q, k, v, g, beta, state, mask)
    y0, s0 = stock.gated_delta_ops(q, k, v, g, beta, state, mask)
    assert same(y, y0) and same(s, s0)
    # The whole update as stock dispatches it on this machine.
    y1, s1 = stock.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask)
    g2, beta2 = ref.gates(a, b, A_log, dt_bias)
    y2, s2 = ref.scan_stock(q, k, v, g2, beta2, state, mask)
    assert same(y1, y2) and same(s1, s2)


@settings(deadline=None, max_examples=15)
@given(B=st.integers(1, 3), S=st.sampled_from([1, 5]), H=st.sampled_from([1, 2]), D=st.sampled_from([8, 64]),
       dtype=st.sampled_from(list(DTYPES)), seed=st.integers(0, 2**16))
def test_gated_norm_matches_stock_module(B, S, H, D, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    norm = Qwen3NextRMSNormGated(D, eps=1e-6)
    norm.weight = _rand(rng, (D,), dt)
    out, z = _rand(rng, (B, S, H, D), dt), _rand(rng, (B, S, H, D), dt)
    assert same(ref.gated_rms_norm(out, z, norm.weight, norm.eps), norm(out, z))


def _run_turns(module, forward, inputs_per_turn, left_padding, lengths):
    """Prefill then decode through one cache; returns outputs and the final cache arrays."""
    B = inputs_per_turn[0].shape[0]
    cache = make_cache(B, left_padding=left_padding, lengths=lengths)
    outs = []
    for i, h in enumerate(inputs_per_turn):
        mask = ssm_mask(h, cache)
        outs.append(forward(module, h, mask=mask, cache=cache))
        if i == 0 and lengths is not None:
            cache.finalize()  # as the batched generator does after the padded prompt
    mx.eval(outs, cache.cache)
    return outs, cache


FORWARDS = {"qwen3_5": deltanet.qwen3_5_deltanet_forward, "qwen3_next": deltanet.qwen3_next_deltanet_forward}


@settings(deadline=None, max_examples=20)
@given(
    kind=st.sampled_from(list(FORWARDS)), B=st.integers(1, 3), S=st.sampled_from([1, 2, 5, 7]),
    Hk=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2]), Dk=st.sampled_from([8, 32]),
    Dv=st.sampled_from([8, 16]), dtype=st.sampled_from(list(DTYPES)),
    padding=st.sampled_from(["none", "left", "lengths", "both"]), decode_steps=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_forward_is_stock_on_reference_backend(kind, B, S, Hk, rep, Dk, Dv, dtype, padding, decode_steps, seed):
    dt = DTYPES[dtype]
    module = make_module(kind, Hk, Hk * rep, Dk, Dv, dtype=dt, seed=seed)
    rng = np.random.default_rng(seed)
    left = [int(x) for x in rng.integers(0, S, size=B)] if padding in ("left", "both") else None
    lengths = [int(x) for x in rng.integers(1, S + 1, size=B)] if padding in ("lengths", "both") else None
    turns = [random_inputs(B, S, 32, dt, seed)] + [random_inputs(B, 1, 32, dt, seed + i + 1) for i in range(decode_steps)]

    stock_forward = type(module).__call__
    outs0, cache0 = _run_turns(module, stock_forward, turns, left, lengths)
    outs1, cache1 = _run_turns(module, FORWARDS[kind], turns, left, lengths)
    for o0, o1 in zip(outs0, outs1):
        assert same(o1, o0)
    assert same(cache1[0], cache0[0]) and same(cache1[1], cache0[1])
    assert cache1[1].dtype == mx.float32 and cache1[1].shape == (B, Hk * rep, Dv, Dk)


@pytest.mark.parametrize("kind", list(FORWARDS))
def test_forward_without_cache_and_training_mode(kind):
    module = make_module(kind, 2, 4, 32, 16, seed=3)
    h = random_inputs(2, 6, 32, mx.float32, 3)
    assert same(FORWARDS[kind](module, h), type(module).__call__(module, h))
    module.train()
    assert same(FORWARDS[kind](module, h), type(module).__call__(module, h))


def test_forward_reads_per_rank_head_counts():
    """Sharding divides the head counts on the instance; the forward must follow them, as stock does."""
    module = make_module("qwen3_5", 2, 4, 32, 16, seed=5)
    # Emulate one rank of a 2-way shard by hand: keep the first half of every head-indexed weight.
    kd, vd = module.key_dim // 2, module.value_dim // 2
    w = module.in_proj_qkv.weight
    module.in_proj_qkv.weight = mx.concatenate([w[:kd], w[module.key_dim:module.key_dim + kd],
                                               w[2 * module.key_dim:2 * module.key_dim + vd]])
    cw = module.conv1d.weight
    module.conv1d.weight = mx.concatenate([cw[:kd], cw[module.key_dim:module.key_dim + kd],
                                          cw[2 * module.key_dim:2 * module.key_dim + vd]])
    module.conv1d.groups //= 2
    module.in_proj_z.weight = module.in_proj_z.weight[:vd]
    module.in_proj_a.weight = module.in_proj_a.weight[:2]
    module.in_proj_b.weight = module.in_proj_b.weight[:2]
    module.dt_bias, module.A_log = module.dt_bias[:2], module.A_log[:2]
    module.out_proj.weight = module.out_proj.weight[:, :vd]
    module.num_k_heads //= 2
    module.num_v_heads //= 2
    module.key_dim, module.value_dim, module.conv_dim = kd, vd, module.conv_dim // 2
    h = random_inputs(1, 3, 32, mx.float32, 5)
    assert same(deltanet.qwen3_5_deltanet_forward(module, h), type(module).__call__(module, h))


def test_microbench_cases_for_the_bench_harness():
    """(name, run_once, bytes, flops) at Qwen3.6 shapes; the stock cases run on any backend."""
    from lily_dev import deltanet_bench

    cases = deltanet_bench.microbench_cases(backend="reference")
    names = [c[0] for c in cases]
    assert "deltanet_decode_stock" in names and "mlx_fast_gated_delta_update_T8192" in names
    assert not any(n.startswith("deltanet_scan_") for n in names)  # no kernels on the reference backend
    for name, run, nbytes, flops in cases:
        assert callable(run) and nbytes > 0 and flops > 0, name
        if name in ("deltanet_decode_stock", "deltanet_conv_qk_norm_decode_stock"):
            run()
