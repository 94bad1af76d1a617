"""lily_mlx.core.kernel_registry: kernel file sections, kernel directory, per-backend build cache."""


import mlx.core as mx
import pytest

from lily_mlx.core import kernel_registry as kr

FILE_TEXT = """\
// lily-mlx test kernels
// @header
template <typename T> T twice(T x) { return x + x; }
// @kernel scale_add_f32
uint i = thread_position_in_grid.x;
out[i] = twice(a[i]) + b[i];

// @kernel copy_f32
uint i = thread_position_in_grid.x;
out[i] = a[i];
"""

SPEC = kr.KernelSpec(name="scale_add_f32", file="core_test.metal", input_names=("a", "b"),
                     output_names=("out",))


@pytest.fixture
def kernel_dir(tmp_path, monkeypatch):
    """A kernels directory holding core_test.metal, in place of the package's own."""
    (tmp_path / "core_test.metal").write_text(FILE_TEXT)
    monkeypatch.setattr(kr, "_KERNEL_DIRS", (tmp_path / "missing", tmp_path))
    kr.clear_cache()
    yield tmp_path
    kr.clear_cache()


# --- parsing -------------------------------------------------------------------------------------

def test_parse_sections():
    header, bodies = kr.parse_kernel_file(FILE_TEXT, "t.metal")
    assert header == "template <typename T> T twice(T x) { return x + x; }\n"
    assert list(bodies) == ["scale_add_f32", "copy_f32"]
    assert bodies["scale_add_f32"] == ("uint i = thread_position_in_grid.x;\n"
                                       "out[i] = twice(a[i]) + b[i];\n")
    assert bodies["copy_f32"] == "uint i = thread_position_in_grid.x;\nout[i] = a[i];\n"


def test_parse_without_header_and_marker_spacing():
    header, bodies = kr.parse_kernel_file("//@kernel k1\nx;\n//   @kernel   k2  \ny;\n")
    assert header == ""
    assert bodies == {"k1": "x;\n", "k2": "y;\n"}


def test_several_header_sections_concatenate():
    text = "// @header\nA\n// @kernel k\nbody\n// @header\nB\n"
    header, bodies = kr.parse_kernel_file(text)
    assert header == "A\nB\n" and bodies == {"k": "body\n"}


def test_marker_must_be_a_whole_line():
    # A marker inside code is not a section; other '// @word' comments are plain comments.
    text = "// @kernel k\nint a; // @kernel not_a_section\n// @param x\n"
    _, bodies = kr.parse_kernel_file(text)
    assert list(bodies) == ["k"]


def test_misspelt_marker_is_an_error():
    with pytest.raises(ValueError, match="malformed section marker"):
        kr.parse_kernel_file("// @kernel k\na;\n// @kernels x\n", "m.metal")


def test_duplicate_kernel_name():
    with pytest.raises(ValueError, match="'k' defined twice"):
        kr.parse_kernel_file("// @kernel k\na\n// @kernel k\nb\n", "dup.metal")


def test_kernel_without_name():
    with pytest.raises(ValueError, match="dup.metal: '// @kernel' needs a name"):
        kr.parse_kernel_file("// @kernel\na\n", "dup.metal")


def test_no_sections():
    with pytest.raises(ValueError, match="no '// @kernel <name>' section"):
        kr.parse_kernel_file("kernel void f() {}\n", "plain.metal")


def test_header_only_file_rejected():
    with pytest.raises(ValueError):
        kr.parse_kernel_file("// @header\nint helper();\n", "header_only.metal")


def test_malformed_marker_not_glued_to_previous_kernel():
    text = "// @kernel k1\na;\n// @kernel k2 // note\nb;\n"
    try:
        _, bodies = kr.parse_kernel_file(text, "m.metal")
    except ValueError:
        return  # rejecting the line is fine
    assert bodies["k1"] == "a;\n"


# --- kernel directory and sources ----------------------------------------------------------------

def test_kernels_dir_first_existing(kernel_dir):
    assert kr.kernels_dir() == kernel_dir


def test_kernels_dir_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(kr, "_KERNEL_DIRS", (tmp_path / "a", tmp_path / "b"))
    with pytest.raises(FileNotFoundError, match="kernel sources not found"):
        kr.kernels_dir()


def test_package_kernel_dirs():
    # Installed wheel: lily_mlx/_kernels; source checkout: <repo>/kernels (whichever exists).
    pkg = kr._PACKAGE_DIR
    assert kr._KERNEL_DIRS == (pkg / "_kernels", pkg.parent / "kernels")
    if any(d.is_dir() for d in kr._KERNEL_DIRS):
        assert kr.kernels_dir() in kr._KERNEL_DIRS


def test_kernel_source(kernel_dir):
    header, body = kr.kernel_source(SPEC)
    assert "twice" in header and body.startswith("uint i")
    missing = kr.KernelSpec("nope", "core_test.metal", ("a",), ("out",))
    with pytest.raises(KeyError, match="scale_add_f32, copy_f32"):
        kr.kernel_source(missing)


