"""Which kernel backend the kernel tests run on.

The same tests check every execution of one Metal source: the CPU simulator by default (CI), and
``LILY_TEST_KERNEL_BACKEND=cuda`` on an NVIDIA GPU through the bridge (``metal`` on a Mac).
"""

import os
from contextlib import contextmanager

import pytest

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


@contextmanager
def attention_kernels_on(backend: str = KERNEL_BACKEND):
    """The attention kernels run on ``backend`` for the duration, also where the product does not
    enable them yet (``kernels.*_BACKENDS`` list the simulator until a GPU run of these tests passes and
    a benchmark shows the kernel wins): that GPU run is what these tests are for. No-op on the simulator."""
    from dataclasses import replace

    from lily_mlx.core import dispatch

    try:
        with pytest.MonkeyPatch.context() as mp:
            # every backend has the launchers (ops.attention.layer.KERNELS); the dispatch decides
            for op in ("attention_decode", "attention_decode_long", "attention_decode_batch", "attention_decode_quantized",
                       "attention_prefill", "attention_qk_prep"):
                spec = dispatch.OPS[op]
                if backend not in spec.kernel_backends:
                    mp.setitem(dispatch.OPS, op, replace(spec, kernel_backends=spec.kernel_backends | {backend}))
            dispatch.invalidate()
            yield
    finally:
        dispatch.invalidate()  # the plan resolved while the tables were patched is stale now


@pytest.fixture(autouse=True)
def attention_kernels_on_test_backend():
    """Autouse in the attention kernel test modules that import it: on a GPU they check kernels the
    product has not enabled there yet (``attention_kernels_on``)."""
    with attention_kernels_on():
        yield
