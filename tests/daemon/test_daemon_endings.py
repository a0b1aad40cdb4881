"""Every capture ends, says why, and accounts for every expected position: after a daemon restart,
when the END is lost, when the writer dies. Real daemon processes, real
rings, writers in this process or in a child process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from synthetic_writer import Scenario, SyntheticEngine, expected
from vllm_tap.client import CaptureLost, CaptureNotFound, Chunk, Client, Gap
from vllm_tap.daemon.events import END_LOST, NOT_CAPTURED_PREVIOUS, WRITER_GONE
from vllm_tap.ring_schema import BeginMeta, spec_field
from waiting import wait_until as _wait


def _read_everything(d, sc: Scenario) -> bool:
    """Every ring of `sc`'s engine found and read to its end. Counting the rings matters: a ring the
    daemon has not found yet holds data the next daemon reads from its start."""
    s = d.status()
    return len(s["rings"]) == sc.world + 1 and all(r["pending_bytes"] == 0 for r in s["rings"])


def _stream(client: Client, name: str, timeout: float = 20) -> tuple[list, object]:
    sub = client.subscribe(name, timeout=timeout)
    items = list(sub.chunks())
    return items, sub.end


def _every_position_once_in_order(items, stop: int) -> tuple[list[int], list[tuple[range, str]]]:
    """(positions delivered as data, gaps); asserts the items tile [0, stop) in order, once each."""
    nxt = 0
    data, gaps = [], []
    for it in items:
        if isinstance(it, Chunk):
            assert it.start == nxt, (it.start, nxt)
            data += it.positions.tolist()
            nxt = it.stop
        else:
            assert isinstance(it, Gap) and it.positions.start == nxt, (it, nxt)
            gaps.append((it.positions, it.reason))
            nxt = it.positions.stop
    assert nxt == stop, (nxt, stop)
    return data, gaps


# -- item 10: a daemon SIGKILLed and restarted while a request runs --


def _not_adoptable(d) -> None:
    """The next start asks for another arena size: the killed daemon's arena (and what its journal
    says it holds) cannot be adopted, as after a reboot, so the next daemon meets its captures half way."""
    d.settings["arena_bytes"] = 64 << 20


def _kill_after_the_first_positions(d, eng: SyntheticEngine, sc: Scenario, adopted: bool) -> None:
    """The engine writes positions 0..10, the daemon reads them and is SIGKILLed; unless `adopted`,
    its next start cannot adopt the arena."""
    eng.begin()
    for _ in range(5):
        eng.run_step()  # positions 0..10
    _wait(lambda: _read_everything(d, sc), what="the first daemon to read 0..10")
    d.kill()
    if not adopted:
        _not_adoptable(d)


@pytest.mark.parametrize("adopted", [True, False])
@pytest.mark.parametrize("end_before_restart", [False, True])
def test_a_new_subscriber_after_a_daemon_restart_gets_every_position_once_as_data_or_gap(
        daemon_factory, shm_dir, end_before_restart, adopted):
    """Killed after it read positions 0..10 (delivering 0..9, holding 10 back for a later one, the
    rings' cursors below it): a next daemon that adopts its arena delivers 0..9 again as data, then
    reads 10 again; one that cannot (the arena's size changed) meets the capture half way, at 10,
    the head one Gap. Either way every position once, in order, with the engine's values."""
    sc = Scenario(tp=2, n_requests=1, prompt_len=8, gen_len=12, chunk=4)
    d = daemon_factory(end_grace_s=1.0)
    eng = SyntheticEngine(sc, shm_dir)
    _kill_after_the_first_positions(d, eng, sc, adopted)
    if end_before_restart:
        while eng.run_step():  # 11..18 and the END, written while no daemon runs
            pass
    else:
        eng.run_step()  # 11: the request is still running when the new daemon starts
    d.start()
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=_stream(d.client(), sc.request_id(0))))
    t.start()  # a NEW subscriber: it never spoke to the first daemon
    while eng.run_step():
        pass
    t.join(30)
    items, end = got["r"]
    data, gaps = _every_position_once_in_order(items, sc.end_position)
    lost = range(0) if adopted else range(0, 10)
    assert gaps == ([(lost, NOT_CAPTURED_PREVIOUS)] if lost else []), gaps  # in order, where it belongs
    assert data == [p for p in range(sc.end_position) if p not in lost]
    assert end.reason == "length" and end.complete == (not lost) and end.missing_positions == list(lost)
    exp = expected(sc, 0)
    got_logits = np.concatenate([c.logits for c in items if isinstance(c, Chunk)])
    assert got_logits.tobytes() == exp["logits"][data].tobytes()


