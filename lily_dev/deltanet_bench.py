"""Gated DeltaNet kernel microbenchmarks at Qwen3.6 shapes, for the bench harness.

``microbench_cases()`` -> [(name, run_once, bytes_moved, flops)]. ``run_once()`` runs the op once and
waits for it (``mx.eval``); inputs are built once, outside the timed call. Bytes count each array the
op must read or write once (the floor a perfect kernel would move), except the blockwise scan, which
is charged its materialised block states (that traffic is what the ablation measures).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import mlx.core as mx

from lily_mlx.core.backend import resolve_backend
from lily_mlx.ops.deltanet import kernels as dk
from lily_mlx.ops.deltanet import reference as ref
from .deltanet_stock_kernels import mlx_lm_scan

# Qwen3.6-35B-A3B Gated DeltaNet heads (one rank).
QWEN36 = dict(Hk=16, Hv=32, Dk=128, Dv=128)
PREFILL_LENGTHS = (512, 2048, 8192)

Case = Tuple[str, Callable[[], None], int, int]


def _inputs(B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, dtype, seed: int = 0):
    key = mx.random.key(seed)
    ks = mx.random.split(key, 8)
    q, k = ref.qk_norm(mx.random.normal((B, T, Hk, Dk), key=ks[0]).astype(dtype),
                       mx.random.normal((B, T, Hk, Dk), key=ks[1]).astype(dtype), Dk)
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2]).astype(dtype)
    a = mx.random.normal((B, T, Hv), key=ks[3]).astype(dtype)
    b = mx.random.normal((B, T, Hv), key=ks[4]).astype(dtype)
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (Hv,), key=ks[5]))
    dt_bias = mx.random.normal((Hv,), key=ks[6]).astype(dtype)
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk), key=ks[7])
    z = mx.random.normal((B, T, Hv, Dv), key=ks[0]).astype(dtype)
    weight = mx.ones((Dv,), dtype=dtype)
    arrays = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state, z=z, weight=weight)
    mx.eval(list(arrays.values()))
    return arrays


def _scan_bytes(B, T, Hk, Hv, Dk, Dv, isz, blocks: int = 0) -> int:
    activations = (2 * B * T * Hk * Dk + 2 * B * T * Hv * Dv) * isz  # q, k, v, y
    gates = 2 * B * T * Hv * 4  # g, beta fp32
    state = B * Hv * Dv * Dk * 4
    extra = (2 * blocks - 1) * state if blocks else 0  # block states written, then read back
    return activations + gates + 2 * state + extra


def _scan_flops(B, T, Hv, Dk, Dv) -> int:
    return 7 * B * T * Hv * Dv * Dk  # decay 1, S k 2, rank-1 update 2, S q 2 per state element


def microbench_cases(backend: Optional[str] = None, B: int = 1, dtype=mx.bfloat16) -> List[Case]:
    """Scan (T = 512, 2K, 8K; register, staged and blockwise), decode (fused, unfused) and the decode step from
    the in_proj output (one kernel vs conv + decode kernels) at Qwen3.6 shapes, plus stock's paths for
    comparison. ``backend`` defaults to the active one; on the reference
    backend the lily cases are left out (there is no kernel to time)."""
    backend = backend or resolve_backend()
    Hk, Hv, Dk, Dv = QWEN36["Hk"], QWEN36["Hv"], QWEN36["Dk"], QWEN36["Dv"]
    isz = mx.zeros((), dtype=dtype).itemsize
    kernels = backend != "reference"
    cases: List[Case] = []

    for T in PREFILL_LENGTHS:
        x = _inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=T)
        g, beta = ref.gates(x["a"], x["b"], x["A_log"], x["dt_bias"])
        g, beta = g.astype(mx.float32), beta.astype(mx.float32)
        mx.eval(g, beta)
        flops = _scan_flops(B, T, Hv, Dk, Dv)
        if kernels:
            for register in (True, False):
                blocks = 0 if register else -(-T // dk.BLOCKWISE_SCAN_BLOCK)

                def run(x=x, g=g, beta=beta, register=register):
                    mx.eval(dk.scan(x["q"], x["k"], x["v"], g, beta, x["state"], register=register, backend=backend))

                name = f"deltanet_scan_{'register' if register else 'blockwise'}_T{T}"
                cases.append((name, run, _scan_bytes(B, T, Hk, Hv, Dk, Dv, isz, blocks), flops))

            for partials in (dk.ROW_SUM_PARTIALS, 1):
                def run_staged(x=x, g=g, beta=beta, partials=partials):
                    mx.eval(dk.scan(x["q"], x["k"], x["v"], g, beta, x["state"], staged=True, backend=backend,
                                    partials=partials))

                # deltanet_scan_staged (issue 14): the register scan's bits, inputs staged through
                # threadgroup memory a chunk at a time; to be timed against deltanet_scan_register_T{T}.
                # _p1: one sequential chain per row dot product (the layout before ROW_SUM_PARTIALS).
                tag = "" if partials == dk.ROW_SUM_PARTIALS else f"_p{partials}"
                cases.append((f"deltanet_scan_staged{tag}_T{T}", run_staged, _scan_bytes(B, T, Hk, Hv, Dk, Dv, isz),
                              flops))
        cases += _stock_scan_cases(x, g, beta, T, _scan_bytes(B, T, Hk, Hv, Dk, Dv, isz), flops,
                                   backend if kernels else None)

    x = _inputs(B, 1, Hk, Hv, Dk, Dv, dtype, seed=1)
    decode_bytes = (2 * B * Hk * Dk + 3 * B * Hv * Dv) * isz + 2 * B * Hv * 4 + 2 * B * Hv * Dv * Dk * 4
    decode_flops = _scan_flops(B, 1, Hv, Dk, Dv) + 6 * B * Hv * Dv
    args = (x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], x["z"], x["weight"], 1e-6)
    if kernels:
        for fused in (True, False):
            def run(fused=fused):
                mx.eval(dk.decode(*args, fused=fused, backend=backend))

            cases.append((f"deltanet_decode_{'fused' if fused else 'unfused'}", run, decode_bytes, decode_flops))

        def run_fused_p1():
            mx.eval(dk.decode(*args, fused=True, backend=backend, partials=1))

        cases.append(("deltanet_decode_fused_p1", run_fused_p1, decode_bytes, decode_flops))

    def run_reference_decode():
        mx.eval(ref.decode_step(*args))

    cases.append(("deltanet_decode_stock", run_reference_decode, decode_bytes, decode_flops))
    cases += _conv_decode_cases(backend if kernels else None, B, Hk, Hv, Dk, Dv, dtype, isz)
    return cases


def _conv_decode_cases(backend, B, Hk, Hv, Dk, Dv, dtype, isz, K: int = 4) -> List[Case]:
    """Decode conv1d + SiLU + conv-state shift + q/k norm: our kernel and stock's op chain."""
    import mlx.nn as nn

    C = 2 * Hk * Dk + Hv * Dv
    conv1d = nn.Conv1d(C, C, kernel_size=K, groups=C, bias=False)
    conv1d.weight = (0.5 * mx.random.normal((C, K, 1), key=mx.random.key(3))).astype(dtype)
    qkv = mx.random.normal((B, 1, C), key=mx.random.key(4)).astype(dtype)
    conv_state = mx.random.normal((B, K - 1, C), key=mx.random.key(5)).astype(dtype)
    mx.eval(conv1d.weight, qkv, conv_state)
    nbytes = (C * K + B * C * (1 + 2 * (K - 1) + 1)) * isz  # weight, qkv, state in/out, q|k|v
    flops = B * C * (2 * K + 4)
    cases: List[Case] = []
    if backend is not None:
        def run_kernel():
            mx.eval(dk.conv_qk_norm_decode(qkv, conv_state, conv1d.weight, None, Hk, Dk, Hv, Dv, backend=backend))

        cases.append(("deltanet_conv_qk_norm_decode", run_kernel, nbytes, flops))
        cases += _decode_conv_cases(backend, qkv, conv_state, conv1d.weight, B, Hk, Hv, Dk, Dv, dtype, isz, K)

    def run_stock():
        conv_input = ref.conv_input_with_state(qkv, conv_state, None)
        new_state = ref.next_conv_state(conv_input, K - 1, None, 1)
        q, k, v = mx.split(ref.conv1d_silu(conv_input, conv1d), [Hk * Dk, 2 * Hk * Dk], -1)
        q, k = ref.qk_norm(q.reshape(B, 1, Hk, Dk), k.reshape(B, 1, Hk, Dk), Dk)
        mx.eval(q, k, v.reshape(B, 1, Hv, Dv), new_state)

    cases.append(("deltanet_conv_qk_norm_decode_stock", run_stock, nbytes, flops))
    return cases


