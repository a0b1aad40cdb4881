"""The daemon end to end: real shared memory, a real daemon process, real zmq sockets, subscribers
in other processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from synthetic_writer import (Scenario, SyntheticEngine, assert_capture, capture_arrays, expected, output_token_ids,
                              write_decode_backlog)
from vllm_tap import wire_format as wf
from vllm_tap.client import AmbiguousCapture, CaptureEvicted, Chunk, Client, DaemonStopped, Gap
from vllm_tap.daemon.events import Begin, End, Tokens
from vllm_tap.daemon.store import LookupFailed, Store
from waiting import wait_until as _wait


def _fetch_in_child(endpoint: str, names: list[str], q) -> None:
    """A subscriber process: fetch captures, send back plain arrays."""
    try:
        c = Client(endpoint)
        out = {}
        for name in names:
            cap = c.fetch(name, timeout=20)
            out[name] = (capture_arrays(cap), cap.missing_positions, cap.finish_reason, cap.output_token_ids)
        q.put(out)
    except BaseException as e:  # report, don't hang the parent
        q.put(repr(e))


def _idle(d) -> bool:
    s = d.status()
    return s["requests_in_flight"] == 0 and all(r["pending_bytes"] == 0 for r in s["rings"])


def test_subscribers_in_other_processes_get_exactly_the_written_bytes(daemon_proc, shm_dir):
    sc = Scenario(tp=2, n_requests=6, dtype="bfloat16", layers=(0, 3), vocab=96, hidden=24)
    names = [sc.request_id(i) for i in range(sc.n_requests)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # Subscribers come first and wait for names that do not exist yet: the live path.
    subs = [ctx.Process(target=_fetch_in_child, args=(daemon_proc.endpoint, part, q)) for part in (names[:3], names[3:])]
    for p in subs:
        p.start()
    _wait(lambda: daemon_proc.status()["subscribers_waiting"] == 2, 20, "both subscribers")
    writer = subprocess.run([sys.executable, "tests/support/synthetic_writer.py", shm_dir, sc.to_json(), "--step-sleep", "0.01"],
                            capture_output=True, text=True, timeout=60)
    assert writer.returncode == 0, writer.stderr
    assert json.loads(writer.stdout)["dropped"] == 0
    got = {}
    for _ in subs:
        part = q.get(timeout=30)
        assert isinstance(part, dict), part
        got.update(part)
    for p in subs:
        p.join(10)
    for i, name in enumerate(names):
        arrays, missing, reason, out_ids = got[name]
        assert_capture(sc, i, arrays)
        assert missing == [] and reason == "length" and out_ids == output_token_ids(sc, i)
    s = daemon_proc.status()
    assert s["records_in"] > 0 and s["drops"]["records"] == 0
    assert s["delivery_latency_s"]["count"] > 0


def test_late_subscribe_after_the_end_and_a_clear_error_after_eviction(daemon_factory, shm_dir):
    sc = Scenario(tp=1, n_requests=6, vocab=64, layers=(1,))
    one = 9 * (64 + 16) * 4  # payload bytes of one request
    d = daemon_factory(retain_bytes=3 * one + 8 * 1024, end_grace_s=1.0)
    eng = SyntheticEngine(sc, shm_dir)
    eng.run()
    _wait(lambda: _idle(d), what="the daemon to read everything")
    late = d.client().fetch(sc.request_id(5), timeout=5)  # ended before we asked
    assert_capture(sc, 5, capture_arrays(late))
    assert late.finish_reason == "length" and late.missing_positions == [] and late.num_prompt_tokens == sc.prompt_len
    # Retention is enforced by the daemon's loop, not inside the status call: wait for its pass.
    _wait(lambda: d.status()["evicted_requests"] >= 1, what="retention to evict")
    s = d.status()
    assert 0 < s["retained_requests"] < 6 and s["evicted_requests"] >= 1 and s["retained_bytes"] <= 3 * one + 8 * 1024
    t = time.monotonic()
    with pytest.raises(CaptureEvicted, match="retain_bytes"):
        d.client().fetch(sc.request_id(0), timeout=10)
    assert time.monotonic() - t < 5, "an evicted capture must fail at once, not time out"


def test_daemon_sigkilled_mid_stream_and_restarted_loses_nothing_still_in_the_ring(daemon_factory, shm_dir):
    """What was still in the rings arrives, and so does what the killed daemon had read but held back
    (the newest position, see assembly.HOLD_NEWEST): the rings' cursors stayed below it."""
    sc = Scenario(tp=2, n_requests=2, prompt_len=8, gen_len=12, chunk=4)
    d = daemon_factory(end_grace_s=1.0)
    eng = SyntheticEngine(sc, shm_dir)
    eng.begin()
    for _ in range(5):
        eng.run_step()  # positions 0..10 of both requests
    client = d.client()
    results: dict[int, object] = {}
    seen: dict[int, int] = {0: 0, 1: 0}

    def follow(i: int) -> None:
        sub = client.subscribe(sc.request_id(i), timeout=20)
        chunks = []
        try:
            for item in sub.chunks():
                chunks.append(item)
                if isinstance(item, Chunk):
                    seen[i] = item.stop
        except Exception as e:
            results[i] = e
            return
        results[i] = (chunks, sub.end)

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    # Positions 0..9 of 0..10 written: the newest is held until a later one or the END (async scheduling).
    _wait(lambda: seen[0] == 10 and seen[1] == 10, what="the first half to be delivered")
    d.kill()  # mid-stream: no goodbye
    while eng.run_step():  # the second half goes into the rings while no daemon reads them
        pass
    d.start()
    for t in threads:
        t.join(30)
    for i in range(2):
        res = results[i]
        assert isinstance(res, tuple), res
        chunks, end = res
        assert end.reason == "length" and end.missing_positions == [] and end.complete, end
        assert not [c for c in chunks if isinstance(c, Gap)]
        data = [c for c in chunks if isinstance(c, Chunk)]
        got = [p for c in data for p in c.positions]
        assert got == list(range(sc.end_position))
        exp = expected(sc, i)
        assert np.concatenate([c.logits for c in data]).tobytes() == exp["logits"][got].tobytes()
        assert np.concatenate([c.hidden[2] for c in data]).tobytes() == exp["hidden.2"][got].tobytes()


