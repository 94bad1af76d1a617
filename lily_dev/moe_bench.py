"""MoE microbenchmark cases at Qwen3.6-35B-A3B shapes, for the GPU benchmark harness.

``microbench_cases()`` returns ``(name, run_once, bytes_moved, flops)`` tuples. ``run_once()`` builds
and evaluates one call (``mx.eval``) on the active backend (``LILY_BACKEND``); inputs are built and
evaluated before the list is returned, so a case times only its own work. ``bytes_moved`` is the
minimum traffic of the case (every touched expert's packed weights, scales and biases read once,
activations read once, outputs written once); ``flops`` counts 2 per multiply-add.

Prefill GEMM cases, per token count: ``gemm_<gate_up_swiglu|down>_fused_<adaptive|fixed16>`` (the simdgroup tiles,
as the cases were first named), the same with ``_regtiles`` (the register-tiled form, switch ``register_tiles``,
which runs by default), ``..._bf16tiles`` (simdgroup tiles with bf16 operands) and ``..._unfused`` (fused_dequant off).

Decode GEMV cases (``decode_gemv_cases``, appended to ``microbench_cases``): the one-row-block forms
of the expert GEMMs (switch ``row_gemv``) at Qwen3.6 decode shape, top-8 routed experts plus the shared
expert as one chunk (9 blocks per token), bf16:

- ``gemv_gate_up_swiglu_<variant>[1tok]`` / ``gemv_down_<variant>[1tok]``: one launch per evaluation;
  ``..._x8[1tok]``: 8 launches per evaluation (bytes and flops x 8), so the kernels' own time is not
  hidden by the per-call evaluation round trip (~60-100 us on MLX-CUDA). Variants: ``staged`` (what
  runs: kernels.GEMV_LAYOUT), ``rowwise`` (the GEMV before it: one thread per output reading its row
  from device memory, an int-to-float conversion per weight), ``rowwise_exp`` (rowwise with the
  conversion-free nibble of q4_value), ``r<R>_kc<KC>`` (staged at another layout: R outputs per
  threadgroup, K chunk KC), ``onerow_gemm`` (x8 only: the GEMM kernels on the same one-row blocks,
  what row_gemv off runs), ``onerow_gemm_bf16tiles`` (x8, 1 and 8 tokens: those GEMM kernels with bf16 tile
  operands, what decode would run if bf16 tiles became the product path);
- ``..._x8[8tok]`` (staged, rowwise): a decode batch of 8 sequences, 72 blocks per launch;
- ``down_then_combine_x8[<n>tok]`` / ``down_combine_<variant>_x8[<n>tok]``: a decode call's down GEMV and
  combine (with the residual) as two kernels, against ``moe_gemv_down_combine`` (switch ``fused_down_combine``)
  at its layout (``default``: kernels.down_combine_geometry), others (``r<R>_kc<KC>``: R columns a threadgroup,
  K chunk KC; those whose threadgroup memory would pass 32 KB are left out) and the direct layout (``direct``:
  ``moe_gemv_down_combine_direct``, each chain's weights read by its own thread).

Every launch of these cases reads other experts than the previous ones (the launches cycle through a
pool of GEMV_POOL calls whose routings walk over all experts, each with its own shared expert), so the
weights are not left in the GPU's L2 cache from the previous call. Bytes: the touched experts' packed
weights, scales and biases (routed and shared) once, the activation row(s) in, the outputs out.
"""

from __future__ import annotations

import itertools
from typing import Callable, List, Tuple

import mlx.core as mx
import numpy as np

from lily_mlx.core import switches
from lily_mlx.ops.moe import kernels as mk
from lily_mlx.ops.moe.reference import combine_reference, switch_glu_reference
from .moe_testing import make_routing

HIDDEN, EXPERT_WIDTH, NUM_EXPERTS, TOP_K = 2048, 512, 256, 8
TOKENS = (512, 2048, 8192)


