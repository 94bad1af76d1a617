"""Fixtures for the integration tests: the test model, random checkpoints of each supported
architecture, and helpers to run MLX-LM's CLIs as real subprocesses.

The default test model is the embedded tiny Qwen3.6, shipped in the tree (a missing or incomplete copy
is an error, not a silent switch to another model); random 4-bit tiny checkpoints built in seconds
cover the other architectures. ``LILY_TEST_MODEL=<folder>`` picks another local model.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .tiny_models import build_random_model

# Long enough that stock and lily both generate the full 100 tokens on any of the test models.
PROMPT = "Return a new dictionary with the keys of the mapping and values set to"


def _embedded_model_dir() -> Path:
    from lily_mlx.models import embedded

    folder = Path(embedded.EMBEDDED_DIR)
    assert embedded._is_complete(folder), f"the embedded model is part of the tree: {folder}"
    return folder


@pytest.fixture(scope="session")
def random_model(tmp_path_factory):
    """``random_model(model_type)`` -> folder of a random tiny checkpoint (built once per session)."""
    built = {}

    def get(model_type: str = "qwen3_5_moe") -> Path:
        if model_type not in built:
            built[model_type] = build_random_model(tmp_path_factory.mktemp(model_type), model_type)
        return built[model_type]

    return get


@pytest.fixture(scope="session")
def model_path(random_model) -> Path:
    """The folder of the default test model (see module docstring)."""
    if os.environ.get("LILY_TEST_MODEL"):
        return Path(os.environ["LILY_TEST_MODEL"])
    return _embedded_model_dir()


@pytest.fixture(scope="session")
def loaded_model(model_path):
    """(model, tokenizer) of the default test model, stock (tests that patch it must unpatch)."""
    import mlx_lm

    return mlx_lm.load(str(model_path))


# ------------------------------------------------------------------------------------------------
# Subprocess helpers
# ------------------------------------------------------------------------------------------------


def subprocess_env() -> dict:
    """Environment for CLI subprocesses: the installed package, reference backend, no user switches."""
    env = dict(os.environ)
    for name in ("LILY_DISABLE", "LILY_ENABLE", "PYTHONPATH"):
        env.pop(name, None)
    env["LILY_BACKEND"] = "reference"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def hook_status() -> str:
    """'' when this interpreter has lily-mlx's MLX-LM hook installed, else why not."""
    probe = (
        "import sys; "
        "print(any(getattr(f, '_lily_cli_finder', False) for f in sys.meta_path))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd="/", env=subprocess_env(), timeout=60)
    if out.stdout.strip() == "True":
        return ""
    return ("lily-mlx's MLX-LM CLI hook (lily_mlx_hooks.pth) is not installed in this interpreter; "
            "install the package (pip install .) to test `mlx_lm.generate --lily` / `mlx_lm.server --lily`")


@pytest.fixture(scope="session")
def installed_hook():
    reason = hook_status()
    if reason:
        pytest.skip(reason)


def mlx_lm_command(name: str) -> list:
    """The MLX-LM console script ``mlx_lm.<name>`` of this interpreter, else its dispatcher."""
    script = Path(sys.executable).parent / f"mlx_lm.{name}"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "mlx_lm", name]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generated_text(stdout: str) -> str:
    """The generated text that mlx_lm.generate prints between its two '==========' lines."""
    parts = stdout.split("==========\n")
    assert len(parts) >= 3, f"unexpected mlx_lm.generate output:\n{stdout}"
    return parts[1]
