"""Which kernel backend the kernel tests run on.

The same tests check every execution of one Metal source: the CPU simulator by default (CI), and
``LILY_TEST_KERNEL_BACKEND=cuda`` on an NVIDIA GPU through the bridge (``metal`` on a Mac).
"""

import os

from lily_mlx.core.backend import resolve_backend

KERNEL_BACKEND = os.environ.get("LILY_TEST_KERNEL_BACKEND", "sim")


def kernel_backend_problem() -> str | None:
    """Why KERNEL_BACKEND cannot run kernels in this process (None if it can)."""
    if KERNEL_BACKEND == "sim":
        return None  # the simulator's own availability is checked by each test module
    try:
        resolve_backend(KERNEL_BACKEND)
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None
