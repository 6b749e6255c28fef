"""Log lines said once per process: a model re-planned or re-wrapped many times in one run says each thing once.

Example::

    >>> import logging
    >>> log = logging.getLogger("lightning_ckpt.example")
    >>> say_once(log, "turned off the cache"), say_once(log, "turned off the cache")
    (True, False)
"""

from __future__ import annotations

import logging

__all__ = ["say_once"]

_said: set[tuple[str, str]] = set()


def say_once(log: logging.Logger, message: str) -> bool:
    """Log ``message`` at INFO on ``log`` unless it was said there before in this process; whether it was said now."""
    key = (log.name, message)
    if key in _said:
        return False
    _said.add(key)
    log.info(message)
    return True
