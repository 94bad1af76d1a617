"""Metal->CUDA bridge (lily_mlx.msl.cuda) without a GPU: text rewriting, launch checks, the
generated prologue, and CUDA compiles (NVRTC as MLX uses it, else nvcc) of every translation we ship (the bridge's feature checks,
MLX-LM's Gated DeltaNet kernels, and every kernel the patched model launches, recorded at its real
call sites). The same feature checks run on the CPU simulator against independent references, and
against the outputs the GPU produced through the bridge (committed under docs/results/)."""

from __future__ import annotations

import glob
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np
import pytest

from bench import bridge_checks as bc
from lily_mlx.core.kernel_registry import kernels_dir, load_kernel_file
from lily_dev import resource_usage
from lily_mlx.msl.cuda import UnbridgeableError, metal_kernel, translate, wrap_like_mlx
from lily_mlx.msl.cuda.kernel import prelude
from lily_dev.compile_check import compile_cuda, compiler_available, ptx_nvrtc, record_model_translations

needs_nvcc = pytest.mark.skipif(compiler_available() is None, reason="no CUDA compiler (NVRTC or nvcc) installed")
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# Text rewriting

def test_address_spaces_and_shared_memory():
    body = translate("""
        threadgroup float buf[64];
        threadgroup float* p = buf;  // a device pointer in a comment stays "device"
        const device bfloat16_t* x = inp;
        constant int& n = params[0];
        thread float acc[4];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    """)
    assert "__shared__ float buf[64];" in body
    assert "float* p = buf;" in body and "__shared__ float* p" not in body
    assert "const  bfloat16_t* x" in body and "int& n" in body and "float acc[4]" in body
    assert 'comment stays "device"' in body
    assert "threadgroup_barrier(mem_flags::mem_threadgroup)" in body


def test_header_functions_become_device_functions():
    header = translate("""
constant float table[2] = {1.0f, 2.0f};
constexpr constant int N = 4;
template <typename T>
METAL_FUNC T twice(const device T* x) { return x[0] * 2; }
inline float half_of(float x);
template <int NM, typename T, int SK = 1>
inline T scaled(T x) { return x * NM * SK; }
template <int A, int B = (A > 2 ? 1 : 0)>
inline int over_two(int x) { return x * B; }
template <int A, bool B = (A < 2)>
inline bool under_two() { return B; }
struct Acc { float v; void add(float x) { v += x; } Acc(float s) : v(s) {} };
static_assert(N == 4, "N");
""", "header")
    assert "__constant__ float table[2]" in header
    assert "constexpr  int N = 4;" in header
    assert "template <typename T>__device__ \nMETAL_FUNC T twice(const  T* x)" in header
    assert "__device__ inline float half_of(float x);" in header
    assert "template <int NM, typename T, int SK = 1>__device__ \ninline T scaled(T x)" in header  # a default argument
    # A comparison inside a default argument's parentheses is not a template bracket.
    assert "template <int A, int B = (A > 2 ? 1 : 0)>__device__ \ninline int over_two(int x)" in header
    assert "template <int A, bool B = (A < 2)>__device__ \ninline bool under_two()" in header
    assert "__device__ void add(float x)" in header and "__device__ Acc(float s)" in header
    assert "__device__ static_assert" not in header


@pytest.mark.parametrize("text, what", [
    ("[[kernel]] void f() {}", "attributes"),
    ("texture2d<float> t;", "textures"),
    ("auto m = mpp::tensor_ops::matmul2d<>();", "tensor ops"),
    ("simd_shuffle_and_fill_down(x, y, 1);", "simd_shuffle_and_fill"),
])
def test_unbridgeable_constructs_fail_at_construction(text, what):
    with pytest.raises(UnbridgeableError, match="cannot be bridged"):
        metal_kernel("k", ["a"], ["b"], text)


def test_comments_never_trigger_errors():
    metal_kernel("k", ["a"], ["b"], "// [[kernel]] texture2d mentioned in a comment\nb[0] = a[0];")


# ---------------------------------------------------------------------------------------------
# Prologue and launch checks

