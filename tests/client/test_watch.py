"""Watch every capture, end to end: a real daemon process, rings written by the synthetic engine
(in this process or another), watchers in this process and in other processes (SIGKILLed and
SIGSTOPped ones included), the `vllm-tap watch` command line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import msgpack
import numpy as np
import pytest
import zmq

from synthetic_writer import Scenario, SyntheticEngine, assert_capture, capture_arrays, expected, write_scenario
from watch_recorder import digest, read_lines
from vllm_tap import wire_format as wf
from vllm_tap.client import (
    AsyncClient, Client, Chunk, LostCaptures, WatchData, WatchedCapture, WatchEnd, WatchRejected, WatchStart,
)
from project_layout import SUPPORT
from waiting import wait_until as _wait



class Collector:
    """A watch iterated in a thread of this process, its items kept in order."""

    def __init__(self, client: Client, **kw):
        self.w = client.watch(**kw)
        self.items: list = []
        self.error: BaseException | None = None
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        try:
            for item in self.w:
                self.items.append(item)
        except BaseException as e:
            self.error = e

    def of(self, cls) -> list:
        return [i for i in self.items if isinstance(i, cls)]

    def close(self) -> None:
        self.w.close()
        self.t.join(5)
        assert not self.t.is_alive()


def _run_writer(shm_dir: str, sc: Scenario, step_sleep: float = 0.0) -> None:
    r = subprocess.run([sys.executable, os.path.join(SUPPORT, "synthetic_writer.py"), shm_dir, sc.to_json(),
                        "--step-sleep", str(step_sleep)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["dropped"] == 0


def _index(sc: Scenario, request_id: str) -> int:
    return int(request_id.rsplit("-", 1)[1])


def test_whole_captures_in_seq_order_with_exact_values_and_every_filter(daemon_proc, shm_dir):
    c = daemon_proc.client()
    everything = Collector(c, since=0)
    filtered = {
        "instance": Collector(c, since=0, instance="i2"),
        "source": Collector(c, since=0, source="policy"),
        "tap_key_prefix": Collector(c, since=0, tap_key_prefix="job-"),
        "model": Collector(c, since=0, model="m-b"),
        "all four": Collector(c, since=0, instance="i2", source="policy", tap_key_prefix="job-", model="m-b"),
    }
    scs = [Scenario(instance="i1", prefix="a", n_requests=3, tp=2, model="m-a", tap_key="job-"),
           Scenario(instance="i2", prefix="b", n_requests=3, tp=1, model="m-b", source="policy", tap_key="job-"),
           Scenario(instance="i2", prefix="c", n_requests=2, tp=2, model="m-b", source="client", tap_key="other-")]
    for sc in scs:
        _run_writer(shm_dir, sc)
    _wait(lambda: len(everything.of(WatchedCapture)) == 8, what="all 8 captures")
    caps = everything.of(WatchedCapture)
    assert [x.seq for x in caps] == sorted(x.seq for x in caps) and len({x.seq for x in caps}) == 8
    by_rid = {x.request_id: x for x in caps}
    for sc in scs:
        for i in range(sc.n_requests):
            x = by_rid[sc.request_id(i)]
            assert_capture(sc, i, capture_arrays(x.capture))
            assert (x.instance, x.source, x.model, x.tap_key) == (sc.instance, sc.source, sc.model, sc.key(i))
            # One source for a capture's metadata: its begin, end and stacked capture say the same.
            assert (x.begin.source, x.end.source, x.capture.source) == (sc.source,) * 3, x.request_id
            assert x.end.reason == "length" and x.capture.complete
    assert everything.w.last_seq == caps[-1].seq and not everything.of(LostCaptures)
    want = {
        "instance": {x.seq for x in caps if x.instance == "i2"},
        "source": {x.seq for x in caps if x.source == "policy"},
        "tap_key_prefix": {x.seq for x in caps if x.tap_key.startswith("job-")},
        "model": {x.seq for x in caps if x.model == "m-b"},
        "all four": {x.seq for x in caps if x.request_id.startswith("b-")},
    }
    assert all(0 < len(v) < 8 for v in want.values())
    last = caps[-1].seq
    for name, col in filtered.items():
        # Filtered-out captures are skipped silently, and a watermark still moves last_seq past them.
        _wait(lambda: col.w.last_seq == last, 5, f"{name}: last_seq to pass the filtered captures")
        assert {x.seq for x in col.of(WatchedCapture)} == want[name], name
        assert not col.of(LostCaptures), name
    s = daemon_proc.status()
    assert s["sequence"]["last"] == last and s["sequence"]["retained"] == 8 and len(s["watchers"]) == 6
    for col in [everything, *filtered.values()]:
        col.close()
    _wait(lambda: not daemon_proc.status()["watchers"], 5, "closed watches to be cancelled")


def test_streamed_mode_delivers_while_requests_run_in_seq_order(daemon_proc, shm_dir):
    c = daemon_proc.client()
    col = Collector(c, whole=False)
    _wait(lambda: col.w.accepted is not None, 10, "the watch to be accepted")
    sc = Scenario(n_requests=3, tp=2, prompt_len=6, gen_len=10)
    eng = SyntheticEngine(sc, shm_dir)
    try:
        eng.begin()
        for _ in range(4):
            eng.run_step()
        # Mid-request: every capture has started and delivered its first positions already.
        _wait(lambda: len(col.of(WatchStart)) == 3 and len(col.of(WatchData)) >= 3, 10, "streamed data before the end")
        assert not col.of(WatchEnd)
        while eng.run_step():
            pass
    finally:
        eng.close()
    _wait(lambda: len(col.of(WatchEnd)) == 3, 10, "three ends")
    starts = col.of(WatchStart)
    assert [s.seq for s in starts] == sorted(s.seq for s in starts)  # captures start in seq order
    for s in starts:
        i = _index(sc, s.begin.request_id)
        mine = [x for x in col.items if getattr(x, "seq", None) == s.seq]
        assert isinstance(mine[0], WatchStart) and isinstance(mine[-1], WatchEnd)
        chunks = [x.item for x in mine[1:-1]]
        assert all(isinstance(ch, Chunk) for ch in chunks)
        pos = np.concatenate([ch.positions for ch in chunks])
        assert pos.tolist() == list(range(sc.end_position))  # in order, each once
        exp = expected(sc, i)
        got = np.concatenate([ch.logits for ch in chunks])
        assert got.tobytes() == exp["logits"].tobytes()
    assert col.w.last_seq == max(s.seq for s in starts)
    col.close()


def test_watcher_sigkilled_mid_stream_and_restarted_from_its_stored_seq_gets_every_position_once(
        daemon_factory, shm_dir, sock_dir):
    d = daemon_factory(end_grace_s=1.0)
    out = os.path.join(sock_dir, "recorded.jsonl")
    sc = Scenario(n_requests=40, tp=2, prompt_len=5, gen_len=4)
    _run_writer(shm_dir, sc)  # everything is retained (1 GiB default): the recorder starts late on purpose

    def recorder(since):
        argv = [sys.executable, os.path.join(SUPPORT, "watch_recorder.py"), d.endpoint, out, "--item-sleep", "0.05",
                "--until", "40"]
        return subprocess.Popen(argv + (["--since", str(since)] if since is not None else []))

    first = recorder(0)
    _wait(lambda: len(read_lines(out)) >= 8, 30, "the recorder to store some captures")
    first.send_signal(signal.SIGKILL)
    first.wait()
    lines = read_lines(out)
    assert 8 <= len(lines) < 40, "killed mid-stream"
    since = lines[-1]["last_seq"]
    second = recorder(since)
    assert second.wait(60) == 0
    lines = read_lines(out)
    assert not [x for x in lines if x["kind"] == "lost"]
    seen: dict[tuple[str, int], int] = {}
    for x in lines:
        for p in x["positions"]:
            seen[(x["request_id"], p)] = seen.get((x["request_id"], p), 0) + 1
    want = {(sc.request_id(i), p) for i in range(sc.n_requests) for p in range(sc.end_position)}
    assert set(seen) == want and set(seen.values()) == {1}, "every (request, position) exactly once across both runs"
    assert [x["seq"] for x in lines] == list(range(1, 41))
    for x in lines:
        assert x["digest"] == digest(expected(sc, _index(sc, x["request_id"]))), x["request_id"]


def test_daemon_sigkilled_and_restarted_with_watchers_attached(daemon_factory, shm_dir):
    d = daemon_factory(end_grace_s=1.0)
    c = d.client()
    streamed = Collector(c, since=0, whole=False)
    whole = Collector(c, since=0)
    sc = Scenario(n_requests=6, tp=2, prompt_len=6, gen_len=14, chunk=4)
    eng = SyntheticEngine(sc, shm_dir)
    try:
        eng.begin([0, 1, 2, 3])
        eng.reqs[4].ended = eng.reqs[5].ended = True  # not started yet
        for _ in range(20):  # 0..3 end (step 16): delivered whole before the kill
            eng.run_step()
        eng.reqs[4].ended = eng.reqs[5].ended = False
        eng.begin([4, 5])
        for r in eng.reqs[:4]:
            assert r.ended
        for _ in range(5):  # 4 and 5 are mid-flight
            eng.run_step()
        _wait(lambda: len(whole.of(WatchedCapture)) == 4, 10, "the first four captures")
        _wait(lambda: sum(isinstance(x, WatchData) and x.seq >= 5 for x in streamed.items) >= 2, 10, "live data")
        first_run = d.status()["sequence"]
        d.kill()
        while eng.run_step():  # the engine goes on while no daemon reads: the rings keep it
            pass
        d.start()
        _wait(lambda: len(whole.of(WatchedCapture)) >= 6, 30, "the in-flight captures after the restart")
        _wait(lambda: len(streamed.of(WatchEnd)) >= 6, 10, "streamed ends after the restart")
    finally:
        eng.close()
    assert whole.error is None and streamed.error is None
    run2 = d.status()["sequence"]
    assert run2["run_first"] > first_run["last"]  # numbers go on increasing after the crash

    # Whole: seqs strictly increase in delivery order, every seq handled once; the numbers the dead
    # daemon reserved and never used are reported, as "daemon restarted".
    _wait(lambda: whole.of(LostCaptures), 10, "the reserved numbers reported")
    order = [(x.first, x.last) if isinstance(x, LostCaptures) else (x.seq, x.seq)
             for x in whole.items if isinstance(x, (LostCaptures, WatchedCapture))]
    flat = [s for a, b in order for s in range(a, b + 1)]
    assert flat == list(range(1, flat[-1] + 1)), "every seq exactly once, in order"
    lost = whole.of(LostCaptures)
    assert {x.reason for x in lost} == {wf.LOST_RESTARTED} and lost[0].first == first_run["last"] + 1
    caps = {x.request_id: x for x in whole.of(WatchedCapture)}
    assert len(whole.of(WatchedCapture)) == 6
    for i in range(4):
        assert caps[sc.request_id(i)].seq <= first_run["last"]
        assert_capture(sc, i, capture_arrays(caps[sc.request_id(i)].capture))
    for i in (4, 5):
        # Adopted with the dead daemon's arena: under its number, its BEGIN known, every position once
        # (data, or the newest the dead daemon had read and not filed as a Gap), the engine's values.
        x = caps[sc.request_id(i)]
        # (`lazy` says whether its data was read before its BEGIN, which depends on the daemon's turns)
        assert x.seq <= first_run["last"] and x.begin.model == sc.model
        exp = expected(sc, i)
        pos = x.capture.positions.tolist()
        missing = list(x.capture.missing_positions)
        assert sorted(pos + missing) == list(range(sc.end_position)) and len(missing) <= 1, missing
        assert x.capture.logits.tobytes() == exp["logits"][pos].tobytes()

    # Streamed: the same, each (request, position) once, under the one number, ending with its WatchEnd.
    for i in (4, 5):
        rid = sc.request_id(i)
        (seq,) = [x.seq for x in streamed.of(WatchStart) if x.begin.request_id == rid]
        assert seq <= first_run["last"] and [x for x in streamed.of(WatchEnd) if x.seq == seq]
        data = [p for x in streamed.of(WatchData) if x.seq == seq and isinstance(x.item, Chunk)
                for p in x.item.positions.tolist()]
        gaps = [p for x in streamed.of(WatchData) if x.seq == seq and not isinstance(x.item, Chunk)
                for p in x.item.positions]
        assert sorted(data + gaps) == list(range(sc.end_position)), (data, gaps)
        assert len(gaps) <= 1
    streamed.close()
    whole.close()


def _writer_batches(eng: SyntheticEngine, batch: int, after_batch) -> None:
    """Requests `batch` at a time, each batch run to its end before the next begins."""
    sc = eng.sc
    for b0 in range(0, sc.n_requests, batch):
        ids = list(range(b0, min(b0 + batch, sc.n_requests)))
        eng.begin(ids)
        for p0 in range(0, sc.end_position, sc.chunk):
            eng.step += 1
            for i in ids:
                eng.write_positions(i, np.arange(p0, min(p0 + sc.chunk, sc.end_position), dtype=np.int32))
        for i in ids:
            eng.end(i)
        after_batch(ids)


def test_a_watcher_that_stops_reading_learns_what_it_missed_and_others_are_unaffected(daemon_factory, shm_dir,
                                                                                          sock_dir):
    sc = Scenario(n_requests=160, tp=1, prompt_len=8, gen_len=16, chunk=1, vocab=1024, hidden=64, layers=(1,))
    one = sc.end_position * (sc.vocab + sc.hidden) * 4
    d = daemon_factory(end_grace_s=1.0, retain_bytes=12 * one)
    out = os.path.join(sock_dir, "slow.jsonl")
    slow = subprocess.Popen([sys.executable, os.path.join(SUPPORT, "watch_recorder.py"), d.endpoint, out,
                             "--since", "0", "--until", str(sc.n_requests)])
    _wait(lambda: any(w["id"] for w in d.status()["watchers"]), 20, "the slow watcher to attach")
    c = d.client()
    fast = Collector(c, since=0)
    _wait(lambda: len(d.status()["watchers"]) == 2, 10, "both watchers")
    got_by_subscriber: dict[str, object] = {}
    eng = SyntheticEngine(sc, shm_dir)
    stopped = False

    def after_batch(ids):
        nonlocal stopped
        if not stopped:  # the slow watcher has its first capture, then stops reading
            _wait(lambda: len(read_lines(out)) >= 1, 20, "the slow watcher's first capture")
            slow.send_signal(signal.SIGSTOP)
            stopped = True
        # The others keep up: the writer goes on only once they have this batch (a blocked daemon would stall here).
        _wait(lambda: len(fast.of(WatchedCapture)) >= ids[-1] + 1 or fast.error is not None, 60,
              f"the fast watcher at request {ids[-1]}")
        assert fast.error is None and not fast.of(LostCaptures), (fast.error, fast.of(LostCaptures))
        for i in ids[::2]:
            got_by_subscriber[sc.request_id(i)] = c.fetch(sc.request_id(i), timeout=30)

    try:
        _writer_batches(eng, 4, after_batch)
    finally:
        eng.close()
        if stopped:
            slow.send_signal(signal.SIGCONT)
    try:
        assert slow.wait(120) == 0
    except subprocess.TimeoutExpired:
        slow.kill()
        raise AssertionError(f"the slow watcher did not catch up: {read_lines(out)[-3:]}; {d.status()['watchers']}")
    # The fast watcher and the subscriber: everything, exact.
    caps = fast.of(WatchedCapture)
    assert [x.seq for x in caps] == list(range(1, sc.n_requests + 1)) and not fast.of(LostCaptures)
    for x in caps[::17]:
        assert_capture(sc, _index(sc, x.request_id), capture_arrays(x.capture))
    for rid, cap in got_by_subscriber.items():
        assert_capture(sc, _index(sc, rid), capture_arrays(cap))
    # The slow one: every seq once, delivered or lost as "watcher too slow", and it went on afterwards.
    lines = read_lines(out)
    delivered = [x["seq"] for x in lines if x["kind"] == "capture"]
    lost = [x for x in lines if x["kind"] == "lost"]
    assert lost and {x["reason"] for x in lost} == {wf.LOST_TOO_SLOW}
    covered = sorted(delivered + [s for x in lost for s in range(x["first"], x["last"] + 1)])
    assert covered == list(range(1, sc.n_requests + 1)), (delivered, [(x["first"], x["last"]) for x in lost])
    assert delivered[-1] == sc.n_requests  # caught up after the loss
    for x in lines:
        if x["kind"] == "capture":
            assert x["digest"] == digest(expected(sc, _index(sc, x["request_id"])))
    fast.close()


def test_bad_filters_and_a_since_in_the_future_are_clear_errors(daemon_proc, shm_dir):
    c = daemon_proc.client()
    write_scenario(shm_dir, Scenario(n_requests=2, tp=1))
    _wait(lambda: daemon_proc.status()["sequence"]["last"] == 2, 10, "two captures")
    for kw, words in [({"since": 3}, "since 3 is in the future: the newest capture of this daemon is seq 2"),
                      ({"source": "everything"}, "'source' must be one of client, policy"),
                      ({"model": ""}, "'model' must be a non-empty string")]:
        with pytest.raises(WatchRejected, match=words):
            next(iter(c.watch(**kw)))
    with pytest.raises(WatchRejected, match="since must be a sequence number"):
        c.watch(since=-1)
    # A raw peer with an unknown filter key gets the error naming it.
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(daemon_proc.endpoint)
    s.send(msgpack.packb({"v": wf.WIRE_VERSION, "type": "watch", "id": 7, "modle": "x"}))
    assert s.poll(5000)
    h = msgpack.unpackb(s.recv(), raw=False)
    s.close(0)
    assert (h["type"], h["id"], h["code"]) == ("error", 7, wf.E_BAD_FILTER) and "'modle'" in h["message"]
    for args, words in [(["--since", "99"], "since 99 is in the future"), (["--source", "x"], "'source' must be one of")]:
        r = subprocess.run([sys.executable, "-m", "vllm_tap.cli", "watch", "--endpoint", daemon_proc.endpoint, *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr


def test_cli_watch_prints_a_line_per_capture_and_status_shows_the_range_and_watchers(daemon_proc, shm_dir):
    sc = Scenario(n_requests=3, tp=1, tap_key="k", model="m1", source="policy")
    _run_writer(shm_dir, sc)
    r = subprocess.run([sys.executable, "-m", "vllm_tap.cli", "watch", "--endpoint", daemon_proc.endpoint,
                        "--since", "0", "--count", "3"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3
    for k, line in enumerate(lines):
        assert line.startswith(f"seq={k + 1} default/{sc.request_id(k)} source=policy tap_key=k{k} model=m1 "
                               f"positions=0..{sc.end_position - 1} delivered={sc.end_position} missing=0 end=length")
    assert r.stderr.strip() == "last_seq=3"
    js = subprocess.run([sys.executable, "-m", "vllm_tap.cli", "watch", "--endpoint", daemon_proc.endpoint,
                         "--since", "1", "--count", "2", "--json", "--stream"], capture_output=True, text=True, timeout=60)
    objs = [json.loads(x) for x in js.stdout.splitlines()]
    assert [(o["seq"], "start" in o) for o in objs] == [(2, True), (2, False), (3, True), (3, False)], objs
    col = Collector(daemon_proc.client(), since=1, source="policy")
    _wait(lambda: len(col.of(WatchedCapture)) == 2, 10, "the watch")
    s = daemon_proc.status()
    assert (s["sequence"]["first_retained"], s["sequence"]["last_retained"]) == (1, 3)
    (w,) = s["watchers"]
    assert (w["mode"], w["filters"], w["since"], w["handled"], w["delivered"], w["behind"]) == \
        ("whole", {"source": "policy"}, 1, 3, 2, 0)
    text = subprocess.run([sys.executable, "-m", "vllm_tap.cli", "status", "--endpoint", daemon_proc.endpoint],
                          capture_output=True, text=True, timeout=60).stdout
    assert "sequence: last 3, retained 1..3 (3 captures)" in text and "watchers: 1" in text and "source=policy" in text
    col.close()


def test_async_watch(daemon_proc, shm_dir):
    sc = Scenario(n_requests=2, tp=2)

    async def main():
        w = AsyncClient(daemon_proc.endpoint).watch(since=0, whole=False)
        items = []
        async for item in w:
            items.append(item)
            if len([x for x in items if isinstance(x, WatchEnd)]) == 2:
                break
        return items, w.last_seq

    t = threading.Thread(target=_run_writer, args=(shm_dir, sc), kwargs={"step_sleep": 0.01})
    t.start()
    items, last = asyncio.run(main())
    t.join()
    assert last == 2
    for seq in (1, 2):
        mine = [x for x in items if getattr(x, "seq", None) == seq]
        assert isinstance(mine[0], WatchStart) and isinstance(mine[-1], WatchEnd)
        rid = mine[0].begin.request_id
        logits = np.concatenate([x.item.logits for x in mine[1:-1]])
        assert logits.tobytes() == expected(sc, _index(sc, rid))["logits"].tobytes()


def test_sequence_numbers_continue_after_a_clean_restart_and_skip_after_a_crash(daemon_factory, shm_dir):
    d = daemon_factory(end_grace_s=1.0)
    write_scenario(shm_dir, Scenario(n_requests=2, tp=1, prefix="a"))
    _wait(lambda: d.status()["sequence"]["last"] == 2, 10, "two captures")
    assert d.stop() == 0
    d.start()
    write_scenario(shm_dir, Scenario(n_requests=1, tp=1, prefix="b"))
    _wait(lambda: d.status()["sequence"]["last"] == 3, 10, "seq 3 right after a clean restart")
    items = []
    for item in d.client().watch(since=1):
        items.append(item)
        if isinstance(item, WatchedCapture) and item.seq == 3:
            break
    # a-1 kept its number: the next daemon adopted the arena with the captures it retained
    assert [(x.seq, x.request_id) for x in items] == [(2, "a-1"), (3, "b-0")]
    d.kill()
    d.start()
    write_scenario(shm_dir, Scenario(n_requests=1, tp=1, prefix="c"))
    _wait(lambda: (lambda q: q["last"] >= q["run_first"])(d.status()["sequence"]), 10, "a capture after the crash")
    q = d.status()["sequence"]
    assert q["run_first"] > 3 and q["last"] == q["run_first"]  # the dead run's reserved block is skipped
    items = []
    for item in d.client().watch(since=3):
        items.append(item)
        if isinstance(item, WatchedCapture):
            break
    assert [(x.first, x.last, x.reason) for x in items[:-1]] == [(4, q["run_first"] - 1, wf.LOST_RESTARTED)]
    assert items[-1].seq == q["run_first"]
