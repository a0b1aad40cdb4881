"""The watch's two sans-IO parts, driven directly: the persisted sequence counter (a real state
directory on disk) and the watch hub (a real Store; events in, messages out through a send that a
test can make refuse, like a full socket)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack
import numpy as np
import pytest

from vllm_tap import wire_format as wf
from vllm_tap.client.watch import WatchState
from vllm_tap.daemon.events import Begin, End, Gap, Tokens
from vllm_tap.daemon.sequence import STATE_FILE, SequenceCounter, SequenceStateError
from vllm_tap.daemon.store import Store
from vllm_tap.daemon.watch import WatchHub


# -- the counter --


def test_counter_starts_at_one_reserves_blocks_and_continues_after_a_clean_stop(tmp_path):
    d = str(tmp_path / "state")
    c = SequenceCounter(d, block=10).open()
    assert (c.first, c.next) == (1, 1)
    assert json.load(open(os.path.join(d, STATE_FILE)))["next"] == 11  # reserved before the first use
    got = [c.take() for _ in range(25)]
    assert got == list(range(1, 26))
    assert c.reserved > 25 and c.writes <= 5  # one write per block (and an early refill), not per number
    c.close()
    assert json.load(open(os.path.join(d, STATE_FILE)))["next"] == 26
    c2 = SequenceCounter(d, block=10).open()
    assert c2.take() == 26  # a clean restart leaves no gap
    c2.close()


def test_counter_after_a_crash_skips_to_the_promise_and_never_repeats(tmp_path):
    d = str(tmp_path)
    # A process that takes numbers and dies without closing (SIGKILL has the same effect on the file).
    code = ("import os,sys; from vllm_tap.daemon.sequence import SequenceCounter as S; c=S(sys.argv[1], block=100).open(); "
            "print(max(c.take() for _ in range(130))); sys.stdout.flush(); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True, check=True)
    used = int(out.stdout)
    assert used == 130
    c = SequenceCounter(d, block=100).open()
    assert c.first > used and c.take() > used  # the unused rest of the block is skipped, never reused
    c.close()


def test_counter_refuses_a_corrupt_file_a_locked_or_unwritable_dir(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    (d / STATE_FILE).write_text("{not json")
    with pytest.raises(SequenceStateError, match=r"unreadable .* remove it to restart numbering at 1"):
        SequenceCounter(str(d)).open()
    (d / STATE_FILE).write_text(json.dumps({"version": 1, "next": "7"}))
    with pytest.raises(SequenceStateError, match="'next' must be an integer"):
        SequenceCounter(str(d)).open()
    (d / STATE_FILE).unlink()
    a = SequenceCounter(str(d)).open()
    with pytest.raises(SequenceStateError, match=f"in use by another vllm-tap daemon \\(pid {os.getpid()}\\)"):
        SequenceCounter(str(d)).open()
    a.close()
    SequenceCounter(str(d)).open().close()  # free again once the first one stopped
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(SequenceStateError, match="cannot write there"):
                SequenceCounter(str(ro)).open()
        finally:
            ro.chmod(0o700)


# -- the hub --


class Peer:
    """The daemon's send, seen from one or more clients: records messages, can play a full socket."""

    def __init__(self) -> None:
        self.got: dict[bytes, list[dict]] = {}
        self.full: set[bytes] = set()
        self.gone: set[bytes] = set()

    def send(self, envelope, frames):
        who = envelope[0]
        if who in self.gone:
            return None
        if who in self.full:
            return False
        h = msgpack.unpackb(frames[0], raw=False)
        h["_frames"] = frames[1:]
        self.got.setdefault(who, []).append(h)
        return True

    def take(self, who: bytes) -> list[dict]:
        out = self.got.pop(who, [])
        return out


def _begin(rid, instance="default", key="", model="m", source="client"):
    return Begin(instance, rid, key, 2, [1, 2], 1, model, {"source": source}, 0, False, False, 0.0, source)


def _tokens(rid, start, n=1, instance="default"):
    a = np.arange(n * 4, dtype=np.float32).reshape(n, 4) + start
    return Tokens(instance, rid, np.arange(start, start + n, dtype=np.int32), np.zeros(n, np.int32), 2, {"logits": a},
                  {"logits": 1}, 0.0)


