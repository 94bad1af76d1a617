"""MoE op family, reference backend: bit-identical to stock MLX-LM, and the bookkeeping references
agree with an independent numpy oracle."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lily_mlx.ops import OPS, op_backend
from lily_mlx.ops import moe
from lily_mlx.ops.moe.reference import (
    routing_block_map_reference,
    routing_histogram_reference,
    routing_offsets_reference,
    routing_scatter_reference,
    router_reference,
)
from lily_dev.moe_testing import make_inputs, make_routing, make_sparse_moe_block

SETTINGS = settings(deadline=None, max_examples=12, derandomize=True)


@pytest.fixture(scope="module")
def reference_backend():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LILY_BACKEND", "reference")
        yield


def test_ops_registered():
    for name in ("moe_router", "moe_routing", "moe_grouped_gemm", "moe_expert_up", "moe_expert_down"):
        assert name in OPS
    assert OPS["moe_routing"].switches == ("gpu_routing",)
    assert set(OPS["moe_grouped_gemm"].switches) == {"fused_dequant", "adaptive_tile", "fused_combine", "fused_expert_down",
                                                      "row_gemv", "fused_down_combine", "fused_residual",
                                                      "register_tiles", "tall_register_blocks", "split_k_gate_up",
                                                      "direct_down_combine", "down_combine_ring",
                                                      "down_combine_simd_barriers"}
    assert OPS["moe_router"].switches == ("fused_expert_up", "split_router", "fused_topk_gemv", "fused_norm_router",
                                          "fused_next_norm")
    assert op_backend("moe_grouped_gemm", "reference") == "reference"
    assert op_backend("moe_expert_up", "sim") == "reference"


@SETTINGS
@given(
    batch=st.integers(1, 3),
    tokens=st.sampled_from([1, 2, 5, 16, 33]),
    experts_topk=st.sampled_from([(16, 4), (8, 1), (8, 2), (32, 8)]),
    norm=st.booleans(),
    quantized=st.booleans(),
    skew=st.sampled_from([0.0, 5.0, 4000.0]),
    seed=st.integers(0, 1000),
)
def test_sparse_moe_forward_reference_is_stock(batch, tokens, experts_topk, norm, quantized, skew, seed, reference_backend):
    """Reference backend: bit-identical to the stock block (decode and prefill sizes, B > 1,
    odd T, T = 1, empty experts, and with skew=4000 all rows to one expert for k = 1)."""
    num_experts, top_k = experts_topk
    # MLX's CPU gather_mm (unquantised experts) supports float32 only.
    dtype = mx.bfloat16 if quantized else mx.float32
    block = make_sparse_moe_block(num_experts=num_experts, top_k=top_k, norm_topk_prob=norm,
                                  quantized=quantized, seed=seed % 7, skew=skew, dtype=dtype)
    x = make_inputs(batch, tokens, 128, seed=seed, mean=1.0 if skew else 0.0, dtype=dtype)
    want = block(x)
    got = moe.sparse_moe_forward(block, x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert mx.array_equal(got, want).item()


def test_router_reference_matches_stock_topk():
    gates = mx.random.normal((3, 7, 16), key=mx.random.key(1)).astype(mx.bfloat16)
    inds, scores = router_reference(gates, 4, True)
    probs = np.asarray(mx.softmax(gates.astype(mx.float32), axis=-1))
    top = np.sort(np.argsort(-probs, axis=-1, kind="stable")[..., :4], axis=-1)
    assert np.array_equal(np.sort(np.asarray(inds), axis=-1), top)
    np.testing.assert_allclose(np.asarray(scores.astype(mx.float32)).sum(-1), 1.0, atol=2e-2)


@SETTINGS
@given(
    kind=st.sampled_from(["uniform", "skewed", "one", "empty"]),
    tokens=st.integers(1, 300),
    experts_topk=st.sampled_from([(16, 4), (256, 8), (8, 1), (64, 2)]),
    tile=st.sampled_from([8, 16, 32]),
    seed=st.integers(0, 10_000),
)
def test_routing_bookkeeping_references(kind, tokens, experts_topk, tile, seed):
    num_experts, top_k = experts_topk
    inds = make_routing(kind, tokens, top_k, num_experts, seed)
    flat = inds.reshape(-1)
    counts = np.bincount(flat, minlength=num_experts)
    got_counts = routing_histogram_reference(mx.array(inds), num_experts)
    assert np.array_equal(np.asarray(got_counts), counts)
    offsets = np.asarray(routing_offsets_reference(got_counts))
    assert np.array_equal(offsets, np.concatenate([[0], np.cumsum(counts)]))
    sorted_rows, slot_of_row = routing_scatter_reference(mx.array(inds))
    order = np.argsort(flat, kind="stable")
    assert np.array_equal(np.asarray(sorted_rows), order)
    assert np.array_equal(np.asarray(slot_of_row)[order], np.arange(flat.size))
    blocks = routing_block_map_reference(counts, tile)
    covered = np.zeros(flat.size, dtype=int)
    for e, start, rows in blocks:
        assert 1 <= rows <= tile
        assert offsets[e] <= start and start + rows <= offsets[e + 1]
        covered[start:start + rows] += 1
    assert np.all(covered == 1)
    assert len(blocks) == int(np.sum((counts + tile - 1) // tile))


# Rows per expert on both sides of each tile size (16 and 32), an empty expert and a hot one: built
# explicitly so these paths run whatever hypothesis draws.
EDGE_COUNTS = [0, 1, 15, 16, 17, 31, 32, 33, 55, 200]


@pytest.mark.parametrize("tile", [16, 32])
def test_routing_bookkeeping_references_edge_counts(tile):
    from lily_dev.moe_testing import routing_with_counts
    from lily_mlx.ops.moe.reference import tile_rows_for_count

    inds = routing_with_counts(EDGE_COUNTS, 2, seed=tile)
    assert all(len(set(row)) == 2 for row in inds)  # distinct experts per token, as a router gives
    got = np.asarray(routing_histogram_reference(mx.array(inds), len(EDGE_COUNTS)))
    assert got.tolist() == EDGE_COUNTS
    offsets = np.concatenate([[0], np.cumsum(EDGE_COUNTS)])
    blocks = routing_block_map_reference(EDGE_COUNTS, tile)
    want = [(e, offsets[e] + s, min(tile, c - s)) for e, c in enumerate(EDGE_COUNTS) for s in range(0, c, tile)]
    assert np.array_equal(np.asarray(blocks).reshape(-1, 3), np.asarray(want))
    assert [tile_rows_for_count(c, True) for c in (0, 1, 31, 32, 33, 200)] == [16, 16, 16, 32, 32, 32]
    assert {tile_rows_for_count(c, False) for c in EDGE_COUNTS} == {16}