def _decode_conv_cases(backend, qkv, conv_state, conv_weight, B, Hk, Hv, Dk, Dv, dtype, isz, K) -> List[Case]:
    """One decode step of a layer from the in_proj output: ``deltanet_decode_conv_fused`` (switch
    fused_conv_step, one launch) next to the two kernels it replaces (conv + q/k norm, fused decode).
    Same bytes for both: the floor (the two-kernel path also writes and reads q, k, v)."""
    C = 2 * Hk * Dk + Hv * Dv
    x = _inputs(B, 1, Hk, Hv, Dk, Dv, dtype, seed=2)
    decode_args = (x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"], x["z"], x["weight"], 1e-6)
    nbytes = ((C * K + B * C * (1 + 2 * (K - 1)) + B * Hv * Dv * 2) * isz + 2 * B * Hv * 4
              + 2 * B * Hv * Dv * Dk * 4)
    flops = B * C * (2 * K + 4) + _scan_flops(B, 1, Hv, Dk, Dv) + 6 * B * Hv * Dv

    def run_fused():
        mx.eval(dk.decode_conv(qkv, conv_state, conv_weight, None, *decode_args, Hk, Dk, Hv, Dv, backend=backend))

    def run_two_kernels():
        q, k, v, new_conv_state = dk.conv_qk_norm(qkv, conv_state, conv_weight, None, Hk, Dk, Hv, Dv, backend=backend)
        mx.eval(new_conv_state, dk.decode(q, k, v, *decode_args, fused=True, backend=backend))

    return [("deltanet_decode_conv_fused", run_fused, nbytes, flops),
            ("deltanet_decode_conv_two_kernels", run_two_kernels, nbytes, flops)]


def _stock_scan_cases(x, g, beta, T, nbytes, flops, backend: Optional[str] = None) -> List[Case]:
    """Stock comparators: MLX-LM's scan as it dispatches here (its Metal kernel on an Apple GPU, the
    per-token loop elsewhere: left out beyond T = 512 there), MLX core's ``gated_delta_update`` and,
    on a kernel ``backend``, MLX-LM's own generic and packed Metal kernels built for it (through the
    bridge on an NVIDIA GPU): the kernel-against-kernel comparison an Apple GPU would make."""
    cases: List[Case] = []
    q, k, v, state = x["q"], x["k"], x["v"], x["state"]
    if ref.stock_uses_metal_kernel(k, True) or T <= 512:
        def run_mlx_lm():
            mx.eval(ref.scan_stock(q, k, v, g, beta, state))

        cases.append((f"mlx_lm_gated_delta_T{T}", run_mlx_lm, nbytes, flops))
    if hasattr(mx.fast, "gated_delta_update"):
        def run_mlx_fast():
            mx.eval(mx.fast.gated_delta_update(q, k, v, g, beta, state))

        cases.append((f"mlx_fast_gated_delta_update_T{T}", run_mlx_fast, nbytes, flops))
    if backend is not None:
        for packed in (False, True):
            def run_mlx_lm_kernel(packed=packed):
                mx.eval(mlx_lm_scan(q, k, v, g, beta, state, packed=packed, backend=backend))

            cases.append((f"mlx_lm_kernel_{'packed' if packed else 'generic'}_T{T}", run_mlx_lm_kernel, nbytes, flops))
    return cases