def test_prologue_declares_what_metal_would_pass():
    k = metal_kernel("k", ["x", "T"], ["y"], "y[thread_position_in_grid.x] = x[0] * T + x_shape[0];")
    body = k.cuda_body(k.specs([mx.zeros((4, 4)), 3]), [("InT", mx.bfloat16), ("N", 8), ("B", True)])
    assert "using InT = bfloat16_t;" in body and "constexpr int N = 8;" in body and "constexpr bool B = true;" in body
    assert "const auto T = *lily_metal::as_metal(T_lily_);" in body  # 0-d input: a value, as Metal's constant T&
    assert "const int* x_shape = x_lily__shape.data();" in body
    assert "thread_position_in_grid = lily_tpig_" in body
    assert "simdgroup_index_in_threadgroup" not in body  # only attributes the source names
    assert "return;" in body  # padding threads leave before the body


def test_each_kernel_gets_only_the_prelude_sections_it_uses():
    """MLX hashes a custom kernel's whole source at every launch it evaluates: a kernel carries only the
    optional prelude sections its code names (their compiles: the nvcc tests below), no comment lines."""
    plain = metal_kernel("k", ["x"], ["y"], "// a comment\ny[0] = x[0]; threadgroup_barrier(mem_flags::mem_threadgroup);")
    shuffled = metal_kernel("k", ["x"], ["y"], "y[0] = simd_sum(x[0]);")
    matrix = metal_kernel("k", ["x"], ["y"], "simdgroup_matrix<float, 8, 8> m; y[0] = x[0];")
    counted = metal_kernel("k", ["x"], ["y"], "y[0] = x[0];", atomic_outputs=True)
    assert plain.prelude_sections == frozenset() and "a comment" not in plain.body
    assert shuffled.prelude_sections == {"simd"}
    assert matrix.prelude_sections == {"simd", "simdgroup_matrix"}
    assert counted.prelude_sections == {"atomics"}
    full = len(prelude())
    assert len(plain.cuda_header()) < 0.6 * full and "simd_shuffle" not in plain.cuda_header()
    assert "simd_shuffle" in shuffled.cuda_header() and "atomic_fetch_add_explicit" in counted.cuda_header()


def test_kernel_name_changes_with_template_and_mma_switch(monkeypatch):
    k = metal_kernel("k", ["x"], ["y"], "y[0] = static_cast<InT>(x[0]);")
    specs = k.specs([mx.zeros((8,))])
    names = {k.kernel_name(k.cuda_header(), k.cuda_body(specs, [("InT", d)])) for d in (mx.float32, mx.bfloat16)}
    monkeypatch.setenv("LILY_CUDA_MMA", "0")
    names.add(k.kernel_name(k.cuda_header(), k.cuda_body(specs, [("InT", mx.float32)])))
    assert len(names) == 3


# simdgroup_matrix lane layout: mma.sync's fragments unless thread_elements() can observe the layout
SGM_PRODUCT = """
    simdgroup_matrix<T, 8, 8> a, b;
    simdgroup_matrix<float, 8, 8> c = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_load(a, x, 8);
    simdgroup_load(b, x, 8, ulong2(0, 0), true);
    simdgroup_multiply_accumulate(c, a, b, c);
    simdgroup_store(c, y, 8);
"""


def test_simdgroup_matrix_layout_follows_thread_elements_and_the_environment(monkeypatch):
    """A kernel whose code never calls thread_elements() cannot observe its lanes' elements: its header
    selects mma.sync's fragment layout. One that calls it (or LILY_CUDA_SGM_LAYOUT=apple) keeps Apple's;
    a mention in a comment is not a call. The kernel name follows the layout (MLX caches by name)."""
    from lily_mlx.msl.cuda.kernel import SGM_LAYOUT_ENV

    monkeypatch.delenv(SGM_LAYOUT_ENV, raising=False)
    macro = "#define LILY_SGM_MMA_LAYOUT 1"
    free = metal_kernel("k", ["x"], ["y"], "// thread_elements() is not called here\n" + SGM_PRODUCT)
    observed = metal_kernel("k", ["x"], ["y"], SGM_PRODUCT + "y[1] = c.thread_elements()[0];")
    in_header = metal_kernel("k", ["x"], ["y"], SGM_PRODUCT, header="inline float first(simdgroup_matrix<float, 8, 8> m) "
                             "{ return m.thread_elements()[0]; }")
    plain = metal_kernel("k", ["x"], ["y"], "y[0] = simd_sum(x[0]);")
    assert free.sgm_layout() == "mma" and macro in free.cuda_header()
    assert observed.sgm_layout() == in_header.sgm_layout() == "apple"
    assert macro not in observed.cuda_header() and macro not in in_header.cuda_header()
    assert plain.sgm_layout() is None and macro not in plain.cuda_header()  # no simdgroup matrices: no macro
    # Prefill attention reads its fragments through thread_elements() (row reductions over lanes ^ 1, ^ 8).
    header, bodies = load_kernel_file("attention/prefill.metal")
    assert metal_kernel("p", ["x"], ["y"], bodies["attention_prefill"], header=header).sgm_layout() == "apple"
    header, bodies = load_kernel_file("moe/gemm.metal")
    assert metal_kernel("g", ["x"], ["y"], bodies["moe_gemm_down"], header=header).sgm_layout() == "mma"

    specs, template = free.specs([mx.zeros((64,))]), [("T", mx.bfloat16)]
    body = free.cuda_body(specs, template)
    names = {free.kernel_name(free.cuda_header(), body)}
    for value in ("apple", " Apple ", "auto", ""):
        monkeypatch.setenv(SGM_LAYOUT_ENV, value)
        assert free.sgm_layout() == ("apple" if "pple" in value else "mma")
        names.add(free.kernel_name(free.cuda_header(), body))
    assert len(names) == 2
    monkeypatch.setenv(SGM_LAYOUT_ENV, "apple")
    assert macro not in free.cuda_header() and observed.sgm_layout() == "apple"
    assert plain.cuda_header() == metal_kernel("k", ["x"], ["y"], "y[0] = simd_sum(x[0]);").cuda_header()


