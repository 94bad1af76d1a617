"""One patched layer of each op family, called alone at a shape class with a cache rewound between
calls: what tune checks and times (a layer, not the whole model, so every choice costs little)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

PREFILL_CHUNK = 2048  # a context is filled in chunks of MLX-LM's default prefill step
# A server's batch at a batch shape class: its rows' own contexts as fractions of the class's (left-padded to it).
BATCH_FRACTIONS = (1.0, 0.5, 0.25, 0.125)


@dataclass(frozen=True)
class ShapeClass:
    """A call shape the model sees: ``tokens`` per sequence (1: decode) after ``context`` tokens; with
    ``kv_bits`` over a KV cache quantised to that many bits (MLX-LM's ``--kv-bits``, groups of 64); with ``batch``
    a server's batch of that many rows (MLX-LM's ``BatchKVCache``, rows of ``BATCH_FRACTIONS`` of the context)."""

    name: str  # decode@4K, prefill@512, decode@16K/kv4, decode@16K/b4
    tokens: int
    context: int = 0
    kv_bits: int = 0
    batch: int = 0

    @property
    def phase(self) -> str:
        return "decode" if self.tokens == 1 else "prefill"

    def applies_to(self, family: str) -> bool:
        """Whether a layer of this op family calls differently at this class: a quantized KV cache and a batch
        cache only change the attention layers' calls (the other families would repeat the class without them: their
        kernels take a batch's rows as they take one sequence's)."""
        return not (self.kv_bits or self.batch) or family == "attention"

    @property
    def rows(self) -> int:
        return self.batch or 1


def _label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def decode(context: int, kv_bits: int = 0, batch: int = 0) -> ShapeClass:
    if batch > len(BATCH_FRACTIONS) or (batch and kv_bits):
        raise ValueError(f"a batch class of at most {len(BATCH_FRACTIONS)} rows over plain caches")
    return ShapeClass(f"decode@{_label(context)}" + (f"/kv{kv_bits}" if kv_bits else "") + (f"/b{batch}" if batch else ""),
                      1, context, kv_bits, batch)


def prefill(tokens: int) -> ShapeClass:
    return ShapeClass(f"prefill@{_label(tokens)}", tokens)


@dataclass
class LayerCase:
    """The first patched layer of one op family and how to call it."""

    family: str  # deltanet | attention | moe | linear: the ops package its forward comes from
    index: int  # decoder layer index (its cache is the model cache's entry ``index``)
    module: nn.Module
    norm: nn.Module  # the RMSNorm the decoder layer applies before it
    dtype: Any

    def inputs(self, tokens: int, seed: int, rows: int = 1) -> mx.array:
        """Random hidden states through the layer's own norm: the input scale the layer sees."""
        hidden = self.norm.weight.shape[-1]
        x = mx.random.normal((rows, tokens, hidden), key=mx.random.key(seed)).astype(self.dtype)
        return self.norm(x)  # [rows, T, hidden]

    def __call__(self, x: mx.array, cache=None) -> mx.array:
        from mlx_lm.models.base import create_attention_mask, create_ssm_mask

        if self.family in STATELESS_FAMILIES:
            return self.module(x)
        make_mask = create_attention_mask if self.family == "attention" else create_ssm_mask
        return self.module(x, make_mask(x, cache), cache)


def _family(module) -> Optional[str]:
    """The op family whose forward a patched module runs (``lily_mlx.ops.<family>.layer``)."""
    if "_lily_stock_class" not in type(module).__dict__:
        return None
    parts = getattr(type(module).__call__, "__module__", "").split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["lily_mlx", "ops"] else None


# Families whose case holds no cache: the MoE block and a dense projection are functions of their input alone.
STATELESS_FAMILIES = ("moe", "linear")


def _input_width(module) -> int:
    """The input width of a quantised linear layer (its packed weight [N, K * bits / 32])."""
    return module["weight"].shape[-1] * 32 // module.bits


def _projection_case(index: int, layer) -> Optional[LayerCase]:
    """The linear family's case in one decoder layer: its mixer's largest dense projection of the layer's normed
    input (a DeltaNet layer's in-projection at Qwen3.5/3.6, an attention layer's q/k/v projection), the work of
    lily's row GEMV in a decode step; None where the layer's projections are not lily's."""
    norm = layer.input_layernorm
    hidden = norm.weight.shape[-1]
    found = [module for name, module in layer.named_modules()
             if not name.startswith("mlp") and _family(module) == "linear" and _input_width(module) == hidden]
    if not found:
        return None
    largest = max(found, key=lambda module: module["weight"].shape[0])
    return LayerCase("linear", index, largest, norm, norm.weight.dtype)


