"""The ring writer never harms the process it lives in: full shared memory, a ring file truncated
under it and a reader that never comes all end in counted drops, never in SIGBUS or unbounded
memory. Real files on real tmpfs mounts; writers that may fault run in child processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from vllm_tap import ring_format as rf
from vllm_tap.ring_records import RequestRef, RequestTable, TensorId
from vllm_tap.ring_files import RingSpaceError, ring_path
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_writer import RingWriter
from vllm_tap.ring_schema import EndMeta

LOGITS = TensorId(rf.TensorKind.LOGITS)


@pytest.fixture
def small_tmpfs():
    """A 12 MiB tmpfs, like a container's small /dev/shm (needs root; skipped where mount is refused)."""
    d = tempfile.mkdtemp(prefix="vt-tmpfs-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", d], capture_output=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield d
    subprocess.run(["umount", "-l", d], check=False)
    os.rmdir(d)


def _fill(path: str, capacity: int, q) -> None:
    """Child: create a ring and write until it has used its whole capacity once."""
    try:
        w = RingWriter(path, capacity)
    except RingSpaceError as e:
        q.put(("space", str(e)))
        return
    data = np.ones((1, 16384), np.float32)  # 64 KiB records
    written = 0
    r = RingReader(path)
    while written < capacity:
        assert w.write("r", LOGITS, [0], [0], data)
        r.poll()
        written += data.nbytes
    q.put(("ok", written))


def _run_child(target, *args) -> tuple[int, object]:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    p.join(60)
    return p.exitcode, (q.get(timeout=1) if not q.empty() else None)


def test_a_ring_that_shared_memory_cannot_hold_fails_at_creation_with_one_line(small_tmpfs):
    path = ring_path(small_tmpfs, "inst", 0)
    code, got = _run_child(_fill, path, 16 << 20)
    assert code == 0, f"the writer process died (exit {code}; -7 is SIGBUS)"
    kind, msg = got
    assert kind == "space"
    assert "\n" not in msg and small_tmpfs in msg and "16.0 MiB" in msg and "ring_bytes" in msg
    assert not [f for f in os.listdir(os.path.join(small_tmpfs, "inst"))], "no file left behind"
    # What fits is reserved whole at creation: the space is taken before the first write.
    before = shutil.disk_usage(small_tmpfs).used
    w = RingWriter(ring_path(small_tmpfs, "inst", 1), 4 << 20)
    assert shutil.disk_usage(small_tmpfs).used - before >= 4 << 20
    w.close(unlink=True)


def _write_through_truncation(path: str, q) -> None:
    w = RingWriter(path, 1 << 20)
    r = RingReader(path)
    data = np.ones((4, 1024), np.float32)
    table = RequestTable([RequestRef("req")])
    rows = np.ascontiguousarray([[0] * 4, [0, 1, 2, 3], [0] * 4], dtype=np.int32)
    ok = 0
    for k in range(200):
        if k == 50:
            os.truncate(path, 0)  # someone with write access to the file
        res = w.reserve_rows(table, rows, LOGITS, dtype=rf.DType.FLOAT32, width=1024, step=k)
        if res is not None:
            res.payload[:] = data.view(np.uint8).reshape(-1)
            w.commit(res)
            ok += 1
        w.write_control("req", EndMeta(reason="stop"))
        if k < 50:
            r.poll()
    q.put((ok, w.lost()))


def test_a_truncated_ring_file_is_abandoned_not_a_sigbus(shm_dir):
    path = ring_path(shm_dir, "inst", 0)
    code, got = _run_child(_write_through_truncation, path)
    assert code == 0, f"the writer process died (exit {code}; -7 is SIGBUS)"
    ok, lost = got
    assert ok == 50, "every write after the truncation is dropped"
    assert lost == {"records": 150, "control": 150}


def test_control_records_a_reader_never_takes_are_bounded_and_counted(shm_dir):
    path = ring_path(shm_dir, "inst", 0)
    w = RingWriter(path, 1 << 16, max_backlog_records=1000, max_backlog_bytes=1 << 20)
    refs = [RequestRef(f"request-{i:04d}") for i in range(32)]
    table = RequestTable(refs)
    slots = np.repeat(np.arange(32), 1)
    for step in range(2000):  # nobody reads: the ring fills, then every record is dropped
        rows = np.ascontiguousarray([slots, np.full(32, step), np.zeros(32)], dtype=np.int32)
        w.reserve_rows(table, rows, LOGITS, dtype=rf.DType.FLOAT32, width=512, step=step)
        w.write_control(f"r{step}", EndMeta(reason="length", output_token_ids=list(range(64))))
    stats = w.stats()
    assert w.backlog_records() <= 1000 and w.backlog_bytes() <= 1 << 20
    assert stats["control_backlog"] == w.backlog_records()
    assert stats["control_dropped"] > 0
    # What is kept goes out in order once a reader comes; what was dropped is counted, not lost silently.
    r = RingReader(path)
    seen = 0
    while True:
        got = r.poll()
        seen += len(got)
        if w.flush() and not r.pending_bytes() and not got:
            break
    assert seen >= w.backlog_records()
    w.close(unlink=True)
