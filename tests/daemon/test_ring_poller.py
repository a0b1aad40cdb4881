"""The ring poller's read cursors with a journal: a ring's file cursor moves only to where the daemon
says nothing read below it is still needed (daemon/ring_poller.py: floors, uncommitted, commit), and
where an earlier run's journal says it had read to. A real shm directory, a real writer and reader;
what the poller tells is collected by a plain RingFacts."""

from __future__ import annotations

import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap.daemon.access import RingAccess
from vllm_tap.daemon.config import DaemonConfig
from vllm_tap.daemon.ring_poller import HOLD_SHARE, RingPoller
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_reader import read_info
from vllm_tap.ring_records import TensorId
from vllm_tap.ring_writer import RingWriter

LOGITS = TensorId(rf.TensorKind.LOGITS)
CAPACITY = 1 << 16


class Told:
    """What the poller tells (ring_poller.RingFacts), kept."""

    def __init__(self) -> None:
        self.records: list = []
        self.resumed: list[tuple[str, str, int]] = []

    def ring_resumed(self, instance, ring, replay_until=0):
        self.resumed.append((instance, ring, replay_until))

    def record(self, instance, record, now, path):
        self.records.append(record)

    def rejected(self, *args):
        pass

    def ring_read(self, *args):
        pass

    def writer_gone(self, *args):
        pass

    def ring_closed(self, *args):
        pass


def _poller(shm_dir: str, told: Told) -> RingPoller:
    p = RingPoller(shm_dir, RingAccess.from_config(DaemonConfig(shm_dir=shm_dir)), told)
    p.defer_commit = True
    return p


def _write(w: RingWriter, n: int, width: int = 16) -> None:
    for k in range(n):
        pos = np.asarray([k], np.int32)
        assert w.write("r", LOGITS, pos, pos, np.zeros((1, width), np.float32))


def test_a_rings_cursor_stays_at_what_is_held_up_to_a_share_of_the_ring(shm_dir):
    path = ring_path(shm_dir, "i", 0)
    w = RingWriter(path, CAPACITY)
    told = Told()
    p = _poller(shm_dir, told)
    try:
        _write(w, 4)
        p.discover(0.0)
        assert p.read()
        key = ("i", "rank-00000.ring", told.records[0].epoch)
        cursors = [rec.cursor for rec in told.records]
        read = p.rings[0].reader.read_cursor
        floors = p.floors(True)
        assert floors == {key: 0}
        assert p.uncommitted(floors, {key: cursors[2]}) == [(*key, cursors[2], read)]  # records 2 and 3 held
        p.commit()
        assert read_info(path).read_cursor == cursors[2]
        # Nothing read since: what is held is looked at again only when asked (the daemon's tick) ...
        assert p.floors(False) == {} and p.floors(True) == {key: cursors[2]}
        # ... and with the same hold there is nothing to journal: the cursor stays.
        assert p.uncommitted(p.floors(True), {key: cursors[2]}) == []
        # The hold went (its capture filed it): the cursor goes to what was read, without a read.
        assert p.uncommitted(p.floors(True), {}) == [(*key, read, read)]
        p.commit()
        assert read_info(path).read_cursor == read and p.floors(True) == {}
        # A hold further behind what was read than capacity / HOLD_SHARE is given up: the writer's room.
        _write(w, 2 * CAPACITY // HOLD_SHARE // 96)
        assert p.read()
        read2 = p.rings[0].reader.read_cursor
        assert read2 - read > CAPACITY // HOLD_SHARE
        assert p.uncommitted(p.floors(True), {key: read}) == [(*key, read2, read2)]
        p.commit()
        assert read_info(path).read_cursor == read2
    finally:
        p.close()
        w.close()


def test_a_restarted_reader_goes_on_from_the_journal_and_reads_the_held_records_again(shm_dir):
    path = ring_path(shm_dir, "i", 0)
    w = RingWriter(path, CAPACITY)
    told = Told()
    p = _poller(shm_dir, told)
    _write(w, 6)
    p.discover(0.0)
    p.read()
    cursors = [rec.cursor for rec in told.records]
    epoch = told.records[0].epoch
    read = p.rings[0].reader.read_cursor
    # Killed (p is left as it is) with the file's cursor at record 1, its journal saying: below record 3
    # all is filed, read up to the end.
    p.rings[0].reader.commit(cursors[1])
    again = Told()
    q = _poller(shm_dir, again)
    q.resume = {("i", "rank-00000.ring"): (epoch, cursors[3], read)}
    try:
        q.discover(0.0)
        q.read()
        assert [rec.cursor for rec in again.records] == cursors[3:]
        assert again.resumed == [("i", "rank-00000.ring", read)]
        assert read_info(path).read_cursor == cursors[3]
    finally:
        q.close()
        p.close()
        w.close()
