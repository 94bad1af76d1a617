"""Which kernels each switch state runs, on the simulator, and that each state still computes stock's
function.

A switch that is read and ignored (its state hard-wired) computes the right numbers, so output checks
alone cannot see it. These tests use the supported launch record
(``lily_mlx.core.kernel_registry.record_launches``) and assert, for every state of every switch that
has kernels, the kernels launched (names, order, counts) and the variant the switch selects through
template or geometry:

| switch | on | off |
|---|---|---|
| ``fused_dequant`` | GEMMs read packed 4-bit weights | ``moe_dequant_experts_q4`` x 3, GEMMs read dense bf16 weights; routed schedule even for small calls |
| ``gpu_routing`` | ``moe_route_block_map_i32``; block map padded to ``max_blocks_bound`` | block map built on the host, exactly sized |
| ``adaptive_tile`` | 32-row tiles for experts with >= 32 rows | 16-row tiles only |
| ``fused_combine`` | ``moe_combine_weighted_rows`` | no combine kernel (gather + weighted sum) |
| ``register_tiles`` | ``moe_gemm_*_regtile`` (outputs in registers) | ``moe_gemm_gate_up_swiglu`` / ``moe_gemm_down`` (simdgroup tiles) |
| ``tall_register_blocks`` | register tiles with template NT = 64, 64-thread threadgroups | NT = 128, 128 threads |
| ``split_k_gate_up`` (off by default) | gate+up's register tiles and one-row GEMV with template SK = the split | SK = 1 |
| ``direct_down_combine`` (off by default) | decode: ``moe_gemv_down_combine_direct`` (with ``fused_down_combine``) | ``moe_gemv_down_combine`` |
| ``down_combine_ring`` | decode: ``moe_gemv_down_combine`` template PD = 4 | PD = 1 |
| ``down_combine_simd_barriers`` | decode: ``moe_gemv_down_combine`` template GS = 1 | GS = 0 |
| ``register_scan`` | ``deltanet_scan_staged`` / ``deltanet_scan_register`` | ``deltanet_scan_blockwise``, ceil(T / 16) state blocks |
| ``staged_scan`` | ``deltanet_scan_staged`` (with ``register_scan``) | ``deltanet_scan_register`` |
| ``fused_recurrent_norm`` | ``deltanet_decode_fused`` | gates, scan (T = 1), gated norm kernels |
| ``fused_conv_step`` | decode: ``deltanet_decode_conv_fused`` alone (with ``fused_recurrent_norm``) | ``deltanet_conv_qk_norm_decode`` + the decode kernel(s) |
| ``gqa_packing`` | ``attention_decode`` template GT = G, grid B * Hkv threadgroups | GT = 1, B * Hq threadgroups |
| ``coalesced_kv`` | template COALESCED = 1 | COALESCED = 0 |
| ``kv_write_in_trace`` | decode: ``attention_decode_block_partials_live`` + ``attention_decode_merge_live_blocks`` over the KV buffer | ``attention_decode`` over the live rows |
| ``fused_output_gate`` | (with ``kv_write_in_trace``) ``attention_decode_merge_live_blocks_gated`` | ``attention_decode_merge_live_blocks`` |

The expected launches are written out here from the documented dispatch rules (README, docs/moe.md,
``ops/*/kernels.py`` docstrings), not computed by lily's own schedule code. MoE routings are built
explicitly (experts with 0, 1, 15, 16, 17, 31, 32, 33, 55 and 200 rows; calls of exactly
``PER_ASSIGNMENT_MAX`` assignments and just over), DeltaNet chunks cross the blockwise scan's 16-token
blocks, and the whole patched embedded model is run in every switch state (the switches without
kernels yet must then launch exactly what the default state launches).

Accuracy rules (stated, not fitted to one input):
- MoE: relative RMS error against an fp32 oracle on the same bf16 inputs at most stock's own error on
  the same input (measured over 60 seeds x every switch state at these shapes: lily/stock <= 0.45).
- DeltaNet (bf16): ``tests/ops/deltanet_cases.assert_as_accurate_as_stock`` (a multiple of stock's
  99th-percentile error over 1,150 random cases).
- Decode attention: against the fp32 oracle; the kernel accumulates in fp32 and rounds the output to
  bf16 once, which moves an element by at most 2^-9 of itself, so the relative L2 error is below 2^-9
  (5 % allowed on top for the fp32 arithmetic).
- The embedded model: lily's logits no further from the fp32 model's than ``MODEL_ERROR_FACTOR`` x
  stock bf16's (measured over 12 text slices x every state: <= 1.06, see the constant).
"""

from __future__ import annotations

import itertools
from typing import Dict, List, Sequence

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from lily_mlx.core import switches
from lily_mlx.core.kernel_registry import record_launches
from lily_mlx.ops.moe import kernels as mk
from lily_mlx.ops.moe.reference import combine_reference, dequantize_experts_reference, switch_glu_reference
from lily_dev.moe_testing import make_inputs, make_sparse_moe_block, routing_with_counts, simulator_problem
from tests.ops.deltanet_cases import (
    assert_as_accurate_as_stock,
    make_cache,
    make_module,
    random_inputs,
    rel_l2,
    ssm_mask,
)

SIM_PROBLEM = simulator_problem()
pytestmark = pytest.mark.skipif(SIM_PROBLEM is not None, reason=f"no C++ compiler for the simulator: {SIM_PROBLEM}")


