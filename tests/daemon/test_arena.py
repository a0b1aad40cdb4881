"""Delivery through shared memory: the daemon's arena, descriptors to same-host
subscribers, frames over tcp. Real daemon processes, real subscribers in other processes, the real
arena file; the allocator and the reassembler's destination are also driven directly."""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import pwd
import resource
import signal
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from synthetic_writer import Scenario, SyntheticEngine, assert_capture, capture_arrays, expected
from vllm_tap import arena_format as af
from vllm_tap import ring_format as rf
from vllm_tap.client import Chunk, Client
from vllm_tap.client.arena import OVERWRITTEN, ArenaError, ArenaView, wanted
from vllm_tap.daemon.arena import Arena
from vllm_tap.daemon.events import Tokens
from vllm_tap.daemon.destination import ArenaDestination
from vllm_tap.daemon.reassembly import Reassembler
from vllm_tap.ring_records import TensorId
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_writer import RingWriter
from project_layout import SUPPORT
from waiting import wait_until as _wait



def _fetch_in_child(endpoint: str, names: list[str], q, env: dict | None = None) -> None:
    """A subscriber process: fetch captures, send back plain arrays."""
    os.environ.update(env or {})
    try:
        c = Client(endpoint)
        out = {}
        for name in names:
            cap = c.fetch(name, timeout=30)
            out[name] = (capture_arrays(cap), list(cap.missing_positions))
        q.put(out)
    except BaseException as e:  # report, don't hang the parent
        q.put(repr(e))


def _fetch_all(endpoint: str, sc: Scenario, shm_dir: str, env: dict | None = None, status=None) -> dict:
    names = [sc.request_id(i) for i in range(sc.n_requests)]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_fetch_in_child, args=(endpoint, names, q, env))
    p.start()
    if status is not None:
        _wait(lambda: status()["subscribers_waiting"] == 1, 20, "the subscriber")
    writer = subprocess.run([sys.executable, os.path.join(SUPPORT, "synthetic_writer.py"), shm_dir, sc.to_json()],
                            capture_output=True, text=True, timeout=60)
    assert writer.returncode == 0, writer.stderr
    got = q.get(timeout=60)
    p.join(10)
    assert isinstance(got, dict), got
    return got


# -- the path, end to end --


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_dtype_and_tp2_slices_arrive_exact_through_the_arena(daemon_factory, shm_dir, dtype):
    # top-k adds int32 ids and float32 values, written whole by rank 0; logits and hidden states are
    # tensor-parallel slices reassembled in place in the arena.
    sc = Scenario(tp=2, n_requests=4, dtype=dtype, topk=3, vocab=96, hidden=24, layers=(0, 3), gen_len=6)
    d = daemon_factory(end_grace_s=1.0)
    got = _fetch_all(d.endpoint, sc, shm_dir, status=d.status)
    for i in range(sc.n_requests):
        arrays, missing = got[sc.request_id(i)]
        assert_capture(sc, i, arrays)
        assert missing == []
    s = d.status()
    a = s["arena"]
    assert a is not None and a["allocations"] > 0 and a["fallbacks"] == 0
    # Every tokens message went as descriptors: the payload they named is at least every array's bytes.
    itemsize = 4 if dtype == "float32" else 2
    payload = sc.n_requests * sc.end_position * (sc.hidden * len(sc.layers) * itemsize + sc.topk * 8)
    assert s["arena_messages"] > 0 and s["arena_bytes"] >= payload


