"""lily_mlx.core.log.log_once: each key logs once per process."""

import logging
import os
import subprocess
import sys

from lily_mlx.core.log import log_once, reset_log_once


def test_log_once_logs_each_key_once(caplog):
    reset_log_once()
    with caplog.at_level(logging.INFO, logger="lily_mlx"):
        assert log_once("core-test:a", "first a") is True
        assert log_once("core-test:a", "second a") is False
        assert log_once("core-test:b", "first b") is True
    messages = [r.getMessage() for r in caplog.records if r.name == "lily_mlx"]
    assert messages == ["first a", "first b"]
    reset_log_once()
    assert log_once("core-test:a", "again") is True
    reset_log_once()


def test_level_passed_through(caplog):
    reset_log_once()
    with caplog.at_level(logging.INFO, logger="lily_mlx"):
        log_once("core-test:w", "careful", level=logging.WARNING)
    assert [r.levelno for r in caplog.records if r.name == "lily_mlx"] == [logging.WARNING]
    reset_log_once()


def test_visible_once_without_logging_configured():
    """A user who configured no logging still sees a fallback note, exactly once, on stderr."""
    code = ("from lily_mlx.core.log import log_once\n"
            "for _ in range(3): log_once('k', 'falling back to the reference')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("[lily_mlx] falling back to the reference") == 1
    assert out.stdout == ""
