"""MoE prefill kernels on the CPU simulator against the plain-MLX / numpy references.

Integer bookkeeping (histogram, scan, scatter + inverse map, block map) must be bit-exact; the
grouped GEMMs agree within bf16 tolerance. Every output is poisoned (``init_value``) so an
unwritten element shows. Routings are hypothesis-drawn: uniform, skewed, all-to-one-expert and
mostly-empty experts.
"""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lily_mlx.core import switches
from lily_mlx.ops.moe import kernels as mk
from lily_mlx.ops.moe.reference import combine_reference, dequantize_experts_reference, switch_glu_reference
from tests.kernels.kernel_backend import KERNEL_BACKEND, kernel_backend_problem
from lily_dev.moe_testing import make_inputs, make_routing, make_sparse_moe_block, simulator_problem

POISON_INT = -777
SETTINGS = settings(deadline=None, max_examples=10, derandomize=True)
ROUTING_KINDS = st.sampled_from(["uniform", "skewed", "one", "empty"])


SIM_PROBLEM = kernel_backend_problem() or (simulator_problem() if KERNEL_BACKEND == "sim" else None)
needs_sim = pytest.mark.skipif(SIM_PROBLEM is not None, reason=str(SIM_PROBLEM))
# Tests whose result also depends on stock's own quantised matmuls running on the kernel backend's
# device (router, shared expert, the fallback block). On MLX CUDA 0.32.4 those gave different values
# on identical calls and now and then NaN at these small shapes (H200, 2026-11-29; docs/moe.md), so
# there a failure says nothing about lily's kernels. They must pass on the simulator and on Metal.
stock_gpu_matmuls = pytest.mark.xfail(
    KERNEL_BACKEND == "cuda", strict=False,
    reason="stock's quantised matmuls on MLX CUDA 0.32.4 misbehave at hidden 128 (docs/moe.md)")


@pytest.fixture(scope="module")
def gemm_sim():
    """The simulator, able to run the GEMM kernels (simdgroup_matrix)."""
    problem = simulator_problem(need_matrix=True) if KERNEL_BACKEND == "sim" else kernel_backend_problem()
    if problem:
        pytest.skip(problem)


# ----------------------------------------------------------------------------------------------
# Routing bookkeeping: bit-exact


def _numpy_routing(flat: np.ndarray, num_experts: int):
    counts = np.bincount(flat, minlength=num_experts)
    order = np.argsort(flat, kind="stable")
    slot_of_row = np.empty_like(order)
    slot_of_row[order] = np.arange(flat.size)
    return counts, order, slot_of_row


@needs_sim
@SETTINGS
@given(kind=ROUTING_KINDS, tokens=st.integers(1, 700),
       experts_topk=st.sampled_from([(16, 4), (256, 8), (8, 1), (300, 2)]), seed=st.integers(0, 10_000))