def test_tcp_endpoints_and_an_opted_out_client_get_frames_with_the_same_bytes(daemon_factory, shm_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon_factory(end_grace_s=1.0, endpoint=f"tcp://127.0.0.1:{port}")
    assert not wanted(d.endpoint) and wanted("ipc:///run/x.sock")
    sc = Scenario(tp=2, n_requests=2, dtype="bfloat16")
    got = _fetch_all(d.endpoint, sc, shm_dir, status=d.status)
    for i in range(sc.n_requests):
        assert_capture(sc, i, got[sc.request_id(i)][0])
    s = d.status()
    assert s["arena"] is not None and s["arena_messages"] == 0 and s["delivered_bytes"] > 0
    # Over ipc, VLLM_TAP_ARENA=0 keeps a client on frames too (one daemon per shm dir).
    d.stop()
    d2 = daemon_factory(end_grace_s=1.0)
    sc2 = Scenario(tp=1, n_requests=2, prefix="opt-out")
    got = _fetch_all(d2.endpoint, sc2, shm_dir, env={"VLLM_TAP_ARENA": "0"}, status=d2.status)
    for i in range(sc2.n_requests):
        assert_capture(sc2, i, got[sc2.request_id(i)][0])
    assert d2.status()["arena_messages"] == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_of_records_goes_as_one_message_and_stacks_exactly(daemon_factory, shm_dir, dtype):
    """What one daemon pass has for a subscriber goes in one message (a name once per record); the
    client stacks each tensor's parts. A late subscriber's replay is the longest run there is."""
    sc = Scenario(tp=2, n_requests=1, dtype=dtype, gen_len=40, topk=3, vocab=96, hidden=24, layers=(0, 3))
    d = daemon_factory(end_grace_s=0.5)
    writer = subprocess.run([sys.executable, os.path.join(SUPPORT, "synthetic_writer.py"), shm_dir, sc.to_json()],
                            capture_output=True, text=True, timeout=60)
    assert writer.returncode == 0, writer.stderr
    _wait(lambda: d.status()["retained_requests"] == 1, 20, "the capture to end")
    before = d.status()["arena_messages"]
    sub = Client(d.endpoint).subscribe(sc.request_id(0), timeout=10)
    chunks = [c for c in sub.chunks() if isinstance(c, Chunk)]
    events = d.status()["arena_messages"] - before  # tokens events sent as descriptors
    assert sum(len(c) for c in chunks) == sc.end_position and sub.end.complete
    assert 0 < len(chunks) < events, (len(chunks), events)  # several records per message
    cap = Client(d.endpoint).fetch(sc.request_id(0), timeout=10)
    assert_capture(sc, 0, capture_arrays(cap))


def test_a_subscriber_that_read_to_the_end_lets_its_pins_go_at_once(daemon_factory, shm_dir):
    """What the daemon keeps for an arena subscriber after the End (arena_linger_s) is only for
    descriptors not yet copied: a client that read to the End says so (it cancels the finished
    subscription), and the daemon lets go then, not at the deadline or when the peer disconnects
    (a 1 MB stream used to keep a whole capture pinned into the next one: fresh arena pages)."""
    import zmq

    from vllm_tap import wire_format as wf

    sc = Scenario(tp=1, n_requests=1, gen_len=6)
    d = daemon_factory(end_grace_s=0.5, arena_linger_s=600)
    writer = subprocess.run([sys.executable, os.path.join(SUPPORT, "synthetic_writer.py"), shm_dir, sc.to_json()],
                            capture_output=True, text=True, timeout=60)
    assert writer.returncode == 0, writer.stderr
    _wait(lambda: d.status()["retained_requests"] == 1, 20, "the capture to end")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)  # stays connected throughout: only the cancel can free the pin
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    try:
        sock.send_multipart(wf.Subscribe(7, sc.request_id(0), arena=True).frames())
        while True:
            assert sock.poll(10000), "no message from the daemon"
            h = wf.unpack_header(sock.recv_multipart()[0])
            assert h["type"] != wf.ERROR, h
            if h["type"] == wf.END:
                break
        _wait(lambda: d.status()["arena"]["pinned_captures"] == 1, 10, "the pin")
        time.sleep(1.5)  # the liveness probe runs: the peer is there, the pin stays
        assert d.status()["arena"]["pinned_captures"] == 1
        sock.send_multipart(wf.Cancel(7).frames())
        _wait(lambda: d.status()["arena"]["pinned_captures"] == 0, 5, "the pin to go")
        assert d.status()["arena"]["pinned_bytes"] == 0
        # The client library sends that cancel by itself after the End.
        sub = Client(d.endpoint).subscribe(sc.request_id(0), timeout=10)
        assert sum(len(c) for c in sub.chunks() if isinstance(c, Chunk)) == sc.end_position
        _wait(lambda: d.status()["arena"]["pinned_captures"] == 0, 0.9, "the library's release")
    finally:
        sock.close(linger=0)


