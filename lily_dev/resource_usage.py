"""What ptxas gives each kernel on the H200 (sm_90a), without a GPU: registers per thread, spills, static
shared memory, for lily's DeltaNet scans and MLX-LM's own gated-delta kernels (the fair baseline's) at
Qwen3.6's head shape, and the MoE GEMM tiles with fp32 and bf16 operands.

    python -m lily_dev.resource_usage [--family deltanet,moe,attention]    # needs nvcc (CUDA toolkit)

Static facts, not timings: a kernel with more registers per thread keeps fewer threads resident per
SM (65,536 registers), a spill is local-memory traffic. They explain timings; they do not replace them.
"""

from __future__ import annotations

import argparse
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Dict, Optional
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import compile_check

REGISTERS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048


def ptxas_usage(unit: str) -> dict:
    """{registers, spill_stores, spill_loads, smem, stack} of the kernel in one translation unit (nvcc -Xptxas -v)."""
    ok, out = compile_check.compile_nvcc(unit, extra_flags=("-Xptxas", "-v"))
    if not ok:
        raise RuntimeError(out[-2000:])

    def grab(pattern: str) -> int:
        m = re.search(pattern, out)
        return int(m.group(1)) if m else 0

    return {"registers": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads"), "smem": grab(r"(\d+) bytes smem"),
            "stack": grab(r"(\d+) bytes stack frame")}


def record_deltanet_units() -> Dict[str, str]:
    """{kernel name: CUDA translation unit} for one call of every lily DeltaNet kernel variant at
    Qwen3.6's head shape (Hk 16, Hv 32, Dk = Dv = 128, bf16), as the host code launches them."""
    from lily_mlx.core import backend, kernel_registry
    from lily_mlx.ops.deltanet import kernels as dk

    from .deltanet_bench import QWEN36, _inputs

    records: Dict[str, str] = {}
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
            hidden = 2048  # the step from the layer's input (with the trial row GEMV), the input norm inside
            w, scales, biases = mx.quantize(mx.zeros((C + Hv * Dv + 2 * Hv, hidden), mx.bfloat16), group_size=64,
                                            bits=4, stream=mx.cpu)
            dk.decode_from_hidden(mx.zeros((2, 1, hidden), mx.bfloat16), w, scales, biases, 64,
                                  mx.zeros((2, 3, C), mx.bfloat16), mx.zeros((C, 4, 1), mx.bfloat16), None,
                                  x["A_log"], x["dt_bias"], x["state"], x["weight"], 1e-6, Hk, Dk, Hv, Dv,
                                  in_norm=(mx.ones((hidden,), mx.bfloat16), 1e-6), backend="cuda")
    finally:
        kernel_registry.clear_cache()
    return records


def mlx_lm_gdn_units() -> Dict[str, str]:
    """MLX-LM's own gated-delta Metal kernels through the bridge at Qwen3.6's head shape, bf16."""
    from lily_mlx.msl.cuda import metal_kernel, wrap_like_mlx

    from .deltanet_stock_kernels import mlx_lm_kernel_args

    B, T, Hk, Hv, Dk, Dv = 1, 5, 16, 32, 128, 128
    dt = mx.bfloat16
    units = {}
    for name, kw in mlx_lm_kernel_args().items():
        q = mx.zeros((B, T, Hk, Dk), dt)
        g = mx.zeros((B, T, Hv, Dk) if "vec" in name else (B, T, Hv))
        inputs = [q, q, mx.zeros((B, T, Hv, Dv), dt), g, mx.zeros((B, T, Hv)), mx.zeros((B, Hv, Dv, Dk)), T]
        if "mask" in name:
            inputs.append(mx.zeros((B, T), mx.bool_))
        template = [("InT", dt), ("StT", mx.float32), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)]
        units[f"mlx_lm:{name}"] = wrap_like_mlx(metal_kernel(**kw), inputs, [dt, mx.float32], template)[1]
    return units


def _cuda_unit(spec, inputs, output_dtypes, template) -> str:
    """The CUDA translation unit MLX would compile for kernel ``spec`` (a KernelSpec) launched with these inputs,
    output dtypes and template, through the bridge."""
    from lily_mlx.core.kernel_registry import kernel_source
    from lily_mlx.msl.cuda import metal_kernel, wrap_like_mlx

    header, body = kernel_source(spec)
    kernel = metal_kernel(spec.name, list(spec.input_names), list(spec.output_names), body, header=header)
    return wrap_like_mlx(kernel, inputs, output_dtypes, template=template)[1]


