"""Host side of the MoE kernels (``kernels/moe/routing.metal``, ``kernels/moe/gemm.metal``): dispatch table, launch geometry,
the routing schedule (GPU-resident or host-built), the grouped expert GEMMs and their shape rules (``supports``).

They run for every call size where they apply, decode steps included (``layer.sparse_moe_forward``:
batch invariance), and a token's result never depends on the other tokens of the call.

Data flow for one call (A = tokens * top_k assignments, a = token * k + j):

    inds [A] --histogram--> chunk_counts, local_rank --scan--> counts, offsets, chunk_offsets
         --scatter--> sorted_rows (slot -> a), slot_of_row (a -> slot)
         --block map--> blocks [max_blocks, 4] (expert, first slot, rows, tile rows)
    x, sorted_rows, blocks --gate_up_swiglu--> h [A, I] (slot order) --down--> y [A, D] (slot order)
    fused_combine on:  y, slot_of_row, scores --combine--> out [..., D] (weighted sum over k, token order)
    fused_combine off: y[slot_of_row] -> [..., k, D], then stock's weighted sum over k.

With ``gpu_routing`` on, all of it is one lazy graph (no host synchronisation); ``max_blocks`` is an
upper bound and padding entries of the block map make their threadgroups return at once. Off, the
counts come to the host (one sync) and the block map is built there, exactly sized.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...core import compiled, switches
from ...core.dispatch import op_backend
from ...core.kernel_registry import KernelSpec, constant_input, float32_scalar, get_kernel, record_launches
from ...core.log import log_once
from .reference import combine_reference, is_quantized_switch_linear

ROUTER = "moe/router.metal"
RESIDUAL_NORM = "moe/residual_norm.metal"
ROUTING = "moe/routing.metal"
GEMM = "moe/gemm.metal"

# (inputs, outputs) of the expert GEMMs, shared by their one-row GEMV forms: the *_s arrays are the
# shared expert's weights (expert ids E .. E + m - 1).
_GATE_UP_SIGNATURE = (
    ("x", "sorted_rows", "blocks", "w_gate", "scales_gate", "biases_gate", "w_up", "scales_up", "biases_up",
     "w_gate_s", "scales_gate_s", "biases_gate_s", "w_up_s", "scales_up_s", "biases_up_s", "params"), ("h",))
_DOWN_SIGNATURE = (
    ("h", "blocks", "w_down", "scales_down", "biases_down", "w_down_s", "scales_down_s", "biases_down_s", "params"),
    ("y",))
_GATE_UP_PARAMS = ("top_k", "D", "I", "E", "A", "N")
_DOWN_PARAMS = ("I", "D", "E", "Is")

# Dispatch table: one KernelSpec per kernel of kernels/moe/router.metal, routing.metal, gemm.metal and
# residual_norm.metal.
# The down GEMV's inputs without its params, then the combine's; one output.
_DOWN_COMBINE_SIGNATURE = (_DOWN_SIGNATURE[0][:-1] + ("scores", "gate", "residual", "params"), ("out",))
_DOWN_COMBINE_PARAMS = _DOWN_PARAMS + ("k", "A", "shared_chunks", "has_residual")
KERNELS: Dict[str, KernelSpec] = {
    "residual_norm": KernelSpec("moe_residual_rms_norm", RESIDUAL_NORM, ("x", "y", "weight", "eps", "params"),
                                ("h", "n"), params=("D",)),
    # The residual norm and the router's logits in one launch (switch fused_norm_router; decode calls).
    "residual_norm_router_logits": KernelSpec(
        "moe_residual_norm_router_logits_q", RESIDUAL_NORM,
        ("x", "y", "weight", "eps", "w_router", "scales_router", "biases_router", "w_gate", "scales_gate",
         "biases_gate", "params"), ("h", "n", "logits"), params=("D", "E", "has_gate")),
    # The combine with its residual add and the next decoder layer's input norm (switch fused_next_norm; decode).
    "combine_norm": KernelSpec("moe_combine_residual_norm", RESIDUAL_NORM,
                               ("y", "slot_of_row", "scores", "gate", "residual", "weight", "eps", "params"),
                               ("out", "n"), params=("k", "D", "A", "shared_chunks")),
    "router": KernelSpec("moe_router_softmax_topk_q", ROUTER,
                         ("x", "w_router", "scales_router", "biases_router", "w_gate", "scales_gate", "biases_gate",
                          "params"), ("inds", "scores", "gate", "blocks"),
                         params=("D", "E", "top_k", "norm_topk", "has_gate", "decode_tile", "shared_chunks")),
    # The same router in two kernels (switch split_router): the logits over many threadgroups, then the rest.
    "router_logits": KernelSpec("moe_router_logits_q", ROUTER,
                                ("x", "w_router", "scales_router", "biases_router", "w_gate", "scales_gate",
                                 "biases_gate", "params"), ("logits",), params=("D", "E", "has_gate")),
    # The logits of TT tokens per threadgroup (prompt-sized calls; the same bits).
    "router_logits_tokens": KernelSpec("moe_router_logits_tokens_q", ROUTER,
                                       ("x", "w_router", "scales_router", "biases_router", "w_gate", "scales_gate",
                                        "biases_gate", "params"), ("logits",), params=("D", "E", "has_gate", "N")),
    "router_topk": KernelSpec("moe_router_topk_from_logits", ROUTER, ("logits", "params"),
                              ("inds", "scores", "gate", "blocks"),
                              params=("E", "top_k", "norm_topk", "has_gate", "decode_tile", "shared_chunks")),
    "histogram": KernelSpec("moe_route_histogram_i32", ROUTING, ("inds", "params"), ("chunk_counts", "local_rank"),
                            params=("A", "E", "n_chunks")),
    "scan": KernelSpec("moe_route_scan_i32", ROUTING, ("chunk_counts", "params"), ("counts", "offsets", "chunk_offsets"),
                       params=("A", "E", "n_chunks")),
    "scatter": KernelSpec("moe_route_scatter_i32", ROUTING, ("inds", "local_rank", "chunk_offsets", "params"),
                          ("sorted_rows", "slot_of_row"), params=("A", "E", "n_chunks")),
    "block_map": KernelSpec("moe_route_block_map_i32", ROUTING, ("counts", "offsets", "params"), ("blocks",),
                            params=("A", "E", "max_blocks", "large_min_rows")),
    "gate_up": KernelSpec("moe_gemm_gate_up_swiglu", GEMM, *_GATE_UP_SIGNATURE, params=_GATE_UP_PARAMS),
    "down": KernelSpec("moe_gemm_down", GEMM, *_DOWN_SIGNATURE, params=_DOWN_PARAMS),
    # The same GEMMs with each thread's outputs in registers (switch register_tiles): same inputs, same bits.
    "gate_up_regtile": KernelSpec("moe_gemm_gate_up_swiglu_regtile", GEMM, *_GATE_UP_SIGNATURE,
                                  params=_GATE_UP_PARAMS),
    "down_regtile": KernelSpec("moe_gemm_down_regtile", GEMM, *_DOWN_SIGNATURE, params=_DOWN_PARAMS),
    # Decode forms of the two GEMMs for one-row blocks (switch row_gemv): same inputs, same bits. The
    # staged forms run; the rowwise ones are their benchmark baseline and test oracle (gemv_layout).
    "gemv_gate_up": KernelSpec("moe_gemv_gate_up_swiglu", GEMM, *_GATE_UP_SIGNATURE, params=_GATE_UP_PARAMS),
    # The same with each chain's weights read by its own thread (a benchmark layout, gemv_layout ("direct", R, KB):
    # level as an op, slower in a step on the H100, 2026-12-05; docs/moe.md).
    "gemv_gate_up_direct": KernelSpec("moe_gemv_gate_up_swiglu_direct", GEMM, *_GATE_UP_SIGNATURE,
                                      params=_GATE_UP_PARAMS),
    # The decode gate/up GEMV with the router's top-k inside (switch fused_topk_gemv): logits in, and the
    # top-k kernel's outputs out besides h.
    "gemv_gate_up_routed": KernelSpec(
        "moe_gemv_gate_up_swiglu_routed", GEMM, ("x", "logits") + _GATE_UP_SIGNATURE[0][3:],
        ("h", "inds", "scores", "gate", "blocks"),
        params=_GATE_UP_PARAMS + ("norm_topk", "has_gate", "decode_tile", "shared_chunks")),
    "gemv_down": KernelSpec("moe_gemv_down", GEMM, *_DOWN_SIGNATURE, params=_DOWN_PARAMS),
    # The decode down GEMV and the combine (+ the residual) in one launch (switch fused_down_combine).
    "gemv_down_combine": KernelSpec("moe_gemv_down_combine", GEMM, *_DOWN_COMBINE_SIGNATURE,
                                    params=_DOWN_COMBINE_PARAMS),
    # The same with each chain's weights read by its own thread from device memory (a layout candidate).
    "gemv_down_combine_direct": KernelSpec("moe_gemv_down_combine_direct", GEMM, *_DOWN_COMBINE_SIGNATURE,
                                           params=_DOWN_COMBINE_PARAMS),
    "gemv_gate_up_rowwise": KernelSpec("moe_gemv_gate_up_swiglu_rowwise", GEMM, *_GATE_UP_SIGNATURE,
                                       params=_GATE_UP_PARAMS),
    "gemv_down_rowwise": KernelSpec("moe_gemv_down_rowwise", GEMM, *_DOWN_SIGNATURE, params=_DOWN_PARAMS),
    "dequant": KernelSpec("moe_dequant_experts_q4", GEMM, ("w", "scales", "biases", "counts", "params"), ("w_out",),
                          params=("O", "K")),
    "combine": KernelSpec("moe_combine_weighted_rows", GEMM, ("y", "slot_of_row", "scores", "gate", "residual",
                                                                "params"),
                          ("out",), params=("k", "D", "A", "shared_chunks", "has_residual")),
}

CHUNK = 256  # assignments per threadgroup in the histogram and scatter kernels
GEMM_THREADS = 128  # 4 simdgroups
GEMM_COLS = 32  # output columns per threadgroup
# The GEMMs' tile forms: the switch register_tiles picks between simdgroup and register tiles, tall_register_blocks
# between the register form over 64 threads (8 rows a thread in 32-row tiles) and over 128; "register256"
# (benchmarks, tests) is that form over 256 threads, which also takes 64-row tiles (HUGE_TILE, host_block_map's
# huge_min_rows). Threads per threadgroup of each explicit form:
REGTILE_THREADS = {"register": GEMM_THREADS, "register64": 64, "register256": 256, "register64_rolled": 64}
# The product's gate/up register tiles unroll the loops over a thread's staged weight columns (template WR = 1), so
# that they stay in registers; "register64_rolled" (benchmarks, tests) is the 64-thread form with those loops rolled
# (WR = 0: the columns in local memory, a 64-byte stack frame under ptxas; 4-7 % slower on the H200, 2026-12-04).
REGTILE_ROLLED = frozenset({"register64_rolled"})
TILE_KINDS = ("simdgroup",) + tuple(REGTILE_THREADS)
COMBINE_THREADS = 128  # threads per threadgroup of the combine kernel, 4 columns each
# Placeholder for the combine kernel's residual input when it adds none (one element, never read).
_ONE_ZERO = {dtype: constant_input((1,), dtype) for dtype in (mx.bfloat16, mx.float16, mx.float32)}
SMALL_TILE, LARGE_TILE, HUGE_TILE = 16, 32, 64
MAX_EXPERTS = 1024  # the scan and block-map kernels keep one thread per expert in one threadgroup
NEVER = 1 << 30


def _kernel(name: str, backend: Optional[str] = None):
    return get_kernel(KERNELS[name], backend or op_backend("moe_routing"))




def _scan_threads(num_experts: int) -> int:
    return max(32, -(-num_experts // 32) * 32)


def large_min_rows(adaptive: bool) -> int:
    """The tile rule: an expert with at least 32 rows gets 32-row tiles, otherwise 16-row tiles;
    with ``adaptive_tile`` off every expert gets 16-row tiles."""
    return LARGE_TILE if adaptive else NEVER


def max_blocks_bound(num_assignments: int, num_experts: int) -> int:
    """Most blocks any routing can need: sum_e ceil(c_e / 16) <= (A + 15 * min(E, A)) / 16, and <= A."""
    a = num_assignments
    return max(1, min(a, (a + 15 * min(num_experts, a)) // 16))


# ----------------------------------------------------------------------------------------------
# Routing bookkeeping kernels


def route_histogram(inds: mx.array, num_experts: int, backend: Optional[str] = None, init_value=None):
    """inds [A] -> (chunk_counts [n_chunks, E], local_rank [A]) int32."""
    a = inds.size
    n_chunks = -(-a // CHUNK)
    return _kernel("histogram", backend)(
        inputs=[inds.reshape(-1).astype(mx.uint32), KERNELS["histogram"].pack(A=a, E=num_experts, n_chunks=n_chunks)],
        template=[("CHUNK", CHUNK)],
        grid=(n_chunks * CHUNK, 1, 1), threadgroup=(CHUNK, 1, 1),
        output_shapes=[(n_chunks, num_experts), (a,)], output_dtypes=[mx.int32, mx.int32],
        init_value=init_value,
    )


def route_scan(chunk_counts: mx.array, num_assignments: int, backend: Optional[str] = None, init_value=None):
    """chunk_counts [n_chunks, E] -> (counts [E], offsets [E + 1], chunk_offsets [n_chunks, E])."""
    n_chunks, e = chunk_counts.shape
    nt = _scan_threads(e)
    return _kernel("scan", backend)(
        inputs=[chunk_counts, KERNELS["scan"].pack(A=num_assignments, E=e, n_chunks=n_chunks)],
        template=[("NT", nt)],
        grid=(nt, 1, 1), threadgroup=(nt, 1, 1),
        output_shapes=[(e,), (e + 1,), (n_chunks, e)], output_dtypes=[mx.int32] * 3,
        init_value=init_value,
    )


def route_scatter(inds: mx.array, local_rank: mx.array, chunk_offsets: mx.array,
                  backend: Optional[str] = None, init_value=None):
    """-> (sorted_rows [A]: slot -> assignment, slot_of_row [A]: assignment -> slot)."""
    a = inds.size
    n_chunks, e = chunk_offsets.shape
    return _kernel("scatter", backend)(
        inputs=[inds.reshape(-1).astype(mx.uint32), local_rank, chunk_offsets, KERNELS["scatter"].pack(A=a, E=e, n_chunks=n_chunks)],
        template=[("CHUNK", CHUNK)],
        grid=(n_chunks * CHUNK, 1, 1), threadgroup=(CHUNK, 1, 1),
        output_shapes=[(a,), (a,)], output_dtypes=[mx.int32, mx.int32],
        init_value=init_value,
    )


def route_block_map(counts: mx.array, offsets: mx.array, num_assignments: int, adaptive: bool,
                    backend: Optional[str] = None, init_value=None):
    """-> blocks [max_blocks, 4] int32: (expert, first slot, rows, tile rows); padding (-1, 0, 0, 0)."""
    e = counts.shape[0]
    nt = _scan_threads(e)
    max_blocks = max_blocks_bound(num_assignments, e)
    (blocks,) = _kernel("block_map", backend)(
        inputs=[counts, offsets, KERNELS["block_map"].pack(
            A=num_assignments, E=e, max_blocks=max_blocks, large_min_rows=large_min_rows(adaptive))],
        template=[("NT", nt)],
        grid=(nt, 1, 1), threadgroup=(nt, 1, 1),
        output_shapes=[(max_blocks, 4)], output_dtypes=[mx.int32],
        init_value=init_value,
    )
    return blocks


def host_block_map(counts, adaptive: bool, huge_min_rows: int = NEVER) -> np.ndarray:
    """The same block map built on the host from the counts, exactly sized: [n_blocks, 4]. ``huge_min_rows``
    (benchmarks, tests): experts with at least that many rows get 64-row tiles, which only the 256-thread
    register tiles (``tiles="register256"``) take."""
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    threshold = large_min_rows(adaptive)
    rows = []
    for e, c in enumerate(counts):
        tile = HUGE_TILE if c >= huge_min_rows else LARGE_TILE if c >= threshold else SMALL_TILE
        for start in range(0, int(c), tile):
            rows.append((e, offsets[e] + start, min(tile, int(c) - start), tile))
    return np.asarray(rows, dtype=np.int32).reshape(-1, 4)


def routing_schedule(inds: mx.array, num_experts: int, gpu_routing: bool, adaptive: bool,
                     backend: Optional[str] = None):
    """Everything the grouped GEMMs need for one chunk: dict of counts, sorted_rows, slot_of_row,
    blocks. gpu_routing=False brings the counts to the host (one synchronisation)."""
    a = inds.size
    inds = inds.reshape(-1)
    chunk_counts, local_rank = route_histogram(inds, num_experts, backend)
    counts, offsets, chunk_offsets = route_scan(chunk_counts, a, backend)
    sorted_rows, slot_of_row = route_scatter(inds, local_rank, chunk_offsets, backend)
    if gpu_routing:
        blocks = route_block_map(counts, offsets, a, adaptive, backend)
    else:
        blocks = mx.array(host_block_map(counts.tolist(), adaptive))  # host synchronisation
    return {"counts": counts, "sorted_rows": sorted_rows, "slot_of_row": slot_of_row, "blocks": blocks}


# Calls with at most this many assignments (decode: B * top_k rows) skip the routing kernels: each
# assignment becomes its own one-row block, in assignment order. The GEMMs' arithmetic per output
# element is the same in any block layout (one fp32 accumulator, same K order: kernels/moe/gemm.metal),
# so this changes launches, not results: a token gets the same bits alone, in a decode batch or in a
# prefill chunk (tests/kernels/test_batch_invariance.py). 4 routing launches saved per MoE layer.
PER_ASSIGNMENT_MAX = 64


@lru_cache(maxsize=PER_ASSIGNMENT_MAX)
def _per_assignment_tail(a: int):
    """(identity [A], block columns 1..3 [A, 3] = (slot a, 1 row, 16-row tile)), built once per A."""
    identity = np.arange(a, dtype=np.int32)
    tail = np.stack([identity, np.ones(a, np.int32), np.full(a, SMALL_TILE, np.int32)], axis=1)
    return mx.array(identity), mx.array(tail)


def per_assignment_schedule(inds: mx.array):
    """The schedule of a small call without routing kernels: sorted_rows = slot_of_row = identity,
    block a = (expert inds[a], slot a, 1 row, 16-row tile). Two MLX ops, no kernel launch."""
    flat = inds.reshape(-1, 1).astype(mx.int32)  # [A, 1]
    identity, tail = _per_assignment_tail(flat.shape[0])
    blocks = mx.concatenate([flat, tail], axis=1)  # [A, 4]
    return {"counts": None, "sorted_rows": identity, "slot_of_row": identity, "blocks": blocks}


# ----------------------------------------------------------------------------------------------
# Grouped expert GEMMs


def dequantize_experts(layer, counts: mx.array, dtype, backend: Optional[str] = None, init_value=None) -> mx.array:
    """[E, O, K] dequantised weights of experts with rows (others left unwritten): fused_dequant off."""
    w, scales, biases = layer["weight"], layer["scales"], layer["biases"]
    e, o, kw = w.shape
    k = kw * 8
    (out,) = _kernel("dequant", backend)(
        inputs=[w, scales, biases, counts, KERNELS["dequant"].pack(O=o, K=k)],
        template=[("T", dtype)],
        grid=(o * k // 8, e, 1), threadgroup=(256, 1, 1),
        output_shapes=[(e, o, k)], output_dtypes=[dtype],
        init_value=init_value,
    )
    return out


def _weights(layer, fused_dequant: bool, counts, dtype, backend):
    if fused_dequant:
        return [layer["weight"], layer["scales"], layer["biases"]]
    # The scales/biases inputs are unused by the dense-weight tile loader.
    return [dequantize_experts(layer, counts, dtype, backend), layer["scales"], layer["biases"]]


def shared_chunks(shared, expert_width: int) -> int:
    """m: the shared expert's width in chunks of the experts' width (0 without a fused shared expert)."""
    return 0 if shared is None else shared.gate_proj["scales"].shape[0] // expert_width


def _shared_weights(shared_layer, fallback) -> list:
    """The shared expert's 4-bit (weight, scales, biases) for the GEMMs' ``*_s`` inputs; without a fused
    shared expert, the experts' own arrays stand in (no block reads them)."""
    layer = shared_layer if shared_layer is not None else fallback
    return [layer["weight"], layer["scales"], layer["biases"]]