def test_route_histogram_scan_scatter(kind, tokens, experts_topk, seed):
    num_experts, top_k = experts_topk
    inds = make_routing(kind, tokens, top_k, num_experts, seed)
    flat = inds.reshape(-1)
    a = flat.size
    chunk_counts, local_rank = mk.route_histogram(mx.array(inds), num_experts, KERNEL_BACKEND, init_value=POISON_INT)
    # Histogram: per-chunk counts and ranks within the chunk.
    n_chunks = -(-a // mk.CHUNK)
    want_cc = np.stack([np.bincount(flat[c * mk.CHUNK:(c + 1) * mk.CHUNK], minlength=num_experts)
                        for c in range(n_chunks)])
    assert np.array_equal(np.asarray(chunk_counts), want_cc)
    want_rank = np.array([np.sum(flat[(i // mk.CHUNK) * mk.CHUNK:i] == flat[i]) for i in range(a)])
    assert np.array_equal(np.asarray(local_rank), want_rank)
    # Scan.
    counts, offsets, chunk_offsets = mk.route_scan(chunk_counts, a, KERNEL_BACKEND, init_value=POISON_INT)
    want_counts, want_order, want_slots = _numpy_routing(flat, num_experts)
    assert np.array_equal(np.asarray(counts), want_counts)
    assert np.array_equal(np.asarray(offsets), np.concatenate([[0], np.cumsum(want_counts)]))
    want_co = np.concatenate([[0], np.cumsum(want_counts)])[:-1][None, :] + np.cumsum(want_cc, axis=0) - want_cc
    assert np.array_equal(np.asarray(chunk_offsets), want_co)
    # Scatter and inverse map.
    sorted_rows, slot_of_row = mk.route_scatter(mx.array(inds), local_rank, chunk_offsets, KERNEL_BACKEND,
                                                init_value=POISON_INT)
    assert np.array_equal(np.asarray(sorted_rows), want_order)
    assert np.array_equal(np.asarray(slot_of_row), want_slots)


@needs_sim
@SETTINGS
@given(kind=ROUTING_KINDS, tokens=st.integers(1, 700),
       experts_topk=st.sampled_from([(16, 4), (256, 8), (8, 1), (300, 2)]),
       adaptive=st.booleans(), seed=st.integers(0, 10_000))
def test_route_block_map(kind, tokens, experts_topk, adaptive, seed):
    num_experts, top_k = experts_topk
    flat = make_routing(kind, tokens, top_k, num_experts, seed).reshape(-1)
    counts = np.bincount(flat, minlength=num_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    blocks = mk.route_block_map(mx.array(counts.astype(np.int32)), mx.array(offsets.astype(np.int32)),
                                flat.size, adaptive, KERNEL_BACKEND, init_value=POISON_INT)
    blocks = np.asarray(blocks)
    want = mk.host_block_map(counts, adaptive)
    assert blocks.shape == (mk.max_blocks_bound(flat.size, num_experts), 4)
    assert len(want) <= len(blocks)
    assert np.array_equal(blocks[:len(want)], want)
    assert np.all(blocks[len(want):] == [-1, 0, 0, 0])
    # The tile rule, and the blocks cover every slot once.
    for e, first, rows, tile in want:
        assert tile == (32 if adaptive and counts[e] >= 32 else 16) and 1 <= rows <= tile
    covered = np.zeros(flat.size, dtype=int)
    for _, first, rows, _ in want:
        covered[first:first + rows] += 1
    assert np.all(covered == 1)


# ----------------------------------------------------------------------------------------------
# Grouped GEMMs: bf16 tolerance against dequantised weights in fp32


def _schedule_numpy(flat: np.ndarray, num_experts: int, adaptive: bool):
    counts, order, slots = _numpy_routing(flat, num_experts)
    return {
        "counts": mx.array(counts.astype(np.int32)),
        "sorted_rows": mx.array(order.astype(np.int32)),
        "slot_of_row": mx.array(slots.astype(np.int32)),
        "blocks": mx.array(mk.host_block_map(counts, adaptive)),
    }


def _dense(layer):
    return dequantize_experts_reference(layer, mx.float32)  # [E, O, K]


def _rms_rel(got, want) -> float:
    got = np.asarray(got.astype(mx.float32), dtype=np.float64)
    want = np.asarray(want.astype(mx.float32), dtype=np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2)) / max(1e-12, np.sqrt(np.mean(want ** 2))))


def _assert_close_bf16(got, want, what, max_rel=3e-2, rms_rel=1e-2):
    """bf16 tolerance: max error within ``max_rel`` of the largest value, RMS error within ``rms_rel``."""
    got_np = np.asarray(got.astype(mx.float32))
    want_np = np.asarray(want.astype(mx.float32))
    assert got_np.shape == want_np.shape, what
    assert not np.isnan(got_np).any(), f"{what}: unwritten (poisoned) elements"
    scale = max(1e-3, float(np.abs(want_np).max()))
    err = float(np.abs(got_np - want_np).max())
    assert err <= max_rel * scale, f"{what}: max |err| {err} vs scale {scale}"
    rms = _rms_rel(got, want)
    assert rms <= rms_rel, f"{what}: relative RMS error {rms}"


def _stock_on_cpu(fn, *args):
    """Stock's result as the oracle, computed on MLX's CPU backend: on MLX CUDA 0.32.4 stock's own
    quantised MoE matmuls at these small test shapes gave different results on identical calls and,
    now and then, NaN (measured on an H200; see docs/moe.md), so the GPU copy cannot be the oracle."""
    with mx.stream(mx.cpu):
        out = fn(*args)
        mx.eval(out)
    return out


def _exact_switch_glu(sw, x, inds):
    """SwitchGLU in fp32 on the dequantised weights: x [..., D], inds [..., k] -> [..., k, D]."""
    xf = x.astype(mx.float32)
    g = mx.einsum("...d,...kod->...ko", xf, _dense(sw.gate_proj)[inds])
    u = mx.einsum("...d,...kod->...ko", xf, _dense(sw.up_proj)[inds])
    return mx.einsum("...ko,...kdo->...kd", g * mx.sigmoid(g) * u, _dense(sw.down_proj)[inds])


def _assert_as_good_as_stock(got, stock, exact, what):
    """Stock rounds its intermediates to bf16 (gate/up outputs, SwiGLU); the kernels keep them in
    fp32 up to h. Both are compared with the fp32 computation: the kernels must be no worse."""
    _assert_close_bf16(got, stock, what + " vs stock", max_rel=0.1, rms_rel=0.06)
    err_kernel, err_stock = _rms_rel(got, exact), _rms_rel(stock, exact)
    assert err_kernel <= 1.25 * err_stock + 2e-3, f"{what}: RMS error vs fp32 {err_kernel} (stock {err_stock})"


GEMM_SHAPES = st.sampled_from([(128, 64, 16, 4), (64, 128, 8, 2), (192, 128, 4, 1)])  # D, I, E, k


@SETTINGS
@given(kind=ROUTING_KINDS, tokens=st.sampled_from([1, 3, 17, 40]), shape=GEMM_SHAPES,
       adaptive=st.booleans(), fused=st.booleans(), seed=st.integers(0, 1000))
def test_grouped_gemms(gemm_sim, kind, tokens, shape, adaptive, fused, seed):
    d, i, e, k = shape
    block = make_sparse_moe_block(hidden=d, expert_width=i, num_experts=e, top_k=k, seed=seed % 5)
    sw = block.switch_mlp
    inds = make_routing(kind, tokens, k, e, seed)
    flat = inds.reshape(-1)
    x = make_inputs(1, tokens, d, seed=seed).reshape(tokens, d)
    sched = _schedule_numpy(flat, e, adaptive)
    h = mk.gemm_gate_up_swiglu(x, sched["sorted_rows"], sched["blocks"], sw.gate_proj, sw.up_proj, k,
                               fused, sched["counts"], KERNEL_BACKEND, init_value=float("nan"))
    # Reference in fp32 on the same (bf16) inputs.
    xs = x.astype(mx.float32)[mx.array(np.asarray(sched["sorted_rows"]) // k)]  # [A, D] slot order
    e_of_slot = mx.array(np.sort(flat))
    g = mx.einsum("ad,aod->ao", xs, _dense(sw.gate_proj)[e_of_slot])
    u = mx.einsum("ad,aod->ao", xs, _dense(sw.up_proj)[e_of_slot])
    want_h = g * mx.sigmoid(g) * u
    _assert_close_bf16(h, want_h, "gate_up_swiglu")
    y = mk.gemm_down(h, sched["blocks"], sw.down_proj, fused, sched["counts"], KERNEL_BACKEND, init_value=float("nan"))
    want_y = mx.einsum("ai,adi->ad", h.astype(mx.float32), _dense(sw.down_proj)[e_of_slot])
    _assert_close_bf16(y, want_y, "down")


def test_dequant_experts(gemm_sim):
    block = make_sparse_moe_block(hidden=128, expert_width=64, num_experts=8, top_k=2)
    layer = block.switch_mlp.down_proj
    counts = mx.array([3, 0, 1, 0, 0, 7, 0, 2], dtype=mx.int32)
    got = mk.dequantize_experts(layer, counts, mx.bfloat16, KERNEL_BACKEND, init_value=float("nan"))
    want = dequantize_experts_reference(layer, mx.bfloat16)
    used = np.asarray(counts) > 0
    got, want = np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32))
    np.testing.assert_allclose(got[used], want[used], rtol=1e-2, atol=1e-2)
    assert np.isnan(got[~used]).all()  # experts without rows are skipped


# ----------------------------------------------------------------------------------------------
# Weighted combine (fused_combine): token-order weighted sums straight from slot order


@needs_sim
@SETTINGS
@given(tokens=st.sampled_from([1, 2, 7, 33]), k=st.sampled_from([1, 2, 4, 8]),
       width=st.sampled_from([4, 36, 128, 520]), dtype=st.sampled_from(["bfloat16", "float32"]),
       seed=st.integers(0, 1000))
def test_combine_rows(tokens, k, width, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = getattr(mx, dtype)
    a = tokens * k
    y = rng.standard_normal((a, width)).astype(np.float32)
    slot_of_row = rng.permutation(a).astype(np.int32)
    scores = rng.uniform(0, 1, (tokens, k)).astype(np.float32)
    y_mx, scores_mx = mx.array(y).astype(dt), mx.array(scores).astype(dt)
    got = mk.combine_rows(y_mx, mx.array(slot_of_row), scores_mx, backend=KERNEL_BACKEND, init_value=float("nan"))
    # Oracle in float64 on the same (rounded) inputs.
    y64 = np.asarray(y_mx.astype(mx.float32), dtype=np.float64)
    s64 = np.asarray(scores_mx.astype(mx.float32), dtype=np.float64)
    want = np.einsum("nk,nkd->nd", s64, y64[slot_of_row].reshape(tokens, k, width))
    got = np.asarray(got.astype(mx.float32), dtype=np.float64)
    assert got.shape == (tokens, width) and not np.isnan(got).any()  # every element written
    tol = 1e-5 if dtype == "float32" else 1e-2  # fp32 accumulation, one rounding to the output type
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("fused_combine", [True, False], ids=["fused", "gather+sum"])
def test_routed_experts_combined_vs_stock(gemm_sim, fused_combine, monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    block = make_sparse_moe_block(num_experts=16, top_k=4, seed=4, skew=3.0)
    x = make_inputs(2, 13, 128, seed=6, mean=0.3)
    gates = mx.softmax(block.gate(x).astype(mx.float32), axis=-1)
    inds = mx.argpartition(gates, kth=-4, axis=-1)[..., -4:]
    scores = mx.take_along_axis(gates, inds, axis=-1).astype(x.dtype)
    with switches.overrides(disable=() if fused_combine else ("fused_combine",)):
        got = mk.routed_experts_combined_kernel(block.switch_mlp, x, inds, scores)
    assert got is not None and got.shape == x.shape
    stock = _stock_on_cpu(lambda: combine_reference(switch_glu_reference(block.switch_mlp, x, inds), scores))
    exact = combine_reference(_exact_switch_glu(block.switch_mlp, x, inds), scores.astype(mx.float32))
    _assert_as_good_as_stock(got, stock, exact, "combined routed experts")


# ----------------------------------------------------------------------------------------------
# The routed-experts forward and the whole block, kernels vs stock


SWITCH_STATES = [(), ("gpu_routing",), ("fused_dequant",), ("adaptive_tile",),
                 ("gpu_routing", "fused_dequant", "adaptive_tile")]


@pytest.mark.parametrize("disabled", SWITCH_STATES, ids=lambda d: "off:" + ",".join(d) if d else "all-on")
def test_routed_experts_kernel_vs_stock(gemm_sim, disabled, monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    block = make_sparse_moe_block(num_experts=16, top_k=4, seed=1, skew=5.0)
    x = make_inputs(2, 21, 128, seed=3, mean=0.5)  # B > 1, odd T, a hot expert
    inds = mx.argpartition(block.gate(x), kth=-4, axis=-1)[..., -4:]
    with switches.overrides(disable=disabled):
        got = mk.routed_experts_kernel(block.switch_mlp, x, inds)
    assert got is not None
    stock = _stock_on_cpu(switch_glu_reference, block.switch_mlp, x, inds)
    _assert_as_good_as_stock(got, stock, _exact_switch_glu(block.switch_mlp, x, inds), "routed experts")


@stock_gpu_matmuls
def test_sparse_moe_forward_sim_vs_stock(gemm_sim, monkeypatch):
    from lily_mlx.ops.moe import sparse_moe_forward

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    for batch, tokens, k in [(1, 16, 4), (3, 7, 4), (1, 64, 1)]:
        block = make_sparse_moe_block(num_experts=16, top_k=k, seed=tokens)
        x = make_inputs(batch, tokens, 128, seed=tokens)
        want = _stock_on_cpu(block, x)
        _assert_close_bf16(sparse_moe_forward(block, x), want, f"forward B={batch} T={tokens} k={k}",
                           max_rel=0.1, rms_rel=0.05)


@pytest.mark.slow
def test_grouped_gemm_larger_shape(gemm_sim, monkeypatch):
    """One representative larger case: 64 experts, top-8, hidden 512, expert width 256, 96 tokens."""
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    block = make_sparse_moe_block(hidden=512, expert_width=256, num_experts=64, top_k=8, seed=2, skew=3.0)
    x = make_inputs(1, 96, 512, seed=5, mean=0.3)
    inds = mx.argpartition(block.gate(x), kth=-8, axis=-1)[..., -8:]
    got = mk.routed_experts_kernel(block.switch_mlp, x, inds)
    stock = _stock_on_cpu(switch_glu_reference, block.switch_mlp, x, inds)
    _assert_as_good_as_stock(got, stock, _exact_switch_glu(block.switch_mlp, x, inds), "routed experts (larger)")


@needs_sim
@stock_gpu_matmuls
def test_unsupported_falls_back(monkeypatch):
    """Non-quantised experts and other bit widths take the reference path, saying why once."""
    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    notes = []
    monkeypatch.setattr(mk, "log_once", lambda key, message, *a, **k: notes.append(message))
    x = make_inputs(1, 20, 128)
    for block in (make_sparse_moe_block(quantized=False), make_sparse_moe_block(bits=8)):
        inds = mx.argpartition(block.gate(x), kth=-4, axis=-1)[..., -4:]
        assert mk.routed_experts_kernel(block.switch_mlp, x, inds) is None
    assert "not quantised" in notes[0] and "8-bit" in notes[1], notes
    # The forward still computes stock's result (the reference path).
    from lily_mlx.ops.moe import sparse_moe_forward

    block = make_sparse_moe_block(bits=8)
    assert mx.array_equal(sparse_moe_forward(block, x), block(x)).item()


# ----------------------------------------------------------------------------------------------
# No host synchronisation inside a prefill chunk with gpu_routing on


def _trace_forward_with_metal_kernels(monkeypatch, tmp_path, disabled=()):
    """Export (trace, never evaluate) the MoE forward with real ``mx.fast.metal_kernel`` objects.

    MLX refuses any evaluation while tracing (``.item()``, ``.tolist()``, ``np.array``, ``mx.eval``
    all raise), so a successful export proves the chunk's graph is built with no host sync.
    """
    from lily_mlx.core import kernel_registry
    from lily_mlx.ops.moe import sparse_moe_forward

    def metal_kernel(spec, backend=None):
        header, body = kernel_registry.kernel_source(spec)
        return mx.fast.metal_kernel(name=spec.name, input_names=list(spec.input_names),
                                    output_names=list(spec.output_names), source=body, header=header,
                                    ensure_row_contiguous=spec.ensure_row_contiguous,
                                    atomic_outputs=spec.atomic_outputs)

    monkeypatch.setenv("LILY_BACKEND", "sim")  # any kernel backend; kernels built as Metal ones
    monkeypatch.setattr(mk, "get_kernel", metal_kernel)
    block = make_sparse_moe_block(num_experts=16, top_k=4)
    x = make_inputs(2, 40, 128)
    calls = []

    def fn(x):
        y = sparse_moe_forward(block, x)
        calls.append(y.shape)
        return y

    with switches.overrides(disable=disabled):
        mx.export_function(str(tmp_path / "moe_chunk.mlxfn"), fn, x)
    return calls


def test_gpu_routing_needs_no_host_sync(monkeypatch, tmp_path):
    calls = _trace_forward_with_metal_kernels(monkeypatch, tmp_path)
    assert calls == [(2, 40, 128)]
    # The traced graph really contains the kernels (and not the reference path).
    text = (tmp_path / "moe_chunk.mlxfn").read_bytes()
    for name in ("moe_route_histogram_i32", "moe_route_block_map_i32", "moe_gemm_gate_up_swiglu", "moe_gemm_down"):
        assert name.encode() in text


def test_host_routing_does_sync(monkeypatch, tmp_path):
    """The ablation (gpu_routing off) brings counts to the host: the same trace must fail."""
    with pytest.raises(Exception, match="eval"):
        _trace_forward_with_metal_kernels(monkeypatch, tmp_path, disabled=("gpu_routing",))


def test_microbench_cases_small(gemm_sim, monkeypatch):
    """The benchmark cases run (shrunk shapes) and report positive bytes and flops."""
    from lily_dev import moe_bench

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    # Two lengths: a case built for one length must not run with the other's shapes (late binding).
    for name, value in dict(HIDDEN=128, EXPERT_WIDTH=64, NUM_EXPERTS=16, TOP_K=4, TOKENS=(24, 40)).items():
        monkeypatch.setattr(moe_bench, name, value)
    cases = moe_bench.microbench_cases()
    names = [c[0] for c in cases]
    assert "stock_switch_glu[24tok]" in names and "gemm_gate_up_swiglu_fused_adaptive[24tok]" in names
    for name, run_once, bytes_moved, flops in cases:
        run_once()
        assert bytes_moved > 0 and flops >= 0, name


def test_small_calls_run_the_gemms_without_routing_kernels(gemm_sim, monkeypatch):
    """Up to PER_ASSIGNMENT_MAX assignments (decode) the schedule is one block per assignment: only the
    two GEMMs and the combine launch; a prefill chunk runs the routing kernels too. With the routing
    held fixed, a token's routed-expert output has the same bits in both (batch invariance of lily's
    kernels; stock's router and shared-expert matmuls around them are MLX's own, which on MLX CUDA are
    not batch invariant: bench/batch_invariance.py), and the whole block stays close to stock's."""
    from lily_mlx.core.kernel_registry import record_launches
    from lily_mlx.ops.moe import sparse_moe_forward

    monkeypatch.setenv("LILY_BACKEND", KERNEL_BACKEND)
    block = make_sparse_moe_block(num_experts=16, top_k=4, seed=4, skew=3.0)
    chunk = make_inputs(1, 20, 128, seed=7, mean=0.3)  # 80 assignments: routed schedule
    with record_launches() as routed:
        mx.eval(sparse_moe_forward(block, chunk))
    with record_launches() as small:
        alone = sparse_moe_forward(block, chunk[:, 5:6])  # 4 assignments
        mx.eval(alone)
    assert small.counts() == {"moe_gemm_gate_up_swiglu": 1, "moe_gemm_down": 1, "moe_combine_weighted_rows": 1}
    assert {"moe_route_histogram_i32", "moe_route_scan_i32", "moe_route_scatter_i32",
            "moe_route_block_map_i32"} <= set(routed.counts())

    gates = mx.softmax(block.gate(chunk).astype(mx.float32), axis=-1)
    inds = mx.argpartition(gates, kth=-4, axis=-1)[..., -4:]
    scores = mx.take_along_axis(gates, inds, axis=-1).astype(chunk.dtype)
    whole = mk.routed_experts_combined_kernel(block.switch_mlp, chunk, inds, scores)
    one = mk.routed_experts_combined_kernel(block.switch_mlp, chunk[:, 5:6], inds[:, 5:6], scores[:, 5:6])
    assert mx.array_equal(one[0, 0], whole[0, 5]).item()

    stock = _stock_on_cpu(lambda: type(block).__call__(block, chunk[:, 5:6]))
    np.testing.assert_allclose(np.array(alone.astype(mx.float32)), np.array(stock.astype(mx.float32)),
                               atol=0.05 * float(mx.abs(stock).max().item()))
