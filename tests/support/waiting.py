"""Waiting in tests for what another process does: poll a condition up to a deadline."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(cond: Callable[[], object], timeout: float = 20.0, what: str = "condition", every: float = 0.02) -> None:
    """Return once cond() is true; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)