GEMV_MAX_K = 4096  # kernels/moe/gemm.metal: MOE_GEMV_MAX_K, the rowwise forms' staged row

# The staged decode GEMVs (kernels/moe/gemm.metal): (outputs per threadgroup R, K chunk KC) per kernel.
# gate+up: 2R threads (a gate and an up chain per output), K = hidden (2048 at Qwen3.6: 8 chunks);
# down: R threads, K = expert width (512: 2 chunks). One simdgroup per threadgroup for both: on the H200
# (2026-12-01, op cases gemv_*_x8[1tok]) R = 16 / 32 ran gate+up 18 % and down 7 % faster than R = 32 / 64
# (more, smaller threadgroups; same bits at any layout). Bench variants: lily_dev/moe_bench.py.
GEMV_LAYOUT = {"gate_up": (16, 256), "down": (32, 256)}
# Switch split_k_gate_up (a candidate): gate+up's sums as this many K ranges (halved until the GEMV's chunks divide
# K: 2 at the embedded model's hidden size 128), and the decode GEMVs' (R, KC) then. (16, 64, 4) is one of the
# layouts the op cases time (lily_dev/moe_bench.py GEMV_SPLIT_VARIANTS); until they are timed it is a guess.
GATE_UP_K_SPLIT = 4
GATE_UP_SPLIT_ROWS_CHUNK = (16, 64)
GEMV_THREADGROUP_BYTES = 32 * 1024  # Apple's threadgroup memory limit