def test_arena_parts_of_one_name_stack_or_are_refused(shm_dir):
    a = Arena.create(shm_dir, 4 << 20)
    x = a.alloc((2, 8), np.float32)
    y = a.alloc((3, 8), np.float32)
    z = a.alloc((1, 4), np.float32)
    x[:] = np.arange(16).reshape(2, 8)
    y[:] = -np.arange(24).reshape(3, 8)
    v = ArenaView(a.path, a.arena_id)

    def desc(arr, name="logits", dtype="float32"):
        block, gen, offset = a.locate(arr)
        return [name, dtype, arr.shape[0], arr.shape[1], block, gen, offset]

    got = v.copy_out([desc(x), desc(y)])
    assert got["logits"][0] == rf.DType.FLOAT32 and (got["logits"][1] == np.concatenate([x, y])).all()
    with pytest.raises(ValueError, match="do not stack"):
        v.copy_out([desc(x), desc(z)])  # another width
    with pytest.raises(ValueError, match="do not stack"):
        v.copy_out([desc(x), desc(y, dtype="int32")])
    # One part's region reused meanwhile: the whole message is refused, not half of it.
    d_y = desc(y)
    del y
    assert v.copy_out([desc(x), d_y]) is None
    a.close()


# -- never garbage --


def _slow_subscriber(endpoint: str, name: str, sleep_s: float, ready_path: str, q) -> None:
    """Subscribes, takes the Begin and the first chunk, then sleeps while the daemon queues the rest
    as descriptors, then reads everything."""
    try:
        sub = Client(endpoint).subscribe(name, timeout=30)
        items = []
        for item in sub.chunks():
            if not items:
                open(ready_path, "w").close()
                time.sleep(sleep_s)
            items.append(item)
        out = []
        for it in items:
            if isinstance(it, Chunk):
                out.append(("chunk", list(it.positions), it.logits.copy()))
            else:
                out.append(("gap", [it.positions.start, it.positions.stop], it.reason))
        q.put((out, list(sub.end.missing_positions)))
    except BaseException as e:
        q.put(repr(e))


def _stream_to_a_slow_subscriber(daemon_factory, shm_dir, sock_dir, n_other, sleep_s, linger_s):
    """One capture streamed as descriptors to a subscriber that sleeps `sleep_s` after its first chunk,
    with retention 0 (the capture is dropped once sent); `other` has `n_other` captures to write next,
    into the regions the dropped capture frees. Returns the scenarios, the daemon, the result queue
    and the subscriber process."""
    sc = Scenario(tp=1, n_requests=1, prompt_len=4, gen_len=120, chunk=4, vocab=2048, hidden=16, layers=(0,),
                  ring_bytes=8 << 20)
    other = Scenario(tp=1, n_requests=n_other, prompt_len=4, gen_len=120, chunk=4, vocab=2048, hidden=16,
                     layers=(0,), ring_bytes=8 << 20, prefix="other", seed=1)
    d = daemon_factory(end_grace_s=0.5, retain_bytes=0, arena_linger_s=linger_s)
    ready = os.path.join(sock_dir, "ready")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_slow_subscriber, args=(d.endpoint, sc.request_id(0), sleep_s, ready, q))
    p.start()
    _wait(lambda: d.status()["subscribers_waiting"] == 1, 20, "the subscriber")
    eng = SyntheticEngine(sc, shm_dir)
    eng.begin()
    eng.run_step()
    _wait(lambda: os.path.exists(ready), 20, "the first chunk")
    while eng.run_step():  # the rest goes out as descriptors while the subscriber sleeps
        pass
    eng.close()
    return sc, other, d, q, p


def test_a_region_reused_under_a_slow_subscriber_is_detected_never_read(daemon_factory, shm_dir, sock_dir):
    # retain_bytes 0: a capture is dropped as soon as it ended and its messages went out, so the
    # arena reuses its regions for the next capture while the subscriber still holds descriptors.
    sc, other, d, q, p = _stream_to_a_slow_subscriber(daemon_factory, shm_dir, sock_dir, 6, 6.0, 0.5)
    _wait(lambda: d.status()["subscribers"] == 0, 20, "the subscription to be sent out and done")
    _wait(lambda: d.status()["retained_requests"] == 0 and d.status()["arena"]["pinned_captures"] == 0, 20,
          "the capture to be dropped and let go")
    eng2 = SyntheticEngine(other, shm_dir)  # its records land in the freed regions
    eng2.run()
    eng2.close()
    items, missing = q.get(timeout=60)
    p.join(10)
    exp = expected(sc, 0)["logits"]
    covered = []
    overwritten = []
    for kind, where, payload in items:
        if kind == "chunk":
            assert payload.tobytes() == exp[where].tobytes()  # whatever came as data is the capture's
            covered += where
        else:
            assert payload == OVERWRITTEN, payload
            overwritten += range(*where)
            covered += range(*where)
    assert overwritten, "no region was reused under the subscriber: the test proves nothing"
    assert sorted(covered) == list(range(sc.end_position))
    assert sorted(missing) == sorted(overwritten)


