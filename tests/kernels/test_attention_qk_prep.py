"""q/k preparation kernel (kernels/attention/qk_prep.metal, switch ``fused_qk_prep``) vs stock's ops.

The kernel does in one launch what stock does with five primitives: the output gate split off q_proj,
q_norm and k_norm (RMSNorm over the head dim) and the partial, non-traditional RoPE of queries and keys
at each row's cache offset. Checked on hypothesis-drawn shapes (B 1-3, chunks of 1-6 tokens, head
layouts 16/2, 4/2, 8/8, 2/1, head dims 32-256, rotated dims 2..D, bf16 / fp16 / fp32, scalar or per-row
offsets from -40 (left padding) to 5,000, RoPE base and scale), outputs poisoned with NaN; Qwen3.6's shape at long offsets;
the gate copied bit for bit; a row's bits independent of the batch; the race check; the dispatch and
its fallbacks.

Oracle: stock's own ops (``reference.qk_prep_reference``) on the same inputs. The kernel keeps stock's
rounding points (normalised value, times the weight, rotated value: each rounded to the activation
type), so the two differ only where a sum of squares or a rotation angle, computed in another order,
rounds an element the other way: at most 2 units in the last place of the tensor's largest element
(bf16 2^-6, fp16 2^-9 of it; fp32 1e-5), plus the angle's own fp32 error, which grows with the position
(4e-7 per position of the largest element: MLX computes the angle as the Metal kernel does, its CPU
backend in another order). The hypothesis test computes stock's ops on MLX's CPU stream: MLX's CUDA
RoPE (0.32.4) is off at negative offsets (a left-padded row's padding; measured on an H200 2026-12-01:
up to 7.8 on values of ~4 against MLX's CPU RoPE, with which the kernel agrees to one bf16 unit),
while at offsets >= 0 the kernel matches MLX's CUDA ops bit for bit.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lily_mlx.core import switches
from lily_mlx.core.kernel_registry import record_launches
from lily_mlx.ops.attention import kernels as ak
from lily_mlx.ops.attention import layer as att
from lily_mlx.ops.attention.reference import qk_prep_reference
from lily_mlx.ops.deltanet import kernels as deltanet_kernels
from tests.kernels.kernel_backend import KERNEL_BACKEND, kernel_backend_problem
from tests.kernels.kernel_backend import attention_kernels_on_test_backend  # noqa: F401 (autouse fixture)

SIM_MISSING = kernel_backend_problem() or deltanet_kernels.backend_unavailable_reason(KERNEL_BACKEND)
needs_sim = pytest.mark.skipif(SIM_MISSING is not None, reason=f"{KERNEL_BACKEND} kernels not available: {SIM_MISSING}")

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
ULP2 = {"bfloat16": 2**-6, "float16": 2**-9, "float32": 1e-5}  # module docstring
PER_POSITION = 4e-7
NAN = float("nan")


def _problem(rng, B, L, H, Hkv, D, dims, dtype, base=1e7, rope_scale=1.0, eps=1e-6):
    def rand(shape, scale=1.0):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)

    q_proj = rand((B, L, H * 2 * D), 3.0)
    k_proj = rand((B, L, Hkv * D), 3.0)
    v_proj = rand((B, L, Hkv * D))
    q_norm, k_norm = nn.RMSNorm(D, eps=eps), nn.RMSNorm(D, eps=eps)
    q_norm.weight, k_norm.weight = rand((D,)), rand((D,))
    rope = nn.RoPE(dims, traditional=False, base=base, scale=rope_scale)
    return q_proj, k_proj, v_proj, dict(n_heads=H, n_kv_heads=Hkv, q_norm=q_norm, k_norm=k_norm, rope=rope)


def _run(q_proj, k_proj, offset, **kw):
    out = ak.qk_prep(q_proj, k_proj, offset=offset, backend=KERNEL_BACKEND, init_value=NAN, **kw)
    mx.eval(out)
    return out


def _check(got, want, dtype_name, max_position):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not bool(mx.any(mx.isnan(got)).item()), "unwritten output"
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= (ULP2[dtype_name] + PER_POSITION * max_position) * scale


@needs_sim
@settings(deadline=None, max_examples=40)
@given(B=st.integers(1, 3), L=st.integers(1, 6), heads=st.sampled_from([(16, 2), (4, 2), (8, 8), (2, 1)]),
       D=st.sampled_from([32, 64, 128, 256]), dims_kind=st.sampled_from(["2", "quarter", "half", "all"]),
       dtype=st.sampled_from(list(DTYPES)), per_row=st.booleans(), base=st.sampled_from([1e4, 1e6, 1e7]),
       rope_scale=st.sampled_from([1.0, 0.25]), seed=st.integers(0, 2**16))
def test_qk_prep_kernel_matches_stock(B, L, heads, D, dims_kind, dtype, per_row, base, rope_scale, seed):
    rng = np.random.default_rng(seed)
    H, Hkv = heads
    dims = {"2": 2, "quarter": D // 4, "half": D // 2, "all": D}[dims_kind]
    q_proj, k_proj, v_proj, kw = _problem(rng, B, L, H, Hkv, D, dims, DTYPES[dtype], base, rope_scale)
    offsets = [int(x) for x in rng.integers(-40, 5000, size=B)]  # negative: a left-padded BatchKVCache row
    offset = mx.array(offsets, dtype=mx.int32) if per_row else offsets[0]
    assert ak.qk_prep_supports(q_proj, k_proj, H, Hkv, kw["q_norm"], kw["k_norm"], kw["rope"], offset) is None
    queries, keys, gate = _run(q_proj, k_proj, offset, **kw)
    with mx.stream(mx.cpu):  # MLX's CUDA RoPE is off at negative offsets (module docstring)
        want_q, want_k, _, want_gate = qk_prep_reference(q_proj, k_proj, v_proj, offset=offset, **kw)
        mx.eval(want_q, want_k, want_gate)
    max_position = rope_scale * (max(abs(o) for o in (offsets if per_row else offsets[:1])) + L)
    _check(queries, want_q, dtype, max_position)
    _check(keys, want_k, dtype, max_position)
    assert mx.array_equal(gate, want_gate).item()  # a copy
    # The fused q/k/v projection's output read in place (k_proj None): the same bits.
    in_place = _run(mx.concatenate([q_proj, k_proj, v_proj], axis=-1), None, offset, **kw)
    for got, want in zip(in_place, (queries, keys, gate)):
        assert got.shape == want.shape and mx.array_equal(got, want).item()


@needs_sim
@pytest.mark.parametrize("L, offset", [(1, 4095), (1, 131071), (7, 2048)])
def test_qk_prep_kernel_qwen36_shape(L, offset):
    """16 query heads, 2 KV heads, head dim 256, 64 rotated dims, bf16, at decode and prefill offsets."""
    rng = np.random.default_rng(L + offset)
    q_proj, k_proj, v_proj, kw = _problem(rng, 1, L, 16, 2, 256, 64, mx.bfloat16)
    queries, keys, gate = _run(q_proj, k_proj, offset, **kw)
    want_q, want_k, _, want_gate = qk_prep_reference(q_proj, k_proj, v_proj, offset=offset, **kw)
    _check(queries, want_q, "bfloat16", offset + L)
    _check(keys, want_k, "bfloat16", offset + L)
    assert mx.array_equal(gate, want_gate).item()


@needs_sim
def test_a_rows_bits_do_not_depend_on_its_batch():
    rng = np.random.default_rng(3)
    q_proj, k_proj, _, kw = _problem(rng, 3, 4, 4, 2, 64, 16, mx.bfloat16)
    offsets = mx.array([7, 300, 4000], dtype=mx.int32)
    batch = _run(q_proj, k_proj, offsets, **kw)
    for b in range(3):
        alone = _run(q_proj[b:b + 1], k_proj[b:b + 1], int(offsets[b].item()), **kw)
        for x, y in zip(batch, alone):
            assert mx.array_equal(x[b:b + 1], y).item(), b


@needs_sim
@pytest.mark.skipif(KERNEL_BACKEND != "sim", reason="the race check is the simulator's")
def test_qk_prep_kernel_race_check(monkeypatch):
    """The simulator's race check on the normalised row shared through threadgroup memory."""
    monkeypatch.setenv("LILY_MSL_RACE", "1")
    rng = np.random.default_rng(5)
    q_proj, k_proj, v_proj, kw = _problem(rng, 1, 2, 4, 2, 64, 32, mx.bfloat16)
    queries, keys, _ = _run(q_proj, k_proj, 9, **kw)
    want_q, want_k, _, _ = qk_prep_reference(q_proj, k_proj, v_proj, offset=9, **kw)
    _check(queries, want_q, "bfloat16", 11)
    _check(keys, want_k, "bfloat16", 11)


