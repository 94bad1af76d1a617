"""A decode-sized MoE call replayed from its recorded launches (host cost).

Every decode step calls each MoE block with the same shapes, so working out its launches (router, GEMV
gate+up, GEMV down and combine or both in one: geometry, params arrays, schedule constants) gives the same
answer token after token. ``DecodePlan`` records them once, from the general path, and a later call only
gathers each launch's inputs and launches: the activations, outputs of the earlier launches, constants
of the plan, and the weights, read from the block's modules at every call (so ``load_weights`` and
``update`` take effect). The caller keys plans by everything that shapes the launches (tokens, dtype,
backends) and uses them only in the switch state they were recorded in.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from ...core.kernel_registry import LaunchRecord

# Where a launch input comes from: ("arg", i) (the call's i-th activation array: x, then the residual
# where the combine adds it), ("out", launch, output), ("weight", key path), ("const", array).
Source = Tuple


class DecodePlan:
    """The launches of one recorded call, with the source of each of their inputs."""

    def __init__(self, block, args: Tuple[mx.array, ...], record: LaunchRecord, result: mx.array, input_names,
                 constants):
        weight_paths = {id(a): tuple(path.split(".")) for path, a in tree_flatten(block.parameters())}
        outputs = {}
        self.launches = []
        self.replayable = True
        for i, launch in enumerate(record):
            sources = []
            for name, a in zip(input_names(launch.name), launch.kwargs["inputs"]):
                arg = next((i for i, b in enumerate(args) if a is b), None)
                if arg is not None:
                    sources.append(("arg", arg))
                elif id(a) in outputs:
                    sources.append(("out",) + outputs[id(a)])
                elif id(a) in weight_paths:
                    sources.append(("weight", weight_paths[id(a)]))
                else:
                    # Anything else is kept as is, so it must be a constant of the shapes (a params
                    # array, the one-row schedule's identity), never data of this call.
                    self.replayable &= name in constants
                    sources.append(("const", a))
            outputs.update({id(o): (i, j) for j, o in enumerate(launch.outputs)})
            static = {k: v for k, v in launch.kwargs.items() if k not in ("inputs", "init_value")}
            self.launches.append((launch.launcher, tuple(sources), static))
        # The call's result must be an output of the last launch (reshaped by the caller).
        last = outputs.get(id(result))
        self.result = last[1] if last is not None and last[0] == len(record) - 1 else None

    @classmethod
    def record(cls, block, args, record: LaunchRecord, result: mx.array, input_names,
               constants) -> Optional["DecodePlan"]:
        """A plan from ``record``, or None when the call cannot be replayed from its launches alone.
        ``args``: the call's activation arrays (x [N, D], or a tuple of x and the residual);
        ``input_names(kernel)``: the kernel's input names; ``constants``: the names of inputs that may be
        kept from the recorded call (anything else must be an activation, a weight or an output)."""
        if not record or any(launch.launcher is None for launch in record):
            return None
        plan = cls(block, _as_tuple(args), record, result, input_names, constants)
        return plan if plan.replayable and plan.result is not None else None

    def __call__(self, block, args) -> mx.array:
        args = _as_tuple(args)
        outs: List[tuple] = []
        for launcher, sources, static in self.launches:
            inputs = []
            for src in sources:
                kind = src[0]
                if kind == "arg":
                    inputs.append(args[src[1]])
                elif kind == "out":
                    inputs.append(outs[src[1]][src[2]])
                elif kind == "weight":
                    node = block
                    for key in src[1]:
                        node = node[key]
                    inputs.append(node)
                else:
                    inputs.append(src[1])
            outs.append(launcher(inputs=inputs, **static))
        return outs[-1][self.result]


def _as_tuple(args) -> Tuple[mx.array, ...]:
    return tuple(args) if isinstance(args, (tuple, list)) else (args,)
