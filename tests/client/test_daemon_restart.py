"""Readers ride through a graceful daemon restart (SIGTERM, as `systemctl restart vllm-tap` sends) as
through a crash: a real daemon process, `vllm-tap record` and `vllm-tap watch` as processes of their
own, a subscriber in this process, traffic from the synthetic engine (tests/support/synthetic_writer.py).

The synthetic engine rather than a vLLM server: the test needs captures that are finished before
the stop, captures in flight across it (written to while no daemon runs) and captures begun after
the restart, at steps it chooses, with values it can recompute exactly; a server's scheduling
decides none of that, and starting one costs minutes. (tests/e2e cover the hook's records.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa

from synthetic_writer import Scenario, SyntheticEngine, expected
from waiting import wait_until as _wait
from vllm_tap import dataset_format as df
from vllm_tap import wire_format as wf
from vllm_tap.client import Chunk, Gap
from vllm_tap.client.datasets import open_dataset
from vllm_tap.client.datasets.store import DatasetStore



def _manifest(dest: str) -> df.Manifest | None:
    raw = DatasetStore(dest).read_bytes(df.manifest_path("hostA"))
    return df.decode_manifest(raw) if raw else None


def _rows(dest: str) -> pa.Table:
    return open_dataset(dest).to_pyarrow().to_table(columns=["seq", "request_id", "position", "token_id", "logits",
                                                              df.hook_name(0), df.hook_name(2)])


def _watching(d) -> int:
    return len(d.status()["watchers"])


def _watch_lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Subscriber:
    """One capture streamed in a thread of this process: every Chunk and Gap in order."""

    def __init__(self, client, name: str):
        self.items: list[Chunk | Gap] = []
        self.error: BaseException | None = None
        self.sub = client.subscribe(name, timeout=30)
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        try:
            for item in self.sub.chunks():
                self.items.append(item)
        except BaseException as e:
            self.error = e

    def positions(self) -> int:
        return sum(len(x) for x in self.items if isinstance(x, Chunk))


def test_recorder_watcher_and_subscriber_ride_through_a_graceful_restart(daemon_factory, shm_dir, tmp_path):
    d = daemon_factory(end_grace_s=1.0)
    dest = str(tmp_path / "ds")
    rec_log, watch_out, watch_err = (str(tmp_path / n) for n in ("rec.log", "watch.jsonl", "watch.err"))
    cli = [sys.executable, "-m", "vllm_tap.cli"]
    # A shard that only age or size would seal is never sealed here: what the dataset holds before
    # the restart was committed because the daemon said it was stopping. The recorder stops by itself
    # once it has the ten captures (a SIGTERM could come before it read the last ones off its socket).
    rec = subprocess.Popen([*cli, "record", dest, "--endpoint", d.endpoint, "--writer", "hostA", "--quiet",
                            "--shard-age", "1h", "--max-captures", "10"], stdout=open(rec_log, "ab"),
                           stderr=subprocess.STDOUT)
    watcher = subprocess.Popen([*cli, "watch", "--since", "0", "--json", "--endpoint", d.endpoint],
                               stdout=open(watch_out, "wb"), stderr=open(watch_err, "wb"))
    sc = Scenario(n_requests=10, tp=2, prompt_len=6, gen_len=14, chunk=4, ring_bytes=4 << 20)
    eng = SyntheticEngine(sc, shm_dir)
    sub = None
    try:
        _wait(lambda: _manifest(dest) is not None or rec.poll() is not None, 30, "the recorder's first manifest")
        _wait(lambda: _watching(d) >= 2, 30, "the recorder's and the watcher's watches")
        # Before the stop: 0..3 begin and end; 4 and 5 are in flight (a subscriber streams 4).
        for r in eng.reqs[4:]:
            r.ended = True
        eng.begin([0, 1, 2, 3])
        while eng.run_step():
            pass
        for r in eng.reqs[4:6]:
            r.ended = False
        eng.begin([4, 5])
        sub = Subscriber(d.client(), sc.request_id(4))
        for _ in range(4):
            eng.run_step()
        _wait(lambda: sum(1 for x in _watch_lines(watch_out) if "reason" in x and "lost" not in x) == 4, 60,
              "the watcher's first four captures")
        _wait(lambda: sub.positions() >= 6, 60, "the subscriber's first positions")
        first_run = d.status()["sequence"]

        assert d.stop(timeout=60) == 0  # SIGTERM, as `systemctl restart` sends (a loaded box may take over 10 s)
        # The recorder committed what it held (a shard of 1 h age, far from full): 0..3, each whole.
        _wait(lambda: _manifest(dest).committed_seq >= 4, 60, "the commit at the daemon's stop")
        held = _rows(dest)
        assert sorted(set(held.column("request_id").to_pylist())) == [sc.request_id(i) for i in range(4)]
        assert held.num_rows == 4 * sc.end_position
        for _ in range(3):  # 4 and 5 go on while no daemon runs: the rings keep what they write
            eng.run_step()
        time.sleep(1.0)
        assert rec.poll() is None, open(rec_log).read()
        assert watcher.poll() is None, open(watch_err).read()
        assert sub.error is None and sub.sub.end is None

        d.start()
        while eng.run_step():  # 4 and 5 end with the new daemon
            pass
        for r in eng.reqs[6:]:
            r.ended = False
        eng.begin([6, 7, 8, 9])  # and captures that begin after the restart
        while eng.run_step():
            pass
        assert eng.flush() and eng.dropped == 0
        _wait(lambda: sum(1 for x in _watch_lines(watch_out) if "reason" in x and "lost" not in x) == 10, 90,
              "the watcher's ten captures")
        _wait(lambda: sub.sub.end is not None or sub.error is not None, 60, "the subscriber's end")
        second_run = d.status()["sequence"]
        assert rec.wait(60) == 0, open(rec_log).read()
    finally:
        eng.close()
        if rec.poll() is None:
            rec.kill()
        if watcher.poll() is None:
            watcher.send_signal(signal.SIGINT)
    assert watcher.wait(30) == 0, open(watch_err).read()
    assert "the daemon is stopping" in open(rec_log).read()
    assert second_run["run_first"] > first_run["last"]

    # The watcher: every seq from 1 on exactly once, as a capture or a loss; the losses are the
    # numbers of the captures in flight at the stop (the next daemon continues them under new ones).
    seen: list[int] = []
    caps: dict[str, int] = {}
    for x in _watch_lines(watch_out):
        if "lost" in x:
            assert x["reason"] == wf.LOST_RESTARTED, x
            seen += range(x["lost"][0], x["lost"][1] + 1)
        else:
            seen.append(x["seq"])
            assert x["request_id"] not in caps, f"{x['request_id']} delivered twice"
            caps[x["request_id"]] = x["seq"]
    assert seen == list(range(1, seen[-1] + 1)), "every seq exactly once, in order"
    assert sorted(caps) == sorted(sc.request_id(i) for i in range(10))
    assert [caps[sc.request_id(i)] > first_run["last"] for i in range(10)] == [False] * 4 + [True] * 6
    last_seq = int(open(watch_err).read().split("last_seq=")[-1].split()[0])
    assert last_seq == seen[-1]

    # The recorder: the same captures, each (request, position) once, with the engine's values; what
    # the stopping daemon had delivered of 4 and 5 went over with the handover, so they arrive whole
    # under their new numbers, and their old numbers are recorded as lost.
    m = _manifest(dest)
    assert m.committed_seq == seen[-1]
    assert [(e.reason, e.first <= caps[sc.request_id(4)]) for e in m.lost] and \
        {e.reason for e in m.lost} == {wf.LOST_RESTARTED}
    assert sum(e.last - e.first + 1 for e in m.lost) == len(seen) - 10
    t = _rows(dest)
    rid = np.array(t.column("request_id").to_pylist())
    pos = t.column("position").to_numpy()
    assert len(set(zip(rid.tolist(), pos.tolist()))) == t.num_rows, "a (request, position) recorded twice"
    gaps = {g.request_id: g for g in open_dataset(dest).gaps}
    for i in range(10):
        sel = np.nonzero(rid == sc.request_id(i))[0]
        part = t.take(pa.array(sel[np.argsort(pos[sel])]))
        p = part.column("position").to_numpy()
        exp = expected(sc, i)
        start = 0
        assert sc.request_id(i) not in gaps, gaps[sc.request_id(i)]
        assert p.tolist() == list(range(start, sc.end_position)), sc.request_id(i)
        assert part.column("seq").to_pylist() == [caps[sc.request_id(i)]] * len(p)
        assert part.column("token_id").to_numpy().tolist() == exp["token_ids"][start:].tolist()
        got = np.stack(part.column("logits").to_numpy(zero_copy_only=False))
        assert got.tobytes() == exp["logits"][start:].tobytes()
        for layer in sc.layers:
            got = np.stack(part.column(df.hook_name(layer)).to_numpy(zero_copy_only=False))
            assert got.tobytes() == exp[f"hidden.{layer}"][start:].tobytes()

    # The subscriber: every position of 4 exactly once, in order, as data with the engine's values
    # (the next daemon continued the capture from where the subscription stood), and its end.
    assert sub.error is None, sub.error
    at = 0
    exp = expected(sc, 4)
    for x in sub.items:
        assert isinstance(x, Chunk), f"positions {x.positions} missing: {x.reason}"
        assert x.start == at
        assert x.logits.tobytes() == exp["logits"][x.start:x.stop].tobytes()
        assert x.hidden[2].tobytes() == exp["hidden.2"][x.start:x.stop].tobytes()
        at = x.stop
    assert at == sc.end_position
    assert sub.sub.end is not None and list(sub.sub.end.missing_positions) == []
