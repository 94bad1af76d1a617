"""Checks of the Metal->CUDA bridge's features, one Metal source each, runnable on any kernel
backend (``cuda`` on an NVIDIA GPU, ``sim`` on the CPU, ``metal`` on a Mac).

Each check builds its kernel with a ``metal_kernel`` factory, runs it on seeded inputs and compares
with an independent reference (numpy or plain MLX ops). The outputs are returned too, so two
executions of one source (GPU through the bridge, CPU through the simulator) can be compared with
each other (``bench/device_run.sh`` saves them; ``tests/msl/test_cuda_bridge.py`` compares).

Also here: MLX-LM's own Gated DeltaNet Metal kernels (generic and packed), captured from
``mlx_lm.models.gated_delta`` and run through a factory against ``gated_delta_ops``.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import mlx.core as mx
import numpy as np

from lily_dev.deltanet_stock_kernels import mlx_lm_kernels, mlx_lm_scan

# ---------------------------------------------------------------------------------------------
# simd_*: reductions, scans, shuffles, broadcasts, quad ops (one simdgroup = 32 consecutive threads).

SIMD_SOURCE = """
    uint gid = thread_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    float x = x_in[gid];
    out_sum[gid] = simd_sum(x);
    out_max[gid] = simd_max(x);
    out_min[gid] = simd_min(x);
    out_prefix[gid] = simd_prefix_exclusive_sum(x);
    out_xor[gid] = simd_shuffle_xor(x, 5);
    out_bcast[gid] = simd_broadcast(x, 7);
    out_down[gid] = simd_shuffle_down(x, 3);
    out_quad[gid] = quad_sum(x);
    bfloat16_t xb = static_cast<bfloat16_t>(x);
    out_bf16_sum[gid] = static_cast<float>(simd_sum(xb));
    out_lane[gid] = static_cast<float>(lane + 100 * simdgroup_index_in_threadgroup);
