"""A restarted daemon adopts its predecessor's arena: retained captures stay fetchable and watchable
under their sequence numbers, bit for bit, after a SIGKILL as after a SIGTERM; captures in flight go
on; and a torn or hostile journal is refused, not believed.

Real daemon processes on a real shm directory, traffic from the synthetic engine
(tests/support/synthetic_writer.py), whose values the test recomputes exactly.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest

from synthetic_writer import Scenario, SyntheticEngine, assert_capture, capture_arrays, expected
from waiting import wait_until
from vllm_tap import ring_format as rf
from vllm_tap.client import CaptureNotFound, LostCaptures
from vllm_tap.daemon import journal_format as jf


def _fetch_all(client, sc: Scenario, which) -> dict[str, object]:
    return {sc.request_id(i): client.fetch(sc.request_id(i), timeout=30) for i in which}


def _finish(eng: SyntheticEngine, which: list[int]) -> None:
    for r in eng.reqs:
        r.ended = r.i not in which
    eng.begin(which)
    while eng.run_step():
        pass
    assert eng.flush() and eng.dropped == 0


def _same(a, b) -> None:
    x, y = capture_arrays(a), capture_arrays(b)
    assert sorted(x) == sorted(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and x[k].tobytes() == y[k].tobytes(), k
    assert list(a.missing_positions) == list(b.missing_positions)
    assert (a.finish_reason, a.expected, a.end_position) == (b.finish_reason, b.expected, b.end_position)


def _settled(d) -> None:
    """The daemon has read, filed and journaled what the rings hold (its journal stops growing)."""
    last = [-1, 0]

    def quiet() -> bool:
        n = d.status()["arena"]["journal"]["written_bytes"]
        last[1] = last[1] + 1 if n == last[0] else 0
        last[0] = n
        return last[1] >= 5

    wait_until(quiet, 20, "a quiet journal", every=0.05)


def _rewind(shm_dir: str, instance: str) -> None:
    """Every ring's read cursor back at its start, as if no daemon had moved it."""
    for name in os.listdir(os.path.join(shm_dir, instance)):
        with open(os.path.join(shm_dir, instance, name), "r+b") as f:
            f.seek(rf.READ_CURSOR_OFFSET)
            f.write(bytes(8))


def _watch_seqs(client, since: int, n: int) -> dict[str, int]:
    seqs: dict[str, int] = {}
    with client.watch(since=since) as w:
        for cap in w:
            if isinstance(cap, LostCaptures):
                continue
            seqs[cap.request_id] = cap.seq
            if len(seqs) == n:
                break
    return seqs


def _served(daemon_factory, shm_dir, n: int):
    """A daemon that delivered n finished captures of two ranks: (daemon, scenario, engine, the captures)."""
    d = daemon_factory(end_grace_s=1.0)
    sc = Scenario(n_requests=n, tp=2, prompt_len=6, gen_len=10, chunk=4, ring_bytes=4 << 20)
    eng = SyntheticEngine(sc, shm_dir)
    _finish(eng, list(range(n)))
    return d, sc, eng, _fetch_all(d.client(), sc, range(n))


def _same_again(d, sc: Scenario, before: dict):
    """Once the restarted daemon has read and journaled what the rings hold, its captures are
    `before`, bit for bit: (a client, its status)."""
    _settled(d)
    c = d.client()
    after = _fetch_all(c, sc, range(len(before)))
    for rid, cap in before.items():
        _same(cap, after[rid])
    return c, d.status()


