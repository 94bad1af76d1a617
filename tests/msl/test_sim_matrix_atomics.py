"""simdgroup_matrix products vs numpy; device and threadgroup atomics under contention."""

import mlx.core as mx
import numpy as np
import pytest

from lily_mlx.msl import sim


@pytest.mark.parametrize("dt,tname", [(mx.float32, "float"), (mx.float16, "half"), (mx.bfloat16, "bfloat")])
def test_simdgroup_matrix_tiled_matmul(dt, tname):
    # C[16, 16] = A[16, 32] @ B[32, 16]: 4 simdgroups, one 8x8 tile each, A staged in threadgroup memory.
    src = f"""
        threadgroup {tname} at[16 * 32];
        uint lid = thread_index_in_threadgroup;
        for (uint i = lid; i < 16 * 32; i += 128) at[i] = a[i];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        uint sg = simdgroup_index_in_threadgroup;
        uint r0 = (sg / 2) * 8, c0 = (sg % 2) * 8;
        simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        for (uint k = 0; k < 32; k += 8) {{
            simdgroup_matrix<{tname}, 8, 8> ma, mb;
            simdgroup_load(ma, at + r0 * 32 + k, 32);
            simdgroup_load(mb, b, 16, ulong2(c0, k));
            simdgroup_multiply_accumulate(acc, ma, mb, acc);
        }}
        simdgroup_store(acc, c + r0 * 16 + c0, 16);
    """
    rng = np.random.default_rng(1)
    A = mx.array(rng.standard_normal((16, 32)).astype(np.float32)).astype(dt)
    B = mx.array(rng.standard_normal((32, 16)).astype(np.float32)).astype(dt)
    k = sim.metal_kernel(name="mm", input_names=["a", "b"], output_names=["c"], source=src)
    C = k(inputs=[A, B], grid=(128, 1, 1), threadgroup=(128, 1, 1), output_shapes=[(16, 16)],
          output_dtypes=[mx.float32])[0]
    ref = np.array(A.astype(mx.float32)).astype(np.float64) @ np.array(B.astype(mx.float32)).astype(np.float64)
    assert np.allclose(np.array(C), ref, rtol=1e-5, atol=1e-4)


def test_simdgroup_matrix_transpose_and_thread_elements():
    src = """
        simdgroup_matrix<float, 8, 8> m;
        simdgroup_load(m, a, 8, ulong2(0, 0), true);
        simdgroup_store(m, t, 8);
        uint l = thread_index_in_simdgroup;
        auto e = m.thread_elements();
        lane_elems[2 * l] = e[0];
        lane_elems[2 * l + 1] = e[1];
    """
    A = mx.arange(64).astype(mx.float32).reshape(8, 8)
    k = sim.metal_kernel(name="mt", input_names=["a"], output_names=["t", "lane_elems"], source=src)
    T, E = k(inputs=[A], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(8, 8), (64,)],
             output_dtypes=[mx.float32, mx.float32])
    assert np.array_equal(np.array(T), np.array(A).T)
    # Every element of the (transposed) matrix is held by exactly one lane.
    assert sorted(np.array(E).tolist()) == list(range(64))


def test_device_atomics_under_contention():
    # Histogram with float and int atomic adds from 4096 threads over 16 bins, plus max/min.
    src = """
        uint i = thread_position_in_grid.x;
        uint bin = idx[i];
        atomic_fetch_add_explicit(&hist[bin], 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&fsum[bin], val[i], memory_order_relaxed);
        atomic_fetch_max_explicit(&imax[bin], int(i), memory_order_relaxed);
    """
    rng = np.random.default_rng(2)
    idx = rng.integers(0, 16, 4096).astype(np.uint32)
    val = np.ones(4096, np.float32) * 0.5
    k = sim.metal_kernel(name="hist", input_names=["idx", "val"], output_names=["hist", "fsum", "imax"],
                         source=src, atomic_outputs=True)
    h, f, m = k(inputs=[mx.array(idx), mx.array(val)], grid=(4096, 1, 1), threadgroup=(256, 1, 1),
                output_shapes=[(16,)] * 3, output_dtypes=[mx.int32, mx.float32, mx.int32], init_value=0)
    counts = np.bincount(idx, minlength=16)
    assert np.array_equal(np.array(h), counts)
    assert np.array_equal(np.array(f), counts * 0.5)
    assert np.array_equal(np.array(m), [np.nonzero(idx == b)[0].max() for b in range(16)])


def test_threadgroup_atomics_and_compare_exchange():
    src = """
        threadgroup atomic<uint> counter;
        threadgroup atomic_int best;
        uint lid = thread_index_in_threadgroup;
        if (lid == 0) {
            atomic_store_explicit(&counter, 0u, memory_order_relaxed);
            atomic_store_explicit(&best, -1, memory_order_relaxed);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        uint slot = atomic_fetch_add_explicit(&counter, 1u, memory_order_relaxed);
        int expected = atomic_load_explicit(&best, memory_order_relaxed);
        while (int(lid) > expected &&
               !atomic_compare_exchange_weak_explicit(&best, &expected, int(lid), memory_order_relaxed,
                                                      memory_order_relaxed)) {}
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[threadgroup_position_in_grid.x * 256 + slot] = 1;
        if (lid == 0) top[threadgroup_position_in_grid.x] = atomic_load_explicit(&best, memory_order_relaxed);
    """
    k = sim.metal_kernel(name="tga", input_names=["x"], output_names=["out", "top"], source=src)
    out, top = k(inputs=[mx.zeros((1,))], grid=(512, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(512,), (2,)],
                 output_dtypes=[mx.int32, mx.int32], init_value=0)
    assert np.array(out).sum() == 512 and np.array(out).min() == 1
    assert np.array(top).tolist() == [255, 255]