def test_a_header_includes_another_files_header(kernel_dir):
    """"// @include <file>" in a header stands for that file's header (one level, never itself)."""
    (kernel_dir / "user.metal").write_text("// @header\n// @include core_test.metal\nT thrice(T x);\n"
                                           "// @kernel user_k\nout[0] = twice(a[0]);\n")
    header, bodies = kr.load_kernel_file("user.metal")
    assert "template <typename T> T twice" in header and "T thrice" in header and "@include" not in header
    assert list(bodies) == ["user_k"]
    (kernel_dir / "self.metal").write_text("// @header\n// @include self.metal\n// @kernel k\nx;\n")
    with pytest.raises(ValueError, match="not another kernel file"):
        kr.load_kernel_file("self.metal")
    (kernel_dir / "nested.metal").write_text("// @header\n// @include user.metal\n// @kernel k\nx;\n")
    with pytest.raises(ValueError, match="one level only"):
        kr.load_kernel_file("nested.metal")


def test_the_routed_gate_up_gemv_sees_the_routers_selection():
    header, bodies = kr.load_kernel_file("moe/gemm.metal")
    assert "inline uint moe_router_picks" in header and "moe_gemv_gate_up_swiglu_routed" in bodies


# --- build cache ---------------------------------------------------------------------------------

@pytest.fixture
def fake_factories(monkeypatch):
    """Replace the per-backend kernel constructors with recorders."""
    builds = []

    def factory(backend):
        if backend not in ("metal", "sim", "cuda"):
            raise ValueError(f"backend {backend!r} runs no kernels")

        def make(**kwargs):
            builds.append((backend, kwargs))
            return object()
        return make

    monkeypatch.setattr(kr, "_factory", factory)
    return builds


def test_get_kernel_builds_once_per_backend(kernel_dir, fake_factories):
    k_sim = kr.get_kernel(SPEC, "sim")
    assert kr.get_kernel(SPEC, "sim") is k_sim
    k_cuda = kr.get_kernel(SPEC, "cuda")
    assert k_cuda is not k_sim and kr.get_kernel(SPEC, "cuda") is k_cuda
    assert [b for b, _ in fake_factories] == ["sim", "cuda"]
    backend, kwargs = fake_factories[0]
    assert kwargs == dict(
        name="scale_add_f32", input_names=["a", "b"], output_names=["out"],
        source="uint i = thread_position_in_grid.x;\nout[i] = twice(a[i]) + b[i];\n",
        header="template <typename T> T twice(T x) { return x + x; }\n",
        ensure_row_contiguous=True, atomic_outputs=False,
    )
    kr.clear_cache()
    assert kr.get_kernel(SPEC, "sim") is not k_sim
    assert len(fake_factories) == 3


def test_get_kernel_default_backend_from_env(kernel_dir, fake_factories, monkeypatch):
    monkeypatch.setenv("LILY_BACKEND", "sim")
    kr.get_kernel(SPEC)
    assert fake_factories[-1][0] == "sim"


def test_reference_backend_runs_no_kernels(kernel_dir):
    with pytest.raises(ValueError, match="runs no kernels"):
        kr.get_kernel(SPEC, "reference")


def _simulator_problem():
    from lily_dev.moe_testing import simulator_problem

    return simulator_problem()


@pytest.mark.skipif(_simulator_problem() is not None, reason=f"no C++ compiler for the simulator: {_simulator_problem()}")
def test_sim_kernel_built_cached_and_correct(kernel_dir):
    kernel = kr.get_kernel(SPEC, "sim")
    assert kr.get_kernel(SPEC, "sim") is kernel
    n = 96
    a, b = mx.random.normal((n,)), mx.random.normal((n,))
    (out,) = kernel(inputs=[a, b], grid=(n, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(n,)],
                    output_dtypes=[mx.float32], init_value=float("nan"))
    assert mx.allclose(out, 2 * a + b).item()


def test_small_constant_inputs_are_cached_and_wider_than_8_bytes():
    """Cached, and at least CONSTANT_MIN_ELEMENTS wide (the values first, zeros after): MLX's CUDA allocator keeps
    arrays of at most 8 bytes in its managed pool of small arrays."""
    import mlx.core as mx

    a, b = kr.int32_params(2, 3, 1), kr.int32_params(2, 3, True)
    assert a is b and a.dtype == mx.int32 and a.tolist() == [2, 3, 1, 0]
    assert kr.int32_params(2, 3, 0) is not a
    assert kr.int32_params(*range(6)).tolist() == list(range(6))
    eps = kr.float32_scalar(1e-6)
    assert eps is kr.float32_scalar(1e-6) and eps.dtype == mx.float32 and eps.shape == (kr.CONSTANT_MIN_ELEMENTS,)
    assert eps[0].item() == mx.array(1e-6, dtype=mx.float32).item() and eps.nbytes > 8


def test_nested_launch_records_each_see_their_launches():
    """Records nest (a decode plan records inside a test's or tune's record): leaving the inner one
    leaves the outer one listening, even when both hold the same launches."""
    from lily_mlx.core.kernel_registry import _recorders, record_launches

    with record_launches() as outer:
        with record_launches() as inner:
            pass
        assert inner == outer and any(r is outer for r in _recorders) and not any(r is inner for r in _recorders)
    assert not any(r is outer for r in _recorders)