@pytest.fixture(scope="module", autouse=True)
def on_the_cpu():
    """Stock's ops (the oracles, the model's own matmuls) on MLX's CPU backend on any machine: the
    kernels run in the simulator there anyway, and stock's small quantised matmuls on MLX CUDA
    0.32.4 are not reliable (docs/moe.md)."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


@pytest.fixture
def sim(monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "sim")


def _states(names: Sequence[str]) -> List[Dict[str, bool]]:
    return [dict(zip(names, values)) for values in itertools.product((True, False), repeat=len(names))]


def _state_id(state: Dict[str, bool]) -> str:
    off = [n for n, on in state.items() if not on]
    return "off:" + ",".join(off) if off else "all-on"


def _overrides(state: Dict[str, bool]):
    """Exactly this state for the named switches, whatever LILY_DISABLE / LILY_ENABLE say."""
    return switches.overrides(disable=[n for n, on in state.items() if not on],
                              enable=[n for n, on in state.items() if on])


def _np(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32) if a.dtype in (mx.bfloat16, mx.float16) else a)


# ----------------------------------------------------------------------------------------------
# MoE: fused_dequant, gpu_routing, adaptive_tile, fused_combine, register_tiles

HIST, SCAN, SCATTER, BLOCK_MAP = ("moe_route_histogram_i32", "moe_route_scan_i32", "moe_route_scatter_i32",
                                  "moe_route_block_map_i32")
DEQUANT, GATE_UP, DOWN, COMBINE = ("moe_dequant_experts_q4", "moe_gemm_gate_up_swiglu", "moe_gemm_down",
                                   "moe_combine_weighted_rows")
MOE_SWITCHES = ("fused_dequant", "gpu_routing", "adaptive_tile", "fused_combine", "register_tiles")
HIDDEN, EXPERT_WIDTH, TOP_K = 64, 64, 2
# Rows per expert of each call (10 experts, 2 per token, every token's experts distinct).
MOE_CALLS = {
    # 400 assignments (2 histogram chunks of 256): an empty expert, both sides of the 16- and 32-row
    # tile sizes, and a hot expert that takes 7 32-row tiles (13 with 16-row tiles).
    "prefill-400": [0, 1, 15, 16, 17, 31, 32, 33, 55, 200],
    "decode-8": [0, 3, 0, 1, 0, 2, 1, 1, 0, 0],  # 4 tokens: a decode batch
    "limit-64": [0, 1, 15, 16, 17, 15, 0, 0, 0, 0],  # exactly PER_ASSIGNMENT_MAX
    "over-66": [0, 1, 15, 16, 17, 17, 0, 0, 0, 0],  # one token more: the routed schedule
}
PER_ASSIGNMENT_MAX = 64  # docs/moe.md: calls of <= 64 assignments run one block per assignment


GEMV_GATE_UP, GEMV_DOWN = "moe_gemv_gate_up_swiglu", "moe_gemv_down"


def expected_moe_launches(state: Dict[str, bool], assignments: int) -> List[str]:
    per_assignment = assignments <= PER_ASSIGNMENT_MAX and state["fused_dequant"]
    names = [] if per_assignment else [HIST, SCAN, SCATTER] + ([BLOCK_MAP] if state["gpu_routing"] else [])
    dequant = [] if state["fused_dequant"] else [DEQUANT]
    gate_up, down = gemm_names(state, assignments)
    names += dequant * 2 + [gate_up] + dequant + [down]  # gate and up dequantised before their GEMM
    return names + ([COMBINE] if state["fused_combine"] else [])


def gemm_names(state: Dict[str, bool], assignments: int):
    """The two expert kernels: the GEMV forms for one-row blocks (row_gemv), else the GEMMs."""
    per_assignment = assignments <= PER_ASSIGNMENT_MAX and state["fused_dequant"]
    if per_assignment and state.get("row_gemv", True):
        return GEMV_GATE_UP, GEMV_DOWN
    # register_tiles (default on): the register-tiled GEMMs (widths here are multiples of 64)
    regtile = "_regtile" if state.get("register_tiles", True) else ""
    return GATE_UP + regtile, DOWN + regtile


def expected_blocks(counts: Sequence[int], state: Dict[str, bool], flat_inds: np.ndarray) -> np.ndarray:
    """The block map the GEMMs must get: (expert, first slot, rows, tile rows) per block."""
    a = len(flat_inds)
    if a <= PER_ASSIGNMENT_MAX and state["fused_dequant"]:
        return np.stack([flat_inds, np.arange(a), np.ones(a, int), np.full(a, 16)], axis=1)
    blocks, first = [], 0
    for e, c in enumerate(counts):
        tile = 32 if state["adaptive_tile"] and c >= 32 else 16
        blocks += [(e, first + s, min(tile, c - s), tile) for s in range(0, c, tile)]
        first += c
    if state["gpu_routing"]:  # an upper bound of blocks, padding rows (-1, 0, 0, 0)
        bound = max(1, min(a, (a + 15 * min(len(counts), a)) // 16))
        blocks += [(-1, 0, 0, 0)] * (bound - len(blocks))
    return np.asarray(blocks, dtype=np.int64).reshape(-1, 4)


# ----------------------------------------------------------------------------------------------
# The whole MoE block: fused_expert_up (router kernel), fused_expert_down (shared expert as expert E)

ROUTER = ["moe_router_softmax_topk_q"]  # split_router off
SPLIT_ROUTER = ["moe_router_logits_q", "moe_router_topk_from_logits"]  # split_router on
# docs/moe.md: calls of more than 8 tokens take the logits kernel of token groups (the same bits).
ROUTER_GROUP_MIN_TOKENS = 8
SPLIT_ROUTER_GROUPS = ["moe_router_logits_tokens_q", "moe_router_topk_from_logits"]
MOE_BLOCK_SWITCHES = ("fused_expert_up", "fused_expert_down", "row_gemv", "split_router", "fused_topk_gemv",
                      "fused_down_combine")
GEMV_GATE_UP_ROUTED = "moe_gemv_gate_up_swiglu_routed"
# fused_down_combine: on that decode path the down GEMV and the combine are one kernel.
GEMV_DOWN_COMBINE = "moe_gemv_down_combine"


def topk_in_gemv(state: Dict[str, bool], assignments: int) -> bool:
    """fused_topk_gemv's path: a decode call of the fused router and shared expert on the one-row GEMVs,
    the router split (logits, then the GEMV selects)."""
    return (state["fused_topk_gemv"] and state["split_router"] and state["fused_expert_up"]
            and state["fused_expert_down"] and state["fused_combine"] and state["row_gemv"]
            and state["fused_dequant"] and assignments <= PER_ASSIGNMENT_MAX)


def expected_block_launches(state: Dict[str, bool], assignments: int, tokens: int) -> List[str]:
    split = SPLIT_ROUTER_GROUPS if tokens > ROUTER_GROUP_MIN_TOKENS else SPLIT_ROUTER
    if topk_in_gemv(state, assignments):  # the top-k inside the gate/up GEMV: 4 launches (3 with fused_down_combine)
        return [split[0], GEMV_GATE_UP_ROUTED] + ([GEMV_DOWN_COMBINE] if state["fused_down_combine"]
                                                  else [GEMV_DOWN, COMBINE])
    router = (split if state["split_router"] else ROUTER) if state["fused_expert_up"] else []
    return router + expected_moe_launches(state, assignments)


@pytest.mark.parametrize("chunks", [1, 2], ids=["shared-1x", "shared-2x"])
@pytest.mark.parametrize("tokens", [3, 40])
@pytest.mark.parametrize("state", _states(MOE_BLOCK_SWITCHES + ("fused_combine",)), ids=_state_id)
def test_moe_block_switch_paths(sim, state, tokens, chunks):
    """The block's launches per switch state; with the shared expert fused (its width 1 or 2 times the
    experts'), its m chunk rows per token follow the A routed slots in the GEMMs (blocks of expert ids
    E .. E + m - 1, one row each for a decode call) and the combine reads them; the block stays close to
    stock's (fp32 oracle: the same block in fp32)."""
    from lily_mlx.ops.moe import sparse_moe_forward

    num_experts = 10
    block = make_sparse_moe_block(hidden=HIDDEN, expert_width=EXPERT_WIDTH, num_experts=num_experts, top_k=TOP_K,
                                  shared_width=chunks * EXPERT_WIDTH, seed=tokens)
    x = make_inputs(1, tokens, HIDDEN, seed=tokens)
    full = {name: switches.SWITCHES[name].default for name in switches.SWITCHES}
    full.update(state)
    with _overrides(state), record_launches() as rec:
        out = sparse_moe_forward(block, x)
        mx.eval(out)
    a = tokens * TOP_K
    assert rec.names() == expected_block_launches(full, a, tokens), rec.names()
    launches = {launch.name: launch for launch in rec}
    if topk_in_gemv(full, a):  # the GEMV writes the block map: read it where the down GEMV takes it
        gate_up = launches[GEMV_GATE_UP_ROUTED]
        down = launches[GEMV_DOWN_COMBINE if full["fused_down_combine"] else GEMV_DOWN]
        blocks = np.asarray(down.kwargs["inputs"][1])
    else:
        gate_up = launches[gemm_names(full, a)[0]]
        blocks = np.asarray(gate_up.kwargs["inputs"][2])
    shared = state["fused_expert_down"] and state["fused_combine"]
    assert gate_up.kwargs["output_shapes"][0][0] == a + (chunks * tokens if shared else 0)
    shared_blocks = blocks[blocks[:, 0] >= num_experts]
    if shared:  # every token's chunk c row exactly once, in slots A + c * N .. A + (c + 1) * N - 1
        for c in range(chunks):
            mine = shared_blocks[shared_blocks[:, 0] == num_experts + c]
            slots = np.concatenate([np.arange(f, f + r) for _, f, r, _ in mine])
            assert np.array_equal(np.sort(slots), np.arange(a + c * tokens, a + (c + 1) * tokens))
        if a <= PER_ASSIGNMENT_MAX and full["fused_dequant"]:
            assert (shared_blocks[:, 2] == 1).all()  # one-row blocks: the GEMV forms' contract
    else:
        assert len(shared_blocks) == 0

    stock = type(block).__call__(block, x)
    exact = make_sparse_moe_block(hidden=HIDDEN, expert_width=EXPERT_WIDTH, num_experts=num_experts, top_k=TOP_K,
                                  shared_width=chunks * EXPERT_WIDTH, seed=tokens)
    exact.update(block.parameters())  # the same 4-bit weights, computed in fp32
    exact.set_dtype(mx.float32)
    exact = type(exact).__call__(exact, x.astype(mx.float32))
    assert _rms_rel(out, exact) <= 3 * max(_rms_rel(stock, exact), 2e-3)


