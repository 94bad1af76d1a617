"""Simulator core: dispatch semantics, thread attributes, threadgroup memory + barriers, simd ops,
16-bit float rounding, vectors, templates, scalars, init_value, bounds and divergence reports."""

import ml_dtypes
import mlx.core as mx
import numpy as np
import pytest

from lily_mlx.msl import sim


def run(source, inputs, out_shape, out_dtype=mx.float32, grid=(32, 1, 1), tg=(32, 1, 1), names=None,
        template=None, header="", init_value=None, outputs=("out",), **kw):
    names = names or [f"in{i}" for i in range(len(inputs))]
    k = sim.metal_kernel(name="t", input_names=names, output_names=list(outputs), source=source, header=header, **kw)
    shapes = out_shape if isinstance(out_shape, list) else [out_shape]
    dtypes = out_dtype if isinstance(out_dtype, list) else [out_dtype] * len(shapes)
    res = k(inputs=inputs, template=template, grid=grid, threadgroup=tg, output_shapes=shapes,
            output_dtypes=dtypes, init_value=init_value)
    return res if len(res) > 1 else res[0]


def test_exp_elementwise_doc_example():
    source = """
        uint elem = thread_position_in_grid.x;
        T tmp = inp[elem];
        out[elem] = metal::exp(tmp);
    """
    a = mx.random.normal(shape=(4, 16)).astype(mx.float16)
    k = sim.metal_kernel(name="myexp", input_names=["inp"], output_names=["out"], source=source)
    b = k(inputs=[a], template=[("T", mx.float16)], grid=(a.size, 1, 1), threadgroup=(256, 1, 1),
          output_shapes=[a.shape], output_dtypes=[a.dtype])[0]
    assert mx.allclose(b, mx.exp(a)).item()


