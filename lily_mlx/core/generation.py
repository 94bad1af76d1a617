"""A count of the changes to what a call's path is chosen from: switch states and the dispatch plan.

Host-side caches of resolved choices (a decoder layer's decode step replay, ``compiled.LayerStep``)
store the count they were made at and are used only while it is unchanged, instead of asking every
switch and op backend again at every call.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_count = 0


def current() -> int:
    return _count


def bump() -> None:
    """Called by every change of a switch state or of the dispatch plan."""
    global _count
    _count += 1


# The weights a patched model's modules hold: a count of the times an array or a module was set into (or deleted
# from) one of them (lily's module classes report it, ``lily_mlx.patch``). Decode traces that hold a layer's weights
# as constants (switch ``constant_weights``) are made again after it moves; a move is also a ``bump``.
_weights = 0
_quiet = threading.local()  # .depth: lily's own writes of a module's arrays (putting back what was there)


def weights_epoch() -> int:
    return _weights


def weights_changed() -> None:
    global _weights
    if getattr(_quiet, "depth", 0):
        return
    _weights += 1
    bump()


@contextlib.contextmanager
def weights_kept() -> Iterator[None]:
    """For lily's own writes that put a module's arrays back as they were (after a trace): not a change."""
    _quiet.depth = getattr(_quiet, "depth", 0) + 1
    try:
        yield
    finally:
        _quiet.depth -= 1
