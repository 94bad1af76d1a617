"""Operation families (deltanet, moe, attention, linear), one package each: ``lily_mlx.ops.<family>``
registers the family's ops in ``lily_mlx.core.dispatch`` when imported and gives its layer forwards;
its modules are ``layer`` (forwards, dispatch), ``kernels`` (kernel launchers, shape rules) and
``reference`` (plain-MLX references). Each op has a reference, switches, shape rules and one
dispatch point into a kernel."""

from __future__ import annotations

from typing import Dict

from ..core.dispatch import OPS, Op, op_backend, reference_ops, register_op  # noqa: F401

FAMILIES = ("moe", "deltanet", "attention", "linear")


def load_all() -> Dict[str, Op]:
    """Import every op family so that ``OPS`` is complete."""
    import importlib

    for family in FAMILIES:
        importlib.import_module(f"{__name__}.{family}")
    return OPS
