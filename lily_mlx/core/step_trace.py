"""A one-token decode step of a whole text model (embedding, decoder layers, final norm, lm_head) as one trace
(switch ``step_trace``; the patched text model's forward, ``lily_mlx.ops.moe.layer.text_model_forward``, calls
:func:`decode_step`).

Why: after ``layer_replay`` a decode step is ~50 trace calls from Python (one per decoder layer), each
flattening its inputs and rebuilding its part of the graph. Traced whole, a step is one call: on the H200's host
at 4K the graph build went 1.23 -> 0.73 ms a step, though decode did not move (the step is bound by its
evaluation there; docs/decode.md), hence off by default.

How: the step is traced from the decoder layers' own replays (``compiled.replays_only``: a layer without a
shape-stable replay gives the trace up), with every cache's state arrays and the KV caches' position as the
trace's inputs and the new states among its outputs. A later step replays it while what it was made for holds:
the same switch states, dispatch plan and weights (``_state_key``: with the switch on at patch time every module of
the model reports what is set into it, which moves the weights epoch), the same decoder layers, an input of the same shape,
caches of the plain types with the same shapes (the KV buffers' capacity, with room for this step's row) and one
offset. Then the caches are moved on as the layers would move them: new state arrays, offsets + 1. Otherwise the
step is built layer by layer; the first step with a new signature always is (it makes the layers' replays), the
next one traces.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from . import compiled, dispatch, generation, switches
from .log import log_once

_TRACES = "_lily_step_traces"  # signature -> (the layers it was made with, (trace, binding) or None: given up)
_SEEN = "_lily_step_seen"  # the signature of the last step built layer by layer

# How a step's attention layers read their position, registered by the attention family (which owns it):
#   "make": cache -> the position array of a step over it; "hold": (offset, position) -> a context in which the
#   layers read ``position`` (the trace's input) for that offset instead of an array made from the host's value.
POSITION: Dict[str, Callable] = {}


def stock_call(self, inputs, cache, input_embeddings=None):
    """The text model's stock forward."""
    stock = getattr(type(self), "_lily_stock_class", type(self))
    if input_embeddings is not None:
        return stock.__call__(self, inputs, cache=cache, input_embeddings=input_embeddings)
    return stock.__call__(self, inputs, cache=cache)


def applies(self, inputs: mx.array, cache, input_embeddings) -> bool:
    """Whether this call is a one-token decode step the switch may take (checked before :func:`decode_step`)."""
    return (cache is not None and input_embeddings is None and inputs.ndim == 2 and inputs.shape[1] == 1
            and not self.training and switches.is_enabled("step_trace") and switches.is_enabled("layer_replay")
            and switches.is_enabled("compiled_layers") and compiled.enabled(dispatch.active_backend()))


def forget_step(model) -> None:
    """Drops ``model``'s step trace (``unpatch``)."""
    for module in model.modules():
        module.__dict__.pop(_TRACES, None)
        module.__dict__.pop(_SEEN, None)


# --- the caches a step trace reads and writes -------------------------------------------------------------

def _cache_states(cache) -> Optional[Tuple[List[mx.array], Tuple[int, ...], int]]:
    """(every cache's state arrays in cache order, the KV buffers' capacities, their common offset), or None
    where a cache is not one a step trace moves on: a plain ``KVCache`` with a buffer and room for the row, an
    ``ArraysCache`` without per-row lengths or padding (a batch's caches are other types)."""
    states: List[mx.array] = []
    capacities = []
    offset = None
    for c in cache:
        kind = type(c)
        if kind is KVCache:
            keys = c.keys
            if keys is None or not isinstance(c.offset, int) or c.offset >= keys.shape[2]:
                return None
            if offset is None:
                offset = c.offset
            elif c.offset != offset:
                return None
            states += (keys, c.values)
            capacities.append(keys.shape[2])
        elif kind is ArraysCache:
            if c.lengths is not None or c.left_padding is not None or any(a is None for a in c.cache):
                return None
            states += c.cache
        else:
            return None
    if offset is None:
        return None
    return states, tuple(capacities), offset


def _set_states(cache, states) -> None:
    i = 0
    for c in cache:
        if type(c) is KVCache:
            c.keys, c.values = states[i], states[i + 1]
            i += 2
        else:
            n = len(c.cache)
            c.cache[:] = states[i:i + n]
            i += n


def _moved_on(cache) -> None:
    """The host side of a replayed step: each KV cache one row further (the layers' replays do this when they run)."""
    for c in cache:
        if type(c) is KVCache:
            c.offset += 1


