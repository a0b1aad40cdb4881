"""A daemon that starts behind (thousands of steps already in its rings) answers while it catches up,
and still delivers everything. Real daemon process, real rings written by the synthetic engine."""

from __future__ import annotations

import time

from synthetic_writer import Scenario, SyntheticEngine, assert_capture, capture_arrays
from vllm_tap.client import DaemonUnavailable

# Small records, one per capture, tensor and step, as a worker writes them for a small model: reading
# them costs Python per record, so a backlog of them takes the daemon seconds.
BACKLOG = Scenario(tp=1, n_requests=16, prompt_len=8, gen_len=2000, hidden=64, layers=(0, 1, 2, 3), vocab=256,
                   ring_bytes=128 << 20)


def test_a_daemon_started_behind_a_large_backlog_answers_status_while_it_reads_it_and_delivers_it_all(
        daemon_factory, shm_dir):
    """16 captures of 2000 decode steps (160 000 records, ~56 MiB) are in the rings before the daemon
    starts. While it reads them it answers `status` again and again (each within the 1 s a launcher
    gives it), and afterwards every capture is whole and bit-equal. (Before: the daemon read 16 MiB of
    a ring in a round, seconds of work, and answered nothing in between; a launcher polling with 1 s
    timeouts gave up on it.)"""
    eng = SyntheticEngine(BACKLOG, shm_dir, engine_ring_bytes=4 << 20)
    try:
        eng.run()
        assert eng.flush() and eng.dropped == 0
        d = daemon_factory(end_grace_s=0.0)
        c = d.client()
        answers, failures, slowest, t0 = 0, 0, 0.0, time.monotonic()
        while True:
            t = time.monotonic()
            try:
                s = c.status(timeout=1.0)
            except DaemonUnavailable:
                failures += 1
                assert time.monotonic() - t0 < 120, "the daemon never caught up"
                continue
            slowest = max(slowest, time.monotonic() - t)
            if s["pending_bytes"] == 0 and s["requests_in_flight"] == 0:
                break
            answers += 1
            time.sleep(0.01)
        print(f"\n{answers} answers while behind, {failures} unanswered in 1 s, the slowest {slowest * 1000:.0f} ms; "
              f"caught up after {time.monotonic() - t0:.1f} s")
        # Liveness, not speed: before, it answered a handful of times in all while behind.
        assert failures == 0 and answers >= 10, (answers, failures)
        for i in range(BACKLOG.n_requests):
            cap = c.fetch(BACKLOG.request_id(i), timeout=30)
            assert cap.complete and cap.missing_positions == [], (i, cap.missing_positions)
            assert_capture(BACKLOG, i, capture_arrays(cap))
    finally:
        eng.close()