def _dense(layer):
    return dequantize_experts_reference(layer, mx.float32)


def _exact_switch_glu(sw, x, inds):
    """SwitchGLU in fp32 on the dequantised weights: x [..., D], inds [..., k] -> [..., k, D]."""
    xf = x.astype(mx.float32)
    g = mx.einsum("...d,...kod->...ko", xf, _dense(sw.gate_proj)[inds])
    u = mx.einsum("...d,...kod->...ko", xf, _dense(sw.up_proj)[inds])
    return mx.einsum("...ko,...kdo->...kd", g * mx.sigmoid(g) * u, _dense(sw.down_proj)[inds])


def _rms_rel(got, want) -> float:
    got, want = _np(got).astype(np.float64), _np(want).astype(np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2)) / max(1e-30, np.sqrt(np.mean(want ** 2))))


def _moe_problem(counts, seed=0):
    block = make_sparse_moe_block(hidden=HIDDEN, expert_width=EXPERT_WIDTH, num_experts=len(counts),
                                  top_k=TOP_K, shared_width=64, seed=seed)
    inds = routing_with_counts(counts, TOP_K, seed)  # [T, k]
    tokens = inds.shape[0]
    x = make_inputs(1, tokens, HIDDEN, seed=seed)
    weights = np.random.default_rng(seed).uniform(0.05, 1.0, (1, tokens, TOP_K))
    scores = mx.array((weights / weights.sum(-1, keepdims=True)).astype(np.float32)).astype(mx.bfloat16)
    return block, x, mx.array(inds[None].astype(np.uint32)), scores


