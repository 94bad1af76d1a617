"""lily_mlx.msl.signature reproduces MLX's own generated kernel text, captured from MLX itself
(tracing inside mx.export_function with verbose=True prints it on fd 1, no Metal device needed)."""

import copy
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from lily_mlx.msl import signature as sig

CASES_FILE = Path(__file__).with_name("msl_signature_cases.py")


def _load_cases():
    spec = importlib.util.spec_from_file_location("msl_signature_cases", CASES_FILE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def mlx_sources():
    r = subprocess.run([sys.executable, str(CASES_FILE)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    blocks = re.findall(r"Generated source code for `(\w+)`:\n```\n(.*?)\n```\n", r.stdout, re.S)
    return dict(blocks)


def test_generator_matches_mlx_for_every_rule(mlx_sources):
    cases = _load_cases().cases()
    assert len(mlx_sources) == len(cases)
    for make_kw, call_kw in cases:
        call_kw = copy.copy(call_kw)
        name, text = sig.generate_source(
            make_kw["name"], make_kw["input_names"], make_kw["output_names"], make_kw["source"],
            make_kw.get("header", ""), call_kw.get("template"), make_kw.get("atomic_outputs", False),
            call_kw["inputs"], call_kw["output_dtypes"])
        assert text == mlx_sources[make_kw["name"]], make_kw["name"]
        assert f"void {name}(" in text


def test_rule_helpers():
    src = "uint x = thread_position_in_grid.x; // grid_size mentioned in a comment"
    assert sig.used_thread_attributes(src) == [("grid_size", "uint3"), ("thread_position_in_grid", "uint3")]
    assert sig.format_template([("T", mx.bfloat16), ("N", 3), ("B", False)]) == "<bfloat16_t, 3, 0>"
    assert sig.template_params({"T": mx.float16, "B": True}) == "template <typename T, bool B>\n"
    specs = sig.classify_inputs(["a", "b", "c", "d"], [mx.zeros((7,)), mx.zeros((8,)), 3, 1.5], "a_shape b_ndim")
    assert [(s.space, s.scalar, s.type) for s in specs] == [
        ("constant", False, "float"), ("device", False, "float"), ("constant", True, "int32_t"),
        ("constant", True, "float")]
    assert (specs[0].has_shape, specs[1].has_ndim, specs[0].has_strides) == (True, True, False)
    assert sig.kernel_name("k", [("T", mx.float32)], specs, [mx.float16]) == (
        "custom_kernel_k__float_floatc_float_int32_ts_floats_float16_t")