def _served_then_killed(daemon_factory, shm_dir):
    """_served with 4 captures, their watch numbers taken, everything journaled, then a SIGKILL:
    (daemon, scenario, engine, the captures, their numbers)."""
    d, sc, eng, before = _served(daemon_factory, shm_dir, 4)
    try:
        seqs = _watch_seqs(d.client(), 0, 4)
        _settled(d)
        d.kill()
    except BaseException:
        eng.close()
        raise
    return d, sc, eng, before, seqs


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_retained_captures_survive_a_restart_bit_for_bit_under_their_numbers(daemon_factory, shm_dir, how):
    d, sc, eng, before = _served(daemon_factory, shm_dir, 6)
    try:
        c = d.client()
        for i in range(6):
            assert_capture(sc, i, capture_arrays(before[sc.request_id(i)]))
        seqs = _watch_seqs(c, 0, 6)
        if how == "SIGKILL":  # right after: what was sent is in the journal
            d.kill()
        else:
            assert d.stop(timeout=60) == 0
        d.start()
        st = d.status()
        assert st["arena"]["adopted"]["captures"] == 6, st["arena"]
        c = d.client()
        after = _fetch_all(c, sc, range(6))
        for i in range(6):
            _same(before[sc.request_id(i)], after[sc.request_id(i)])
            assert_capture(sc, i, capture_arrays(after[sc.request_id(i)]))
        assert _watch_seqs(c, 0, 6) == seqs  # under the numbers they had
    finally:
        eng.close()


def test_a_capture_in_flight_at_a_sigkill_goes_on_with_what_was_filed(daemon_factory, shm_dir):
    d = daemon_factory(end_grace_s=1.0)
    sc = Scenario(n_requests=2, tp=2, prompt_len=6, gen_len=16, chunk=4, ring_bytes=4 << 20)
    eng = SyntheticEngine(sc, shm_dir)
    try:
        eng.begin([0, 1])
        for _ in range(6):
            eng.run_step()
        assert eng.flush()
        wait_until(lambda: d.status()["arena"]["journal"]["captures"] == 2, 10, "the journal's two captures")
        _settled(d)
        d.kill()
        for _ in range(3):  # written while no daemon runs
            eng.run_step()
        d.start()
        assert d.status()["arena"]["adopted"]["in_flight"] == 2
        while eng.run_step():
            pass
        assert eng.flush()
        c = d.client()
        for i in range(2):
            cap = c.fetch(sc.request_id(i), timeout=30)
            lo, hi = cap.expected
            got = cap.positions.tolist()
            missing = list(cap.missing_positions)
            assert sorted(got + missing) == list(range(lo, hi)), (got, missing)
            # The position held back for a later one (async scheduling), read and not filed, is read
            # again: the rings' cursors had stayed below it.
            assert missing == [], missing
            arrays, want = capture_arrays(cap), expected(sc, i)
            for name in ("logits", "hidden.0", "hidden.2", "token_ids"):
                assert arrays[name].tobytes() == want[name][got].tobytes(), name
    finally:
        eng.close()


def test_a_daemon_killed_again_and_again_while_it_reads_a_backlog_loses_no_position(daemon_factory, shm_dir):
    """80 whole captures (BEGIN, data, END) wait in the rings; the daemon reading them is SIGKILLed at
    random moments, 6 times, and restarted each time. Every capture comes back once, ended by its
    END, its values exact: a record read and not yet journaled is read again by the next daemon (a
    ring's cursor moves only once the journal has what was read there), one journaled is not read
    twice (the journal says how far each ring was read), an END read is kept, and what it held
    unfiled (a step waiting for its other tensors, the newest position) is read again: no position
    is missing. (Before: the records a killed daemon had read and not yet journaled were lost:
    captures ended `end lost`, positions missing; later, what it held unfiled was, one position a
    kill.)"""
    n = 80
    sc = Scenario(n_requests=n, tp=1, prompt_len=8, gen_len=100, chunk=8, vocab=1024, hidden=128,
                  ring_bytes=128 << 20)
    d = daemon_factory(end_grace_s=1.0, start=False)
    eng = SyntheticEngine(sc, shm_dir)
    try:
        _finish(eng, list(range(n)))  # the backlog, written while no daemon runs
        rng = random.Random(20261128)
        for _ in range(6):
            d.start()
            time.sleep(rng.uniform(0.0, 0.4))
            d.kill()
        d.start()
        c = d.client()
        missing = 0
        for i in range(n):
            cap = c.fetch(sc.request_id(i), timeout=60)
            got, lost = cap.positions.tolist(), list(cap.missing_positions)
            assert cap.finish_reason == "length" and cap.expected == (0, sc.end_position), (i, cap.finish_reason)
            assert sorted(got + lost) == list(range(*cap.expected)), (i, lost)
            arrays, want = capture_arrays(cap), expected(sc, i)
            for name in ("logits", "hidden.0", "hidden.2", "token_ids"):
                assert arrays[name].tobytes() == want[name][got].tobytes(), (i, name)
            missing += len(lost)
        assert missing == 0, missing
        st = d.status()
        assert st["retained_requests"] == n and st["requests_in_flight"] == 0, st["retained_requests"]
    finally:
        eng.close()


