"""Gated DeltaNet kernels, host side: dispatch table, shape rules (``supports``,
``conv_unsupported_reason``), launch geometry.

Kernels live in ``kernels/deltanet/deltanet.metal`` (layout notes there and in docs/deltanet.md). Each host
function has the signature of its reference in ``reference`` (this package) plus ``backend``
(``metal``, ``sim`` or ``cuda``) and ``init_value`` (tests poison outputs with it).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Tuple

import mlx.core as mx

from ...core import projections
from ...core.kernel_registry import KernelSpec, constant_input, float32_scalar, get_kernel

# Dispatch table: one row per kernel of kernels/deltanet/deltanet.metal.
_FILE = "deltanet/deltanet.metal"
KERNELS = {
    spec.name: spec
    for spec in (
        KernelSpec("deltanet_gates", _FILE, ("a", "b", "A_log", "dt_bias", "params"), ("g", "beta"), params=("n", "Hv")),
        KernelSpec(
            "deltanet_scan_register", _FILE,
            ("q", "k", "v", "g", "beta", "state_in", "mask", "params"), ("y", "state_out"),
            params=("B", "T", "Hk", "Hv", "has_state", "has_mask"),
        ),
        KernelSpec(
            "deltanet_scan_staged", _FILE,
            ("q", "k", "v", "g", "beta", "state_in", "mask", "params"), ("y", "state_out"),
            params=("B", "T", "Hk", "Hv", "has_state", "has_mask"),
        ),
        KernelSpec(
            "deltanet_scan_blockwise", _FILE,
            ("q", "k", "v", "g", "beta", "state_in", "mask", "params"), ("y", "state_out", "block_states"),
            params=("B", "T", "Hk", "Hv", "has_state", "has_mask", "block", "n_blocks"),
        ),
        KernelSpec("deltanet_gated_norm", _FILE, ("x", "z", "weight", "eps", "params"), ("out",), params=("rows",)),
        KernelSpec(
            "deltanet_decode_fused", _FILE,
            ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_in", "mask", "z", "weight", "eps", "params"),
            ("out", "state_out"), params=("B", "Hk", "Hv", "has_state", "has_mask"),
        ),
        KernelSpec(
            "deltanet_conv_qk_norm_decode", _FILE,
            ("qkv", "conv_state", "weight", "mask", "lengths", "eps", "params"), ("q", "k", "v", "conv_state_out"),
            params=("B", "Hk", "C", "has_state", "has_mask", "T", "has_lengths"),
        ),
        KernelSpec(
            "deltanet_decode_conv_fused", _FILE,
            ("qkv", "conv_state", "conv_weight", "mask", "lengths", "a", "b", "A_log", "dt_bias", "state_in", "z",
             "weight", "qk_eps", "norm_eps", "params"),
            ("out", "state_out", "conv_state_out"),
            params=("B", "Hk", "Hv", "C", "has_conv_state", "has_state", "has_mask", "has_lengths", "qkv_ld", "z_ld",
                    "z_off", "ab_ld", "a_off", "b_off"),
        ),
        KernelSpec(
            "deltanet_decode_from_hidden", _FILE,
            ("x", "in_norm_weight", "in_norm_eps", "w", "scales", "biases", "conv_state", "conv_weight", "mask",
             "lengths", "A_log", "dt_bias", "state_in", "weight", "qk_eps", "norm_eps", "params"),
            ("out", "state_out", "conv_state_out"),
            params=("B", "Hk", "Hv", "C", "has_conv_state", "has_state", "has_mask", "has_lengths"),
        ),
    )
}

# register_scan=off: tokens per materialised state block (data, not code: a tuning knob).
BLOCKWISE_SCAN_BLOCK = 16

STATE_ELEMENTS_PER_LANE = 32  # DELTANET_EPL in the kernel file
# Independent partial sums per lane in a state row's dot products (deltanet_lane_dot; a lane's 32
# elements are 8 chunks of 4 consecutive columns): 4 gives each step chains of 8 FMAs plus 2 adds instead
# of one chain of 32 (the scan runs about one simdgroup per SIMD scheduler at Qwen3.6's 32 heads, so
# each step waits on its chains). 1 = one sequential chain (kept for benchmarks). Every scan and decode
# kernel takes the same value (batch invariance).
ROW_SUM_PARTIALS = 4
SUPPORTED_DK = (32, 64, 128, 256)
ACTIVATION_DTYPES = (mx.bfloat16, mx.float16, mx.float32)

_ONE_BOOL = mx.array([True])
# The recurrent state's stand-in where there is none: 8 elements, so that MLX passes it, like a real state,
# as a device pointer (inputs of fewer elements go to the constant address space), which the kernels load
# 16 bytes at a time (deltanet_load_state); never read.
_NO_STATE = constant_input((8,), mx.float32)
_ONE_INT = mx.array([0], dtype=mx.int32)

# One-element stand-ins for an absent conv state, per activation dtype (built once at import: not per
# call, and never inside an mx.compile trace).
_ONE_ZERO = {dtype: constant_input((1,), dtype) for dtype in ACTIVATION_DTYPES}


def rows_per_simdgroup(Dk: int) -> int:
    """State rows one simdgroup owns: 32 lanes / (Dk / 32 lanes per row)."""
    return 32 * STATE_ELEMENTS_PER_LANE // Dk


def supports(q: mx.array, v: mx.array, g: Optional[mx.array] = None,
             state: Optional[mx.array] = None) -> Optional[str]:
    """None when the kernels can run q [B, T, Hk, Dk], v [B, T, Hv, Dv] (and, where given, the gate g
    and the recurrent state); else why they cannot."""
    if g is not None and g.ndim != 3:
        return f"gate g of shape {tuple(g.shape)}: the kernels take one decay per head, g [B, T, Hv]"
    if state is not None and state.dtype != mx.float32:
        return f"recurrent state in {state.dtype}: the kernels keep it in float32"
    Hk, Dk = q.shape[-2:]
    Hv, Dv = v.shape[-2:]
    return _head_shape_reason(Hk, Dk, Hv, Dv) or _dtype_reason(q.dtype, v.dtype)


def _head_shape_reason(Hk: int, Dk: int, Hv: int, Dv: int) -> Optional[str]:
    if Dk not in SUPPORTED_DK:
        return f"Dk={Dk} not in {SUPPORTED_DK}"
    if Dv % 32 != 0 or Dv % rows_per_simdgroup(Dk) != 0:
        return f"Dv={Dv} not a multiple of 32 and of {rows_per_simdgroup(Dk)} (rows per simdgroup at Dk={Dk})"
    if Dv * Dk > 32 * 1024:
        return f"Dv*Dk={Dv * Dk} needs more than 1024 threads per decode threadgroup"
    if Hk == 0 or Hv % Hk != 0:
        return f"Hv={Hv} not a multiple of Hk={Hk}"
    return None


def _dtype_reason(q_dtype, v_dtype) -> Optional[str]:
    if q_dtype not in ACTIVATION_DTYPES or v_dtype != q_dtype:
        return f"activation dtypes q={q_dtype}, v={v_dtype} not supported"
    return None


@lru_cache(maxsize=None)
def backend_unavailable_reason(backend: str) -> Optional[str]:
    """Why ``backend`` cannot build kernels in this process (its toolchain missing); None if it can."""
    try:
        if backend == "sim":
            from ...msl import sim

            sim.metal_kernel  # noqa: B018
        elif backend == "cuda":
            from ...msl import cuda

            cuda.metal_kernel  # noqa: B018
    except (ImportError, AttributeError) as e:
        return f"the {backend} kernel toolchain is unavailable ({e})"
    return None




def _refuse_unsupported(q, v, g, state) -> None:
    """Launchers take only what the kernels compute correctly (the op layer falls back before)."""
    reason = supports(q, v, g, state)
    if reason is not None:
        raise ValueError(f"DeltaNet kernel: {reason}")


def _scan_threadgroup_y(simdgroups: int) -> int:
    return math.gcd(simdgroups, 4)


# ----------------------------------------------------------------------------------------------


def gates(a, b, A_log, dt_bias, *, backend: str, init_value=None) -> Tuple[mx.array, mx.array]:
    """g and beta, fp32, for a, b: [B, T, Hv] (stock rounds beta to b's dtype; fp32 is the exact value)."""
    n = a.size
    tg = 256
    grid = max(tg, -(-n // tg) * tg)
    g, beta = get_kernel(KERNELS["deltanet_gates"], backend)(
        inputs=[a, b, A_log, dt_bias, KERNELS["deltanet_gates"].pack(n=n, Hv=a.shape[-1])],
        grid=(grid, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[a.shape, a.shape],
        output_dtypes=[mx.float32, mx.float32],
        init_value=init_value,
    )
    return g, beta


def scan(q, k, v, g, beta, state, mask=None, *, register: bool = True, backend: str, init_value=None,
         block: Optional[int] = None, return_block_states: bool = False, out_dtype=None, staged: bool = False,
         partials: int = ROW_SUM_PARTIALS):
    """Delta-rule scan (reference: ``scan_ops``). y is 0 at masked positions.

    q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g: [B, T, Hv] fp32; beta: [B, T, Hv]; state fp32 or None.
    ``register``: state in registers for the whole scan; else the blockwise ablation.
    ``staged`` (with ``register``): ``deltanet_scan_staged``, the register scan with its inputs staged
    through threadgroup memory a chunk of tokens at a time (same bits; the layer's default, switch
    ``staged_scan``, see docs/deltanet.md).
    ``out_dtype``: y's dtype (default q's). ``partials``: the row dot products' partial sums
    (``ROW_SUM_PARTIALS``; other values are for benchmarks and tests).
    """
    _refuse_unsupported(q, v, g, state)
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    simdgroups = Dv // rows_per_simdgroup(Dk)
    has_state = state is not None
    has_mask = mask is not None
    inputs = [q, k, v, g.astype(mx.float32), beta, state if has_state else _NO_STATE,
              mask if has_mask else _ONE_BOOL]
    out_dtype = out_dtype or q.dtype
    template = [("InT", q.dtype), ("OutT", out_dtype), ("Dk", Dk), ("Dv", Dv), ("PARTIALS", partials)]
    geometry = dict(grid=(32, simdgroups, B * Hv), threadgroup=(32, _scan_threadgroup_y(simdgroups), 1))
    state_shape = (B, Hv, Dv, Dk)
    if register:
        name = "deltanet_scan_staged" if staged else "deltanet_scan_register"
        if staged:  # the staged loads are split over the threadgroup's 32 TGY threads at compile time
            template = template + [("TGY", geometry["threadgroup"][1])]
        y, state_out = get_kernel(KERNELS[name], backend)(
            inputs=inputs + [KERNELS[name].pack(
                B=B, T=T, Hk=Hk, Hv=Hv, has_state=has_state, has_mask=has_mask)],
            template=template, **geometry,
            output_shapes=[(B, T, Hv, Dv), state_shape],
            output_dtypes=[out_dtype, mx.float32],
            init_value=init_value,
        )
        return y, state_out
    block = block or BLOCKWISE_SCAN_BLOCK
    n_blocks = max(1, -(-T // block))
    y, state_out, block_states = get_kernel(KERNELS["deltanet_scan_blockwise"], backend)(
        inputs=inputs + [KERNELS["deltanet_scan_blockwise"].pack(
            B=B, T=T, Hk=Hk, Hv=Hv, has_state=has_state, has_mask=has_mask, block=block, n_blocks=n_blocks)],
        template=template, **geometry,
        output_shapes=[(B, T, Hv, Dv), state_shape, (B * Hv, n_blocks, Dv, Dk)],
        output_dtypes=[out_dtype, mx.float32, mx.float32],
        init_value=init_value,
    )
    if return_block_states:
        return y, state_out, block_states
    return y, state_out


def gated_norm(x, z, weight, eps: float, *, backend: str, init_value=None, out_dtype=None) -> mx.array:
    """Gated RMSNorm over the last axis (reference: ``gated_rms_norm``). x, z: [..., Dv]; out in
    ``out_dtype`` (default x's)."""
    out_dtype = out_dtype or x.dtype
    Dv = x.shape[-1]
    rows = x.size // Dv
    tg_y = 4
    grid_y = max(tg_y, -(-rows // tg_y) * tg_y)
    (out,) = get_kernel(KERNELS["deltanet_gated_norm"], backend)(
        inputs=[x, z, weight, float32_scalar(eps), KERNELS["deltanet_gated_norm"].pack(rows=rows)],
        template=[("OutT", out_dtype), ("Dv", Dv)],
        grid=(32, grid_y, 1),
        threadgroup=(32, tg_y, 1),
        output_shapes=[x.shape],
        output_dtypes=[out_dtype],
        init_value=init_value,
    )
    return out


def decode(q, k, v, a, b, A_log, dt_bias, state, z, weight, eps: float, mask=None, *, fused: bool = True,
           backend: str, init_value=None, partials: int = ROW_SUM_PARTIALS) -> Tuple[mx.array, mx.array]:
    """One decode token + gated RMSNorm (reference: ``decode_step``): (normed out [B, 1, Hv, Dv], state).

    q, k: [B, 1, Hk, Dk]; v, z: [B, 1, Hv, Dv]; a, b: [B, 1, Hv]; state [B, Hv, Dv, Dk] fp32 or None.
    ``fused``: one kernel; else the gates, scan (T = 1) and gated-norm kernels in turn, passing fp32
    through memory so both variants round once, at the end.
    """
    if not fused:
        g, beta = gates(a, b, A_log, dt_bias, backend=backend, init_value=init_value)
        y, state = scan(q, k, v, g, beta, state, mask, register=True, backend=backend, init_value=init_value,
                        out_dtype=mx.float32, partials=partials)
        out = gated_norm(y, z, weight, eps, backend=backend, init_value=init_value, out_dtype=q.dtype)
        return out, state
    _refuse_unsupported(q, v, None, state)
    B, _, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    simdgroups = Dv // rows_per_simdgroup(Dk)
    has_state = state is not None
    has_mask = mask is not None
    out, state_out = get_kernel(KERNELS["deltanet_decode_fused"], backend)(
        inputs=[q, k, v, a, b, A_log, dt_bias, state if has_state else _NO_STATE,
                mask if has_mask else _ONE_BOOL, z, weight, float32_scalar(eps),
                KERNELS["deltanet_decode_fused"].pack(
                    B=B, Hk=Hk, Hv=Hv, has_state=has_state, has_mask=has_mask)],
        template=[("InT", q.dtype), ("Dk", Dk), ("Dv", Dv), ("PARTIALS", partials)],
        grid=(32, simdgroups, B * Hv),
        threadgroup=(32, simdgroups, 1),
        output_shapes=[(B, 1, Hv, Dv), (B, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, mx.float32],
        init_value=init_value,
    )
    return out, state_out


def conv_unsupported_reason(conv1d, qkv: mx.array, Hk: int, Dk: int, channels: Optional[int] = None) -> Optional[str]:
    """Why the fused decode conv + q/k-norm kernel cannot run; None when it can. ``channels``: qkv's conv
    channels when they are the first of a longer row (the fused in-projection's output)."""
    C = qkv.shape[-1] if channels is None else channels
    weight = conv1d.weight
    if "bias" in conv1d:
        return "conv1d with a bias"
    if weight.ndim != 3 or weight.shape[0] != C or weight.shape[2] != 1 or weight.shape[1] < 2:
        return f"conv1d weight {tuple(weight.shape)} is not depthwise over {C} channels"
    if Dk not in SUPPORTED_DK or (C - 2 * Hk * Dk) % Dk != 0:
        return f"conv_dim={C} not in rows of Dk={Dk}"
    if qkv.dtype not in ACTIVATION_DTYPES:
        return f"activation dtype {qkv.dtype} not supported"
    return None


def conv_qk_norm(qkv, conv_state, weight, mask, Hk: int, Dk: int, Hv: int, Dv: int, *, lengths=None,
                 backend: str, eps: float = 1e-6, init_value=None):
    """The tokens of a chunk (any T; decode is T = 1): conv1d + SiLU + q/k normalisation and the new
    conv state (references: ``conv_input_with_state``, ``conv1d_silu``, ``qk_norm``,
    ``next_conv_state``). A token's q, k, v are computed the same way whatever the chunk and the
    batch around it (batch invariance).

    qkv: [B, T, C]; conv_state: [B, K-1, C] or None (zeros); weight: [C, K, 1]; mask: [B, T] bool or
    None; lengths: [B] valid tokens per row of a right-padded chunk (the cache's ``lengths``) or None.
    Returns q, k [B, T, Hk, Dk], v [B, T, Hv, Dv] and the new conv state [B, K-1, C].
    """
    B, T, C = qkv.shape
    K = weight.shape[1]
    has_state = conv_state is not None
    has_mask = mask is not None
    has_lengths = lengths is not None
    q, k, v, new_state = get_kernel(KERNELS["deltanet_conv_qk_norm_decode"], backend)(
        inputs=[qkv, conv_state if has_state else _ONE_ZERO[qkv.dtype], weight,
                mask if has_mask else _ONE_BOOL, lengths.astype(mx.int32) if has_lengths else _ONE_INT,
                float32_scalar(eps), KERNELS["deltanet_conv_qk_norm_decode"].pack(
                    B=B, Hk=Hk, C=C, has_state=has_state, has_mask=has_mask, T=T, has_lengths=has_lengths)],
        template=[("InT", qkv.dtype), ("Dk", Dk), ("K", K)],
        grid=(32, C // Dk, B * T),
        threadgroup=(32, math.gcd(C // Dk, 4), 1),
        output_shapes=[(B, T, Hk, Dk), (B, T, Hk, Dk), (B, T, Hv, Dv), (B, K - 1, C)],
        output_dtypes=[qkv.dtype] * 4,
        init_value=init_value,
    )
    return q, k, v, new_state


def conv_qk_norm_decode(qkv, conv_state, weight, mask, Hk: int, Dk: int, Hv: int, Dv: int, *, backend: str,
                        eps: float = 1e-6, init_value=None):
    """One decode token (``conv_qk_norm`` with T = 1): qkv [B, 1, C]; mask [B, 1] or None."""
    return conv_qk_norm(qkv, conv_state, weight, mask, Hk, Dk, Hv, Dv, backend=backend, eps=eps,
                        init_value=init_value)


# ----------------------------------------------------------------------------------------------
# One decode token from the in_proj output: conv + q/k norm + step + gated norm (switch fused_conv_step)


def decode_conv_unsupported_reason(conv1d, qkv: mx.array, Hk: int, Dk: int, Hv: int, Dv: int,
                                   conv_state: Optional[mx.array] = None,
                                   state: Optional[mx.array] = None, channels: Optional[int] = None) -> Optional[str]:
    """Why ``deltanet_decode_conv_fused`` cannot run this decode call (qkv [B, 1, C]); None when it can.
    Shapes and dtypes only (it runs per call). Where it cannot, the conv kernel and the decode
    kernel(s) run in turn, each under its own rules (``conv_unsupported_reason``, ``supports``)."""
    if qkv.ndim != 3 or qkv.shape[1] != 1:
        return f"qkv of shape {tuple(qkv.shape)} is not one decode token"
    reason = conv_unsupported_reason(conv1d, qkv, Hk, Dk, channels) or _head_shape_reason(Hk, Dk, Hv, Dv)
    if reason is not None:
        return reason
    if Dv != Dk:
        return f"Dv={Dv} != Dk={Dk} (the fused kernel computes one conv row per value head)"
    C = qkv.shape[-1] if channels is None else channels
    if C != 2 * Hk * Dk + Hv * Dv:
        return f"conv_dim={C} != 2 Hk Dk + Hv Dv = {2 * Hk * Dk + Hv * Dv}"
    if conv_state is not None and conv_state.dtype != qkv.dtype:
        return f"conv state in {conv_state.dtype}, activations in {qkv.dtype}"
    if state is not None and state.dtype != mx.float32:
        return f"recurrent state in {state.dtype}: the kernels keep it in float32"
    return None


def decode_conv(qkv, conv_state, conv_weight, mask, a, b, A_log, dt_bias, state, z, weight, eps: float,
                Hk: int, Dk: int, Hv: int, Dv: int, *, lengths=None, qk_eps: float = 1e-6, backend: str,
                init_value=None, partials: int = ROW_SUM_PARTIALS,
                joint: Optional[Tuple[int, int, int]] = None) -> Tuple[mx.array, mx.array, mx.array]:
    """One decode token from the in_proj output in one kernel: (normed out [B, 1, Hv, Dv], new conv
    state [B, K-1, C], new recurrent state [B, Hv, Dv, Dk] fp32), bit-identical to ``conv_qk_norm``
    followed by ``decode(fused=True)``.

    qkv: [B, 1, C] (C = 2 Hk Dk + Hv Dv, Dv == Dk); conv_state: [B, K-1, C] or None (zeros);
    conv_weight: [C, K, 1]; mask: [B, 1] bool or None; a, b: [B, 1, Hv]; state fp32 or None (zeros);
    z: [B, 1, Hv, Dv]; weight, eps: the gated norm's; lengths: [B] or None; qk_eps: the q/k l2norm eps.
    ``joint`` = (z_off, b_off, a_off): qkv is the fused in-projection's output [B, 1, P] holding q|k|v, z, b
    and a at those offsets (C = z_off; z, a, b not given): the kernel reads the pieces in place.
    """
    reason = _head_shape_reason(Hk, Dk, Hv, Dv) or _dtype_reason(qkv.dtype, qkv.dtype)
    B, T, P = qkv.shape
    if joint is None:
        C, strides, offsets = P, (P, Hv * Dv, Hv), (0, 0, 0)
    else:
        z_off, b_off, a_off = joint
        C, strides, offsets = z_off, (P, P, P), joint
        if reason is None and not (b_off == z_off + Hv * Dv and a_off == b_off + Hv and P == a_off + Hv):
            reason = f"fused in-projection offsets {joint} in a row of {P} do not hold z [{Hv * Dv}], b and a [{Hv}]"
        z = a = b = qkv
    K = conv_weight.shape[1]
    if reason is None and (T != 1 or Dv != Dk or C != 2 * Hk * Dk + Hv * Dv):
        reason = f"qkv {tuple(qkv.shape)} with Hk={Hk}, Dk={Dk}, Hv={Hv}, Dv={Dv}: not one token, or Dv != Dk"
    if reason is None and state is not None and state.dtype != mx.float32:
        reason = f"recurrent state in {state.dtype}: the kernels keep it in float32"
    if reason is not None:
        raise ValueError(f"DeltaNet kernel: {reason}")
    has_conv_state, has_state = conv_state is not None, state is not None
    has_mask, has_lengths = mask is not None, lengths is not None
    spec = KERNELS["deltanet_decode_conv_fused"]
    out, state_out, conv_state_out = get_kernel(spec, backend)(
        inputs=[qkv, conv_state if has_conv_state else _ONE_ZERO[qkv.dtype], conv_weight,
                mask if has_mask else _ONE_BOOL, lengths.astype(mx.int32) if has_lengths else _ONE_INT,
                a, b, A_log, dt_bias, state if has_state else _NO_STATE, z, weight,
                float32_scalar(qk_eps), float32_scalar(eps),
                spec.pack(B=B, Hk=Hk, Hv=Hv, C=C, has_conv_state=has_conv_state, has_state=has_state,
                          has_mask=has_mask, has_lengths=has_lengths, qkv_ld=strides[0], z_ld=strides[1],
                          z_off=offsets[0], ab_ld=strides[2], a_off=offsets[2], b_off=offsets[1])],
        template=[("InT", qkv.dtype), ("Dk", Dk), ("Dv", Dv), ("K", K), ("PARTIALS", partials)],
        **_conv_step_launch(qkv.dtype, B, Hv, Dk, Dv, K, C, init_value))
    return out, conv_state_out, state_out


def _conv_step_launch(dtype, B: int, Hv: int, Dk: int, Dv: int, K: int, C: int, init_value) -> dict:
    """Geometry and outputs of a launch that ends in the conv step (one threadgroup per value head): (out [B, 1, Hv,
    Dv], state_out [B, Hv, Dv, Dk] fp32, conv_state_out [B, K-1, C])."""
    simdgroups = Dv // rows_per_simdgroup(Dk)
    return dict(grid=(32, simdgroups, B * Hv), threadgroup=(32, simdgroups, 1),
                output_shapes=[(B, 1, Hv, Dv), (B, Hv, Dv, Dk), (B, K - 1, C)],
                output_dtypes=[dtype, mx.float32, dtype], init_value=init_value)


# One decode token from the layer's input: the in-projection rows each head needs by the dense row GEMV, then
# deltanet_decode_conv_fused's work, in one launch (switch fused_in_proj_step, with the trial row GEMV)

# Weight pieces a row and lane in flight in deltanet_decode_from_hidden's GEMV (template U; the row GEMV's own is 2). Its
# 512-thread threadgroups allow 128 registers a thread and NVRTC cannot be told the bound through MLX: ptxas for sm_90a
# at Qwen3.6's shape gives 118-120 registers with 1, 127 with 2 (too close for another compiler version). Read at each
# call, so a benchmark's --set reaches it.
FROM_HIDDEN_UNROLL = 1


def decode_from_hidden_reason(x: mx.array, weight: mx.array, scales: mx.array, biases: Optional[mx.array],
                              group_size: int, bits: int, mode: str, Hk: int, Dk: int, Hv: int, Dv: int,
                              in_norm_weight: Optional[mx.array] = None) -> Optional[str]:
    """Why ``deltanet_decode_from_hidden`` cannot take this decode call's in-projection (x [B, 1, Hd]; the fused
    weight W [C + Hv Dv + 2 Hv, Hd] 4-bit, q|k|v, z, b, a); None when it can. The conv step's own rules are
    ``decode_conv_unsupported_reason``'s."""
    reason = projections.fold_reason(x, weight, scales, biases, group_size, bits, mode, in_norm_weight)
    rows = 2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv
    if reason is None and weight.shape[0] != rows:
        reason = f"in-projection of {weight.shape[0]} rows ({rows}: q|k|v, z, b, a)"
    return reason


def decode_from_hidden(x, weight, scales, biases, group_size: int, conv_state, conv_weight, mask, A_log, dt_bias,
                       state, norm_weight, eps: float, Hk: int, Dk: int, Hv: int, Dv: int, *, in_norm=None,
                       lengths=None, qk_eps: float = 1e-6, backend: str, init_value=None,
                       partials: int = ROW_SUM_PARTIALS) -> Tuple[mx.array, mx.array, mx.array]:
    """``decode_conv(gemv(x))`` in one launch: (normed out [B, 1, Hv, Dv], new conv state [B, K-1, C], new recurrent
    state [B, Hv, Dv, Dk] fp32) with the bits of the dense row GEMV over the fused in-projection (weight, scales,
    biases, group_size: q|k|v, z, b, a) followed by ``decode_conv(..., joint=...)``. x: [B, 1, Hd], the layer's input;
    ``in_norm`` = (weight [Hd], eps): x is the input of the layer's RMSNorm, computed inside (as the GEMV with the
    norm inside). The rest as ``decode_conv``'s; callers check ``decode_from_hidden_reason`` and
    ``decode_conv_unsupported_reason`` first."""
    B, _, hd = x.shape
    C = 2 * Hk * Dk + Hv * Dv
    K = conv_weight.shape[1]
    has_conv_state, has_state = conv_state is not None, state is not None
    has_mask, has_lengths = mask is not None, lengths is not None
    spec = KERNELS["deltanet_decode_from_hidden"]
    out, state_out, conv_state_out = get_kernel(spec, backend)(
        inputs=[x, in_norm[0] if in_norm is not None else x, float32_scalar(in_norm[1] if in_norm is not None else 0.0),
                weight, scales, biases, conv_state if has_conv_state else _ONE_ZERO[x.dtype], conv_weight,
                mask if has_mask else _ONE_BOOL, lengths.astype(mx.int32) if has_lengths else _ONE_INT,
                A_log, dt_bias, state if has_state else _NO_STATE, norm_weight, float32_scalar(qk_eps),
                float32_scalar(eps),
                spec.pack(B=B, Hk=Hk, Hv=Hv, C=C, has_conv_state=has_conv_state, has_state=has_state,
                          has_mask=has_mask, has_lengths=has_lengths)],
        template=[("InT", x.dtype), ("Dk", Dk), ("Dv", Dv), ("K", K), ("PARTIALS", partials), ("GS", group_size),
                  ("NORM", int(in_norm is not None)), ("Hd", hd), ("U", FROM_HIDDEN_UNROLL)],
        **_conv_step_launch(x.dtype, B, Hv, Dk, Dv, K, C, init_value))
    return out, conv_state_out, state_out
