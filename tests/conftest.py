"""Shared test settings: hypothesis profiles.

``dev`` (default) and ``ci`` (selected when ``CI=true``, or by ``HYPOTHESIS_PROFILE=<name>``).
No deadline anywhere: MLX's first call to an op compiles it, so timings vary wildly. Failing
examples are printed with a reproduction blob (``@reproduce_failure``).
"""

import atexit
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

from lily_mlx.core import dispatch

# No test sees a tune profile of the machine it runs on (``~/.cache/lily_mlx/tune``): tune profiles
# are on, as for a user, in an empty folder (subprocesses inherit it). Tune tests set their own.
_NO_PROFILES = tempfile.mkdtemp(prefix="lily-tune-empty-")
atexit.register(shutil.rmtree, _NO_PROFILES, True)
os.environ["LILY_TUNE_DIR"] = _NO_PROFILES
os.environ.pop("LILY_TUNE", None)

settings.register_profile(
    "dev",
    deadline=None,
    max_examples=30,
    print_blob=True,
)
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=15,  # CI runs the whole suite on 2 cores: breadth over depth per test
    print_blob=True,
    derandomize=True,  # reproducible CI runs; new seeds come from local runs
    suppress_health_check=[HealthCheck.too_slow],
)

_ci = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if _ci else "dev"))


@pytest.fixture(autouse=True)
def fresh_dispatch_plan():
    """lily-mlx reads LILY_BACKEND / LILY_REFERENCE_OPS when its dispatch plan is resolved (patch time,
    or first use), not on every call: each test starts and ends with no plan, so the environment a
    test sets (monkeypatch) is the one its first dispatch sees."""
    dispatch.invalidate()
    yield
    dispatch.invalidate()