@pytest.mark.parametrize("value", ["mma", "0", "applee"])
def test_an_invalid_simdgroup_matrix_layout_setting_is_an_error(monkeypatch, value):
    from lily_mlx.msl.cuda.kernel import SGM_LAYOUT_ENV

    monkeypatch.setenv(SGM_LAYOUT_ENV, value)
    k = metal_kernel("k", ["x"], ["y"], SGM_PRODUCT)
    with pytest.raises(ValueError, match=f"LILY_CUDA_SGM_LAYOUT={value!r} is not one of auto, apple"):
        k.cuda_header()


@pytest.mark.skipif(compiler_available() != "nvrtc", reason="needs NVRTC (pip install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("dtype, layout, mma, shuffles", [
    (mx.bfloat16, "auto", "1", 2),     # tensor cores, mma layout: B's fragment only
    (mx.bfloat16, "apple", "1", 7),    # tensor cores, Apple's layout: A 1, C 2, B 2, D back 2
    (mx.float32, "auto", "1", 24),     # fp32 loop, mma layout: A's 4 pairs (2 words each), B's 8 pairs
    (mx.float32, "apple", "1", 32),    # fp32 loop, Apple's layout: per k both of A's elements, B's pair
    (mx.bfloat16, "auto", "0", 12),    # fp32 loop on 16-bit operands: a pair is one word
    (mx.bfloat16, "apple", "0", 24),
])
def test_shuffles_per_simdgroup_matrix_product(monkeypatch, dtype, layout, mma, shuffles):
    """What the layouts are about: warp shuffles per 8 x 8 x 8 product (PTX ``shfl.sync``; one product)."""
    monkeypatch.setenv("LILY_CUDA_SGM_LAYOUT", layout)
    monkeypatch.setenv("LILY_CUDA_MMA", mma)
    k = metal_kernel("k", ["x"], ["y"], SGM_PRODUCT)
    text = ptx_nvrtc(wrap_like_mlx(k, [mx.zeros((64,), dtype)], [mx.float32], [("T", dtype)])[1])
    assert text.count("shfl.sync") == shuffles
    assert text.count("mma.sync") == (1 if mma == "1" and dtype != mx.float32 else 0)


