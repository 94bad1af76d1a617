"""Operation families. Each op has a reference in plain MLX ops, switches, shape rules and one
dispatch point into a kernel; ``OPS`` records them so tools can say which backend each op uses."""

from __future__ import annotations

import os

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Tuple

from ..backend import resolve_backend


@dataclass(frozen=True)
class Op:
    name: str
    family: str  # moe | deltanet | attention
    description: str
    switches: Tuple[str, ...] = ()
    kernel_backends: FrozenSet[str] = field(default_factory=frozenset)  # backends with a kernel


OPS: Dict[str, Op] = {}


def register_op(op: Op) -> Op:
    OPS[op.name] = op
    return op


def reference_ops() -> FrozenSet[str]:
    """Ops or families forced onto their reference by ``LILY_REFERENCE_OPS=deltanet,moe_routing``
    (to bisect a disagreement, or to keep one family stock while trying another)."""
    text = os.environ.get("LILY_REFERENCE_OPS", "")
    return frozenset(t.strip() for t in text.split(",") if t.strip())


def op_backend(name: str, backend: str | None = None) -> str:
    """Backend ``name`` runs on: the active backend if the op has a kernel for it, else reference."""
    backend = backend or resolve_backend()
    op = OPS[name]
    forced = reference_ops()
    if op.name in forced or op.family in forced:
        return "reference"
    return backend if backend in op.kernel_backends else "reference"


def load_all() -> Dict[str, Op]:
    """Import every op module so that ``OPS`` is complete."""
    import importlib

    for mod in ("moe", "deltanet", "attention"):
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:  # a family not written yet
            if e.name != f"{__name__}.{mod}":
                raise
    return OPS