def test_a_subscriber_within_the_linger_gets_everything_after_retention_dropped_the_capture(daemon_factory, shm_dir,
                                                                                            sock_dir):
    """Descriptors already handed to zmq keep their capture pinned for arena_linger_s: a subscriber a
    little behind loses nothing even when retention (0 here) drops the capture at once."""
    sc, other, d, q, p = _stream_to_a_slow_subscriber(daemon_factory, shm_dir, sock_dir, 4, 4.0, 30)
    _wait(lambda: d.status()["subscribers"] == 0 and d.status()["retained_requests"] == 0, 20, "the capture dropped")
    assert d.status()["arena"]["pinned_captures"] == 1
    eng2 = SyntheticEngine(other, shm_dir)
    eng2.run()
    eng2.close()
    items, missing = q.get(timeout=60)
    p.join(10)
    exp = expected(sc, 0)["logits"]
    assert missing == [] and all(kind == "chunk" for kind, _, _ in items)
    got = [x for _, where, _ in items for x in where]
    assert got == list(range(sc.end_position))
    assert np.concatenate([payload for _, _, payload in items]).tobytes() == exp.tobytes()


def test_an_evicted_capture_leaves_nothing_readable_in_the_arena_file(daemon_factory, shm_dir):
    # A subscriber reads a capture through the arena, retention then evicts it (the client is told
    # CaptureEvicted): none of its values may still be in the file a subscriber group can map.
    from vllm_tap.client import CaptureEvicted

    sc = Scenario(tp=1, n_requests=1, vocab=4096, hidden=64, layers=(0,), prefix="secret")
    d = daemon_factory(end_grace_s=1.0, retain_ttl_s=1.0, arena_linger_s=0, arena_bytes=64 << 20)
    got = _fetch_all(d.endpoint, sc, shm_dir, status=d.status)
    assert_capture(sc, 0, got[sc.request_id(0)][0])
    s = d.status()
    assert s["arena_messages"] > 0
    path = s["arena"]["path"]
    _wait(lambda: d.status()["evicted_requests"] >= 1, what="retention to evict")
    with pytest.raises(CaptureEvicted):
        Client(d.endpoint).fetch(sc.request_id(0), timeout=5)
    # Freed, then zeroed once the daemon is idle (or, under load, overwritten or zeroed within a second).
    _wait(lambda: d.status()["arena"]["regions"] == 0 and d.status()["arena"]["unzeroed_bytes"] == 0,
          what="every region to be freed and zeroed")
    with open(path, "rb") as f:
        data = f.read()
    exp = expected(sc, 0)
    for name in ("logits", "hidden.0"):
        row = exp[name][3].tobytes()  # one whole row of the capture
        assert row not in data, f"{name} of the evicted capture is still in {path}"


def test_allocator_generations_move_when_a_region_is_freed(shm_dir):
    a = Arena.create(shm_dir, 4 << 20)
    try:
        x = a.alloc((2, 1000), np.float32)
        block, gen, offset = a.locate(x)
        assert a.locate(x[1:])[2] == offset + 4000 and a.locate(np.zeros(3)) is None
        x[:] = 7
        v = ArenaView(a.path, a.arena_id)
        desc = [["logits", "float32", 2, 1000, block, gen, offset]]
        (code, got), = v.copy_out(desc).values()
        assert code == rf.DType.FLOAT32 and (got == 7).all()
        del x  # freed: its generation moves, and a reused region never matches an old descriptor
        y = a.alloc((2, 1000), np.float32)
        assert a.locate(y)[0] == block and a.locate(y)[1] == gen + 1
        y[:] = 9
        assert v.copy_out(desc) is None and v.overwritten == 1
        with pytest.raises(ValueError):
            v.copy_out([["logits", "float32", 2, 1000, block, gen, a.capacity - 10]])
        with pytest.raises(ArenaError):
            ArenaView(a.path, a.arena_id + 2)
        # Full: the caller keeps the array on its heap; merged buddies serve a bigger request later.
        del y
        held = [a.alloc((1, 1 << 20), np.uint8) for _ in range(6)]
        assert sum(h is None for h in held) == 2 and a.fallbacks == 2
        del held
        assert a.regions == 0 and a.alloc((1, 4 << 20), np.uint8) is not None
    finally:
        a.close()
    assert not os.path.exists(a.path)