def test_records_a_killed_daemon_journaled_are_not_read_twice(daemon_factory, shm_dir):
    """The daemon is killed after its journal said how far it had read each ring and before the
    rings' own cursors moved there (here: the cursors are put back to the start): the next daemon
    reads on from the journal's cursors. Nothing is filed twice: the same 4 captures under the same
    numbers, bit for bit. (Reading from the rings' cursors would file each capture again, a new
    capture of what it read twice.)"""
    d, sc, eng, before, seqs = _served_then_killed(daemon_factory, shm_dir)
    try:
        _rewind(shm_dir, sc.instance)
        d.start()
        assert "where the earlier run's journal says it had read to" in d.log()
        c, st = _same_again(d, sc, before)
        assert st["retained_requests"] == 4 and st["requests_in_flight"] == 0, st["retained_requests"]
        assert _watch_seqs(c, 0, 4) == seqs
    finally:
        eng.close()


def _without_read_frames(arena_dir: str) -> None:
    """Every journal segment without its Read frames (what a write cut part-way loses last)."""
    for name in os.listdir(arena_dir):
        if not name.startswith(jf.JOURNAL_PREFIX):
            continue
        path = os.path.join(arena_dir, name)
        with open(path, "rb") as f:
            blob = f.read()
        kept, at = bytearray(), 0
        while at < len(blob):
            length, _ = jf.FRAME.unpack_from(blob, at)
            end = at + jf.FRAME.size + length
            if type(next(jf.frames(blob[at:end]))) is not jf.Read:
                kept += blob[at:end]
            at = end
        assert len(kept) < len(blob)
        with open(path, "r+b") as f:
            f.write(kept)
            f.truncate()


def test_records_read_again_past_the_journals_cursors_file_nothing_twice(daemon_factory, shm_dir):
    """The journal lost its Read frames (a kill part-way through a write loses them first; here all
    of them) and the rings' cursors are put back to the start: the next daemon reads every record
    again, and files nothing twice. The journal has where each capture's BEGIN record lies in the
    engine ring, so that record starts nothing, nor do the data and ENDs of the captures it finished:
    the same 4 captures under the same numbers, bit for bit, none started. (Before: each capture
    was filed a second time.)"""
    d, sc, eng, before, seqs = _served_then_killed(daemon_factory, shm_dir)
    try:
        _without_read_frames(shm_dir.rstrip("/") + ".arena")
        _rewind(shm_dir, sc.instance)
        d.start()
        c, st = _same_again(d, sc, before)
        # The 4 BEGIN records met again; the data and ENDs of finished captures, as late records.
        assert st["reassembly"]["requests_started"] == 0 and st["reassembly"]["replayed_records"] == 4, \
            st["reassembly"]
        assert st["reassembly"]["late_records"] > 0 and st["retained_requests"] == 4
        assert _watch_seqs(c, 0, 4) == seqs
    finally:
        eng.close()


def test_a_sigterm_with_nothing_retained_leaves_no_arena_behind(daemon_factory, shm_dir):
    d = daemon_factory(end_grace_s=1.0)
    assert d.stop(timeout=30) == 0
    arena_dir = shm_dir.rstrip("/") + ".arena"
    left = os.listdir(arena_dir) if os.path.isdir(arena_dir) else []
    assert left == [], left