def test_dispatch_threads_partial_edge_groups_and_attributes():
    # grid (37, 3, 2) with threadgroup (16, 2, 1): edge groups are partial, no padding threads run.
    src = """
        uint3 g = thread_position_in_grid;
        uint i = (g.z * threads_per_grid.y + g.y) * threads_per_grid.x + g.x;
        out[i * 8 + 0] = thread_position_in_threadgroup.x + 100 * thread_position_in_threadgroup.y;
        out[i * 8 + 1] = threadgroup_position_in_grid.x + 100 * threadgroup_position_in_grid.y + 10000 * threadgroup_position_in_grid.z;
        out[i * 8 + 2] = threads_per_threadgroup.x * threads_per_threadgroup.y * threads_per_threadgroup.z;
        out[i * 8 + 3] = thread_index_in_threadgroup;
        out[i * 8 + 4] = simdgroup_index_in_threadgroup * 100 + thread_index_in_simdgroup;
        out[i * 8 + 5] = threadgroups_per_grid.x * 100 + threadgroups_per_grid.y;
        out[i * 8 + 6] = threads_per_simdgroup + thread_execution_width;
        out[i * 8 + 7] = simdgroups_per_threadgroup;
    """
    G, TG = (37, 3, 2), (16, 2, 1)
    out = np.array(run(src, [mx.zeros((1,))], (37 * 3 * 2 * 8,), mx.uint32, grid=G, tg=TG)).reshape(2, 3, 37, 8)
    for z in range(2):
        for y in range(3):
            for x in range(37):
                lx, ly = x % 16, y % 2
                gx, gy = x // 16, y // 2
                ax, ay = min(16, 37 - gx * 16), min(2, 3 - gy * 2)
                lid = ly * ax + lx
                exp = [lx + 100 * ly, gx + 100 * gy + 10000 * z, ax * ay, lid, (lid // 32) * 100 + lid % 32,
                       3 * 100 + 2, 64, (ax * ay + 31) // 32]
                assert list(out[z, y, x]) == exp, (x, y, z)


def test_threadgroup_memory_barrier_tree_reduction():
    src = """
        threadgroup float buf[256];
        uint lid = thread_position_in_threadgroup.x;
        buf[lid] = inp[thread_position_in_grid.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint s = 128; s > 0; s >>= 1) {
            if (lid < s) buf[lid] += buf[lid + s];
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        if (lid == 0) out[threadgroup_position_in_grid.x] = buf[0];
    """
    x = mx.random.uniform(shape=(4 * 256,))
    out = run(src, [x], (4,), grid=(1024, 1, 1), tg=(256, 1, 1), names=["inp"])
    assert np.allclose(np.array(out), np.array(x).reshape(4, 256).sum(1), rtol=1e-5)


def test_threadgroup_memory_declared_in_header_helper_is_shared():
    header = """
    template <typename T>
    T group_sum(T v, uint lid, uint n) {
        threadgroup T partial[32];
        T s = simd_sum(v);
        if (lid % 32 == 0) partial[lid / 32] = s;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        T total = 0;
        for (uint i = 0; i < n / 32; ++i) total += partial[i];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        return total;
    }
    """
    src = """
        uint lid = thread_position_in_threadgroup.x;
        float t = group_sum<float>(inp[thread_position_in_grid.x], lid, threads_per_threadgroup.x);
        if (lid == 0) out[threadgroup_position_in_grid.x] = t;
    """
    x = mx.random.uniform(shape=(3 * 128,))
    out = run(src, [x], (3,), grid=(384, 1, 1), tg=(128, 1, 1), names=["inp"], header=header)
    assert np.allclose(np.array(out), np.array(x).reshape(3, 128).sum(1), rtol=1e-5)


def _butterfly_sum(v):
    v = list(v)
    for m in (1, 2, 4, 8, 16):
        v = [np.float32(v[l] + v[l ^ m]) for l in range(32)]
    return v[0]


def test_simd_sum_is_xor_butterfly_bitwise():
    x = (mx.random.normal(shape=(64,)) * mx.exp(mx.random.normal(shape=(64,)) * 4)).astype(mx.float32)
    src = "out[thread_position_in_grid.x] = simd_sum(inp[thread_position_in_grid.x]);"
    out = np.array(run(src, [x], (64,), grid=(64, 1, 1), tg=(64, 1, 1), names=["inp"]))
    xn = np.array(x)
    for s in range(2):
        ref = _butterfly_sum(xn[32 * s:32 * s + 32].astype(np.float32))
        assert np.all(out[32 * s:32 * s + 32] == ref)


@pytest.mark.parametrize("op,ref", [
    ("simd_max(v)", lambda v, l: v.max()),
    ("simd_min(v)", lambda v, l: v.min()),
    ("simd_shuffle(v, (l * 7) % 32)", lambda v, l: v[(l * 7) % 32]),
    ("simd_shuffle_xor(v, 5)", lambda v, l: v[l ^ 5]),
    ("simd_shuffle_down(v, 3)", lambda v, l: v[l + 3] if l + 3 < 32 else v[l]),
    ("simd_shuffle_up(v, 3)", lambda v, l: v[l - 3] if l >= 3 else v[l]),
    ("simd_broadcast(v, 9)", lambda v, l: v[9]),
    ("simd_shuffle_and_fill_down(v, -v, 3)", lambda v, l: v[l + 3] if l + 3 < 32 else -v[l + 3 - 32]),
    ("simd_shuffle_and_fill_up(v, -v, 2, 8)", lambda v, l: v[l - 2] if l % 8 >= 2 else -v[l - 2 + 8]),
    ("float(uint64_t(simd_active_threads_mask()) == 0xffffffffull)", lambda v, l: 1.0),
    ("simd_prefix_inclusive_sum(v)", lambda v, l: v[:l + 1].sum()),
    ("simd_prefix_exclusive_sum(v)", lambda v, l: v[:l].sum()),
    ("float(simd_all(v > -100.0f)) + 2 * float(simd_any(v > 1e9f))", lambda v, l: 1.0),
    ("float(uint64_t(simd_ballot(l % 3 == 0)) == 0x49249249ull)", lambda v, l: 1.0),
    ("float(simd_sum(int(l)))", lambda v, l: 496.0),
    ("float(simd_or(1u << l) == 0xffffffffu)", lambda v, l: 1.0),
])
def test_simd_ops(op, ref):
    x = mx.round(mx.random.normal(shape=(32,)) * 8)  # small integers: sums are exact in any order
    src = f"uint l = thread_index_in_simdgroup; float v = inp[l]; out[l] = {op};"
    out = np.array(run(src, [x], (32,), names=["inp"]))
    xn = np.array(x)
    assert np.array_equal(out, np.array([ref(xn, l) for l in range(32)], dtype=np.float32)), op


@pytest.mark.parametrize("mdt,npdt,tname", [(mx.float16, np.float16, "half"), (mx.bfloat16, ml_dtypes.bfloat16, "bfloat")])
def test_f16_conversion_and_arithmetic_rounding_bitexact(mdt, npdt, tname):
    rng = np.random.default_rng(0)
    # magnitudes across normal, subnormal, overflow ranges plus ties
    a = (rng.standard_normal(4096) * np.exp2(rng.integers(-30, 20, 4096))).astype(np.float32)
    a[:4] = [65520.0, 65519.0, 2.0 ** -25, 3 * 2.0 ** -26]
    b = (rng.standard_normal(4096) * np.exp2(rng.integers(-10, 10, 4096))).astype(np.float32)
    src = f"""
        uint i = thread_position_in_grid.x;
        {tname} x = {tname}(a[i]);
        {tname} y = {tname}(b[i]);
        o1[i] = x;
        o2[i] = x * y;
        o3[i] = x + y;
        o4[i] = float(x) / float(y);
    """
    outs = run(src, [mx.array(a), mx.array(b)], [(4096,)] * 4, [mdt, mdt, mdt, mx.float32], grid=(4096, 1, 1),
               tg=(256, 1, 1), names=["a", "b"], outputs=("o1", "o2", "o3", "o4"))
    with np.errstate(over="ignore"):
        xa, xb = a.astype(npdt), b.astype(npdt)
    got = [np.array(o.view(mx.uint16)) for o in outs[:3]]
    with np.errstate(over="ignore"):
        exp = [xa, (xa.astype(np.float32) * xb.astype(np.float32)).astype(npdt),
               (xa.astype(np.float32) + xb.astype(np.float32)).astype(npdt)]
    for g, e in zip(got, exp):
        assert np.array_equal(g, e.view(np.uint16))


def test_vectors_templates_scalars_and_constant_inputs():
    src = """
        uint i = thread_position_in_grid.x;
        float4 v = float4(inp[4 * i], inp[4 * i + 1], inp[4 * i + 2], inp[4 * i + 3]);
        float4 w = v * scale + float4(c[0], c[1], c[2], 1.0f);
        half4 h = half4(w);
        out[i] = dot(float4(h), float4(1.0f)) + (B ? N : -N) + float(h.x) * 0.0f;
    """
    x = mx.random.normal(shape=(4 * 40,))
    c = mx.array([1.0, 2.0, 3.0])
    out = run(src, [x, 2.0, c], (40,), grid=(40, 1, 1), tg=(16, 1, 1), names=["inp", "scale", "c"],
              template=[("N", 7), ("B", True)])
    w = np.array(x).reshape(40, 4) * 2.0 + np.array([1, 2, 3, 1.0])
    h = w.astype(np.float16).astype(np.float32)
    assert np.allclose(np.array(out), h.sum(1) + 7, rtol=1e-5)


def test_init_value_and_unwritten_outputs():
    src = "if (thread_position_in_grid.x % 2 == 0) out[thread_position_in_grid.x] = 1.0f;"
    out = np.array(run(src, [mx.zeros((1,))], (8,), grid=(8, 1, 1), tg=(8, 1, 1), init_value=-3.0))
    assert list(out) == [1, -3, 1, -3, 1, -3, 1, -3]
    out = np.array(run(src, [mx.zeros((1,))], (8,), grid=(8, 1, 1), tg=(8, 1, 1)))
    assert np.isnan(out[1::2]).all()  # uninitialised outputs are poisoned


def test_out_of_bounds_write_is_reported():
    src = "out[thread_position_in_grid.x + 1] = inp[thread_position_in_grid.x];"
    with pytest.raises(sim.OutOfBoundsError, match=r"`out`.*\n.*line \d+: out\[thread_position_in_grid.x \+ 1\]"):
        run(src, [mx.zeros((64,))], (64,), grid=(64, 1, 1), tg=(32, 1, 1), names=["inp"])


def test_out_of_bounds_read_is_reported():
    src = "out[thread_position_in_grid.x] = inp[thread_position_in_grid.x * 2];"
    with pytest.raises(sim.OutOfBoundsError, match=r"out-of-bounds read of buffer 0 \(`inp`"):
        run(src, [mx.zeros((64,))], (64,), grid=(64, 1, 1), tg=(32, 1, 1), names=["inp"])


def test_divergent_simd_sum_is_reported_not_hung():
    src = """
        float v = inp[thread_position_in_grid.x];
        if (thread_index_in_simdgroup < 16) v = simd_sum(v);
        out[thread_position_in_grid.x] = v;
    """
    with pytest.raises(sim.DivergenceError, match="simd_sum"):
        run(src, [mx.zeros((64,))], (64,), grid=(64, 1, 1), tg=(64, 1, 1), names=["inp"])


def test_barrier_in_divergent_branch_is_reported():
    src = """
        if (thread_position_in_threadgroup.x == 0) return;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = 1.0f;
    """
    with pytest.raises(sim.DivergenceError, match="threadgroup_barrier.*already returned"):
        run(src, [mx.zeros((64,))], (64,), grid=(64, 1, 1), tg=(64, 1, 1), names=["inp"])


def test_compile_error_shows_numbered_source():
    with pytest.raises(sim.CompileError, match=r"(?s)undefined_thing.*\d+\| .*undefined_thing"):
        run("out[0] = undefined_thing;", [mx.zeros((1,))], (1,), grid=(1, 1, 1), tg=(1, 1, 1))


def test_missing_barrier_race_is_reported():
    # Each thread reads its neighbour's slot: without a barrier the result depends on thread order.
    body = """
        threadgroup float buf[64];
        uint lid = thread_position_in_threadgroup.x;
        buf[lid] = inp[thread_position_in_grid.x];
        {barrier}
        out[thread_position_in_grid.x] = buf[(lid + 1) % 64];
    """
    x = mx.random.normal(shape=(128,))
    fixed = body.format(barrier="threadgroup_barrier(mem_flags::mem_threadgroup);")
    out = run(fixed, [x], (128,), grid=(128, 1, 1), tg=(64, 1, 1), names=["inp"], race_check=True)
    assert np.array_equal(np.array(out), np.roll(np.array(x).reshape(2, 64), -1, axis=1).reshape(-1))
    with pytest.raises(sim.RaceError, match=r"race: thread \d+ .* (reads|writes) byte \d+ of threadgroup `buf` "
                                            r"that thread \d+ (read|wrote).*\n.*line \d+: (buf\[lid\]|out\[)"):
        run(body.format(barrier=""), [x], (128,), grid=(128, 1, 1), tg=(64, 1, 1), names=["inp"], race_check=True)


def test_simdgroup_synchronised_sharing_is_not_a_race():
    # Lanes of one simdgroup may share threadgroup memory across a simd op / simdgroup_barrier.
    src = """
        threadgroup float buf[32];
        uint l = thread_index_in_simdgroup;
        buf[l] = inp[l];
        simdgroup_barrier(mem_flags::mem_threadgroup);
        float v = buf[(l + 1) % 32];
        float s = simd_sum(v);
        if (l == 0) buf[0] = s;
        simdgroup_barrier(mem_flags::mem_threadgroup);
        out[l] = buf[0] + v;
    """
    x = mx.arange(32).astype(mx.float32)
    out = run(src, [x], (32,), names=["inp"], race_check=True)
    assert np.array(out).tolist() == [496.0 + (l + 1) % 32 for l in range(32)]


def test_write_write_race_is_reported():
    src = """
        threadgroup float acc[1];
        if (thread_position_in_threadgroup.x == 0) acc[0] = 0.0f;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        acc[0] = float(thread_position_in_threadgroup.x);  // every thread writes the same slot
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = 1.0f;
    """
    with pytest.raises(sim.RaceError, match=r"writes byte \d+ of threadgroup `acc` that thread \d+ wrote"):
        run(src, [mx.zeros((1,))], (64,), grid=(64, 1, 1), tg=(64, 1, 1), race_check=True)


def test_mlx_invalid_signature_quirk_is_a_compile_error():
    with pytest.raises(sim.CompileError, match="invalid signature"):
        run("o1[0] = in0_shape[0]; o2[0] = 1;", [mx.zeros((4, 8))], [(1,), (1,)], [mx.int32, mx.int32],
            grid=(1, 1, 1), tg=(1, 1, 1), outputs=("o1", "o2"))


def test_device_pointers_through_header_helpers():
    # Output pointers passed to helpers taking `const device T*` (deduced T), pointer arithmetic
    # and reinterpretation as vectors keep working and stay bounds-checked.
    header = """
    template <typename T>
    T read_back(const device T* p, uint i) { return p[i]; }
    inline void store2(device float* dst, uint i, float2 v) {
        device float2* d2 = reinterpret_cast<device float2*>(dst);
        d2[i] = v;
    }
    """
    src = """
        uint i = thread_position_in_grid.x;
        store2(out, i, float2(inp[2 * i], inp[2 * i + 1]) * 2.0f);
        out2[i] = read_back(out, 2 * i) + read_back(inp + 2 * i, 1);
    """
    x = mx.arange(16).astype(mx.float32)
    out, out2 = run(src, [x], [(16,), (8,)], grid=(8, 1, 1), tg=(8, 1, 1), names=["inp"], header=header,
                    outputs=("out", "out2"))
    assert np.array(out).tolist() == (np.arange(16) * 2.0).tolist()
    assert np.array(out2).tolist() == [4 * i + 2 * i + 1 for i in range(8)]
    with pytest.raises(sim.OutOfBoundsError, match="`out`"):
        run(src.replace("store2(out, i,", "store2(out, i + 1,"), [x], [(16,), (8,)], grid=(8, 1, 1),
            tg=(8, 1, 1), names=["inp"], header=header, outputs=("out", "out2"))


def test_race_check_has_no_false_positive_on_declaration_poisoning():
    # Thread 0 reaches the declaration first (and poisons the block); thread 5 writes it before the
    # barrier: that is the only write of the interval, so no race.
    src = """
        threadgroup float x[1];
        if (thread_position_in_threadgroup.x == 5) x[0] = 2.0f;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = x[0];
    """
    out = run(src, [mx.zeros((1,))], (32,), race_check=True)
    assert np.array(out).tolist() == [2.0] * 32


@pytest.mark.parametrize("mdt,npdt,tname", [(mx.float16, np.float16, "half"), (mx.bfloat16, ml_dtypes.bfloat16, "bfloat")])
def test_every_16_bit_pattern_widens_and_narrows_exactly(mdt, npdt, tname):
    # All 65536 bit patterns: 16-bit -> float is exact, float -> 16-bit gives the pattern back
    # (NaNs stay NaN); and float values halfway between neighbours round to even.
    src = f"""
        uint i = thread_position_in_grid.x;
        {tname} h = as_type<{tname}>(bits[i]);
        wide[i] = float(h);
        back[i] = as_type<ushort>({tname}(float(h)));
        float mid = float(h) + (float(as_type<{tname}>(ushort(bits[i] + 1))) - float(h)) * 0.5f;  // exact
        tie[i] = as_type<ushort>({tname}(mid));
    """
    bits = np.arange(65536, dtype=np.uint16)
    k = sim.metal_kernel(name="f16all", input_names=["bits"], output_names=["wide", "back", "tie"], source=src)
    wide, back, tie = k(inputs=[mx.array(bits)], grid=(65536, 1, 1), threadgroup=(256, 1, 1),
                        output_shapes=[(65536,)] * 3, output_dtypes=[mx.float32, mx.uint16, mx.uint16])
    ref = bits.view(npdt).astype(np.float32)
    wide = np.array(wide)
    nan = np.isnan(ref)
    assert np.array_equal(wide[~nan], ref[~nan]) and np.isnan(wide[nan]).all()
    back = np.array(back)
    assert np.array_equal(back[~nan], bits[~nan])
    assert np.isnan(back[nan].view(npdt).astype(np.float32)).all()
    # midpoints of finite neighbours (same sign, not crossing into inf/nan)
    nxt = (bits.astype(np.uint32) + 1).astype(np.uint16).view(npdt).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        mid = ((ref.astype(np.float64) + nxt.astype(np.float64)) * 0.5).astype(np.float32)
        ok = np.isfinite(ref) & np.isfinite(nxt) & (np.sign(ref) == np.sign(nxt)) & (bits != 0x7FFF) & (bits != 0xFFFF)
        expect = mid.astype(npdt).view(np.uint16)
    assert np.array_equal(np.array(tie)[ok], expect[ok])


# Metal keeps pointer address spaces apart: MLX passes inputs of fewer than 8 elements as `constant`,
# and a helper declared for `const device T*` does not take them (a Metal compile error on a Mac).
_DEVICE_HELPER = "inline float first(const device float* x) { return x[0]; }\n"
_ANY_SPACE_HELPER = "template <typename P> inline float first(P x) { return x[0]; }\n"


def test_small_inputs_are_constant_and_do_not_convert_to_device_pointers():
    big, small = mx.arange(16, dtype=mx.float32), mx.arange(4, dtype=mx.float32)
    body = "out[0] = first(inp);"
    got = run(body, [big], (1,), grid=(1, 1, 1), tg=(1, 1, 1), names=["inp"], header=_DEVICE_HELPER)
    assert got.item() == 0.0  # 16 elements: a device buffer, the helper takes it
    with pytest.raises(sim.CompileError, match="first"):
        run(body, [small], (1,), grid=(1, 1, 1), tg=(1, 1, 1), names=["inp"], header=_DEVICE_HELPER)
    got = run(body, [small], (1,), grid=(1, 1, 1), tg=(1, 1, 1), names=["inp"], header=_ANY_SPACE_HELPER)
    assert got.item() == 0.0  # a helper generic in the pointer type takes either


def test_reinterpret_cast_keeps_the_address_space():
    small = mx.arange(4, dtype=mx.float32)
    cast_device = "out[0] = float(reinterpret_cast<const device uint*>(inp)[1] != 0u);"
    cast_constant = "out[0] = float(reinterpret_cast<const constant uint*>(inp)[1] != 0u);"
    with pytest.raises(sim.CompileError, match="address space"):
        run(cast_device, [small], (1,), grid=(1, 1, 1), tg=(1, 1, 1), names=["inp"])
    assert run(cast_constant, [small], (1,), grid=(1, 1, 1), tg=(1, 1, 1), names=["inp"]).item() == 1.0


def test_threadgroup_memory_does_not_convert_to_a_device_pointer():
    body = """
        threadgroup float buf[32];
        buf[thread_position_in_threadgroup.x] = inp[thread_position_in_grid.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = first(buf);
    """
    x = mx.arange(32, dtype=mx.float32)
    with pytest.raises(sim.CompileError, match="first"):
        run(body, [x], (32,), names=["inp"], header=_DEVICE_HELPER)
    tg_helper = "inline float first(threadgroup float* x) { return x[0]; }\n"
    assert run(body, [x], (32,), names=["inp"], header=tg_helper).tolist() == [0.0] * 32


def test_double_is_a_metal_compile_error():
    with pytest.raises(sim.CompileError, match="no 64-bit float type"):
        run("double d = inp[0]; out[0] = float(d);", [mx.zeros((16,))], (1,), grid=(1, 1, 1), tg=(1, 1, 1),
            names=["inp"])
    # a comment may say it
    run("// double buffering\nout[0] = inp[0];", [mx.zeros((16,))], (1,), grid=(1, 1, 1), tg=(1, 1, 1),
        names=["inp"])


def test_runtime_sized_arrays_are_a_compile_error():
    # g++ accepts `float a[n]` with n known only at run time (an extension); Metal does not.
    with pytest.raises(sim.CompileError, match="variable length array|vla"):
        run("int n = int(inp[0]) + 1; float a[n]; a[0] = inp[0]; out[0] = a[0];", [mx.zeros((16,))], (1,),
            grid=(1, 1, 1), tg=(1, 1, 1), names=["inp"])


def test_misaligned_vector_access_is_reported():
    # A uint4 read through reinterpret_cast at a 4-byte offset: Metal requires 16-byte alignment.
    x = mx.arange(16, dtype=mx.uint32)
    aligned = "out[0] = float(reinterpret_cast<const device uint4*>(inp)[1].x);"
    assert run(aligned, [x], (1,), grid=(1, 1, 1), tg=(1, 1, 1), names=["inp"]).item() == 4.0
    shifted = "out[0] = float(reinterpret_cast<const device uint4*>(inp + 1)[0].x);"
    expected = r"misaligned access to buffer 0 \(`inp`, input\) at byte offset 4: .*16-byte"
    with pytest.raises(sim.MisalignedAccessError, match=expected):
        run(shifted, [x], (1,), grid=(1, 1, 1), tg=(1, 1, 1), names=["inp"])


def test_misaligned_threadgroup_vector_access_is_reported_by_the_race_check():
    # A uint4 stored through reinterpret_cast at a 4-byte offset of threadgroup memory: the CUDA bridge faults
    # ("misaligned address"), Metal requires the alignment. Device buffers are checked in every build; threadgroup
    # memory in race-check builds (every access instrumented), where the plain build would pass.
    src = """
    threadgroup float4 buf4[33];
    threadgroup float* buf = reinterpret_cast<threadgroup float*>(buf4);
    uint t = thread_position_in_grid.x;
    *reinterpret_cast<threadgroup uint4*>(buf + {shift} + 4 * t) = uint4(t);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[t] = float(reinterpret_cast<threadgroup uint*>(buf)[{shift} + 4 * t]);
    """
    x = mx.zeros((32,))
    aligned = run(src.replace("{shift}", "4"), [x], (32,), grid=(32, 1, 1), tg=(32, 1, 1), names=["inp"],
                  race_check=True)
    assert aligned.tolist() == [float(t) for t in range(32)]
    shifted = src.replace("{shift}", "1")
    run(shifted, [x], (32,), grid=(32, 1, 1), tg=(32, 1, 1), names=["inp"])  # unchecked without the race check
    with pytest.raises(sim.MisalignedAccessError, match=r"writes 16 bytes at byte 4 of threadgroup `buf4` "
                                                        r".*not a multiple of 16"):
        run(shifted, [x], (32,), grid=(32, 1, 1), tg=(32, 1, 1), names=["inp"], race_check=True)


@pytest.mark.parametrize("text", [
    "template <typename T> requires (sizeof(T) == 4) inline T same(T x) { return x; }\n",
    "inline float f(float x) { auto g = []<typename T>(T y) { return y; }; return g(x); }\n",
])
def test_cxx20_only_constructs_are_metal_compile_errors(text):
    with pytest.raises(sim.CompileError, match="C\\+\\+20|C\\+\\+17"):
        run("out[0] = inp[0];", [mx.zeros((16,))], (1,), grid=(1, 1, 1), tg=(1, 1, 1), names=["inp"],
            header=text)