def _end(rid, instance="default", stop=3, source="client"):
    return End(instance, rid, "stop", 2, 1, [5], stop, (0, stop), [], stop, 0.0, source)


class Rig:
    def __init__(self, tmp_path, retain_bytes=1 << 30):
        self.store = Store(retain_bytes, 600.0)
        self.hub = WatchHub()
        self.store.on_drop = self.hub.dropped
        self.hub.open(SequenceCounter(str(tmp_path / "state")))
        self.peer = Peer()
        self.now = 0.0

    def file(self, *events):
        for ev in events:
            e = self.store.add(ev, self.now)
            if e is not None:
                self.hub.filed(ev, e)

    def capture(self, rid, n=3, **kw):
        inst = kw.pop("instance", "default")
        self.file(_begin(rid, instance=inst, **kw), *[_tokens(rid, p, instance=inst) for p in range(n)],
                  _end(rid, instance=inst, stop=n))

    def watch(self, who: bytes, wid=1, **kw):
        return self.hub.attach([who], wf.WatchRequest(wid, **kw), self.now)

    def pump(self, rounds=50):
        for _ in range(rounds):
            if not self.hub.pump(self.peer.send, self.now):
                break

    def msgs(self, who):
        self.pump()
        return self.peer.take(who)


def _types(msgs):
    return [(m["type"], m.get("seq", m.get("first"))) for m in msgs]


def test_whole_mode_sends_capture_after_capture_in_seq_order(tmp_path):
    r = Rig(tmp_path)
    assert r.watch(b"w", since=0) is None
    r.file(_begin("a"), _begin("b"), _tokens("a", 0), _tokens("b", 0), _end("b", stop=1))
    m = r.msgs(b"w")
    # b ended first, but a (seq 1) holds it back; a itself goes out as it is filed.
    assert _types(m) == [("watching", None), ("begin", 1), ("tokens", 1)]
    r.file(_tokens("a", 1), _end("a", stop=2))
    m = r.msgs(b"w")
    assert _types(m) == [("tokens", 1), ("end", 1), ("begin", 2), ("tokens", 2), ("end", 2)]
    assert m[3]["request_id"] == "b"


def test_streamed_mode_starts_in_seq_order_and_interleaves_live(tmp_path):
    r = Rig(tmp_path)
    r.watch(b"w", since=0, whole=False)
    r.file(_begin("a"), _begin("b"), _tokens("b", 0))
    assert _types(r.msgs(b"w"))[1:] == [("begin", 1), ("begin", 2), ("tokens", 2)]
    r.file(_tokens("a", 0), _end("b", stop=1), _tokens("a", 1))
    m = _types(r.msgs(b"w"))
    assert sorted(m) == [("end", 2), ("tokens", 1), ("tokens", 1)]  # live, as filed; a is still running


def test_since_resumes_exactly_after_it_and_the_future_is_refused(tmp_path):
    r = Rig(tmp_path)
    for rid in "abcd":
        r.capture(rid)
    r.watch(b"w", since=2)
    m = r.msgs(b"w")
    assert m[0]["type"] == "watching" and m[0]["since"] == 2 and m[0]["oldest"] == 1 and m[0]["next"] == 5
    assert [x["request_id"] for x in m if x["type"] == "begin"] == ["c", "d"]
    err = r.watch(b"x", since=5)
    h = msgpack.unpackb(err[0], raw=False)
    assert h["code"] == wf.E_BAD_SINCE and "since 5 is in the future" in h["message"] and "seq 4" in h["message"]
    r.watch(b"y")  # since=None: only what begins from now on
    assert [x["type"] for x in r.msgs(b"y")] == ["watching"]
    r.capture("e")
    assert [x["request_id"] for x in r.msgs(b"y") if x["type"] == "begin"] == ["e"]


