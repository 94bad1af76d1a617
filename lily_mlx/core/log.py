"""Logging helpers: lily-mlx speaks through the ``lily_mlx`` logger, fallbacks once per reason."""

import logging
import os
import sys
import threading
import warnings

logger = logging.getLogger("lily_mlx")
_seen: set = set()
_lock = threading.Lock()


def log_once(key: str, message: str, level: int = logging.INFO) -> bool:
    """Log ``message`` the first time ``key`` is seen in this process. Returns True if it logged."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    if not logger.handlers and not logging.getLogger().handlers:
        # Make one-time fallback notes visible without the user configuring logging.
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[lily_mlx] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    logger.log(level, message)
    return True


def reset_log_once() -> None:
    """Forget which one-time messages were logged (tests)."""
    with _lock:
        _seen.clear()


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # lily_mlx/


def _caller_stacklevel() -> int:
    """``stacklevel`` of the first frame outside lily-mlx, so a warning points at the user's line."""
    frame, level = sys._getframe(2), 2  # the caller of warn_caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def warn_caller(message: str, category=UserWarning) -> None:
    """``warnings.warn`` attributed to the code that called into lily-mlx (not a lily-mlx line)."""
    warnings.warn(message, category, stacklevel=_caller_stacklevel())
