"""The ring copier (daemon/copier.py): large payloads copied into the arena by a child that maps the
rings, read ahead while the daemon handles the record before; a ring truncated under it kills the
child, never the daemon, and pread takes over."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from synthetic_writer import write_decode_backlog
from vllm_tap import ring_format as rf
from vllm_tap.daemon import copier as copier_mod
from vllm_tap.daemon.arena import Arena
from vllm_tap.daemon.copier import Copier


def _wait(cond, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_backlog_of_full_logits_arrives_exact_through_the_copier_read_ahead(daemon_factory, shm_dir):
    """Steps of full logits (2.5 MiB a record) pile up while the daemon is stopped; it then reads
    them through the copier, each next record's copy started while the last is handled. Every value
    arrives exactly as written."""
    from vllm_tap.ring_records import TensorId
    from vllm_tap.spec import CaptureSpec, LogitsMode, PositionsMode

    d = daemon_factory(end_grace_s=1.0)
    n, prompt, steps, vocab = 8, 4, 12, 81920
    spec = CaptureSpec(logits=LogitsMode.FULL, layers=(), positions=PositionsMode.OUTPUT).to_meta()
    rids = [f"copied-{i}" for i in range(n)]
    sections = ((TensorId(rf.TensorKind.LOGITS), rf.DType.FLOAT32, vocab, (0, vocab), vocab),)

    def row(i: int, pos: int, section: int = 0) -> np.ndarray:
        return (np.arange(vocab) * 0.5 + 1000 * int(pos) + 100_000 * i).astype(np.float32)

    write_decode_backlog(shm_dir, d, rids, spec, prompt, steps, sections, row, ring_bytes=64 << 20)
    c = d.client()
    pos = np.arange(prompt - 1, prompt - 1 + steps)
    for i, rid in enumerate(rids):
        cap = c.fetch(rid, timeout=30)
        assert cap.positions.tolist() == pos.tolist() and cap.missing_positions == [] and cap.complete, rid
        assert cap.arrays()["logits"].tobytes() == np.stack([row(i, p) for p in pos]).tobytes(), rid
    s = d.status()
    assert s["copier"]["running"] and s["copier"]["losses"] == 0
    assert s["copier"]["copies"] >= steps - 1, s["copier"]  # the first may go by pread while it starts
    ring = next(r for r in s["rings"] if r["rank"] == 0)
    assert ring["read_ahead_taken"] >= steps // 2, ring


def test_large_records_whose_captures_rows_are_interleaved_are_read_past_a_large_record(daemon_factory, shm_dir):
    """Large records of whole tensors whose captures' rows do not lie together (each step holds two
    positions of every request, interleaved) follow one another in a backlog: the read-ahead after a
    large record leaves them to poll (they land per capture, not in one block), the daemon stays up
    and every value arrives exactly as written."""
    from vllm_tap.ring_records import TensorId
    from vllm_tap.spec import CaptureSpec, LogitsMode, PositionsMode

    d = daemon_factory(end_grace_s=1.0)
    n, prompt, steps, each, vocab = 4, 4, 6, 2, 32768
    spec = CaptureSpec(logits=LogitsMode.FULL, layers=(), positions=PositionsMode.OUTPUT).to_meta()
    rids = [f"interleaved-{i}" for i in range(n)]
    sections = ((TensorId(rf.TensorKind.LOGITS), rf.DType.FLOAT32, vocab, (0, vocab), vocab),)

    def row(i: int, pos: int, section: int = 0) -> np.ndarray:
        return (np.arange(vocab) * 0.25 + 1000 * int(pos) + 100_000 * int(i)).astype(np.float32)

    write_decode_backlog(shm_dir, d, rids, spec, prompt, steps, sections, row, ring_bytes=64 << 20, rows_each=each)
    c = d.client()
    pos = np.arange(prompt - 1, prompt - 1 + steps * each)
    for i, rid in enumerate(rids):
        try:
            cap = c.fetch(rid, timeout=30)
        except Exception:
            raise AssertionError(d.log()[-3000:]) from None
        assert cap.positions.tolist() == pos.tolist() and cap.missing_positions == [] and cap.complete, rid
        assert cap.arrays()["logits"].tobytes() == np.stack([row(i, p) for p in pos]).tobytes(), rid
    assert d.proc.poll() is None and d.status()["copier"]["losses"] == 0


class _Ring:
    """What the copier asks of a ring reader: its descriptor."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY)

    def fileno(self) -> int:
        return self.fd


def _ring_file(path: str, nbytes: int, fill: int) -> None:
    with open(path, "wb") as f:
        f.write(bytes([fill]) * nbytes)


def test_a_ring_truncated_under_the_copier_kills_the_child_not_the_caller(shm_dir, monkeypatch, caplog):
    """A real child, a real SIGBUS: the ring file shrinks under its mapping, the copy fails (the
    caller then reads with pread, which sees the short file), the loss is logged and counted, and a
    new child serves the next copy."""
    monkeypatch.setattr(copier_mod, "RESTART_AFTER_S", 0.0)
    os.makedirs(shm_dir, exist_ok=True)
    a = Arena.create(shm_dir, 64 << 20)
    cp = Copier(a)
    n = 4 << 20
    try:
        path = os.path.join(shm_dir, "a.ring")
        _ring_file(path, 8 << 20, 7)
        ring = _Ring(path)
        buf = a.alloc((n,), np.uint8, overwrite=True)
        _wait(lambda: cp.copy(ring, 4096, buf), what="the copier to start and copy")
        assert (buf == 7).all() and cp.copies >= 1
        first = cp.snapshot()["pid"]

        os.truncate(path, 4096)  # someone shrinks the ring: the child's next load from it faults
        buf[:] = 0
        assert cp.copy(ring, 4096, buf) is False
        assert cp.losses == 1 and not cp.snapshot()["running"]
        assert "ring copier lost" in caplog.text and f"exit -{int(signal.SIGBUS)}" in caplog.text, caplog.text
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)

        # The caller lives on, and so does the copier: a new child for the next ring.
        path2 = os.path.join(shm_dir, "b.ring")
        _ring_file(path2, 8 << 20, 9)
        ring2 = _Ring(path2)
        _wait(lambda: cp.copy(ring2, 0, buf), what="a new copier")
        assert (buf == 9).all() and cp.snapshot()["pid"] != first and cp.losses == 1
        # Asked outside the ring (a ring shorter than its header says): refused, the child is fine.
        assert cp.copy(ring2, (8 << 20) - 4096, buf) is False and cp.losses == 1
        os.close(ring.fd)
        os.close(ring2.fd)
    finally:
        cp.close()
        buf = None
        a.close()


def test_small_or_private_buffers_are_left_to_pread(shm_dir):
    a = Arena.create(shm_dir, 16 << 20)
    cp = Copier(a)
    try:
        path = os.path.join(shm_dir, "c.ring")
        _ring_file(path, 8 << 20, 5)
        ring = _Ring(path)
        small = a.alloc((copier_mod.MIN_BYTES - 4096,), np.uint8, overwrite=True)
        assert cp.copy(ring, 0, small) is False  # not worth a round trip
        assert cp.copy(ring, 0, np.empty(4 << 20, np.uint8)) is False  # not in the arena
        assert cp.snapshot()["pid"] is None  # and no child was started for either
        os.close(ring.fd)
    finally:
        cp.close()
        a.close()


def test_the_copier_can_be_turned_off(daemon_factory):
    d = daemon_factory(ring_copier=False)
    s = d.status()
    assert s["arena"] is not None and s["copier"] is None