"""
SIMD_OUTPUTS = ["out_sum", "out_max", "out_min", "out_prefix", "out_xor", "out_bcast", "out_down",
                "out_quad", "out_bf16_sum", "out_lane"]


def _bf16_round(a: np.ndarray) -> np.ndarray:
    return np.array(mx.array(a).astype(mx.bfloat16).astype(mx.float32))


def _butterfly(v: np.ndarray, op) -> np.ndarray:
    """xor-butterfly 1, 2, 4, 8, 16 over groups of 32 (each level applied to all lanes)."""
    v = v.reshape(-1, 32).copy()
    lanes = np.arange(32)
    for m in (1, 2, 4, 8, 16):
        v = op(v, v[:, lanes ^ m])
    return v.reshape(-1)


def simd_reference(x: np.ndarray, threadgroup: int) -> Dict[str, np.ndarray]:
    g = x.reshape(-1, 32).astype(np.float32)
    lanes = np.arange(32)
    down_src = np.minimum(lanes + 3, 31)
    down = np.where(lanes + 3 < 32, g[:, down_src], g)
    q = g.reshape(-1, 8, 4)
    quad = (q[..., [0, 1, 2, 3]] + q[..., [1, 0, 3, 2]])
    quad = quad + quad[..., [2, 3, 0, 1]]
    bf = _bf16_round(x)
    bf_sum = bf.reshape(-1, 32)
    for m in (1, 2, 4, 8, 16):
        bf_sum = _bf16_round(bf_sum + bf_sum[:, lanes ^ m])
    gid = np.arange(x.size)
    return {
        "out_sum": _butterfly(x.astype(np.float32), np.add),
        "out_max": np.repeat(g.max(1), 32),
        "out_min": np.repeat(g.min(1), 32),
        "out_prefix": (np.cumsum(g, 1) - g).reshape(-1),
        "out_xor": g[:, lanes ^ 5].reshape(-1),
        "out_bcast": np.repeat(g[:, 7], 32),
        "out_down": down.reshape(-1),
        "out_quad": quad.reshape(-1),
        "out_bf16_sum": bf_sum.reshape(-1),
        "out_lane": ((gid % threadgroup) % 32 + 100 * ((gid % threadgroup) // 32)).astype(np.float32),
    }


def check_simd(factory: Callable, seed: int = 0) -> Tuple[Dict[str, float], Dict[str, np.ndarray]]:
    n, tg = 256, 128
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    k = factory(name="bridge_check_simd", input_names=["x_in"], output_names=SIMD_OUTPUTS, source=SIMD_SOURCE)
    outs = k(inputs=[mx.array(x)], grid=(n, 1, 1), threadgroup=(tg, 1, 1),
             output_shapes=[(n,)] * len(SIMD_OUTPUTS), output_dtypes=[mx.float32] * len(SIMD_OUTPUTS),
             init_value=float("nan"))
    got = {name: np.array(o) for name, o in zip(SIMD_OUTPUTS, outs)}
    ref = simd_reference(x, tg)
    errs = {name: float(np.max(np.abs(got[name] - ref[name]))) for name in SIMD_OUTPUTS}
    return errs, got


# ---------------------------------------------------------------------------------------------
# Atomics: integer histogram and float sum into atomic outputs; a threadgroup atomic counter.

ATOMIC_SOURCE = """
    uint gid = thread_position_in_grid.x;
    threadgroup atomic<uint> local_count;
    if (thread_index_in_threadgroup == 0) {
        atomic_store_explicit(&local_count, 0u, memory_order_relaxed);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    int bin = bins[gid];
    atomic_fetch_add_explicit(&hist[bin], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&total[bin], values[gid], memory_order_relaxed);
    atomic_fetch_add_explicit(&local_count, 1u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (thread_index_in_threadgroup == 0) {
        atomic_fetch_add_explicit(&groups[0], int(atomic_load_explicit(&local_count, memory_order_relaxed)),
                                  memory_order_relaxed);
    }
"""


def check_atomic(factory: Callable, seed: int = 0) -> Tuple[Dict[str, float], Dict[str, np.ndarray]]:
    n, nbins, tg = 4096, 16, 256
    rng = np.random.default_rng(seed)
    bins = rng.integers(0, nbins, n).astype(np.int32)
    # Values exact in fp32 whatever the summation order (multiples of 1/8, small sums).
    values = (rng.integers(-64, 64, n) / 8.0).astype(np.float32)
    k = factory(name="bridge_check_atomic", input_names=["bins", "values"], output_names=["hist", "total", "groups"],
                source=ATOMIC_SOURCE, atomic_outputs=True)
    hist, total, groups = k(inputs=[mx.array(bins), mx.array(values)], grid=(n, 1, 1), threadgroup=(tg, 1, 1),
                            output_shapes=[(nbins,), (nbins,), (1,)],
                            output_dtypes=[mx.int32, mx.float32, mx.int32], init_value=0)
    got = {"hist": np.array(hist), "total": np.array(total), "groups": np.array(groups)}
    ref_hist = np.bincount(bins, minlength=nbins)
    ref_total = np.bincount(bins, weights=values, minlength=nbins).astype(np.float32)
    errs = {
        "hist": float(np.max(np.abs(got["hist"] - ref_hist))),
        "total": float(np.max(np.abs(got["total"] - ref_total))),
        "groups": float(abs(int(got["groups"][0]) - n)),
    }
    return errs, got


# ---------------------------------------------------------------------------------------------
# simdgroup_matrix: C[M, N] = A[M, K] @ B[K, N], one simdgroup per 8x8 output tile, tiles of A and B
# staged in threadgroup memory; plus the per-lane element layout (thread_elements()).

MATMUL_HEADER = """
// Stage one 8x8 tile of a row-major matrix into threadgroup memory (one element per lane pair).
template <typename T>
METAL_FUNC void stage_tile(threadgroup T* dst, const device T* src, int ld, int row0, int col0, uint lane) {
    for (uint i = lane; i < 64; i += 32) {
        dst[i] = src[(row0 + i / 8) * ld + col0 + i % 8];
    }
}
"""

MATMUL_SOURCE = """
    // grid: (32 * N / 8, M / 8, 1); threadgroup: (32, 1, 1): one simdgroup per output tile.
    uint lane = thread_index_in_simdgroup;
    int tile_n = threadgroup_position_in_grid.x;
    int tile_m = threadgroup_position_in_grid.y;
    threadgroup T a_tile[64];
    threadgroup T b_tile[64];
    simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_matrix<T, 8, 8> a_frag;
    simdgroup_matrix<T, 8, 8> b_frag;
    for (int k0 = 0; k0 < K; k0 += 8) {
        stage_tile(a_tile, a, K, tile_m * 8, k0, lane);
        stage_tile(b_tile, b, N, k0, tile_n * 8, lane);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_load(a_frag, a_tile, 8);
        simdgroup_load(b_frag, b_tile, 8);
        simdgroup_multiply_accumulate(acc, a_frag, b_frag, acc);
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    simdgroup_store(acc, c, N, ulong2(tile_n * 8, tile_m * 8));
    // Which (row, col) this lane's two elements are: Apple's layout must be reproduced.
    simdgroup_matrix<float, 8, 8> probe;
    probe.thread_elements()[0] = float(lane * 2);
    probe.thread_elements()[1] = float(lane * 2 + 1);
    if (tile_m == 0 && tile_n == 0) {
        simdgroup_store(probe, layout, 8);
    }
"""


def apple_layout() -> np.ndarray:
    """[8, 8] matrix whose (r, c) entry is 2 * lane + i for the lane/element holding it on Apple GPUs
    (the layout MLX's steel GEMMs rely on)."""
    out = np.zeros((8, 8), np.float32)
    for lane in range(32):
        q = lane // 4
        r = (q & 4) + (lane // 2) % 4
        c = (q & 2) * 2 + (lane % 2) * 2
        out[r, c], out[r, c + 1] = 2 * lane, 2 * lane + 1
    return out


def check_simdgroup_matrix(factory: Callable, dtype=mx.bfloat16, seed: int = 0):
    M, N, K = 32, 48, 64
    rng = np.random.default_rng(seed)
    a = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
    b = mx.array(rng.standard_normal((K, N)).astype(np.float32)).astype(dtype)
    k = factory(name="bridge_check_simdgroup_matmul", input_names=["a", "b"], output_names=["c", "layout"],
                source=MATMUL_SOURCE, header=MATMUL_HEADER)
    c, layout = k(inputs=[a, b], template=[("T", dtype), ("M", M), ("N", N), ("K", K)],
                  grid=(32 * N // 8, M // 8, 1), threadgroup=(32, 1, 1),
                  output_shapes=[(M, N), (8, 8)], output_dtypes=[mx.float32, mx.float32], init_value=float("nan"))
    ref = np.array(a.astype(mx.float32)) @ np.array(b.astype(mx.float32))
    got = {"c": np.array(c), "layout": np.array(layout)}
    errs = {
        "c_rel": float(np.max(np.abs(got["c"] - ref)) / np.max(np.abs(ref))),
        "layout": float(np.max(np.abs(got["layout"] - apple_layout()))),
    }
    return errs, got, _layout_info(k)


# The same products in a kernel that never calls thread_elements(): nothing in it can observe the lane
# layout, so the CUDA bridge gives its matrices mma.sync's fragment layout (unless
# LILY_CUDA_SGM_LAYOUT=apple); the check above keeps Apple's. Operands straight from device memory (origin, elements_per_row, a
# transposed load of B), an fp32 accumulator loaded from memory, a product of mixed operand types
# (T x float: the bridge's fp32 loop) stored transposed, and a simdgroup_multiply.

LAYOUT_FREE_SOURCE = """
    // grid: (32 * N / 8, M / 8, 1); threadgroup: (64, 1, 1): one simdgroup per 8 x 8 output tile.
    // a [M, K] (T), bt [N, K] (T, B transposed), btf: bt as float, c0 [M, N] (float).
    int tile_n = thread_position_in_grid.x / 32;
    int tile_m = threadgroup_position_in_grid.y;
    ulong2 tile_origin = ulong2(tile_n * 8, tile_m * 8);
    simdgroup_matrix<float, 8, 8> acc;
    simdgroup_load(acc, c0, N, tile_origin);
    simdgroup_matrix<float, 8, 8> mixed = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_matrix<T, 8, 8> a_frag;
    simdgroup_matrix<T, 8, 8> b_frag;
    simdgroup_matrix<float, 8, 8> b_float;
    for (int k0 = 0; k0 < K; k0 += 8) {
        simdgroup_load(a_frag, a, K, ulong2(k0, tile_m * 8));
        // (k, n) of B is bt[n][k]: the transposed load's origin is in bt's coordinates (column k0, row n0).
        simdgroup_load(b_frag, bt, K, ulong2(k0, tile_n * 8), true);
        simdgroup_load(b_float, btf, K, ulong2(k0, tile_n * 8), true);
        simdgroup_multiply_accumulate(acc, a_frag, b_frag, acc);
        simdgroup_multiply_accumulate(mixed, a_frag, b_float, mixed);
    }
    simdgroup_matrix<float, 8, 8> last;
    simdgroup_multiply(last, a_frag, b_frag);  // the last K step alone
    simdgroup_store(acc, c, N, tile_origin);
    simdgroup_store(mixed, ct, M, ulong2(tile_m * 8, tile_n * 8), true);  // ct [N, M] = (A @ B)^T
    simdgroup_store(last, c_last, N, tile_origin);
"""


def check_simdgroup_matrix_layout_free(factory: Callable, dtype=mx.bfloat16, seed: int = 1):
    """C = C0 + A @ B, (A @ B)^T through the fp32 loop (T x float), and the last K step's product."""
    M, N, K = 16, 48, 32
    rng = np.random.default_rng(seed)
    a = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(dtype)
    bt = mx.array(rng.standard_normal((N, K)).astype(np.float32)).astype(dtype)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    k = factory(name="bridge_check_simdgroup_layout_free", input_names=["a", "bt", "btf", "c0"],
                output_names=["c", "ct", "c_last"], source=LAYOUT_FREE_SOURCE)
    c, ct, c_last = k(inputs=[a, bt, bt.astype(mx.float32), mx.array(c0)],
                      template=[("T", dtype), ("M", M), ("N", N), ("K", K)],
                      grid=(32 * N // 8, M // 8, 1), threadgroup=(64, 1, 1),
                      output_shapes=[(M, N), (N, M), (M, N)], output_dtypes=[mx.float32] * 3,
                      init_value=float("nan"))
    a32, b32 = np.array(a.astype(mx.float32)), np.array(bt.astype(mx.float32)).T
    ab = a32 @ b32
    ref = {"c": c0 + ab, "ct": ab.T, "c_last": a32[:, K - 8:] @ b32[K - 8:]}
    got = {"c": np.array(c), "ct": np.array(ct), "c_last": np.array(c_last)}
    errs = {f"{name}_rel": float(np.max(np.abs(got[name] - ref[name])) / np.max(np.abs(ref[name])))
            for name in ref}
    return errs, got, _layout_info(k)


def _layout_info(kernel) -> Dict[str, str]:
    """The bridge's lane layout for ``kernel`` (CUDA kernels only: 'mma' or 'apple'), for the results."""
    layout = getattr(kernel, "sgm_layout", None)
    return {"sgm_layout": layout()} if callable(layout) else {}


# ---------------------------------------------------------------------------------------------
# MLX-LM's Gated DeltaNet Metal kernels, captured from its module (which builds them only on Metal).

def gdn_inputs(B, T, Hk, Hv, Dk, Dv, dtype=mx.bfloat16, seed=0, vector_gate=False):
    mx.random.seed(seed)
    q = (mx.random.normal((B, T, Hk, Dk)) * Dk ** -0.5).astype(dtype)
    k = (mx.random.normal((B, T, Hk, Dk)) * Dk ** -0.5).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv)).astype(dtype)
    gshape = (B, T, Hv, Dk) if vector_gate else (B, T, Hv)
    g = mx.exp(-mx.random.uniform(0.01, 0.5, gshape))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, g, beta, state


def check_gdn(factory: Callable, variant: str, shape=(1, 33, 4, 8, 128, 128), seed=0) -> Dict[str, float]:
    """Run MLX-LM's ``variant`` GDN kernel ('generic' or 'packed') through ``factory`` with MLX-LM's
    launch geometry (grid, threadgroup, template) and compare with ``gated_delta_ops``."""
    from mlx_lm.models import gated_delta as gd

    B, T, Hk, Hv, Dk, Dv = shape
    q, k, v, g, beta, state = gdn_inputs(B, T, Hk, Hv, Dk, Dv, seed=seed)
    y, s = mlx_lm_scan(q, k, v, g, beta, state, packed=(variant == "packed"), kernels=mlx_lm_kernels(factory))
    y_ref, s_ref = gd.gated_delta_ops(q, k, v, g, beta, state)
    mx.eval(y, s, y_ref, s_ref)
    y32, yr = np.array(y.astype(mx.float32)), np.array(y_ref.astype(mx.float32))
    return {
        "y_max_abs": float(np.max(np.abs(y32 - yr))),
        "y_ref_max": float(np.max(np.abs(yr))),
        "state_max_abs": float(np.max(np.abs(np.array(s) - np.array(s_ref)))),
        "state_ref_max": float(np.max(np.abs(np.array(s_ref)))),
    }


# Tolerances: simd and atomics are exact up to fp32 summation order; bf16 matmul with fp32 accumulation.
TOLERANCES = {"simd": 1e-4, "atomic": 0.0, "simdgroup_matrix": 2e-2}


def run_all(factory: Callable, log=print) -> Tuple[Dict[str, dict], Dict[str, np.ndarray]]:
    """Run every feature check with ``factory``; returns ({check: {errors, ok}}, {check.output: array})."""
    results: Dict[str, dict] = {}
    arrays: Dict[str, np.ndarray] = {}
    for label, fn, tol in (
        ("simd", check_simd, TOLERANCES["simd"]),
        ("atomic", check_atomic, TOLERANCES["atomic"]),
        ("simdgroup_matrix_bf16", lambda f: check_simdgroup_matrix(f, mx.bfloat16), TOLERANCES["simdgroup_matrix"]),
        ("simdgroup_matrix_f16", lambda f: check_simdgroup_matrix(f, mx.float16), TOLERANCES["simdgroup_matrix"]),
        ("simdgroup_matrix_f32", lambda f: check_simdgroup_matrix(f, mx.float32), 1e-5),
        ("simdgroup_matrix_layout_free_bf16", lambda f: check_simdgroup_matrix_layout_free(f, mx.bfloat16),
         TOLERANCES["simdgroup_matrix"]),
        ("simdgroup_matrix_layout_free_f16", lambda f: check_simdgroup_matrix_layout_free(f, mx.float16),
         TOLERANCES["simdgroup_matrix"]),
        ("simdgroup_matrix_layout_free_f32", lambda f: check_simdgroup_matrix_layout_free(f, mx.float32), 1e-5),
    ):
        try:
            errs, outs, *info = fn(factory)  # info: the bridge's simdgroup_matrix layout, where known
            ok = all(np.isfinite(e) and e <= tol for e in errs.values())
            results[label] = {"errors": errs, "tolerance": tol, "ok": bool(ok), **(info[0] if info else {})}
            arrays.update({f"{label}.{k}": v for k, v in outs.items()})
        except Exception as e:  # a failing check is reported, the others still run
            results[label] = {"error": f"{type(e).__name__}: {e}", "ok": False}
        log(f"[bridge] {label}: {'ok' if results[label]['ok'] else 'FAILED'} {results[label].get('errors', results[label].get('error'))}")
    for variant in ("generic", "packed"):
        label = f"mlx_lm_gdn_{variant}"
        try:
            errs = check_gdn(factory, variant)
            ok = errs["y_max_abs"] <= 2e-2 * max(1.0, errs["y_ref_max"]) and errs["state_max_abs"] <= 1e-4 * max(1.0, errs["state_ref_max"])
            results[label] = {"errors": errs, "ok": bool(ok)}
        except Exception as e:
            results[label] = {"error": f"{type(e).__name__}: {e}", "ok": False}
        log(f"[bridge] {label}: {'ok' if results[label]['ok'] else 'FAILED'} {results[label].get('errors', results[label].get('error'))}")
    return results, arrays
