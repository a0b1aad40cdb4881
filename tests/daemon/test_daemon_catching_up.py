"""A daemon that starts behind (thousands of steps already in its rings) answers while it catches up,
and still delivers everything. Real daemon process, real rings written by the synthetic engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from synthetic_writer import Scenario, SyntheticEngine, assert_capture, capture_arrays
from vllm_tap.client import DaemonUnavailable
from waiting import wait_until

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
        _answers_while_behind(d)
        _every_capture_whole(d)
    finally:
        eng.close()


def _answers_while_behind(d) -> None:
    """Asks `status` until the daemon has caught up; asserts it answered again and again meanwhile."""
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


def _every_capture_whole(d) -> None:
    c = d.client()
    for i in range(BACKLOG.n_requests):
        cap = c.fetch(BACKLOG.request_id(i), timeout=30)
        assert cap.complete and cap.missing_positions == [], (i, cap.missing_positions)
        assert_capture(BACKLOG, i, capture_arrays(cap))


WRITER = """
import sys
from synthetic_writer import Scenario, SyntheticEngine
eng = SyntheticEngine(Scenario.from_json(sys.argv[1]), sys.argv[2], engine_ring_bytes=4 << 20)
eng.begin()
eng.run_step()
print("ready", flush=True)
sys.stdin.readline()
while eng.run_step():
    pass
assert eng.flush() and eng.dropped == 0
"""


def test_a_daemon_reading_what_a_dead_writer_left_answers_status_meanwhile(daemon_factory, shm_dir):
    """A writer process writes the same backlog while the daemon is stopped (SIGSTOP) and exits; the
    daemon resumes, learns of the exit through the writer's pidfd, and reads what the ring holds
    before its captures end. It answers `status` again and again while it does, and every capture
    is whole. (Before: the ring of a dead writer was read to its end in one go.)"""
    d = daemon_factory(end_grace_s=0.0)
    here = os.path.dirname(os.path.abspath(__file__))
    support = os.path.join(os.path.dirname(here), "support")
    w = subprocess.Popen([sys.executable, "-c", WRITER, BACKLOG.to_json(), shm_dir], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": support})
    try:
        assert w.stdout.readline().strip() == "ready"
        wait_until(lambda: len(d.status()["rings"]) == 2 and d.status()["requests_in_flight"] == BACKLOG.n_requests,
                   what="both rings and every BEGIN")
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            w.stdin.write("go\n")
            w.stdin.flush()
            assert w.wait(120) == 0
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        _answers_while_behind(d)
        _every_capture_whole(d)
        assert d.status()["writers_exited"] == 2  # its pidfd told: the rings were read as a dead writer's
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