def test_ring_overflow_is_reported_as_missing_positions(daemon_factory, shm_dir):
    sc = Scenario(tp=2, n_requests=4, vocab=256, ring_bytes=8192, layers=(0,))
    eng = SyntheticEngine(sc, shm_dir)
    eng.run()  # no daemon yet: the small rings overflow
    assert eng.dropped > 0
    dropped = {rid: eng.dropped_positions.get(rid, set()) for rid in (sc.request_id(i) for i in range(sc.n_requests))}
    assert any(dropped.values()) and not all(len(v) == sc.end_position for v in dropped.values())
    d = daemon_factory(end_grace_s=1.0)
    assert eng.flush(10), "queued DROP/END records never went out"
    c = d.client()
    for i in range(sc.n_requests):
        cap = c.fetch(sc.request_id(i), timeout=10)
        assert set(cap.missing_positions) == dropped[sc.request_id(i)]
        assert sorted(set(cap.positions.tolist()) | set(cap.missing_positions)) == list(range(sc.end_position))
        if cap.positions.size:  # what did arrive is exact
            assert cap.logits.tobytes() == expected(sc, i)["logits"][cap.positions].tobytes()
        else:
            assert cap.logits is None
    assert d.status()["drops"]["records"] == eng.dropped


def test_a_missing_ranks_slice_makes_positions_missing_never_a_wrong_concat(daemon_proc, shm_dir):
    sc = Scenario(tp=2, n_requests=1, skip_rank=1)
    SyntheticEngine(sc, shm_dir).run()
    cap = daemon_proc.client().fetch(sc.request_id(0), timeout=10)
    assert cap.positions.size == 0 and cap.logits is None
    assert cap.missing_positions == list(range(sc.end_position)) and cap.finish_reason == "length"


def test_pipeline_and_tensor_parallel_groups_join_per_token(daemon_proc, shm_dir):
    scs = [Scenario(instance="pp", tp=1, pp=2, layers=(0, 1, 2, 3), dtype="float16", topk=5),
           Scenario(instance="tppp", tp=2, pp=2, layers=(0, 1, 2, 3), n_requests=2)]
    for sc in scs:
        SyntheticEngine(sc, shm_dir).run()
    c = daemon_proc.client()
    for sc in scs:
        for i in range(sc.n_requests):
            cap = c.fetch(sc.request_id(i), instance=sc.instance, timeout=10)
            assert_capture(sc, i, capture_arrays(cap))
            assert cap.missing_positions == []