def test_filters_skip_silently_and_the_watermark_moves_past_them(tmp_path):
    r = Rig(tmp_path)
    r.watch(b"w", since=0, instance="i2", source="policy", tap_key_prefix="job-", model="m2")
    r.capture("a", instance="i2", key="job-1", model="m2", source="policy")   # 1: yes
    r.capture("b", instance="i1", key="job-2", model="m2", source="policy")   # 2: other instance
    r.capture("c", instance="i2", key="other", model="m2", source="policy")   # 3: tap_key
    r.capture("d", instance="i2", key="job-3", model="m1", source="policy")   # 4: model
    r.capture("e", instance="i2", key="job-4", model="m2", source="client")   # 5: source
    m = r.msgs(b"w")
    assert [x["seq"] for x in m if x["type"] == "begin"] == [1]
    assert not [x for x in m if x["type"] == "lost"]
    r.now += 0.3
    r.hub.tick(r.now)
    m = r.msgs(b"w")
    assert [(x["type"], x["seq"]) for x in m] == [("watermark", 5)]
    snap = r.hub.snapshot(r.now)["watchers"][0]
    assert snap["filtered"] == 4 and snap["delivered"] == 1 and snap["handled"] == 5 and snap["behind"] == 0


def test_eviction_before_the_watch_is_evicted_and_during_it_is_too_slow(tmp_path):
    r = Rig(tmp_path, retain_bytes=3000)  # about two captures of ~1.4 kB
    for rid in "abcd":
        r.capture(rid)
        r.store.evict(r.now)
    assert r.hub.snapshot(0)["sequence"]["first_retained"] == 3
    r.watch(b"w", since=0)
    m = r.msgs(b"w")
    lost = [x for x in m if x["type"] == "lost"]
    assert [(x["first"], x["last"], x["reason"]) for x in lost] == [(1, 2, wf.LOST_EVICTED)]
    assert [x["seq"] for x in m if x["type"] == "begin"] == [3, 4]
    # Now the watcher stops reading: its socket is full; retention drops what it has not reached.
    r.peer.full.add(b"w")
    for rid in "efgh":
        r.capture(rid)
        r.store.evict(r.now)
        r.pump()
    r.peer.full.discard(b"w")
    m = r.msgs(b"w")
    lost = [(s, x["reason"]) for x in m if x["type"] == "lost" for s in range(x["first"], x["last"] + 1)]
    assert lost == [(5, wf.LOST_TOO_SLOW), (6, wf.LOST_TOO_SLOW)], lost  # 5 was half sent: abandoned, not pinned
    # 5's begin was waiting in the full socket; the client drops a capture that a loss then covers.
    assert [x["seq"] for x in m if x["type"] == "begin"] == [5, 7, 8]


def test_a_slow_watcher_does_not_hold_up_another(tmp_path):
    r = Rig(tmp_path, retain_bytes=3000)
    r.watch(b"slow", since=0)
    r.watch(b"fast", since=0)
    r.pump()
    r.peer.take(b"slow")
    r.peer.full.add(b"slow")
    seen = []
    for k in range(20):
        r.capture(f"r{k}")
        r.store.evict(r.now)
        seen += [x["seq"] for x in r.msgs(b"fast") if x["type"] == "end"]
    assert seen == list(range(1, 21))
    r.peer.full.discard(b"slow")
    m = r.msgs(b"slow")
    ends = [x["seq"] for x in m if x["type"] == "end"]
    lost = [(x["first"], x["last"]) for x in m if x["type"] == "lost"]
    covered = sorted(ends + [s for a, b in lost for s in range(a, b + 1)])
    assert covered == list(range(1, 21)) and lost and ends  # every seq once: delivered or lost


def test_a_capture_dropped_mid_send_is_reported_not_pinned(tmp_path):
    r = Rig(tmp_path)
    r.watch(b"w", since=0, whole=False)
    r.file(_begin("a"), _tokens("a", 0))
    r.pump()
    r.peer.take(b"w")
    r.file(_begin("a"))  # the same request id begins again: the store replaces the running capture
    m = r.msgs(b"w")
    assert [(x["type"], x.get("first"), x.get("reason")) for x in m if x["type"] == "lost"] == \
        [("lost", 1, wf.LOST_DROPPED)]
    assert [x["seq"] for x in m if x["type"] == "begin"] == [2]