def test_a_freed_region_is_overwritten_whole_or_zeroed_never_handed_out_stale(shm_dir):
    import vllm_tap.daemon.arena as arena_mod

    a = Arena.create(shm_dir, 4 << 20)
    block = af.BLOCK
    file_view = np.frombuffer(a._mm, np.uint8)[a.data_offset:]
    try:
        x = a.alloc((2 * block,), np.uint8)
        x[:] = 0xAB
        assert a.locate(x)[2] == 0
        del x  # freed: not zeroed yet (no pass over memory at every free)
        assert a.unzeroed_bytes == 2 * block and (file_view[:2 * block] == 0xAB).all()
        # Taken again for something the caller fills only in part: every stale byte is zero first.
        y = a.alloc((block,), np.uint8)
        assert a.locate(y)[2] == 0 and (y == 0).all()
        assert a.unzeroed_bytes == block  # the block given back past it is still stale
        y[:] = 0xCD
        del y
        # Taken for a whole overwrite (a ring read): only what lies past the array's end is zeroed.
        z = a.alloc((100,), np.uint8, overwrite=True)
        assert a.locate(z)[2] == 0 and a.unzeroed_bytes == block
        assert (file_view[:100] == 0xCD).all()  # what the read will overwrite
        assert not file_view[100:block].any(), "the tail past the array kept stale bytes"
        assert (file_view[block:2 * block] == 0xAB).all()
        z[:] = 1
        del z
        # Under load: regions free for ZERO_WITHIN_S are zeroed by sweep(now); younger ones wait.
        t0 = time.monotonic()
        assert a.sweep(t0) == 0 and a.unzeroed_bytes == 2 * block
        assert a.sweep(t0 + arena_mod.ZERO_WITHIN_S + 0.01) == 2 * block
        assert a.unzeroed_bytes == 0 and not file_view[:2 * block].any()
        # Idle: sweep() zeroes whatever is stale at once.
        w = a.alloc((block,), np.uint8, overwrite=True)
        w[:] = 9
        del w
        assert a.sweep() == block and not file_view[:block].any()
        assert a.regions == 0 and a.allocated_bytes == 0
    finally:
        del file_view
        a.close()