def test_a_torn_journal_adopts_what_precedes_the_tear(daemon_factory, shm_dir):
    d = daemon_factory(end_grace_s=1.0)
    sc = Scenario(n_requests=4, tp=1, prompt_len=6, gen_len=6, chunk=4, ring_bytes=4 << 20)
    eng = SyntheticEngine(sc, shm_dir)
    try:
        _finish(eng, [0, 1])
        _fetch_all(d.client(), sc, [0, 1])  # sent, so in the journal (it is written before anything goes out)
        size = d.status()["arena"]["journal"]["bytes"]
        _finish(eng, [2, 3])
        _fetch_all(d.client(), sc, [2, 3])
        d.kill()
        arena_dir = shm_dir.rstrip("/") + ".arena"
        (seg,) = [n for n in os.listdir(arena_dir) if n.startswith(jf.JOURNAL_PREFIX)]
        path = os.path.join(arena_dir, seg)
        with open(path, "r+b") as f:  # a byte flipped in the first frame after the first two captures
            f.seek(size + jf.FRAME.size + 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
        d.start()
        assert "fails its crc" in d.log()
        c = d.client()
        assert d.status()["arena"]["adopted"]["captures"] == 2
        for i in (0, 1):
            assert_capture(sc, i, capture_arrays(c.fetch(sc.request_id(i), timeout=10)))
        for i in (2, 3):
            with pytest.raises(CaptureNotFound):
                c.fetch(sc.request_id(i), timeout=1)
    finally:
        eng.close()


def test_a_journal_others_may_write_is_not_replayed(daemon_factory, shm_dir):
    d, sc, eng, _ = _served(daemon_factory, shm_dir, 1)
    try:
        d.kill()
        arena_dir = shm_dir.rstrip("/") + ".arena"
        for n in os.listdir(arena_dir):
            if n.startswith(jf.JOURNAL_PREFIX):
                os.chmod(os.path.join(arena_dir, n), 0o666)
        d.start()
        assert "not a private file" in d.log()
        assert d.status()["arena"]["adopted"]["captures"] == 0
        with pytest.raises(CaptureNotFound):
            d.client().fetch(sc.request_id(0), timeout=1)
    finally:
        eng.close()


# -- the journal read back, without a daemon: replay rules and what a hostile journal gets --


def _arena(tmp_path, capacity: int = 1 << 20):
    from vllm_tap.daemon.arena import Arena

    return Arena.create(str(tmp_path), capacity)


def _journal(arena, *entries) -> bytes:
    head = jf.SegmentHead(jf.JOURNAL_VERSION, arena.arena_id, arena.capacity, 1, True, os.getpid())
    return b"".join(jf.frame(e) for e in (head, *entries))


def _began(seq: int, rid: str = "r") -> jf.Began:
    return jf.Began(seq, "default", rid, "", 2, [5, 6], 1, "m", None, 0, False, "client", 0.0)


def _ended(seq: int, missing=(), delivered: int = 4) -> jf.Ended:
    return jf.Ended(seq, "stop", 2, 2, [7, 8], 4, (0, 4), list(missing), delivered, "client", 0.0)


def _data(arena, seq: int, start: int, n: int, cols: int = 8, *, fill: float = 1.0, **override) -> jf.Data:
    arr = arena.alloc((n, cols), np.float32)
    arr[:] = fill
    block, blocks, gen, offset = arena.region_of(arr)
    _data.keep.append(arr)  # the daemon's store would hold it
    ref = dict(name="logits", dtype=1, rows=n, cols=cols, block=block, blocks=blocks, gen=gen, offset=offset)
    ref.update(override)
    return jf.Data(seq, start, np.arange(start, start + n, dtype="<i4").tobytes(), 2, [jf.Ref(**ref)])


_data.keep = []


def _adopt(tmp_path, build):
    """Write a journal over a live arena, then adopt it as the next daemon would (its regions now
    the journal's only claim on that memory)."""
    from vllm_tap.daemon import adoption
    from vllm_tap.daemon.arena import Arena

    a = _arena(tmp_path)
    blob = build(a)
    a.close(keep=True)
    _data.keep.clear()
    b = Arena.reopen(str(tmp_path), a.arena_id, a.capacity)
    assert b is not None
    out = adoption.captures(adoption.replay(a.arena_id, [blob]).logs, b, now=1.0)
    b.end_adoption()
    return out, b


def test_adopted_arrays_are_described_where_they_lie(tmp_path):
    """Several tensors of one region (the sections of one ring record): each adopted array is
    located, for descriptors to subscribers, at its own offset, not at its region's start."""
    def build(a):
        whole = a.alloc((3, 64), np.float32)
        whole[:] = np.arange(3)[:, None]
        _data.keep.append(whole)
        block, blocks, gen, offset = a.region_of(whole)
        refs = [jf.Ref(f"t{k}", 1, 1, 64, block, blocks, gen, offset + k * 256) for k in range(3)]
        return _journal(a, _began(1), jf.Data(1, 0, np.zeros(1, "<i4").tobytes(), 2, refs))

    out, arena = _adopt(tmp_path, build)
    (tok,) = [e for e in out[0].history if type(e).__name__ == "Tokens"]
    for k in range(3):
        arr = tok.tensors[f"t{k}"]
        assert arr.tolist() == [[float(k)] * 64]
        assert arena.locate(arr)[2] - arena.locate(tok.tensors["t0"])[2] == k * 256


def test_replay_follows_begin_data_end_forget_and_a_checkpoint(tmp_path):
    from vllm_tap.daemon import adoption

    def build(a):
        return _journal(a, _began(1), _data(a, 1, 0, 2), _data(a, 1, 2, 2, fill=2.0), _ended(1),
                        _began(2, "gone"), jf.Forgot(2), _began(3, "shed"), _data(a, 3, 0, 2), jf.Shed(3, "over budget"))

    out, arena = _adopt(tmp_path, build)
    assert [c.seq for c in out] == [1, 3]
    one = out[0].history
    assert [type(e).__name__ for e in one] == ["Begin", "Tokens", "Tokens", "End"]
    assert one[2].tensors["logits"].tolist() == [[2.0] * 8] * 2 and one[3].delivered == 4
    assert [type(e).__name__ for e in out[1].history] == ["Begin", "Gap"] and out[1].history[1].reason == "over budget"
    # a checkpoint segment forgets what came before it
    blob2 = _journal(arena, _began(9, "later"))
    assert list(adoption.replay(arena.arena_id, [_journal(arena, _began(1)), blob2]).logs) == [9]


def test_replay_keeps_the_end_read_of_a_capture_in_flight_and_the_last_cursor_of_each_ring(tmp_path):
    from vllm_tap.daemon import adoption

    ending = jf.Ending(1, "length", 2, 2, [7, 8], 4, None, "client")
    late = jf.Ending(2, "stop", 2, 2, [7, 8], 4, None, "client")

    def build(a):
        return _journal(a, _began(1), _data(a, 1, 0, 2), jf.Read("default", "rank-00000.ring", 5, 128, 192), ending,
                        _began(2, "ended"), _data(a, 2, 0, 4), _ended(2), late,
                        jf.Read("default", "rank-00000.ring", 5, 448, 512), jf.Read("default", "engine.ring", 6, 64, 64))

    from vllm_tap.daemon.arena import Arena

    a = _arena(tmp_path)
    blob = build(a)
    bad = _journal(a, _began(3), jf.Ending(3, "length", 2, 2, [7, 8], -1, None, "client"))
    a.close(keep=True)
    _data.keep.clear()
    r = adoption.replay(a.arena_id, [blob])
    assert r.logs[1].end_read == ending and r.logs[2].end_read is None  # an END read after its End: nothing
    assert r.reads == {("default", "rank-00000.ring"): (5, 448, 512), ("default", "engine.ring"): (6, 64, 64)}
    b = Arena.reopen(str(tmp_path), a.arena_id, a.capacity)
    (one, two) = adoption.captures(r.logs, b, now=1.0)
    assert one.end_read == ending and one.ended_wall is None and two.end_read is None
    assert adoption.captures(adoption.replay(a.arena_id, [bad]).logs, b, now=1.0) == []  # an END out of bounds
    b.end_adoption()


@pytest.mark.parametrize("bad", ["gen", "block", "offset", "overlap"])
def test_a_reference_the_arena_does_not_back_is_a_gap_the_end_counts(tmp_path, bad):
    def build(a):
        good = _data(a, 1, 0, 2)
        if bad == "gen":
            wrong = _data(a, 1, 2, 2, gen=12345)
        elif bad == "block":
            wrong = _data(a, 1, 2, 2, block=a.n_blocks + 5)
        elif bad == "offset":
            wrong = _data(a, 1, 2, 2, offset=a.capacity - 4)
        else:  # a region that claims to overlap the first one
            r = good.tensors[0]
            wrong = _data(a, 1, 2, 2, block=r.block + 1 if r.blocks > 1 else r.block, blocks=r.blocks + 1)
        return _journal(a, _began(1), good, wrong, _ended(1))

    out, _ = _adopt(tmp_path, build)
    (c,) = out
    kinds = [type(e).__name__ for e in c.history]
    assert kinds == ["Begin", "Tokens", "Gap", "End"], kinds
    assert c.history[2].reason == "not captured: consumed by a previous daemon"
    end = c.history[-1]
    assert list(end.missing_positions) == [2, 3] and end.delivered == 2


def test_positions_that_do_not_follow_refuse_the_capture(tmp_path):
    def build(a):
        return _journal(a, _began(1), _data(a, 1, 0, 2), _data(a, 1, 5, 2), _ended(1), _began(2, "fine"),
                        _data(a, 2, 0, 2), _ended(2, delivered=2))

    out, _ = _adopt(tmp_path, build)
    assert [c.seq for c in out] == [2]


def test_a_torn_frame_ends_the_replay_and_keeps_what_came_before(tmp_path):
    from vllm_tap.daemon import adoption

    a = _arena(tmp_path)
    blob = _journal(a, _began(1), _began(2, "two"))
    torn = blob[:-3]
    assert list(adoption.replay(a.arena_id, [torn]).logs) == [1]
    flipped = bytearray(blob)
    flipped[-1] ^= 0x55
    assert list(adoption.replay(a.arena_id, [bytes(flipped)]).logs) == [1]
    garbage = blob + jf.FRAME.pack(5, 0) + b"\xc1\xc1\xc1\xc1\xc1"
    assert list(adoption.replay(a.arena_id, [garbage]).logs) == [1, 2]
    other = _journal(a, _began(1))
    assert adoption.replay(a.arena_id + 2, [other]).logs == {}


def test_adopting_an_arena_gives_back_the_memory_its_captures_do_not_hold(tmp_path):
    """What no adopted capture holds goes back to tmpfs: an adopted arena costs what it holds, however
    much of it the earlier run had touched (zeroing it instead would fault in every page)."""
    from vllm_tap.daemon.arena import Arena

    a = Arena.create(str(tmp_path), 64 << 20)
    keep = a.alloc((4, 1024), np.float32)
    keep[:] = 3.0
    churn = [a.alloc((1024, 1024), np.float32) for _ in range(40)]  # 160 MiB asked, 64 MiB arena: some fit
    for x in churn:
        if x is not None:
            x[:] = 1.0
    block, blocks, gen, offset = a.region_of(keep)
    path = a.path
    used_before = os.stat(path).st_blocks * 512
    a.close(keep=True)
    b = Arena.reopen(str(tmp_path), a.arena_id, 64 << 20)
    region = b.adopt_region(block, blocks, gen)
    view = b.view(region, offset, (4, 1024), np.float32)
    assert b.end_adoption() == 1
    b.sweep(None)
    used_after = os.stat(path).st_blocks * 512
    assert used_before > 32 << 20 and used_after < 4 << 20, (used_before, used_after)
    assert view.tolist() == [[3.0] * 1024] * 4
    fresh = b.alloc((1024, 1024), np.float32)  # what was given back is handed out again, all zeros
    assert fresh is not None and not fresh.any()


def test_the_journal_stays_bounded_and_replays_what_is_held_across_segments(tmp_path, monkeypatch):
    """Many captures filed and let go, two held throughout: segments roll, those no held capture
    needs are removed, the held ones are written again when old segments hold much more than they
    need, and a replay of what is left gives exactly the captures held, with their values."""
    from vllm_tap.daemon import adoption
    from vllm_tap.daemon import journal as jmod
    from vllm_tap.daemon.arena import Arena
    from vllm_tap.daemon.events import Begin, End, new_tokens
    from vllm_tap.daemon.store import Store
    from vllm_tap.positions import PositionRanges

    monkeypatch.setattr(jmod, "SEGMENT_BYTES", 4096)
    monkeypatch.setattr(jmod, "MIN_RELOCATE_BYTES", 16384)
    a = _arena(tmp_path, 16 << 20)
    j = jmod.Journal.start(a, [], 1, [])
    store = Store(1 << 40, 1e9)
    store.on_drop = j.dropped

    def file(seq: int) -> None:
        rid = f"r{seq}"
        evs = [Begin("default", rid, "", 2, [1, 2], 1, "m", None, 0, False, False, 0.0)]
        for p in range(3):
            arr = a.alloc((1, 16), np.float32)
            arr[:] = seq * 10 + p
            pos = np.array([p], np.int32)
            evs.append(new_tokens("default", rid, pos, pos + 100, 2, {"logits": arr}, {"logits": 1}, 0.0, 72))
        evs.append(End("default", rid, "length", 2, 1, [5], 3, (0, 3), PositionRanges(), 3, 0.0))
        for ev in evs:
            e = store.add(ev, 0.0)
            if type(ev) is Begin:
                e.seq = seq
            j.filed(ev, e)

    for seq in range(1, 301):
        file(seq)
        if seq > 2:
            e = store.get(("default", f"r{seq - 1}")) if seq > 3 else None
            if e is not None:
                store._drop(e, "evicted")  # all but the first two go soon after they end
        if seq % 7 == 0:
            j.tick()
    j.tick()
    j.tick()
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith(jf.JOURNAL_PREFIX))
    assert j.relocated_bytes > 0 and len(names) <= 8, (j.snapshot(), names)
    blobs = [open(tmp_path / n, "rb").read() for n in names]
    logs = adoption.replay(a.arena_id, blobs).logs
    assert sorted(logs) == [1, 2, 300]
    j.close(keep=True)
    a.close(keep=True)
    b = Arena.reopen(str(tmp_path), a.arena_id, 16 << 20)
    for c in adoption.captures(logs, b, now=1.0):
        toks = [ev for ev in c.history if type(ev).__name__ == "Tokens"]
        assert [t.tensors["logits"][0, 0] for t in toks] == [c.seq * 10 + p for p in range(3)]
        assert type(c.history[-1]).__name__ == "End"
    b.end_adoption()
    j2 = jmod.Journal.start(b, [], 99, names)  # the next run's journal replaces the segments it replayed
    j2.close(keep=False)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(jf.JOURNAL_PREFIX)]


