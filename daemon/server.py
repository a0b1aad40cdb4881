"""The daemon: discovers rings, reads them, reassembles per request, serves subscribers over ZeroMQ.

One thread does everything in a loop (scan the shm directory, poll every ring, feed the
reassemblers, answer requests, push messages to subscribers), so there is no locking on the data
path; a lock only guards the state against `snapshot()` from another thread. Sends never block:
each subscriber reads its capture's history at its own pace through the ROUTER socket's high-water
mark, and one that falls more than `subscriber_queue` live messages behind is cut off as too slow,
so it cannot hold up the rings or the other subscribers.
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from vllm_tap import ring_format as rf
from vllm_tap import wire_format as wf
from vllm_tap.ring import RingFormatError, RingReader

from vllm_tap.daemon.config import DaemonConfig
from vllm_tap.daemon.messages import Frames, encode
from vllm_tap.daemon.reassembly import Begin, Event, Reassembler
from vllm_tap.daemon.sequence import SequenceCounter
from vllm_tap.daemon.store import Entry, LookupFailed, Store
from vllm_tap.daemon.watch import WatchHub
from vllm_tap.doorbell import Doorbell

log = logging.getLogger(__name__)

SCAN_INTERVAL_S = 0.25  # how often the shm directory is rescanned for new or replaced rings
LIVENESS_INTERVAL_S = 1.0  # how often writer pids are checked
RECENT_WRITE_NS = 10 * 10**9  # a ring written this recently counts as alive even if its pid is not
# visible (a writer in another pid namespace)
TICK_INTERVAL_S = 0.05  # reassembler timeouts, retention, subscription timeouts
ON_TICK_INTERVAL_S = 0.05
READ_BUDGET_BYTES = 16 << 20  # per ring per round, so one busy ring cannot starve the others
SEND_BATCH = 64  # messages per subscriber per round, for fairness between subscribers
SNDHWM = 256  # messages the socket holds per subscriber before sends to it would block
IDLE_AFTER_S = 1.0  # after this long with nothing to do ...
IDLE_SLEEP_S = 0.005  # ... sleep up to this long between ring polls
STOP_FLUSH_S = 1.0  # how long stop() tries to get the final messages out
TOO_SLOW_FLUSH_S = 5.0  # how long a cut-off subscriber's error is retried

# Delivery latency (ring read to send), seconds; fixed so scrapes can be compared over time.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)


class DaemonError(RuntimeError):
    """The daemon cannot start (bad endpoint, address in use); the message says why in one line."""


class Histogram:
    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def to_dict(self) -> dict[str, Any]:
        """Cumulative counts keyed by upper bound, like a Prometheus histogram."""
        buckets: dict[str, int] = {}
        acc = 0
        for le, c in zip(self.bounds, self.counts):
            acc += c
            buckets[format(le, "g")] = acc
        buckets["+Inf"] = self.count
        return {"buckets": buckets, "sum": self.sum, "count": self.count}


@dataclass(eq=False)
class _Ring:
    reader: RingReader
    instance: str
    alive: bool = True
    gone: bool = False  # writer_gone reported
    checked: float = 0.0

    @property
    def path(self) -> str:
        return self.reader.path


@dataclass(eq=False)
class _Sub:
    envelope: list[bytes]  # routing id, plus the empty delimiter when the peer is a REQ socket
    req: wf.Subscribe
    deadline: float  # when an unresolved name gives up
    entry: Entry | None = None
    index: int = 0  # next history index to send
    live_from: int = 0  # history length when attached: later messages are live (count for lag, latency)
    frames: Frames | None = None  # the encoded message at `index`, kept across a refused send
    final: Frames | None = None  # an error to send, after which the subscription ends
    final_deadline: float = 0.0

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.envelope[0], self.req.id)


@dataclass
class _Counters:
    records_in: int = 0
    payload_bytes_in: int = 0
    delivered_messages: int = 0
    delivered_bytes: int = 0
    subscribers_total: int = 0
    subscribers_too_slow: int = 0
    bad_requests: int = 0
    corrupt_rings_skipped: int = 0
    doorbell_wakeups: int = 0
    by_type: dict[str, int] = field(default_factory=dict)


def _frames_nbytes(frames: Frames) -> int:
    return sum(len(f) if isinstance(f, (bytes, bytearray)) else f.nbytes for f in frames)


class Daemon:
    def __init__(self, config: DaemonConfig, *, on_ready: Callable[[], None] | None = None,
                 on_tick: Callable[[], None] | None = None):
        self.config = config
        self.endpoint = config.resolved_endpoint()
        self._on_ready = on_ready
        self._on_tick = on_tick
        # A plain attribute, not a threading.Event: stop() must be safe inside a signal handler,
        # which could interrupt the main thread while it holds the Event's internal lock.
        self._stopping = False
        self._stop_reason = "daemon stopping"
        self._lock = threading.RLock()
        self._sock: zmq.Socket | None = None
        self._started_at = time.time()
        self._rings: dict[str, _Ring] = {}
        self._order: list[_Ring] = []  # engine rings first: BEGINs are then usually read before their data
        self._rejected: dict[str, int] = {}  # path -> inode of a file that is not a readable ring
        self._reasm: dict[str, Reassembler] = {}
        self.store = Store(config.retain_bytes, config.retain_ttl_s)
        # watch: sequence numbers and watchers (daemon/watch.py); told of every filed event and drop
        self.watch = WatchHub()
        self.store.on_drop = self.watch.dropped
        self._subs: dict[tuple[bytes, int], _Sub] = {}
        self._by_key: dict[tuple[str, str], set[_Sub]] = {}
        self._pending: set[_Sub] = set()
        self._active: set[_Sub] = set()  # subscriptions with something to send
        self._latency = Histogram()
        self.counters = _Counters()
        self._last_scan = self._last_tick = -1e9
        self._doorbell: Doorbell | None = None  # writers wake us through it; bound once shm_dir exists

    # -- control --

    def stop(self, reason: str = "daemon stopping") -> None:
        """Ask run() to return; safe from a signal handler or any thread."""
        if not self._stopping:
            self._stop_reason = reason
        self._stopping = True

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            # Mandatory routing: a send to a full or vanished peer fails (and we keep or drop that
            # subscriber) instead of being silently discarded by the socket.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDHWM, SNDHWM)
            sock.setsockopt(zmq.LINGER, 0)
            _prepare_endpoint(self.endpoint, ctx)
            try:
                sock.bind(self.endpoint)
            except zmq.ZMQError as e:
                raise DaemonError(f"cannot listen on {self.endpoint}: {e}") from None
            self._sock = sock
            # watch: the persisted sequence counter; SequenceStateError stops start-up (one line)
            self.watch.open(SequenceCounter(self.config.resolved_state_dir()))
            with self._lock:
                self._scan(time.monotonic())
            log.info("serving %s; watching %s (%d rings)", self.endpoint, self.config.shm_dir, len(self._rings))
            if self._on_ready is not None:
                self._on_ready()
            self._loop()
        finally:
            try:
                with self._lock:
                    if self._sock is not None:
                        self._shutdown()
            finally:
                self._sock = None
                sock.close(linger=0)
                ctx.term()
                self.watch.close()  # watch: a clean stop persists the last number used
        log.info("stopped: %s", self._stop_reason)

    def _loop(self) -> None:
        assert self._sock is not None
        idle_since = time.monotonic()
        last_on_tick = 0.0
        interval = max(self.config.poll_interval_s, 0.0)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        polled_bell = None
        while not self._stopping:
            with self._lock:
                now = time.monotonic()
                busy = self._step(now)
            if self._on_tick is not None and now - last_on_tick >= ON_TICK_INTERVAL_S:
                last_on_tick = now
                self._on_tick()
            if busy:
                idle_since = now
                continue
            bell = self._doorbell
            if bell is not None:
                # Writers ring after every commit: wait for that or a request. The timer is only a
                # backstop for a writer that could not ring (no permission, a lost wake-up).
                if polled_bell is not bell:
                    poller.register(bell.fileno(), zmq.POLLIN)
                    polled_bell = bell
                woke = dict(poller.poll(timeout=max(interval, IDLE_SLEEP_S) * 1000))
                if bell.fileno() in woke:
                    self.counters.doorbell_wakeups += bell.drain()
                continue
            sleep = interval if now - idle_since < IDLE_AFTER_S else max(interval, IDLE_SLEEP_S)
            # No doorbell (no shm directory yet): poll the rings. zmq's poll counts whole
            # milliseconds: a shorter interval would round up to 1 ms, and that wait was the floor
            # of the commit-to-subscriber latency. Below 1 ms, sleep the interval instead (a
            # request then waits at most that long).
            if sleep < 0.001:
                time.sleep(sleep)
            else:
                self._sock.poll(timeout=round(sleep * 1000), flags=zmq.POLLIN)

    def _step(self, now: float) -> bool:
        if now - self._last_scan >= SCAN_INTERVAL_S:
            self._last_scan = now
            self._scan(now)
        busy = self._read_rings()
        busy |= self._recv(now)
        if now - self._last_tick >= TICK_INTERVAL_S:
            self._last_tick = now
            for reasm in self._reasm.values():
                self._dispatch(reasm.tick(now), now)
            self.store.evict(now)
            self.watch.tick(now)
            for sub in [s for s in self._pending if now >= s.deadline]:
                self._not_found(sub)
        busy |= self._send_all()
        busy |= self.watch.pump(self._send, now)
        return busy

    # -- rings --

    def _reassembler(self, instance: str) -> Reassembler:
        r = self._reasm.get(instance)
        if r is None:
            r = self._reasm[instance] = Reassembler(instance, end_grace_s=self.config.end_grace_s)
        return r

    def _scan(self, now: float) -> None:
        for path, ring in list(self._rings.items()):
            if ring.reader.replaced():
                # The writer restarted (new file, new epoch) or the file went: finish the old
                # mapping first, it may hold records committed before the writer went away.
                self._drain(ring)
                self._reassembler(ring.instance).writer_gone(ring.reader.name, now)
                log.info("ring %s replaced or removed (epoch %d done)", path, ring.reader.epoch)
                ring.reader.close()
                del self._rings[path]
            elif now - ring.checked >= LIVENESS_INTERVAL_S:
                ring.checked = now
                self._check_alive(ring, now)
        if self._doorbell is None:
            self._doorbell = Doorbell.bind(self.config.shm_dir)
        try:
            instances = [e for e in os.scandir(self.config.shm_dir) if e.is_dir() and not e.name.startswith(".")]
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            instances = []
        for inst in instances:
            try:
                files = [f for f in os.scandir(inst.path) if f.name.endswith(rf.RING_SUFFIX)]
            except OSError:
                continue
            for f in files:
                if f.path not in self._rings:
                    self._open(f.path, inst.name, now)
        self._order = sorted(self._rings.values(), key=lambda r: (r.reader.rank != rf.ENGINE_RANK, r.instance, r.reader.rank))

    def _open(self, path: str, instance: str, now: float) -> None:
        try:
            inode = os.stat(path).st_ino
        except OSError:
            return
        if self._rejected.get(path) == inode:
            return
        try:
            reader = RingReader(path)
        except (RingFormatError, OSError, ValueError) as e:
            self._rejected[path] = inode
            log.warning("ignoring %s: %s", path, e)
            return
        self._rejected.pop(path, None)
        ring = self._rings[path] = _Ring(reader, instance, checked=now)
        self._check_alive(ring, now)
        log.info("reading ring %s (instance %s, rank %d, writer pid %d, epoch %d)",
                 path, instance, reader.rank, reader.writer_pid, reader.epoch)

    def _check_alive(self, ring: _Ring, now: float) -> None:
        alive = ring.reader.writer_alive()
        if not alive:
            last = ring.reader.info().stats["last_write_ns"]
            alive = last > 0 and time.time_ns() - last < RECENT_WRITE_NS
        ring.alive = alive
        if not alive and not ring.gone:
            ring.gone = True
            log.info("writer %d of %s is gone", ring.reader.writer_pid, ring.path)
            self._reassembler(ring.instance).writer_gone(ring.reader.name, now)
        elif alive:
            ring.gone = False

    def _poll_ring(self, ring: _Ring) -> int:
        recs = ring.reader.poll(max_bytes=READ_BUDGET_BYTES)
        if not recs:
            return 0
        now = time.monotonic()  # the read time: delivery latency is measured from here
        reasm = self._reassembler(ring.instance)
        c = self.counters
        for rec in recs:
            c.records_in += 1
            if rec.data is not None:
                c.payload_bytes_in += rec.data.nbytes
            self._dispatch(reasm.feed(rec, now), now)
        return len(recs)

    def _read_rings(self) -> bool:
        got = 0
        for ring in self._order:
            got += self._poll_ring(ring)
        return got > 0

    def _drain(self, ring: _Ring) -> None:
        while self._poll_ring(ring):
            pass

    # -- events to subscribers --

    def _dispatch(self, events: list[Event], now: float) -> None:
        for ev in events:
            entry = self.store.add(ev, now)
            if entry is None:
                continue
            self.watch.filed(ev, entry)
            if isinstance(ev, Begin):
                self._resolve_pending(entry, now)
                continue
            self._active.update(self._by_key.get(entry.key, ()))

    def _resolve_pending(self, entry: Entry, now: float) -> None:
        for sub in [s for s in self._pending if s.req.name in entry.names]:
            self._pending.discard(sub)
            self._resolve(sub, now)

    def _resolve(self, sub: _Sub, now: float) -> None:
        r = sub.req
        try:
            entry = self.store.resolve(r.name, r.index, r.instance)
        except LookupFailed as e:
            self._fail(sub, e.code, e.message)
            return
        if entry is None:
            if now >= sub.deadline:
                self._not_found(sub)
            else:
                self._pending.add(sub)
            return
        sub.entry = entry
        sub.index = 0
        sub.live_from = len(entry.history)
        self._by_key.setdefault(entry.key, set()).add(sub)
        self.store.touch(entry)
        self._active.add(sub)

    def _not_found(self, sub: _Sub) -> None:
        r = sub.req
        what = repr(r.name) + (f" index {r.index}" if r.index is not None else "") + (
            f" in instance {r.instance!r}" if r.instance is not None else "")
        self._fail(sub, wf.E_NOT_FOUND, f"no capture named {what} appeared within {r.timeout:g} s")

    def _fail(self, sub: _Sub, code: str, message: str, flush_s: float = 1.0) -> None:
        """End a subscription with an error message (sent as soon as the socket takes it)."""
        self._pending.discard(sub)
        self._detach(sub)
        sub.frames = None
        sub.final = wf.error_frames(code, message, sub.req.id)
        sub.final_deadline = time.monotonic() + flush_s
        self._active.add(sub)

    def _too_slow(self, sub: _Sub) -> None:
        self.counters.subscribers_too_slow += 1
        log.warning("subscriber %s to %r is more than %d messages behind: cut off",
                    sub.envelope[0].hex(), sub.req.name, self.config.subscriber_queue)
        self._fail(sub, wf.E_TOO_SLOW, f"too slow: more than {self.config.subscriber_queue} messages behind",
                   TOO_SLOW_FLUSH_S)

    def _remove(self, sub: _Sub) -> None:
        if self._subs.get(sub.key) is sub:
            del self._subs[sub.key]
        self._pending.discard(sub)
        self._active.discard(sub)
        self._detach(sub)

    def _detach(self, sub: _Sub) -> None:
        """Stop feeding the subscription live events of its capture."""
        if sub.entry is not None:
            subs = self._by_key.get(sub.entry.key)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._by_key[sub.entry.key]
            sub.entry = None

    def _send(self, envelope: list[bytes], frames: Frames) -> bool | None:
        """True if sent, False if the peer's queue is full now, None if the peer is gone."""
        assert self._sock is not None
        try:
            self._sock.send_multipart(envelope + frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                return None
            raise
        self.counters.delivered_messages += 1
        self.counters.delivered_bytes += _frames_nbytes(frames)
        return True

    def _pump_sub(self, sub: _Sub) -> bool:
        """Send what the subscriber may have now; True if anything went out."""
        sent = 0
        while sent < SEND_BATCH:
            if sub.final is not None:
                ok = self._send(sub.envelope, sub.final)
                if ok or ok is None or time.monotonic() >= sub.final_deadline:
                    self._remove(sub)
                return bool(ok) or sent > 0
            e = sub.entry
            if e is None or sub.index >= len(e.history):
                self._active.discard(sub)
                if e is not None and e.end is not None:
                    self._remove(sub)  # everything up to the End went out
                return sent > 0
            ev = e.history[sub.index]
            if sub.frames is None:
                sub.frames = encode(ev, e, sub.req.id, sub.req.from_position)
                if sub.frames is None:  # before from_position
                    sub.index += 1
                    continue
            ok = self._send(sub.envelope, sub.frames)
            if ok is None:
                log.debug("subscriber %s went away", sub.envelope[0].hex())
                self._remove(sub)
                return sent > 0
            if not ok:
                # The socket holds SNDHWM messages for this peer and refused another: what is
                # left is our queue for it. Past the bound it is too slow (a replay does not count).
                if len(e.history) - max(sub.index, sub.live_from) > self.config.subscriber_queue:
                    self._too_slow(sub)
                return sent > 0
            if sub.index >= sub.live_from:
                self._latency.observe(time.monotonic() - ev.at)
            sub.index += 1
            sub.frames = None
            sent += 1
        return True

    def _send_all(self) -> bool:
        busy = False
        for sub in list(self._active):
            busy |= self._pump_sub(sub)
        return busy

    # -- requests --

    def _reply(self, envelope: list[bytes], frames: Frames) -> None:
        if not self._send(envelope, frames):
            log.debug("reply to %s dropped (peer busy or gone)", envelope[0].hex())

    def _recv(self, now: float) -> bool:
        assert self._sock is not None
        got = False
        for _ in range(100):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            got = True
            envelope, body = frames[:1], frames[1:]
            if body and body[0] == b"":  # a REQ peer's delimiter: echo it back
                envelope, body = frames[:2], frames[2:]
            try:
                req = wf.parse_request(body)
            except wf.WireError as e:
                self.counters.bad_requests += 1
                log.info("bad request from %s: %s", envelope[0].hex(), e.message)
                self._reply(envelope, wf.error_frames(e.code, e.message, e.sub_id))
                continue
            kind = type(req).__name__
            self.counters.by_type[kind] = self.counters.by_type.get(kind, 0) + 1
            if isinstance(req, wf.StatusRequest):
                self._reply(envelope, [wf.pack(wf.STATUS, req.id, status=self._snapshot())])
            elif isinstance(req, wf.Cancel):
                old = self._subs.get((envelope[0], req.id))
                if old is not None:
                    self._remove(old)
                else:
                    self.watch.cancel(envelope, req.id)
            elif isinstance(req, wf.WatchRequest):
                refused = self.watch.attach(envelope, req, now)
                if refused is not None:
                    self.counters.bad_requests += 1
                    self._reply(envelope, refused)
            else:
                # The same id again replaces the subscription: clients resend to resume after
                # silence (a restarted daemon), from the position they got to.
                old = self._subs.get((envelope[0], req.id))
                if old is not None:
                    self._remove(old)
                else:
                    self.counters.subscribers_total += 1
                sub = _Sub(envelope, req, deadline=now + req.timeout)
                self._subs[sub.key] = sub
                self._resolve(sub, now)
        return got

    # -- shutdown --

    def _shutdown(self) -> None:
        reason = self._stop_reason
        for sub in list(self._subs.values()):
            self._fail(sub, wf.E_STOPPING, reason, STOP_FLUSH_S)
        self.watch.stop(reason, time.monotonic())
        deadline = time.monotonic() + STOP_FLUSH_S
        while (self._active or self.watch.busy) and time.monotonic() < deadline:
            self._send_all()
            self.watch.pump(self._send, time.monotonic())
            if self._active or self.watch.busy:
                time.sleep(0.005)
        for ring in self._rings.values():
            ring.reader.close()  # read cursors live in the files and are current after every poll
        self._rings.clear()
        self._order = []
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None

    # -- status --

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        rings = []
        dropped_records = dropped_bytes = 0
        for ring in self._order:
            info = ring.reader.info()
            dropped_records += info.stats["records_dropped"]
            dropped_bytes += info.stats["bytes_dropped"]
            rings.append({
                "path": ring.path, "instance": ring.instance, "name": ring.reader.name, "rank": info.rank,
                "world_size": info.world_size, "writer_pid": info.writer_pid, "alive": ring.alive,
                "epoch": info.epoch, "capacity": info.capacity, "pending_bytes": info.backlog_bytes,
                "read_cursor": info.read_cursor, "write_cursor": info.write_cursor, "corrupt": ring.reader.corrupt,
                "writer": dict(info.stats),
            })
        reasm_stats: dict[str, int] = {}
        requests: list[dict[str, Any]] = []
        for r in self._reasm.values():
            for k, v in r.stats.items():
                reasm_stats[k] = reasm_stats.get(k, 0) + v
            requests.extend(r.requests())
        c = self.counters
        return {
            "pid": os.getpid(),
            "wire_version": wf.WIRE_VERSION,
            "uptime_s": time.time() - self._started_at,
            "endpoint": self.endpoint,
            "shm_dir": self.config.shm_dir,
            # Writers wake the daemon through it; null: it polls the rings on a timer.
            "doorbell": self._doorbell.path if self._doorbell is not None else None,
            "doorbell_wakeups": c.doorbell_wakeups,
            "rings": rings,
            "requests_in_flight": sum(r.in_flight() for r in self._reasm.values()),
            "requests": requests[:100],
            "retained_requests": self.store.retained,
            "retained_bytes": self.store.retained_bytes,
            "evicted_requests": self.store.evictions,
            "records_in": c.records_in,
            "bytes_in": c.payload_bytes_in,
            "drops": {"records": dropped_records, "bytes": dropped_bytes,
                      "missing_positions": reasm_stats.get("missing_positions", 0)},
            "reassembly": reasm_stats,
            "subscribers": len(self._subs),
            "subscribers_waiting": len(self._pending),
            "subscribers_total": c.subscribers_total,
            "subscribers_too_slow": c.subscribers_too_slow,
            "delivered_messages": c.delivered_messages,
            "delivered_bytes": c.delivered_bytes,
            "bad_requests": c.bad_requests,
            "delivery_latency_s": self._latency.to_dict(),
            # watch: "sequence" (numbers given, retained range, state file) and "watchers"
            **self.watch.snapshot(time.monotonic()),
        }


def _prepare_endpoint(endpoint: str, ctx: zmq.Context) -> None:
    """Make an ipc socket's directory; refuse to take over a socket another daemon still serves."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path or path.startswith("@"):  # abstract namespace: nothing on disk
            return
        d = os.path.dirname(path)
        if d:
            try:
                os.makedirs(d, mode=0o755, exist_ok=True)
            except OSError as e:
                raise DaemonError(f"cannot create the socket directory {d}: {e}") from None
        if os.path.exists(path) and _answers(ctx, endpoint):
            raise DaemonError(f"another daemon is already serving {endpoint}")
    elif not endpoint.startswith(("tcp://", "inproc://")):
        raise DaemonError(f"unsupported endpoint {endpoint!r}: use ipc://PATH or tcp://HOST:PORT")


def _answers(ctx: zmq.Context, endpoint: str, timeout_s: float = 0.3) -> bool:
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        s.send_multipart(wf.StatusRequest(0).frames(), flags=zmq.NOBLOCK)
        return bool(s.poll(int(timeout_s * 1000)))
    except zmq.ZMQError:
        return False
    finally:
        s.close(linger=0)
