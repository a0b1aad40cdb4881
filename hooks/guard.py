"""No exception from the tap may reach vLLM's loop: the rule every patched runner method keeps.

Each patched entry point runs the tap's part of its work inside `guard.run(...)`: an exception there
is logged (the first with its traceback, then at most one line a minute saying how many followed)
and the step goes on without capturing; vLLM's own method always runs and its own exceptions pass
through untouched. Start-up failures (bad settings, no room for the ring, an unsupported model,
runner or version) are the opposite case: they raise TapConfigError and stop vLLM with one line.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

log = logging.getLogger("vllm_tap.hooks")

T = TypeVar("T")


class RateLimitedLog:
    """Errors of one kind logged once with a traceback, then at most every `interval` seconds."""

    def __init__(self, interval: float = 60.0):
        self.interval = interval
        self.count = 0
        self._last = float("-inf")
        self._suppressed = 0

    def error(self, what: str, exc: BaseException) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last < self.interval:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
        first = self._last == float("-inf")
        self._last, self._suppressed = now, 0
        log.error("vllm-tap: %s failed; the step goes on without capture%s: %s: %s",
                  what, more, type(exc).__name__, exc, exc_info=exc if first else None)


_errors = RateLimitedLog()


def errors() -> RateLimitedLog:
    return _errors


def run(what: str, fn: Callable[..., T], *args, on_error: Callable[[], None] | None = None, **kwargs) -> T | None:
    """fn(*args, **kwargs), or None after logging when it raises (then on_error(), itself guarded)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the whole point: nothing may reach vLLM
        _errors.error(what, e)
        if on_error is not None:
            try:
                on_error()
            except Exception as e2:  # noqa: BLE001
                _errors.error(what + " (clean-up)", e2)
        return None
