import os
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def _msl_cache_dir():
    # Share compiled kernels across the session (and xdist workers) without touching ~/.cache
    # unless the caller chose a cache directory.
    if "LILY_MSL_CACHE" not in os.environ:
        os.environ["LILY_MSL_CACHE"] = os.path.join(tempfile.gettempdir(), "lily_mlx_msl_test_cache")
    yield
