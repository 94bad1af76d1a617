"""Every ``LILY_*`` environment variable, checked in one place.

Importing lily-mlx never fails because of the environment (MLX-LM's CLIs import it through the hook
even without ``--lily``). Whatever turns lily-mlx on (``--lily``, ``patch()``, ``load()``) calls
``lily_mlx.patch.check_environment`` first, which raises :class:`LilyConfigError` on any of
:func:`problems`, so a bad value is one clear error before any model loads, not a traceback in the
middle of generation.
"""

from __future__ import annotations

import os
from typing import List

from . import switches, tune_profile
from .backend import resolve_backend

class LilyConfigError(ValueError):
    """A lily-mlx setting (environment variable or flag) that cannot be honoured; one-line message."""


def _backend_problem() -> List[str]:
    try:
        resolve_backend()
    except (ValueError, RuntimeError) as e:
        return [str(e)]
    return []


def _reference_ops_problem() -> List[str]:
    text = os.environ.get("LILY_REFERENCE_OPS", "")
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        return []
    from .dispatch import OPS as ops  # filled by importing the op families (lily_mlx.patch does it)

    known = set(ops) | {op.family for op in ops.values()}
    unknown = [n for n in names if n not in known]
    if not unknown:
        return []
    return [f"LILY_REFERENCE_OPS={text!r}: unknown op or family {', '.join(map(repr, unknown))}; "
            f"valid: {', '.join(sorted(known))}"]


def _trial_ops_problem() -> List[str]:
    text = os.environ.get("LILY_TRIAL_OPS", "")
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        return []
    from .dispatch import OPS as ops  # filled by importing the op families (lily_mlx.patch does it)

    trials = sorted(name for name, op in ops.items() if op.trial_backends)
    unknown = [n for n in names if n not in trials]
    if not unknown:
        return []
    return [f"LILY_TRIAL_OPS={text!r}: not a trial kernel {', '.join(map(repr, unknown))}; "
            f"trial kernels: {', '.join(trials)}"]


def _allow_untested_problem() -> List[str]:
    value = os.environ.get("LILY_ALLOW_UNTESTED", "")
    return [] if value in ("", "0", "1") else [f"LILY_ALLOW_UNTESTED={value!r} is not 0 or 1"]


def _tune_problem() -> List[str]:
    value = os.environ.get(tune_profile.TUNE_ENV, "")
    if value.strip().lower() in ("",) + tune_profile.TUNE_CHOICES:
        return []
    return [f"{tune_profile.TUNE_ENV}={value!r} is not one of {', '.join(tune_profile.TUNE_CHOICES)} "
            "(off: ignore tune profiles)"]


def _cuda_sgm_layout_problem() -> List[str]:
    from ..msl.cuda.kernel import sgm_layout_setting  # the bridge reads it when it builds a kernel's header

    try:
        sgm_layout_setting()
    except ValueError as e:
        return [str(e)]
    return []


def _cuda_body_in_header_problem() -> List[str]:
    from ..msl.cuda.kernel import body_in_header  # the bridge reads it when it makes a kernel object

    try:
        body_in_header()
    except ValueError as e:
        return [str(e)]
    return []


def problems() -> List[str]:
    """One line per lily-mlx environment variable that cannot be honoured (empty when all is well)."""
    return (switches.environment_problems() + _backend_problem() + _reference_ops_problem()
            + _trial_ops_problem() + _allow_untested_problem() + _tune_problem() + _cuda_sgm_layout_problem()
            + _cuda_body_in_header_problem())
