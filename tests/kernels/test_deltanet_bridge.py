"""Every DeltaNet kernel at Qwen3.6's head shape (Hk=16, Hv=32, Dk=Dv=128, bf16), as the host code
launches it, translated by the Metal->CUDA bridge and compiled for the H200 (sm_90a) with nvcc.
Needs nvcc (no GPU): MLX's CUDA kernel factory is replaced by the bridge's recorder."""

from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import mlx.core as mx
import pytest

from lily_mlx.core import backend, kernel_registry
from lily_mlx.ops.deltanet import kernels as dk
from lily_dev import compile_check
from lily_dev.deltanet_bench import QWEN36, _inputs

pytestmark = [
    pytest.mark.skipif(compile_check.nvcc_path() is None, reason="nvcc (CUDA toolkit) not installed"),
    pytest.mark.slow,
]


def _record_launches():
    """{kernel name: CUDA translation unit} for one call of every DeltaNet kernel variant."""
    records = {}
    Hk, Hv, Dk, Dv = QWEN36["Hk"], QWEN36["Hv"], QWEN36["Dk"], QWEN36["Dv"]
    kernel_registry.clear_cache()
    try:
        with mock.patch.object(mx.fast, "cuda_kernel",
                               side_effect=lambda **kw: compile_check.RecordedCudaKernel(records, **kw)), \
                mock.patch.object(backend, "_cuda_available", return_value=True):
            x = _inputs(2, 3, Hk, Hv, Dk, Dv, mx.bfloat16)
            g, beta = dk.gates(x["a"], x["b"], x["A_log"], x["dt_bias"], backend="cuda")
            for register in (True, False):
                dk.scan(x["q"], x["k"], x["v"], g, beta, x["state"], mx.ones((2, 3), mx.bool_), register=register,
                        backend="cuda")
            dk.scan(x["q"], x["k"], x["v"], g, beta, x["state"], mx.ones((2, 3), mx.bool_), staged=True,
                    backend="cuda")
            dk.gated_norm(x["v"], x["z"], x["weight"], 1e-6, backend="cuda")
            x = _inputs(2, 1, Hk, Hv, Dk, Dv, mx.bfloat16)
            for fused in (True, False):
                dk.decode(x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], x["z"],
                          x["weight"], 1e-6, fused=fused, backend="cuda")
            C = 2 * Hk * Dk + Hv * Dv
            dk.conv_qk_norm_decode(mx.zeros((2, 1, C), mx.bfloat16), mx.zeros((2, 3, C), mx.bfloat16),
                                   mx.zeros((C, 4, 1), mx.bfloat16), None, Hk, Dk, Hv, Dv, backend="cuda")
            dk.decode_conv(mx.zeros((2, 1, C), mx.bfloat16), mx.zeros((2, 3, C), mx.bfloat16),
                           mx.zeros((C, 4, 1), mx.bfloat16), None, x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"],
                           x["z"], x["weight"], 1e-6, Hk, Dk, Hv, Dv, backend="cuda")
    finally:
        kernel_registry.clear_cache()
    return records


def test_every_deltanet_kernel_compiles_for_the_h200():
    records = _record_launches()
    assert {name.rsplit("_", 1)[0].removeprefix("custom_kernel_") for name in records} == set(dk.KERNELS)
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(records, pool.map(compile_check.compile_cuda, records.values())))
    failed = {name: out[-1500:] for name, (ok, out) in results.items() if not ok}
    assert not failed, failed
