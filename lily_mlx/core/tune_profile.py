"""Tune profiles: what ``python -m lily_mlx tune`` measured on one device, and how patch() finds it.

A profile is a JSON file in the tune folder (``LILY_TUNE_DIR``, default ``~/.cache/lily_mlx/tune``)
named after its key: the device, the backend, the MLX version and the lily-mlx version. It holds, per
op, whether its kernel or its reference runs (a kernel that disagreed with its reference, or measured
slower than it, is pinned to the reference; a trial kernel, ``"trial": true``, runs only where the
profile chose it) and, per switch, on or off. The dispatch plan reads the
matching profile when it is resolved (``patch()``), never per call. ``LILY_TUNE=off`` ignores
profiles. Format and choices: docs/usage.md, "Tuning for your machine".
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

from .log import log_once

FORMAT = 1
TUNE_ENV = "LILY_TUNE"
TUNE_DIR_ENV = "LILY_TUNE_DIR"
TUNE_CHOICES = ("on", "off")


@dataclass(frozen=True)
class Profile:
    """The choices of one profile file that the dispatch plan applies."""

    path: Path
    model: str  # what it was tuned on
    reference_ops: Dict[str, str] = field(default_factory=dict)  # op -> why it runs its reference
    switches_off: Dict[str, str] = field(default_factory=dict)  # switch -> why it is off
    kernel_ops: Dict[str, str] = field(default_factory=dict)  # trial kernel -> why it runs (measured faster)


def tune_enabled() -> bool:
    """False when ``LILY_TUNE=off``; an invalid value also disables profiles (it is reported by
    ``core.environment`` with ``--lily`` / ``patch()``; here it must never raise)."""
    return os.environ.get(TUNE_ENV, "").strip().lower() in ("", "on")


def tune_dir() -> Path:
    """``LILY_TUNE_DIR``, else ``lily_mlx/tune`` under the user's cache folder."""
    if os.environ.get(TUNE_DIR_ENV):
        return Path(os.environ[TUNE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lily_mlx" / "tune"


def device_name() -> str:
    import mlx.core as mx

    try:
        return str(mx.device_info().get("device_name") or "unknown device")
    except Exception:  # an MLX build without device_info
        import platform

        return platform.processor() or platform.machine() or "unknown device"


def device_key(backend: str) -> Dict[str, str]:
    """What a profile must match to apply here."""
    import mlx.core as mx

    # core may not import the package above it; the package is imported before any submodule.
    lily_version = getattr(sys.modules.get("lily_mlx"), "__version__", "unknown")
    return {"device": device_name(), "backend": backend, "mlx": mx.__version__, "lily": lily_version}


def profile_filename(key: Dict[str, str]) -> str:
    text = f"{key['backend']}-{key['device']}-mlx{key['mlx']}-lily{key['lily']}"
    return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_") + ".json"


def profile_path(backend: str) -> Path:
    return tune_dir() / profile_filename(device_key(backend))


def _choices(data: dict, path: Path) -> Profile:
    ops = {name: entry.get("reason", "tune profile")
           for name, entry in data.get("ops", {}).items() if entry.get("choice") == "reference"}
    off = {name: entry.get("reason", "tune profile")
           for name, entry in data.get("switches", {}).items() if entry.get("choice") == "off"}
    trials = {name: entry.get("reason", "tune profile")
              for name, entry in data.get("ops", {}).items() if entry.get("trial") and entry.get("choice") == "kernel"}
    return Profile(path, str(data.get("model", "?")), ops, off, trials)


# (path, mtime) -> Profile or None: read a file once, even when the plan is resolved many times.
_read: Dict[Tuple[str, int], Optional[Profile]] = {}


def _read_profile(path: Path, key: Dict[str, str]) -> Optional[Profile]:
    stamp = (str(path), path.stat().st_mtime_ns)
    if stamp not in _read:
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT or data.get("key") != key:
                log_once(f"tune-mismatch:{path}", f"tune profile {path} was made for {data.get('key')}, "
                         f"not this machine ({key}): ignored; run `python -m lily_mlx tune`")
                _read[stamp] = None
            else:
                _read[stamp] = _choices(data, path)
        except (OSError, ValueError, AttributeError) as e:
            log_once(f"tune-unreadable:{path}", f"tune profile {path} is unreadable ({e}): ignored")
            _read[stamp] = None
    return _read[stamp]


def load(backend: str) -> Optional[Profile]:
    """The profile for this device, backend and versions, or None (``LILY_TUNE=off``, the reference
    backend, or no such file; profiles of other devices or versions are named in one log line)."""
    if backend == "reference" or not tune_enabled():
        return None
    path = profile_path(backend)
    if path.is_file():
        return _read_profile(path, device_key(backend))
    others = sorted(p.name for p in tune_dir().glob("*.json")) if tune_dir().is_dir() else []
    if others:
        log_once(f"tune-others:{path}", f"no tune profile for this machine ({path.name}); ignoring the "
                 f"profiles for other devices or versions in {tune_dir()}: {', '.join(others)}")
    return None


def describe(profile: Optional[Profile]) -> str:
    """For the ``--lily`` line: whether a tune profile is in use."""
    if not tune_enabled():
        return f"tune profile: off ({TUNE_ENV}={os.environ.get(TUNE_ENV)})"
    if profile is None:
        return "tune profile: none"
    trials = f", trial kernel(s) on: {', '.join(sorted(profile.kernel_ops))}" if profile.kernel_ops else ""
    return (f"tune profile: {profile.path} (tuned on {profile.model}; {len(profile.reference_ops)} op(s) on "
            f"reference, {len(profile.switches_off)} switch(es) off{trials})")