@contextmanager
def _captured_launches(module, factory: str = "_kernel"):
    """``module.<factory>`` (the function that hands out a launcher for a dispatch-table name or a KernelSpec and a
    backend) replaced for the block: every launch is recorded as (that name or spec, its keyword arguments) in the
    yielded list and returns zeros of its output shapes, nothing runs."""
    calls = []

    def kernel(name, backend=None):
        def launch(**kw):
            calls.append((name, kw))
            return [mx.zeros(tuple(s), d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]
        return launch

    with mock.patch.object(module, factory, kernel):
        yield calls


def moe_gemm_units(dtypes=(mx.bfloat16,)) -> Dict[str, str]:
    """The grouped GEMMs (gate+up+SwiGLU, down) at Qwen3.6's widths, for each activation dtype with fp32
    tile operands and with operands of that dtype, and their register-tiled forms (switch register_tiles; 128, 64
    and 256 threads, and the 64-thread gate/up form with its staged columns' loops rolled, ``WR=0``)."""
    from lily_mlx.ops.moe import kernels as mk

    from .moe_testing import make_routing, make_sparse_moe_block

    block = make_sparse_moe_block(hidden=2048, expert_width=512, num_experts=8, top_k=2, seed=1)
    sw = block.switch_mlp
    flat = make_routing("uniform", 40, 2, 8, 1).reshape(-1)
    counts = np.bincount(flat, minlength=8)
    sched = {"counts": mx.array(counts.astype(np.int32)),
             "sorted_rows": mx.array(np.argsort(flat, kind="stable").astype(np.int32)),
             "blocks": mx.array(mk.host_block_map(counts, True))}
    with _captured_launches(mk) as calls:
        for dtype in dtypes:
            x = mx.zeros((40, 2048), dtype)
            for tile, tiles in ((None, "simdgroup"), (dtype, "simdgroup"), (None, "register"), (None, "register64"),
                               (None, "register256"), (None, "register64_rolled")):
                h = mk.gemm_gate_up_swiglu(x, sched["sorted_rows"], sched["blocks"], sw.gate_proj, sw.up_proj, 2,
                                           True, sched["counts"], "cuda", tile_dtype=tile, tiles=tiles)
                mk.gemm_down(h, sched["blocks"], sw.down_proj, True, sched["counts"], "cuda", tile_dtype=tile,
                             tiles=tiles)
    units = {}
    for name, kw in calls:
        t = dict(kw["template"])
        key = (f"{mk.KERNELS[name].name}[T={t['T']}, MT={t.get('MT')}" + (f", NT={t['NT']}" if t.get("NT") else "")
               + (", WR=0" if t.get("WR") == 0 else "") + "]")
        units[key] = _cuda_unit(mk.KERNELS[name], kw["inputs"], kw["output_dtypes"], kw["template"])
    return units


def down_combine_unit(blocks_per_token: int = 9, width: int = 2048, expert_width: int = 512,
                      direct: bool = False, in_flight: Optional[int] = None, simd_barriers: bool = False) -> tuple:
    """(CUDA translation unit, threads per threadgroup) of ``moe_gemv_down_combine`` (``direct``: its direct
    layout, ``moe_gemv_down_combine_direct``; ``in_flight``: the staged layout's chunks in flight, by default the
    product's; ``simd_barriers``: its groups' simdgroup barriers) in bf16 as a
    decode call launches it, with the template of Qwen3.6's shape (8 experts + 1 shared chunk, hidden 2048, expert
    width 512); the inputs' shapes do not enter the translation, a small block's stand in."""
    from lily_mlx.ops.moe import kernels as mk

    from .moe_testing import make_sparse_moe_block

    k = blocks_per_token - 1
    geometry = (mk.down_combine_direct_geometry if direct else mk.down_combine_geometry)(
        blocks_per_token, width, expert_width)
    block = make_sparse_moe_block(hidden=128, expert_width=64, num_experts=16, top_k=k, shared_width=64, seed=1)
    block.set_dtype(mx.bfloat16)
    with _captured_launches(mk) as calls:
        mk.gemv_down_combine(mx.zeros((blocks_per_token, 64), mx.bfloat16), mx.zeros((blocks_per_token, 4), mx.int32),
                             block.switch_mlp.down_proj, block.shared_expert, mx.zeros((1, k), mx.bfloat16),
                             mx.zeros((1,), mx.float32), mx.zeros((1, 128), mx.bfloat16), geometry, "cuda",
                             direct=direct)
    (name, kw), = calls
    rows, chunk, groups = geometry
    sizes = [("KB", chunk), ("KX", expert_width)] if direct else [("KC", chunk)]
    in_flight = mk.chunks_in_flight(expert_width // chunk, in_flight or mk.DOWN_COMBINE_IN_FLIGHT)
    ring = [] if direct else [("PD", in_flight), ("GS", int(simd_barriers))]
    template = [("T", mx.bfloat16), ("R", rows), *sizes, ("NBLK", blocks_per_token), ("NG", groups), *ring]
    return _cuda_unit(mk.KERNELS[name], kw["inputs"], kw["output_dtypes"], template), rows * groups


def gate_up_gemv_unit(experts: int = 256, width: int = 2048, expert_width: int = 512, split: int = 1,
                      in_flight: int = 1, layout=None) -> str:
    """The CUDA translation unit of the decode gate/up GEMV with the router's top-k inside
    (``moe_gemv_gate_up_swiglu_routed``) in bf16 with the template of Qwen3.6's shape (256 experts, hidden 2048,
    expert width 512); a small block's launch stands in for the inputs (their shapes do not enter the translation).
    ``split`` > 1: its layout under switch split_k_gate_up; ``in_flight``: chunks in flight (without the split);
    ``layout``: (R, KC) in place of ``GEMV_LAYOUT``'s (candidates)."""
    from lily_mlx.ops.moe import kernels as mk

    from .moe_testing import make_sparse_moe_block

    block = make_sparse_moe_block(hidden=128, expert_width=64, num_experts=16, top_k=4, shared_width=64, seed=1)
    block.set_dtype(mx.bfloat16)
    with _captured_launches(mk) as calls:
        mk.gemv_gate_up_routed(block, mx.zeros((1, 128), mx.bfloat16), mx.zeros((1, 16), mx.float32), "cuda")
    (name, kw), = calls
    rows, chunk, *_ = mk.gemv_geometry("gate_up", expert_width, width, layout or mk.gate_up_split_layout(split),
                                       mk.ROUTED_GEMV_PROBS_BYTES)
    ring = mk.chunks_in_flight(width // chunk, in_flight) if split == 1 else 1
    template = [("T", mx.bfloat16), ("R", rows), ("KC", chunk), ("NPL", -(-experts // 32)), ("SK", split),
                ("PD", ring)]
    return _cuda_unit(mk.KERNELS[name], kw["inputs"], kw["output_dtypes"], template)


def attention_units(heads: tuple = (16, 2), head_dim: int = 256) -> Dict[str, str]:
    """The decode attention kernels in bf16 at Qwen3.6's heads (16 query heads, 2 KV heads, head dim 256) with their
    default templates: the one-pass kernel, the fixed blocks' partials and their merge, and the partials with half
    a KV head's query heads a threadgroup (``[GT=4]``, a candidate), and the three forms over a 4- and an 8-bit quantized
    cache (``[4-bit]``, ``[8-bit]``: one pass, fixed blocks, live length). The rows' count is a runtime parameter, so a small cache stands in for a long
    one."""
    from lily_mlx.ops.attention import kernels as ak

    hq, hkv = heads
    q = mx.zeros((1, hq, 1, head_dim), mx.bfloat16)
    kv = mx.zeros((1, hkv, 1024, head_dim), mx.bfloat16)
    with _captured_launches(ak, "get_kernel") as calls:
        ak.decode_attention(q, kv, kv, scale=0.0625, backend="cuda")
        ak.decode_attention_fixed_blocks(q, kv, kv, scale=0.0625, backend="cuda")
        ak.decode_attention_fixed_blocks(q, kv, kv, scale=0.0625, backend="cuda", heads_per_threadgroup=hq // hkv // 2)
        for bits in (4, 8):  # a quantized KV cache (MLX-LM's --kv-bits), groups of 64
            quantized = tuple(mx.quantize(kv, group_size=64, bits=bits))
            ak.decode_attention_quantized(q, quantized, quantized, scale=0.0625, bits=bits, group_size=64,
                                          backend="cuda")
            ak.decode_attention_quantized(q, quantized, quantized, scale=0.0625, bits=bits, group_size=64,
                                          fixed_blocks=True, backend="cuda")
            ak.decode_attention_quantized_live(q, quantized, quantized, mx.array([1000], dtype=mx.int32),
                                               scale=0.0625, bits=bits, group_size=64, backend="cuda")
    units = {}
    for spec, kw in calls:
        template = dict(kw["template"])
        gt = template.get("GT")
        name = spec.name if gt in (None, hq // hkv) else f"{spec.name}[GT={gt}]"
        name += f"[{template['BITS']}-bit]" if "BITS" in template else ""
        units.setdefault(name, _cuda_unit(spec, kw["inputs"], kw["output_dtypes"], kw["template"]))
    return units


def router_units(shapes=((256, 8, 8, 2048), (1024, 32, 8, 4096), (16, 4, 4, 64))) -> Dict[str, tuple]:
    """{name: (CUDA translation unit, threads per threadgroup)} of the router kernels (one kernel, the
    split pair, the split logits of a prompt-sized call and the residual norm with the logits) for (experts,
    top-k, bits, hidden) shapes, bf16, as ``route_tokens``, ``router_logits`` and ``residual_norm_router_logits``
    launch them."""
    from lily_mlx.core import switches
    from lily_mlx.ops.moe import kernels as mk

    from .moe_testing import make_sparse_moe_block

    units = {}
    for experts, top_k, bits, hidden in shapes:
        block = make_sparse_moe_block(hidden=hidden, expert_width=64, num_experts=experts, top_k=top_k, seed=1)
        if bits != 8:  # the block comes with an 8-bit router
            _requantize_router(block, bits)
        x = mx.zeros((1, hidden), mx.bfloat16)
        with _captured_launches(mk) as calls:
            for split in (True, False):
                with switches.overrides(**({} if split else {"disable": ["split_router"]})):
                    mk.route_tokens(block, x, True, "cuda")
            mk.router_logits(block, mx.zeros((3 * mk.ROUTER_TOKENS_PER_GROUP, hidden), mx.bfloat16), True, "cuda")
            norm = nn.RMSNorm(hidden)
            norm.weight = norm.weight.astype(mx.bfloat16)
            mk.residual_norm_router_logits(block, norm, x, x, "cuda")
        for name, kw in calls:
            spec = mk.KERNELS[name]
            unit = _cuda_unit(spec, kw["inputs"], kw["output_dtypes"], kw["template"])
            units[f"{spec.name}[E={experts}, k={top_k}, bits={bits}, D={hidden}]"] = (unit, kw["threadgroup"][0])
    return units


def linear_gemv_units(rows=(1, 2, 4, 8), k: int = 2048, n: int = 4096, group_size: int = 64) -> Dict[str, tuple]:
    """{name: (CUDA translation unit, threads per threadgroup)} of the dense row GEMV (``linear_gemv_q4``) and of
    it with the input norm inside (``linear_gemv_q4_rms_norm``) for calls of ``rows`` rows of x, bf16, as
    ``gemv_q4`` / ``gemv_q4_rms_norm`` launch them."""
    from lily_mlx.core.kernel_registry import float32_scalar
    from lily_mlx.ops.linear import kernels as lk

    wq, scales, biases = mx.quantize(mx.zeros((n, k), mx.bfloat16), group_size=group_size, bits=4, stream=mx.cpu)
    units = {}
    for name, extra in (("gemv_q4", []), ("gemv_q4_rms_norm", [mx.ones((k,), mx.bfloat16), float32_scalar(1e-6)])):
        spec = lk.KERNELS[name]
        for m in rows:
            x = mx.zeros((m, k), mx.bfloat16)
            inputs = [x, wq, scales, biases, *extra, spec.pack(K=k, N=n, B=m)]
            template = [("T", mx.bfloat16), ("M", min(m, lk.MAX_ROWS_PER_LAUNCH)), ("GS", group_size)]
            unit = _cuda_unit(spec, inputs, [mx.bfloat16], template)
            units[f"{spec.name}[M={m}, K={k}, GS={group_size}]"] = (unit, lk.SIMDGROUPS * 32)
    return units


def _requantize_router(block, bits: int) -> None:
    """The block's router and shared-expert gate quantised to ``bits`` (group 64), bf16 scales."""
    import mlx.nn as nn

    for name in ("gate", "shared_expert_gate"):
        layer = getattr(block, name)
        w = mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=layer.group_size, bits=layer.bits)
        dense = nn.Linear(w.shape[1], w.shape[0], bias=False)
        dense.weight = w.astype(mx.bfloat16)
        setattr(block, name, nn.QuantizedLinear.from_linear(dense, group_size=64, bits=bits))


def table(usage: Dict[str, dict], threads: Dict[str, int]) -> str:
    lines = ["| kernel | registers / thread | spill stores / loads (bytes) | static smem (bytes) | threads / SM by registers |",
             "|---|---|---|---|---|"]
    for name, u in usage.items():
        per_sm = min(MAX_THREADS_PER_SM, REGISTERS_PER_SM // max(1, u["registers"]) // 32 * 32)
        lines.append(f"| {name} | {u['registers']} | {u['spill_stores']} / {u['spill_loads']} | {u['smem']} | {per_sm} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lily_dev.resource_usage", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="deltanet,moe", help="comma-separated: deltanet, moe, attention")
    args = p.parse_args(argv)
    if compile_check.nvcc_path() is None:
        print("nvcc (CUDA toolkit) not found", file=sys.stderr)
        return 2
    families = {f.strip() for f in args.family.split(",")}
    units: Dict[str, str] = {}
    if "deltanet" in families:
        units.update({name.removeprefix("custom_kernel_").rsplit("_", 1)[0]: unit
                      for name, unit in record_deltanet_units().items() if "scan" in name or "decode" in name})
        units.update(mlx_lm_gdn_units())
    if "moe" in families:
        units.update(moe_gemm_units())
    if "attention" in families:
        units.update(attention_units())
    with ThreadPoolExecutor(2) as pool:
        usage = dict(zip(units, pool.map(ptxas_usage, units.values())))
    print(table(usage, {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