def test_mlx_gets_the_header_as_an_include_of_a_content_addressed_file(tmp_path, monkeypatch):
    """MLX hashes a custom kernel's whole source, header included, at every launch it evaluates (+6.8 us
    per launch for a 36 KB header on the H200): the header MLX gets is one ``#include`` line of a file
    holding the full header, written once per content; the kernel name still hashes the full text."""
    from lily_mlx.msl.cuda.kernel import BODY_IN_HEADER_ENV, HEADER_DIR_ENV, launch_header

    monkeypatch.setenv(HEADER_DIR_ENV, str(tmp_path / "headers"))
    monkeypatch.setenv(BODY_IN_HEADER_ENV, "0")  # the header alone (the body's move: its own test below)
    k = metal_kernel("k", ["x"], ["y"], "y[0] = simd_sum(x[0]);")
    text = k.cuda_header()
    line = launch_header(text)
    assert line.startswith('#include "') and line.endswith('"\n') and len(line) < len(text) // 10
    path = Path(line.split('"')[1])
    assert path.parent == tmp_path / "headers" and path.read_text() == text
    assert launch_header(text) == line  # same content, same file
    assert launch_header(metal_kernel("k", ["x"], ["y"], "y[0] = x[0];").cuda_header()) != line
    path.write_text("damaged")  # a file whose content differs is rewritten
    assert launch_header(text) == line and path.read_text() == text

    calls = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: calls.append(kw) or object(), raising=False)
    k._cuda_kernel([mx.zeros((32,))], None, [mx.float32])
    assert calls[0]["header"] == line and calls[0]["name"] == k.kernel_name(text, calls[0]["source"])

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(HEADER_DIR_ENV, "relative")  # written and included by its absolute path
    assert launch_header(text) == f'#include "{tmp_path / "relative" / path.name}"\n'

    monkeypatch.setenv(HEADER_DIR_ENV, "inline")
    assert launch_header(text) == text
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(HEADER_DIR_ENV, str(blocker / "headers"))  # cannot be created: inlined
    assert launch_header(text) == text


