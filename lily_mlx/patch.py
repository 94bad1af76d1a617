"""Swap lily-mlx forwards into an MLX-LM Qwen3.5/3.6-family model, per instance, and back.

``patch(model)`` changes the ``__class__`` of each DeltaNet, attention, sparse-MoE, decoder-layer, text-model and
quantised linear module of the model to a lily subclass of the stock class whose ``__call__`` is the op forward of
``lily_mlx.ops`` (see docs/design.md). Nothing else changes: submodules, caches and cache formats stay
stock's, and so do the weights' names, shapes and values (a layer's input projections become views of
one concatenated weight, ``lily_mlx.core.projections``: the same values in the same memory footprint), so

- MLX-LM's by-name imports do not matter (no module-level name is replaced),
- ``model.shard()`` works before or after patching (the forwards read head and expert counts, and the
  sharding group, from the instance at call time),
- prompt caches made, saved or loaded by either engine work in the other,
- ``unpatch(model)`` restores the stock classes on the same weights, so both engines can alternate in
  one process.

Generation-level switch ``chunked_prefill``: MLX-LM chunks the prompt itself (``prefill_step_size``,
default 2048) before the model sees it, so the switch cannot live inside the model. It lives where the
step size is chosen: :func:`prefill_step_size` maps MLX-LM's step size to the one the switch state asks
for; the ``--lily`` CLI hooks apply it to ``--prefill-step-size``, and Python callers pass
``prefill_step_size=lily_mlx.patch.prefill_step_size()`` to ``mlx_lm.generate``/``stream_generate``.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .core import environment, generation, switches
from .core.compiled import holds_no_arrays
from .core.log import log_once, warn_caller

# MLX-LM architecture modules (``mlx_lm.models.<name>``) whose layers lily-mlx can drive. MLX-LM
# resolves config aliases (``MODEL_REMAPPING``) to these modules before building the model, and patch()
# recognises a model by its architecture module, so an alias of one of them is supported too.
SUPPORTED_MODEL_TYPES: Tuple[str, ...] = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

# Versions this layer was tested against (pyproject.toml pins the same ranges).
TESTED_VERSIONS: Dict[str, Tuple[str, str]] = {
    "mlx": ("0.32.4", "0.33"),
    "mlx-lm": ("0.32.2", "0.33"),
}
ALLOW_UNTESTED_ENV = "LILY_ALLOW_UNTESTED"

# Stock class (module, name) -> (op module, forward name). The forward replaces the class's __call__.
_QWEN3_NEXT = "mlx_lm.models.qwen3_next"
_QWEN3_5 = "mlx_lm.models.qwen3_5"
_QUANTIZED_LINEAR = (("mlx.nn.layers.quantized", "QuantizedLinear"), ("linear", "quantized_linear_forward"))
_TARGETS: Dict[str, List[Tuple[Tuple[str, str], Tuple[str, str]]]] = {
    "qwen3_next": [
        ((_QWEN3_NEXT, "Qwen3NextGatedDeltaNet"), ("deltanet", "qwen3_next_deltanet_forward")),
        ((_QWEN3_NEXT, "Qwen3NextAttention"), ("attention", "attention_forward")),
        ((_QWEN3_NEXT, "Qwen3NextSparseMoeBlock"), ("moe", "sparse_moe_forward")),
        ((_QWEN3_NEXT, "Qwen3NextDecoderLayer"), ("moe", "decoder_layer_forward")),
        ((_QWEN3_NEXT, "Model"), ("moe", "text_model_forward")),
        _QUANTIZED_LINEAR,
    ],
    "qwen3_5": [
        ((_QWEN3_5, "GatedDeltaNet"), ("deltanet", "qwen3_5_deltanet_forward")),
        ((_QWEN3_NEXT, "Qwen3NextAttention"), ("attention", "attention_forward")),
        ((_QWEN3_NEXT, "Qwen3NextSparseMoeBlock"), ("moe", "sparse_moe_forward")),
        ((_QWEN3_5, "DecoderLayer"), ("moe", "decoder_layer_forward")),
        ((_QWEN3_5, "TextModel"), ("moe", "text_model_forward")),
        _QUANTIZED_LINEAR,
    ],
}
_TARGETS["qwen3_5_moe"] = _TARGETS["qwen3_5"]  # same layer classes; MoE vs dense MLP per config

# (stock class, forward or None, reports weight changes, watch only) -> lily subclass; one per key for the process.
_LILY_CLASSES: Dict[Tuple[type, object, bool, bool], type] = {}

# "Whole prompt in one chunk": larger than any prompt; MLX-LM takes min(step, remaining).
UNCHUNKED_PREFILL_STEP = sys.maxsize
DEFAULT_PREFILL_STEP_SIZE = 2048  # MLX-LM's default


# --------------------------------------------------------------------------------------------------
# Version gate
# --------------------------------------------------------------------------------------------------


def _version_tuple(text: str) -> Tuple[int, ...]:
    try:
        from packaging.version import Version

        return Version(text).release
    except Exception:  # packaging missing or a non-PEP 440 string: leading numbers only
        parts = []
        for piece in text.split("."):
            digits = "".join(ch for ch in piece if ch.isdigit())
            if not digits:
                break
            parts.append(int(digits))
        return tuple(parts)


def installed_versions() -> Dict[str, str]:
    import mlx.core as mx
    import mlx_lm

    return {"mlx": mx.__version__, "mlx-lm": mlx_lm.__version__}


def untested_versions() -> List[str]:
    """``name found (tested >=lo,<hi)`` for each installed package outside its tested range."""
    out = []
    for name, found in installed_versions().items():
        lo, hi = TESTED_VERSIONS[name]
        v = _version_tuple(found)
        if not (_version_tuple(lo) <= v < _version_tuple(hi)):
            out.append(f"{name} {found} (tested >={lo},<{hi})")
    return out


def check_versions() -> None:
    """Refuse to patch under untested MLX / MLX-LM versions unless ``LILY_ALLOW_UNTESTED=1``.

    MLX-LM's layer internals change between releases; a forward written for one release could
    silently compute something else on another, so the default is a clear refusal.
    """
    bad = untested_versions()
    if not bad:
        return
    found = "; ".join(bad)
    if os.environ.get(ALLOW_UNTESTED_ENV, "") == "1":
        log_once(
            "untested-versions",
            f"untested versions ({found}); patching anyway because "
            f"{ALLOW_UNTESTED_ENV}=1. Check results with `python -m lily_mlx consistency`.",
            level=logging.WARNING,
        )
        return
    raise RuntimeError(
        f"lily-mlx has not been tested with {found}. MLX-LM's model internals change between "
        "releases, so patching could compute something other than stock. Install the tested "
        "versions (pip install 'mlx>=0.32.4,<0.33' 'mlx-lm>=0.32.2,<0.33'), or set "
        f"{ALLOW_UNTESTED_ENV}=1 to patch anyway and check the result with "
        "`python -m lily_mlx consistency`."
    )


# --------------------------------------------------------------------------------------------------
# Model type and op lookup
# --------------------------------------------------------------------------------------------------


def _architecture_of(cls: type) -> str:
    """The MLX-LM architecture module (``mlx_lm.models.<name>``) a model class comes from."""
    return cls.__module__.rsplit(".", 1)[-1]


def model_architecture(model) -> str:
    """The MLX-LM architecture module a model was built from (``qwen3_5_moe`` for Qwen3.6; a patched model's too)."""
    return _architecture_of(type(model).__dict__.get("_lily_stock_class") or type(model))


def _described(declared, arch: str) -> str:
    """A model type as messages name it: ``'qwen3'``, or ``'mistral' (architecture 'llama')`` where MLX-LM builds the
    declared ``model_type`` from another architecture module."""
    return f"{declared!r} (architecture {arch!r})" if isinstance(declared, str) and declared != arch else repr(arch)


def _describe(model) -> str:
    return _described(getattr(model, "model_type", None), model_architecture(model))


def _unsupported_message(declared, arch: str) -> str:
    """Why ``patch()`` refuses a model of MLX-LM architecture ``arch`` (its config's ``model_type``: ``declared``)."""
    return (f"lily-mlx does not support model type {_described(declared, arch)}; "
            f"supported MLX-LM model types: {', '.join(SUPPORTED_MODEL_TYPES)}")


def config_architecture(model_path: str) -> Optional[Tuple[str, str]]:
    """(declared model type, MLX-LM architecture) from the ``config.json`` of a model folder, or of a Hugging Face repo
    already in the local cache (no download); None where there is none to read."""
    import json
    from pathlib import Path

    config = Path(model_path).expanduser() / "config.json"
    if not config.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(repo_id=str(model_path), filename="config.json")
        except Exception:  # not a repo id, or no hub library: the loader will say what is wrong
            return None
        if not isinstance(cached, str):
            return None
        config = Path(cached)
    try:
        values = json.loads(config.read_text())
        declared = values.get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(declared, str):
        return None
    try:  # the module MLX-LM builds it from (its model-type and architecture remappings)
        from mlx_lm.utils import _get_classes

        model_cls, _ = _get_classes(values)
    except Exception:  # a type MLX-LM does not know, or another MLX-LM: its loader says what is wrong
        return None
    return declared, _architecture_of(model_cls)


def unsupported_model_message(model_path: str) -> Optional[str]:
    """Why ``patch()`` would refuse the model at ``model_path``, read from its config before loading it (None when
    it is supported or its config cannot be read here)."""
    found = config_architecture(model_path)
    if found is None or found[1] in SUPPORTED_MODEL_TYPES:
        return None
    return _unsupported_message(*found)


def _op_forward(module_name: str, func_name: str) -> Optional[Callable]:
    """The op forward, or None when its module or function does not exist (yet)."""
    full = f"lily_mlx.ops.{module_name}"
    try:
        mod = importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name != full:  # the op module exists but one of its imports is missing: a real error
            raise
        mod = None
    forward = getattr(mod, func_name, None) if mod is not None else None
    if forward is None:
        log_once(
            f"missing-op:{full}.{func_name}",
            f"{full}.{func_name} is not available; those layers keep stock MLX-LM's code.",
        )
    return forward


def adapter_modules(tree, prefix: str = "") -> List[str]:
    """Names of the modules in ``tree`` (a module, or a dict / list of them as ``update_modules`` takes) that carry
    LoRA / DoRA adapters (MLX-LM's tuner layers: ``LoRALinear``, ``LoRASwitchLinear``, ``DoRALinear``,
    ``LoRAEmbedding``, each with a ``lora_a`` array)."""
    import mlx.nn as nn

    if isinstance(tree, nn.Module):
        return [f"{prefix}.{name}".strip(".") if name else prefix for name, m in tree.named_modules()
                if "lora_a" in m]
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return []
    return [path for key, value in items for path in adapter_modules(value, f"{prefix}.{key}".strip("."))]


def _shown(paths: List[str]) -> str:
    return ", ".join(paths[:2]) + (f" and {len(paths) - 2} more" if len(paths) > 2 else "")


def _adapters_message(paths: List[str]) -> str:
    shown = _shown(paths)
    return (f"LoRA / DoRA adapters on {len(paths)} module(s) ({shown}): lily-mlx's kernels read each layer's base "
            f"weights and would leave the adapters out. Fuse them into the weights first (`mlx_lm.fuse --model M "
            f"--adapter-path A --save-path F`, then load F), or run this model stock")


def _refuse_adapters(module, key: str, value) -> None:
    paths = adapter_modules(value, key)
    if paths:
        raise ValueError(f"LoRA / DoRA adapters set into a model patched by lily-mlx ({_shown(paths)}, in a "
                         f"{type(module).__name__}): its kernels read each layer's base weights and would leave "
                         f"them out. Call lily_mlx.unpatch(model) before adding adapters; to run them with lily-mlx, "
                         f"fuse them into the weights (`mlx_lm.fuse`) and patch the fused model")


# What a lily module keeps in its __dict__ besides stock's attributes that a copy (copy.deepcopy, pickle) keeps too:
# the decoder layers' links and the patch report. The rest are caches of this process (decode plans, traces, the
# fused projections' records, reasons keyed by dtype), rebuilt by the copy on its first calls.
_COPIED_STATE = ("_lily_successor", "_lily_report")


class _RefusesAdapters:
    """Base of every lily module class: an adapter module (LoRA / DoRA) set into a patched module, directly or by
    ``update_modules`` (what MLX-LM's ``linear_to_lora_layers`` and ``load_adapters`` call on each decoder layer), is
    an error before anything changes; the kernels would compute the layer without it. A copy (``copy.deepcopy``,
    ``pickle``) leaves the module's caches behind (``_COPIED_STATE``) and names its class by what it is made from
    (``_lily_module``), so that a pickle loads in another process."""

    def __getstate__(self):
        return {k: v for k, v in vars(self).items() if not k.startswith("_lily_") or k in _COPIED_STATE}

    def __reduce_ex__(self, protocol):
        # A dict subclass's reduction, (copyreg.__newobj__, (cls,), state, listitems, dictitems), with the class
        # made again from its stock class, forward and kind where it is loaded: lily classes are made by patch(),
        # so a fresh process has none to find by name.
        reduced = super().__reduce_ex__(max(protocol, 2))  # (protocols 0 and 1 would leave the items out)
        cls = type(self)
        made_from = (cls._lily_stock_class, cls.__dict__.get("__call__"), issubclass(cls, _ReportsWeights),
                     cls._lily_watch_only)
        return (_lily_module, made_from) + tuple(reduced[2:])

    def __setitem__(self, key, value):
        _refuse_adapters(self, str(key), value)
        super().__setitem__(key, value)

    def update_modules(self, modules, strict: bool = True):
        _refuse_adapters(self, "", modules)
        return super().update_modules(modules, strict)


class _ReportsWeights:
    """Base of the lily module classes of a model patched with switch ``constant_weights`` on: an array or a module
    set into the module, or an item removed from it, is a change of the model's weights
    (``generation.weights_changed``), after which the decode traces, which hold the weights as constants, are made
    again. A module set in reports its own changes from then on. MLX's ``load_weights``, ``update``,
    ``update_modules`` and attribute assignment all set items."""

    _lily_reports_weights = True

    def __setitem__(self, key, value):
        import mlx.nn as nn

        super().__setitem__(key, value)
        if isinstance(value, nn.Module):
            _report_weights(value)
        generation.weights_changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        generation.weights_changed()

    def pop(self, key, *default):  # (nn.Module.__setattr__ pops an item a non-array value replaces)
        present = key in self
        value = super().pop(key, *default)
        if present:
            generation.weights_changed()
        return value


def _lily_class(stock_cls: type, forward: Optional[Callable], reports: bool = False,
                watch_only: bool = False) -> type:
    """The lily class of ``stock_cls``: a subclass whose call is ``forward`` (stock's where None); with ``reports``
    one that also reports its weight changes (``_ReportsWeights``); ``watch_only``: one that does nothing else but
    refuse adapters (and report, with ``reports``): stock's code in a patched model's tree, not counted as patched.
    Every lily class refuses adapters (``_RefusesAdapters``)."""
    key = (stock_cls, forward, reports, watch_only)
    cls = _LILY_CLASSES.get(key)
    if cls is None:
        attrs = {
            "__module__": __name__,
            "__doc__": f"lily-mlx version of {stock_cls.__module__}.{stock_cls.__qualname__}.",
            "_lily_stock_class": stock_cls,
            "_lily_watch_only": watch_only,
        }
        name = f"Lily{stock_cls.__name__}"
        if forward is not None:
            attrs["__call__"] = forward
        elif not watch_only:
            name += "StockCall"
        name += ("Watched" if reports else "Guarded") if watch_only else "Reporting" if reports else ""
        attrs["__qualname__"] = name
        cls = type(name, (_RefusesAdapters, _ReportsWeights, stock_cls) if reports else (_RefusesAdapters, stock_cls),
                   attrs)
        cls = _LILY_CLASSES.setdefault(key, cls)  # one class a key when threads make it at once (unpickling)
    return cls


def _lily_module(stock_cls: type, forward: Optional[Callable], reports: bool, watch_only: bool):
    """An empty module of the lily class made from these (``_RefusesAdapters.__reduce_ex__``; the copy's items and
    attributes are set into it next)."""
    cls = _lily_class(stock_cls, forward, reports, watch_only)
    return cls.__new__(cls)


def _report_weights(module) -> None:
    """Every module of ``module``'s tree reports its weight changes: its lily class, or stock's own code under a
    lily class that only reports (``_lily_watch_only``: not counted as patched)."""
    for m in module.modules():
        cls = type(m)
        if getattr(cls, "_lily_reports_weights", False):
            continue
        if holds_no_arrays(m):  # nothing to report, and it may be shared with other models of the process
            continue
        stock = cls.__dict__.get("_lily_stock_class")
        if stock is None or cls.__dict__.get("_lily_watch_only"):
            m.__class__ = _lily_class(stock or cls, None, reports=True, watch_only=True)
        else:
            m.__class__ = _lily_class(stock, cls.__dict__.get("__call__"), reports=True)


def _target_classes(arch: str) -> Dict[type, Optional[Callable]]:
    out = {}
    for (cls_mod, cls_name), (op_mod, func) in _TARGETS[arch]:
        stock_cls = getattr(importlib.import_module(cls_mod), cls_name)
        out[stock_cls] = _op_forward(op_mod, func)
    return out


def _stock_class(module) -> Optional[type]:
    return type(module).__dict__.get("_lily_stock_class")


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def is_patched(model) -> bool:
    """True when any module of ``model`` runs a lily-mlx forward (the guarding and watching classes of the rest of a
    patched tree run stock's code and do not count). False for anything that is not an MLX module."""
    import mlx.nn as nn

    if not isinstance(model, nn.Module):
        return False
    return any(_stock_class(m) is not None and not type(m).__dict__.get("_lily_watch_only") for m in model.modules())


# The reason given for an op that has no kernel on any backend: stock's path, which runs where the ops with kernels
# do not apply (e.g. the MoE decode GEMVs of stock, behind the grouped kernels). The one-line summary leaves it out.
FALLBACK_ONLY = "stock's fallback path (no kernel by design)"


@dataclass(frozen=True)
class PatchReport:
    """What :func:`patch` did to a model: ``lily_mlx.patch_report(model)``."""

    architecture: str
    backend: str
    layers: Dict[str, int]  # stock layer class -> instances patched
    op_backends: Dict[str, str]  # op -> backend it runs on
    reference_reasons: Dict[str, str] = field(default_factory=dict)  # op on its reference -> why
    switches_off: Tuple[str, ...] = ()
    tune_profile: str = "tune profile: none"  # whether a tune profile is in use, and which
    switches_on: Tuple[str, ...] = ()  # switches off by default that are on

    def summary(self) -> str:
        """One line for ``--lily``: what was patched, where the ops run, what stays on the reference."""
        layers = ", ".join(f"{n} {name}" for name, n in self.layers.items())
        line = (f"{self.architecture} model patched ({layers}); backend {self.backend}; "
                f"switches off: {', '.join(self.switches_off) or 'none'}")
        if self.switches_on:
            line += f"; switches on that are off by default: {', '.join(self.switches_on)}"
        if self.backend != "reference" and self.reference_reasons:
            by_reason: Dict[str, List[str]] = {}
            for op, why in self.reference_reasons.items():  # a tune profile's reasons: in its report
                by_reason.setdefault("tune profile" if why.startswith("tune profile") else why, []).append(op)
            by_reason.pop(FALLBACK_ONLY, None)  # stock's own path by design: nothing the user could turn on
            if by_reason:
                line += "; reference path: " + "; ".join(f"{', '.join(ops)} ({why})" for why, ops in by_reason.items())
        return f"{line}; {self.tune_profile}"


def _report(model, arch: str) -> PatchReport:
    from .core import tune_profile
    from .core.dispatch import active_backend, active_profile
    from .ops import OPS, op_backend, reference_ops

    backend = active_backend()
    forced = reference_ops()
    profile = active_profile()
    pinned = profile.reference_ops if profile is not None else {}
    layers = Counter(_stock_class(m).__name__ for m in model.modules()
                     if _stock_class(m) is not None and not type(m).__dict__.get("_lily_watch_only"))
    op_backends = {name: op_backend(name, backend) for name in OPS}
    reasons = {}
    if backend != "reference":
        for name, op in OPS.items():
            if op_backends[name] != "reference":
                continue
            if name in forced or op.family in forced:
                reasons[name] = "LILY_REFERENCE_OPS"
            elif name in pinned:
                reasons[name] = f"tune profile: {pinned[name]}"
            elif backend in op.trial_backends:
                reasons[name] = ("trial kernel, on where `python -m lily_mlx tune` measures it faster "
                                 "(or LILY_TRIAL_OPS names it)")
            elif not op.kernel_backends and not op.trial_backends:
                reasons[name] = FALLBACK_ONLY
            else:
                reasons[name] = f"no {backend} kernel yet"
    # the switches whose state differs from their default
    state = switches.state()
    off = tuple(n for n, on in state.items() if not on and switches.SWITCHES[n].default)
    on = tuple(n for n, on in state.items() if on and not switches.SWITCHES[n].default)
    return PatchReport(arch, backend, dict(layers), op_backends, reasons, off, tune_profile.describe(profile), on)


def environment_problems() -> List[str]:
    """One line per LILY_* variable that cannot be honoured. ``LILY_REFERENCE_OPS`` and ``LILY_TRIAL_OPS``
    name ops, which exist once their families are imported: that happens here, and only when one is set."""
    if os.environ.get("LILY_REFERENCE_OPS") or os.environ.get("LILY_TRIAL_OPS"):
        from .ops import load_all

        load_all()
    return environment.problems()


def check_environment() -> None:
    """Every LILY_* variable valid, or :class:`~lily_mlx.core.environment.LilyConfigError`; then the
    dispatch plan is resolved from them (the hot path reads no environment)."""
    from .core import dispatch
    from .ops import load_all

    problems = environment_problems()
    if problems:
        raise environment.LilyConfigError("lily-mlx: " + "; ".join(problems))
    load_all()  # the plan covers every op
    dispatch.resolve()


def patch_report(model) -> Optional[PatchReport]:
    """The report of the last :func:`patch` of ``model`` (None if it was never patched)."""
    return getattr(model, "_lily_report", None)


def _layer_lists(model) -> List[list]:
    """The decoder-layer lists of ``model`` (a text model's ``layers``, in call order)."""
    return [m.layers for m in model.modules() if isinstance(getattr(m, "layers", None), list)
            and "embed_tokens" in m]


def patch(model, strict: bool = True):
    """Make ``model`` (an MLX-LM Qwen3.5/3.6/Next model) run lily-mlx ops. Returns ``model``.

    Patches in place, per instance; idempotent. An unsupported model type raises ``ValueError``
    naming the supported ones, or with ``strict=False`` warns and returns the model unpatched.
    """
    import mlx.nn as nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"lily_mlx.patch takes an MLX-LM model (an mlx.nn.Module), got {type(model).__name__}")
    arch = model_architecture(model)
    if arch not in SUPPORTED_MODEL_TYPES:
        msg = _unsupported_message(getattr(model, "model_type", None), arch)
        if strict:
            raise ValueError(msg)
        warn_caller(msg + ". Running the model unpatched (stock MLX-LM).")
        return model
    check_environment()
    check_versions()
    adapters = adapter_modules(model)
    if adapters:
        unpatch(model)  # (a model patched before adapters came in some way the classes do not see)
        if strict:
            raise ValueError(_adapters_message(adapters) + " (patch(model, strict=False): a warning and a stock model)")
        warn_caller(_adapters_message(adapters) + ". Running the model unpatched (stock MLX-LM).")
        return model
    targets = _target_classes(arch)
    swapped = 0
    for module in model.modules():
        forward_cls = type(module)
        if forward_cls in targets:
            module.__class__ = _lily_class(forward_cls, targets[forward_cls])
            swapped += 1
    if swapped or is_patched(model):
        # The rest of the tree runs stock's code and refuses adapters too (a LoRA layer set into the MoE block's
        # switch_mlp, say, or the whole tree's update_modules checked before anything changes). Leaves are left
        # alone: an adapter replaces a module inside its parent, and a leaf may be shared with other models (MLX-LM's
        # SwitchGLU takes one default SwiGLU() instance for the whole process).
        for module in model.modules():
            if _stock_class(module) is None and module.children():
                module.__class__ = _lily_class(type(module), None, watch_only=True)
    if swapped:
        from .core import projections

        projections.prepare_model(model)  # once: each layer's projections as one weight (views, no copy)
    from .ops.moe.layer import link_successors

    for layers in _layer_lists(model):
        link_successors(layers)  # a layer may compute the next one's input norm (switch fused_next_norm)
        # A decoder layer owns its decode traces: with its weights as their constants, its whole tree reports
        # weight changes.
        if switches.is_enabled("constant_weights") or switches.is_enabled("step_trace"):
            for layer in layers:
                if _stock_class(layer) is not None:
                    _report_weights(layer)
    if switches.is_enabled("step_trace"):  # a text model's step trace holds all its weights as constants
        text_model_forward = _op_forward("moe", "text_model_forward")
        for module in model.modules():
            if getattr(type(module), "__call__", None) is text_model_forward:
                _report_weights(module)
    generation.weights_changed()  # decode paths resolved before (replays of decode steps) are chosen again
    if swapped == 0 and not is_patched(model):
        msg = f"lily-mlx found no patchable layers in this {_describe(model)} model"
        if strict:
            raise ValueError(msg)
        warn_caller(msg)
    model._lily_report = _report(model, arch)
    return model