def layer_cases(model) -> Dict[str, LayerCase]:
    """family -> the first patched layer of that family in a patched MLX-LM model (for the linear family the first
    decoder layer's largest projection of its normed input)."""
    cases: Dict[str, LayerCase] = {}
    for index, layer in enumerate(model.layers):
        for name, module in layer.children().items():
            family = _family(module)
            if family is not None and family not in cases:
                norm = layer.post_attention_layernorm if name == "mlp" else layer.input_layernorm
                cases[family] = LayerCase(family, index, module, norm, norm.weight.dtype)
        if "linear" not in cases:
            projection = _projection_case(index, layer)
            if projection is not None:
                cases["linear"] = projection
    return cases


def _batch_cache(c) -> bool:
    """Whether a KV cache is MLX-LM's batch cache: per-row offsets (an array), its rows' common end in ``_idx``."""
    return isinstance(c.offset, mx.array)


class LayerCache:
    """The layer's cache at a shape class's context, rewound to it before every call, so each timed
    call does the same work and every variant of a check starts from the same state."""

    def __init__(self, model, case: LayerCase, context: int, seed: int, kv_bits: int = 0, batch: int = 0):
        from mlx_lm.models.cache import KVCache

        if case.family in STATELESS_FAMILIES:
            self.cache = None
        elif batch:  # each row filled alone, then merged as MLX-LM's BatchGenerator merges a batch's prompts
            rows = [self._filled(model, case, max(1, int(context * f)), seed + 7919 * r)
                    for r, f in enumerate(BATCH_FRACTIONS[:batch])]
            self.cache = type(rows[0]).merge(rows)
            mx.eval(*self.arrays())
        else:
            self.cache = self._filled(model, case, context, seed)
        if kv_bits and type(self.cache) is KVCache:  # as MLX-LM's maybe_quantize_kv_cache does after the prompt
            self.cache = self.cache.to_quantized(group_size=64, bits=kv_bits)
            mx.eval(*self.arrays())
        self._saved = self._snapshot()

    @staticmethod
    def _filled(model, case: LayerCase, context: int, seed: int):
        """The layer's own cache after ``context`` tokens (in prefill chunks)."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)[case.index]
        for start in range(0, context, PREFILL_CHUNK):
            x = case.inputs(min(PREFILL_CHUNK, context - start), seed + start)
            mx.eval(case(x, cache), *[a for a in cache.state if isinstance(a, mx.array)])
        return cache

    def arrays(self) -> List[mx.array]:
        """The cache's arrays (evaluated with a call's output: a state update is part of its work)."""
        c = self.cache
        if c is None:
            return []
        if hasattr(c, "offset"):  # KVCache: keys/values written in place up to offset (quantized: 3 arrays each)
            return [a for part in (c.keys, c.values) if part is not None
                    for a in (part if isinstance(part, (tuple, list)) else (part,))]
        return [a for a in c.cache if a is not None]  # ArraysCache: conv state, recurrent state

    def state(self) -> List[mx.array]:
        """What a call leaves in the cache (for KV caches the part up to the offset)."""
        c = self.cache
        if c is not None and hasattr(c, "offset"):
            live = c._idx if _batch_cache(c) else c.offset
            return [a[..., :live, :] for a in self.arrays()]
        return self.arrays()

    def _snapshot(self):
        c = self.cache
        if c is None:
            return None
        if hasattr(c, "offset"):  # writes past offset are overwritten by the next call
            return (c.offset, c._idx) if _batch_cache(c) else c.offset
        return list(c.cache), c.lengths, c.left_padding

    def rewind(self):
        """The cache as it was after filling the context; returns it."""
        c = self.cache
        if c is None:
            return None
        if hasattr(c, "offset"):
            if _batch_cache(c):
                c.offset, c._idx = self._saved
            else:
                c.offset = self._saved
        else:
            cache, c.lengths, c.left_padding = self._saved
            c.cache = list(cache)
        return c
