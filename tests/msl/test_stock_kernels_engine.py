"""The fair-baseline engine ``stock-kernels``: stock MLX-LM running its own Gated DeltaNet Metal kernels
on a kernel backend (here the simulator), as it does on a Mac."""

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta as gd

from bench import e2e
from lily_dev.deltanet_stock_kernels import set_stock_kernels, stock_kernels_active
from tests.ops.deltanet_cases import make_module, random_inputs, rel_l2


def test_stock_kernels_run_mlx_lm_kernels_and_restore_stock():
    module = make_module("qwen3_5", 2, 4, 32, 32, seed=3)
    h = random_inputs(1, 6, 32, mx.float32, 3)
    stock = type(module).__call__(module, h)  # MLX-LM's op loop on this CPU
    original = gd._gated_delta_kernel
    calls = []
    set_stock_kernels(True, backend="sim")
    try:
        assert stock_kernels_active()
        kernel = gd._gated_delta_kernel  # MLX-LM's own kernel text, built for the simulator
        gd._gated_delta_kernel = lambda **kw: calls.append(kw) or kernel(**kw)
        with_kernels = type(module).__call__(module, h)
        mx.eval(with_kernels)
    finally:
        set_stock_kernels(False)
    assert len(calls) == 1 and calls[0]["grid"] == (32, 32, 4)  # one launch, MLX-LM's geometry
    assert rel_l2(with_kernels, stock) < 1e-5
    assert gd._gated_delta_kernel is original and not stock_kernels_active()
    mx.eval(type(module).__call__(module, h))  # stock again


def test_engine_names():
    e2e.validate_engine("stock-kernels")
    with pytest.raises(ValueError, match="stock-kernels"):
        e2e.validate_engine("stock-kernel")
    rows = [{"length": 512, "label": "512", "prefill": True, "decode": True,
             "stock": {"prompt_tps": 100.0, "generation_tps": 10.0, "peak_memory": 1.0},
             "stock-kernels": {"prompt_tps": 200.0, "generation_tps": 20.0, "peak_memory": 1.5},
             "lily": {"prompt_tps": 300.0, "generation_tps": 30.0, "peak_memory": 1.2},
             "prefill_ratio": 3.0, "decode_ratio": 3.0, "prefill_ratio_vs_stock_kernels": 1.5,
             "decode_ratio_vs_stock_kernels": 1.5, "same_tokens": True}]
    table = e2e.table_markdown(rows)
    header, rule, line = table.splitlines()
    assert "ratio vs stock-kernels" in header and header.count("|") == rule.count("|") == line.count("|")
    assert "| 1.500 |" in line and "1.00 / 1.50 / 1.20" in line
