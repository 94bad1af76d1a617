"""The layout docs/design.md describes, pinned: which way imports flow, where kernels live, what ships.

- no import circles between lily-mlx modules (every import statement counts, lazy ones included);
- ``lily_mlx.msl`` stands alone: it imports nothing else from lily-mlx;
- ``lily_mlx.core`` (the bottom layer) imports only itself and ``msl``;
- an op family never imports another family (every module of ``lily_mlx.ops`` but the package itself
  belongs to one);
- every ``.metal`` file sits in the folder of the family that launches it, and its kernels are named
  ``<family>_<op>[_<variant>]``;
- the wheel ships no test, benchmark or dev-only code.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lily_mlx"
FAMILIES = ("deltanet", "moe", "attention", "linear")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path):
    """Every lily_mlx module ``path`` imports (absolute or relative, at any depth of the code)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # "from pkg import module"
    return {m for m in found if m.split(".")[0] == "lily_mlx"}


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_import_circles():
    graph = _graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    # A package's __init__ importing its own submodule is not a circle of code.
    cycles = [c for c in cycles if not all(m.startswith(min(c, key=len)) for m in c)]
    assert not cycles, f"import circles: {cycles}"


def _imports_of(prefix: str):
    return {name: deps for name, deps in _graph().items() if name == prefix or name.startswith(prefix + ".")}


def test_msl_stands_alone():
    for name, deps in _imports_of("lily_mlx.msl").items():
        outside = {d for d in deps if not d.startswith("lily_mlx.msl")}
        assert not outside, f"{name} imports {outside}"


def test_core_is_the_bottom_layer():
    for name, deps in _imports_of("lily_mlx.core").items():
        outside = {d for d in deps if not d.startswith(("lily_mlx.core", "lily_mlx.msl"))}
        assert not outside, f"{name} imports {outside}"


def _family_of(module: str):
    """The op family of ``lily_mlx.ops.<family>`` and of its modules ``lily_mlx.ops.<family>.<module>``
    (a flat ``lily_mlx.ops.<family>_<module>`` counts too); None for any other module."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["lily_mlx", "ops"]:
        return next((f for f in FAMILIES if parts[2] == f or parts[2].startswith(f + "_")), None)
    return None


def test_families_never_import_each_other():
    for name, deps in _imports_of("lily_mlx.ops").items():
        if name == "lily_mlx.ops":
            continue
        own = _family_of(name)
        assert own is not None, f"{name} belongs to no op family {FAMILIES}"
        others = {d for d in deps if _family_of(d) not in (None, own)}
        assert not others, f"{name} ({own}) imports {others}"


def test_family_of_understands_both_module_layouts():
    assert _family_of("lily_mlx.ops.deltanet") == "deltanet"
    assert _family_of("lily_mlx.ops.deltanet.kernels") == "deltanet"
    assert _family_of("lily_mlx.ops.moe.reference") == "moe"
    assert _family_of("lily_mlx.ops.moe_kernels") == "moe"
    assert _family_of("lily_mlx.ops.attention.layer.attention_forward") == "attention"
    assert _family_of("lily_mlx.ops") is None
    assert _family_of("lily_mlx.ops.moelike") is None
    assert _family_of("lily_mlx.core.dispatch") is None


def test_kernel_files_sit_in_their_family_folder():
    from lily_mlx.core.kernel_registry import kernels_dir, load_kernel_file

    files = sorted(kernels_dir().rglob("*.metal"))
    assert files
    for path in files:
        rel = path.relative_to(kernels_dir())
        assert len(rel.parts) == 2 and rel.parts[0] in FAMILIES, f"{rel} is not in kernels/<family>/"
        _, bodies = load_kernel_file(rel.as_posix())
        for kernel in bodies:
            assert kernel.startswith(rel.parts[0] + "_"), f"{rel}: kernel {kernel} not named {rel.parts[0]}_<op>"


@pytest.mark.slow
def test_wheel_ships_no_test_bench_or_dev_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "No module named 'hatchling'" in proc.stderr + proc.stdout:
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path),
                               str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("lily_mlx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"lily_mlx", "lily_mlx_patches", "lily_mlx_hooks.pth"} | {
        n for n in tops if n.endswith(".dist-info")}, tops
    dev_markers = ("test", "bench", "compile_check", "stock_kernels", "lily_dev")
    shipped_code = [n for n in names if n.endswith(".py")]
    assert not [n for n in shipped_code if any(m in Path(n).name for m in dev_markers)], shipped_code
    assert any(n.startswith("lily_mlx/_kernels/") and n.endswith(".metal") for n in names)
    assert not [n for n in shipped_code if "unittest" in zipfile.ZipFile(wheel).read(n).decode()]


def test_kernel_params_are_named_once():
    """Every kernel with a ``params`` input names its layout in its KernelSpec, and no kernel body
    indexes ``params`` by position (the generated prologue is the only reader)."""
    import re

    import pytest as _pytest

    from lily_mlx.core.kernel_registry import kernel_source, load_kernel_file
    from lily_mlx.ops import attention, deltanet, moe  # noqa: F401  (their kernels modules hold the specs)
    from lily_mlx.ops.attention import kernels as ak
    from lily_mlx.ops.deltanet import kernels as dk
    from lily_mlx.ops.moe import kernels as mk

    specs = [*ak.KERNELS.values(), *dk.KERNELS.values(), *mk.KERNELS.values()]
    for spec in specs:
        assert ("params" in spec.input_names) == bool(spec.params), spec.name
        _, bodies = load_kernel_file(spec.file)
        assert not re.search(r"params\s*\[", bodies[spec.name]), f"{spec.name} reads params by position"
        _, body = kernel_source(spec)
        for i, name in enumerate(spec.params):
            assert f"const int {name} = params[{i}];" in body
        with _pytest.raises(ValueError, match=spec.name):
            spec.pack(**{n: 1 for n in spec.params[:-1]})  # one missing
    assert len({s.name for s in specs}) == len(specs)