@pytest.mark.parametrize("call", list(MOE_CALLS))
@pytest.mark.parametrize("state", _states(MOE_SWITCHES), ids=_state_id)
def test_moe_switch_paths(sim, state, call):
    counts = MOE_CALLS[call]
    block, x, inds, scores = _moe_problem(counts)
    sw = block.switch_mlp
    flat = np.asarray(inds).reshape(-1).astype(np.int64)
    assert np.array_equal(np.bincount(flat, minlength=len(counts)), counts)
    with _overrides(state), record_launches() as rec:
        out = mk.routed_experts_combined_kernel(sw, x, inds, scores)
        mx.eval(out)

    # Which kernels, in which order.
    assert rec.names() == expected_moe_launches(state, flat.size), rec.names()
    launches = {launch.name: launch for launch in rec}
    gate_up, down = (launches[name] for name in gemm_names(state, flat.size))

    # The schedule the GEMMs ran: blocks (tile rows per expert), one threadgroup row per block.
    want_blocks = expected_blocks(counts, state, flat)
    for launch, blocks in ((gate_up, gate_up.kwargs["inputs"][2]), (down, down.kwargs["inputs"][1])):
        assert np.array_equal(np.asarray(blocks), want_blocks), (launch.name, np.asarray(blocks))
        assert launch.kwargs["grid"][1] == len(want_blocks)
    tiles = set(want_blocks[want_blocks[:, 2] > 0, 3].tolist())
    if flat.size > PER_ASSIGNMENT_MAX or not state["fused_dequant"]:
        assert tiles == ({16, 32} if state["adaptive_tile"] and max(counts) >= 32 else {16})

    # fused_dequant: packed 4-bit weights into the GEMMs, or dense bf16 from the dequant kernel.
    for weight, layer in ((gate_up.kwargs["inputs"][3], sw.gate_proj), (gate_up.kwargs["inputs"][6], sw.up_proj),
                          (down.kwargs["inputs"][2], sw.down_proj)):
        if state["fused_dequant"]:
            assert weight.dtype == mx.uint32 and weight.shape == layer["weight"].shape
        else:
            e, o, kw = layer["weight"].shape
            assert weight.dtype == x.dtype and weight.shape == (e, o, kw * 8)

    # Every state: stock's function, at least as accurate as stock against the fp32 oracle.
    assert out.shape == x.shape and out.dtype == x.dtype
    with mx.stream(mx.cpu):
        stock = combine_reference(switch_glu_reference(sw, x, inds), scores)
        mx.eval(stock)
    exact = combine_reference(_exact_switch_glu(sw, x, inds), scores.astype(mx.float32))
    err, err_stock = _rms_rel(out, exact), _rms_rel(stock, exact)
    assert err <= err_stock, f"RMS error vs fp32 {err:.4g}, stock's {err_stock:.4g}"


REGISTER_BLOCK_SWITCHES = ("tall_register_blocks",)


