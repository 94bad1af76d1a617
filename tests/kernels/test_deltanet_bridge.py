"""Every DeltaNet kernel at Qwen3.6's head shape (Hk=16, Hv=32, Dk=Dv=128, bf16), as the host code
launches it, translated by the Metal->CUDA bridge and compiled for the H200 (sm_90a) with nvcc.
Needs nvcc (no GPU): MLX's CUDA kernel factory is replaced by the bridge's recorder."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from lily_mlx.ops.deltanet import kernels as dk
from lily_dev import compile_check, resource_usage

pytestmark = [
    pytest.mark.skipif(compile_check.nvcc_path() is None, reason="nvcc (CUDA toolkit) not installed"),
    pytest.mark.slow,
]


def test_every_deltanet_kernel_compiles_for_the_h200():
    records = resource_usage.record_deltanet_units()
    assert {name.rsplit("_", 1)[0].removeprefix("custom_kernel_") for name in records} == set(dk.KERNELS)
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(records, pool.map(compile_check.compile_cuda, records.values())))
    failed = {name: out[-1500:] for name, (ok, out) in results.items() if not ok}
    assert not failed, failed


def test_scans_and_decode_kernels_do_not_spill_on_the_h200():
    """ptxas at Qwen3.6's head shape: every scan and decode kernel keeps its state in registers without
    spilling to local memory (docs/deltanet.md, "Prefill scan vs MLX-LM's kernel": register counts)."""
    units = {name: unit for name, unit in resource_usage.record_deltanet_units().items()
             if "scan" in name or "decode" in name}
    with ThreadPoolExecutor(2) as pool:
        usage = dict(zip(units, pool.map(resource_usage.ptxas_usage, units.values())))
    for name, u in usage.items():
        assert u["registers"] > 0 and u["spill_stores"] == 0 and u["spill_loads"] == 0, (name, u)


@pytest.mark.skipif(compile_check.compiler_available() != "nvrtc", reason="needs NVRTC (pip install nvidia-cuda-nvrtc)")
def test_scan_and_decode_kernels_move_the_state_16_bytes_at_a_time():
    """Each lane's 32 fp32 state elements go in and out as 8 16-byte accesses (deltanet_load_state /
    deltanet_store_state), none one float at a time: with scalar accesses a simdgroup's load touched 16
    sectors for 128 useful bytes (Nsight Compute on the H200: 72 % of the decode kernel's sectors excess)."""
    units = {name: unit for name, unit in resource_usage.record_deltanet_units().items()
             if "scan" in name or "decode_fused" in name or "decode_conv_fused" in name}
    assert len(units) >= 4
    for name, unit in units.items():
        ptx = compile_check.ptx_nvrtc(unit)
        loads = ptx.count("ld.global.v4.f32") + ptx.count("ld.global.nc.v4.f32")
        stores = ptx.count("st.global.v4.f32")
        assert loads >= 8 and stores >= 8, (name, loads, stores)
        assert ptx.count("st.global.f32") <= 1, name  # at most a scan's fp32 read-out y
