"""Operation families (deltanet, moe, attention). Each op has a reference in plain MLX ops, switches,
shape rules and one dispatch point into a kernel; they register in ``lily_mlx.core.dispatch``."""

from __future__ import annotations

from typing import Dict

from ..core.dispatch import OPS, Op, op_backend, reference_ops, register_op  # noqa: F401

FAMILIES = ("moe", "deltanet", "attention")


def load_all() -> Dict[str, Op]:
    """Import every op family so that ``OPS`` is complete."""
    import importlib

    for family in FAMILIES:
        importlib.import_module(f"{__name__}.{family}")
    return OPS