# ---------------------------------------------------------------------------------------------
# dispatch through the layer's op (LILY_BACKEND = the kernel backend)


@needs_sim
def test_dispatch_runs_the_kernel_with_the_switch_and_falls_back_outside_its_shapes(monkeypatch):
    from lily_mlx.core.log import reset_log_once

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    rng = np.random.default_rng(11)
    q_proj, k_proj, v_proj, kw = _problem(rng, 2, 3, 4, 2, 64, 16, mx.bfloat16)
    want = qk_prep_reference(q_proj, k_proj, v_proj, offset=12, **kw)

    with record_launches() as rec:
        got = att.qk_prep(q_proj, k_proj, v_proj, offset=12, **kw)
    assert rec.names() == ["attention_qk_prep"]
    for x, y in zip(got[:2], want[:2]):
        _check(x, y, "bfloat16", 15)
    assert mx.array_equal(got[2], want[2]).item() and mx.array_equal(got[3], want[3]).item()  # values, gate

    with switches.overrides(disable=["fused_qk_prep"]), record_launches() as rec:
        off = att.qk_prep(q_proj, k_proj, v_proj, offset=12, **kw)
    assert not rec.names() and all(mx.array_equal(x, y).item() for x, y in zip(off, want))

    reset_log_once()
    traditional = dict(kw, rope=nn.RoPE(16, traditional=True, base=1e7))
    want_t = qk_prep_reference(q_proj, k_proj, v_proj, offset=12, **traditional)
    with record_launches() as rec:
        fallback = att.qk_prep(q_proj, k_proj, v_proj, offset=12, **traditional)
    assert not rec.names() and all(mx.array_equal(x, y).item() for x, y in zip(fallback, want_t))
    assert "traditional" in ak.qk_prep_supports(q_proj, k_proj, 4, 2, kw["q_norm"], kw["k_norm"],
                                                traditional["rope"], 12)
    fp32_norm = nn.RMSNorm(64, eps=1e-6)  # fp32 weight, bf16 activations: stock promotes, so stock's ops run
    assert "dtype" in ak.qk_prep_supports(q_proj, k_proj, 4, 2, fp32_norm, kw["k_norm"], kw["rope"], 12)


