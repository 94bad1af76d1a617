"""Language features of the Metal-compatibility prelude, each against a known answer: vectors and
packed vectors, as_type, half literals, Limits, metal::precise/fast math, integer bit functions,
quad ops, vector simd ops, partial simdgroups; and the speed requirement (~10^5 threads in seconds)."""

import time

import mlx.core as mx
import numpy as np

from lily_mlx.msl import sim


def _k(src, n_out=1, header="", input_names=("x",), **kw):
    return sim.metal_kernel(name="lang", input_names=list(input_names), output_names=[f"o{i}" for i in range(n_out)],
                            source=src, header=header, **kw)


def test_scalar_and_vector_language_features():
    src = """
        uint i = thread_position_in_grid.x;
        if (i != 0) return;
        int k = 0;
        o0[k++] = sizeof(float3);            // 16: padded like Metal
        o0[k++] = sizeof(packed_float3);     // 12
        o0[k++] = alignof(half4);            // 8
        o0[k++] = as_type<uint>(1.0f) == 0x3f800000u;
        o0[k++] = as_type<ushort>(half(1.0h)) == 0x3c00;
        o0[k++] = as_type<ushort>(bfloat16_t(1.0f)) == 0x3f80;
        o0[k++] = isinf(Limits<float>::max) && Limits<float>::min < 0;
        o0[k++] = float(Limits<half>::finite_max) == 65504.0f;
        o0[k++] = float(Limits<bfloat16_t>::finite_max) > 3.3e38f;
        o0[k++] = Limits<int>::max == 2147483647;
        o0[k++] = metal::precise::sqrt(16.0f) + metal::fast::exp(0.0f);   // 5
        o0[k++] = popcount(0xF0F0u) + clz(1u) + ctz(8u);                   // 8 + 31 + 3
        uint4 u = uint4(1, 2, 3, 4) * 2u + uint4(1);
        o0[k++] = u.x + u.y * 10 + u.z * 100 + u.w * 1000;                 // 3 + 50 + 700 + 9000
        float4 v = float4(float2(1.0f, 2.0f), 3.0f, 4.0f);
        float3 w = float3(v.x, v.y, v.z) / 2.0f;
        o0[k++] = w[0] + w[1] + w[2];                                      // 3
        o0[k++] = all(v > 0.0f) && !any(v > 4.0f);
        o0[k++] = metal::max(half(2.0h), half(3.0h)) + metal::min(2, 5);   // 5
        o0[k++] = select(1.0f, 2.0f, v.w > 3.0f);                         // 2
        int4 s = int4(-3, 4, -5, 6);
        o0[k++] = abs(s).x + abs(s).z + clamp(s, -4, 4).w;                 // 3 + 5 + 4
        packed_half4 ph = packed_half4(half4(1.0h, 2.0h, 3.0h, 4.0h));
        o0[k++] = float(ph[3] + ph.x);                                     // 5
        o0[k++] = ceildiv(10, 4) + float(x[0]);                            // 3 + 0.5
        o0[k++] = metal::fma(2.0f, 3.0f, 1.0f) + metal::fract(2.25f);      // 7.25
        o0[k++] = float(half(0.1f) * half(3.0f));                          // rounded in half
    """
    out = np.array(_k(src)(inputs=[mx.array([0.5])], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(22,)],
                           output_dtypes=[mx.float32])[0])
    half_prod = float(np.float16(np.float16(0.1) * np.float16(3.0)))
    expected = [16, 12, 8, 1, 1, 1, 1, 1, 1, 1, 5, 42, 9753, 3, 1, 5, 2, 12, 5, 3.5, 7.25, half_prod]
    assert out.tolist() == expected


def test_quad_ops_vector_simd_ops_and_partial_simdgroups():
    # 40 threads in one threadgroup: simdgroup 1 has only 8 lanes; ops run over the lanes present.
    src = """
        uint l = thread_index_in_simdgroup;
        float v = x[thread_position_in_grid.x];
        float4 v4 = float4(v, 2.0f * v, 1.0f, 0.0f);
        float4 s4 = simd_sum(v4);
        o0[thread_position_in_grid.x] = s4.x + s4.y * 1000.0f;
        o1[thread_position_in_grid.x] = quad_sum(v) + 100.0f * quad_shuffle_xor(v, 1u)
                                        + 10000.0f * simd_shuffle_rotate_down(v, 1u);
        o2[thread_position_in_grid.x] = simd_product(l < 4 ? 2.0f : 1.0f) + 100.0f * float(simds_present());
    """
    header = "inline uint simds_present() { return simd_sum(1u); }"
    x = mx.arange(40).astype(mx.float32)
    o0, o1, o2 = _k(src, 3, header)(inputs=[x], grid=(40, 1, 1), threadgroup=(40, 1, 1),
                                   output_shapes=[(40,)] * 3, output_dtypes=[mx.float32] * 3)
    xn = np.arange(40, dtype=np.float32)
    groups = [xn[:32], xn[32:]]
    exp0 = np.concatenate([np.full(len(g), g.sum() + 2000 * g.sum()) for g in groups])
    assert np.array_equal(np.array(o0), exp0)
    exp1 = []
    for gi, g in enumerate(groups):
        n = len(g)
        for l in range(n):
            q = l // 4 * 4
            rot = g[(l + 1) % 32] if (l + 1) % 32 < n else g[l]
            exp1.append(g[q:q + 4].sum() + 100 * g[l ^ 1] + 10000 * rot)
    assert np.array_equal(np.array(o1), np.array(exp1, dtype=np.float32))
    assert np.array(o2).tolist() == [16 + 3200] * 32 + [16 + 800] * 8


