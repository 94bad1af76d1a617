"""Logging helpers: lily-mlx speaks through the ``lily_mlx`` logger, fallbacks once per reason."""

import logging
import threading

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