def test_restarted_daemon_reports_the_earlier_runs_numbers(tmp_path):
    r = Rig(tmp_path)
    r.capture("a")
    r.capture("b")
    r.hub.close()  # clean stop
    r2 = Rig(tmp_path)
    r2.capture("c")
    r2.watch(b"w", since=1)
    m = r2.msgs(b"w")
    assert [(x["first"], x["last"], x["reason"]) for x in m if x["type"] == "lost"] == [(2, 2, wf.LOST_RESTARTED)]
    assert [x["seq"] for x in m if x["type"] == "begin"] == [3]


def test_keepalive_when_idle_repeat_is_ignored_and_cancel_removes(tmp_path):
    r = Rig(tmp_path)
    r.watch(b"w", since=0)
    r.msgs(b"w")
    r.now += 1.1
    r.hub.tick(r.now)
    assert [(x["type"], x["seq"]) for x in r.msgs(b"w")] == [("watermark", 0)]
    assert r.watch(b"w", since=0) is None and r.msgs(b"w") == []  # the repeat changes nothing
    r.peer.gone.add(b"w")
    r.now += 1.1
    r.hub.tick(r.now)
    r.pump()
    assert r.hub.snapshot(r.now)["watchers"] == []  # a vanished peer is noticed at the keepalive
    r.watch(b"v", wid=3, since=0)
    assert r.hub.cancel([b"v"], 3) and r.hub.snapshot(r.now)["watchers"] == []


# -- the client's state against the hub's messages --


def _client(whole, since=0):
    return WatchState("ipc://x", since, {}, whole, True, 60.0, 1.0, 1)


def _feed(st, msgs):
    out = []
    for h in msgs:
        frames = [msgpack.packb({k: v for k, v in h.items() if k != "_frames"}, use_bin_type=True), *h["_frames"]]
        out += st.on_frames(frames, 0.0)
    return out


def test_client_state_assembles_whole_captures_and_tracks_last_seq(tmp_path):
    from vllm_tap.client import LostCaptures, Watermark, WatchedCapture

    r = Rig(tmp_path, retain_bytes=3000)
    for rid in "abcd":
        r.capture(rid)
        r.store.evict(r.now)
    r.watch(b"w", since=0, wid=1)
    st = _client(True)
    items = _feed(st, r.msgs(b"w"))
    assert isinstance(items[0], LostCaptures) and (items[0].first, items[0].last) == (1, 2)
    caps = [i for i in items if isinstance(i, WatchedCapture)]
    assert [c.seq for c in caps] == [3, 4] and caps[0].request_id == "c" and caps[0].source == "client"
    assert caps[0].capture.positions.tolist() == [0, 1, 2] and caps[0].capture.logits[2, 0] == 2.0
    assert st.last_seq == 4
    r.now += 1.1
    r.hub.tick(r.now)
    assert _feed(st, r.msgs(b"w")) == [Watermark(4)]


def test_client_state_streamed_last_seq_waits_for_the_oldest_open_capture(tmp_path):
    from vllm_tap.client import WatchData, WatchEnd, WatchStart

    r = Rig(tmp_path)
    r.watch(b"w", since=0, whole=False, wid=1)
    st = _client(False)
    r.file(_begin("a"), _begin("b"), _tokens("a", 0), _tokens("b", 0), _end("b", stop=1))
    items = _feed(st, r.msgs(b"w"))
    assert [(type(i), i.seq) for i in items] == [(WatchStart, 1), (WatchData, 1), (WatchStart, 2), (WatchData, 2),
                                                 (WatchEnd, 2)]
    assert st.last_seq == 0  # b (2) ended, but a (1) is still open
    # A restarted daemon reports 1..2 lost: only 1 is news (2 already ended here).
    lost = st.on_frames([wf.pack(wf.LOST, 1, first=1, last=2, reason=wf.LOST_RESTARTED, detail="")], 0.0)
    assert [(x.first, x.last) for x in lost] == [(1, 1)] and st.last_seq == 2