def test_qk_prep_kernel_compiles_for_cuda():
    """Qwen3.6's instantiations (bf16 and fp16, D = 256, 64 rotated dims) and a small fp32 one translate
    and compile for the bridge (the kernel is simulator-only in the product until timed on a GPU)."""
    from lily_dev.compile_check import compile_cuda, compiler_available
    from lily_mlx.core.kernel_registry import kernel_source
    from lily_mlx.msl.cuda import metal_kernel, wrap_like_mlx

    if compiler_available() is None:
        pytest.skip("no CUDA compiler (NVRTC or nvcc) installed")
    spec = ak.KERNELS["attention_qk_prep"]
    header, body = kernel_source(spec)
    kernel = metal_kernel(spec.name, list(spec.input_names), list(spec.output_names), body, header=header)
    for dtype, D, dims in ((mx.bfloat16, 256, 64), (mx.float16, 256, 64), (mx.float32, 64, 16)):
        q, k, w = mx.zeros((1, 1, 32 * D), dtype), mx.zeros((1, 1, 2 * D), dtype), mx.zeros((D,), dtype)
        scalar = mx.zeros((1,))
        _, unit = wrap_like_mlx(kernel, [q, k, w, w, mx.zeros((1,), mx.int32), scalar, scalar, scalar,
                                         mx.zeros((3,), mx.int32)], [dtype] * 3,
                                template=[("T", dtype), ("D", D), ("DIMS", dims)])
        ok, log = compile_cuda(unit)
        assert ok, log


@needs_sim
def test_qk_prep_bench_cases():
    """The cases the kernels mode times (small chunks here): each runs, stock's and lily's per chunk."""
    from lily_dev.attention_bench import qk_prep_cases

    cases = qk_prep_cases(KERNEL_BACKEND, chunks=(1, 3))
    names = [name for name, *_ in cases]
    assert names == [f"attention_qk_prep_{who}{x}_L{n}" for n in (1, 3) for who in ("stock", "lily")
                     for x in ("", "_x8")]
    for _, run, nbytes, flops in cases:
        run()
        assert nbytes > 0 and flops > 0


@needs_sim
def test_attention_layer_reads_the_fused_qkv_projection_in_place(monkeypatch):
    """With fused_qkv_proj, a decode step's q/k preparation kernel reads q and k (and the values their view)
    from the one matmul's output, never split; the layer's outputs are the bits of the projections apart."""
    from mlx_lm.models.cache import KVCache

    from lily_mlx.core import projections, switches
    from lily_mlx.ops import attention as att
    from tests.ops.test_attention_layer import HIDDEN, make_attention, run_chunks

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    module = make_attention(4, 2, 64, partial=0.25, dtype=mx.bfloat16, quantize=True, seed=3, group_size=32)
    mx.random.seed(4)
    xs = [mx.random.normal((1, t, HIDDEN)).astype(mx.bfloat16) for t in (5, 1, 1)]
    counts = {"matmul": 0, "split": 0}
    for name in counts:
        real = getattr(projections, name)
        monkeypatch.setattr(projections, name, lambda *a, _real=real, _name=name: counts.__setitem__(
            _name, counts[_name] + 1) or _real(*a))
    runs = {}
    for fused in (True, False):
        with switches.overrides(disable=["compiled_decode"] + ([] if fused else ["fused_qkv_proj"])):
            runs[fused] = run_chunks(att.attention_forward, module, xs, KVCache())
        if fused:
            assert counts == {"matmul": 3, "split": 0}, counts  # the 5-token chunk (<= 7 rows) and two steps
    for a, b in zip(runs[True], runs[False]):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