@pytest.mark.parametrize("state", _states(("register_tiles",) + REGISTER_BLOCK_SWITCHES), ids=_state_id)
def test_tall_register_blocks_paths(sim, state):
    """tall_register_blocks: with register_tiles, the register-tiled GEMMs over 64-thread threadgroups (template
    NT = 64: 8 rows a thread in 32-row tiles) or 128 (NT = 128); without register_tiles no effect (simdgroup
    tiles, no NT). Every state gives the same bits (docs/moe.md: the register forms are the simdgroup tiles'
    arithmetic)."""
    counts = MOE_CALLS["prefill-400"]
    block, x, inds, scores = _moe_problem(counts)
    with _overrides(state), record_launches() as rec:
        out = mk.routed_experts_combined_kernel(block.switch_mlp, x, inds, scores)
        mx.eval(out)
    full = {"fused_dequant": True, "gpu_routing": True, "adaptive_tile": True, "fused_combine": True}
    full.update(state)
    launches = {launch.name: launch for launch in rec}
    nt = (64 if state["tall_register_blocks"] else 128) if state["register_tiles"] else None
    for name in gemm_names(full, sum(counts)):
        launch = launches[name]
        assert dict(launch.kwargs["template"]).get("NT") == nt, (name, launch.kwargs["template"])
        assert launch.kwargs["threadgroup"][0] == (nt or 128)
    with _overrides({"register_tiles": False}):
        want = mk.routed_experts_combined_kernel(block.switch_mlp, x, inds, scores)
    assert mx.array_equal(out, want).item()


K_SPLIT_SWITCHES = ("split_k_gate_up",)
# direct_down_combine (off by default): with the decode path of fused_down_combine, moe_gemv_down_combine_direct in
# place of moe_gemv_down_combine, the same bits; down_combine_ring and down_combine_simd_barriers (both on): that
# kernel's template PD and GS, the same bits (tests/kernels/test_moe_kernels.py).
DIRECT_SWITCHES = ("direct_down_combine", "down_combine_ring", "down_combine_simd_barriers")


@pytest.mark.parametrize("state", _states(("register_tiles",)), ids=_state_id)
def test_split_k_gate_up_paths(sim, state):
    """split_k_gate_up (docs/moe.md, "The switch"): with register_tiles, gate+up's register tiles (a prefill call)
    and its one-row GEMV (a decode-sized call) both take template SK = 4 at hidden size 256 (4 ranges of 64-value
    chunks); without register_tiles neither splits (the simdgroup tiles have no SK; the GEMV SK = 1); off, SK = 1.
    The same kernels launch in either state of the switch, and each state is at least as accurate as stock against
    the fp32 oracle (as every MoE switch state above)."""
    block = make_sparse_moe_block(hidden=256, expert_width=EXPERT_WIDTH, num_experts=10, top_k=TOP_K, shared_width=64,
                                  seed=2)
    names = {}
    for call in ("prefill-400", "decode-8"):
        inds = routing_with_counts(MOE_CALLS[call], TOP_K, 2)
        x = make_inputs(1, inds.shape[0], 256, seed=2)
        inds = mx.array(inds[None].astype(np.uint32))
        scores = mx.full(inds.shape, 0.5, dtype=mx.bfloat16)
        for split_on in (True, False):
            with _overrides({**state, "split_k_gate_up": split_on}), record_launches() as rec:
                out = mk.routed_experts_combined_kernel(block.switch_mlp, x, inds, scores)
                mx.eval(out)
            names[call, split_on] = [launch.name for launch in rec]
            with mx.stream(mx.cpu):
                stock = combine_reference(switch_glu_reference(block.switch_mlp, x, inds), scores)
                mx.eval(stock)
            exact = combine_reference(_exact_switch_glu(block.switch_mlp, x, inds), scores.astype(mx.float32))
            assert _rms_rel(out, exact) <= _rms_rel(stock, exact), (call, split_on)
            (gate_up,) = [launch for launch in rec if "gate_up" in launch.name]
            sk = dict(gate_up.kwargs["template"]).get("SK")
            if gate_up.name == GATE_UP:  # the simdgroup tiles (register_tiles off): no split to take
                assert sk is None and not state["register_tiles"]
            else:
                want = 4 if split_on and state["register_tiles"] else 1
                assert sk == want, (call, gate_up.name, gate_up.kwargs["template"])
        assert names[call, True] == names[call, False]


# ----------------------------------------------------------------------------------------------
# DeltaNet: register_scan, staged_scan, fused_recurrent_norm, fused_conv_step

DELTANET_SWITCHES = ("register_scan", "staged_scan", "fused_recurrent_norm", "fused_conv_step")
SCAN_BLOCK = 16  # docs/deltanet.md: the blockwise scan materialises the state every 16 tokens
DELTANET_TURNS = (33, 16, 1, 1)  # prefill chunks across and on block boundaries, then decode steps
HK, HV, DK, DV = 2, 4, 32, 32


def expected_deltanet_launches(state: Dict[str, bool], tokens: int) -> List[str]:
    if tokens == 1 and state["fused_recurrent_norm"]:
        if state["fused_conv_step"]:  # one kernel from the in_proj output (Dk = Dv at every shape here)
            return ["deltanet_decode_conv_fused"]
        return ["deltanet_conv_qk_norm_decode", "deltanet_decode_fused"]
    if tokens == 1:  # an unfused decode step runs the register scan for its one token
        scan = "deltanet_scan_register"
    elif state["register_scan"]:
        scan = "deltanet_scan_staged" if state["staged_scan"] else "deltanet_scan_register"
    else:
        scan = "deltanet_scan_blockwise"
    return ["deltanet_conv_qk_norm_decode", "deltanet_gates", scan, "deltanet_gated_norm"]


