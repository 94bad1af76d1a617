"""Attention layer: ``attention_forward(self, x, mask, cache)``, the whole layer with the stock
module as ``self``, and the dispatch of each op (``qk_prep``, ``prefill_attention``,
``decode_attention``, ``long_context_attention``; registered by the package,
``lily_mlx.ops.attention``) to its kernel or its reference.

On the reference backend it is exactly stock's computation: the same MLX primitives in the same
order, mlx_lm's own ``scaled_dot_product_attention`` (quantized KV caches included; ``reference``).
Kernels: ``attention_decode``, ``attention_decode_long``, ``attention_decode_batch`` (``kernels``,
kernels/attention/decode.metal), ``attention_prefill`` (kernels/attention/prefill.metal) and
``attention_qk_prep`` (kernels/attention/qk_prep.metal).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ...core.dispatch import active_backend, op_backend
from ...core.log import log_once
from ...core.switches import is_enabled
from ...core import compiled, projections, step_trace
from . import kernels
from .reference import attention_reference, qk_prep_reference

# (op name, backend) -> kernel launcher, for every backend a kernel is written for: where it runs by
# default (the op's kernel_backends) and where it is a trial kernel (on when the tune profile says so);
# the dispatch (op_backend) decides which of them runs.
KERNELS: dict = {
    **{("attention_decode", backend): kernels.decode_attention_from_cache(backend)
       for backend in kernels.WRITTEN_FOR},
    **{("attention_decode_long", backend): kernels.decode_attention_fixed_blocks_from_cache(backend)
       for backend in kernels.WRITTEN_FOR},
    **{("attention_decode_batch", backend): kernels.decode_attention_fixed_blocks_rows_from_cache(backend)
       for backend in kernels.WRITTEN_FOR},
    **{("attention_decode_quantized", backend): kernels.decode_attention_quantized_from_cache(backend)
       for backend in kernels.WRITTEN_FOR},
    **{("attention_prefill", backend): kernels.prefill_attention_from_cache(backend)
       for backend in kernels.WRITTEN_FOR},
    **{("attention_qk_prep", backend): functools.partial(kernels.qk_prep, backend=backend)
       for backend in kernels.WRITTEN_FOR},
}


def _kernel_for(op: str, unsupported: Optional[Callable[[], Optional[str]]] = None) -> Optional[Callable]:
    """The kernel that runs op ``op`` (its name) on the active backend, or None for the reference.

    ``unsupported()`` names why these shapes/inputs are outside the kernel (logged once); it is asked
    only where the op has a kernel here (the decode step's hot path)."""
    backend = active_backend()
    if backend == "reference":
        return None
    if op_backend(op) == "reference" or (op, backend) not in KERNELS:
        return None  # said once, at patch time (lily_mlx.patch_report)
    unsupported = unsupported() if unsupported is not None else None
    if unsupported:
        log_once(f"{op}:{backend}:{unsupported}", f"{op}: {unsupported}, using the reference")
        return None
    return KERNELS[(op, backend)]


def is_quantized_kv(keys: Any) -> bool:
    """Quantized KV caches hand out (packed, scales, biases) as a tuple or a list (MLX-LM's
    ``QuantizedKVCache`` and ``KVCache.to_quantized`` differ), plain caches an array."""
    return isinstance(keys, (tuple, list))


def _kv_shape(keys: Any) -> Tuple[int, ...]:
    """[B, Hkv, S, ...] of keys (of the packed part for a quantized cache)."""
    return (keys[0] if is_quantized_kv(keys) else keys).shape


# --- q/k preparation ------------------------------------------------------------------------------

def _qk_prep_in_place(y, fused: projections.FusedProjection, *, n_heads, n_kv_heads, q_norm, k_norm, rope, offset):
    """``qk_prep`` from the fused q/k/v projection's output y [B, L, 2 H D + 2 Hkv D] read in place by the kernel
    (no split primitive), or None where the kernel does not take it (the caller splits y)."""
    if not is_enabled("fused_qk_prep"):
        return None
    B, L, width = y.shape
    D = width // (2 * n_heads + 2 * n_kv_heads)
    if fused.split_at != (2 * n_heads * D, (2 * n_heads + n_kv_heads) * D):
        return None
    q_end, k_end = fused.split_at
    kernel = _kernel_for("attention_qk_prep", lambda: kernels.qk_prep_supports(
        y[..., :q_end], y[..., q_end:k_end], n_heads, n_kv_heads, q_norm, k_norm, rope, offset))  # (views: shapes)
    if kernel is None:
        return None
    queries, keys, gate = kernel(y, None, n_heads=n_heads, n_kv_heads=n_kv_heads, q_norm=q_norm, k_norm=k_norm,
                                 rope=rope, offset=offset)
    values = y[..., k_end:].reshape(B, L, n_kv_heads, D).transpose(0, 2, 1, 3)
    return queries, keys, values, gate


@dataclasses.dataclass(frozen=True)
class _Shaped:
    """The shape and dtype of a projection output a kernel computes itself (for ``qk_prep_supports``'s rules)."""
    shape: tuple
    dtype: Any


def _prepared_from_hidden(x, fused: projections.FusedProjection, *, n_heads, n_kv_heads, q_norm, k_norm, rope,
                          offset):
    """A decode call's (queries, keys, values, gate) from the layer's input x [B, 1, hidden] in one launch
    (``attention_qk_prep_from_hidden``, switch ``fused_qkv_prep``), or None where it does not apply. It applies where the
    call would take the linear family's row GEMV for the fused q/k/v projection (``projections.GEMV_PLAN``: the trial
    kernel on, with the layer's input norm inside where that GEMV would compute it) and then the q/k preparation kernel
    on the same backend: the kernel gives those two launches' bits, so this choice never changes a result."""
    if x.shape[1] != 1 or not (is_enabled("fused_qkv_prep") and is_enabled("fused_qk_prep")):
        return None
    plan = projections.GEMV_PLAN[0](x, fused)
    if plan is None:
        return None
    backend, source, norm = plan
    B, _, hidden = x.shape
    D = fused.weight.shape[0] // (2 * n_heads + 2 * n_kv_heads)
    if fused.split_at != (2 * n_heads * D, (2 * n_heads + n_kv_heads) * D):
        return None
    if _kernel_for("attention_qk_prep", lambda: kernels.qk_prep_supports(
            _Shaped((B, 1, 2 * n_heads * D), x.dtype), _Shaped((B, 1, n_kv_heads * D), x.dtype), n_heads,
            n_kv_heads, q_norm, k_norm, rope, offset)) is None or active_backend() != backend:
        return None
    in_norm_weight = None if norm is None else norm["weight"]
    reason = kernels.qkv_prep_from_hidden_reason(source, fused.weight, fused.scales, fused.biases, fused.group_size,
                                                 fused.bits, fused.mode, n_heads, n_kv_heads, in_norm_weight)
    if reason is not None:
        log_once(f"fused_qkv_prep:{reason}", f"fused_qkv_prep: {reason}; the q/k/v projection's GEMV, then the q/k "
                 "preparation")
        return None
    return kernels.qkv_prep_from_hidden(source, fused.weight, fused.scales, fused.biases, fused.group_size,
                                        n_heads=n_heads, n_kv_heads=n_kv_heads, q_norm=q_norm, k_norm=k_norm, rope=rope,
                                        offset=offset, backend=backend,
                                        in_norm=None if norm is None else (in_norm_weight, norm.eps))


def qk_prep(q_proj_out, k_proj_out, v_proj_out, *, n_heads, n_kv_heads, q_norm, k_norm, rope,
            offset=0):
    """q/k preparation; see ``qk_prep_reference`` for shapes. Kernel (switch ``fused_qk_prep``; off: the
    reference's separate ops): ``attention_qk_prep``, the values only transposed, as stock."""
    if is_enabled("fused_qk_prep"):
        kernel = _kernel_for("attention_qk_prep", lambda: kernels.qk_prep_supports(
            q_proj_out, k_proj_out, n_heads, n_kv_heads, q_norm, k_norm, rope, offset))
        if kernel is not None:
            queries, keys, gate = kernel(q_proj_out, k_proj_out, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                         q_norm=q_norm, k_norm=k_norm, rope=rope, offset=offset)
            B, L, _ = v_proj_out.shape
            values = v_proj_out.reshape(B, L, n_kv_heads, -1).transpose(0, 2, 1, 3)
            return queries, keys, values, gate
    return qk_prep_reference(q_proj_out, k_proj_out, v_proj_out, n_heads=n_heads,
                             n_kv_heads=n_kv_heads, q_norm=q_norm, k_norm=k_norm, rope=rope,
                             offset=offset)


# --- attention over the cache ---------------------------------------------------------------------

def prefill_attention(queries, keys, values, *, scale, mask=None, cache=None):
    """Chunk of L queries over cache + chunk; shapes as ``attention_reference``. The kernel takes a
    plain ``KVCache`` (or no cache) with mask "causal" or None (shape rules: ``kernels.prefill_supports``);
    bool or additive mask arrays (batched caches), quantized and rotating caches run stock's attention."""
    kernel = _kernel_for("attention_prefill", lambda: kernels.prefill_supports(queries, keys, values, mask, cache))
    if kernel is not None:
        return kernel(queries, keys, values, scale=scale, mask=mask, cache=cache)
    return attention_reference(queries, keys, values, scale=scale, mask=mask, cache=cache)


def decode_attention(queries, keys, values, *, scale, mask=None, cache=None):
    """One query row (L == 1) over the KV cache. Kernel variants: ``coalesced_kv``, ``gqa_packing``.
    The kernel takes a plain ``KVCache`` without a mask, or a ``BatchKVCache`` with its own one-row mask
    (the server's batches: each row from its left padding on; shape rules: ``kernels.supports``)."""
    kernel = _kernel_for("attention_decode", lambda: kernels.supports(queries, keys, values, mask, cache, batch=True))
    if kernel is not None:
        return kernel(queries, keys, values, scale=scale, mask=mask, cache=cache,
                      coalesced=is_enabled("coalesced_kv"), gqa_packed=is_enabled("gqa_packing"))
    return attention_reference(queries, keys, values, scale=scale, mask=mask, cache=cache)


def batch_decode_attention(queries, keys, values, *, scale, mask=None, cache=None):
    """One query row for each row of a batch (mlx_lm's ``BatchKVCache`` with its own one-row mask: the server's
    batches) over the KV cache: the fixed-block split, each row's blocks from its left padding on and of its own
    length's size, so a row's bits never depend on the other rows (``kernels.decode_attention_fixed_blocks_rows``).
    With ``fixed_block_attention`` off, or where the op has no kernel, the one-pass op (``decode_attention``)."""
    if is_enabled("fixed_block_attention"):
        kernel = _kernel_for("attention_decode_batch",
                             lambda: kernels.supports(queries, keys, values, mask, cache, batch=True))
        if kernel is not None:
            return kernel(queries, keys, values, scale=scale, mask=mask, cache=cache,
                          coalesced=is_enabled("coalesced_kv"), gqa_packed=is_enabled("gqa_packing"))
    return decode_attention(queries, keys, values, scale=scale, mask=mask, cache=cache)


def long_context_attention(queries, keys, values, *, scale, mask=None, cache=None):
    """Decode at long context: the fixed-block split kernels (same shape rules as the decode kernel).
    Reference: stock's attention."""
    kernel = _kernel_for("attention_decode_long", lambda: kernels.supports(queries, keys, values, mask, cache))
    if kernel is not None:
        return kernel(queries, keys, values, scale=scale, mask=mask, cache=cache,
                      coalesced=is_enabled("coalesced_kv"), gqa_packed=is_enabled("gqa_packing"))
    return attention_reference(queries, keys, values, scale=scale, mask=mask, cache=cache)


def quantized_decode_attention(queries, keys, values, *, scale, mask=None, cache=None):
    """One query row over a quantized KV cache (MLX-LM's ``QuantizedKVCache``, ``--kv-bits``): the kernels read the
    packed rows and dequantise them in registers. The fixed-block split on a GPU at every context
    (``kernels.QUANTIZED_SPLIT_BACKENDS``), elsewhere by the plain cache's rule (``decode_path``); with
    ``fixed_block_attention`` off the one-pass kernel. Reference: stock's quantized attention."""
    kernel = _kernel_for("attention_decode_quantized",
                         lambda: kernels.quantized_supports(queries, keys, values, mask, cache))
    if kernel is not None:
        _, n_kv_heads, kv_length = _kv_shape(keys)[:3]
        path = decode_path(kv_length, queries.shape[3], queries.shape[1] // n_kv_heads)
        split = path == "fixed_block" or (is_enabled("fixed_block_attention")
                                          and active_backend() in kernels.QUANTIZED_SPLIT_BACKENDS)
        return kernel(queries, keys, values, scale=scale, mask=mask, cache=cache,
                      gqa_packed=is_enabled("gqa_packing"), fixed_blocks=split)
    return attention_reference(queries, keys, values, scale=scale, mask=mask, cache=cache)


def decode_path(kv_length: int, head_dim: int, gqa_factor: int) -> str:
    """``"fixed_block"`` or ``"ordinary"``: which decode path a shape takes (switch + the write-up's
    shape rule, ``kernels.FIXED_BLOCK_*``). ``kv_length`` is the row's own context, never the batch's."""
    if not is_enabled("fixed_block_attention"):
        return "ordinary"
    if (
        kv_length >= kernels.FIXED_BLOCK_MIN_CONTEXT
        and head_dim == kernels.FIXED_BLOCK_HEAD_DIM
        and gqa_factor == kernels.FIXED_BLOCK_GQA_FACTOR
    ):
        return "fixed_block"
    return "ordinary"


def attention(queries, keys, values, *, scale, mask=None, cache=None):
    """Attention of prepared queries over the (updated) KV cache: picks the op by shape."""
    _, n_heads, L, head_dim = queries.shape
    if L != 1:
        return prefill_attention(queries, keys, values, scale=scale, mask=mask, cache=cache)
    if is_quantized_kv(keys):
        return quantized_decode_attention(queries, keys, values, scale=scale, mask=mask, cache=cache)
    _, n_kv_heads, kv_length = _kv_shape(keys)[:3]
    if mask is not None and hasattr(cache, "left_padding"):
        # A batch's rows (BatchKVCache): kv_length is the batch's padded length, not a row's own context, so the
        # single sequence's rule cannot choose a path per row; one path serves every row alike at every length.
        return batch_decode_attention(queries, keys, values, scale=scale, mask=mask, cache=cache)
    path = decode_path(kv_length, head_dim, n_heads // n_kv_heads)
    op = long_context_attention if path == "fixed_block" else decode_attention
    return op(queries, keys, values, scale=scale, mask=mask, cache=cache)


# --- a decode step's attention over the cache's buffer (switch kv_write_in_trace) ---------------------

NO_LIMIT = 1 << 62
# Rows a KV buffer grows by once a step writes into it from a trace (switch kv_write_in_trace, a backend that
# traces): each growth traces the attention layers' first trace anew, so fewer growths than MLX-LM's 256 rows
# (~20 KB a row over Qwen3.6's 10 attention layers: 20 MB a growth).
BUFFER_GROWTH_ROWS = 1024


def _live_length_kernel_on() -> bool:
    """Whether the attention over a buffer (``attend_in_buffer``) is the fixed-block kernels' live-length form:
    where the long-context op has a kernel on this backend and ``fixed_block_attention`` is on."""
    return is_enabled("fixed_block_attention") and _kernel_for("attention_decode_long") is not None


def buffer_limit(self, cache: Any) -> int:
    """Context lengths up to which a decode step writes into ``cache``'s buffer and attends over all of it
    (switch ``kv_write_in_trace``), for a plain ``KVCache``: every length where the live-length kernels run;
    else where the step's attention is stock's (the decode op on its reference; up to the fixed-block
    threshold where the long-context op has a kernel); for a ``QuantizedKVCache``: every length, but where the
    quantized kernel runs with ``fixed_block_attention`` off (``_quantized_in_buffer``). 0: never."""
    if not is_enabled("kv_write_in_trace"):
        return 0
    if type(cache) is QuantizedKVCache:
        return NO_LIMIT if _quantized_in_buffer() else 0
    if type(cache) is not KVCache:
        return 0
    if _live_length_kernel_on():
        return NO_LIMIT
    if op_backend("attention_decode") != "reference":
        return 0
    gqa = self.num_attention_heads // self.num_key_value_heads
    if (decode_path(kernels.FIXED_BLOCK_MIN_CONTEXT, self.head_dim, gqa) == "fixed_block"
            and op_backend("attention_decode_long") != "reference"):
        return kernels.FIXED_BLOCK_MIN_CONTEXT - 1
    return NO_LIMIT


def _quantized_in_buffer() -> bool:
    """Whether a decode step over a ``QuantizedKVCache`` writes its row into the buffers and attends over them
    (``_attend_in_quantized_buffer``): where the op has its kernel and ``fixed_block_attention`` is on (the kernels'
    live-length form), and where the op is on its reference (stock's quantized attention over the buffers, the rows
    past the offset masked, as a plain cache's steps attend where the decode op is on its reference). Not with the
    kernel and ``fixed_block_attention`` off: the one-pass kernel over MLX-LM's live rows."""
    return _kernel_for("attention_decode_quantized") is None or is_enabled("fixed_block_attention")


def _capacity(buffer: Any) -> int:
    """Rows of a KV buffer: a plain cache's array or a quantized cache's (packed, scales, biases)."""
    return _kv_shape(buffer)[2]


def _buffer_form(buffer: Any) -> tuple:
    """A KV buffer's shapes and dtypes but its capacity (part of a trace's slot)."""
    parts = buffer if is_quantized_kv(buffer) else (buffer,)
    return tuple((b.shape[:2], b.shape[3], b.dtype) for b in parts)


def _as_buffer(buffer: Any) -> Any:
    """A trace's output for a cache's buffer: a quantized cache's parts as the tuple MLX-LM's caches hold."""
    return tuple(buffer) if isinstance(buffer, list) else buffer


def _still_in_buffer(cache: Any, mask: Any, limit: int, capacity: int) -> bool:
    """Whether a replay traced for a buffer of ``capacity`` rows fits this step: the buffer kept that capacity
    and the step writes into it (``in_buffer``)."""
    keys = cache.keys
    return keys is not None and _capacity(keys) == capacity and in_buffer(cache, mask, limit)


def in_buffer(cache: Any, mask: Any, limit: int) -> bool:
    """Whether this one-token step attends over the buffer (``limit`` from ``buffer_limit``): no mask, and
    the buffer has room for the row (else MLX-LM's ``update_and_fetch`` grows it, built op by op)."""
    keys = cache.keys
    return limit > 0 and mask is None and keys is not None and cache.offset < min(_capacity(keys), limit)


def write_row(buffer: mx.array, row: mx.array, position: mx.array) -> mx.array:
    """``buffer`` [B, Hkv, S_cap, D] with ``row`` [B, Hkv, 1, D] written at row ``position`` (an int32 scalar array):
    a scatter along the rows (one ``ScatterAxis``), not ``mx.slice_update`` at a dynamic start: MLX's CUDA backend
    launches a dynamic slice update's copy over the whole destination (0.73 ms a decode step at 4K for Qwen3.6's 20
    buffers on the H200, growing with the capacity; docs/decode.md), a scatter over the row's elements. The buffer
    is updated in place where MLX can donate it (the caller holds no other reference when the step is evaluated)."""
    return mx.put_along_axis(buffer, position.reshape(1, 1, 1, 1), row, axis=2)


def attend_in_buffer(queries, keys, values, gate, k_buffer, v_buffer, positions, *, scale):
    """queries [B, H, 1, D], this step's keys / values [B, Hkv, 1, D], its output gate [B, 1, H * D], the cache's
    buffers [B, Hkv, S_cap, D], positions (the offset, an int32 scalar) -> (gated output [B, 1, H * D], the
    o-projection's input; k_buffer, v_buffer): the row written at the offset (``update_and_fetch``'s copy) and the
    attention over rows 0 .. offset of the buffer, in a form whose shapes hold from token to token until the
    buffer grows: the fixed-block kernels reading the live length from ``positions`` (``_live_length_kernel_on``;
    their merge applies the gate with ``fused_output_gate``), else stock's attention over the whole buffer with
    the rows past the offset masked (the same function as over the live rows: masked scores weigh exactly 0). A
    quantized cache's buffers (tuples): ``_attend_in_quantized_buffer``."""
    if is_quantized_kv(k_buffer):
        return _attend_in_quantized_buffer(queries, keys, values, gate, k_buffer, v_buffer, positions, scale=scale)
    k_buffer, v_buffer = write_row(k_buffer, keys, positions), write_row(v_buffer, values, positions)
    if _live_length_kernel_on():
        problem = kernels.shape_problem(queries, k_buffer, v_buffer)
        if not problem:
            fuse_gate = is_enabled("fused_output_gate") and gate.dtype == queries.dtype
            output = kernels.decode_attention_fixed_blocks_live(
                queries, k_buffer, v_buffer, positions, scale=scale, gqa_packed=is_enabled("gqa_packing"),
                coalesced=is_enabled("coalesced_kv"), backend=active_backend(), gate=gate if fuse_gate else None,
                block_rows=_live_block_rows(k_buffer))
            return (output if fuse_gate else gated(output, gate)), k_buffer, v_buffer
        log_once(f"attention_decode_long:live:{problem}", f"attention_decode_long: {problem}, using the reference")
    live = mx.arange(k_buffer.shape[2], dtype=mx.int32) <= positions  # [S_cap]
    return gated(attention_reference(queries, k_buffer, v_buffer, scale=scale, mask=live), gate), k_buffer, v_buffer


def _attend_in_quantized_buffer(queries, keys, values, gate, k_buffer, v_buffer, positions, *, scale):
    """``attend_in_buffer`` over a ``QuantizedKVCache``'s buffers, each (packed [B, Hkv, S_cap, D * bits / 32],
    scales, biases [B, Hkv, S_cap, D / group]): the step's rows quantised as ``update_and_fetch`` quantises them
    (the same bits in the cache), written at the offset, then the quantized kernels' live-length form, or where the op
    is on its reference or the kernels do not take these buffers (said once) stock's quantized attention over them
    with the rows past the offset masked (the same function as over the live rows: masked scores weigh exactly 0).
    Bits and group are read off the buffers' widths."""
    D = queries.shape[3]
    bits, group_size = 32 * k_buffer[0].shape[3] // D, D // k_buffer[1].shape[3]
    k_rows = mx.quantize(keys, group_size=group_size, bits=bits)  # (packed, scales, biases) of [B, Hkv, 1, D]
    v_rows = mx.quantize(values, group_size=group_size, bits=bits)
    k_buffer = tuple(write_row(b, r, positions) for b, r in zip(k_buffer, k_rows))
    v_buffer = tuple(write_row(b, r, positions) for b, r in zip(v_buffer, v_rows))
    kernel = _kernel_for("attention_decode_quantized",
                         lambda: kernels.quantized_problem(queries, k_buffer, v_buffer, bits, group_size))
    if kernel is None:
        live = mx.arange(k_buffer[0].shape[2], dtype=mx.int32) <= positions  # [S_cap]
        output = quantized_scaled_dot_product_attention(queries, k_buffer, v_buffer, scale=scale, mask=live,
                                                        group_size=group_size, bits=bits)
        return gated(output, gate), k_buffer, v_buffer
    fuse_gate = is_enabled("fused_output_gate") and gate.dtype == queries.dtype
    output = kernels.decode_attention_quantized_live(
        queries, k_buffer, v_buffer, positions, scale=scale, bits=bits, group_size=group_size,
        gqa_packed=is_enabled("gqa_packing"), backend=active_backend(), gate=gate if fuse_gate else None,
        block_rows=_live_block_rows(k_buffer[0]))
    return (output if fuse_gate else gated(output, gate)), k_buffer, v_buffer


def _live_block_rows(k_buffer: mx.array) -> int:
    """Rows per block of the live-length kernels over this buffer (a function of its capacity alone)."""
    return kernels.live_block_rows(k_buffer.shape[2])


# --- the layer ------------------------------------------------------------------------------------

def _qkv_projections(self, x: mx.array) -> Optional[projections.FusedProjection]:
    """The fused q/k/v projection record for this call (switch ``fused_qkv_proj``, op
    ``attention_qkv_proj``; calls of a few rows), or None: three matmuls. Same bits either way."""
    return projections.for_call(self, projections.GROUPS["Qwen3NextAttention"], x, switch="fused_qkv_proj",
                                op="attention_qkv_proj")


def _projected_and_prepared(self, x: mx.array, fused: Optional[projections.FusedProjection], offset):
    """x [B, L, hidden] -> queries [B, H, L, D], keys / values [B, Hkv, L, D], gate [B, L, H * D]: the
    q/k/v projections (one matmul with ``fused``) and the q/k preparation at ``offset``."""
    heads = dict(n_heads=self.num_attention_heads, n_kv_heads=self.num_key_value_heads, q_norm=self.q_norm,
                 k_norm=self.k_norm, rope=self.rope, offset=offset)
    if fused is not None:
        prepared = _prepared_from_hidden(x, fused, **heads)
        if prepared is not None:
            return prepared
        y = projections.matmul(fused, x)  # [B, L, q | k | v]
        prepared = _qk_prep_in_place(y, fused, **heads)
        if prepared is not None:
            return prepared
        q_proj_out, k_proj_out, v_proj_out = projections.split(fused, y)
    else:
        q_proj_out = self.q_proj(x)  # [B, L, H * 2D]
        k_proj_out, v_proj_out = self.k_proj(x), self.v_proj(x)  # [B, L, Hkv * D]
    return qk_prep(q_proj_out, k_proj_out, v_proj_out, **heads)


def gated(output: mx.array, gate: mx.array) -> mx.array:
    """output [B, H, L, D], gate [B, L, H * D] -> output * sigmoid(gate) [B, L, H * D] (stock's ops)."""
    B, _, L, _ = output.shape
    output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)  # [B, L, H * D]
    return output * mx.sigmoid(gate)


def _gated_output(self, output: mx.array, gate: Optional[mx.array]) -> mx.array:
    """output [B, H, L, D], gate [B, L, H * D] -> o_proj(output * sigmoid(gate)) [B, L, hidden]; gate None:
    ``output`` is already gated, [B, L, H * D] (``attend_in_buffer``)."""
    return self.o_proj(output if gate is None else gated(output, gate))


def _traces_on(self, x: mx.array, cache: Any) -> bool:
    """Whether this call's shape-stable pieces run from traces (switch ``compiled_attention``): a decode
    step (one token per row) with a KV cache, on Metal or CUDA (ops on their reference there are plain
    MLX ops, traceable; the simulator computes eagerly), the layer not sharded."""
    if x.shape[1] != 1 or cache is None or not is_enabled("compiled_attention"):
        return False
    if hasattr(self.q_proj, "group") or hasattr(self.o_proj, "group"):
        return False  # sharded (MLX-LM's shard()): its all_sum stays out of traces, as in the other pieces
    kernel_backends = [b for b in (op_backend("attention_qk_prep"),) if b != "reference"]
    return compiled.enabled(active_backend(), *kernel_backends)


# The last offset made an array, that array, and (switch device_positions) the wide array it is a view of: a decode
# step's attention layers share one (their caches have the same offset), so it is made once a step, not once a
# layer. One tuple, replaced whole (threads read it safely).
_last_position: Tuple[int, Optional[mx.array], Optional[mx.array]] = (-1, None, None)

# With device_positions the position is element 0 of an int32 array this wide, made by a kernel (the last step's
# plus one): wider than 8 bytes, MLX's CUDA allocator places it in device memory, not in the managed pool of small
# arrays that the host writes its scalars into. The one added is as wide and made once (a Python 1 would be a new
# host-made scalar in that pool every step).
POSITION_WIDTH = 4


@functools.lru_cache(maxsize=None)
def _ones() -> mx.array:
    return mx.ones((POSITION_WIDTH,), dtype=mx.int32)


def _positions(cache: Any) -> mx.array:
    """The cache's offset as an int32 array (a [B] or scalar input: the traces are shape-stable from token
    to token)."""
    global _last_position
    offset = cache.offset
    if isinstance(offset, mx.array):
        return offset.astype(mx.int32)
    last = _last_position
    if last[0] == offset:
        return last[1]
    wide = None
    if is_enabled("device_positions"):
        follows = last[0] == offset - 1 and last[2] is not None
        wide = last[2] + _ones() if follows else mx.full((POSITION_WIDTH,), offset, dtype=mx.int32)
        position = wide[0]  # a view: the kernels read the wide array's memory
    else:
        position = mx.array(offset, dtype=mx.int32)
    _last_position = (offset, position, wide)
    return position


@contextlib.contextmanager
def position_held(offset: int, position: mx.array):
    """While a whole decode step is traced: the attention layers read ``position`` (the trace's input) as the
    position of offset ``offset``, instead of an array made from the host's value (which the trace would hold
    as a constant)."""
    global _last_position
    _last_position = (offset, position, None)
    try:
        yield
    finally:
        _last_position = (-1, None, None)  # (the trace's placeholder must not outlive it)


step_trace.POSITION.update(make=_positions, hold=position_held)  # (a whole step's trace: its position input)


def _weights(fused: Optional[projections.FusedProjection]) -> list:
    """The fused q/k/v arrays as trace inputs (a re-prepared record is never replayed stale)."""
    return [] if fused is None else [a for a in (fused.weight, fused.scales, fused.biases) if a is not None]


def _bound(fused: Optional[projections.FusedProjection], weights) -> Optional[projections.FusedProjection]:
    """``fused`` with a trace's placeholders for its arrays."""
    if fused is None:
        return None
    return dataclasses.replace(fused, weight=weights[0], scales=weights[1],
                               biases=weights[2] if len(weights) > 2 else None)


def _prep_key(self, args, fused: Optional[projections.FusedProjection]) -> tuple:
    return (tuple((a.shape, a.dtype) for a in args), op_backend("attention_qk_prep"), is_enabled("fused_qk_prep"),
            self.q_proj.weight.shape, self.k_proj.weight.shape, None if fused is None else (fused.names, fused.split_at))


def traced_decode_layer(self, x: mx.array, mask, cache, *, owner, key, pre, post, pre_args=(), post_args=(),
                        replayable=False):
    """``post(x, attention_layer(pre(x, *pre_args)), *post_args)`` for a decode step (switch ``compiled_attention``; with
    ``compiled_layers`` the decoder layer calls it through ``compiled.LAYER_TRACES``, otherwise
    ``attention_forward`` with nothing around the mixer): ``pre`` with the projections and q/k preparation,
    and the output gate and o_proj with ``post``, replay traces owned by ``owner``. The KV cache update and the
    attention over it are in the first trace where ``in_buffer`` (switch ``kv_write_in_trace``: that trace is
    kept for one buffer capacity at a time), else built in between. A ``compiled.LayerStep`` (with its replay if
    ``replayable``), or None (nothing done) where the pieces would not be traced."""
    if not _traces_on(self, x, cache):
        return None
    fused = _qkv_projections(self, x)  # chosen from x: the caller hands a pre that keeps its shape and dtype
    weights = _weights(fused)
    n_pre, n_post = len(pre_args), len(post_args)
    limit = buffer_limit(self, cache)
    buffered = in_buffer(cache, mask, limit)

    def prepared(x, positions, *rest):
        return _projected_and_prepared(self, pre(x, *rest[:n_pre]), _bound(fused, rest[n_pre:]), positions)

    def prep(x, positions, *rest):
        with compiled.inline():
            return tuple(prepared(x, positions, *rest))

    def prep_and_attend(x, positions, k_buffer, v_buffer, *rest):
        with compiled.inline():
            queries, keys, values, gate = prepared(x, positions, *rest)
            output, k_buffer, v_buffer = attend_in_buffer(queries, keys, values, gate, k_buffer, v_buffer,
                                                          positions, scale=self.scale)
            return output, k_buffer, v_buffer

    def finish(output, gate, x, *extra):
        with compiled.inline():
            return post(x, _gated_output(self, output, gate), *extra)

    def finish_gated(output, x, *extra):  # (the output gated in the first trace)
        with compiled.inline():
            return post(x, self.o_proj(output), *extra)

    def whole_step(x, positions, k_buffer, v_buffer, *rest):  # (one_trace_attention: the layer in one trace)
        n_in = n_pre + len(weights)
        output, k_buffer, v_buffer = prep_and_attend(x, positions, k_buffer, v_buffer, *rest[:n_in])
        return finish_gated(output, x, *rest[n_in:]), k_buffer, v_buffer

    def stale(pre_args, post_args) -> bool:  # (a replay no longer fits the layer)
        return (len(pre_args) != n_pre or len(post_args) != n_post
                or (fused is not None and not projections.holds(self, fused.names, fused.pieces)))

    args = [x, _positions(cache), *pre_args] + weights
    first_key = ("prep", key, n_pre) + _prep_key(self, args, fused)
    if buffered and is_enabled("one_trace_attention"):
        return _one_trace_in_buffer(self, whole_step, first_key[1:], x, pre_args, weights, post_args, cache, limit,
                                    owner=owner, stale=stale, replayable=replayable)
    if buffered:
        # One trace per capacity: the slot (the key without it) keeps only the latest.
        kb = cache.keys
        slot = ("prep_in_buffer",) + first_key[1:] + (_buffer_form(kb), _attention_form())
        first_key, capacity = slot + (_capacity(kb),), _capacity(kb)
        traced_out = compiled.call(owner, first_key, prep_and_attend, [x, args[1], kb, cache.values, *args[2:]],
                                   slot=slot)
        if traced_out is None:
            return None
        output, cache.keys, cache.values = traced_out[0], _as_buffer(traced_out[1]), _as_buffer(traced_out[2])
        cache.offset += 1
        gate = None  # (applied in the first trace)
    else:
        traced_out = compiled.call(owner, first_key, prep, args)
        if traced_out is None:
            return None
        output, gate = _attend(self, traced_out, mask, cache, limit)

    def out_key(output):
        return ("out", key, output.shape, output.dtype, None if gate is None else (gate.shape, gate.dtype), x.shape,
                x.dtype, self.o_proj.weight.shape, n_post)

    if gate is None:
        out = compiled.call(owner, out_key(output), finish_gated, (output, x, *post_args))
    else:
        out = compiled.call(owner, out_key(output), finish, (output, gate, x, *post_args))
    if out is None:
        return compiled.LayerStep(post(x, _gated_output(self, output, gate), *post_args))
    if not replayable:
        return compiled.LayerStep(out)
    traced_first, traced_finish = compiled.lookup(owner, first_key), compiled.lookup(owner, out_key(output))
    if traced_first is None or traced_finish is None:
        return compiled.LayerStep(out)
    shape, dtype = output.shape, output.dtype

    def replay(x, mask, cache, pre_args, post_args):
        """The same step for a later call: the two traces called directly, the cache update and the
        attention over it built as above (None, nothing done, once the step would attend over the buffer)."""
        if stale(pre_args, post_args) or in_buffer(cache, mask, limit):
            return None
        output, gate = _attend(self, traced_first(x, _positions(cache), *pre_args, *weights), mask, cache, limit)
        if output.shape != shape or output.dtype != dtype:  # (not for one input shape; then the keyed call)
            return compiled.call(owner, out_key(output), finish, (output, gate, x, *post_args))
        return traced_finish(output, gate, x, *post_args)

    def replay_in_buffer(x, mask, cache, pre_args, post_args):
        """The same step for a later call while the buffer keeps its capacity and has room: two trace calls,
        the cache's buffers and offset moved on (None, nothing done, otherwise)."""
        if stale(pre_args, post_args) or not _still_in_buffer(cache, mask, limit, capacity):
            return None
        output, keys, values = traced_first(x, _positions(cache), cache.keys, cache.values, *pre_args, *weights)
        cache.keys, cache.values = _as_buffer(keys), _as_buffer(values)
        cache.offset += 1
        return traced_finish(output, x, *post_args)

    return compiled.LayerStep(out, compiled.shape_stable(replay_in_buffer) if buffered else replay)


def _attention_form() -> tuple:
    """The switch states and kernels that decide how a step attends over the KV buffer (part of its trace's key; a
    quantized cache's step: its op's kernel or stock's masked attention)."""
    return (_live_length_kernel_on(), is_enabled("gqa_packing"), is_enabled("coalesced_kv"),
            is_enabled("fused_output_gate"),
            _kernel_for("attention_decode_quantized") is not None)


def _one_trace_in_buffer(self, whole_step, key, x, pre_args, weights, post_args, cache, limit, *, owner, stale,
                         replayable):
    """An attention decoder layer's decode step over the KV buffer as one trace (switch ``one_trace_attention``):
    ``whole_step(x, positions, k_buffer, v_buffer, *pre_args, *weights, *post_args)`` (projections and q/k
    preparation, the KV row written into the buffer, the attention over it, o_proj and the decoder layer's
    ``post``), traced once per buffer capacity (``key`` and the cache's shapes; the slot keeps the latest). A
    ``compiled.LayerStep`` (with its replay if ``replayable``; ``stale(pre_args, post_args)`` says when a replay
    no longer fits the layer), or None (nothing done) where it would not be traced."""
    kb = cache.keys
    capacity = _capacity(kb)
    slot = ("layer_in_buffer",) + key + (_buffer_form(kb), _attention_form(), len(post_args),
                                         self.o_proj.weight.shape)
    traced_out = compiled.call(owner, slot + (capacity,), whole_step,
                               [x, _positions(cache), kb, cache.values, *pre_args, *weights, *post_args], slot=slot)
    if traced_out is None:
        return None
    out, cache.keys, cache.values = traced_out[0], _as_buffer(traced_out[1]), _as_buffer(traced_out[2])
    cache.offset += 1
    traced = compiled.lookup(owner, slot + (capacity,)) if replayable else None
    if traced is None:
        return compiled.LayerStep(out)

    def replay(x, mask, cache, pre_args, post_args):
        """The same step for a later call while the buffer keeps its capacity and has room: one trace call, the
        cache's buffers and offset moved on (None, nothing done, otherwise)."""
        if stale(pre_args, post_args) or not _still_in_buffer(cache, mask, limit, capacity):
            return None
        out, keys, values = traced(x, _positions(cache), cache.keys, cache.values, *pre_args, *weights, *post_args)
        cache.keys, cache.values = _as_buffer(keys), _as_buffer(values)
        cache.offset += 1
        return out

    return compiled.LayerStep(out, compiled.shape_stable(replay))


def _attend(self, prepared, mask, cache, limit: Optional[int] = None):
    """(queries, keys, values, gate) of this step -> (attention output [B, H, L, D], gate): the KV cache
    updated with the step's keys and values and attended over (over its whole buffer where ``in_buffer``: then
    (the gated output [B, 1, H * D], None); ``limit``: ``buffer_limit``'s answer where the caller has it)."""
    queries, keys, values, gate = prepared
    if queries.shape[2] == 1:
        limit = buffer_limit(self, cache) if limit is None else limit
        if in_buffer(cache, mask, limit):
            output, cache.keys, cache.values = attend_in_buffer(queries, keys, values, gate, cache.keys,
                                                                cache.values, _positions(cache), scale=self.scale)
            cache.offset += 1
            return output, None  # (gated already)
        if (limit and type(cache) in (KVCache, QuantizedKVCache) and cache.step < BUFFER_GROWTH_ROWS
                and active_backend() in compiled.COMPILE_BACKENDS):
            cache.step = BUFFER_GROWTH_ROWS  # the steps to come write into the buffer from a trace: retrace less often
    keys, values = cache.update_and_fetch(keys, values)
    return attention(queries, keys, values, scale=self.scale, mask=mask, cache=cache), gate


def _unchanged(x: mx.array) -> mx.array:
    return x


def _mixer_output(x: mx.array, mixed: mx.array) -> mx.array:
    return mixed


def attention_forward(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    """``Qwen3NextAttention.__call__`` with the stock module as ``self`` (attributes read now, so a
    sharded module's per-rank head counts apply). x: [B, L, hidden] -> [B, L, hidden].

    In a decode step (switch ``compiled_attention``, Metal / CUDA) the pieces before and after the KV
    cache (projections + q/k preparation; output gate + o_proj) replay traces (``traced_decode_layer``
    with this module as their owner and nothing around the mixer): the same primitives, none of their
    Python. The cache update and the attention over the grown cache are built as usual."""
    if self.training:  # the kernels have no gradients: training runs stock's ops, stock's gradients
        return getattr(type(self), "_lily_stock_class", type(self)).__call__(self, x, mask=mask, cache=cache)
    step = traced_decode_layer(self, x, mask, cache, owner=self, key="mixer", pre=_unchanged, post=_mixer_output)
    if step is not None:
        return step.out
    prepared = _projected_and_prepared(self, x, _qkv_projections(self, x), cache.offset if cache is not None else 0)
    if cache is not None:
        output, gate = _attend(self, prepared, mask, cache)
    else:
        queries, keys, values, gate = prepared
        output = attention(queries, keys, values, scale=self.scale, mask=mask, cache=cache)
    return _gated_output(self, output, gate)


compiled.LAYER_TRACES[attention_forward] = traced_decode_layer
