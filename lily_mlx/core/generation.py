"""A count of the changes to what a call's path is chosen from: switch states and the dispatch plan.

Host-side caches of resolved choices (a decoder layer's decode step replay, ``compiled.LayerStep``)
store the count they were made at and are used only while it is unchanged, instead of asking every
switch and op backend again at every call.
"""

from __future__ import annotations

_count = 0


def current() -> int:
    return _count


def bump() -> None:
    """Called by every change of a switch state or of the dispatch plan."""
    global _count
    _count += 1