def test_a_capture_handed_over_by_one_stop_is_whole_after_the_next(daemon_factory, shm_dir):
    """In flight at a SIGTERM (handed over, continued by the next daemon), finished, then another
    SIGTERM: the third daemon adopts it whole. (Before: what the handover carried lay outside the
    arena, the journal could not name it, and the third daemon had it as a Gap its End did not list.)"""
    d = daemon_factory(end_grace_s=1.0)
    # rows of 32 KiB: what the handover carries is more than the journal writes inline
    sc = Scenario(n_requests=1, tp=1, prompt_len=6, gen_len=30, chunk=4, vocab=8192, ring_bytes=16 << 20)
    eng = SyntheticEngine(sc, shm_dir)
    try:
        eng.begin([0])
        for _ in range(8):
            eng.run_step()
        assert eng.flush()
        _settled(d)
        assert d.stop(timeout=60) == 0
        d.start()
        while eng.run_step():
            pass
        assert eng.flush()
        first = d.client().fetch(sc.request_id(0), timeout=30)
        assert_capture(sc, 0, capture_arrays(first))
        assert d.stop(timeout=60) == 0
        d.start()
        assert d.status()["arena"]["adopted"]["captures"] == 1
        again = d.client().fetch(sc.request_id(0), timeout=30)
        assert list(again.missing_positions) == [] and again.complete
        assert_capture(sc, 0, capture_arrays(again))
    finally:
        eng.close()


def test_a_begin_out_of_bounds_refuses_its_capture_and_nothing_else(tmp_path):
    def build(a):
        bad = jf.Began(1, "default", "r", "", -5, None, 0, "m", None, -3, False, "client", 0.0)
        return _journal(a, bad, _data(a, 1, 0, 2), _ended(1), _began(2, "fine"), _data(a, 2, 0, 2),
                        _ended(2, delivered=2))

    out, _ = _adopt(tmp_path, build)
    assert [c.seq for c in out] == [2]