@needs_nvcc
def test_a_kernel_with_its_header_included_compiles(tmp_path, monkeypatch):
    from lily_mlx.msl.cuda.kernel import BODY_IN_HEADER_ENV, HEADER_DIR_ENV, launch_header

    monkeypatch.setenv(HEADER_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(BODY_IN_HEADER_ENV, "0")
    k = metal_kernel("k", ["x"], ["y"], "y[thread_position_in_grid.x] = simd_sum(x[thread_position_in_grid.x]);")
    _, unit = wrap_like_mlx(k, [mx.zeros((64,))], [mx.float32])
    included = unit.replace(k.cuda_header(), launch_header(k.cuda_header()))
    assert len(included) < len(unit) // 3
    ok, out = compile_cuda(included)
    assert ok, out[-3000:]


def test_body_in_header_is_the_default_and_0_turns_it_off(monkeypatch):
    """LILY_CUDA_BODY_IN_HEADER: unset or 1, the body goes into the header file; 0, MLX gets the body as is;
    anything else is refused with the choices named."""
    from lily_mlx.core import environment
    from lily_mlx.msl.cuda.kernel import BODY_IN_HEADER_ENV, body_in_header

    k = metal_kernel("copy_body_mode", ["a"], ["b"], "b[thread_position_in_grid.x] = a[thread_position_in_grid.x];")
    inputs = [mx.zeros((64,)), mx.zeros((3,), mx.int32)]
    for value, moved in ((None, True), ("1", True), ("0", False), (" 0 ", False)):
        if value is None:
            monkeypatch.delenv(BODY_IN_HEADER_ENV, raising=False)
        else:
            monkeypatch.setenv(BODY_IN_HEADER_ENV, value)
        assert body_in_header() is moved
        _, body = k.cuda_sources(inputs, [mx.float32], None)
        assert body.strip().startswith("lily_body_") is moved, (value, body)
        assert environment.problems() == []
    monkeypatch.setenv(BODY_IN_HEADER_ENV, "yes")
    with pytest.raises(ValueError, match="not 0 or 1"):
        body_in_header()
    assert any(BODY_IN_HEADER_ENV in line for line in environment.problems())


@needs_nvcc
def test_body_in_header_mode_compiles_and_hands_mlx_a_one_line_body(tmp_path, monkeypatch):
    """LILY_CUDA_BODY_IN_HEADER=1 (the default): the translated body moves into the header file as a device function, so
    the source MLX hashes at every launch holds a one-line call; the translation units of lily's dense
    GEMV, residual norm and SIMD-group / simdgroup_matrix feature kernels compile that way, and the call
    names every parameter of MLX's signature."""
    from lily_mlx.core.kernel_registry import kernel_source
    from lily_mlx.msl.cuda.kernel import BODY_IN_HEADER_ENV, HEADER_DIR_ENV
    from lily_mlx.ops.linear import kernels as lk
    from lily_mlx.ops.moe import kernels as mk

    monkeypatch.setenv(HEADER_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(BODY_IN_HEADER_ENV, "1")
    wq, scales, biases = mx.quantize(mx.zeros((64, 256), mx.bfloat16), group_size=64, bits=4, stream=mx.cpu)
    x = mx.zeros((2, 1, 256), mx.bfloat16)
    cases = {
        "gemv": (lk.KERNELS["gemv_q4"], [x, wq, scales, biases, lk.KERNELS["gemv_q4"].pack(K=256, N=64, B=2)],
                 [mx.bfloat16], [("T", mx.bfloat16), ("M", 2), ("GS", 64)]),
        "residual_norm": (mk.KERNELS["residual_norm"], [x, x, x[0, 0], mx.zeros((1,)),
                                                        mk.KERNELS["residual_norm"].pack(D=256)],
                          [mx.bfloat16, mx.bfloat16], [("T", mx.bfloat16), ("PER_THREAD", 1)]),
    }
    units = {}
    for name, (spec, inputs, out_dtypes, template) in cases.items():
        header, body = kernel_source(spec)
        k = metal_kernel(spec.name, list(spec.input_names), list(spec.output_names), body, header=header)
        h, one_line = k.cuda_sources(inputs + [mx.zeros((3,), mx.int32)], out_dtypes, template)
        assert one_line.count("\n") == 0 and len(one_line) < 300 and one_line.strip().startswith("lily_body_")
        assert one_line.strip()[:-1].split("(", 1)[0] in h  # the device function sits in the header
        units[name] = wrap_like_mlx(k, inputs, out_dtypes, template)[1]
    units.update(_feature_units(all_layouts=False))
    _compile_all(units)


@pytest.mark.parametrize("grid, tg, ok", [
    ((256, 1, 1), (128, 1, 1), True),
    ((100, 1, 1), (64, 1, 1), False),     # a 36-thread threadgroup: partial SIMD-group
    ((96, 1, 1), (64, 1, 1), True),       # edge threadgroup of 32: whole SIMD-groups
    ((32, 6, 1), (32, 4, 1), True),       # partial in y, x full: warps line up
    ((48, 2, 1), (32, 2, 1), False),      # partial in x with y > 1: Metal regroups lanes
])
def test_simd_launch_checks(grid, tg, ok):
    k = metal_kernel("k", ["x"], ["y"], "y[0] = simd_sum(x[0]);")
    if ok:
        k._check_launch(grid, tg)
    else:
        with pytest.raises(UnbridgeableError, match="SIMD-group"):
            k._check_launch(grid, tg)


def test_atomic_outputs_need_metal_atomic_types():
    k = metal_kernel("k", ["x"], ["y"], "atomic_fetch_add_explicit(&y[0], x[0], memory_order_relaxed);",
                     atomic_outputs=True)
    with pytest.raises(UnbridgeableError, match="atomic"):
        k(inputs=[mx.zeros((4,))], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],
          output_dtypes=[mx.bfloat16])


# ---------------------------------------------------------------------------------------------
# nvcc compiles of everything the bridge ships (MLX's wrapper reproduced; a stand-in device header)

def _feature_units(all_layouts: bool = True):
    units = {
        "simd": wrap_like_mlx(metal_kernel("simd", ["x_in"], bc.SIMD_OUTPUTS, bc.SIMD_SOURCE),
                              [mx.zeros((256,))], [mx.float32] * len(bc.SIMD_OUTPUTS))[1],
        "atomic": wrap_like_mlx(metal_kernel("atomic", ["bins", "values"], ["hist", "total", "groups"],
                                             bc.ATOMIC_SOURCE, atomic_outputs=True),
                                [mx.zeros((64,), mx.int32), mx.zeros((64,))], [mx.int32, mx.float32, mx.int32])[1],
    }
    for dt in (mx.bfloat16, mx.float16, mx.float32):
        k = metal_kernel("mm", ["a", "b"], ["c", "layout"], bc.MATMUL_SOURCE, header=bc.MATMUL_HEADER)
        units[f"simdgroup_matrix_{dt}"] = wrap_like_mlx(
            k, [mx.zeros((32, 64), dt), mx.zeros((64, 48), dt)], [mx.float32, mx.float32],
            [("T", dt), ("M", 32), ("N", 48), ("K", 64)])[1]
    # The layout-free check in both layouts, and its 16-bit products through the fp32 loop (no tensor cores).
    cases = [(dt, {"LILY_CUDA_SGM_LAYOUT": layout}) for dt in (mx.bfloat16, mx.float16, mx.float32)
             for layout in ("auto", "apple")] + [(mx.bfloat16, {"LILY_CUDA_MMA": "0"})]
    for dt, env in cases if all_layouts else cases[:1]:
        k = metal_kernel("mm_free", ["a", "bt", "btf", "c0"], ["c", "ct", "c_last"], bc.LAYOUT_FREE_SOURCE)
        with mock.patch.dict(os.environ, env):
            units[f"simdgroup_matrix_layout_free_{dt}_{env}"] = wrap_like_mlx(
                k, [mx.zeros((16, 32), dt), mx.zeros((48, 32), dt), mx.zeros((48, 32)), mx.zeros((16, 48))],
                [mx.float32] * 3, [("T", dt), ("M", 16), ("N", 48), ("K", 32)])[1]
    return units


def _gdn_units():
    return resource_usage.mlx_lm_gdn_units()


def _compile_all(units):
    include = os.environ.get("LILY_MLX_CUDA_INCLUDE")
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(units, pool.map(lambda t: compile_cuda(t, include_dir=include), units.values())))
    failed = {k: out[-3000:] for k, (ok, out) in results.items() if not ok}
    assert not failed, "nvcc failed:\n" + "\n\n".join(f"== {k}\n{v}" for k, v in failed.items())