def test_three_dimensional_threadgroups_and_many_threads_run_fast():
    # ~1.3e5 threads with a simd_sum and a threadgroup barrier: seconds at most (issue 3, speed).
    src = """
        threadgroup float part[8];
        uint lid = thread_index_in_threadgroup;
        uint3 p = thread_position_in_grid;
        uint i = (p.z * threads_per_grid.y + p.y) * threads_per_grid.x + p.x;
        float v = x[i];
        float s = simd_sum(v);
        if (thread_index_in_simdgroup == 0) part[simdgroup_index_in_threadgroup] = s;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float t = 0.0f;
        for (uint j = 0; j < simdgroups_per_threadgroup; ++j) t += part[j];
        o0[i] = t;
    """
    k = _k(src)
    x = mx.random.uniform(shape=(16, 64, 128))  # z, y, x
    call = lambda: k(inputs=[x], grid=(128, 64, 16), threadgroup=(32, 4, 2), output_shapes=[x.shape],
                     output_dtypes=[mx.float32])[0]
    call()  # compile
    t0 = time.perf_counter()
    out = call()
    elapsed = time.perf_counter() - t0
    xn = np.array(x).reshape(16 // 2, 2, 64 // 4, 4, 128 // 32, 32)  # tg blocks of (2, 4, 32)
    sums = xn.sum(axis=(1, 3, 5), keepdims=True)
    expected = np.broadcast_to(sums, xn.shape).reshape(16, 64, 128)
    assert np.allclose(np.array(out), expected, rtol=1e-5)
    assert elapsed < 10.0, f"131072 threads took {elapsed:.2f}s"


def test_sixteen_bit_conversion_rules_match_metal():
    # `c ? h : 0` is a half; 16-bit values convert implicitly to float, explicitly to integers;
    # 16-bit op 16-bit stays 16-bit, with float it becomes float.
    src = """
        uint i = thread_position_in_grid.x;
        T v = (i < n) ? x[i] : 0;
        T w = (i % 2 == 0) ? v : T(1);
        int k = int(w) + static_cast<int>(v);
        if (v) k += 100;
        bool b = !w;
        float f = v;
        T m = metal::max(v, w);
        o0[i] = float(m) + k + b + f;
        o1[i] = sizeof(v * w) * 10 + sizeof(v * 1.0f) + sizeof(v + 1) * 100;
    """
    for dt in (mx.float16, mx.bfloat16):
        k = _k(src, 2, input_names=("x", "n"))
        x = mx.array([1.5, 2.0, 0.0, -3.0]).astype(dt)
        o0, o1 = k(inputs=[x, 3], template=[("T", dt)], grid=(4, 1, 1), threadgroup=(4, 1, 1),
                   output_shapes=[(4,), (4,)], output_dtypes=[mx.float32, mx.int32])
        assert np.array(o0).tolist() == [105, 107, 1, 2]
        assert np.array(o1).tolist() == [224] * 4


def test_fast_and_precise_math_namespaces():
    src = """
        uint i = thread_position_in_grid.x;
        o0[i] = metal::fast::fract(x[i]) + metal::precise::sign(x[i]) + metal::fast::divide(x[i], 2.0f)
                + metal::precise::exp(0.0f) + fast::max(1.0f, 2.0f);
    """
    out = _k(src)(inputs=[mx.array([1.25, -2.5])], grid=(2, 1, 1), threadgroup=(2, 1, 1), output_shapes=[(2,)],
                  output_dtypes=[mx.float32])[0]
    assert np.array(out).tolist() == [0.25 + 1 + 0.625 + 1 + 2, 0.5 - 1 - 1.25 + 1 + 2]


def test_swizzles_read_and_write():
    src = """
        uint i = thread_position_in_grid.x;
        float4 v = float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
        float2 a = v.xy;
        float3 b = v.zyx;
        half4 h = half4(v);
        half2 hz = h.zw;
        v.xz = float2(10.0f, 20.0f);
        float2 c = v.yw * 2.0f + a;
        float4 e = float4(v.xy, b.xy);
        uint2 u = uint2(3, 4);
        o0[i] = a.x + a.y * 10 + b.x * 100 + float(hz.y) * 1000 + v.x + v.z + c.x + c.y + e.w
                + float(uint2(u.yx).x) + float3(v.rgb).x + dot(float3(v.xyz), float3(1.0f));
    """
    x = mx.arange(8).astype(mx.float32)
    out = _k(src)(inputs=[x], grid=(2, 1, 1), threadgroup=(2, 1, 1), output_shapes=[(2,)],
                  output_dtypes=[mx.float32])[0]

    def ref(q):
        v = [10, q[1], 20, q[3]]
        return (q[0] + q[1] * 10 + q[2] * 100 + q[3] * 1000 + 10 + 20 + (v[1] * 2 + q[0]) + (v[3] * 2 + q[1])
                + q[1] + 4 + 10 + (10 + q[1] + 20))

    assert np.array(out).tolist() == [ref(list(range(4 * i, 4 * i + 4))) for i in range(2)]


def test_words_of_comments_are_not_read_as_code():
    """A comment ending in "threadgroup" before a thread's own array (the translator once read the two as a
    threadgroup declaration and left the array undeclared); a "//" inside a string stays; block comments keep the
    lines, so a later line's report still points at it."""
    src = """
        uint i = thread_position_in_grid.x;  // each thread's own, not the threadgroup
        float mine[2];
        /* several
           lines */ float other[2];
        mine[0] = float(i);
        other[0] = float(2 * i);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const char* s = "not // a comment";
        o0[i] = mine[0] + other[0] + float(s[4] == '/');
    """
    out = _k(src)(inputs=[mx.array([0.0])], grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8,)],
                  output_dtypes=[mx.float32])[0]
    assert np.array(out).tolist() == [3.0 * i + 1.0 for i in range(8)]