def unpatch(model):
    """Restore stock MLX-LM classes on ``model`` (same weights, same caches). Returns ``model``."""
    from .ops.moe.layer import unlink_successors

    from .core.step_trace import forget_step

    for layers in _layer_lists(model):
        unlink_successors(layers)
    forget_step(model)
    for module in model.modules():
        stock_cls = _stock_class(module)
        if stock_cls is not None:
            module.__class__ = stock_cls
        for name in [k for k in vars(module) if k.startswith("_lily_")]:  # caches of the patched paths
            vars(module).pop(name)
    generation.weights_changed()  # (classes changed: other patched models check what their modules report again)
    return model


def load(path_or_repo, *args, strict: bool = True, **mlx_lm_load_kwargs):
    """Drop-in for ``mlx_lm.load``: same arguments, same return values, model patched.

    ``strict`` is lily's own (see :func:`patch`); everything else goes to ``mlx_lm.load``.
    """
    from mlx_lm import utils as mlx_lm_utils

    check_environment()  # a bad LILY_* value fails here, before minutes of loading
    out = mlx_lm_utils.load(path_or_repo, *args, **mlx_lm_load_kwargs)
    patch(out[0], strict=strict)
    return out


def prefill_step_size(requested: Optional[int] = None) -> int:
    """The prompt chunk size MLX-LM should use under the ``chunked_prefill`` switch.

    On: ``requested`` (MLX-LM's default 2048 if None), as stock. Off (the write-up's ablation): one
    chunk for the whole prompt.
    """
    if not switches.is_enabled("chunked_prefill"):
        return UNCHUNKED_PREFILL_STEP
    return DEFAULT_PREFILL_STEP_SIZE if requested is None else int(requested)


class _CallablePatchModule(type(sys)):
    """``lily_mlx.patch`` is both this module and the function: once the submodule is imported,
    Python binds the package attribute ``lily_mlx.patch`` to the module, so the module forwards
    calls to :func:`patch` and ``lily_mlx.patch(model)`` works either way."""

    def __call__(self, model, strict: bool = True):
        return patch(model, strict=strict)


sys.modules[__name__].__class__ = _CallablePatchModule