def test_allocator_regions_never_overlap_and_everything_comes_back(shm_dir):
    """Random sizes (a region keeps only the blocks it needs), random frees: no two live regions share
    a byte, and once all are gone one request for the whole arena succeeds (buddies merged)."""
    a = Arena.create(shm_dir, 8 << 20)
    rng = np.random.default_rng(7)
    live: list[np.ndarray] = []
    try:
        for _ in range(3000):
            if live and rng.random() < 0.45:
                live.pop(int(rng.integers(len(live))))
                continue
            x = a.alloc((1, int(rng.integers(1, 300_000))), np.uint8)
            if x is None:
                continue
            x[:] = len(live) % 251
            live.append(x)
            spans = sorted((a.locate(y)[2], a.locate(y)[2] + y.nbytes) for y in live)
            assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))
            assert a.allocated_bytes == sum(-(-y.nbytes // af.BLOCK) * af.BLOCK for y in live)
        del x
        live.clear()
        assert a.regions == 0 and a.allocated_bytes == 0
        assert a.alloc((1, 8 << 20), np.uint8) is not None
    finally:
        a.close()


def test_locate_gives_every_view_its_own_offset_or_none(shm_dir):
    a = Arena.create(shm_dir, 4 << 20)
    a.alloc((5, 100), np.float32)  # so the next region does not start at 0
    x = a.alloc((4, 64), np.float32)
    base = x.ctypes.data
    for view in (x, x[1:], x[2:3], x.reshape(-1), x.reshape(2, 128)):
        block, _gen, off = a.locate(view)
        assert off == view.ctypes.data - base + block * af.BLOCK, view.shape
    for view in (x.T, x[::-1], x[:, 1:3], x.reshape(-1)[::-1]):  # not C-contiguous: not describable
        assert a.locate(view) is None
    assert a.locate(np.zeros((4, 64), np.float32)) is None
    a.close()


def test_allocator_keeps_the_footprint_at_the_bottom(shm_dir):
    """Fresh tmpfs pages cost more than the copy into them (reserve, zero, fault): regions come from
    the lowest free address, so a steady load keeps reusing the same pages at the bottom of the
    arena (before: the first region came from the top half of a default arena)."""
    a = Arena.create(shm_dir, 2 << 30)  # the default: two top regions of 1 GiB
    rng = np.random.default_rng(3)
    live: list[np.ndarray] = []
    high = 0
    for i in range(600):
        n = int(rng.choice([4096, 65536, 262144, 1 << 20])) // 4
        x = a.alloc((1, n), np.float32)
        live.append(x)
        block, _gen, off = a.locate(x)
        high = max(high, off + x.nbytes)
        if len(live) > 16:
            live.pop(int(rng.integers(0, len(live))))
    # At most 17 regions of at most 1 MiB live at once: the footprint stays within a few times that.
    assert high <= 64 << 20, high >> 20
    assert a.snapshot()["committed_bytes"] <= 80 << 20
    del live, x
    a.close()


def test_a_region_is_mapped_into_the_daemon_before_it_is_handed_out(shm_dir):
    # Large records are written by the copier child, so without this the daemon's first touch of a
    # page was the zeroing of a freed region: a fault every 4 KiB in the middle of ingest.
    a = Arena.create(shm_dir, 64 << 20)
    try:
        x = a.alloc((16 << 20,), np.uint8)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x[:] = 1  # 4,096 pages
        assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 256
        assert a.committed_bytes >= 16 << 20
    finally:
        del x
        a.close()


def test_tensor_parallel_slices_are_read_straight_into_one_array(shm_dir):
    """The ring reader asks its destination where each slice goes; the tensor delivered is that array."""
    a = Arena.create(shm_dir, 8 << 20)
    inst = os.path.join(shm_dir, "i")
    os.makedirs(inst)
    logits = TensorId(rf.TensorKind.LOGITS)
    reasm = Reassembler("i", alloc=a.alloc, hold_newest=0)
    destination = ArenaDestination(a)
    # Slices of 96 KiB: read by preadv straight into their columns (the large-record path).
    full = np.arange(3 * 16384, dtype=np.float32).reshape(3, 16384)
    events = []
    for rank, (lo, hi) in enumerate([(0, 8192), (8192, 16384)]):
        path = os.path.join(inst, f"rank-{rank:05d}.ring")
        w = RingWriter(path, 1 << 20, rank=rank, world_size=2)
        assert w.write("r", logits, [0, 1, 2], [5, 6, 7], np.ascontiguousarray(full[:, lo:hi]), step=1,
                       slice_=(lo, hi), full_dim=16384, expected_ranks=2)
        r = RingReader(path, destination=destination)
        (rec,) = r.poll()
        part = rec.sections[0].parts[0]
        assert a.locate(part) is None and part.base is not None  # a column view of the shared array
        events += reasm.feed(rec, 1.0)
        r.close()
        w.close()
    (tok,) = [e for e in events if isinstance(e, Tokens)]
    t = tok.tensors["logits"]
    assert a.locate(t) is not None and (t == full).all()
    assert a.allocations == 1  # one region for both slices: nothing concatenated
    a.close()


# -- what subscribers and daemons leave behind --


def _reader_killed(endpoint: str, name: str, q) -> None:
    sub = Client(endpoint).subscribe(name, timeout=30)
    for _ in sub.chunks():
        q.put("reading")
        time.sleep(60)  # killed here, mid-read


def test_a_subscriber_killed_mid_read_leaks_nothing(daemon_factory, shm_dir):
    sc = Scenario(tp=2, n_requests=1, gen_len=60, vocab=512, ring_bytes=4 << 20)
    d = daemon_factory(end_grace_s=0.5, retain_ttl_s=1.0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_reader_killed, args=(d.endpoint, sc.request_id(0), q))
    p.start()
    _wait(lambda: d.status()["subscribers_waiting"] == 1, 20, "the subscriber")
    eng = SyntheticEngine(sc, shm_dir)
    eng.run()
    eng.close()
    assert q.get(timeout=20) == "reading"
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    # Its subscription goes (the daemon notices the connection went), the capture is evicted after
    # its TTL, and every arena region comes back: nothing was pinned by the dead reader's mapping.
    _wait(lambda: d.status()["subscribers"] == 0, 20, "the dead subscriber to be dropped")
    _wait(lambda: d.status()["retained_requests"] == 0, 20, "the capture to be evicted")
    _wait(lambda: d.status()["arena"]["regions"] == 0, 20, "every arena region to be freed")
    assert d.status()["arena"]["allocations"] > 0
    # And the next subscriber is served as usual.
    sc2 = Scenario(tp=2, n_requests=1, prefix="after")
    got = _fetch_all(d.endpoint, sc2, shm_dir, status=d.status)
    assert_capture(sc2, 0, got[sc2.request_id(0)][0])


def _follow(endpoint: str, name: str, q) -> None:
    try:
        sub = Client(endpoint).subscribe(name, timeout=30)
        out = []
        for it in sub.chunks():
            if isinstance(it, Chunk):
                out.append(("chunk", list(it.positions), it.logits.copy()))
                q.put(("at", it.stop))
            else:
                out.append(("gap", [it.positions.start, it.positions.stop], it.reason))
        q.put(("done", out, list(sub.end.missing_positions)))
    except BaseException as e:
        q.put(("error", repr(e)))


def test_daemon_restart_with_subscribers_attached(daemon_factory, shm_dir):
    """A subscriber mid-stream when the daemon is killed resumes with the new daemon, which adopted
    the dead one's arena file (the same file, so the subscriber's mapping stays good)."""
    sc = Scenario(tp=2, n_requests=1, prompt_len=8, gen_len=12, chunk=4)
    d = daemon_factory(end_grace_s=1.0)
    first = d.status()["arena"]["path"]
    eng = SyntheticEngine(sc, shm_dir)
    eng.begin()
    for _ in range(5):
        eng.run_step()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_follow, args=(d.endpoint, sc.request_id(0), q))
    p.start()
    while True:
        msg = q.get(timeout=20)
        assert msg[0] == "at", msg
        if msg[1] == 10:
            break
    d.kill()
    while eng.run_step():
        pass
    d.start()
    second = d.status()["arena"]["path"]
    assert second == first and d.status()["arena"]["adopted"]["in_flight"] == 1
    assert glob.glob(os.path.join(shm_dir + ".arena", af.ARENA_PREFIX + "*")) == [second]
    while True:
        msg = q.get(timeout=30)
        if msg[0] != "at":
            break
    assert msg[0] == "done", msg
    _, items, missing = msg
    p.join(10)
    exp = expected(sc, 0)["logits"]
    got = []
    for kind, where, payload in items:
        if kind == "chunk":
            assert payload.tobytes() == exp[where].tobytes()
            got += where
    # Position 10, the newest when the daemon was killed, was held back (async scheduling) and not
    # filed: the ring's cursor stayed below it, and the new daemon read it again.
    assert got == list(range(sc.end_position)) and missing == []
    assert d.status()["arena_messages"] > 0  # after the restart, still through the (new) arena
    eng.close()


# -- who may read it --


def test_the_arena_file_is_private_to_the_daemon_and_its_group(daemon_factory, shm_dir, sock_dir):
    d = daemon_factory(end_grace_s=1.0)
    path = d.status()["arena"]["path"]
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == af.FILE_MODE and st.st_uid == os.geteuid()
    assert not stat.S_IMODE(st.st_mode) & 0o007  # nothing for other users
    if os.geteuid() != 0:
        pytest.skip("trying the file as another user needs root (useradd, setuid)")
    user = "vtaparena"
    if subprocess.run(["id", user], capture_output=True).returncode != 0:
        r = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", user], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot create a user: {r.stderr.strip()}")
    pw = pwd.getpwnam(user)
    assert pw.pw_gid != st.st_gid
    # Only the file's mode stands between that user and the arena: the directories let it through.
    assert os.path.dirname(path) == shm_dir + ".arena"  # arena_dir's default: beside the ring directory
    os.chmod(os.path.dirname(path), 0o755)
    os.chmod(sock_dir, 0o755)
    os.chmod(d.endpoint[len("ipc://"):], 0o777)
    probe = _as_user(pw, _try_open, path)
    assert probe.startswith("PermissionError"), probe
    # A subscriber running as that user cannot map it: it asks again without the arena and gets
    # the same bytes as frames.
    sc = Scenario(tp=2, n_requests=1, dtype="float16", prefix="other-user")
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the subscriber: numpy and zmq are imported already, then it becomes the other user
        try:
            os.close(rfd)
            _become(pw)
            cap = Client(d.endpoint).fetch(sc.request_id(0), timeout=30)
            out = json.dumps({k: v.tobytes().hex() for k, v in capture_arrays(cap).items()})
        except BaseException as e:
            out = json.dumps({"error": repr(e)})
        os.write(wfd, out.encode())
        os._exit(0)
    os.close(wfd)
    try:
        _wait(lambda: d.status()["subscribers_waiting"] == 1, 30, "the other user's subscriber")
        writer = subprocess.run([sys.executable, os.path.join(SUPPORT, "synthetic_writer.py"), shm_dir, sc.to_json()],
                                capture_output=True, text=True, timeout=60)
        assert writer.returncode == 0, writer.stderr
        raw = b""
        while chunk := os.read(rfd, 1 << 20):
            raw += chunk
    finally:
        os.close(rfd)
        os.waitpid(pid, 0)
    got = json.loads(raw)
    assert "error" not in got, got["error"]
    exp = capture_arrays_from_expected(sc)
    assert got.keys() == exp.keys() and all(bytes.fromhex(got[k]) == exp[k] for k in got)
    # (Descriptors the daemon sent before the client asked again went to the cancelled id.)
    assert d.status()["delivered_bytes"] > sum(len(v) for v in exp.values())  # the payload came as frames


