"""Bounded host lookahead in prefill (switch ``bounded_lookahead``).

MLX builds a prompt chunk's graph for all layers and evaluates it at the end of the chunk: the host
then encodes layer after layer far ahead of the GPU, and the buffers a layer releases stay allocated
until the GPU has run that layer, so a chunk's per-layer transients add up. Measured on the H200 at a
64K prompt (docs/results/2026-12-01-h200x2-prefill-memory): lily peaked at 42.1 GB, 25.7 GB with a wait
after every layer (the fair baseline: 39.2 and 26.9 GB).

Here each prefill layer's output is submitted as soon as it is built (``mx.async_eval``) and the host
waits for the layer ``DEPTH`` layers back before building the next: the GPU keeps the next layers
queued while at most about ``DEPTH`` + 1 layers' transients are alive. Evaluation order and arithmetic
are unchanged (the same graph, evaluated in pieces), so results are bitwise the same.
"""

from __future__ import annotations

import collections
import threading

import mlx.core as mx

from . import switches
from .log import log_once

DEPTH = 2  # layers the host may run ahead of the GPU in a prefill chunk
# Chunks of fewer tokens (B x T) run as before: their transients are small, and waits would only slow
# short multi-token calls such as a speculative-decoding verify step.
MIN_TOKENS = 256

_local = threading.local()  # a server's generation thread and the caller's keep separate queues


def _pending() -> collections.deque:
    pending = getattr(_local, "pending", None)
    if pending is None:
        pending = _local.pending = collections.deque()
    return pending


def after_prefill_layer(y: mx.array) -> None:
    """Called with a layer's output ``y`` [B, T, D]; bounds the host's lookahead in prefill chunks of at
    least ``MIN_TOKENS`` tokens."""
    if y.ndim != 3 or y.shape[1] <= 1 or y.shape[0] * y.shape[1] < MIN_TOKENS:
        return
    if not switches.is_enabled("bounded_lookahead"):
        return
    try:
        mx.async_eval(y)
    except ValueError as e:  # inside mx.compile / vmap: the caller evaluates the whole graph itself
        log_once("lookahead-in-transform", f"bounded_lookahead: not applied inside a function transformation ({e})")
        return
    pending = _pending()
    pending.append(y)
    while len(pending) > DEPTH:
        mx.eval(pending.popleft())  # waits for the GPU to finish that layer


def clear() -> None:
    """Drop this thread's queued layer outputs (their memory is released once evaluated)."""
    _pending().clear()
