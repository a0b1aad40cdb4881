"""A full host: the shared-memory file system fills up after the daemon and the writers started.

Real daemon processes on a real tmpfs of a few MiB (mounted here; the tests need root), filled by
another file the way any local account can fill /dev/shm. The daemon's arena counts only tmpfs it
has reserved, so a full file system costs the arena (arrays go as frames, counted) and never a
ring or a position; memory of its own it cannot write is its own problem, never the ring's."""

from __future__ import annotations

import errno
import mmap
import multiprocessing as mp
import os
import subprocess
import tempfile

import numpy as np
import pytest

from synthetic_writer import Scenario, SyntheticEngine, assert_capture, capture_arrays, expected
from vllm_tap import ring_format as rf
from vllm_tap.client import Client
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_records import per_tensor

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (needs root)")


@pytest.fixture
def shm_dir():
    """The rings and the arena on a tmpfs of their own, small enough to fill in a moment."""
    mnt = tempfile.mkdtemp(prefix="vt-full-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0755", "tmpfs", mnt], check=True)
    try:
        yield os.path.join(mnt, "shm")
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)
        os.rmdir(mnt)


def fill(directory: str) -> int:
    """Write a file under `directory` until its file system has no room left; returns its bytes."""
    path = os.path.join(os.path.dirname(directory.rstrip("/")), "filler")
    block = b"\xa5" * (1 << 20)
    n = 0
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(block)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                break
    small = b"\xa5" * 4096
    with open(path + ".tail", "wb", buffering=0) as f:  # the last pages a MiB did not fit into
        while True:
            try:
                n += f.write(small)
            except OSError:
                break
    return n


def _fetch_in_child(endpoint: str, names: list[str], q) -> None:
    try:
        c = Client(endpoint)
        q.put({n: (capture_arrays(cap := c.fetch(n, timeout=30)), list(cap.missing_positions)) for n in names})
    except BaseException as e:  # report, don't hang the parent
        q.put(repr(e))


def test_a_shm_filled_after_start_costs_the_arena_never_a_ring_or_a_position(daemon_factory, shm_dir):
    # Large records (read straight into their arrays) and small ones (copied into them), both kinds
    # of write into the arena.
    sc = Scenario(tp=1, n_requests=6, vocab=8192, hidden=64, layers=(0,), gen_len=5, chunk=4, ring_bytes=4 << 20)
    d = daemon_factory(end_grace_s=1.0, arena_bytes=256 << 20)
    eng = SyntheticEngine(sc, shm_dir)
    assert fill(shm_dir) > 0
    names = [sc.request_id(i) for i in range(sc.n_requests)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_fetch_in_child, args=(d.endpoint, names, q))
    p.start()
    try:
        eng.run()
        assert eng.flush() and eng.dropped == 0
        got = q.get(timeout=60)
    finally:
        p.join(10)
        eng.close()
    assert d.alive(), d.log()
    assert isinstance(got, dict), f"{got}\n{d.log()}"
    for i, name in enumerate(names):
        arrays, missing = got[name]
        assert missing == [], (name, missing)
        assert_capture(sc, i, arrays)
    s = d.status()
    assert s["rings_broken"] == 0 and not s["broken_rings"], s["broken_rings"]
    a = s["arena"]
    # Nothing was placed in tmpfs it had not reserved, and it says why arrays went as frames.
    assert a["fallbacks"] > 0 and a["committed_bytes"] < 16 << 20, a
    assert "cannot reserve" in d.log()


def test_memory_of_its_own_that_cannot_be_written_is_read_privately_not_blamed_on_the_ring(shm_dir):
    # A destination that hands out pages of a file nothing reserved, on a full tmpfs: the read into them
    # fails (EFAULT). The reader must keep the ring and deliver the same bytes from its own memory.
    os.makedirs(shm_dir)
    sc = Scenario(tp=1, n_requests=2, vocab=8192, hidden=16, layers=(0,), gen_len=3, chunk=4, ring_bytes=4 << 20)
    eng = SyntheticEngine(sc, shm_dir)
    eng.run()
    hole_path = os.path.join(shm_dir, "holes")
    fd = os.open(hole_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 64 << 20)
    holes = mmap.mmap(fd, 64 << 20)
    fill(shm_dir)
    handed = []

    class Holes:
        def block(self, nbytes):
            if nbytes < 64 << 10:  # small records are copied, not read, into a destination's memory
                return None
            a = np.frombuffer(holes, np.uint8, count=nbytes, offset=len(handed) * (8 << 20))
            handed.append(a)
            return a

        def columns(self, *args):
            return None

    reader = RingReader(eng.ranks[0].path, destination=Holes())
    try:
        recs = [r for r in reader.poll() if r.kind == rf.RecordKind.DATA]
        assert handed, "no record was read through the destination"
        assert reader.destination_failures == len(handed) and reader.rejected == 0 and reader.corrupt == 0
        large = 0
        for rec in recs:
            large += rec.nbytes >= 64 << 10
            for r in per_tensor([rec]):
                assert all(not np.shares_memory(r.data, h) for h in handed)
                if r.data.shape[1] == sc.vocab:
                    i = int(r.request_id.rsplit("-", 1)[1])
                    assert r.data.tobytes() == expected(sc, i)["logits"][r.positions].tobytes()
        n_handed = len(handed)
        assert large == n_handed, (large, n_handed, [(rec.step, rec.nbytes) for rec in recs])
    finally:
        reader.close()
        del handed[:]
        os.close(fd)  # the mapping goes with the last array that views it
        eng.close()