def _become(pw) -> None:
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)


def _try_open(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.read(1)
        return "opened"
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def _as_user(pw, fn, *args) -> str:
    """fn(*args) in a forked child running as that user (this interpreter is not theirs to exec)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rfd)
            _become(pw)
            out = fn(*args)
        except BaseException as e:
            out = repr(e)
        os.write(wfd, out.encode())
        os._exit(0)
    os.close(wfd)
    raw = os.read(rfd, 1 << 16)
    os.close(rfd)
    os.waitpid(pid, 0)
    return raw.decode()


def capture_arrays_from_expected(sc: Scenario) -> dict[str, bytes]:
    return {k: np.ascontiguousarray(v).tobytes() for k, v in expected(sc, 0).items()}


def test_rows_of_a_request_spread_over_a_record_go_into_the_arena(shm_dir):
    """A step's record whose rows of one request are not together (a prefill's extra rows before the
    batch's sampled rows): each request's rows come out in order, in the arena."""
    from vllm_tap.ring_records import RequestRef, RequestTable

    a = Arena.create(shm_dir, 8 << 20)
    os.makedirs(os.path.join(shm_dir, "i"))
    reasm = Reassembler("i", alloc=a.alloc, hold_newest=0)
    path = os.path.join(shm_dir, "i", "rank-00000.ring")
    w = RingWriter(path, 1 << 22)
    table = RequestTable([RequestRef("a", start=0), RequestRef("b", start=0)])
    rows = np.array([[0, 1, 0, 1], [0, 0, 1, 1], [5, 6, 7, 8]], np.int32)  # slots a, b, a, b
    res = w.reserve_rows(table, rows, TensorId(rf.TensorKind.LOGITS), dtype=rf.DType.FLOAT32, width=64, step=1)
    data = np.arange(4 * 64, dtype=np.float32).reshape(4, 64)
    res.payload[:] = data.view(np.uint8).reshape(-1)
    w.commit(res)
    r = RingReader(path, destination=ArenaDestination(a))
    toks = {e.request_id: e for rec in r.poll() for e in reasm.feed(rec, 1.0) if isinstance(e, Tokens)}
    assert (toks["a"].tensors["logits"] == data[[0, 2]]).all() and (toks["b"].tensors["logits"] == data[[1, 3]]).all()
    assert all(a.locate(t.tensors["logits"]) is not None for t in toks.values())
    r.close()
    w.close()
    a.close()