# K chunks a staged GEMV may take, largest first (the layout's KC is the most it takes). 512 only where a layout asks
# for it (benchmark layouts: gate+up at (16, 512) ran 2.8x slower than the product's (16, 256) on the H100, down at
# (32, 512) 14 % faster as an op, 2026-12-05; docs/moe.md).
GEMV_CHUNKS = (512, 256, 128, 64)


def gemv_stage_bytes(matrices: int, rows: int, chunk: int, split: int = 1) -> int:
    """Threadgroup memory of a staged GEMV: two buffers of packed rows (padded by one uint4), scales and
    biases as floats and the activation chunk as floats (each ``split`` times: the K-split candidate), plus the
    gate+up form's R up sums."""
    chains = matrices * rows * split
    per_buffer = chains * (chunk // 32 + 1) * 16 + 2 * chains * (chunk // 64) * 4 + split * chunk * 4
    return 2 * per_buffer + (rows * 4 if matrices == 2 else 0)


@lru_cache(maxsize=None)
def gemv_geometry(name: str, width: int, k: int, layout=None, other_bytes: int = 0):
    """(rows R, chunk KC) of staged GEMV ``name`` ('gate_up' / 'down') for output width ``width`` and
    reduction length ``k``: R from ``layout`` (default GEMV_LAYOUT) halved until it divides the width,
    KC the largest of GEMV_CHUNKS (at most the layout's) dividing k whose buffers fit 32 KB beside
    ``other_bytes`` of the kernel's own threadgroup memory. A layout (R, KC, SK) (gate+up only: the K-split
    candidate, benchmarks and tests) returns (R, KC, SK), KC then dividing k / SK."""
    rows, chunk, *rest = layout or GEMV_LAYOUT[name]
    split = rest[0] if rest else 1
    if split > 1 and name != "gate_up":
        raise ValueError(f"staged GEMV {name}: the K split is a gate+up candidate only")
    matrices = 2 if name == "gate_up" else 1
    while width % rows:
        rows //= 2
    if (matrices * rows * split) % 32:  # whole simdgroups (the bridge runs nothing else with barriers)
        raise ValueError(f"staged GEMV {name}: {matrices} x {rows} x {split} threads are not whole simdgroups")
    for kc in GEMV_CHUNKS:
        if (kc <= chunk and k % (kc * split) == 0
                and gemv_stage_bytes(matrices, rows, kc, split) + other_bytes <= GEMV_THREADGROUP_BYTES):
            return (rows, kc) if not rest else (rows, kc, split)
    raise ValueError(f"no staged GEMV chunk for {name} at width {width}, K {k}, layout {layout}")


def gemv_direct_geometry(name: str, width: int, k: int, rows: int, batch_groups: int) -> tuple:
    """(R, KB) of ``moe_gemv_gate_up_swiglu_direct`` (a layout candidate: each chain's weight row read by its
    thread, KB quantisation groups a register batch) for output width ``width`` and reduction length ``k``; raises
    where the layout does not fit (R not dividing the width, 2R not whole simdgroups, KB not dividing k / 64, the
    activation row past 32 KB)."""
    if (name != "gate_up" or width % rows or (2 * rows) % 32 or k % 64 or (k // 64) % batch_groups
            or (k + rows) * 4 > GEMV_THREADGROUP_BYTES):
        raise ValueError(f"direct GEMV {name}: layout (R {rows}, KB {batch_groups}) does not fit width {width}, "
                         f"K {k}")
    return rows, batch_groups


# Output columns per threadgroup of moe_gemv_down_combine: each block's GEMV in a group of that many threads.
DOWN_COMBINE_ROWS = 16


def _down_combine_groups(blocks_per_token: int, width: int, rows: int) -> Optional[int]:
    """NG of moe_gemv_down_combine (both layouts): the blocks rounded up to whole simdgroups of groups of ``rows``
    threads; None where ``rows`` does not divide the width or the groups pass one threadgroup's 1,024 threads."""
    groups = -(-blocks_per_token * rows // 32) * 32 // rows
    return None if width % rows or groups * rows > 1024 else groups


@lru_cache(maxsize=None)
def down_combine_geometry(blocks_per_token: int, width: int, k: int, rows: Optional[int] = None,
                          chunks: tuple = (256, 128, 64)) -> Optional[tuple]:
    """(R, KC, NG) of ``moe_gemv_down_combine`` for a token's ``blocks_per_token`` down GEMVs (k routed + m
    shared chunks) of output width ``width`` and reduction length ``k``: R = ``rows`` columns a threadgroup
    (default ``DOWN_COMBINE_ROWS``, read at the first call so that a benchmark's ``--set`` reaches it; benchmarks and
    tests try others), NG groups of R threads (the blocks, rounded up to whole simdgroups), KC the first of
    ``chunks`` dividing k whose double-buffered staging, once per group, fits 32 KB; None where nothing fits or R
    does not divide the width."""
    rows = rows or DOWN_COMBINE_ROWS
    groups = _down_combine_groups(blocks_per_token, width, rows)
    if groups is None:
        return None
    for kc in chunks:
        if k % kc == 0 and groups * gemv_stage_bytes(1, rows, kc) <= GEMV_THREADGROUP_BYTES:
            return rows, kc, groups
    return None


# batch_groups: at 4 (Qwen3.6's down: 8 groups, two batches) ptxas issues all 16 of a row's 16-byte loads before the
# first sum (121 registers); at 8 it spreads them through the sums again (48 registers; sm_90a, 2026-12-04).
@lru_cache(maxsize=None)
def down_combine_direct_geometry(blocks_per_token: int, width: int, k: int, rows: int = DOWN_COMBINE_ROWS,
                                 batch_groups: tuple = (4, 2, 1)) -> Optional[tuple]:
    """(R, KB, NG) of ``moe_gemv_down_combine_direct`` (each chain's weight row read by its thread from device
    memory): R and NG as ``down_combine_geometry``, KB the first of ``batch_groups`` quantisation groups a register
    batch dividing k / 64; None where k is no multiple of 64, R does not divide the width, or the NG activation
    rows (k floats each) and results do not fit 32 KB."""
    groups = _down_combine_groups(blocks_per_token, width, rows)
    if groups is None or k % 64 or groups * (k + rows) * 4 > GEMV_THREADGROUP_BYTES:
        return None
    kb = next(b for b in batch_groups if (k // 64) % b == 0)
    return rows, kb, groups


@lru_cache(maxsize=None)
def gemv_threads(width: int) -> int:
    """Threads per rowwise GEMV threadgroup: the largest of 256, 128, 64, 32 dividing the output width."""
    return next(t for t in (256, 128, 64, 32) if width % t == 0)


# Down's columns per threadgroup, widest first (16 column groups x TN columns a thread): 64 (TN = 4) was 1.06-1.17x
# faster than 128 (TN = 8) at 2K and 8K tokens in two H200 runs, at 512 once faster, once 1.06x slower
# (docs/results/2026-12-02-h200-register-tiles).
REGTILE_DOWN_COLUMNS = (64,)


@lru_cache(maxsize=None)
def regtile_columns(name: str, width: int) -> Optional[int]:
    """Output columns per threadgroup of the register-tiled form of GEMM ``name`` ("gate_up" or "down")
    at this output width (16 column groups x 4 or 8 columns per thread), or None where it does not apply."""
    for cols in ((64,) if name == "gate_up" else REGTILE_DOWN_COLUMNS):
        if width % cols == 0:
            return cols
    return None


def gemm_gate_up_swiglu(x2d: mx.array, sorted_rows: mx.array, blocks: mx.array, gate_proj, up_proj,
                        top_k: int, fused_dequant: bool = True, counts: Optional[mx.array] = None,
                        backend: Optional[str] = None, init_value=None, shared=None, gemv: bool = False,
                        gemv_layout=None, tile_dtype=None, tiles: Optional[str] = None,
                        k_split: int = 1) -> mx.array:
    """h [A (+ N), I] (slot order) = silu(x Wg^T) * (x Wu^T) for the rows of every block. ``shared``:
    the shared expert (an MLP of 4-bit gate/up/down projections) as m chunks, experts E .. E + m - 1,
    rows A + c * N + n.
    ``gemv``: the one-row-block form (every block must have one row; 4-bit weights). ``gemv_layout``
    (benchmarks, tests): None, the staged GEMV at GEMV_LAYOUT; (R, KC) another staged layout;
    'rowwise' the rowwise form as it was before the staged one (a nibble conversion per weight),
    'rowwise_exp' the rowwise form with q4_value; ('direct', R, KB) gate+up with each chain's weight row read by
    its thread, KB quantisation groups a register batch (a layout candidate). All give the same bits.
    ``tile_dtype`` (benchmarks, tests): the GEMM tiles' operand type, float32 (default; the same bits as
    the GEMVs) or the activation dtype (bf16/f16 fragments with fp32 accumulation: tensor cores through
    the bridge; not the same bits as the GEMVs, so not a product path yet, docs/moe.md).
    ``tiles`` (benchmarks, tests): "simdgroup", "register" (the register-tiled form, fp32 operands, same
    bits), "register64" (that form over 64 threads) or "register256" (over 256 threads: the only one that takes
    64-row tiles); None: as the switch register_tiles says.
    ``k_split`` (benchmarks, tests; register tiles only): the K-split candidate's arithmetic, each sum over
    ``k_split`` contiguous K ranges added in range order: the bits of the staged GEMV at layout (R, KC, k_split)."""
    n, d = x2d.shape
    e, i = gate_proj["scales"].shape[:2]
    a = sorted_rows.size
    inputs = [x2d, sorted_rows, blocks]
    inputs += _weights(gate_proj, fused_dequant, counts, x2d.dtype, backend)
    inputs += _weights(up_proj, fused_dequant, counts, x2d.dtype, backend)
    inputs += _shared_weights(shared.gate_proj if shared is not None else None, gate_proj)
    inputs += _shared_weights(shared.up_proj if shared is not None else None, up_proj)
    inputs.append(KERNELS["gate_up"].pack(top_k=top_k, D=d, I=i, E=e, A=a, N=n))
    rows = a + shared_chunks(shared, i) * n
    return _launch_expert_kernel("gate_up", gemv, inputs, blocks, (rows, i), x2d.dtype, backend, init_value,
                                 d, gemv_layout, tile_dtype, tiles, k_split)


def _register_tiles(name: str, width: int, tile_dtype, tiles: Optional[str]) -> Optional[int]:
    """Columns per threadgroup when the register-tiled form runs this GEMM, else None (simdgroup tiles)."""
    if tiles is not None and tiles not in TILE_KINDS:
        raise ValueError(f"tiles: one of {TILE_KINDS}, not {tiles!r}")
    wanted = tiles in REGTILE_THREADS or (tiles is None and switches.is_enabled("register_tiles"))
    if not wanted or (tile_dtype is not None and tile_dtype != mx.float32):
        if tiles in REGTILE_THREADS:
            raise ValueError("register tiles take fp32 operands only")
        return None
    cols = regtile_columns(name, width)
    if cols is None:
        if tiles in REGTILE_THREADS:
            raise ValueError(f"register tiles: output width {width} is not a multiple of 64")
        log_once(f"moe_regtile:{name}:{width}",
                 f"moe_grouped_gemm: simdgroup tiles for {name} (output width {width} not a multiple of 64)")
    return cols


def gate_up_split(width: int, k: int, fused_dequant: bool = True) -> int:
    """The K split of gate+up's sums for a call of output width ``width`` (the expert width) and reduction length
    ``k``: GATE_UP_K_SPLIT where switch ``split_k_gate_up`` is on and both forms take it (the register tiles run
    gate+up at this width, 4-bit weights dequantised in the kernels), halved until k is a multiple of the split's
    GEMV chunks; else 1. From shapes and switches alone, never from the call's size, so that a token's bits do not
    depend on it."""
    if (not (switches.is_enabled("split_k_gate_up") and fused_dequant and switches.is_enabled("register_tiles"))
            or regtile_columns("gate_up", width) is None):
        return 1
    split = GATE_UP_K_SPLIT
    while split > 1 and k % (GATE_UP_SPLIT_ROWS_CHUNK[1] * split):
        split //= 2
    return split


def gate_up_split_layout(split: int) -> Optional[tuple]:
    """The decode GEMVs' staged layout (R, KC, split) for ``gate_up_split``'s split; None (the default) at 1."""
    return (*GATE_UP_SPLIT_ROWS_CHUNK, split) if split > 1 else None


def _launch_expert_kernel(name: str, gemv: bool, inputs, blocks: mx.array, out_shape, dtype, backend,
                          init_value, k: int, gemv_layout=None, tile_dtype=None, tiles=None,
                          k_split: int = 1) -> mx.array:
    """Launch expert GEMM ``name`` over ``blocks`` (reduction length ``k``), or its one-row GEMV form:
    out [rows, width]. ``k_split`` > 1: gate+up's register tiles with the K-split candidate's arithmetic."""
    width = out_shape[1]
    template = [("T", dtype)]
    if k_split > 1 and (gemv or name != "gate_up" or _register_tiles(name, width, tile_dtype, tiles) is None
                        or k % (32 * k_split)):
        raise ValueError(f"K split {k_split}: gate+up's register tiles only, with K ({k}) a multiple of 32 x the split")
    if gemv and gemv_layout in ("rowwise", "rowwise_exp"):
        if k > GEMV_MAX_K:
            raise ValueError(f"rowwise GEMV: K {k} > {GEMV_MAX_K}")
        grid, threads, name = (width, blocks.shape[0], 1), (gemv_threads(width), 1, 1), f"gemv_{name}_rowwise"
        template.append(("CVT", int(gemv_layout == "rowwise_exp")))
    elif gemv and isinstance(gemv_layout, tuple) and gemv_layout[0] == "direct":
        rows, kb = gemv_direct_geometry(name, width, k, *gemv_layout[1:])
        grid, threads, name = (width // rows * 2 * rows, blocks.shape[0], 1), (2 * rows, 1, 1), f"gemv_{name}_direct"
        template += [("R", rows), ("KB", kb), ("KX", k)]
    elif gemv:
        rows, chunk, *rest = gemv_geometry(name, width, k, gemv_layout)
        split = rest[0] if rest else 1
        chains = rows * (2 if name == "gate_up" else 1) * split
        grid, threads = (width // rows * chains, blocks.shape[0], 1), (chains, 1, 1)
        template += [("R", rows), ("KC", chunk)] + ([("SK", split)] if name == "gate_up" else [])
        name = "gemv_" + name
    elif (cols := _register_tiles(name, width, tile_dtype, tiles)) is not None:
        nt = REGTILE_THREADS[tiles or ("register64" if switches.is_enabled("tall_register_blocks") else "register")]
        grid, threads = (width // cols * nt, blocks.shape[0], 1), (nt, 1, 1)
        template.append(("NT", nt))
        if name == "down":
            template.append(("TN", cols // 16))
        else:
            template += [("WR", int(tiles not in REGTILE_ROLLED)), ("SK", k_split)]
        name += "_regtile"
    else:
        grid, threads = (width // GEMM_COLS * GEMM_THREADS, blocks.shape[0], 1), (GEMM_THREADS, 1, 1)
        if tile_dtype is not None and tile_dtype not in (mx.float32, dtype):
            raise ValueError(f"tile operands: float32 or the activation dtype {dtype}, not {tile_dtype}")
        template.append(("MT", tile_dtype or mx.float32))
    (out,) = _kernel(name, backend)(
        inputs=inputs, template=template, grid=grid, threadgroup=threads,
        output_shapes=[out_shape], output_dtypes=[dtype], init_value=init_value,
    )
    return out


def gemm_down(h: mx.array, blocks: mx.array, down_proj, fused_dequant: bool = True,
              counts: Optional[mx.array] = None, backend: Optional[str] = None, init_value=None,
              shared=None, gemv: bool = False, gemv_layout=None, tile_dtype=None,
              tiles: Optional[str] = None) -> mx.array:
    """y [rows, D] (slot order) = h Wd^T for the rows of every block (``shared``: the chunks' down;
    ``gemv``: the one-row-block form; ``gemv_layout``, ``tile_dtype``, ``tiles`` as for gemm_gate_up_swiglu)."""
    rows, i = h.shape
    e, d = down_proj["scales"].shape[:2]
    inputs = [h, blocks] + _weights(down_proj, fused_dequant, counts, h.dtype, backend)
    inputs += _shared_weights(shared.down_proj if shared is not None else None, down_proj)
    shared_width = i * max(1, shared_chunks(shared, i))
    inputs.append(KERNELS["down"].pack(I=i, D=d, E=e, Is=shared_width))
    return _launch_expert_kernel("down", gemv, inputs, blocks, (rows, d), h.dtype, backend, init_value, i,
                                 gemv_layout, tile_dtype, tiles)


# The staged down+combine's chunks in flight with switch down_combine_ring (template PD of moe_gemv_down_combine; the
# same bits at any value; off: 1, the staged GEMVs' schedule). At 4 the kernel took 18-24 % less time in a 4K step
# (H100, 2026-12-05: 15.9 against 19.3-21.0 us a layer; docs/moe.md).
DOWN_COMBINE_IN_FLIGHT = 4


def chunks_in_flight(chunks: int, most: int) -> int:
    """The most chunks in flight, halved until it divides ``chunks`` (at least 1)."""
    in_flight = max(1, most)
    while chunks % in_flight:
        in_flight //= 2
    return in_flight


def down_combine_schedule(rows_per_tg: int, direct: bool) -> dict:
    """The staged down+combine's switches as ``gemv_down_combine``'s arguments: chunks in flight (switch
    ``down_combine_ring``: ``DOWN_COMBINE_IN_FLIGHT``, else 1) and the groups' simdgroup barriers (switch
    ``down_combine_simd_barriers``, where a group of ``rows_per_tg`` threads lies in one simdgroup)."""
    if direct:
        return {}
    simd = switches.is_enabled("down_combine_simd_barriers")
    if simd and 32 % rows_per_tg:
        log_once(f"down_combine_simd_barriers:{rows_per_tg}", f"down_combine_simd_barriers: groups of {rows_per_tg} "
                 "threads do not lie in one simdgroup, the down+combine waits at threadgroup barriers")
        simd = False
    return {"in_flight": DOWN_COMBINE_IN_FLIGHT if switches.is_enabled("down_combine_ring") else 1,
            "simd_barriers": simd}


def gemv_down_combine(h: mx.array, blocks: mx.array, down_proj, shared, scores: mx.array, gate: mx.array,
                      residual: Optional[mx.array], geometry: tuple, backend: Optional[str] = None,
                      init_value=None, direct: bool = False, in_flight: Optional[int] = None,
                      simd_barriers: bool = False) -> mx.array:
    """out [N, D] = ``combine_rows(gemm_down(h, blocks, ..., gemv=True), identity, scores, gate=gate,
    residual=residual)`` in one launch (switch ``fused_down_combine``), the same bits: a decode call's one-row
    blocks (the gate/up GEMV's schedule: routed rows then ``shared``'s chunks), h [N * (k + m), I], scores [N, k]
    (h's dtype), gate [N] fp32, residual [N, D] or None. ``geometry``: ``down_combine_geometry``'s (R, KC, NG), or
    with ``direct`` (each chain's weights read by its thread, a layout candidate) ``down_combine_direct_geometry``'s
    (R, KB, NG). ``in_flight``: the staged layout's chunks in flight (default ``DOWN_COMBINE_IN_FLIGHT``, halved until
    it divides I / KC). ``simd_barriers`` (staged layout, R dividing 32): each group of R chains waits between chunks
    at a simdgroup barrier instead of the threadgroup's (switch ``down_combine_simd_barriers``; the same bits)."""
    n, k = scores.shape
    rows, i = h.shape
    e, d = down_proj["scales"].shape[:2]
    m = shared_chunks(shared, i)
    blocks_per_token = rows // n
    inputs = [h, blocks] + _weights(down_proj, True, None, h.dtype, backend)
    inputs += _shared_weights(shared.down_proj, down_proj)
    inputs += [scores, gate, residual if residual is not None else _ONE_ZERO[h.dtype]]
    inputs.append(KERNELS["gemv_down_combine"].pack(I=i, D=d, E=e, Is=i * max(1, m), k=k, A=n * k, shared_chunks=m,
                                                    has_residual=residual is not None))
    rows_per_tg, chunk, groups = geometry
    name = "gemv_down_combine_direct" if direct else "gemv_down_combine"
    sizes = [("KB", chunk), ("KX", i)] if direct else [("KC", chunk)]
    ring = [] if direct else [("PD", chunks_in_flight(i // chunk, in_flight or DOWN_COMBINE_IN_FLIGHT)),
                              ("GS", int(simd_barriers))]
    (out,) = _kernel(name, backend)(
        inputs=inputs, template=[("T", h.dtype), ("R", rows_per_tg), *sizes, ("NBLK", blocks_per_token),
                                 ("NG", groups), *ring],
        grid=(d * groups, n, 1), threadgroup=(rows_per_tg * groups, 1, 1),
        output_shapes=[(n, d)], output_dtypes=[h.dtype], init_value=init_value)
    return out


def combine_rows(y: mx.array, slot_of_row: mx.array, scores: mx.array, backend: Optional[str] = None,
                 init_value=None, gate: Optional[mx.array] = None, chunks: int = 1,
                 residual: Optional[mx.array] = None) -> mx.array:
    """out [N, D] = sum_j scores[n, j] * y[slot_of_row[n * k + j]] (+ gate[n] * sum_c y[A + c * N + n],
    the shared expert's ``chunks`` rows): y [A (+ chunks * N), D] (slot order), scores [N, k] (any
    float dtype), gate [N] fp32; fp32 accumulation, output in y's dtype. ``residual`` [N, D] (y's dtype):
    ``residual + out`` in the same launch, the bits of MLX's add of the two."""
    d = y.shape[1]
    n, k = scores.shape
    a = slot_of_row.size
    groups = -(-d // (4 * COMBINE_THREADS))
    m = chunks if gate is not None else 0
    (out,) = _kernel("combine", backend)(
        inputs=[y, slot_of_row, scores, gate if m else float32_scalar(0.0),
                residual if residual is not None else _ONE_ZERO[y.dtype],
                KERNELS["combine"].pack(k=k, D=d, A=a, shared_chunks=m, has_residual=residual is not None)],
        template=[("T", y.dtype)],
        grid=(groups * COMBINE_THREADS, n, 1), threadgroup=(COMBINE_THREADS, 1, 1),
        output_shapes=[(n, d)], output_dtypes=[y.dtype], init_value=init_value,
    )
    return out


def combine_rows_norm(y: mx.array, slot_of_row: mx.array, scores: mx.array, residual: mx.array, weight: mx.array,
                      eps: float, backend: Optional[str] = None, init_value=None, gate: Optional[mx.array] = None,
                      chunks: int = 1):
    """(out, n): out = ``combine_rows(..., residual=residual)`` (its bits) and n = rms_norm(out) * weight (the
    next decoder layer's input norm, ``residual_rms_norm``'s arithmetic) in one launch (switch
    ``fused_next_norm``), one threadgroup per token. y, slot_of_row, scores, gate, chunks: as ``combine_rows``;
    residual [N, D] (y's dtype); weight [D]."""
    d = y.shape[1]
    n, k = scores.shape
    m = chunks if gate is not None else 0
    spec = KERNELS["combine_norm"]
    out, normed = _kernel("combine_norm", backend)(
        inputs=[y, slot_of_row, scores, gate if m else float32_scalar(0.0), residual, weight, float32_scalar(eps),
                spec.pack(k=k, D=d, A=slot_of_row.size, shared_chunks=m)],
        template=[("T", y.dtype), ("PER_THREAD", norm_per_thread(d))],
        grid=(NORM_THREADS, n, 1), threadgroup=(NORM_THREADS, 1, 1),
        output_shapes=[(n, d), (n, d)], output_dtypes=[y.dtype, y.dtype], init_value=init_value,
    )
    return out, normed


# ----------------------------------------------------------------------------------------------
# The decoder layer's residual add + post-attention RMSNorm (fused_add_norm)

NORM_THREADS = 256  # kernels/moe/residual_norm.metal: MOE_NORM_THREADS
NORM_MAX_HIDDEN = 8192  # a thread holds 3 x D / NORM_THREADS floats in registers


def norm_per_thread(d: int) -> int:
    """The residual-norm kernel's PER_THREAD: the elements each of its threads owns."""
    return -(-d // NORM_THREADS)


def residual_norm_reason(norm, x: mx.array, y: mx.array) -> Optional[str]:
    """None when the residual-norm kernel computes ``x + y`` and ``norm`` of it; else why not."""
    if compiled.stock_type(norm) is not nn.RMSNorm:
        return f"post-attention norm {type(norm).__name__} (nn.RMSNorm only)"
    if x.dtype not in (mx.bfloat16, mx.float16, mx.float32) or y.dtype != x.dtype or x.shape != y.shape:
        return f"residual {x.dtype} {x.shape} and mixer output {y.dtype} {y.shape}"
    if norm.weight.dtype != x.dtype or norm.weight.shape != (x.shape[-1],):
        return f"norm weight {norm.weight.dtype} {norm.weight.shape} for activations {x.dtype}"
    if x.shape[-1] > NORM_MAX_HIDDEN:
        return f"hidden size {x.shape[-1]} > {NORM_MAX_HIDDEN} (the kernel keeps a row in registers)"
    return None


def residual_rms_norm(x: mx.array, y: mx.array, weight: mx.array, eps: float, backend: Optional[str] = None,
                      init_value=None):
    """(h, n): h = x + y (the bits of MLX's add), n = rms_norm(h) * weight with stock's rounding points;
    x, y [..., D], one launch."""
    d = x.shape[-1]
    rows = x.size // d
    # In and out in the call's shape (the kernel reads rows of D): no reshape primitives to evaluate.
    h, n = get_kernel(KERNELS["residual_norm"], backend or op_backend("moe_residual_norm"))(
        inputs=[x, y, weight, float32_scalar(eps), KERNELS["residual_norm"].pack(D=d)],
        template=[("T", x.dtype), ("PER_THREAD", norm_per_thread(d))], grid=(NORM_THREADS, rows, 1),
        threadgroup=(NORM_THREADS, 1, 1), output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype],
        init_value=init_value,
    )
    return h, n


# ----------------------------------------------------------------------------------------------
# Router kernel and the shared expert (fused_expert_up, fused_expert_down)

ROUTER_THREADS = 512  # kernels/moe/router.metal: MOE_ROUTER_THREADS
ROUTER_LOGIT_SIMDGROUPS = 8  # kernels/moe/router.metal: MOE_ROUTER_LOGIT_SIMDGROUPS (expert rows per threadgroup)
# Prompt-sized router calls: tokens per threadgroup of moe_router_logits_tokens_q, which calls of more than
# ROUTER_GROUP_MIN_TOKENS tokens take (decode calls keep the one-token form; either gives the same bits).
ROUTER_TOKENS_PER_GROUP = 8
ROUTER_GROUP_MIN_TOKENS = 8
ROUTER_MAX_EXPERTS = 1024  # kernels/moe/router.metal's threadgroup arrays
ROUTER_MAX_HIDDEN = 4096  # kernels/moe/router.metal: MOE_ROUTER_MAX_D (the staged activation row)
ROUTER_MAX_TOP_K = 32  # kernels/moe/router.metal: MOE_ROUTER_MAX_K (one lane per pick)


def _quantization(layer) -> str:
    """``affine 4-bit group 64``: a quantised layer's format as a reason names it (no group where the layer has none)."""
    group = getattr(layer, "group_size", None)
    return f"{layer.mode} {layer.bits}-bit" + (f" group {group}" if group else "")


def _quantized_linear_reason(layer, x: mx.array, bits: tuple, what: str) -> Optional[str]:
    if not (hasattr(layer, "scales") and hasattr(layer, "bits")):
        return f"{what} is not quantised"
    if layer.mode != "affine" or layer.bits not in bits or layer.group_size != 64:
        return f"{what} is {_quantization(layer)}, the kernel takes affine {bits} group 64"
    if layer.get("biases") is None or "bias" in layer:
        return f"{what} has no affine biases, or has an output bias"
    if layer["scales"].dtype != x.dtype:
        return f"{what} scales are {layer['scales'].dtype}, activations {x.dtype}"
    return None


def router_reason(block, x: mx.array, with_gate: bool) -> Optional[str]:
    """None when the router kernel computes this block's routing (and, ``with_gate``, its shared
    expert's gate) for activations like ``x``; else why not."""
    reason = _quantized_linear_reason(block.gate, x, (4, 8), "router")
    if reason is None and with_gate:
        reason = _quantized_linear_reason(block.shared_expert_gate, x, (4, 8), "shared-expert gate")
        if reason is None and block.shared_expert_gate.bits != block.gate.bits:
            reason = "router and shared-expert gate have different bit widths"
    if reason is None and block.gate["scales"].shape[0] > ROUTER_MAX_EXPERTS:
        reason = f"{block.gate['scales'].shape[0]} experts (the router kernel takes <= {ROUTER_MAX_EXPERTS})"
    if reason is None and x.shape[-1] > ROUTER_MAX_HIDDEN:
        reason = f"hidden size {x.shape[-1]} (the router kernel takes <= {ROUTER_MAX_HIDDEN})"
    if reason is None and block.top_k > ROUTER_MAX_TOP_K:
        reason = f"top-{block.top_k} routing (the router kernel takes k <= {ROUTER_MAX_TOP_K})"
    return reason


def shared_expert_reason(block, x: mx.array) -> Optional[str]:
    """None when the grouped GEMMs can run the block's shared expert as experts E .. E + m - 1; else why not."""
    shared = getattr(block, "shared_expert", None)
    if shared is None or getattr(block, "shared_expert_gate", None) is None:
        return "block has no gated shared expert"
    if type(shared).__call__ is not _swiglu_mlp_call():
        return f"shared expert {type(shared).__name__} is not MLX-LM's SwiGLU MLP"
    for name in ("gate_proj", "up_proj", "down_proj"):
        reason = _quantized_linear_reason(getattr(shared, name), x, (4,), f"shared expert {name}")
        if reason is not None:
            return reason
    width, expert_width = shared.gate_proj["scales"].shape[0], block.switch_mlp.gate_proj["scales"].shape[1]
    if width % expert_width != 0:
        return f"shared expert width {width} is not a multiple of the experts' {expert_width}"
    return None


@lru_cache(maxsize=1)
def _swiglu_mlp_call():
    from mlx_lm.models.qwen3_next import Qwen3NextMLP

    return Qwen3NextMLP.__call__


def router_logits(block, x2d: mx.array, with_gate: bool, backend: Optional[str] = None, init_value=None,
                  tokens_per_group: Optional[int] = None):
    """moe_router_logits_q: x [N, D] -> logits [N, E + 1] fp32 (each rounded to T; row E the shared
    expert's gate), one simdgroup per expert row (switch split_router). Calls of more than
    ROUTER_GROUP_MIN_TOKENS tokens run moe_router_logits_tokens_q, ROUTER_TOKENS_PER_GROUP tokens a threadgroup
    (each router word read once for them; the same bits). ``tokens_per_group`` (tests, benchmarks): 1 for the
    one-token form, another count for the grouped one, whatever N."""
    n, d = x2d.shape
    router, gate = block.gate, block.shared_expert_gate if with_gate else block.gate
    e = router["scales"].shape[0]
    threads = 32 * ROUTER_LOGIT_SIMDGROUPS
    row_groups = -(-(e + int(with_gate)) // ROUTER_LOGIT_SIMDGROUPS)
    weights = [x2d, router["weight"], router["scales"], router["biases"], gate["weight"], gate["scales"],
               gate["biases"]]
    template = [("T", x2d.dtype), ("BITS", router.bits)]
    tt = tokens_per_group or (ROUTER_TOKENS_PER_GROUP if n > ROUTER_GROUP_MIN_TOKENS else 1)
    if tt == 1:
        name, inputs = "router_logits", weights + [KERNELS["router_logits"].pack(D=d, E=e, has_gate=with_gate)]
    else:
        name, inputs = "router_logits_tokens", weights + [KERNELS["router_logits_tokens"].pack(
            D=d, E=e, has_gate=with_gate, N=n)]
        template.append(("TT", tt))
    (logits,) = _kernel(name, backend)(
        inputs=inputs, template=template, grid=(threads, -(-n // tt), row_groups), threadgroup=(threads, 1, 1),
        output_shapes=[(n, e + 1)], output_dtypes=[mx.float32], init_value=init_value)
    return logits


ROUTED_GEMV_PROBS_BYTES = 4 * (ROUTER_MAX_EXPERTS + 1) + 4  # kernels/moe/gemm.metal: the routed form's own


# The routed gate+up GEMV's chunks in flight (template PD of moe_gemv_gate_up_swiglu_routed, moe_gemv_staged_ring; the
# same bits at any value): 1, the staged schedule, until timed. A candidate after the down+combine's ring took 18-24 %
# off that kernel (H100, 2026-12-05); at R = 16 each thread holds ~44 registers of a 256-wide chunk (so PD 2 there, or
# PD 4 with chunks of 128 / 64 through GEMV_LAYOUT: see the CUDA fit test).
GATE_UP_IN_FLIGHT = 1


def gemv_gate_up_routed(block, x2d: mx.array, logits: mx.array, backend: Optional[str] = None, init_value=None,
                        in_flight: Optional[int] = None):
    """The decode gate/up GEMV with the router's top-k inside (switch ``fused_topk_gemv``): x [N, D] and the
    router's logits -> (h [N * (k + m), I], inds [N, k], scores [N, k], gate [N] fp32, blocks [N * (k + m), 4]),
    the same bits as ``route_tokens`` followed by the one-row gate/up GEMV. The block's shared expert is fused
    (m of its chunks, experts E .. E + m - 1); 4-bit weights (the caller checks). ``in_flight``: chunks in flight
    (default ``GATE_UP_IN_FLIGHT``, halved until it divides the chunks; without the K split only)."""
    n, d = x2d.shape
    sw = block.switch_mlp
    e, i = sw.gate_proj["scales"].shape[:2]
    k = block.top_k
    shared = block.shared_expert
    m = shared_chunks(shared, i)
    rows = n * (k + m)
    split = gate_up_split(i, d)  # (switch split_k_gate_up: the GEMM tiles of larger calls split alike)
    inputs = [x2d, logits]
    inputs += _weights(sw.gate_proj, True, None, x2d.dtype, backend)
    inputs += _weights(sw.up_proj, True, None, x2d.dtype, backend)
    inputs += _shared_weights(shared.gate_proj, sw.gate_proj) + _shared_weights(shared.up_proj, sw.up_proj)
    inputs.append(KERNELS["gemv_gate_up_routed"].pack(
        top_k=k, D=d, I=i, E=e, A=n * k, N=n, norm_topk=bool(block.norm_topk_prob), has_gate=True,
        decode_tile=SMALL_TILE, shared_chunks=m))
    rows_per_tg, chunk, *_ = gemv_geometry("gate_up", i, d, gate_up_split_layout(split), ROUTED_GEMV_PROBS_BYTES)
    threads = 2 * rows_per_tg * split
    ring = chunks_in_flight(d // chunk, in_flight or GATE_UP_IN_FLIGHT) if split == 1 else 1
    template = [("T", x2d.dtype), ("R", rows_per_tg), ("KC", chunk), ("NPL", -(-e // 32)), ("SK", split),
                ("PD", ring)]
    return _kernel("gemv_gate_up_routed", backend)(
        inputs=inputs, template=template, grid=(i // rows_per_tg * threads, rows, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(rows, i), (n, k), (n, k), (n,), (rows, 4)],
        output_dtypes=[x2d.dtype, mx.int32, x2d.dtype, mx.float32, mx.int32], init_value=init_value)


def route_tokens(block, x2d: mx.array, with_gate: bool, backend: Optional[str] = None, init_value=None):
    """The router kernel(s): x [N, D] -> inds [N, k] int32, scores [N, k], gate [N] fp32 (the shared
    expert's sigmoid gate; zeros without ``with_gate``), blocks [N * k (+ N), 4] (the one-row decode
    schedule, shared-expert rows last). Switch ``split_router``: the logits over many threadgroups, then
    the top-k kernel (same bits); off: one threadgroup per token does everything."""
    n, d = x2d.shape
    router, gate = block.gate, block.shared_expert_gate if with_gate else block.gate
    e = router["scales"].shape[0]
    k = block.top_k
    m = shared_chunks(block.shared_expert if with_gate else None, block.switch_mlp.gate_proj["scales"].shape[1])
    rows = n * (k + m)
    weights = [x2d, router["weight"], router["scales"], router["biases"], gate["weight"], gate["scales"],
               gate["biases"]]
    select = dict(top_k=k, norm_topk=bool(block.norm_topk_prob), has_gate=with_gate, decode_tile=SMALL_TILE,
                  shared_chunks=m)
    per_lane = -(-e // 32)  # experts per lane of the selection (its keys in registers)
    outputs = dict(output_shapes=[(n, k), (n, k), (n,), (rows, 4)],
                   output_dtypes=[mx.int32, x2d.dtype, mx.float32, mx.int32], init_value=init_value)
    if not switches.is_enabled("split_router"):
        return _kernel("router", backend)(
            inputs=weights + [KERNELS["router"].pack(D=d, E=e, **select)],
            template=[("T", x2d.dtype), ("BITS", router.bits), ("NPL", per_lane)],
            grid=(ROUTER_THREADS, n, 1), threadgroup=(ROUTER_THREADS, 1, 1), **outputs)
    logits = router_logits(block, x2d, with_gate, backend, init_value)
    return _kernel("router_topk", backend)(  # one simdgroup per token: the selection needs no more
        inputs=[logits, KERNELS["router_topk"].pack(E=e, **select)], template=[("T", x2d.dtype), ("NPL", per_lane)],
        grid=(32, n, 1), threadgroup=(32, 1, 1), **outputs)


@lru_cache(maxsize=256)
def shared_expert_blocks(num_tokens: int, chunks: int, num_routed: int, num_experts: int, tile: int,
                         one_row: bool) -> mx.array:
    """Blocks of the shared expert's chunks c (expert id E + c) over slots A + c * N .. A + (c + 1) * N - 1:
    tiles of ``tile`` rows, or one row per block (``one_row``: the per-assignment schedule)."""
    step = 1 if one_row else tile
    rows = [(num_experts + c, num_routed + c * num_tokens + start, min(step, num_tokens - start), tile)
            for c in range(chunks) for start in range(0, num_tokens, step)]
    return mx.array(np.asarray(rows, dtype=np.int32).reshape(-1, 4))


# ----------------------------------------------------------------------------------------------
# The routed-experts forward of a prefill chunk


def supports(switch_mlp, x: mx.array, num_experts: int) -> Optional[str]:
    """None when the kernels can run this block/input; else why they cannot."""
    from mlx_lm.models.switch_layers import SwiGLU

    if not isinstance(getattr(switch_mlp, "activation", None), SwiGLU):
        return "activation is not SwiGLU"
    for name in ("gate_proj", "up_proj", "down_proj"):
        layer = getattr(switch_mlp, name)
        if not is_quantized_switch_linear(layer):
            return "expert weights are not quantised"
        if layer.bits != 4 or layer.group_size != 64 or layer.mode != "affine":
            return f"experts are {_quantization(layer)}, kernels need affine 4-bit group 64"
        if layer.get("biases") is None or getattr(layer, "global_scale", None) is not None or "bias" in layer:
            return "expert layer has no affine biases, or has a global scale or an output bias"
        if layer["scales"].dtype != x.dtype:
            return f"activation dtype {x.dtype} differs from the scales' dtype {layer['scales'].dtype}"
    if x.dtype not in (mx.bfloat16, mx.float16):
        return f"activation dtype {x.dtype} (kernels take bf16/fp16)"
    if num_experts > MAX_EXPERTS:
        return f"{num_experts} experts (kernels take <= {MAX_EXPERTS})"
    return None


@lru_cache(maxsize=None)
def kernels_unavailable(backend: str) -> Optional[str]:
    """Why this backend cannot build the MoE kernels (its runtime missing), or None. Cached: the
    answer does not change within a process."""
    try:
        for spec in KERNELS.values():
            get_kernel(spec, backend)
    except (ImportError, AttributeError) as e:
        return f"{backend} kernel runtime unavailable: {e}"
    return None


def _static_reason(switch_mlp, x: mx.array, num_experts: int) -> Optional[str]:
    """``supports`` for this layer and activation dtype, computed once per (layer, dtype):
    it depends only on the layer's weights and quantisation, which a forward never changes."""
    cache = switch_mlp.__dict__.setdefault("_lily_moe_support", {})
    key = x.dtype
    if key not in cache:
        cache[key] = supports(switch_mlp, x, num_experts)
    return cache[key]


def moe_unavailable_reason(switch_mlp, x: mx.array, backend: str) -> Optional[str]:
    """Why the grouped kernels cannot run this layer on ``backend`` (logged once), or None."""
    num_experts = switch_mlp.gate_proj["weight"].shape[0]
    reason = _static_reason(switch_mlp, x, num_experts)
    if reason is not None:
        log_once(f"moe_grouped_gemm:{reason}", f"moe_grouped_gemm: reference path ({reason})")
        return reason
    reason = kernels_unavailable(backend)
    if reason is not None:
        log_once(f"moe_grouped_gemm:{backend}:unavailable", f"moe_grouped_gemm: reference path ({reason})")
    return reason


def _schedule(inds: mx.array, num_experts: int, fused: bool, backend: str, decode_blocks=None,
              num_shared_rows: int = 0, chunks: int = 0):
    """The GEMMs' schedule for this call: per-assignment blocks for small calls (``decode_blocks``
    from the router kernel when it ran), else the routing kernels' block map; with a fused shared
    expert its ``chunks`` x ``num_shared_rows`` rows' blocks (expert ids E + c, slots A ..) come last."""
    a = inds.size
    if a <= PER_ASSIGNMENT_MAX and fused:
        if decode_blocks is not None:
            identity = _per_assignment_tail(a)[0]
            return {"counts": None, "sorted_rows": identity, "slot_of_row": identity, "blocks": decode_blocks,
                    "one_row_blocks": True}
        schedule = per_assignment_schedule(inds)
        tile, one_row = SMALL_TILE, True
    else:
        adaptive = switches.is_enabled("adaptive_tile")
        schedule = routing_schedule(inds, num_experts, switches.is_enabled("gpu_routing"), adaptive, backend)
        tile, one_row = (LARGE_TILE if adaptive and num_shared_rows >= LARGE_TILE else SMALL_TILE), False
    if num_shared_rows and chunks:
        shared = shared_expert_blocks(num_shared_rows, chunks, a, num_experts, tile, one_row)
        schedule["blocks"] = mx.concatenate([schedule["blocks"], shared], axis=0)
    schedule["one_row_blocks"] = one_row
    return schedule


def _routed_rows(switch_mlp, x: mx.array, inds: mx.array, shared=None, decode_blocks=None, checked: bool = False):
    """Routing schedule and the down GEMM's output: (y [A (+ m * N), D] in slot order, schedule, backend),
    or None when the kernels do not apply (said once in the log). ``shared``: the shared expert, run as
    m chunks of the experts' width, experts E .. E + m - 1 (rows A + c * N + n). ``checked``: the caller
    has established that they apply."""
    backend = op_backend("moe_grouped_gemm")
    if not checked and moe_unavailable_reason(switch_mlp, x, backend) is not None:
        return None
    num_experts = switch_mlp.gate_proj["weight"].shape[0]
    fused = switches.is_enabled("fused_dequant")
    x2d = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])  # the caller's array when 2-D (decode plans)
    n_shared = x2d.shape[0] if shared is not None else 0
    chunks = shared_chunks(shared, switch_mlp.gate_proj["scales"].shape[1])
    schedule = _schedule(inds, num_experts, fused, backend, decode_blocks, n_shared, chunks)
    top_k = inds.shape[-1]
    # One-row blocks (the per-assignment schedule) run the GEMV forms: same bits, far less work.
    gemv = schedule["one_row_blocks"] and switches.is_enabled("row_gemv")
    split = gate_up_split(switch_mlp.gate_proj["scales"].shape[1], x2d.shape[-1], fused)
    h = gemm_gate_up_swiglu(x2d, schedule["sorted_rows"], schedule["blocks"], switch_mlp.gate_proj,
                            switch_mlp.up_proj, top_k, fused, schedule["counts"], backend, shared=shared, gemv=gemv,
                            gemv_layout=gate_up_split_layout(split) if gemv else None,
                            k_split=split if not gemv else 1)
    y = gemm_down(h, schedule["blocks"], switch_mlp.down_proj, fused, schedule["counts"], backend, shared=shared,
                  gemv=gemv)
    return y, schedule, backend


def routed_experts_kernel(switch_mlp, x: mx.array, inds: mx.array) -> Optional[mx.array]:
    """Routed experts with the kernels: x [..., D], inds [..., k] -> [..., k, D] (stock's SwitchGLU
    output), or None when the kernels do not apply (then the caller runs the reference)."""
    routed = _routed_rows(switch_mlp, x, inds)
    if routed is None:
        return None
    y, schedule, _ = routed
    y = mx.take(y, schedule["slot_of_row"], axis=0)  # back to assignment order
    return y.reshape(*inds.shape, x.shape[-1])


def _fused_combine_enabled(width: int) -> bool:
    fused = switches.is_enabled("fused_combine")
    if fused and width % 4 != 0:
        log_once("fused_combine:width", f"fused_combine: hidden size {width} is not a multiple of 4, "
                 "combining with gather + weighted sum instead")
        fused = False
    return fused


def routed_experts_combined_kernel(switch_mlp, x: mx.array, inds: mx.array, scores: mx.array) -> Optional[mx.array]:
    """Routed experts weighted and summed over k: x [..., D], inds/scores [..., k] -> [..., D], or
    None when the kernels do not apply. ``fused_combine`` off: gather, multiply, sum (stock's ops)."""
    if not _fused_combine_enabled(x.shape[-1]):
        y = routed_experts_kernel(switch_mlp, x, inds)
        return None if y is None else combine_reference(y, scores)
    routed = _routed_rows(switch_mlp, x, inds)
    if routed is None:
        return None
    y, schedule, backend = routed
    k = inds.shape[-1]
    out = combine_rows(y, schedule["slot_of_row"], scores.reshape(-1, k), backend)
    return out.reshape(x.shape)


def sparse_moe_kernels(block, x: mx.array, residual: Optional[mx.array] = None) -> Optional[mx.array]:
    """The whole sparse MoE block on the kernels (router, routed experts, shared expert): x [..., D]
    -> [..., D], or None when the grouped kernels do not apply (the caller runs the reference).
    ``residual`` (x's shape and dtype): ``residual + block(x)`` is returned instead, the add inside the
    combine kernel where the shared expert is fused into it (same bits as MLX's add), else MLX's add.

    fused_expert_up: the router kernel gives indices, scores, the shared expert's gate and (small
    calls) the GEMMs' schedule; off, stock's router ops. fused_expert_down: the shared expert runs in
    the grouped GEMMs as experts E .. E + m - 1 (m chunks of the experts' width) and the combine adds
    it, gated; off, MLX's matmuls add it after."""
    backend = op_backend("moe_grouped_gemm")
    if moe_unavailable_reason(block.switch_mlp, x, backend) is not None:
        return None
    x2d = x.reshape(-1, x.shape[-1])
    k = block.top_k
    fused_combine = _fused_combine_enabled(x.shape[-1])
    fuse_shared = (fused_combine and switches.is_enabled("fused_expert_down")
                   and _cached_reason(block, x, "shared", shared_expert_reason) is None)
    router_backend = op_backend("moe_router")
    fuse_router = (switches.is_enabled("fused_expert_up") and router_backend != "reference"
                   and _cached_reason(block, x, ("router", fuse_shared), router_reason, fuse_shared) is None)
    r2d = None
    if residual is not None:
        if fuse_shared and residual.dtype == x.dtype and residual.shape == x.shape:
            r2d = residual.reshape(x2d.shape)
        else:
            out = sparse_moe_kernels(block, x)
            return None if out is None else residual + out
    args = (x2d,) if r2d is None else (x2d, r2d)
    if (fuse_router and fuse_shared and x2d.shape[0] * k <= PER_ASSIGNMENT_MAX and switches.is_enabled("fused_dequant")
            and switches.is_enabled("row_gemv")):
        # A decode-sized call on the fused path: replayed from a plan after the first call. The key
        # holds everything the launches' geometry depends on (sharding or re-quantising changes it; every
        # switch state, so that a plan is only used in the state it was recorded in).
        key = (x2d.shape, x.dtype, backend, router_backend, block.gate["weight"].shape,
               block.switch_mlp.gate_proj["weight"].shape, block.shared_expert.gate_proj["weight"].shape,
               switches.key(), r2d is not None)

        def general(x2, r2=None):
            return _block_general(block, x2, True, True, router_backend, residual2d=r2)

        out = compiled.call(block, key, general, args) if compiled.enabled(backend, router_backend) else None
        if out is None:
            out = _planned(block, args, key, general)
        return out.reshape(x.shape)
    return _block_general(block, x2d, fuse_router, fuse_shared, router_backend, fused_combine,
                          residual2d=r2d).reshape(x.shape)


_UNPLANNABLE = object()
# Inputs a decode plan may keep from its recorded call: shape constants, never data (the residual only as
# the placeholder of a call without one: a real residual is one of the call's activations).
_PLAN_CONSTANTS = frozenset({"params", "sorted_rows", "slot_of_row", "residual"})


def _planned(block, args, key, general):
    """``general(*args)`` recorded on the first call for ``key``, then replayed by its ``DecodePlan``."""
    from .decode_plan import DecodePlan

    if compiled.inlining():  # traced as part of a larger piece: no plan recorded from its placeholders
        return general(*args)
    plans = block.__dict__.setdefault("_lily_decode_plans", {})
    plan = plans.get(key)
    if plan is None:
        with record_launches() as record:
            out = general(*args)
        plans[key] = DecodePlan.record(block, args, record, out, _input_names, _PLAN_CONSTANTS) or _UNPLANNABLE
        return out
    return general(*args) if plan is _UNPLANNABLE else plan(block, args)


@lru_cache(maxsize=None)
def _input_names(kernel_name: str):
    return next(spec.input_names for spec in KERNELS.values() if spec.name == kernel_name)


def _block_general(block, x2d: mx.array, fuse_router: bool, fuse_shared: bool, router_backend: str,
                   fused_combine: bool = True, residual2d: Optional[mx.array] = None) -> mx.array:
    """The block on the kernels, building every launch: out [N, D] (``residual2d + out`` when given, added
    by the combine kernel: callers pass it only with the shared expert fused, ``sparse_moe_kernels``)."""
    from .reference import router_reference, shared_expert_reference

    k = block.top_k
    if fuse_router and fuse_shared and fused_combine and _topk_in_gemv(x2d.shape[0] * k):
        return _decode_block_topk_in_gemv(block, x2d, router_backend, residual2d)
    decode_blocks = None
    if fuse_router:
        inds, scores, gate, decode_blocks = route_tokens(block, x2d, fuse_shared, router_backend)
        gate = gate if fuse_shared else None
    else:
        inds, scores = router_reference(block.gate(x2d), k, block.norm_topk_prob)
        gate = None
        if fuse_shared:
            gate = mx.sigmoid(block.shared_expert_gate(x2d)).reshape(-1).astype(mx.float32)

    if not fused_combine:
        y = routed_experts_kernel(block.switch_mlp, x2d, inds)
        out = combine_reference(y, scores)
    else:
        shared = block.shared_expert if fuse_shared else None
        y, schedule, backend = _routed_rows(block.switch_mlp, x2d, inds, shared, decode_blocks, checked=True)
        chunks = shared_chunks(shared, block.switch_mlp.gate_proj["scales"].shape[1])
        out = combine_rows(y, schedule["slot_of_row"], scores, backend, gate=gate, chunks=chunks,
                           residual=residual2d)
    if not fuse_shared:
        out = out + shared_expert_reference(block, x2d)
    return out


def norm_router_reason(block, norm, x: mx.array, y: mx.array, backend: str) -> Optional[str]:
    """None when ``residual_norm_router_logits`` and the decode GEMVs compute this call's residual add,
    post-attention norm and MoE block on ``backend`` (``norm``: the decoder layer's post-attention RMSNorm;
    x, y [..., D] the residual and the mixer's output), the bits of the unfused kernels; else why not. The
    switch states are the caller's (``layer.post_mixer``)."""
    reason = residual_norm_reason(norm, x, y)
    if reason is not None:
        return reason
    if moe_unavailable_reason(block.switch_mlp, x, backend) is not None:
        return "the MoE kernels do not apply"
    for what, check, args in (("shared", shared_expert_reason, ()), (("router", True), router_reason, (True,))):
        reason = _cached_reason(block, x, what, check, *args)
        if reason is not None:
            return reason
    if x.shape[-1] % 4 != 0:
        return f"hidden size {x.shape[-1]} is not a multiple of 4 (fused_combine)"
    return None


def residual_norm_router_logits(block, norm, x: mx.array, y: mx.array, backend: Optional[str] = None,
                                init_value=None):
    """(h [N, D], n [N, D], logits [N, E + 1] fp32): ``residual_rms_norm(x, y, ...)`` and
    ``router_logits(block, n, True)`` in one launch (switch ``fused_norm_router``), the same bits; x, y
    [..., D] (N rows); the shared expert's gate logit in column E."""
    d = x.shape[-1]
    n = x.size // d
    router, gate = block.gate, block.shared_expert_gate
    e = router["scales"].shape[0]
    spec = KERNELS["residual_norm_router_logits"]
    return _kernel("residual_norm_router_logits", backend or op_backend("moe_router"))(
        inputs=[x, y, norm.weight, float32_scalar(norm.eps), router["weight"], router["scales"], router["biases"],
                gate["weight"], gate["scales"], gate["biases"], spec.pack(D=d, E=e, has_gate=True)],
        template=[("T", x.dtype), ("BITS", router.bits), ("PER_THREAD", norm_per_thread(d))],
        grid=(NORM_THREADS, n, -(-(e + 1) // ROUTER_LOGIT_SIMDGROUPS)), threadgroup=(NORM_THREADS, 1, 1),
        output_shapes=[(n, d), (n, d), (n, e + 1)], output_dtypes=[x.dtype, x.dtype, mx.float32],
        init_value=init_value)


def _topk_in_gemv(assignments: int) -> bool:
    """Whether a call of ``assignments`` (token, expert) pairs takes the decode path with the router's top-k
    inside the gate/up GEMV (switch ``fused_topk_gemv``; with split_router, the one-row GEMVs)."""
    return (assignments <= PER_ASSIGNMENT_MAX and switches.is_enabled("fused_topk_gemv")
            and switches.is_enabled("split_router") and switches.is_enabled("row_gemv")
            and switches.is_enabled("fused_dequant"))


def _decode_block_topk_in_gemv(block, x2d: mx.array, router_backend: str,
                               residual2d: Optional[mx.array] = None, logits: Optional[mx.array] = None,
                               next_norm=None):
    """A decode call of the block in four launches: the router's logits (unless given: ``logits`` from
    ``residual_norm_router_logits``), the gate/up GEMV that selects each token's experts itself (and writes
    the top-k kernel's outputs), the down GEMV, the combine (+ the residual); three with the down GEMV and the
    combine as one (switch ``fused_down_combine``). The bits of the five-launch path (route_tokens, then the
    GEMVs). ``next_norm`` (weight, eps), with ``residual2d``: the combine also
    normalises its output for the next layer (``combine_rows_norm``) and (out, n) is returned."""
    backend = op_backend("moe_grouped_gemm")
    sw, shared = block.switch_mlp, block.shared_expert
    if logits is None:
        logits = router_logits(block, x2d, True, router_backend)
    h, inds, scores, gate, blocks = gemv_gate_up_routed(block, x2d, logits, backend)
    chunks = shared_chunks(shared, sw.gate_proj["scales"].shape[1])
    if next_norm is None and switches.is_enabled("fused_down_combine"):
        # Switch direct_down_combine (off, a candidate; the same bits): GPU time of a 4K step's 40 launches under
        # Nsight Compute, H100 761.2 us against 1,010.6 staged (2026-12-05), H200 911.7 against 982.0 (2026-12-04);
        # decode in bursts no faster with it (H100, 2026-12-05: off 1.045x at 4K, 1.030x at 32K).
        direct = (switches.is_enabled("direct_down_combine")
                  and down_combine_direct_geometry(block.top_k + chunks, x2d.shape[1], h.shape[1]))
        geometry = direct or down_combine_geometry(block.top_k + chunks, x2d.shape[1], h.shape[1])
        if geometry is not None:
            return gemv_down_combine(h, blocks, sw.down_proj, shared, scores, gate, residual2d, geometry, backend,
                                     direct=bool(direct), **down_combine_schedule(geometry[0], bool(direct)))
        log_once("fused_down_combine:shape", f"fused_down_combine: {block.top_k} + {chunks} down GEMVs of width "
                 f"{x2d.shape[1]} do not fit one threadgroup, running the down GEMV and the combine apart")
    y = gemm_down(h, blocks, sw.down_proj, True, None, backend, shared=shared, gemv=True)
    slot_of_row = _per_assignment_tail(inds.size)[0]
    if next_norm is not None:
        return combine_rows_norm(y, slot_of_row, scores, residual2d, next_norm[0], next_norm[1], backend, gate=gate,
                                 chunks=chunks)
    return combine_rows(y, slot_of_row, scores, backend, gate=gate, chunks=chunks, residual=residual2d)


def decode_block_from_norm(layer, x: mx.array, mixed: mx.array, backend: str, next_norm=None):
    """A decoder layer's work after its mixer for a decode call, in four launches (switch
    ``fused_norm_router``): h = x + mixed, the post-attention norm and the router's logits in one
    (``residual_norm_router_logits``), then the gate/up GEMV (top-k inside), the down GEMV and the combine
    with the residual h (one launch with ``fused_down_combine``: three in all). x, mixed [..., D] -> h +
    mlp(norm(h)) [..., D]; the caller checks ``norm_router_reason`` and the switches (``layer.post_mixer``).
    ``next_norm`` (weight [D], eps): the combine also computes the next layer's input norm of the output, and
    (out, n) is returned (switch ``fused_next_norm``)."""
    h, normed, logits = residual_norm_router_logits(layer.mlp, layer.post_attention_layernorm, x, mixed, backend)
    out = _decode_block_topk_in_gemv(layer.mlp, normed, backend, residual2d=h, logits=logits, next_norm=next_norm)
    if next_norm is not None:
        return out[0].reshape(x.shape), out[1].reshape(x.shape)
    return out.reshape(x.shape)


def _cached_reason(block, x: mx.array, what, check, *args) -> Optional[str]:
    """``check(block, x, *args)`` once per (block, activation dtype, what): it depends only on the
    block's weights and quantisation, which a forward never changes. The reason is logged once."""
    cache = block.__dict__.setdefault("_lily_moe_reasons", {})
    key = (what, x.dtype)
    if key not in cache:
        cache[key] = reason = check(block, x, *args)
        if reason is not None:
            # A debug line: the block still runs its routed experts on the kernels, and this piece on
            # stock's ops (a correct path, not a fallback of the whole op).
            log_once(f"moe:{what}:{reason}", f"moe {what[0] if isinstance(what, tuple) else what}: "
                     f"{reason}; using stock's ops for it", level=logging.DEBUG)
    return cache[key]