def test_two_instances_with_the_same_request_id_are_kept_apart(daemon_proc, shm_dir):
    a = Scenario(instance="a", n_requests=1, seed=0)
    b = Scenario(instance="b", n_requests=1, seed=1)
    for sc in (a, b):
        SyntheticEngine(sc, shm_dir).run()
    c = daemon_proc.client()
    for sc in (a, b):
        cap = c.fetch("req-0", instance=sc.instance, timeout=10)
        assert cap.instance == sc.instance
        assert_capture(sc, 0, capture_arrays(cap))
    with pytest.raises(AmbiguousCapture, match="instance"):
        c.fetch("req-0", timeout=5)


def _raw(endpoint: str, frames: list[bytes], timeout: float = 5.0) -> dict:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        s.send_multipart(frames)
        assert s.poll(int(timeout * 1000)), f"no reply to {frames!r}"
        reply = s.recv_multipart()
        return msgpack.unpackb(reply[-1], raw=False)
    finally:
        s.close()


@pytest.mark.parametrize("frames, code, words", [
    ([b"\xc1\xff garbage"], wf.E_BAD_REQUEST, "msgpack"),
    ([msgpack.packb([1, 2, 3])], wf.E_BAD_REQUEST, "map"),
    ([msgpack.packb({"v": 99, "type": "status", "id": 4})], wf.E_VERSION, "version 99"),
    ([msgpack.packb({"v": wf.WIRE_VERSION, "type": "launch", "id": 5})], wf.E_BAD_REQUEST, "unknown message type"),
    ([msgpack.packb({"v": wf.WIRE_VERSION, "type": "subscribe", "id": 6, "name": 3})], wf.E_BAD_REQUEST, "name"),
    ([msgpack.packb({"v": wf.WIRE_VERSION, "type": "subscribe", "id": 7, "name": "x", "index": -1})], wf.E_BAD_REQUEST, "index"),
    ([wf.StatusRequest(1).frames()[0], b"extra"], wf.E_BAD_REQUEST, "one frame"),
    ([b""], wf.E_BAD_REQUEST, "one frame"),  # an empty first frame reads as a REQ delimiter: no body
])
def test_malformed_messages_get_an_error_reply_and_the_daemon_keeps_serving(daemon_proc, frames, code, words):
    reply = _raw(daemon_proc.endpoint, frames)
    assert reply["type"] == wf.ERROR and reply["code"] == code and words in reply["message"], reply
    if code == wf.E_VERSION or "unknown" in words:
        assert reply["id"] is not None  # the id is echoed whenever it could be read
    ok = _raw(daemon_proc.endpoint, wf.StatusRequest(2).frames())
    assert ok["type"] == wf.STATUS and ok["id"] == 2 and ok["status"]["bad_requests"] >= 1
    assert daemon_proc.alive()


def test_stop_tells_subscribers_why_and_exits_zero(daemon_proc):
    """A subscriber told the daemon stops waits for the next one (a restart is ridden through); when
    none comes within its timeout, the error says the daemon stopped and why."""
    errors = []

    def wait_for_nothing() -> None:
        try:
            daemon_proc.client().fetch("never-appears", timeout=4)
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=wait_for_nothing)
    t.start()
    _wait(lambda: daemon_proc.status()["subscribers_waiting"] == 1, what="the subscription")
    started = time.monotonic()
    assert daemon_proc.stop() == 0
    assert time.monotonic() - started < 5
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], DaemonStopped) and "SIGTERM" in str(errors[0]), errors


def test_a_slow_subscriber_is_cut_off_and_does_not_hold_up_the_others(daemon_factory, shm_dir):
    sc = Scenario(tp=1, n_requests=1, prompt_len=2, gen_len=700, vocab=1024, layers=(), ring_bytes=4 << 20)
    d = daemon_factory(subscriber_queue=100, end_grace_s=1.0)
    slow = zmq.Context.instance().socket(zmq.DEALER)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 4096)
    slow.setsockopt(zmq.LINGER, 0)
    slow.connect(d.endpoint)
    slow.send_multipart(wf.Subscribe(77, sc.request_id(0), timeout=20).frames())  # ... and never reads
    _wait(lambda: d.status()["subscribers_waiting"] == 1, what="the slow subscription")
    eng = SyntheticEngine(sc, shm_dir)

    def write() -> None:
        eng.begin()
        while eng.run_step():
            time.sleep(0.0005)

    w = threading.Thread(target=write)
    w.start()
    cap = d.client().fetch(sc.request_id(0), timeout=20)  # a good subscriber, alongside
    w.join()
    assert_capture(sc, 0, capture_arrays(cap))
    s = d.status()
    assert s["subscribers_too_slow"] == 1
    # Reading now, the slow one finds the explicit error after what the socket had buffered.
    last = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and slow.poll(2000):
        last = msgpack.unpackb(slow.recv_multipart()[0], raw=False)
        if last["type"] == wf.ERROR:
            break
    slow.close()
    assert last is not None and last["type"] == wf.ERROR and last["code"] == wf.E_TOO_SLOW, last


