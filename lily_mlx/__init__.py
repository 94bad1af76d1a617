"""lily-mlx: Qwen3.5/3.6-specific kernels swapped into MLX-LM's own model.

    import lily_mlx
    model, tokenizer = lily_mlx.load("mlx-community/Qwen3.6-35B-A3B-4bit")

``lily_mlx.patch(model)`` / ``lily_mlx.unpatch(model)`` switch an already loaded MLX-LM model between
lily-mlx and stock on the same weights. Switches: ``lily_mlx.switches``.
"""

__version__ = "0.1.0"

from .core import switches  # noqa: E402,F401
from .core.backend import resolve_backend  # noqa: E402,F401

_LAZY = {
    "load": ("lily_mlx.patch", "load"),
    "patch": ("lily_mlx.patch", "patch"),
    "unpatch": ("lily_mlx.patch", "unpatch"),
    "is_patched": ("lily_mlx.patch", "is_patched"),
    "patch_report": ("lily_mlx.patch", "patch_report"),
    "SUPPORTED_MODEL_TYPES": ("lily_mlx.patch", "SUPPORTED_MODEL_TYPES"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'lily_mlx' has no attribute {name!r}")