def test_client_state_streamed_replay_after_a_new_connection_repeats_nothing(tmp_path):
    from vllm_tap.client import WatchData, WatchEnd, WatchStart

    r = Rig(tmp_path)
    r.watch(b"w1", since=0, whole=False, wid=1)
    st = _client(False)
    r.file(_begin("a"), _begin("b"), _tokens("a", 0), _tokens("a", 1), _tokens("b", 0), _end("b", stop=1))
    first = _feed(st, r.msgs(b"w1"))
    assert [(type(i), i.seq) for i in first if not isinstance(i, WatchData)] == [(WatchStart, 1), (WatchStart, 2),
                                                                                  (WatchEnd, 2)]
    # The connection is replaced: the daemon sees a new peer and starts the watch again from since=last_seq (0).
    r.watch(b"w2", since=st.last_seq, whole=False, wid=1)
    r.file(_tokens("a", 2), _end("a", stop=3))
    again = _feed(st, r.msgs(b"w2"))
    assert [(type(i), i.seq) for i in again] == [(WatchData, 1), (WatchEnd, 1)]  # nothing of b, only a's new position
    assert again[0].item.positions.tolist() == [2] and st.last_seq == 2


def test_many_drops_compact_the_index_and_forget_old_tombstones_but_still_report_every_seq(tmp_path, monkeypatch):
    import vllm_tap.daemon.watch as watch_mod

    monkeypatch.setattr(watch_mod, "TOMBSTONES", 100)
    r = Rig(tmp_path, retain_bytes=3000)  # keeps about two captures
    r.watch(b"f", since=0, instance="other")  # a filtering watcher attached all along
    r.pump()
    for k in range(3000):
        r.capture(f"r{k}")
        r.store.evict(r.now)
    assert len(r.hub._present) < 2 * 2 + 1024 + 1 and len(r.hub._gone) <= 125  # compacted, trimmed
    r.watch(b"w", since=0)
    m = r.msgs(b"w")
    lost = [x for x in m if x["type"] == "lost"]
    ends = [x["seq"] for x in m if x["type"] == "end"]
    covered = sorted(ends + [s for x in lost for s in range(x["first"], x["last"] + 1)])
    assert covered == list(range(1, 3001)) and ends == [2999, 3000]
    assert {x["reason"] for x in lost} == {wf.LOST_EVICTED} and len(lost) <= 3
    # The filtering watcher, attached all along: the recent drops are tombstoned (not its instance:
    # skipped silently); older ones, beyond the tombstones, are reported rather than hidden.
    m = r.msgs(b"f")
    lost = [x for x in m if x["type"] == "lost"]
    assert lost and lost[-1]["last"] < 3000 - 100 and not [x for x in m if x["type"] == "begin"]
    assert {x["reason"] for x in lost} == {wf.LOST_TOO_SLOW}  # given out and dropped while it was attached
    r.now += 0.3
    r.hub.tick(r.now)
    assert [x["seq"] for x in r.msgs(b"f") if x["type"] == "watermark"] == [3000]


def test_whole_mode_late_begin_completes_the_head_capture_without_losing_its_data(tmp_path):
    from vllm_tap.client import WatchedCapture

    r = Rig(tmp_path)
    r.watch(b"w", since=0, wid=1)
    st = _client(True)
    lazy = Begin("default", "a", "", 0, None, 1, "", None, 0, True, False, 0.0)  # made from data: no BEGIN seen
    r.file(lazy, _tokens("a", 0), _tokens("a", 1))
    assert _feed(st, r.msgs(b"w")) == []
    full = Begin("default", "a", "key", 2, [1, 2], 1, "m", {"source": "policy"}, 0, True, True, 0.0, "policy")
    r.file(full, _tokens("a", 2), _end("a", stop=3, source="policy"))  # the reassembler's END says what the BEGIN did
    m = r.msgs(b"w")
    assert [(x["type"], x.get("model")) for x in m][:1] == [("begin", "m")]  # sent again, fuller
    (cap,) = _feed(st, m)
    assert isinstance(cap, WatchedCapture) and cap.model == "m" and cap.source == "policy" and cap.tap_key == "key"
    assert cap.capture.positions.tolist() == [0, 1, 2]