# --- the trace ----------------------------------------------------------------------------------------------

def _layers(self) -> tuple:
    inner = self.model
    return tuple(inner.layers)


def _model_problem(self) -> Optional[str]:
    """Why a step trace cannot hold this model's step (None: it can). Checked when one is made."""
    inner = getattr(self, "model", None)
    if inner is None or getattr(inner, "pipeline_size", 1) != 1:
        return "pipeline-parallel model"
    if getattr(self, "sharding_group", None) is not None or any(
            getattr(m, "sharding_group", None) is not None or hasattr(m, "group") for m in self.modules()):
        return "sharded model (its collectives stay out of traces)"
    if not compiled._weights_watched(self, module_lists=True):  # (the decoder layers: compared at every step)
        return ("a weight change would go unseen (switch step_trace was off when the model was patched, or arrays "
                "are held in a plain list or dict)")
    return None


class _Binding:
    """What the step's function reads while it is traced (kept out of its closure: the trace lives on, the caches
    of the request it was made in must not)."""

    cache = None
    offset = 0
    ran = False


def _make_trace(self):
    binding = _Binding()

    def step(inputs, position, *states):
        binding.ran = True
        cache = binding.cache
        _set_states(cache, states)
        with POSITION["hold"](binding.offset, position), compiled.replays_only():
            logits = stock_call(self, inputs, cache)
        return (logits, *_cache_states_after(cache))

    return mx.compile(step), binding


def _cache_states_after(cache) -> List[mx.array]:
    out: List[mx.array] = []
    for c in cache:
        out += (c.keys, c.values) if type(c) is KVCache else c.cache
    return out


# The state a trace's launches were chosen under, per generation (a switch toggled and set back moves the
# generation, not the state: the traces made before are used again).
_state_memo: list = [None, None]


def _state_key() -> tuple:
    current = generation.current()
    if _state_memo[0] != current:
        _state_memo[:] = [current, (switches.key(), dispatch.plan_key(), generation.weights_epoch())]
    return _state_memo[1]


KEPT_TRACES = 4  # step traces a model keeps (the latest signatures: KV capacities, switch states)


def decode_step(self, inputs: mx.array, cache) -> Optional[mx.array]:
    """The step through the model's step trace for this signature (made here on the second step with it), or
    None: the caller builds it layer by layer."""
    found = _cache_states(cache)
    if found is None or not POSITION:
        return None
    states, capacities, offset = found
    signature = (_state_key(), inputs.shape, inputs.dtype, capacities)
    traces = self.__dict__.setdefault(_TRACES, {})
    layers = _layers(self)
    stored = traces.get(signature)
    if stored is not None and len(stored[0]) == len(layers) and all(a is b for a, b in zip(stored[0], layers)):
        if stored[1] is None:
            return None  # (given up for this signature)
        traced, binding = stored[1]
    elif self.__dict__.get(_SEEN) != signature:
        self.__dict__[_SEEN] = signature  # this step makes the layers' replays; the next one traces them
        return None
    else:
        while len(traces) >= KEPT_TRACES:
            traces.pop(next(iter(traces)))
        reason = _model_problem(self)
        if reason is not None:
            log_once(f"step_trace:{reason}", f"step_trace: not used for this model ({reason})")
            traces[signature] = (layers, None)
            return None
        traced, binding = _make_trace(self)
        traces[signature] = (layers, (traced, binding))
    try:
        return _run(traced, binding, inputs, cache, states, offset)
    except compiled.NotReplayed as e:  # (while tracing: MLX traces again for inputs of other dtypes, too)
        log_once(f"step_trace:{e}", f"step_trace: a step could not be traced whole ({e}); building it layer by layer")
        traces[signature] = (layers, None)
        return None


def _run(traced, binding, inputs, cache, states, offset) -> mx.array:
    """One call of the step trace: the caches' new states set, their offsets moved on (by the layers themselves
    when the call traced: MLX runs the function only then). A trace given up leaves the caches as they were."""
    position = POSITION["make"](next(c for c in cache if type(c) is KVCache))
    binding.cache, binding.offset, binding.ran = cache, offset, False
    try:
        logits, *new_states = traced(inputs, position, *states)
    except compiled.NotReplayed:
        _set_states(cache, states)  # (the layers set the trace's placeholders and moved the offsets on)
        for c in cache:
            if type(c) is KVCache:
                c.offset = offset
        raise
    finally:
        binding.cache = None
    _set_states(cache, new_states)
    if not binding.ran:
        _moved_on(cache)
    return logits
