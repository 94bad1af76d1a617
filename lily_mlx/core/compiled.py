"""Decode pieces traced once with ``mx.compile`` and replayed (switch ``compiled_decode``).

A decode step calls every MoE block and DeltaNet mixer with the same shapes, token after token, and
building their kernel launches in Python costs more host time than the GPU spends on them (a launch
through ``mx.fast.metal_kernel``/``cuda_kernel`` assembles its source string at every call). Traced once
per shape, a later call replays the recorded graph in C++: the same primitives, kernels and inputs,
no Python per launch. The owner module is the trace's implicit input (``inputs=owner``), so its
current weights are read at every call (``load_weights``/``update`` take effect).

Only Metal and CUDA kernels are MLX primitives that a trace can hold; the simulator computes eagerly
on the host when called, so there the pieces run uncompiled. A piece whose trace fails runs
uncompiled from then on, with a one-time log line.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import generation, switches
from .log import log_once

COMPILE_BACKENDS = frozenset({"metal", "cuda"})

_FAILED = object()

# Decode steps of whole decoder layers (switch compiled_layers), per patched mixer forward, registered by
# the mixer's op family (families do not import each other; the decoder layer finds its mixer's entry):
#   LAYER_TRACES[forward](mixer, x, mask, cache, *, owner, key, pre, post, pre_args, post_args, replayable)
#       -> a LayerStep (its replay made only if ``replayable``) or None
# computes post(x, mixer(pre(x))) for a one-token step with the shape-stable parts traced, ``owner``'s
# weights (the decoder layer's) the traces' implicit inputs; ``key`` holds what pre/post depend on.
LAYER_TRACES: Dict[Callable, Callable] = {}


@dataclass(frozen=True)
class LayerStep:
    """A decoder layer's decode step through its traces. ``out``: the step's output (an array, or a tuple
    when ``post`` returns one). ``replay(x, mask, cache, pre_args, post_args)``: the same step for a later
    call with every path choice of this one already made: the trace objects called directly, their inputs
    gathered from the call, the cache updated as here; it returns None (having done nothing) where the
    call's cache or the mixer's weights no longer fit, and the caller builds the step again. The caller
    uses a replay only while nothing it chose from has changed (``generation``, shapes, cache type)."""

    out: Any
    replay: Optional[Callable] = None


_local = threading.local()  # .inline, .replays_only: depths of inline() and replays_only() on this thread


@contextlib.contextmanager
def _deeper(name: str):
    setattr(_local, name, getattr(_local, name, 0) + 1)
    try:
        yield
    finally:
        setattr(_local, name, getattr(_local, name) - 1)


def inline():
    """While a larger piece is traced (a whole decoder layer): the pieces it calls run their functions
    directly, as part of that trace, instead of tracing (or recording) themselves."""
    return _deeper("inline")


def inlining() -> bool:
    """Whether the caller runs inside :func:`inline` (so must not keep host-side state built from the
    trace's placeholder arrays, such as a recorded launch plan)."""
    return getattr(_local, "inline", 0) > 0


class NotReplayed(Exception):
    """Raised inside a whole step's trace (:func:`replays_only`) by a decoder layer that cannot replay a
    shape-stable step: the step trace is given up and the step built layer by layer."""


def replays_only():
    """While a whole decode step is traced (switch ``step_trace``): every decoder layer must replay a stored
    step whose inputs are all arrays (``shape_stable``), else it raises :class:`NotReplayed` before doing
    anything (a trace must not bake a host value, such as a cache length, into the step)."""
    return _deeper("replays_only")


def replaying_only() -> bool:
    return getattr(_local, "replays_only", 0) > 0


def shape_stable(replay: Callable) -> Callable:
    """Marks a ``LayerStep`` replay whose step depends on no host value but its cache's shapes: a whole step's
    trace may hold it (:func:`replays_only`)."""
    replay.shape_stable = True
    return replay


def enabled(*backends: str) -> bool:
    """Whether a piece whose kernels run on ``backends`` is compiled (switch on, every backend traceable)."""
    return switches.is_enabled("compiled_decode") and all(b in COMPILE_BACKENDS for b in backends)


def stock_type(module) -> type:
    """The class whose code ``module`` runs: a lily class that only reports weight changes (given to the stock
    modules of a patched layer's tree) stands for its stock class."""
    cls = type(module)
    return cls.__dict__["_lily_stock_class"] if cls.__dict__.get("_lily_watch_only") else cls


def holds_no_arrays(module) -> bool:
    """A leaf module without arrays (MLX-LM's ``SwiGLU``): no weights to watch, and it may be shared by every model
    of the process, so patching leaves its class alone (its parent sees it replaced)."""
    return not module.children() and not module.parameters()


def _weights_watched(owner, module_lists: bool = False) -> bool:
    """Whether every array ``owner``'s traces may read is held where a change is seen (``generation.weights_epoch``):
    each module of its tree is of a class that reports what is set into it (``lily_mlx.patch``), and none holds
    arrays in a plain list, tuple or dict, whose items can change unseen. ``module_lists``: lists of modules are
    allowed (the caller checks their items by identity, as a step trace does a model's decoder layers)."""
    for module in owner.modules():
        if not getattr(type(module), "_lily_reports_weights", False) and not holds_no_arrays(module):
            return False
        for value in module.values():
            if module_lists and isinstance(value, list) and all(isinstance(v, nn.Module) for v in value):
                continue
            if isinstance(value, (list, tuple)) or (isinstance(value, dict) and not isinstance(value, nn.Module)):
                return False
    return True


def _constant_weights(owner) -> bool:
    """Whether ``owner``'s traces hold its weights as constants (switch ``constant_weights``, or ``step_trace``, whose
    trace of a whole step holds them so: a layer trace taking its owner's weights as inputs would swap them out and
    back as new array objects while the step is traced; once per owner and weights epoch)."""
    if not (switches.is_enabled("constant_weights") or switches.is_enabled("step_trace")):
        return False
    cached = owner.__dict__.get("_lily_constant_weights")
    epoch = generation.weights_epoch()
    if cached is None or cached[0] != epoch:
        cached = owner.__dict__["_lily_constant_weights"] = (epoch, _weights_watched(owner))
    return cached[1]


def _traces(owner) -> Dict:
    """``owner``'s traces, dropped when the weights epoch has moved since they were made (a trace may hold the
    weights it was made with as constants)."""
    epoch = generation.weights_epoch()
    if owner.__dict__.get("_lily_compiled_epoch") != epoch:
        owner.__dict__["_lily_compiled"] = {}
        owner.__dict__.pop("_lily_compiled_slots", None)
        owner.__dict__["_lily_compiled_epoch"] = epoch
    return owner.__dict__["_lily_compiled"]


def call(owner, key: Hashable, fn: Callable, args: Sequence[mx.array], slot: Optional[Hashable] = None):
    """``fn(*args)`` through a trace cached on ``owner`` per ``key``, or None when it cannot be traced
    (the caller then runs ``fn`` itself). ``key`` must hold everything besides the args' shapes and
    dtypes that changes what ``fn`` builds (switch states, backends, weight shapes). ``slot``: the traces
    of one slot replace each other (a KV buffer's capacity grows: the last capacity's trace is dropped).
    Inside :func:`inline`, ``fn(*args)`` itself (traced as part of the larger piece).

    The owner's weights are the trace's implicit inputs (read at every call), or with switch
    ``constant_weights`` and an owner whose weight changes are seen (a patched decoder layer) constants of it,
    the traces made again after any change."""
    if inlining():
        return fn(*args)
    traces = _traces(owner)
    traced = traces.get(key)
    if traced is _FAILED:
        return None
    if traced is None and slot is not None:
        slots = owner.__dict__.setdefault("_lily_compiled_slots", {})
        if slots.get(slot, key) != key:
            traces.pop(slots[slot], None)
        slots[slot] = key
    if traced is None:
        constants = _constant_weights(owner)
        traced = mx.compile(fn) if constants else mx.compile(fn, inputs=owner)
        saved = tree_flatten(owner.parameters())
        with generation.weights_kept():  # (tracing with inputs swaps placeholders in and back: no change)
            try:
                out = traced(*args)
            except Exception as e:  # an op that cannot be traced: run this piece eagerly from now on
                owner.update(tree_unflatten(saved))  # the trace swaps placeholders in; put the weights back
                traces[key] = _FAILED
                log_once(f"compiled:{type(owner).__name__}:{type(e).__name__}",
                         f"compiled_decode: {type(owner).__name__} cannot be traced ({type(e).__name__}: {e}); "
                         "running it uncompiled")
                return None
            # MLX puts the weights back after tracing as new array objects; the owner keeps its own (identity
            # tells a module's arrays from replaced ones: the fused projections would be prepared again).
            if not constants:
                owner.update(tree_unflatten(saved))
        traces[key] = traced
        return out
    return traced(*args)


def lookup(owner, key: Hashable):
    """The trace :func:`call` keeps for ``owner`` and ``key`` (None: none yet, or it could not trace)."""
    traced = _traces(owner).get(key)
    return None if traced is _FAILED else traced