def _deltanet_turns(module, forward, turns, lengths):
    cache = make_cache(turns[0].shape[0], left_padding=[0] * turns[0].shape[0], lengths=lengths)
    outs, masks, records = [], [], []
    for i, h in enumerate(turns):
        mask = ssm_mask(h, cache)
        with record_launches() as rec:
            out = forward(module, h, mask=mask, cache=cache)
            mx.eval(out, cache.cache)
        outs.append(out)
        masks.append(mask)
        records.append(rec)
        if i == 0 and lengths is not None:
            cache.finalize()
    return outs, masks, records, cache


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("state", _states(DELTANET_SWITCHES), ids=_state_id)
def test_deltanet_switch_paths(sim, state, kind):
    from lily_mlx.ops.deltanet import layer as deltanet

    forward = {"qwen3_5": deltanet.qwen3_5_deltanet_forward, "qwen3_next": deltanet.qwen3_next_deltanet_forward}[kind]
    B, seed = 2, 21
    module = make_module(kind, HK, HV, DK, DV, dtype=mx.bfloat16, seed=seed)
    turns = [random_inputs(B, t, 32, mx.bfloat16, seed + i) for i, t in enumerate(DELTANET_TURNS)]
    lengths = [DELTANET_TURNS[0], 29]  # row 1 right-padded in the first chunk, as the batched generator does
    stock, masks, _, stock_cache = _deltanet_turns(module, type(module).__call__, turns, lengths)
    with _overrides(state):
        outs, _, records, cache = _deltanet_turns(module, forward, turns, lengths)

    for t, rec in zip(DELTANET_TURNS, records):
        assert rec.names() == expected_deltanet_launches(state, t), (t, rec.names())
        for launch in rec:
            if launch.name == "deltanet_scan_blockwise":  # one materialised state per 16-token block
                assert launch.kwargs["output_shapes"][2] == (B * HV, -(-t // SCAN_BLOCK), DV, DK)
            if launch.name in ("deltanet_scan_register", "deltanet_scan_staged"):
                assert len(launch.kwargs["output_shapes"]) == 2  # no block states
            if launch.name == "deltanet_decode_conv_fused":  # deltanet_decode_fused's geometry
                simdgroups = DV // (32 * 32 // DK)
                assert launch.kwargs["grid"] == (32, simdgroups, B * HV)
                assert launch.kwargs["threadgroup"] == (32, simdgroups, 1)

    exact = make_module(kind, HK, HV, DK, DV, dtype=mx.bfloat16, seed=seed)
    exact.update(tree_map(lambda p: p.astype(mx.float32), exact.parameters()))
    oracle, _, _, exact_cache = _deltanet_turns(exact, type(exact).__call__, [h.astype(mx.float32) for h in turns],
                                                lengths)
    for turn, (got, ref, want, mask) in enumerate(zip(outs, stock, oracle, masks)):
        keep = (lambda a: a) if mask is None else (lambda a, m=mask: mx.where(m[..., None], a, 0))
        assert not bool(mx.any(mx.isnan(got)).item())
        assert_as_accurate_as_stock(keep(got), keep(ref), keep(want), "output", f"turn {turn}")
    assert_as_accurate_as_stock(cache[1], stock_cache[1], exact_cache[1], "state", "final state")
    assert bool(mx.array_equal(cache[0], stock_cache[0]).item())  # the conv state is moved, not computed


# ----------------------------------------------------------------------------------------------
# Decode attention: gqa_packing, coalesced_kv (the kernel runs for a plain KVCache without a mask)

ATTENTION_SWITCHES = ("gqa_packing", "coalesced_kv")
DECODE_SIMDGROUPS = 4  # docs/attention.md


@pytest.mark.parametrize("state", _states(ATTENTION_SWITCHES), ids=_state_id)
def test_attention_switch_paths(sim, state):
    from mlx_lm.models.cache import KVCache

    from lily_mlx.ops.attention import layer as att
    from lily_mlx.ops.attention import reference as attref

    rng = np.random.default_rng(5)
    B, Hkv, G, D, S = 2, 2, 4, 64, 20

    def rand(shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    q, k, v = rand((B, Hkv * G, 1, D)), rand((B, Hkv, S, D)), rand((B, Hkv, S, D))
    cache = KVCache()
    cache.update_and_fetch(k[:, :, :S - 1], v[:, :, :S - 1])
    keys, values = cache.update_and_fetch(k[:, :, S - 1:], v[:, :, S - 1:])  # the decode step's row
    with _overrides(state), record_launches() as rec:
        out = att.attention(q, keys, values, scale=D ** -0.5, mask=None, cache=cache)
        mx.eval(out)

    assert rec.names() == ["attention_decode"]
    (launch,) = rec
    heads_per_threadgroup = G if state["gqa_packing"] else 1
    assert launch.template["GT"] == heads_per_threadgroup
    assert launch.template["COALESCED"] == int(state["coalesced_kv"])
    assert launch.kwargs["grid"] == (32, DECODE_SIMDGROUPS, B * Hkv * G // heads_per_threadgroup)
    assert launch.kwargs["threadgroup"] == (32, DECODE_SIMDGROUPS, 1)

    f32 = [a.astype(mx.float32) for a in (q, k, v)]
    want = attref.attention_reference(*f32, scale=D ** -0.5)  # fp32, not rounded
    assert out.dtype == q.dtype and not bool(mx.any(mx.isnan(out)).item())
    assert rel_l2(out, want) <= 1.05 * 2 ** -9  # one rounding to bf16, fp32 accumulation


# ----------------------------------------------------------------------------------------------
# The patched embedded model in every switch state

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""  # 31 tokens
SECOND_CHUNK = 16  # tokens: 64 expert assignments, a prefill chunk on the per-assignment MoE schedule
# Lily's logits against the fp32 model may be at most this multiple of stock bf16's distance to it
# (RMS over positions and vocabulary). Measured over 12 held-out text slices (same 31 + 16 + 1 + 1
# chunking) x every switch state: ratio 0.93 to 1.06 (lily keeps fp32 where stock rounds to bf16, but
# rounds in other places). A broken kernel moves the logits by far more.
MODEL_ERROR_FACTOR = 1.25
# Switches without kernels of their own here, and chunked_prefill (chosen by MLX-LM's prompt chunking,
# lily_mlx.patch.prefill_step_size, before the model is called): flipping them changes no launch here.
# compiled_decode replays the same launches from a trace, on Metal and CUDA only (the simulator runs
# eagerly): tests/kernels/test_compiled_decode.py; so do compiled_layers (whole DeltaNet layers) and
# compiled_attention (the attention layers' pieces; tests/core/test_compiled.py traces both on the CPU), and
# layer_replay calls those traces without choosing the path again, one_trace_attention makes an attention layer's
# two traces over its KV buffer one (tests/core/test_compiled.py). device_positions makes the step's position
# array on the GPU (same launches, same bits: tests/ops/test_attention_layer.py, test_attention_kernels.py).
# constant_weights holds the layers' weights as their traces' constants (same launches, same bits:
# tests/core/test_compiled.py); step_trace replays a whole decode step from one trace of the layers' replays (same
# launches, same bits: tests/core/test_step_trace.py, tests/model/test_decode_graph.py).
# bounded_lookahead evaluates the same graph in
# pieces (when, not what): tests/core/test_lookahead.py. fused_in_proj / fused_qkv_proj merge MLX's own
# quantised matmuls (no lily kernel; same bits): tests/core/test_projections.py. fused_residual hands the
# combine kernel one more input (same launches, same bits): tests/kernels/test_moe_model.py. dense_gemv's
# kernel is a trial kernel on every backend (off unless LILY_TRIAL_OPS names it):
# tests/kernels/test_linear_kernels.py; so are gemv_input_norm's, fused_in_proj_step's and fused_qkv_prep's, which act
# only with it (tests/kernels/test_linear_kernels.py, tests/kernels/test_deltanet_from_hidden.py,
# tests/kernels/test_attention_qkv_prep.py, tests/model/test_decode_graph.py).
NO_KERNEL_SWITCHES = ("fixed_block_attention", "chunked_prefill", "compiled_decode", "compiled_layers", "compiled_attention",
                      "layer_replay", "one_trace_attention", "device_positions", "constant_weights", "step_trace",
                      "bounded_lookahead",
                      "fused_in_proj", "fused_qkv_proj", "fused_residual", "dense_gemv", "gemv_input_norm",
                      "fused_in_proj_step", "fused_qkv_prep")
# fused_qk_prep: on, attention_qk_prep before each attention kernel; off, stock's ops
# (expected_model_launches; tests/kernels/test_attention_qk_prep.py).
QK_PREP_SWITCHES = ("fused_qk_prep",)
# fused_add_norm: on, moe_residual_rms_norm between each layer's mixer and its MoE block; off, MLX's ops.
# fused_norm_router: on, with the block's decode path (top-k in the GEMV, residual in the combine), that kernel
# and the router's logits kernel as one (moe_residual_norm_router_logits_q).
# fused_next_norm: on, with that decode path, a one-token call's combine (moe_combine_residual_norm) also computes the
# next layer's input norm (every layer but the last; tests/kernels/test_moe_kernels.py checks the hand-over).
ADD_NORM_SWITCHES = ("fused_add_norm", "fused_norm_router", "fused_next_norm")
# kv_write_in_trace (with fixed_block_attention, where the long-context op has kernels): a decode step writes its
# row into the KV buffer and attends over it through the fixed-block kernels' live-length form (blocks over the
# buffer's capacity); off, the decode kernel over the live rows. (Its traces: tests/core/test_compiled.py,
# tests/kernels/test_compiled_decode.py.)
# fused_output_gate: that merge also applies the layer's output gate (attention_decode_merge_live_blocks_gated).
KV_BUFFER_SWITCHES = ("kv_write_in_trace", "fused_output_gate")
NORM_ROUTER_NEEDS = ("fused_norm_router", "fused_add_norm", "fused_residual", "fused_expert_up", "fused_expert_down",
                     "fused_combine")
assert set(NO_KERNEL_SWITCHES) | set(MOE_SWITCHES) | set(MOE_BLOCK_SWITCHES) | set(DELTANET_SWITCHES) | set(
    ATTENTION_SWITCHES) | set(QK_PREP_SWITCHES) | set(ADD_NORM_SWITCHES) | set(REGISTER_BLOCK_SWITCHES) | set(
    KV_BUFFER_SWITCHES) | set(K_SPLIT_SWITCHES) | set(DIRECT_SWITCHES) == set(
    switches.SWITCHES), \
    "a new switch needs its expected launches here"


def expected_model_launches(state: Dict[str, bool], tokens: int, layer_types: Sequence[str], top_k: int) -> List[str]:
    """Launches of one forward call of ``tokens`` tokens (batch 1) through the patched model with a
    fresh prompt cache: per layer, its mixer's kernels then its MoE block's."""
    names = []
    add_norm = ["moe_residual_rms_norm"] if state["fused_add_norm"] else []  # after the mixer, before the block
    after_mixer = add_norm + expected_block_launches(state, tokens * top_k, tokens)
    last_after_mixer = after_mixer
    if all(state[name] for name in NORM_ROUTER_NEEDS) and topk_in_gemv(state, tokens * top_k):
        assert after_mixer[0] == "moe_residual_rms_norm", after_mixer
        assert after_mixer[1] in (SPLIT_ROUTER[0], SPLIT_ROUTER_GROUPS[0]), after_mixer
        after_mixer = last_after_mixer = ["moe_residual_norm_router_logits_q"] + after_mixer[2:]
        if state["fused_next_norm"] and tokens == 1:  # the down GEMV, then the combine with the next norm
            assert after_mixer[-1] in (COMBINE, GEMV_DOWN_COMBINE), after_mixer
            after_mixer = after_mixer[:-1] if after_mixer[-1] == GEMV_DOWN_COMBINE else after_mixer[:-2]
            after_mixer = after_mixer + [GEMV_DOWN, "moe_combine_residual_norm"]
    for i, kind in enumerate(layer_types):
        if i == len(layer_types) - 1:
            after_mixer = last_after_mixer  # no next layer to hand a norm to
        if kind == "linear_attention":
            names += expected_deltanet_launches(state, tokens)
            names += after_mixer
            continue
        if state["fused_qk_prep"]:  # q/k norms, RoPE and the gate split in one kernel
            names.append("attention_qk_prep")
        if tokens == 1 and state["kv_write_in_trace"] and state["fixed_block_attention"]:
            merge = "attention_decode_merge_live_blocks" + ("_gated" if state["fused_output_gate"] else "")
            names += ["attention_decode_block_partials_live", merge]  # over the buffer
        elif tokens == 1:  # decode over a plain KVCache, no mask: the decode attention kernel
            names.append("attention_decode")
        else:  # a prefill chunk over a plain KVCache, mask "causal": the prefill kernel (no switch)
            names.append("attention_prefill")
        names += after_mixer
    return names


@pytest.fixture(scope="module")
def embedded():
    """The shipped embedded model (bf16), the test's chunks, and the logits of stock and of the fp32
    model (same 4-bit weights; the oracle) over them."""
    import mlx_lm

    from lily_mlx.models.embedded import EMBEDDED_DIR, _is_complete

    assert _is_complete(EMBEDDED_DIR), f"the embedded model is part of the tree: {EMBEDDED_DIR}"
    model, tokenizer = mlx_lm.load(str(EMBEDDED_DIR))
    chunks = _model_chunks(tokenizer)
    stock, _ = _model_calls(model, chunks)
    exact, _ = mlx_lm.load(str(EMBEDDED_DIR))
    exact.set_dtype(mx.float32)
    oracle, _ = _model_calls(exact, chunks)
    return model, chunks, stock, oracle


def _model_calls(model, chunks):
    """Logits [tokens, vocab] fp32 of each chunk, fed in turn through one prompt cache, and the
    launch record of each call."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits, records = [], []
    for chunk in chunks:
        with record_launches() as rec:
            out = model(mx.array(chunk)[None], cache=cache)[0].astype(mx.float32)
            mx.eval(out)
        logits.append(out)
        records.append(rec)
    return mx.concatenate(logits, axis=0), records


def _model_chunks(tokenizer):
    ids = tokenizer.encode(PROMPT)
    assert len(ids) * 4 > PER_ASSIGNMENT_MAX  # the first chunk takes the routed MoE schedule
    second = tokenizer.encode(" " + "x" * 200)[:SECOND_CHUNK]
    assert len(second) == SECOND_CHUNK
    return [ids, second, [ids[0]], [ids[1]]]


MODEL_STATES = [{}] + [{name: False} for name in switches.SWITCHES]


@pytest.mark.parametrize("off", MODEL_STATES, ids=lambda s: _state_id(s) if s else "all-on")
def test_embedded_model_switch_paths(sim, embedded, off):
    """Prefill chunks of 31 and 16 tokens then two decode steps through the patched embedded model:
    every DeltaNet, attention and MoE layer runs its kernels (per the switch state; the switches
    without kernels change nothing), and the logits stay within MODEL_ERROR_FACTOR x stock's distance
    to the fp32 model."""
    import lily_mlx

    model, chunks, stock, oracle = embedded
    layer_types = ["linear_attention" if hasattr(layer, "linear_attn") else "full_attention" for layer in model.layers]
    top_k = model.layers[0].mlp.top_k
    state = {name: switches.SWITCHES[name].default for name in switches.SWITCHES}
    state.update(off)
    lily_mlx.patch(model)
    try:
        with _overrides(state):
            lily, records = _model_calls(model, chunks)
    finally:
        lily_mlx.unpatch(model)
    for chunk, rec in zip(chunks, records):
        want = expected_model_launches(state, len(chunk), layer_types, top_k)
        assert rec.names() == want, f"{len(chunk)}-token call: launched {rec.counts()}, expected {want}"

    def rms(a, b):
        return float(mx.sqrt(mx.mean((a - b) ** 2)).item())

    assert rms(lily, oracle) <= MODEL_ERROR_FACTOR * rms(stock, oracle), (rms(lily, oracle), rms(stock, oracle))
