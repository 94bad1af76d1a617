"""Which execution backend lily-mlx kernels use: ``LILY_BACKEND=auto|metal|cuda|sim|reference``.

- ``metal``: ``mx.fast.metal_kernel`` on an Apple GPU (the product).
- ``cuda``: the same Metal text through the Metal->CUDA bridge on MLX's CUDA backend.
- ``sim``: the CPU simulator (tests; never chosen automatically).
- ``reference``: plain MLX ops, identical to stock MLX-LM.
``auto`` picks metal, then cuda, then reference, by what this machine has.
"""

from __future__ import annotations

import os

import mlx.core as mx

BACKENDS = ("metal", "cuda", "sim", "reference")
CHOICES = ("auto",) + BACKENDS


def _metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


def _cuda_available() -> bool:
    try:
        return bool(mx.cuda.is_available())
    except Exception:
        return False


def auto_backend() -> str:
    if _metal_available():
        return "metal"
    if _cuda_available():
        return "cuda"
    return "reference"


def resolve_backend(requested: str | None = None) -> str:
    """The backend in force: ``requested``, else ``LILY_BACKEND``, else automatic."""
    choice = (requested or os.environ.get("LILY_BACKEND") or "auto").strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"LILY_BACKEND={choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "auto":
        return auto_backend()
    if choice == "metal" and not _metal_available():
        raise RuntimeError("LILY_BACKEND=metal but no Metal GPU is available on this machine")
    if choice == "cuda" and not _cuda_available():
        raise RuntimeError("LILY_BACKEND=cuda but MLX's CUDA backend is not available here")
    return choice
