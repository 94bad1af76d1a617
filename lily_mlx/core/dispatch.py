"""The op registry and the dispatch plan: which backend each op runs on, resolved once.

Every op family registers its ops here (:func:`register_op`): name, family, the switches it reads and
the backends it has kernels for. The plan maps each op to the backend it runs on: the active backend
(``LILY_BACKEND``) where the op has a kernel for it and ``LILY_REFERENCE_OPS`` does not keep it on
its reference, else ``"reference"``. The environment is read when the plan is resolved (at
``patch()``, or on first use after :func:`invalidate`), never on the hot path: a forward's
``op_backend(name)`` is one dict lookup.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional, Tuple

from .backend import resolve_backend

REFERENCE = "reference"


@dataclass(frozen=True)
class Op:
    """One operation of a family: what it computes, the switches it reads, where it has kernels."""

    name: str
    family: str  # moe | deltanet | attention
    description: str
    switches: Tuple[str, ...] = ()
    kernel_backends: FrozenSet[str] = field(default_factory=frozenset)  # backends with a kernel


OPS: Dict[str, Op] = {}

_lock = threading.Lock()
_backend: Optional[str] = None  # the backend in force, resolved with the plan
_plan: Dict[str, str] = {}  # op name -> backend it runs on


def register_op(op: Op) -> Op:
    OPS[op.name] = op
    with _lock:
        _plan.pop(op.name, None)
    return op


def reference_ops() -> FrozenSet[str]:
    """Ops or families forced onto their reference by ``LILY_REFERENCE_OPS=deltanet,moe_routing``
    (to bisect a disagreement, or to keep one family stock while trying another)."""
    text = os.environ.get("LILY_REFERENCE_OPS", "")
    return frozenset(t.strip() for t in text.split(",") if t.strip())


def _choose(op: Op, backend: str, forced: FrozenSet[str]) -> str:
    if op.name in forced or op.family in forced:
        return REFERENCE
    return backend if backend in op.kernel_backends else REFERENCE


def resolve() -> str:
    """Read ``LILY_BACKEND`` and ``LILY_REFERENCE_OPS`` now and rebuild the plan; returns the backend."""
    global _backend
    backend = resolve_backend()
    forced = reference_ops()
    with _lock:
        _backend = backend
        _plan.clear()
        _plan.update({name: _choose(op, backend, forced) for name, op in OPS.items()})
    return backend


def invalidate() -> None:
    """Forget the plan: the next dispatch resolves it again from the environment."""
    global _backend
    with _lock:
        _backend = None
        _plan.clear()


def active_backend() -> str:
    """The backend the plan was resolved for (resolving it if needed)."""
    return _backend if _backend is not None else resolve()


def op_backend(name: str, backend: Optional[str] = None) -> str:
    """Backend op ``name`` runs on. Hot path: a lookup in the resolved plan. With an explicit
    ``backend`` (tools, tables): what the op would use there."""
    if backend is not None:
        return _choose(OPS[name], backend, reference_ops())
    chosen = _plan.get(name)
    if chosen is None or _backend is None:
        active = active_backend()
        with _lock:
            chosen = _plan.setdefault(name, _choose(OPS[name], active, reference_ops()))
    return chosen