class _Layer(dict):
    """Just enough of a ``QuantizedSwitchLinear`` for the kernels and the reference (weights by key)."""

    bits, group_size, mode = 4, 64, "affine"

    def get(self, key, default=None):
        return dict.get(self, key, default)

    def __getattr__(self, name):
        if name in ("scales", "weight", "biases"):
            return self[name]
        raise AttributeError(name)

    def __contains__(self, key):  # no output bias
        return dict.__contains__(self, key)


def _quantized_experts(out_dims: int, in_dims: int, seed: int) -> _Layer:
    w = mx.random.normal((NUM_EXPERTS, out_dims, in_dims), key=mx.random.key(seed)) * (in_dims ** -0.5)
    wq, scales, biases = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
    mx.eval(wq, scales, biases)
    return _Layer(weight=wq, scales=scales, biases=biases)


class _SwitchGLU:
    def __init__(self, seed: int = 0):
        from mlx_lm.models.switch_layers import SwiGLU

        self.gate_proj = _quantized_experts(EXPERT_WIDTH, HIDDEN, seed)
        self.up_proj = _quantized_experts(EXPERT_WIDTH, HIDDEN, seed + 1)
        self.down_proj = _quantized_experts(HIDDEN, EXPERT_WIDTH, seed + 2)
        self.activation = SwiGLU()


def _quantized_linear(out_dims: int, in_dims: int, seed: int) -> _Layer:
    w = mx.random.normal((out_dims, in_dims), key=mx.random.key(seed)) * (in_dims ** -0.5)
    wq, scales, biases = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
    mx.eval(wq, scales, biases)
    return _Layer(weight=wq, scales=scales, biases=biases)


class _SharedExpert:
    """Qwen3.6's shared expert as the GEMMs take it (fused_expert_down): 4-bit gate/up/down of the
    experts' width, i.e. one chunk (expert id E)."""

    def __init__(self, seed: int):
        self.gate_proj = _quantized_linear(EXPERT_WIDTH, HIDDEN, seed)
        self.up_proj = _quantized_linear(EXPERT_WIDTH, HIDDEN, seed + 1)
        self.down_proj = _quantized_linear(HIDDEN, EXPERT_WIDTH, seed + 2)


def _expert_bytes(out_dims: int, in_dims: int, experts_touched: int) -> int:
    packed = out_dims * in_dims // 2
    scales_biases = 2 * 2 * out_dims * in_dims // 64
    return experts_touched * (packed + scales_biases)


def _run(fn: Callable, disable=()) -> Callable[[], None]:
    def run_once():
        with switches.overrides(disable=disable):
            mx.eval(fn())

    return run_once


