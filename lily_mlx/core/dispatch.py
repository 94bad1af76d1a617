"""The op registry and the dispatch plan: which backend each op runs on, resolved once.

Every op family registers its ops here (:func:`register_op`): name, family, the switches it reads and
the backends it has kernels for. The plan maps each op to the backend it runs on: the active backend
(``LILY_BACKEND``) where the op has a kernel for it and ``LILY_REFERENCE_OPS`` does not keep it on
its reference and the tune profile of this machine (``core.tune_profile``) does not pin it there,
else ``"reference"``. A *trial* kernel (``Op.trial_backends``: written for that backend, but not
measured faster than its reference on the machines tried) runs only where this machine's tune profile
measured it correct and faster (``python -m lily_mlx tune`` times trial kernels too), or where
``LILY_TRIAL_OPS`` names it. The environment and the profile are read when the plan is resolved (at
``patch()``, or on first use after :func:`invalidate`), never on the hot path: a forward's
``op_backend(name)`` is one dict lookup.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, Optional, Tuple

from . import generation, switches, tune_profile
from .backend import resolve_backend

REFERENCE = "reference"


@dataclass(frozen=True)
class Op:
    """One operation of a family: what it computes, the switches it reads, where it has kernels."""

    name: str
    family: str  # moe | deltanet | attention | linear
    description: str
    switches: Tuple[str, ...] = ()
    kernel_backends: FrozenSet[str] = field(default_factory=frozenset)  # backends with a kernel
    # Backends with a kernel that runs only where a tune profile turned it on (measured faster there).
    trial_backends: FrozenSet[str] = field(default_factory=frozenset)


OPS: Dict[str, Op] = {}

_lock = threading.Lock()
_backend: Optional[str] = None  # the backend in force, resolved with the plan
_plan: Dict[str, str] = {}  # op name -> backend it runs on
_profile: Optional[tune_profile.Profile] = None  # the tune profile the plan applies
_profile_off: FrozenSet[str] = frozenset()  # switches that profile turned off
_tune_trials: FrozenSet[str] = frozenset()  # trial kernels on while ``python -m lily_mlx tune`` measures them
# What the plan's choices are made from (``plan_key``), set when it is resolved: equal keys, equal choices. Filling the
# plan lazily does not change it (a choice, once made, stays until the plan is resolved again); registering an op again
# does (``_registered``).
_plan_inputs: Optional[tuple] = None
_registered = 0


def register_op(op: Op) -> Op:
    global _registered
    OPS[op.name] = op
    with _lock:
        _plan.pop(op.name, None)
        _registered += 1
        generation.bump()
    return op


def reference_ops() -> FrozenSet[str]:
    """Ops or families forced onto their reference by ``LILY_REFERENCE_OPS=deltanet,moe_routing``
    (to bisect a disagreement, or to keep one family stock while trying another)."""
    text = os.environ.get("LILY_REFERENCE_OPS", "")
    return frozenset(t.strip() for t in text.split(",") if t.strip())


def trial_ops() -> FrozenSet[str]:
    """Trial kernels turned on by ``LILY_TRIAL_OPS=attention_qk_prep,...`` (to try one without a tune
    run, or to A/B it: ``bench.e2e``'s ``lily-trial:<op>`` engines set it), besides the tune profile's."""
    return frozenset(_env_names("LILY_TRIAL_OPS"))


def _choose(op: Op, backend: str, forced: FrozenSet[str], pinned=(), trials=()) -> str:
    if op.name in forced or op.family in forced or op.name in pinned:
        return REFERENCE
    if backend in op.kernel_backends:
        return backend
    if backend in op.trial_backends and (op.name in _tune_trials or op.name in trials):
        return backend
    return REFERENCE


def _trials_for(profile: Optional[tune_profile.Profile]):
    return set(profile.kernel_ops if profile is not None else {}) | trial_ops()


def _env_names(var: str) -> set:
    return {n.strip() for n in os.environ.get(var, "").split(",") if n.strip()}


def _apply_profile_switches(profile: Optional[tune_profile.Profile]) -> None:
    """Turn off the switches the profile measured slower on than off, unless the user turned them on
    (``LILY_ENABLE``, ``--lily-enable``, ``switches.enable``: the user's word wins); switches a previous
    profile turned off come back on, unless the user turned them off."""
    global _profile_off
    user = switches.user_choices()
    user_on = _env_names("LILY_ENABLE") | {n for n, on in user.items() if on}
    user_off = _env_names("LILY_DISABLE") | {n for n, on in user.items() if not on}
    wanted = set(profile.switches_off) if profile is not None else set()
    wanted = {n for n in wanted if n in switches.SWITCHES} - user_on
    for name in _profile_off - wanted - user_off:
        switches.set_enabled(name, True)
    for name in wanted:
        switches.set_enabled(name, False)
    _profile_off = frozenset(wanted)


def resolve() -> str:
    """Read ``LILY_BACKEND``, ``LILY_REFERENCE_OPS``, ``LILY_TRIAL_OPS`` and the tune profile now and rebuild the plan
    (and apply the profile's switch choices); returns the backend."""
    global _backend, _profile, _plan_inputs
    backend = resolve_backend()
    forced = reference_ops()
    profile = tune_profile.load(backend)
    pinned = profile.reference_ops if profile is not None else {}
    trials = _trials_for(profile)
    with _lock:
        _backend, _profile = backend, profile
        _plan.clear()
        _plan.update({name: _choose(op, backend, forced, pinned, trials) for name, op in OPS.items()})
        _plan_inputs = (backend, repr(profile), forced, frozenset(trials), _tune_trials)
        generation.bump()
    _apply_profile_switches(profile)
    return backend


def active_profile() -> Optional[tune_profile.Profile]:
    """The tune profile the resolved plan applies (None: none for this machine, or LILY_TUNE=off)."""
    active_backend()
    return _profile


def _pinned_for(backend: str):
    """Ops the tune profile for ``backend`` pins to their reference."""
    profile = _profile if backend == _backend else tune_profile.load(backend)
    return profile.reference_ops if profile is not None else {}


def _trial_ops_for(backend: str):
    """Trial kernels on for ``backend``: its tune profile's and LILY_TRIAL_OPS's."""
    return _trials_for(_profile if backend == _backend else tune_profile.load(backend))


@contextlib.contextmanager
def trial_kernels_on(names: Iterable[str]):
    """These trial kernels on, the plan resolved again on entry and exit (``python -m lily_mlx tune`` checks and
    times the trial kernels it decides like the other kernels; a trial kernel it has no case for stays as the
    environment and the profile say, so that what it measures is what ships)."""
    global _tune_trials
    saved = _tune_trials
    _tune_trials = frozenset(names)
    invalidate()
    try:
        yield
    finally:
        _tune_trials = saved
        invalidate()


def invalidate() -> None:
    """Forget the plan: the next dispatch resolves it again from the environment."""
    global _backend, _profile, _plan_inputs
    with _lock:
        _backend, _profile, _plan_inputs = None, None, None
        _plan.clear()
        generation.bump()


def plan_key() -> tuple:
    """What the ops' backends are chosen from, as a hashable value: equal keys, equal choices (a plan resolved again
    from the same environment and profile has the key it had)."""
    active_backend()
    return _plan_inputs, _registered


def active_backend() -> str:
    """The backend the plan was resolved for (resolving it if needed)."""
    return _backend if _backend is not None else resolve()


def op_backend(name: str, backend: Optional[str] = None) -> str:
    """Backend op ``name`` runs on. Hot path: a lookup in the resolved plan. With an explicit
    ``backend`` (tools, tables): what the op would use there."""
    if backend is not None:
        return _choose(OPS[name], backend, reference_ops(), _pinned_for(backend), _trial_ops_for(backend))
    chosen = _plan.get(name)
    if chosen is None or _backend is None:
        active = active_backend()
        with _lock:
            chosen = _plan.setdefault(name, _choose(OPS[name], active, reference_ops(), _pinned_for(active),
                                                    _trial_ops_for(active)))
    return chosen