# -- item 11: the END never comes --


@pytest.mark.parametrize("lives", [1, 2])
def test_a_capture_whose_end_is_lost_ends_once_the_engine_stops_listing_it(daemon_factory, shm_dir, lives):
    sc = Scenario(tp=1, n_requests=2, prompt_len=4, gen_len=3, chunk=4)
    d = daemon_factory(end_grace_s=1.0)
    eng = SyntheticEngine(sc, shm_dir)
    eng.end = lambda i: None  # this engine loses every END (a full ring, a bug, a previous daemon)
    eng.begin()
    eng.live()
    while eng.run_step():
        eng.live()
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=_stream(d.client(), sc.request_id(0))))
    t.start()
    for _ in range(lives):
        eng.live([])  # once after the last capture ended; a second time if a later capture was running
        time.sleep(0.2)
    t.join(30)
    assert not t.is_alive(), "the subscriber still waits: the capture never ended"
    items, end = got["r"]
    data, gaps = _every_position_once_in_order(items, sc.end_position)
    assert data == list(range(sc.end_position)) and gaps == []
    assert end.reason == END_LOST and not end.complete and end.end_position is None
    assert d.status()["reassembly"]["ends_lost"] == 2


def test_a_subscriber_whose_capture_a_restarted_daemon_never_sees_again_is_told_so(daemon_factory, shm_dir):
    """Each heartbeat resubscription used to restart the new daemon's wait for the name: forever."""
    sc = Scenario(tp=1, n_requests=1, prompt_len=4, gen_len=20, chunk=4)
    d = daemon_factory(end_grace_s=1.0)
    eng = SyntheticEngine(sc, shm_dir)
    # No asynchronous scheduling: the daemon holds nothing back, so its rings' cursors pass everything
    # it read and the next daemon meets nothing of this capture again.
    eng.engine.write_control(sc.request_id(0), BeginMeta(spec=spec_field(sc.spec()), num_prompt_tokens=sc.prompt_len,
                                                         async_scheduling=False), tap_key=sc.key(0))
    eng.run_step()
    eng.run_step()
    got: dict = {}

    def follow() -> None:
        try:
            got["r"] = _stream(Client(d.endpoint, heartbeat_s=0.5), sc.request_id(0), timeout=4)
        except Exception as e:
            got["r"] = e

    t = threading.Thread(target=follow)
    t.start()
    _wait(lambda: _read_everything(d, sc) and d.status()["subscribers"] == 1, what="the stream")
    d.kill()
    _not_adoptable(d)
    d.start()  # it finds nothing of this capture in the rings: the writer wrote nothing since
    t.join(30)
    assert not t.is_alive(), "the subscriber still waits"
    assert isinstance(got["r"], CaptureLost), got["r"]


# -- item 12: the writer dies --