# -- the store alone (no IO) --


def _begin(rid: str, instance: str = "default", key: str = "") -> Begin:
    return Begin(instance, rid, key, 2, [1, 2], 1, "m", None, 0, False, False, 0.0)


def _tokens(rid: str, nbytes: int, instance: str = "default") -> Tokens:
    a = np.zeros((1, nbytes // 4), np.float32)
    return Tokens(instance, rid, np.zeros(1, np.int32), np.zeros(1, np.int32), 2, {"logits": a}, {"logits": 1}, 0.0)


def _end(rid: str, instance: str = "default") -> End:
    return End(instance, rid, "stop", 2, 1, [5], 1, (0, 1), [], 1, 0.0)


def test_store_resolves_every_alias_and_refuses_to_guess():
    st = Store(1 << 30, 600)
    for rid in ("cmpl-abc-0-1234abcd", "cmpl-abc-1-5678abcd"):  # a two-prompt completion
        st.add(_begin(rid, key="mykey" if rid.endswith("1234abcd") else ""), 0.0)
    assert st.resolve("mykey").request_id == "cmpl-abc-0-1234abcd"
    assert st.resolve("abc", index=1).request_id == "cmpl-abc-1-5678abcd"
    assert st.resolve("cmpl-abc", index=0).request_id == "cmpl-abc-0-1234abcd"
    with pytest.raises(LookupFailed, match="index="):
        st.resolve("abc")
    assert st.resolve("nothing") is None


def test_store_evicts_finished_captures_lru_within_bytes_and_ttl():
    st = Store(retain_bytes=6000, retain_ttl_s=10.0)  # each capture here is ~2.8 kB
    for k, rid in enumerate(("a", "b", "c")):
        st.add(_begin(rid), 0.0)
        st.add(_tokens(rid, 2000), 0.0)
        st.add(_end(rid), float(k))
    st.touch(st.resolve("a"))  # a was read recently: b is the least recently used
    evicted = [e.request_id for e in st.evict(3.0)]
    assert evicted == ["b"] and st.retained_bytes <= 6000
    with pytest.raises(LookupFailed, match="retain_bytes"):
        st.resolve("b")
    st.add(_begin("live"), 0.0)
    assert sorted(e.request_id for e in st.evict(100.0)) == ["a", "c"]  # past the TTL; in-flight stays
    assert st.resolve("live") is not None and st.in_flight == 1


def test_in_process_daemon_hooks_snapshot_and_stop_from_another_thread(shm_dir, tmp_path):
    """The embedding API the service uses: on_ready, on_tick, snapshot() and stop() from other threads; tcp://."""
    import socket

    from vllm_tap.daemon.config import DaemonConfig
    from vllm_tap.daemon.server import Daemon

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = threading.Event()
    ticks: list[float] = []
    d = Daemon(DaemonConfig(shm_dir=shm_dir, endpoint=f"tcp://127.0.0.1:{port}", state_dir=str(tmp_path)),
               on_ready=ready.set, on_tick=lambda: ticks.append(time.monotonic()))
    t = threading.Thread(target=d.run)
    t.start()
    try:
        assert ready.wait(10)
        sc = Scenario(tp=2, n_requests=1)
        SyntheticEngine(sc, shm_dir).run()
        cap = Client(f"tcp://127.0.0.1:{port}").fetch(sc.request_id(0), timeout=10)
        assert_capture(sc, 0, capture_arrays(cap))
        snap = d.snapshot()
        assert len(snap.rings) == 3 and snap.retained_requests == 1 and snap.subscribers_total == 1
        assert snap.doorbell == os.path.join(shm_dir, ".doorbell")
        # An idle daemon raises each ring's waiting flag before it blocks; a commit then wakes it
        # through its doorbell rather than its timer.
        from vllm_tap import ring_format as rf
        from vllm_tap.ring_records import TensorId
        from vllm_tap.ring_files import ring_path
        from vllm_tap.ring_writer import RingWriter

        w = RingWriter(ring_path(shm_dir, "bell", 0), 1 << 16)
        try:
            deadline = time.monotonic() + 10
            while not w.reader_waiting and time.monotonic() < deadline:
                time.sleep(0.01)
            assert w.reader_waiting, "the idle daemon never raised the new ring's waiting flag"
            woken = d.snapshot().doorbell_wakeups
            w.write("r", TensorId(rf.TensorKind.LOGITS), [0], [1], np.ones((1, 4), np.float32))
            assert w._doorbell.sent == 1
            while d.snapshot().doorbell_wakeups == woken and time.monotonic() < deadline:
                time.sleep(0.01)
            assert d.snapshot().doorbell_wakeups > woken
        finally:
            w.close(unlink=True)
        time.sleep(0.3)
    finally:
        d.stop("test over")
        t.join(5)
    assert not t.is_alive()
    gaps = np.diff(ticks)
    assert len(ticks) > 3 and gaps.max() < 0.5, f"on_tick gaps up to {gaps.max():.3f} s"  # due every 0.1 s; slack for load


def test_a_backlog_of_decode_steps_read_after_a_stop_arrives_whole_with_its_steps_joined(daemon_proc, shm_dir):
    """A worker's decode steps pile up while the daemon is stopped; once it runs again it reads many
    steps of the same captures per round and handles each run as one (steps_joined). Subscribers get
    exactly the bytes written, every position, with and without the newest position held back
    (async scheduling), through the delivery arena."""
    from vllm_tap import ring_format as rf
    from vllm_tap.ring_records import TensorId
    from vllm_tap.spec import CaptureSpec, LogitsMode, PositionsMode

    n, prompt, steps, k = 24, 8, 60, 20
    spec = CaptureSpec(logits=LogitsMode.TOPK, topk=k, layers=(), positions=PositionsMode.OUTPUT).to_meta()
    rids = [f"backlog-{i}" for i in range(n)]
    sections = ((TensorId(rf.TensorKind.TOPK_IDS), rf.DType.INT32, k, (0, k), k),
                (TensorId(rf.TensorKind.TOPK_VALUES), rf.DType.FLOAT32, k, (0, k), k),
                (TensorId(rf.TensorKind.LOGSUMEXP), rf.DType.FLOAT32, 1, (0, 1), 1))

    def vals(i: int, pos: int, width: int, kind: int) -> np.ndarray:
        return (np.arange(width) + 1000 * pos + 100_000 * i + 10_000_000 * kind).astype(np.int32)

    def fill(i: int, pos: int, section: int) -> np.ndarray:
        tid, _dt, width, _s, _f = sections[section]
        a = vals(i, pos, width, tid.kind)
        return a if tid.kind == rf.TensorKind.TOPK_IDS else a.astype(np.float32)

    write_decode_backlog(shm_dir, daemon_proc, rids, spec, prompt, steps, sections, fill,
                         begin_meta=lambda i: {"async_scheduling": i % 2 == 0})
    c = daemon_proc.client()
    for i, rid in enumerate(rids):
        cap = c.fetch(rid, timeout=20)
        pos = np.arange(prompt - 1, prompt - 1 + steps)
        assert cap.positions.tolist() == pos.tolist() and cap.missing_positions == [] and cap.complete, rid
        got = cap.arrays()
        assert got["topk_ids"].tobytes() == np.stack([vals(i, p, k, rf.TensorKind.TOPK_IDS) for p in pos]).tobytes()
        assert np.array_equal(got["topk_values"], np.stack([vals(i, p, k, rf.TensorKind.TOPK_VALUES) for p in pos]).astype(np.float32))
        assert np.array_equal(got["logsumexp"].reshape(-1), np.array([vals(i, p, 1, rf.TensorKind.LOGSUMEXP)[0] for p in pos], np.float32))
    s = daemon_proc.status()
    assert s["steps_joined"] > steps // 2, s["steps_joined"]  # most steps were read in runs
    assert s["arena_messages"] > 0 and s["drops"]["records"] == 0
