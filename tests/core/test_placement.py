"""Where a ring's writer runs (vllm_tap/placement.py), in its header: written once by the writer,
read back by the reader exactly, and refused when the bytes there are not a placement (a ring file
is untrusted)."""

from __future__ import annotations

import os

import msgspec
import pytest

from vllm_tap import placement as pl
from vllm_tap import ring_format as rf
from vllm_tap.ring_files import RingFormatError
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_writer import RingWriter


def _placement(**kw) -> pl.Placement:
    base = dict(host="node-b", address="10.77.0.2", node_rank=1, nnodes=2, instance="default", home="10.77.0.1:29511",
                world_size=4, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, stage_layers=[[0, 2], [4]], writers=[0, 1],
                settings=pl.settings_hash({"layers": [2, 4]}))
    base.update(kw)
    return pl.Placement(**base)


def test_a_rings_placement_reads_back_as_written(shm):
    p = _placement()
    w = RingWriter(f"{shm}/inst/rank-00003.ring", 1 << 16, rank=3, world_size=4, wake_daemon=False,
                   placement=pl.encode(p))
    r = RingReader(w.path)
    try:
        assert r.placement == p and r.info().placement == p
    finally:
        r.close()
        w.close(unlink=True)


def test_a_ring_without_placement_reads_as_before(shm):
    w = RingWriter(f"{shm}/inst/rank-00000.ring", 1 << 16, wake_daemon=False)
    r = RingReader(w.path)
    try:
        assert r.placement is None
    finally:
        r.close()
        w.close(unlink=True)


def _forged(shm: str, body: bytes, length: int | None = None) -> str:
    """A ring whose placement area holds `body` with length `length` (default len(body))."""
    w = RingWriter(f"{shm}/inst/rank-00000.ring", 1 << 16, wake_daemon=False)
    path = w.path
    w.close()
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, rf.placement_len_struct().pack(len(body) if length is None else length), rf.PLACEMENT_OFFSET)
        os.pwrite(fd, body, rf.PLACEMENT_OFFSET + 4)
    finally:
        os.close(fd)
    return path


@pytest.mark.parametrize("body, length, why", [
    (b"\xff\x00junk", None, "bad placement"),
    (msgspec.msgpack.encode({"host": "a", "address": "", "instance": "i", "home": 7}), None, "bad placement"),
    (msgspec.msgpack.encode({"host": "a" * 300, "address": "", "instance": "i", "home": "h:1"}), None, "bad placement"),
    (msgspec.msgpack.encode({"host": "a", "address": "", "instance": "i", "home": "h:1", "tp_size": 0}), None,
     "bad placement"),
    (b"", rf.PLACEMENT_MAX + 1, "placement of"),
], ids=["not-msgpack", "wrong-type", "too-long-a-name", "out-of-bounds", "length-past-the-header"])
def test_a_placement_that_is_not_one_refuses_the_ring(shm, body, length, why):
    with pytest.raises(RingFormatError, match=why):
        RingReader(_forged(shm, body, length))


def test_a_hosts_settings_hash_ignores_what_may_differ_per_host_only():
    a = {"layers": [16], "policy": {"share": 0.05}, "ring_bytes": 1 << 30}
    assert pl.settings_hash(a) == pl.settings_hash({**a, "ring_bytes": 256 << 20})
    assert pl.settings_hash(a) == pl.settings_hash(dict(reversed(list(a.items()))))
    assert pl.settings_hash(a) != pl.settings_hash({**a, "layers": [15]})


def test_a_placement_too_large_for_the_header_is_refused_by_the_writer(shm):
    with pytest.raises(ValueError, match="placement"):
        RingWriter(f"{shm}/inst/rank-00000.ring", 1 << 16, wake_daemon=False, placement=b"x" * (rf.PLACEMENT_MAX + 1))