def microbench_cases() -> List[Tuple[str, Callable[[], None], int, int]]:
    """Cases for 512, 2K and 8K tokens x top-8 of 256 experts, hidden 2048, expert width 512."""
    sw = _SwitchGLU()
    backend = mk.op_backend("moe_grouped_gemm")
    cases = []
    for tokens in TOKENS:
        a = tokens * TOP_K
        inds_np = make_routing("skewed", tokens, TOP_K, NUM_EXPERTS, seed=tokens)
        inds = mx.array(inds_np.astype(np.uint32))
        x = (mx.random.normal((tokens, HIDDEN), key=mx.random.key(tokens))).astype(mx.bfloat16)
        sched = mk.routing_schedule(inds, NUM_EXPERTS, True, True, backend) if backend != "reference" else None
        fixed = mk.routing_schedule(inds, NUM_EXPERTS, True, False, backend) if backend != "reference" else None
        h = mx.random.normal((a, EXPERT_WIDTH), key=mx.random.key(1)).astype(mx.bfloat16)
        mx.eval(inds, x, h, *(sched.values() if sched else ()), *(fixed.values() if fixed else ()))
        touched = int(np.count_nonzero(np.bincount(inds_np.reshape(-1), minlength=NUM_EXPERTS)))
        up_bytes = 2 * _expert_bytes(EXPERT_WIDTH, HIDDEN, touched) + tokens * HIDDEN * 2 + a * EXPERT_WIDTH * 2
        down_bytes = _expert_bytes(HIDDEN, EXPERT_WIDTH, touched) + a * EXPERT_WIDTH * 2 + a * HIDDEN * 2
        up_flops = 2 * 2 * a * HIDDEN * EXPERT_WIDTH
        down_flops = 2 * a * EXPERT_WIDTH * HIDDEN
        routing_bytes = a * 4 * 6 + NUM_EXPERTS * 4 * 3
        t = f"{tokens}tok"

        cases.append((f"stock_switch_glu[{t}]",
                      _run(lambda x=x, inds=inds: switch_glu_reference(sw, x, inds)),
                      up_bytes + down_bytes, up_flops + down_flops))
        if backend == "reference":
            continue
        cases.append((f"routed_experts_kernel[{t}]",
                      _run(lambda x=x, inds=inds: mk.routed_experts_kernel(sw, x, inds)),
                      up_bytes + down_bytes + routing_bytes, up_flops + down_flops))
        cases.append((f"routing_gpu[{t}]",
                      _run(lambda inds=inds: list(mk.routing_schedule(inds, NUM_EXPERTS, True, True, backend).values())),
                      routing_bytes, 0))
        cases.append((f"routing_host[{t}]",
                      _run(lambda inds=inds: list(mk.routing_schedule(inds, NUM_EXPERTS, False, True, backend).values())),
                      routing_bytes, 0))
        # The simdgroup tiles under their first names; "_regtiles": the register-tiled form (switch register_tiles).
        for (label, s), (suffix, tiles) in itertools.product((("adaptive", sched), ("fixed16", fixed)),
                                                              (("", "simdgroup"), ("_regtiles", "register"))):
            cases.append((f"gemm_gate_up_swiglu_fused_{label}{suffix}[{t}]",
                          _run(lambda x=x, s=s, tiles=tiles: mk.gemm_gate_up_swiglu(
                              x, s["sorted_rows"], s["blocks"], sw.gate_proj, sw.up_proj, TOP_K, True, s["counts"], backend,
                              tiles=tiles)),
                          up_bytes, up_flops))
            cases.append((f"gemm_down_fused_{label}{suffix}[{t}]",
                          _run(lambda h=h, s=s, tiles=tiles: mk.gemm_down(h, s["blocks"], sw.down_proj, True, s["counts"],
                                                                          backend, tiles=tiles)),
                          down_bytes, down_flops))
        # The same tiles with bf16 operand fragments (fp32 accumulation): tensor cores through the bridge.
        # Not a product path yet (not the GEMVs' bits; docs/moe.md): timed to see what it would buy.
        cases.append((f"gemm_gate_up_swiglu_fused_adaptive_bf16tiles[{t}]",
                      _run(lambda x=x, s=sched: mk.gemm_gate_up_swiglu(
                          x, s["sorted_rows"], s["blocks"], sw.gate_proj, sw.up_proj, TOP_K, True, s["counts"], backend,
                          tile_dtype=mx.bfloat16)),
                      up_bytes, up_flops))
        cases.append((f"gemm_down_fused_adaptive_bf16tiles[{t}]",
                      _run(lambda h=h, s=sched: mk.gemm_down(h, s["blocks"], sw.down_proj, True, s["counts"], backend,
                                                             tile_dtype=mx.bfloat16)),
                      down_bytes, down_flops))
        # fused_dequant off: dequantise the touched experts to bf16 first (their bytes written and read back).
        dense_up = 2 * 2 * 2 * touched * EXPERT_WIDTH * HIDDEN
        cases.append((f"gemm_gate_up_swiglu_unfused[{t}]",
                      _run(lambda x=x, s=sched: mk.gemm_gate_up_swiglu(
                          x, s["sorted_rows"], s["blocks"], sw.gate_proj, sw.up_proj, TOP_K, False, s["counts"], backend)),
                      up_bytes + dense_up, up_flops))
        cases.append((f"gemm_down_unfused[{t}]",
                      _run(lambda h=h, s=sched: mk.gemm_down(h, s["blocks"], sw.down_proj, False, s["counts"], backend)),
                      down_bytes + dense_up // 2, down_flops))
        # fused_combine on / off: the routing-weighted sum of the down GEMM's slot-order rows.
        y = mx.random.normal((a, HIDDEN), key=mx.random.key(2)).astype(mx.bfloat16)
        scores = mx.random.uniform(shape=(tokens, TOP_K), key=mx.random.key(3)).astype(mx.bfloat16)
        mx.eval(y, scores)
        combine_bytes = a * HIDDEN * 2 + tokens * HIDDEN * 2 + a * (4 + 2)
        combine_flops = 2 * a * HIDDEN
        cases.append((f"combine_fused[{t}]",
                      _run(lambda y=y, s=sched, sc=scores: mk.combine_rows(y, s["slot_of_row"], sc, backend)),
                      combine_bytes, combine_flops))
        cases.append((f"combine_gather_sum[{t}]",
                      _run(lambda y=y, s=sched, sc=scores, n=tokens: combine_reference(  # bind n now:
                          mx.take(y, s["slot_of_row"], axis=0).reshape(n, TOP_K, HIDDEN), sc)),  # late binding broke it
                      combine_bytes, combine_flops))
    return cases + decode_gemv_cases(sw, backend)


GEMV_POOL = 32  # distinct decode calls the GEMV cases cycle through
REPEATS = 8  # launches per evaluation in the _x8 cases
# Staged layouts timed besides the default (kernels.GEMV_LAYOUT): (R outputs per threadgroup, K chunk).
# (16, 512) and (32, 512): K chunks of 512 (half the chunks a chain, each with twice the bytes in flight; 2026-12-05).
GEMV_VARIANTS = {"gate_up": ((32, 256), (64, 128), (16, 512)), "down": ((64, 256), (128, 256), (64, 128), (32, 512))}
# The gate+up GEMV's K-split candidate (R, KC, SK): each sum as SK chains over contiguous K ranges (other bits than
# the GEMM tiles', so a candidate: docs/moe.md), timed as gemv_gate_up_swiglu_r{R}_kc{KC}_sk{SK}_x8[1tok].
GEMV_SPLIT_VARIANTS = ((16, 128, 2), (16, 64, 4), (8, 64, 4), (8, 64, 8))
# Layouts of the down GEMV + combine kernel timed besides its default: (R columns a threadgroup, K chunk).
DOWN_COMBINE_VARIANTS = ((8, 128), (8, 64), (4, 128), (4, 64), (32, 64))
# The gate+up GEMV's direct layout candidate (R, KB): each chain's weight row read by its thread, KB quantisation
# groups a register batch (no staging, no barrier a chunk), timed as gemv_gate_up_swiglu_direct_r{R}_kb{KB}_x8[1tok].
GEMV_DIRECT_VARIANTS = ((16, 4), (16, 8))


def _decode_calls(tokens: int, backend: str):
    """GEMV_POOL decode calls of ``tokens`` tokens: (x [N, D], h [A + N, I], sorted_rows, blocks) with
    the per-assignment schedule plus one shared-expert chunk, and the call's shared expert. Call j routes
    token t to experts ((j * tokens + t) * TOP_K + i) % E: the pool walks over all experts."""
    calls = []
    for j in range(GEMV_POOL):
        first = (j * tokens + np.arange(tokens)[:, None]) * TOP_K
        inds = mx.array(((first + np.arange(TOP_K)) % NUM_EXPERTS).astype(np.uint32))
        a = tokens * TOP_K
        sched = mk.per_assignment_schedule(inds)
        blocks = mx.concatenate([sched["blocks"], mk.shared_expert_blocks(tokens, 1, a, NUM_EXPERTS, mk.SMALL_TILE,
                                                                          True)], axis=0)
        x = mx.random.normal((tokens, HIDDEN), key=mx.random.key(100 + j)).astype(mx.bfloat16)
        h = mx.random.normal((a + tokens, EXPERT_WIDTH), key=mx.random.key(200 + j)).astype(mx.bfloat16)
        shared = _SharedExpert(seed=1000 + 3 * j)
        mx.eval(x, h, sched["sorted_rows"], blocks)
        calls.append((x, h, sched["sorted_rows"], blocks, shared))
    return calls


def _cycling(launch, calls, per_eval: int) -> Callable[[], None]:
    """run_once: evaluates ``per_eval`` launches, each on the next call of the pool."""
    state = {"next": 0}

    def run_once():
        start = state["next"]
        state["next"] = (start + per_eval) % len(calls)
        mx.eval([launch(*calls[(start + i) % len(calls)]) for i in range(per_eval)])

    return run_once


def decode_gemv_cases(sw, backend: str) -> List[Tuple[str, Callable[[], None], int, int]]:
    """The decode GEMV cases (module docstring): staged vs rowwise, layouts, x8."""
    if backend == "reference":
        return []
    cases = []
    for tokens in (1, 8):
        calls = _decode_calls(tokens, backend)
        a = tokens * TOP_K
        rows = a + tokens  # routed rows + one shared-expert chunk row per token
        touched = min(a, NUM_EXPERTS) + 1
        up_bytes = 2 * _expert_bytes(EXPERT_WIDTH, HIDDEN, touched) + tokens * HIDDEN * 2 + rows * EXPERT_WIDTH * 2
        down_bytes = _expert_bytes(HIDDEN, EXPERT_WIDTH, touched) + rows * EXPERT_WIDTH * 2 + rows * HIDDEN * 2
        up_flops = 2 * 2 * rows * HIDDEN * EXPERT_WIDTH
        down_flops = 2 * rows * EXPERT_WIDTH * HIDDEN
        t = f"[{tokens}tok]"

        def up(layout, gemv=True, tile=None):
            return lambda x, h, sr, blocks, shared: mk.gemm_gate_up_swiglu(
                x, sr, blocks, sw.gate_proj, sw.up_proj, TOP_K, True, None, backend, shared=shared, gemv=gemv,
                gemv_layout=layout, tile_dtype=tile)

        def down(layout, gemv=True, tile=None):
            return lambda x, h, sr, blocks, shared: mk.gemm_down(
                h, blocks, sw.down_proj, True, None, backend, shared=shared, gemv=gemv, gemv_layout=layout,
                tile_dtype=tile)

        kinds = (("gemv_gate_up_swiglu", up, up_bytes, up_flops, GEMV_VARIANTS["gate_up"]),
                 ("gemv_down", down, down_bytes, down_flops, GEMV_VARIANTS["down"]))
        for name, make, nbytes, flops, variants in kinds:
            layouts = [("staged", None), ("rowwise", "rowwise")]
            if tokens == 1:
                layouts += [("rowwise_exp", "rowwise_exp")] + [(f"r{r}_kc{kc}", (r, kc)) for r, kc in variants]
                if name == "gemv_gate_up_swiglu":
                    layouts += [(f"r{r}_kc{kc}_sk{sk}", (r, kc, sk)) for r, kc, sk in GEMV_SPLIT_VARIANTS
                                if HIDDEN % (kc * sk) == 0]  # (shrunk shapes in tests)
                    layouts += [(f"direct_r{r}_kb{kb}", ("direct", r, kb)) for r, kb in GEMV_DIRECT_VARIANTS
                                if (HIDDEN // 64) % kb == 0]
            for label, layout in layouts:
                if tokens == 1 and label in ("staged", "rowwise"):
                    cases.append((f"{name}_{label}{t}", _cycling(make(layout), calls, 1), nbytes, flops))
                cases.append((f"{name}_{label}_x{REPEATS}{t}", _cycling(make(layout), calls, REPEATS),
                              REPEATS * nbytes, REPEATS * flops))
            if tokens == 1:
                cases.append((f"{name}_onerow_gemm_x{REPEATS}{t}", _cycling(make(None, gemv=False), calls, REPEATS),
                              REPEATS * nbytes, REPEATS * flops))
            # Decode through bf16 tiles (one live row per tile): what bf16 tiles as the product path would run
            # for every decode row (docs/moe.md, "Tile operands in bf16/f16"), against the GEMVs above.
            cases.append((f"{name}_onerow_gemm_bf16tiles_x{REPEATS}{t}",
                          _cycling(make(None, gemv=False, tile=mx.bfloat16), calls, REPEATS),
                          REPEATS * nbytes, REPEATS * flops))
        cases += _down_combine_cases(sw, backend, calls, tokens, down_bytes, down_flops)
    return cases


def _down_combine_cases(sw, backend: str, calls, tokens: int, down_bytes: int, down_flops: int):
    """The down GEMV then the combine (two kernels) against moe_gemv_down_combine at its layouts (module
    docstring), each 8 launches an evaluation; the combine's inputs (scores, gate, residual) one set per case."""
    key = mx.random.key(300 + tokens)
    scores = mx.softmax(mx.random.normal((tokens, TOP_K), key=key), axis=-1).astype(mx.bfloat16)
    gate = mx.sigmoid(mx.random.normal((tokens,), key=mx.random.key(301))).astype(mx.float32)
    residual = mx.random.normal((tokens, HIDDEN), key=mx.random.key(302)).astype(mx.bfloat16)
    slot_of_row = mx.arange(tokens * TOP_K, dtype=mx.int32)
    mx.eval(scores, gate, residual, slot_of_row)
    nbytes = down_bytes + 2 * tokens * HIDDEN * 2 - (tokens * TOP_K + tokens) * HIDDEN * 2  # no y, + residual, out
    t = f"[{tokens}tok]"

    def two_kernels(x, h, sr, blocks, shared):
        y = mk.gemm_down(h, blocks, sw.down_proj, True, None, backend, shared=shared, gemv=True)
        return mk.combine_rows(y, slot_of_row, scores, backend, gate=gate, chunks=1, residual=residual)

    def fused(geometry, direct=False):
        return lambda x, h, sr, blocks, shared: mk.gemv_down_combine(h, blocks, sw.down_proj, shared, scores, gate,
                                                                     residual, geometry, backend, direct=direct)

    cases = [(f"down_then_combine_x{REPEATS}{t}", _cycling(two_kernels, calls, REPEATS), REPEATS * nbytes,
              REPEATS * down_flops)]
    default = mk.down_combine_geometry(TOP_K + 1, HIDDEN, EXPERT_WIDTH)
    layouts = [("default", default)] if default is not None else []
    for rows, chunk in DOWN_COMBINE_VARIANTS:
        geometry = mk.down_combine_geometry(TOP_K + 1, HIDDEN, EXPERT_WIDTH, rows, (chunk,))
        if geometry is not None and geometry != default:
            layouts.append((f"r{rows}_kc{chunk}", geometry))
    for label, geometry in layouts:
        cases.append((f"down_combine_{label}_x{REPEATS}{t}", _cycling(fused(geometry), calls, REPEATS),
                      REPEATS * nbytes, REPEATS * down_flops))
    direct = mk.down_combine_direct_geometry(TOP_K + 1, HIDDEN, EXPERT_WIDTH)
    if direct is not None:
        cases.append((f"down_combine_direct_x{REPEATS}{t}", _cycling(fused(direct, True), calls, REPEATS),
                      REPEATS * nbytes, REPEATS * down_flops))
    return cases