def test_a_dead_writer_ends_its_captures_through_its_pidfd(daemon_factory, shm_dir):
    sc = Scenario(tp=1, n_requests=1, prompt_len=4, gen_len=50, chunk=4)
    d = daemon_factory(end_grace_s=5.0)
    writer = subprocess.Popen([sys.executable, "tests/support/synthetic_writer.py", shm_dir, sc.to_json(), "--stop-after", "3"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(writer.stdout.readline())["steps"] == 3
        _wait(lambda: _read_everything(d, sc), what="the rings")
        assert {r["writer_watch"] for r in d.status()["rings"]} == {"pidfd"}
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(r=_stream(d.client(), sc.request_id(0))))
        t.start()
        _wait(lambda: d.status()["subscribers"] == 1, what="the subscriber")
        killed = time.monotonic()
        writer.kill()
        t.join(30)
        took = time.monotonic() - killed
    finally:
        writer.kill()
        writer.wait()
    items, end = got["r"]
    assert end.reason == WRITER_GONE and not end.complete
    data, gaps = _every_position_once_in_order(items, 6)  # steps 0..2: positions 0..5, all delivered
    assert data == list(range(6)) and gaps == []
    # The fallback (kill(pid, 0) plus "written in the last 10 s") took 12.6 s; a pidfd takes well
    # under a second (vllm-tap's measure_floods.py reports the figure). This bound only tells the
    # two mechanisms apart.
    assert took < 5.0, took
    assert d.status()["writers_exited"] == 2


# -- a daemon stopped, resumed and stopped again while captures run, then restarted while vLLM is idle --


def _fetch_known(client: Client, rids: list[str], timeout: float) -> dict:
    """Each capture the daemon knows, fetched (None for one it never saw), concurrently."""
    got: dict = {}

    def one(rid: str) -> None:
        try:
            got[rid] = client.fetch(rid, timeout=timeout)
        except CaptureNotFound:
            got[rid] = None

    threads = [threading.Thread(target=one, args=(rid,)) for rid in rids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


@pytest.mark.parametrize("after_s", [0.03, 0.1])
@pytest.mark.parametrize("second_stop", ["SIGKILL", "SIGTERM"])
def test_captures_end_after_the_daemon_is_stopped_resumed_and_stopped_again_then_restarted_idle(
        daemon_factory, shm_dir, second_stop, after_s):
    """SIGSTOP while captures run; the engine finishes them all (ENDs included) and goes idle; SIGCONT,
    and 30-100 ms later, in the middle of reading the backlog, SIGKILL or SIGTERM; a new daemon.
    Every capture the new daemon sees ends within a bounded time although nothing but the engine's
    LIVE timer writes. A SIGTERM loses nothing: the END of every capture arrives (handed over when
    the stopped daemon had read it), and so does every position the stopped daemon had delivered
    (its history goes over with the handover); a capture it had finished is adopted with its arena. (Before: captures whose END the first daemon had read waited forever,
    `ended: false`, even with every position delivered.)"""
    sc = Scenario(tp=2, n_requests=6, prompt_len=8, gen_len=40, chunk=8, vocab=1 << 17, hidden=64,
                  ring_bytes=128 << 20)
    d = daemon_factory(end_grace_s=1.0)
    eng = SyntheticEngine(sc, shm_dir)
    eng.start_live(0.2)
    try:
        eng.begin()
        for _ in range(3):
            eng.run_step()
        _wait(lambda: _read_everything(d, sc), what="the first steps")
        os.kill(d.proc.pid, signal.SIGSTOP)
        while eng.run_step():  # the rest and every END, while the daemon is stopped
            pass
        os.kill(d.proc.pid, signal.SIGCONT)
        time.sleep(after_s)
        if second_stop == "SIGKILL":
            d.kill()
        else:
            assert d.stop() == 0, d.log()
        d.start()  # vLLM is idle: only its LIVE timer writes
        _wait(lambda: _read_everything(d, sc) and d.status()["requests_in_flight"] == 0, 30,
              "every capture the new daemon saw to end")
        caps = _fetch_known(d.client(), [sc.request_id(i) for i in range(sc.n_requests)], timeout=2)
    finally:
        eng.close()
    known = {rid: c for rid, c in caps.items() if c is not None}
    for rid, cap in known.items():
        i = int(rid.rsplit("-", 1)[1])
        exp = expected(sc, i)
        pos = cap.positions.tolist()
        assert pos == sorted(pos) and not set(pos) & set(cap.missing_positions), rid
        assert sorted(pos + list(cap.missing_positions)) == list(range(sc.end_position)), rid
        if pos and second_stop == "SIGKILL":  # what came is what was written: what the killed daemon
            # had filed (adopted with its arena), then what the next one read
            assert cap.logits.tobytes() == exp["logits"][pos].tobytes(), rid
        if second_stop == "SIGTERM":
            assert cap.finish_reason == "length" and cap.end_position == sc.end_position, (rid, cap.finish_reason)
            # What the stopped daemon had delivered went over with the handover: nothing is missing.
            assert cap.complete and pos == list(range(sc.end_position)), (rid, cap.missing_positions.ranges)
            assert cap.logits.tobytes() == exp["logits"].tobytes(), rid
        else:
            assert cap.finish_reason in ("length", END_LOST), (rid, cap.finish_reason)


@pytest.mark.parametrize("content", [b"\xff\x00junk", b"\x82\xa7version\x01\xa9instances\x81\xa1d\x91\x80"])
def test_an_unusable_handover_is_one_logged_line_and_the_daemon_starts(daemon_factory, sock_dir, content):
    """The handover file is decoded against its schema: garbage, or a capture missing its fields, is
    ignored with one line (and removed), never a reason not to start."""
    state = os.path.join(sock_dir, "state-h")
    os.makedirs(state)
    with open(os.path.join(state, "handover.msgpack"), "wb") as f:
        f.write(content)
    d = daemon_factory(state_dir=state)
    assert d.status()["requests_in_flight"] == 0
    assert not os.path.exists(os.path.join(state, "handover.msgpack"))
    lines = [x for x in d.log().splitlines() if "handover" in x]
    assert len(lines) == 1 and "ignored" in lines[0], lines


# -- a capture's end waits for its data, however far behind the daemon is --


def test_a_backlog_read_long_after_its_ends_arrives_whole_with_no_timeout(daemon_factory, shm_dir):
    """Thousands of decode steps of full logits pile up while the daemon is stopped, then every
    capture's END. Once it runs again the daemon reads the ENDs at once (the engine ring is small)
    and the steps at its own pace, over many rounds (each ring is read READ_BUDGET_BYTES a round).
    Every capture still arrives whole: its end waits until the worker ring is read up to where it
    stood. A grace of 0 makes that the only wait, so the daemon reading fast cannot hide a capture
    ending early. (Before: a capture ended end_grace_s after its END was read, and what the ring still
    held of it became a `timeout` gap, then was discarded as late.)"""
    from vllm_tap.daemon.ring_poller import READ_BUDGET_BYTES
    from vllm_tap.ring_records import TensorId
    from vllm_tap.spec import CaptureSpec, LogitsMode, PositionsMode
    from synthetic_writer import write_decode_backlog
    from vllm_tap import ring_format as rf

    d = daemon_factory(end_grace_s=0.0)
    n, prompt, steps, vocab = 32, 4, 3000, 512
    assert n * steps * vocab * 4 > 4 * READ_BUDGET_BYTES  # read over several rounds, long after the ENDs
    spec = CaptureSpec(logits=LogitsMode.FULL, layers=(), positions=PositionsMode.OUTPUT).to_meta()
    rids = [f"behind-{i}" for i in range(n)]
    sections = ((TensorId(rf.TensorKind.LOGITS), rf.DType.FLOAT32, vocab, (0, vocab), vocab),)

    def row(i: int, pos: int, section: int = 0) -> np.ndarray:
        return (np.arange(vocab) * 0.25 + 1000 * int(pos) + 10_000_000 * i).astype(np.float32)

    c = d.client()
    c.status()  # connected before the stop: its next question is read in the daemon's first rounds after it
    t0 = time.monotonic()
    write_decode_backlog(shm_dir, d, rids, spec, prompt, steps, sections, row, ring_bytes=256 << 20)
    took = time.monotonic() - t0
    # Status says how far behind the daemon is, before it costs anything: bytes unread and how long
    # the oldest has waited (since before the stop), and the captures that ended and wait for their data.
    seen = []
    for _ in range(20):  # 1 s at most: it is behind for longer
        seen.append(c.status())
        if seen[-1]["requests_waiting_for_rings"] == n:
            break
        time.sleep(0.05)  # the captures join a Barrier at a tick (every 50 ms) after their END is read
    behind = [s for s in seen if s["pending_bytes"] > 0]
    assert behind, "caught up before the first answer"
    print(f"\nafter the stop: {behind[0]['pending_bytes'] >> 20} MiB unread, the oldest for "
          f"{behind[0]['pending_s']:.2f} s (the stop took {took:.2f} s at most); "
          f"{max(s['requests_waiting_for_rings'] for s in behind)} captures waiting for their rings")
    assert all(0 < s["pending_s"] <= took + 5 for s in behind), [s["pending_s"] for s in behind]
    assert any(s["requests_waiting_for_rings"] == n for s in behind), [s["requests_waiting_for_rings"] for s in behind]
    pos = np.arange(prompt - 1, prompt - 1 + steps)
    for i, rid in enumerate(rids):
        cap = c.fetch(rid, timeout=60)
        assert cap.finish_reason == "length" and cap.missing_positions == [], (rid, cap.missing_positions.ranges[:3])
        assert cap.positions.tolist() == pos.tolist() and cap.complete, rid
        assert cap.arrays()["logits"].tobytes() == np.stack([row(i, p) for p in pos]).tobytes(), rid
    s = d.status()
    assert s["drops"]["missing_positions"] == 0 and s["reassembly"]["late_records"] == 0, s["reassembly"]
    assert not any(s["gap_positions"].values()) and s["requests_waiting_for_rings"] == 0
    assert s["pending_bytes"] == 0 and s["pending_s"] == 0 and all(r["pending_s"] == 0 for r in s["rings"])

@pytest.mark.parametrize("adopted", [True, False])
def test_a_capture_whose_head_and_end_went_with_a_killed_daemon_lists_the_head_as_missing(daemon_factory, shm_dir,
                                                                                         adopted):
    """A daemon reads a capture's BEGIN and its first positions and is killed (SIGKILL); the END is
    lost too (the killed daemon read it, or the engine could not write it). The next daemon adopts
    the killed one's arena with what it had filed (0..9) and reads again what it held (10), or, where
    it cannot (the arena's size changed), meets the capture half way at 10; its end is `end lost`, every position it lacks is in
    `missing_positions`, so positions + missing_positions is the expected range, and the end is
    marked unknown. (Before: a fetch's subscription that resumed after the daemon's silence got an
    End listing what was missing from where it resumed, and the head it had been sent as a Gap was
    left out.)"""
    sc = Scenario(tp=2, n_requests=1, prompt_len=8, gen_len=12, chunk=4)
    d = daemon_factory(end_grace_s=0.5)
    eng = SyntheticEngine(sc, shm_dir)
    eng.end = lambda i: None
    _kill_after_the_first_positions(d, eng, sc, adopted)
    while eng.run_step():  # 11..18, written while no daemon runs
        pass
    eng.live([])
    d.start()
    time.sleep(0.3)
    eng.live([])
    cap = d.client().fetch(sc.request_id(0), timeout=30)
    assert cap.finish_reason == END_LOST and not cap.complete and not cap.end_known and cap.expected == (0, 19)
    lost = [] if adopted else list(range(10))
    assert cap.positions.tolist() == [p for p in range(sc.end_position) if p not in lost]
    assert list(cap.missing_positions) == lost, cap.missing_positions
    assert cap.logits.tobytes() == expected(sc, 0)["logits"][cap.positions].tobytes()
