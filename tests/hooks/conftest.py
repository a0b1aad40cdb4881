"""Fixtures of the hook tests."""

from __future__ import annotations

import pytest

from vllm_tap.ring_writer import RingWriter


@pytest.fixture
def ring(shm):
    """make(capacity) -> a RingWriter at <shm>/inst/rank-00000.ring (no daemon to wake), closed and
    removed afterwards."""
    writers = []

    def make(capacity=1 << 20):
        w = RingWriter(f"{shm}/inst/rank-00000.ring", capacity, wake_daemon=False)
        writers.append(w)
        return w

    yield make
    for w in writers:
        w.close(unlink=True)
