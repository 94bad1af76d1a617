"""Named A/B switches, one per optimisation of the write-up lily-mlx follows.

A switch changes speed, never results: every state computes stock MLX-LM's function up to
floating-point rounding. "Off" means the write-up's ablation variant (the engine compared with itself),
not stock; stock is an unpatched model. Set switches by API (``disable``/``enable``/``overrides``), by
environment (``LILY_DISABLE=a,b``, ``LILY_ENABLE=a,b``) or on the command line (``--lily-disable a,b``).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import threading
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional

from . import generation


@dataclass(frozen=True)
class Switch:
    name: str
    family: str  # moe | deltanet | attention | linear | generation
    phase: str  # prefill | decode | both
    default: bool
    description: str
    off_meaning: str


_SWITCH_LIST = [
    Switch("fused_dequant", "moe", "both", True,
           "Dequantise 4-bit expert weights tile by tile inside the grouped GEMM (threadgroup memory).",
           "Dequantise the expert weights to a bf16 array first, then multiply."),
    Switch("gpu_routing", "moe", "prefill", True,
           "Routing bookkeeping (histogram, prefix scan, scatter, block map) stays on the GPU, no host sync.",
           "Bring the routing counts to the host and build the GEMM schedule there (one sync per MoE layer)."),
    Switch("adaptive_tile", "moe", "prefill", True,
           "Pick GEMM tile rows and simdgroups per threadgroup from the actual rows per expert.",
           "Fixed 16-row tiles."),
    Switch("register_tiles", "moe", "prefill", True,
           "Grouped GEMMs with each thread's 4 x 4 block of outputs (of gate and of up) in registers: fp32 FMA "
           "chains fed by 16-byte threadgroup loads, the next K step's loads in flight (same bits as the "
           "simdgroup tiles).",
           "simdgroup_matrix 8 x 8 tiles, 4 simdgroups per 32 x 32 block (the write-up's kernel)."),
    Switch("split_k_gate_up", "moe", "both", False,
           "Each gate and up sum of the expert GEMMs as GATE_UP_K_SPLIT chains over contiguous K ranges, added in "
           "range order, in the decode GEMVs (2R x split threads a threadgroup: shorter dependent chains) and the "
           "register tiles alike, so that a token keeps one set of bits in any call (other bits than off; where "
           "the register tiles do not take gate+up, neither splits). A candidate, off by default until timed on a "
           "GPU (docs/moe.md, 'The split as a candidate').",
           "One chain over all of K (the write-up's arithmetic)."),
    Switch("tall_register_blocks", "moe", "prefill", True,
           "With register_tiles: 64-thread threadgroups whose threads each keep 8 rows x 4 columns (of gate and "
           "of up) of a 32-row tile in registers (4 rows of a 16-row tile): twice the FMAs per threadgroup load "
           "(same bits).",
           "128-thread threadgroups, 4 x 4 outputs a thread in 32-row tiles (2 x 4 in 16-row tiles)."),
    Switch("fused_combine", "moe", "both", True,
           "Weight and sum each token's expert rows straight from the down GEMM's slot order (one kernel).",
           "Gather the rows back to token order, multiply by the routing weights, sum over k (three ops)."),
    Switch("register_scan", "deltanet", "prefill", True,
           "Gated DeltaNet prefill scan with the fp32 state held in registers for the whole chunk.",
           "Blockwise (chunked) scan that materialises per-block state in memory."),
    Switch("staged_scan", "deltanet", "prefill", True,
           "The register scan loads each chunk of tokens' q, k, v, gates and mask ahead, coalesced, into "
           "threadgroup memory and steps from there (same bits; with register_scan).",
           "The register scan reads each token's inputs from device memory as it steps."),
    Switch("chunked_prefill", "generation", "prefill", True,
           "Process long prompts in bounded chunks (state and KV cache carry over).",
           "One chunk for the whole prompt (higher peak memory)."),
    Switch("bounded_lookahead", "generation", "prefill", True,
           "In a prefill chunk (>= 256 tokens) the host submits each layer as it is built and waits for "
           "the layer two back before building the next: about three layers' transients alive, not a chunk's.",
           "The host builds and encodes a whole chunk's layers before waiting for any (the GPU runs far behind)."),
    Switch("dense_gemv", "linear", "decode", True,
           "A decode call's dense 4-bit projections (DeltaNet in/out, attention q/k/v/o, lm_head) by lily's row "
           "GEMV: 16-byte weight loads, four outputs per simdgroup sharing each x load, every row of the batch "
           "computed alike (a trial kernel on every backend: LILY_TRIAL_OPS=linear_gemv).",
           "MLX's quantised matmul (its vector kernel for a few rows, its GEMM for more)."),
    Switch("gemv_input_norm", "linear", "decode", False,
           "With dense_gemv: a decoder layer's input RMSNorm is computed inside the GEMV of the projections that "
           "take it (each simdgroup sums the squares of its rows of x itself; stock's rounding points), so the "
           "norm has no launch of its own: 40 primitives and launches fewer in a Qwen3.6 decode step (off by "
           "default: on the H100 a 4K step's projections and norms took 1,299.4 us with it against 1,162.3 with the "
           "plain GEMVs and the norms' own launches; docs/decode.md).",
           "The input norm as its own launch (MLX's rms_norm), the GEMV over its output."),
    Switch("row_gemv", "moe", "decode", True,
           "One-row GEMV forms of the expert GEMMs for decode calls (one thread per output, the GEMMs' "
           "exact per-element arithmetic).",
           "Decode rows run the GEMM kernels as 16-row tiles holding one row."),
    Switch("fused_expert_up", "moe", "both", True,
           "Router GEMV, softmax, top-k, renormalisation and the shared expert's gate in one kernel "
           "per token; for decode it also writes the expert GEMMs' schedule.",
           "Router as MLX ops: quantised matmul, softmax, argpartition, gather, renormalise."),
    Switch("split_router", "moe", "both", True,
           "Router logits spread over the GPU (one simdgroup per expert row), then softmax, top-k and the "
           "schedule in a second kernel (same bits): a token's 0.5 MB router no longer read by one threadgroup.",
           "One threadgroup per token computes all router logits and the top-k (one launch)."),
    Switch("fused_topk_gemv", "moe", "decode", True,
           "With split_router, a decode call's top-k selection inside the gate/up GEMV kernel: each of its "
           "threadgroups selects its token's experts from the router's logits (same bits): 4 launches per "
           "MoE layer instead of 5.",
           "The top-k kernel, then the gate/up GEMV."),
    Switch("fused_residual", "moe", "both", True,
           "The decoder layer's residual add after the MoE block inside the combine kernel (same bits as "
           "MLX's add; with fused_expert_down and fused_combine).",
           "The residual added by MLX after the MoE block."),
    Switch("fused_add_norm", "moe", "both", True,
           "The decoder layer's residual add after its mixer and the post-attention RMSNorm in one kernel "
           "(the add's bits; the norm's sum of squares in the kernel's own order).",
           "MLX's add, then MLX's rms_norm (two primitives per layer)."),
    Switch("fused_norm_router", "moe", "decode", True,
           "With fused_add_norm and fused_topk_gemv, a decode call's residual add, post-attention RMSNorm and "
           "router logits in one kernel (each logit threadgroup recomputes its token's norm; same bits): 4 "
           "launches after each mixer instead of 5.",
           "The residual-norm kernel, then the router-logits kernel."),
    Switch("down_combine_ring", "moe", "decode", True,
           "With fused_down_combine: the staged down+combine keeps DOWN_COMBINE_IN_FLIGHT = 4 chunks of packed "
           "weights, scales and activations in flight in a ring of registers (moe_gemv_staged_ring; the same bits): "
           "18-24 % less time of the kernel in a 4K step (H100, 2026-12-05; docs/moe.md).",
           "One chunk in flight (moe_gemv_staged's schedule)."),
    Switch("down_combine_simd_barriers", "moe", "decode", True,
           "With fused_down_combine: each group of the staged down+combine's chains (one block's GEMV, 16 threads, "
           "half a simdgroup) waits between chunks at a simdgroup barrier for its own staging, not at the "
           "threadgroup's for all ten groups; one threadgroup barrier before the combine (the same bits): 18 % less "
           "time of the kernel in a 4K step with the ring (H100, 2026-12-05; docs/moe.md).",
           "One threadgroup barrier a chunk for all groups."),
    Switch("direct_down_combine", "moe", "decode", False,
           "With fused_down_combine: each chain of a decode call's down GEMV reads its weight row straight from "
           "device memory in register batches (moe_gemv_down_combine_direct), the next batch's loads in flight "
           "during this one's sums, instead of staging 64-wide chunks through threadgroup memory with a barrier each "
           "(the same bits). A candidate, off: 25 % less GPU time of the kernel in a 4K step on the H100, 7 % on the "
           "H200, but decode in alternating bursts no faster with it (H100: off 1.045x at 4K, 1.030x at 32K; "
           "docs/decode.md).",
           "The staged layout (moe_gemv_down_combine)."),
    Switch("fused_down_combine", "moe", "decode", True,
           "With fused_topk_gemv, a decode call's down GEMVs (each of a token's k experts and shared-expert chunks "
           "in its own group of threads of one threadgroup) and the combine with the residual add in one kernel "
           "(same bits): 3 launches per MoE layer after the router instead of 4.",
           "The down GEMV kernel, then the combine kernel."),
    Switch("fused_next_norm", "moe", "decode", False,
           "With fused_norm_router, a decode call's combine kernel also computes the next decoder layer's input "
           "RMSNorm of its output (one threadgroup per token; the norm's sum of squares in the kernel's own "
           "order), handed to the next layer: one launch fewer per layer (off by default: decode measured "
           "~5 % slower with it on the H200, docs/decode.md).",
           "The next layer's input RMSNorm by MLX's rms_norm."),
    Switch("fused_expert_down", "moe", "both", True,
           "Shared expert inside the grouped expert GEMMs (one more expert); the combine kernel adds it, "
           "gated, with the routing-weighted expert rows.",
           "Shared expert by MLX's quantised matmuls, gated and added after the routed experts."),
    Switch("compiled_decode", "generation", "decode", True,
           "Decode-sized MoE blocks and DeltaNet mixers are traced once per shape with mx.compile and "
           "replayed: no Python per kernel launch (Metal and CUDA; the simulator runs eagerly).",
           "Every decode step builds each launch in Python (MoE blocks replay recorded launch plans)."),
    Switch("compiled_layers", "generation", "decode", True,
           "With compiled_decode: a decoder layer's decode step replays traces of whole layers: a DeltaNet "
           "layer (norms, mixer, residual adds, MoE block) one, an attention layer (with compiled_attention) "
           "two around its KV cache (Metal and CUDA; same primitives, same bits).",
           "The mixers and MoE blocks replay their own traces; the norms and adds are built in Python."),
    Switch("layer_replay", "generation", "decode", True,
           "With compiled_layers: after a decode step through the layer traces, a decoder layer replays that "
           "step's resolved path (the trace objects called directly, the cache updated around them) while "
           "the switch states, the dispatch plan, the input's shape and the cache's type are unchanged "
           "and the fused projections' weights are still held (same primitives, same bits).",
           "Every decode step chooses each layer's path again in Python (switches, backends, fused "
           "projections, trace keys) before calling its traces."),
    Switch("constant_weights", "generation", "decode", False,
           "With compiled_decode: a patched decoder layer's decode traces hold its weights as constants instead "
           "of taking them as implicit inputs, which MLX flattens (~45 arrays a layer) at every call (H200, 4K: "
           "graph build 1.23 -> 1.00 ms a step, decode unchanged in alternating bursts: off). Needs the switch on "
           "when the model is patched: every module of a decoder layer then reports what is set into it, and a "
           "weight or module set into a patched layer (load_weights, update, update_modules, attribute or item "
           "assignment) makes the traces again; a write into an array in place (w[...] = v) is not seen. Same "
           "primitives, same bits.",
           "The traces read the layer's current weights at every call (its arrays flattened per call)."),
    Switch("step_trace", "generation", "decode", False,
           "With layer_replay: a one-token decode step of the whole text model (embedding, every decoder layer's "
           "replay, final norm, lm_head) replays one trace of it, the KV caches' position and every cache's "
           "state arrays its inputs, while the caches keep their shapes (the KV buffers their capacity, with room "
           "for the row) and nothing chosen from has changed: one trace call a step instead of one a layer "
           "(H200, 4K: graph build 1.23 -> 0.73 ms a step, 3.16 -> 1.55 on a slower host; decode unchanged in "
           "alternating bursts, the step bound by its evaluation: off, as a trace is made per KV capacity). The "
           "layers' traces then hold their weights as constants (as with constant_weights). Needs the switch on "
           "when the model is patched (every module of the model then reports what is set into it). Same "
           "primitives, same bits.",
           "Each decoder layer replays its own traces (one trace call a layer)."),
    Switch("compiled_attention", "generation", "decode", True,
           "An attention layer's decode pieces before and after the KV cache (q/k/v projections with the "
           "q/k preparation; output gate with o_proj) traced once per shape and replayed, the cache offset "
           "an input (Metal and CUDA, with compiled_decode; same primitives, same bits).",
           "Those pieces built op by op in Python each step (the cache update and the attention always are)."),
    Switch("kv_write_in_trace", "generation", "decode", True,
           "A decode step whose plain KV cache has room writes its keys and values into the cache's buffer at "
           "the offset and attends over rows 0 .. offset of the buffer: through the fixed-block kernels reading "
           "the live length from an array where the long-context op has kernels, else stock's attention with "
           "the rows past the offset masked. With compiled_attention both run inside the layer's first trace "
           "(one trace per capacity; the buffer then grows by 1,024 rows, not MLX-LM's 256), so nothing is "
           "built between the two traces (H200, 4K: build 3.03 -> 2.36 ms a step; with the row written by a "
           "scatter, e2e decode 1.13x / 1.23x at 4K / 32K; docs/decode.md). A quantized cache (--kv-bits) the "
           "same: the row quantised as MLX-LM quantises it, its three parts written, the quantized kernels' "
           "live-length form or stock's quantized attention with the rows past the offset masked "
           "(docs/attention.md).",
           "MLX-LM's update_and_fetch and the attention over the live rows, built op by op between the "
           "attention layer's two traces."),
    Switch("one_trace_attention", "generation", "decode", True,
           "With kv_write_in_trace: an attention layer's decode step over the KV buffer replays one trace "
           "(projections, q/k preparation, KV write, attention, o_proj; with compiled_layers the residual adds "
           "and the MoE block too) instead of two around the attention: one trace call fewer per attention "
           "layer and step (same primitives, same bits; H200, 4K: an attention layer's replay 48 us of host time, "
           "decode 1.035x in alternating bursts).",
           "Two traces, the first ending with the attention's output (its owner's weights flattened twice a "
           "step)."),
    Switch("device_positions", "generation", "decode", False,
           "A decode step's position (the cache's offset, read by the KV row write, the rotary embedding and the "
           "live-length attention kernels) is made on the GPU from the last step's, 4 int32 wide, instead of written "
           "by the host each step. MLX's CUDA allocator keeps arrays of at most 8 bytes in one pool of managed "
           "memory that every host-made scalar shares; under Nsight Compute (H200, 4K) the live partials kernel spent "
           "42 % of its warps' time waiting on that load. Same bits; off: end to end it changed nothing (H200, 4K, "
           "2026-12-04: 0.999x off/on in alternating bursts; the kernels 0.09 ms a step less in the profiler's table).",
           "A scalar int32 array written by the host once a step (shared by the step's attention layers)."),
    Switch("fused_output_gate", "attention", "decode", False,
           "Where a decode step attends over the KV buffer through the live-length kernels (kv_write_in_trace), "
           "their merge also applies the layer's output gate (output * sigmoid(gate), rounded to the activation type "
           "where stock's two ops round) and writes the o-projection's input: 20 primitives and 10 launches fewer a "
           "Qwen3.6 step (off by default: on the H100 a 4K step's GPU time 3.829 against 3.898 ms and decode level "
           "to 1.03x faster, but its sigmoid is the kernel's own, not each backend's stock one, and on the simulator "
           "it moves the consistency check's decode top-1 from 96.35 % to 95.31 %; docs/decode.md).",
           "The gate by MLX's sigmoid and multiply after the attention kernels."),
    Switch("fused_qk_prep", "attention", "both", True,
           "q/k RMSNorm, partial RoPE and output-gate split in one kernel.",
           "Separate norm, RoPE and split ops."),
    Switch("fused_in_proj", "deltanet", "decode", True,
           "A DeltaNet layer's in-projections (qkv, z, b, a) in a decode step as one quantised matmul over "
           "their weights concatenated once at patch time (same bits; calls of up to 7 rows).",
           "One quantised matmul per projection (four per layer and step)."),
    Switch("fused_qkv_proj", "attention", "decode", True,
           "An attention layer's q/k/v projections in a decode step as one quantised matmul over their "
           "weights concatenated once at patch time (same bits; calls of up to 7 rows).",
           "One quantised matmul per projection (three per layer and step)."),
    Switch("fused_recurrent_norm", "deltanet", "decode", True,
           "DeltaNet decode step fused with the gate/beta computation and the gated RMSNorm.",
           "Separate gate, recurrent step and gated-norm kernels."),
    Switch("fused_conv_step", "deltanet", "decode", True,
           "DeltaNet decode step from the in_proj output in one kernel: conv1d + SiLU + q/k norm + conv-state "
           "update fused with the fused decode step (bit-identical; with fused_recurrent_norm, Dk = Dv).",
           "The conv + q/k-norm kernel, then the fused decode kernel (two launches per layer and token)."),
    Switch("fused_in_proj_step", "linear", "decode", False,
           "With the dense row GEMV (a trial kernel): a Qwen3.5/3.6 DeltaNet decode step from the layer's input in one "
           "kernel, each value head computing the in-projection rows it needs (and the layer's input norm, with "
           "gemv_input_norm) by the GEMV's arithmetic, then the fused conv step (the same bits as the GEMV and the "
           "conv-step kernel in turn): the in-projection's launch and output leave the step (off by default: on the "
           "H100 its 32 threadgroups took 44.3 us a layer against ~32 for the GEMV and the conv step; "
           "docs/decode.md).",
           "The in-projection's GEMV, then the conv-step kernel (fused_conv_step)."),
    Switch("fused_qkv_prep", "linear", "decode", True,
           "With the dense row GEMV (a trial kernel): an attention layer's decode q/k/v projection computed inside the "
           "q/k preparation kernel (with fused_qk_prep), each threadgroup one head's block of projection rows by the "
           "GEMV's arithmetic (the layer's input norm too, with gemv_input_norm), then that head's norm and RoPE, gate "
           "or values (the same bits as the GEMV and the preparation kernel in turn): 10 primitives fewer a step.",
           "The q/k/v projection's GEMV, then the q/k preparation kernel."),
    Switch("coalesced_kv", "attention", "decode", True,
           "Decode attention reads K/V so adjacent threads read adjacent bytes.",
           "Strided per-thread K/V reads."),
    Switch("gqa_packing", "attention", "decode", True,
           "Query heads sharing a KV head share a threadgroup that loads each KV row once.",
           "One threadgroup per query head (KV rows loaded once per query head)."),
    Switch("fixed_block_attention", "attention", "decode", True,
           "At >= 32K context split the KV cache into fixed blocks processed in parallel.",
           "Ordinary decode attention path at every length."),
]

SWITCHES: Dict[str, Switch] = {s.name: s for s in _SWITCH_LIST}

_lock = threading.Lock()
_state: Dict[str, bool] = {}
_user_choices: Dict[str, bool] = {}  # set by enable() / disable(): a tune profile never overrides these


# Switches that existed and were removed, with why: a name left in a shell profile or a script gets the reason, not
# only "unknown".
REMOVED = {
    "long_live_blocks": "removed on 2026-12-05: the live-length attention with twice the rows a block decoded 2-5 % "
                        "slower end to end on the H200 (docs/attention.md)",
    "gemv_dequant_warps": "removed on 2026-12-05: the routed gate+up GEMV with producer threads dequantising for its "
                          "chains took 1.37x the staged kernel's time in a 4K decode step on the H100 (docs/moe.md)",
}


def suggestion(name: str) -> str:
    """`` (did you mean 'x'?)`` for a misspelt or wrong-case switch name, `` (removed ...)`` for a removed one, else
    ''."""
    if name in REMOVED:
        return f" ({REMOVED[name]})"
    lowered = {n.lower(): n for n in SWITCHES}
    match = lowered.get(name.lower()) or next(iter(difflib.get_close_matches(name, SWITCHES, n=1)), None)
    return f" (did you mean {match!r}?)" if match else ""


def _unknown_message(unknown: List[str]) -> str:
    named = ", ".join(f"{n!r}{suggestion(n)}" for n in unknown)
    return f"unknown lily-mlx switch(es): {named}. Valid switches: {', '.join(SWITCHES)}"


def _check(names: Iterable[str]) -> list:
    names = [n.strip() for n in names if n and n.strip()]
    unknown = [n for n in names if n not in SWITCHES]
    if unknown:
        raise ValueError(_unknown_message(unknown))
    return names


def parse_list(text: Optional[str]) -> list:
    """Parse a comma-separated switch list (``'a,b'``), validating names."""
    if not text:
        return []
    return _check(text.split(","))


def _from_environment(environ) -> "tuple[Dict[str, bool], List[str]]":
    """(switch values named by LILY_DISABLE / LILY_ENABLE, one line per unknown name)."""
    values: Dict[str, bool] = {}
    problems = []
    named = {}
    for var, value in (("LILY_DISABLE", False), ("LILY_ENABLE", True)):  # ENABLE applies last
        names = [n.strip() for n in environ.get(var, "").split(",") if n.strip()]
        unknown = [n for n in names if n not in SWITCHES]
        if unknown:
            problems.append(f"{var}={environ[var]!r}: {_unknown_message(unknown)}")
        values.update({n: value for n in names if n in SWITCHES})
        named[var] = set(names)
    both = sorted(named["LILY_DISABLE"] & named["LILY_ENABLE"] & set(SWITCHES))
    if both:
        problems.append(f"LILY_DISABLE and LILY_ENABLE both name {', '.join(both)} (name each in one of them)")
    return values, problems


def reset() -> None:
    """Restore defaults, then apply ``LILY_DISABLE`` / ``LILY_ENABLE`` from the environment.

    Never raises: this runs when ``lily_mlx`` is imported, which MLX-LM's CLIs do through the import
    hook even without ``--lily``, so a typo in a shell profile must not break stock MLX-LM. Unknown
    names are skipped; ``--lily``, ``patch()`` and ``load()`` refuse to run while the environment
    holds any (:func:`environment_problems`, checked by ``lily_mlx.patch.check_environment``).
    """
    values, _ = _from_environment(os.environ)
    with _lock:
        _user_choices.clear()
        _state.clear()
        _state.update({n: s.default for n, s in SWITCHES.items()})
        _state.update(values)
        generation.bump()


def environment_problems() -> List[str]:
    """One line per unknown name in ``LILY_DISABLE`` / ``LILY_ENABLE`` as they are now."""
    return _from_environment(os.environ)[1]


def _check_one(name: str) -> str:
    names = _check([name])
    if len(names) != 1:
        raise ValueError(f"empty lily-mlx switch name. Valid switches: {', '.join(SWITCHES)}")
    return names[0]


def is_enabled(name: str) -> bool:
    try:  # hot path: one dict lookup
        return _state[name]
    except KeyError:
        _check_one(name)  # raises for unknown or empty names
        raise ValueError(f"switch name {name!r} has surrounding spaces") from None


def key() -> tuple:
    """Every switch's state, as a hashable value (part of a trace's cache key: a trace holds the paths
    its switches chose when it was made)."""
    return tuple(_state.values())


def set_enabled(name: str, value: bool) -> None:
    name = _check_one(name)
    with _lock:
        _state[name] = bool(value)
        generation.bump()


def disable(*names: str) -> None:
    """Turn switches off for this process: the user's word, which a tune profile's choices never undo."""
    for n in _check(names):
        set_enabled(n, False)
        _user_choices[n] = False


def enable(*names: str) -> None:
    """Turn switches on for this process (``--lily-enable``): the user's word, as ``disable``."""
    for n in _check(names):
        set_enabled(n, True)
        _user_choices[n] = True


def user_choices() -> Dict[str, bool]:
    """Switches set by ``enable`` / ``disable`` (the API, the ``--lily-*`` flags) since the last ``reset``."""
    return dict(_user_choices)


def state() -> Dict[str, bool]:
    """Current state of every switch."""
    return dict(_state)


@contextlib.contextmanager
def overrides(disable: Iterable[str] = (), enable: Iterable[str] = ()) -> Iterator[None]:
    """Temporarily disable/enable switches: ``with overrides(disable=["gpu_routing"]): ...``."""
    if isinstance(disable, str):
        disable = parse_list(disable)
    if isinstance(enable, str):
        enable = parse_list(enable)
    off, on = _check(disable), _check(enable)
    saved = state()
    try:
        for n in off:
            set_enabled(n, False)
        for n in on:
            set_enabled(n, True)
        yield
    finally:
        with _lock:
            _state.clear()
            _state.update(saved)
            generation.bump()


reset()