@needs_nvcc
@pytest.mark.slow
def test_feature_checks_and_mlx_lm_gdn_kernels_compile_for_cuda():
    _compile_all({**_feature_units(), **_gdn_units()})


@needs_nvcc
@pytest.mark.slow
def test_every_kernel_the_patched_model_launches_compiles_for_cuda():
    from bench.model_setup import load_model

    model, _ = load_model(None, "tiny", log=None)
    units = record_model_translations(model, prompt_tokens=40, vocab_size=1024)
    assert units, "the patched model launched no kernel on the cuda backend (the MoE and DeltaNet kernels run there)"
    _compile_all(units)


def test_every_shipped_kernel_translates():
    """Each kernels/<family>/*.metal kernel (launched by the model or not) passes the bridge's translation."""
    files = sorted(kernels_dir().rglob("*.metal"))
    assert files, f"no kernel files under {kernels_dir()}"
    for path in files:
        header, bodies = load_kernel_file(path.relative_to(kernels_dir()).as_posix())
        for name, body in bodies.items():
            metal_kernel(name, ["x"], ["y"], body, header=header)


@needs_nvcc
@pytest.mark.slow
def test_every_shipped_kernel_header_compiles_for_cuda():
    files = sorted(kernels_dir().rglob("*.metal"))
    assert files, f"no kernel files under {kernels_dir()}"
    units = {}
    for path in files:
        header, _ = load_kernel_file(path.relative_to(kernels_dir()).as_posix())
        k = metal_kernel(path.stem, ["x"], ["y"], "y[0] = x[0] + thread_position_in_grid.x;",
                         header=header)
        units[str(path)] = wrap_like_mlx(k, [mx.zeros((8,))], [mx.float32])[1]
    _compile_all(units)


# ---------------------------------------------------------------------------------------------
# The same feature checks on the CPU simulator: references, and the GPU's outputs through the bridge

def _sim_factory():
    from lily_mlx.msl import sim

    return sim.metal_kernel


@pytest.mark.slow
def test_feature_checks_pass_on_the_simulator():
    results, _ = bc.run_all(_sim_factory(), log=lambda m: None)
    failed = {k: v for k, v in results.items() if not v["ok"]}
    assert not failed, failed


def _gpu_outputs():
    found = sorted(glob.glob(str(REPO / "docs" / "results" / "*" / "bridge_outputs_cuda.npz")))
    return found[-1] if found else None


@pytest.mark.slow
def test_simulator_and_gpu_bridge_agree_on_one_source():
    path = _gpu_outputs()
    if path is None:
        pytest.skip("no GPU bridge outputs committed under docs/results/")
    gpu = np.load(path)
    _, sim_out = bc.run_all(_sim_factory(), log=lambda m: None)
    compared = 0
    for key in gpu.files:
        if key not in sim_out:
            continue
        tol = 2e-2 if "simdgroup_matrix" in key and "f32" not in key else 1e-4
        scale = max(1.0, float(np.max(np.abs(sim_out[key]))))
        assert np.max(np.abs(gpu[key] - sim_out[key])) <= tol * scale, key
        compared += 1
    assert compared >= 10
