"""A decode step's graph as lily builds it on MLX's CUDA backend, on any machine (no GPU).

``with cuda_graph_only(): ...`` makes ``LILY_BACKEND=cuda`` resolve here and every lily kernel launch a
placeholder: zero outputs of the launch's shapes tied to its array inputs by ``mx.depends``, one
``Depends`` node a launch. Everything else a CUDA decode step builds is real: the path choices (traces,
layer replays, fused projections, the live-length attention), MLX's own ops, the host code around them.
So on the development CPU one can

- count a step's primitives by kind exactly as the H200's decode profile counts them (a placeholder is
  counted as the ``CustomKernel`` it stands for: :func:`count_step`);
- time the host's graph build of that step (the kernels then evaluate in no time; MLX's quantised
  matmuls and norms still compute on the CPU).

The values are meaningless (every kernel returns zeros): this checks structure and host cost, never
numerics (the simulator does those)."""

from __future__ import annotations

import contextlib
import functools
from typing import Dict, Iterator

import mlx.core as mx

from lily_mlx.core import backend as lily_backend
from lily_mlx.core import dispatch, kernel_registry

PLACEHOLDER = "Depends"  # the primitive a placeholder launch adds to the graph


@functools.lru_cache(maxsize=None)
def _zeros(shape, dtype) -> mx.array:
    z = mx.zeros(shape, dtype)
    mx.eval(z)  # a concrete array: no node of its own in the graph
    return z


class _PlaceholderKernel:
    """Called like an ``mx.fast.metal_kernel`` kernel; returns zeros of the output shapes, depending on
    every array input (so the graph keeps the launch's position and inputs)."""

    def __init__(self, name: str, output_names, **_):
        self.name, self.output_names = name, list(output_names)

    def __call__(self, *, inputs, output_shapes, output_dtypes, **_):
        outs = [_zeros(tuple(int(d) for d in shape), dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        deps = [x for x in inputs if isinstance(x, mx.array)]
        return mx.depends(outs, deps) if deps else [mx.array(o) for o in outs]


def _placeholder_factory(backend: str):
    if backend != "cuda":
        raise ValueError(f"the graph-only harness stands in for cuda, not {backend!r}")
    return _PlaceholderKernel


@contextlib.contextmanager
def cuda_graph_only(monkeypatch=None) -> Iterator[None]:
    """lily's CUDA path with placeholder kernels, for the block (pytest's ``monkeypatch`` if given)."""
    import os

    saved = (lily_backend._cuda_available, kernel_registry._factory, os.environ.get("LILY_BACKEND"))
    lily_backend._cuda_available = lambda: True
    kernel_registry._factory = _placeholder_factory
    os.environ["LILY_BACKEND"] = "cuda"
    kernel_registry.clear_cache()
    dispatch.invalidate()
    try:
        yield
    finally:
        lily_backend._cuda_available, kernel_registry._factory = saved[0], saved[1]
        if saved[2] is None:
            os.environ.pop("LILY_BACKEND", None)
        else:
            os.environ["LILY_BACKEND"] = saved[2]
        kernel_registry.clear_cache()
        dispatch.invalidate()


def count_step(outputs) -> Dict[str, int]:
    """Primitive kind -> nodes in the graph of ``outputs`` (unevaluated), a placeholder launch counted as
    the ``CustomKernel`` it stands for."""
    from bench.decode_profile import count_primitives

    counts = count_primitives(outputs)
    if PLACEHOLDER in counts:
        counts["CustomKernel"] = counts.get("CustomKernel", 0) + counts.pop(PLACEHOLDER)
    return counts
