"""A decode step's graph as lily builds it on MLX's CUDA backend, on any machine (no GPU).

``with cuda_graph_only(): ...`` makes ``LILY_BACKEND=cuda`` resolve here and every lily kernel launch a
placeholder: zero outputs of the launch's shapes tied to its array inputs by ``mx.depends``, one
``Depends`` node a launch. Everything else a CUDA decode step builds is real: the path choices (traces,
layer replays, fused projections, the live-length attention), MLX's own ops, the host code around them.
So on the development CPU one can

- count a step's primitives by kind as the H200's decode profile counts them (a placeholder is counted as
  the ``CustomKernel`` it stands for: :func:`count_step`; MLX's fused ops that a CPU would compute from their
  parts, ``mx.fast.rms_norm`` and ``mx.dequantize``, are placeholders too, each marked in the graph by a
  primitive no decode step has, so that they are counted by their GPU names where the step keeps them);
- time the host's graph build of that step (the kernels then evaluate in no time; MLX's quantised
  matmuls and norms still compute on the CPU).

The values are meaningless (every kernel returns zeros): this checks structure and host cost, never
numerics (the simulator does those)."""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import re
import tempfile
from typing import Dict, Iterator

import mlx.core as mx

from lily_mlx.core import backend as lily_backend
from lily_mlx.core import dispatch, kernel_registry

PLACEHOLDER = "Depends"  # the primitive a placeholder launch adds to the graph
_LABEL = re.compile(r'\[label ="([A-Za-z_]+)[^"]*", shape=rectangle\]')
# MLX's fused ops that a CPU computes from their parts (a GPU runs each as one primitive): placeholders too, so
# that a step's graph has the GPU's kinds; their calls are counted by the GPU's primitive name while a
# :func:`fast_op_calls` block is open.
_fast_calls: list = []
# The marker after each fused op's placeholder (one node of a kind no decode step holds): the graph then says
# which placeholders are fused ops, including whether an op built in Python reached the step at all (an output
# nothing reads is not in the graph).
# Not elementwise, so that mx.compile keeps them (it drops a StopGradient and fuses unary ops).
FAST_OP_MARKERS = {"RMSNorm": ("Sort", lambda z: mx.sort(z, axis=-1)),
                   "Quantize": ("Partition", lambda z: mx.partition(z, 0, axis=-1))}


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


def _fast_op(kind: str):
    """A stand-in for one of MLX's fused ops: zeros of its output, one ``Depends`` node, the call counted."""

    def op(x, *args, **kwargs):
        for calls in _fast_calls:
            calls[kind] = calls.get(kind, 0) + 1
        shape, dtype = tuple(x.shape), kwargs.get("dtype") or x.dtype
        if kind == "Quantize":  # mx.dequantize(w, scales, biases, group_size, bits): [..., N * 32 / bits]
            bits = kwargs.get("bits", args[3] if len(args) > 3 else 4)
            scales = kwargs["scales"] if "scales" in kwargs else args[0]
            shape, dtype = (*shape[:-1], shape[-1] * 32 // bits), kwargs.get("dtype") or scales.dtype
        deps = [a for a in (x, *args, *kwargs.values()) if isinstance(a, mx.array)]
        return FAST_OP_MARKERS[kind][1](mx.depends([_zeros(shape, dtype)], deps)[0])

    return op


def _placeholder_factory(backend: str):
    if backend != "cuda":
        raise ValueError(f"the graph-only harness stands in for cuda, not {backend!r}")
    return _PlaceholderKernel


@contextlib.contextmanager
def cuda_graph_only() -> Iterator[None]:
    """lily's CUDA path with placeholder kernels, for the block."""
    saved = (lily_backend._cuda_available, kernel_registry._factory, os.environ.get("LILY_BACKEND"),
             mx.fast.rms_norm, mx.dequantize)
    lily_backend._cuda_available = lambda: True
    kernel_registry._factory = _placeholder_factory
    mx.fast.rms_norm, mx.dequantize = _fast_op("RMSNorm"), _fast_op("Quantize")
    os.environ["LILY_BACKEND"] = "cuda"
    kernel_registry.clear_cache()
    dispatch.invalidate()
    try:
        yield
    finally:
        lily_backend._cuda_available, kernel_registry._factory = saved[0], saved[1]
        mx.fast.rms_norm, mx.dequantize = saved[3], saved[4]
        if saved[2] is None:
            os.environ.pop("LILY_BACKEND", None)
        else:
            os.environ["LILY_BACKEND"] = saved[2]
        kernel_registry.clear_cache()
        dispatch.invalidate()


@contextlib.contextmanager
def fast_op_calls() -> Iterator[Dict[str, int]]:
    """The calls of MLX's fused ops made in the block, by the GPU's primitive name (``RMSNorm``, ``Quantize``:
    what a step built op by op holds; a replayed trace calls no Python)."""
    calls: Dict[str, int] = {}
    _fast_calls.append(calls)
    try:
        yield calls
    finally:  # by identity: two open blocks' counts may be equal dicts
        for i, c in enumerate(_fast_calls):
            if c is calls:
                del _fast_calls[i]
                break


def count_primitives(outputs) -> Dict[str, int]:
    """Primitive name -> number of nodes in the graph that computes ``outputs`` (nothing evaluated)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "step.dot")
        mx.export_to_dot(path, outputs)
        text = open(path).read()
    return dict(collections.Counter(_LABEL.findall(text)))


def count_step(outputs) -> Dict[str, int]:
    """Primitive kind -> nodes in the graph of ``outputs`` (unevaluated), as the GPU's graph counts them: a fused
    op's placeholder and its marker count as that op (``RMSNorm``, ``Quantize``), every other placeholder as the
    ``CustomKernel`` launch it stands for."""
    counts = count_primitives(outputs)
    placeholders = counts.pop(PLACEHOLDER, 0)
    for kind, (marker, _) in FAST_OP_MARKERS.items():
        n = counts.pop(marker, 0)
        if n:
            counts[kind] = counts.get(kind, 0) + n
            placeholders -= n
    if placeholders:
        counts["CustomKernel"] = counts.get("CustomKernel", 0) + placeholders
    return counts
