"""The daemon: discovers rings, reads them, reassembles per request, serves subscribers over ZeroMQ.

One thread does everything in a loop (discover rings, poll every ring, feed the reassemblers, answer
requests, push messages to subscribers), so there is no locking on the data path; a lock only
guards the state against `snapshot()` from another thread. Sends never block: each subscriber
reads its capture's history at its own pace through the ROUTER socket's high-water mark, and one
that falls more than `subscriber_queue` live messages behind is cut off as too slow, so it cannot
hold up the rings or the other subscribers.

What the daemon survives, and how (docs/operate.md says the same for operators):
- Anything in a ring: records are decoded against a schema (vllm_tap.ring_schema); one that does not
  fit is counted per ring, logged once with ring and cursor, and the captures it names end with a
  reason. A ring file that changes size under the daemon is dropped with one line, counted, and its
  captures end; rings are read with pread, never mapped, so nothing in a ring can fault the daemon.
- Rings are found through inotify without following links, a bounded amount of work per round.
- Writers: each ring's writer is watched through a pidfd (kill(pid, 0) where there is none); its
  death ends its captures within a second, after what its ring still holds is read.
- Connections: the descriptor limit is raised to the hard limit; connections are capped per peer
  and in all (peers.py), subscriptions per connection and in all; frames larger than
  MAX_FRAME_BYTES are refused by libzmq before they are buffered; subscriptions waiting for a name
  are indexed by name and dropped when their peer goes.
- Memory: what captures in flight hold (reassembly and histories) is kept inside `inflight_bytes`;
  beyond it the biggest capture is cut, its remaining positions becoming gaps with a reason.

Delivery (daemon/arena.py): payloads are read from the rings straight into the delivery arena, a
shared-memory file of the daemon's own (one copy; tensor-parallel slices into their columns).
Subscribers and watchers that offered to map it (same host: ipc://) get descriptors; the others
get the same arrays as frames. Regions go back when the daemon drops what references them. A
descriptor handed to zmq is not yet copied by its subscriber (up to two socket queues of them
may be on the way), so a capture whose last message went to an arena subscriber stays pinned for
`arena_linger_s` more (retention may have dropped it meanwhile), or until that peer is gone or
says it read to the End (it cancels the finished subscription), and
pins never hold more than half of arena_bytes in all (oldest let go first). A subscriber still slower
than that finds the generation of a reused region moved: a Gap, never other bytes. A dead
subscriber's pins go with its connection (the liveness probe notices within a second).
"""

from __future__ import annotations

import bisect
import errno
import heapq
import itertools
import logging
import os
import resource
import select
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from vllm_tap import ring_format as rf
from vllm_tap import wire_format as wf
from vllm_tap.ring import RingBroken, RingFormatError, RingReader
from vllm_tap.ring_schema import tensor_id

from vllm_tap.daemon import handover
from vllm_tap.daemon.arena import Arena
from vllm_tap.safe_paths import UnsafePath

from vllm_tap.daemon.access import (RingAccess, narrow_socket, prepare_arena_dir, prepare_socket_dir, socket_gid,
                                    socket_path)
from vllm_tap.daemon.config import DaemonConfig
from vllm_tap.daemon.config_load import is_loopback
from vllm_tap.daemon.curve import CurveServer
from vllm_tap.daemon.discovery import Candidate, RingDirectory
from vllm_tap.daemon.messages import Frames, encode_run
from vllm_tap.daemon.peers import Peers
from vllm_tap.daemon.reassembly import OVER_BUDGET, RING_BROKEN, Begin, Event, Reassembler, Tokens
from vllm_tap.daemon.sequence import SequenceCounter
from vllm_tap.daemon.store import Entry, LookupFailed, Store
from vllm_tap.daemon.watch import WatchHub
from vllm_tap.doorbell import Doorbell

log = logging.getLogger(__name__)

DISCOVERY_INTERVAL_S = 0.05  # how often discovery runs (inotify events, or a slice of a scan)
DISCOVERY_WALK = 4096  # directory entries looked at per discovery round
DISCOVERY_OPENS = 256  # candidate files tried per discovery round
LIVENESS_INTERVAL_S = 1.0  # rings without a pidfd: how often kill(pid, 0) runs; all rings: replaced?
RECENT_WRITE_NS = 10 * 10**9  # a ring written this recently counts as alive even if its pid is not
# visible (a writer in another pid namespace)
TICK_INTERVAL_S = 0.05  # reassembler timeouts, retention, subscription timeouts
ON_TICK_INTERVAL_S = 0.05
PROBE_INTERVAL_S = 1.0  # how often connections holding subscriptions are checked for having gone
READ_BUDGET_BYTES = 16 << 20  # per ring per round, so one busy ring cannot starve the others
SEND_BATCH = 64  # messages per subscriber per round, for fairness between subscribers
SNDHWM = 256  # messages the socket holds per subscriber before sends to it would block
MAX_FRAME_BYTES = 1 << 20  # a request is one frame of at most wire_format.MAX_REQUEST_BYTES
IDLE_AFTER_S = 1.0  # after this long with nothing to do ...
IDLE_SLEEP_S = 0.005  # ... sleep up to this long between ring polls (no doorbell)
DOORBELL_BACKSTOP_S = TICK_INTERVAL_S  # with the doorbell: the longest sleep (the tick is due then)
STOP_FLUSH_S = 1.0  # how long stop() tries to get the final messages out
TOO_SLOW_FLUSH_S = 5.0  # how long a cut-off subscriber's error is retried
MAX_NOFILE = 1 << 20  # the soft descriptor limit is raised to the hard one, up to this
LOG_FIRST = 20  # refused ring files logged one by one; then a count per minute

# Delivery latency (ring read to send), seconds; fixed so scrapes can be compared over time.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)


class DaemonError(RuntimeError):
    """The daemon cannot start (bad endpoint, address in use); the message says why in one line."""


class AccessError(DaemonError):
    """A squatted or too open directory, or unusable keys: restarting cannot fix it, the operator must."""


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


def raise_nofile_limit() -> int:
    """Raise the soft descriptor limit to the hard one (libzmq aborts when accept() meets EMFILE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_NOFILE if hard == resource.RLIM_INFINITY else min(hard, MAX_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft if soft != resource.RLIM_INFINITY else MAX_NOFILE
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return want
    except (ValueError, OSError) as e:
        log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, want, e)
        return soft


@dataclass(eq=False)
class _Ring:
    reader: RingReader
    instance: str
    dir_fd: int
    alive: bool = True
    gone: bool = False  # writer_gone reported
    checked: float = 0.0
    pidfd: int | None = None
    exited_at_cursor: int | None = None  # where the ring was when its writer's pidfd said it exited
    sink_failures: int = 0  # reader.sink_failures already counted by the arena

    @property
    def path(self) -> str:
        return self.reader.path

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.reader.name)


@dataclass(eq=False)
class _Sub:
    envelope: list[bytes]  # routing id, plus the empty delimiter when the peer is a REQ socket
    req: wf.Subscribe
    deadline: float  # when an unresolved name gives up
    entry: Entry | None = None
    index: int = 0  # next history index to send
    live_from: int = 0  # history length when attached: later messages are live (count for lag, latency)
    arena: Arena | None = None  # the subscriber maps it: descriptors instead of payload frames
    frames: Frames | None = None  # the encoded message at `index`, kept across a refused send
    covers: int = 1  # how many history events `frames` carries (a run of tokens through the arena)
    final: Frames | None = None  # an error to send, after which the subscription ends
    final_deadline: float = 0.0
    pending: bool = False  # waiting for its name to appear

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.envelope[0], self.req.id)


@dataclass
class _Counters:
    records_in: int = 0
    payload_bytes_in: int = 0
    delivered_messages: int = 0
    delivered_bytes: int = 0
    arena_messages: int = 0  # tokens messages sent as arena descriptors (their payload bytes below)
    arena_bytes: int = 0
    subscribers_total: int = 0
    subscribers_too_slow: int = 0
    subscriptions_refused: int = 0
    subscriptions_dropped_peer_gone: int = 0
    bad_requests: int = 0
    doorbell_wakeups: int = 0
    rings_refused: int = 0
    rings_broken: int = 0
    rejected_records: int = 0  # also counts those of rings no longer read
    corrupt_records: int = 0
    writers_exited: int = 0
    reassembly_errors: int = 0
    captures_cut: int = 0
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
        self._peers: Peers | None = None
        self._started_at = time.time()
        self._rings: dict[tuple[str, str], _Ring] = {}
        self._order: list[_Ring] = []  # engine rings first: BEGINs are then usually read before their data
        self._by_pidfd: dict[int, _Ring] = {}
        self._broken: list[dict[str, Any]] = []  # rings dropped because they changed under the daemon (last 100)
        self.access = RingAccess.from_config(config)
        self._dir = RingDirectory(config.shm_dir, root_rule=self.access.root, dir_rule=self.access.dirs)
        self._reasm: dict[str, Reassembler] = {}
        self.store = Store(config.retain_bytes, config.retain_ttl_s)
        # watch: sequence numbers and watchers (daemon/watch.py); told of every filed event and drop
        self.watch = WatchHub()
        self.store.on_drop = self.watch.dropped
        self._subs: dict[tuple[bytes, int], _Sub] = {}
        self._by_conn: dict[bytes, set[_Sub]] = {}  # routing id -> its subscriptions
        self._by_key: dict[tuple[str, str], set[_Sub]] = {}
        self._pending: dict[str, set[_Sub]] = {}  # name -> subscriptions waiting for it
        self._n_pending = 0
        self._deadlines: list[tuple[float, int, _Sub]] = []  # heap of pending subscriptions' deadlines
        self._seq = itertools.count()
        self._active: set[_Sub] = set()  # subscriptions with something to send
        self._latency = Histogram()
        self.counters = _Counters()
        self._last_discovery = self._last_tick = self._last_probe = self._last_liveness = -1e9
        self._fd_events = select.poll()
        self._fd_due = False
        self._doorbell: Doorbell | None = None  # writers wake us through it; bound once shm_dir exists
        self.arena: Arena | None = None  # delivered arrays; created at start-up (arena_bytes > 0)
        # Captures fully handed to an arena subscriber's socket, kept until it had time to copy them:
        # routing id -> [(deadline, entry, subscription id)], plus the bytes they hold (see the
        # module docstring). A client that read to the End says so (a cancel): its pins go then.
        self._pins: dict[bytes, list[tuple[float, Entry, int | None]]] = {}
        self._pinned_bytes = 0
        self.nofile = 0
        self._refusal_logs = LOG_FIRST
        self._closed_ring_counts = (0, 0)  # rejected, corrupt of rings no longer read

    # -- control --

    def stop(self, reason: str = "daemon stopping") -> None:
        """Ask run() to return; safe from a signal handler or any thread."""
        if not self._stopping:
            self._stop_reason = reason
        self._stopping = True

    def run(self) -> None:
        self.nofile = raise_nofile_limit()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            # Mandatory routing: a send to a full or vanished peer fails (and we keep or drop that
            # subscriber) instead of being silently discarded by the socket.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDHWM, SNDHWM)
            sock.setsockopt(zmq.LINGER, 0)
            # A larger frame closes the connection as it arrives, before libzmq allocates for it.
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            gid = socket_gid(self.config)
            try:
                _prepare_endpoint(self.endpoint, ctx, gid)
                curve = self._curve()
                self._prepare_shm_dir()
                self._open_arena(gid)
            except UnsafePath as e:
                raise AccessError(str(e)) from None
            self._peers = Peers(ctx, sock, self.endpoint, max_connections=self.config.max_connections,
                                max_per_peer=self.config.max_connections_per_peer, fd_limit=self.nofile,
                                curve=curve, on_bind=lambda: narrow_socket(self.endpoint, gid))
            if curve is not None:
                curve.apply(sock)
            try:
                self._peers.bind()
            except (zmq.ZMQError, OSError) as e:
                raise DaemonError(f"cannot listen on {self.endpoint}: {e}") from None
            narrow_socket(self.endpoint, gid)
            self._sock = sock
            # watch: the persisted sequence counter; SequenceStateError stops start-up (one line)
            self.watch.open(SequenceCounter(self.config.resolved_state_dir()))
            with self._lock:
                self._take_handover(time.monotonic())
                self._discover(time.monotonic())
            log.info("serving %s; watching %s (%d rings, %s; descriptor limit %d)", self.endpoint,
                     self.config.shm_dir, len(self._rings), "inotify" if self._dir.fileno() is not None else "scanning",
                     self.nofile)
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
                if self.arena is not None:
                    self.arena.close()  # also when start-up failed after making it
                peers, self._peers = self._peers, None
                if peers is not None:
                    peers.close()
                sock.close(linger=0)
                if peers is not None:
                    peers.close_gate()
                ctx.term()
                self.watch.close()  # watch: a clean stop persists the last number used
        log.info("stopped: %s", self._stop_reason)

    def _curve(self) -> CurveServer | None:
        cfg = self.config
        if not cfg.curve_key:
            if self.endpoint.startswith("tcp://"):
                log.warning("%s has no CURVE keys: %s can connect and read every capture (see curve_key)",
                            self.endpoint, "any local user" if is_loopback(self.endpoint) else "anyone who reaches it")
            return None
        curve = CurveServer(cfg.curve_key, cfg.curve_clients)
        log.info("CURVE on %s: %d allowed client keys in %s", self.endpoint, curve.allowed_keys, cfg.curve_clients)
        return curve

    def _prepare_shm_dir(self) -> None:
        """Make the ring directory, or refuse a squatted one (UnsafePath). One that cannot be made here
        (a read-only parent) is waited for, and checked when it appears (discovery)."""
        try:
            self.access.prepare_root(self.config.shm_dir)
        except UnsafePath:
            raise
        except OSError as e:
            log.warning("cannot create the shm directory %s (%s): waiting for it to appear", self.config.shm_dir,
                        e.strerror or e)

    def _loop(self) -> None:
        assert self._sock is not None
        idle_since = time.monotonic()
        last_on_tick = 0.0
        interval = max(self.config.poll_interval_s, 0.0)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._peers is not None:
            for s in self._peers.sockets():
                poller.register(s, zmq.POLLIN)
        watched: set[int] = set()
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
            # Descriptors that wake the loop besides the socket: inotify, and one pidfd per writer.
            want = set(self._by_pidfd)
            if self._dir.fileno() is not None:
                want.add(self._dir.fileno())
            for fd in watched - want:
                poller.unregister(fd)
            for fd in want - watched:
                poller.register(fd, zmq.POLLIN)
            watched = want
            bell = self._doorbell
            if bell is not None:
                # Writers ring after a commit while we sleep (the rings' waiting flags): wait for that
                # or a request. The timer is the tick, and a backstop for a writer that could not
                # ring (no permission, a lost wake-up).
                if polled_bell is not bell:
                    poller.register(bell.fileno(), zmq.POLLIN)
                    polled_bell = bell
                readers = [r.reader for r in self._order]
                if not _arm(readers):
                    continue  # a commit came in as we were about to sleep: read it first
                try:
                    woke = dict(poller.poll(timeout=max(interval, DOORBELL_BACKSTOP_S) * 1000))
                finally:
                    _disarm(readers)
                if bell.fileno() in woke:
                    self.counters.doorbell_wakeups += bell.drain()
                if any(fd in woke for fd in watched):
                    self._fd_due = True
                continue
            sleep = interval if now - idle_since < IDLE_AFTER_S else max(interval, IDLE_SLEEP_S)
            # No doorbell (no shm directory yet): poll the rings. zmq's poll counts whole
            # milliseconds: a shorter interval would round up to 1 ms, and that wait was the floor
            # of the commit-to-subscriber latency. Below 1 ms, sleep the interval instead (a
            # request then waits at most that long).
            if sleep < 0.001:
                time.sleep(sleep)
            else:
                woke = dict(poller.poll(timeout=round(sleep * 1000)))
                if any(fd in woke for fd in watched):
                    self._fd_due = True

    def _step(self, now: float) -> bool:
        busy = self._peers.pump() if self._peers is not None else False
        tick = now - self._last_tick >= TICK_INTERVAL_S
        if self._fd_due or tick:
            self._fd_due = False
            self._check_fds(now)
        if now - self._last_discovery >= DISCOVERY_INTERVAL_S:
            self._last_discovery = now
            self._discover(now)
        busy |= self._read_rings()
        busy |= self._recv(now)
        if tick:
            self._last_tick = now
            for reasm in self._reasm.values():
                self._dispatch(reasm.tick(now), now)
            self._shed(now)
            self.store.evict(now)
            self.watch.tick(now)
            self._expire_pending(now)
            if now - self._last_liveness >= LIVENESS_INTERVAL_S:
                self._last_liveness = now
                self._check_rings(now)
            if now - self._last_probe >= PROBE_INTERVAL_S:
                self._last_probe = now
                self._probe_peers()
        busy |= self._send_all()
        busy |= self.watch.pump(self._send, now)
        return busy

    # -- rings --

    def _open_arena(self, gid: int | None) -> None:
        """The delivery arena in its own directory (daemon/access.py: readable by the subscribers'
        group only). UnsafePath for a squatted or too open directory; one that cannot be made or
        filled here (a read-only parent, no space) costs the arena only: subscribers get frames."""
        if self.config.arena_bytes <= 0:
            return
        directory = self.config.resolved_arena_dir()
        try:
            made = prepare_arena_dir(directory, gid)
            self.arena = Arena.create(directory, self.config.arena_bytes, gid)
        except UnsafePath:
            raise
        except OSError as e:
            log.warning("no delivery arena in %s (%s): every subscriber gets payloads as frames", directory,
                        e.strerror or e)
            return
        self.arena.remove_dir = made
        self.watch.arena = self.arena
        self.watch.pin = self._pin
        for r in self._reasm.values():
            r.alloc = self.arena.alloc

    def _reassembler(self, instance: str) -> Reassembler:
        r = self._reasm.get(instance)
        if r is None:
            r = self._reasm[instance] = Reassembler(instance, end_grace_s=self.config.end_grace_s,
                                                    alloc=self.arena.alloc if self.arena is not None else None)
        return r

    def _sink(self, instance: str) -> Any:
        """Where a ring's DATA payloads go: the places reassembly picks in the arena."""
        reasm = self._reassembler(instance)

        def sink(plan: Any, i: int) -> Any:
            h = plan.h
            return reasm.target(plan.request_id(i), h.step, tensor_id(h.tensor, h.layer), h.slice_start, h.slice_stop, h.full_dim,
                                plan.part_rows(i), plan.dtype)

        return sink

    def _discover(self, now: float) -> None:
        if self._doorbell is None:
            self._doorbell = Doorbell.bind(self.config.shm_dir)
        for c in self._dir.step(now, DISCOVERY_WALK, DISCOVERY_OPENS):
            self._open(c, now)
        if self._dir.changed:
            changed, self._dir.changed = self._dir.changed, set()
            for key in changed:
                ring = self._rings.get(key)
                if ring is not None and ring.reader.replaced(ring.dir_fd):
                    self._retire(ring, now, "replaced or removed")

    def _open(self, c: Candidate, now: float) -> None:
        old = self._rings.get(c.key)
        if old is not None:
            if not old.reader.replaced(old.dir_fd):
                return
            self._retire(old, now, "replaced")
        path = os.path.join(self.config.shm_dir, c.instance, c.name)
        try:
            reader = RingReader(path, dir_fd=c.dir_fd, name=c.name)
            why = self.access.files.problem(os.fstat(reader.fileno()))
            if why:
                reader.close()
                raise UnsafePath(f"{why} (ring_group / ring_owners / ring_mode)")
        except (RingFormatError, OSError, ValueError, UnsafePath) as e:
            inode = c.inode
            if inode is None:
                try:
                    inode = os.stat(c.name, dir_fd=c.dir_fd, follow_symlinks=False).st_ino
                except OSError:
                    inode = None
            self._dir.reject(c, inode)
            self.counters.rings_refused += 1
            if self._refusal_logs > 0:
                self._refusal_logs -= 1
                log.warning("ignoring %s: %s%s", path, e, "" if self._refusal_logs else
                            " (further refused files are only counted: `vllm-tap status`)")
            return
        reader.sink = self._sink(c.instance)
        ring = self._rings[c.key] = _Ring(reader, c.instance, c.dir_fd, checked=now)
        if reader.resumed:
            self._reassembler(c.instance).resumed_ring(reader.name)
        self._watch_writer(ring, now)
        self._order = sorted(self._rings.values(),
                             key=lambda r: (r.reader.rank != rf.ENGINE_RANK, r.instance, r.reader.rank))
        log.info("reading ring %s (instance %s, rank %d, writer pid %d, epoch %d%s)", path, c.instance,
                 reader.rank, reader.writer_pid, reader.epoch, ", resuming a previous reader's cursor" if reader.resumed else "")

    def _watch_writer(self, ring: _Ring, now: float) -> None:
        """A pidfd for the writer where its pid is visible here; else kill(pid, 0) every second."""
        try:
            fd = os.pidfd_open(ring.reader.writer_pid)
        except (OSError, AttributeError):
            self._check_alive(ring, now)
            return
        ring.pidfd = fd
        self._by_pidfd[fd] = ring
        self._fd_events.register(fd, select.POLLIN)
        self._check_fds(now)

    def _unwatch_writer(self, ring: _Ring) -> None:
        if ring.pidfd is not None:
            self._by_pidfd.pop(ring.pidfd, None)
            try:
                self._fd_events.unregister(ring.pidfd)
            except KeyError:
                pass
            os.close(ring.pidfd)
            ring.pidfd = None

    def _check_fds(self, now: float) -> None:
        """pidfds of writers that exited (and inotify, which discovery reads itself)."""
        if not self._by_pidfd:
            return
        for fd, _ in self._fd_events.poll(0):
            ring = self._by_pidfd.get(fd)
            if ring is not None:
                self._writer_exited(ring, now)

    def _writer_exited(self, ring: _Ring, now: float) -> None:
        self._unwatch_writer(ring)
        self._drain(ring)  # what it committed before it died still counts
        if ring.key not in self._rings:
            return
        self.counters.writers_exited += 1
        try:
            ring.exited_at_cursor = ring.reader.write_cursor()
        except (RingBroken, OSError):
            ring.exited_at_cursor = None
        ring.alive = False
        if not ring.gone:
            ring.gone = True
            log.info("writer %d of %s exited", ring.reader.writer_pid, ring.path)
            self._reassembler(ring.instance).writer_gone(ring.reader.name, now)

    def _check_rings(self, now: float) -> None:
        for ring in list(self._rings.values()):
            if ring.reader.replaced(ring.dir_fd):
                self._retire(ring, now, "replaced or removed")
                continue
            try:
                ring.reader.check()
            except (RingBroken, OSError) as e:
                self._break(ring, now, str(e))
                continue
            if ring.pidfd is None and ring.exited_at_cursor is None:
                self._check_alive(ring, now)
            elif ring.exited_at_cursor is not None:
                self._written_after_exit(ring)

    def _written_after_exit(self, ring: _Ring) -> None:
        """A ring still written after its writer's pid exited: the pid was another process (the writer
        lives in another pid namespace). Fall back to kill(pid, 0) and recent writes."""
        try:
            w = ring.reader.write_cursor()
        except (RingBroken, OSError):
            return
        if ring.exited_at_cursor is not None and w > ring.exited_at_cursor:
            log.warning("ring %s is still written after pid %d exited: its writer is in another pid namespace? "
                        "Run the daemon in vLLM's.", ring.path, ring.reader.writer_pid)
            ring.exited_at_cursor = None
            ring.gone = False
            ring.alive = True

    def _check_alive(self, ring: _Ring, now: float) -> None:
        alive = ring.reader.writer_alive()
        if not alive:
            try:
                last = ring.reader.info().stats["last_write_ns"]
            except (RingBroken, OSError):
                last = 0
            alive = last > 0 and time.time_ns() - last < RECENT_WRITE_NS
        ring.alive = alive
        if not alive and not ring.gone:
            ring.gone = True
            log.info("writer %d of %s is gone", ring.reader.writer_pid, ring.path)
            self._drain(ring)
            self._reassembler(ring.instance).writer_gone(ring.reader.name, now)
        elif alive:
            ring.gone = False

    def _retire(self, ring: _Ring, now: float, why: str) -> None:
        """The path names another file now (the writer restarted) or none: finish the old one first,
        it may hold records committed before the writer went away."""
        self._drain(ring)
        self._close_ring(ring)
        self._reassembler(ring.instance).writer_gone(ring.reader.name, now)
        log.info("ring %s %s (epoch %d done)", ring.path, why, ring.reader.epoch)

    def _break(self, ring: _Ring, now: float, why: str) -> None:
        """The file changed under us: stop reading it at once, say so, end its captures."""
        self.counters.rings_broken += 1
        log.error("ring %s: %s; no longer read (its captures end)", ring.path, why)
        self._broken.append({"path": ring.path, "instance": ring.instance, "why": why, "at": time.time()})
        del self._broken[:-100]
        self._close_ring(ring)
        self._reassembler(ring.instance).writer_gone(ring.reader.name, now, RING_BROKEN)
        self._dir.reject(Candidate(ring.instance, ring.reader.name, ring.dir_fd, None), ring.reader.inode)

    def _close_ring(self, ring: _Ring) -> None:
        if self._rings.get(ring.key) is ring:
            del self._rings[ring.key]
        self._unwatch_writer(ring)
        r, c = self._closed_ring_counts
        self._closed_ring_counts = (r + ring.reader.rejected, c + ring.reader.corrupt)
        ring.reader.close()
        self._order = [x for x in self._order if x is not ring]

    def _poll_ring(self, ring: _Ring) -> int:
        try:
            recs = ring.reader.poll(max_bytes=READ_BUDGET_BYTES)
        except (RingBroken, OSError) as e:
            self._break(ring, time.monotonic(), str(e))
            return 0
        if ring.reader.sink_failures != ring.sink_failures and self.arena is not None:
            self.arena.write_failed(ring.reader.sink_failures - ring.sink_failures,
                                    "a region handed out could not be written (EFAULT)")
            ring.sink_failures = ring.reader.sink_failures
        reasm = self._reassembler(ring.instance)
        now = time.monotonic()  # the read time: delivery latency is measured from here
        rejections = ring.reader.rejections
        n = len(recs) + len(rejections)
        c = self.counters
        for i, rec in enumerate(recs):
            while rejections and rejections[0].index <= i:  # in the order they were read
                self._rejected(reasm, rejections.popleft(), now)
            c.records_in += 1
            if rec.data is not None:
                c.payload_bytes_in += rec.data.nbytes
            try:
                events = reasm.feed(rec, now)
            except Exception:  # a bug here must cost one record, not the daemon and everyone's captures
                c.reassembly_errors += 1
                if c.reassembly_errors <= LOG_FIRST:
                    log.exception("record of request %s from %s could not be reassembled", rec.request_id, ring.path)
                continue
            self._dispatch(events, now)
        while rejections:
            self._rejected(reasm, rejections.popleft(), now)
        return n

    def _rejected(self, reasm: Reassembler, rej: Any, now: float) -> None:
        if rej.request_ids:
            self._dispatch(reasm.reject(rej.request_ids, rej.why, now), now)

    def _read_rings(self) -> bool:
        got = 0
        for ring in list(self._order):
            got += self._poll_ring(ring)
        return got > 0

    def _drain(self, ring: _Ring) -> None:
        while ring.key in self._rings and self._poll_ring(ring):
            pass

    # -- handover (daemon/handover.py) --

    def _hand_over(self) -> None:
        """A graceful stop: what was read of the captures in flight and not delivered, for the next daemon."""
        try:
            state = {inst: reasm.export_state() for inst, reasm in self._reasm.items()}
            n = handover.write(self.config.resolved_state_dir(), state)
        except Exception as e:  # a stop must complete whatever this finds
            log.error("cannot hand the captures in flight over to the next daemon (%s): they end with it", e,
                      exc_info=not isinstance(e, OSError))
            return
        if n:
            log.info("handed %d captures in flight over to the next daemon", n)

    def _take_handover(self, now: float) -> None:
        taken = handover.take(self.config.resolved_state_dir())
        for inst, captures in taken.items():
            self._dispatch(self._reassembler(inst).restore(captures, now), now)
        if taken:
            log.info("continuing %d captures in flight handed over by the previous daemon",
                     sum(len(v) for v in taken.values()))

    # -- memory --

    def inflight_bytes(self) -> int:
        return sum(r.held_bytes for r in self._reasm.values()) + self.store.inflight_bytes

    def _shed(self, now: float) -> None:
        """Keep captures in flight inside inflight_bytes: cut the biggest until they fit."""
        over = self.inflight_bytes() - self.config.inflight_bytes
        if over <= 0:
            return
        sizes = []
        for inst, reasm in self._reasm.items():
            for rid, held in reasm.request_bytes():
                sizes.append((held + self.store.history_bytes((inst, rid)), inst, rid))
        sizes.sort(reverse=True)
        for size, inst, rid in sizes:
            if over <= 0:
                break
            reason = f"{OVER_BUDGET}: captures in flight held more than inflight_bytes={self.config.inflight_bytes}"
            log.warning("capture %s/%s cut (%d bytes): %s", inst, rid, size, reason)
            self.counters.captures_cut += 1
            self._dispatch(self._reasm[inst].cut(rid, now, reason), now)
            self.store.shed((inst, rid), reason)
            over -= size

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
        for name in entry.names:
            waiting = self._pending.get(name)
            if not waiting:
                continue
            for sub in list(waiting):
                self._unpend(sub)
                self._resolve(sub, now)

    def _pend(self, sub: _Sub) -> None:
        sub.pending = True
        self._pending.setdefault(sub.req.name, set()).add(sub)
        self._n_pending += 1
        heapq.heappush(self._deadlines, (sub.deadline, next(self._seq), sub))

    def _unpend(self, sub: _Sub) -> None:
        if not sub.pending:
            return
        sub.pending = False
        self._n_pending -= 1
        waiting = self._pending.get(sub.req.name)
        if waiting is not None:
            waiting.discard(sub)
            if not waiting:
                del self._pending[sub.req.name]

    def _expire_pending(self, now: float) -> None:
        d = self._deadlines
        while d and d[0][0] <= now:
            deadline, _, sub = heapq.heappop(d)
            if sub.pending and sub.deadline == deadline:
                self._not_found(sub)
        if len(d) > 4 * max(self._n_pending, 1024):  # replaced or resolved subscriptions left behind
            self._deadlines = [x for x in d if x[2].pending and x[2].deadline == x[0]]
            heapq.heapify(self._deadlines)

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
                self._pend(sub)
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
        self._unpend(sub)
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

    def _add(self, sub: _Sub) -> None:
        self._subs[sub.key] = sub
        self._by_conn.setdefault(sub.envelope[0], set()).add(sub)

    def _remove(self, sub: _Sub) -> None:
        if self._subs.get(sub.key) is sub:
            del self._subs[sub.key]
        conn = self._by_conn.get(sub.envelope[0])
        if conn is not None:
            conn.discard(sub)
            if not conn:
                del self._by_conn[sub.envelope[0]]
        self._unpend(sub)
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

    def _pin(self, routing_id: bytes, entry: Entry, sub_id: int | None = None) -> None:
        if self.config.arena_linger_s <= 0:
            return
        self._pins.setdefault(routing_id, []).append((time.monotonic() + self.config.arena_linger_s, entry, sub_id))
        self._pinned_bytes += entry.nbytes
        cap = self.config.arena_bytes // 2
        if self._pinned_bytes > cap:
            self._unpin(lambda deadline: True, self._pinned_bytes - cap)

    def _unpin(self, drop: Callable[[float], bool], at_least: int = 1 << 62, peers: Any = None) -> None:
        """Let go of the pins `drop(deadline)` picks, oldest first until at_least bytes went, of `peers` or all."""
        items = sorted(((pin[0], k, rid, pin) for rid in (peers if peers is not None else list(self._pins))
                        for k, pin in enumerate(self._pins.get(rid, ()))), key=lambda x: x[:2])
        freed = 0
        gone: set[int] = set()
        for deadline, _, rid, pin in items:
            if freed >= at_least:
                break
            if drop(deadline):
                gone.add(id(pin))
                freed += pin[1].nbytes
        if not gone:
            return
        for rid in {x[2] for x in items}:
            kept = [pin for pin in self._pins.get(rid, ()) if id(pin) not in gone]
            if kept:
                self._pins[rid] = kept
            else:
                self._pins.pop(rid, None)
        self._pinned_bytes -= freed

    def _release(self, routing_id: bytes, sub_id: int) -> None:
        """A client cancels a subscription that already ended: it has read (copied) everything up
        to the End, so what was pinned for it may go now rather than at its deadline."""
        pins = self._pins.get(routing_id)
        if not pins:
            return
        kept = [p for p in pins if p[2] != sub_id]
        if len(kept) == len(pins):
            return
        self._pinned_bytes -= sum(p[1].nbytes for p in pins if p[2] == sub_id)
        if kept:
            self._pins[routing_id] = kept
        else:
            del self._pins[routing_id]

    def _peer_gone(self, routing_id: bytes) -> None:
        if routing_id in self._pins:
            self._unpin(lambda deadline: True, peers=[routing_id])
        subs = self._by_conn.get(routing_id, ())
        self.counters.subscriptions_dropped_peer_gone += len(subs)
        for sub in list(subs):
            self._remove(sub)

    def _probe_peers(self) -> None:
        """Connections that hold subscriptions but went away silently (a waiting subscription gets no
        sends that would notice): a one-frame ping each, which clients ignore."""
        assert self._sock is not None
        ping = wf.pack(wf.PING, None)
        if self._pins:
            now = time.monotonic()
            self._unpin(lambda deadline: deadline <= now)
        for rid in [r for r in self._pins if r not in self._by_conn]:  # pins of peers with nothing else here
            try:
                self._sock.send_multipart([rid, ping], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            except zmq.ZMQError as e:
                if e.errno == errno.EHOSTUNREACH:
                    self._peer_gone(rid)
        for rid, subs in list(self._by_conn.items()):
            sub = next(iter(subs), None)
            if sub is None or len(sub.envelope) != 1:
                continue  # REQ peers take only replies
            try:
                self._sock.send_multipart([rid, ping], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # there, just busy
            except zmq.ZMQError as e:
                if e.errno == errno.EHOSTUNREACH:
                    self._peer_gone(rid)

    def _send(self, envelope: list[bytes], frames: Frames) -> bool | None:
        """True if sent, False if the peer's queue is full now, None if the peer is gone."""
        assert self._sock is not None
        try:
            # Buffers go without a copy; a lone header (descriptors, begin, gap, end) is cheaper copied
            # than tracked as a zero-copy frame.
            self._sock.send_multipart(envelope + frames, flags=zmq.NOBLOCK, copy=len(frames) == 1)
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
                    if sub.arena is not None:
                        self._pin(sub.envelope[0], e, sub.req.id)
                    self._remove(sub)  # everything up to the End went out
                return sent > 0
            ev = e.history[sub.index]
            if sub.frames is None:
                sub.frames, sub.covers = encode_run(e.history, sub.index, e, sub.req.id, sub.req.from_position,
                                                    sub.arena)
                if sub.frames is None:  # before from_position
                    sub.index += 1
                    continue
            ok = self._send(sub.envelope, sub.frames)
            if ok is None:
                log.debug("subscriber %s went away", sub.envelope[0].hex())
                self._peer_gone(sub.envelope[0])
                return sent > 0
            if not ok:
                # The socket holds SNDHWM messages for this peer and refused another: what is
                # left is our queue for it. Past the bound it is too slow (a replay does not count).
                if len(e.history) - max(sub.index, sub.live_from) > self.config.subscriber_queue:
                    self._too_slow(sub)
                return sent > 0
            n = sub.covers
            if sub.arena is not None and isinstance(ev, Tokens) and len(sub.frames) == 1:
                self.counters.arena_messages += n
                self.counters.arena_bytes += sum(e.history[i].nbytes for i in range(sub.index, sub.index + n))
            if sub.index + n > sub.live_from:
                now = time.monotonic()
                for i in range(max(sub.index, sub.live_from), sub.index + n):
                    self._latency.observe(now - e.history[i].at)
            sub.index += n
            sub.frames = None
            sub.covers = 1
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
                    self._release(envelope[0], req.id)
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
                    why = self._over_limit(envelope[0])
                    if why:
                        self.counters.subscriptions_refused += 1
                        self._reply(envelope, wf.error_frames(wf.E_LIMIT, why, req.id))
                        continue
                    self.counters.subscribers_total += 1
                sub = _Sub(envelope, req, deadline=now + req.timeout, arena=self.arena if req.arena else None)
                self._add(sub)
                self._resolve(sub, now)
        return got

    def _over_limit(self, routing_id: bytes) -> str:
        cfg = self.config
        if len(self._by_conn.get(routing_id, ())) >= cfg.max_subscriptions_per_connection:
            return (f"this connection already has {cfg.max_subscriptions_per_connection} subscriptions "
                    "(max_subscriptions_per_connection)")
        if len(self._subs) >= cfg.max_subscriptions:
            return f"the daemon already serves {cfg.max_subscriptions} subscriptions (max_subscriptions)"
        return ""

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
        self._hand_over()
        for ring in list(self._rings.values()):
            self._close_ring(ring)  # read cursors live in the files and are current after every poll
        self._order = []
        self._dir.close()
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None
        if self.arena is not None:
            self.arena.close()

    # -- status --

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        rings = []
        dropped_records = dropped_bytes = 0
        rejected, corrupt = self._closed_ring_counts
        for ring in self._order:
            try:
                info = ring.reader.info()
            except (RingBroken, OSError):
                continue  # dropped at its next poll
            dropped_records += info.stats["records_dropped"]
            dropped_bytes += info.stats["bytes_dropped"]
            rejected += ring.reader.rejected
            corrupt += ring.reader.corrupt
            rings.append({
                "path": ring.path, "instance": ring.instance, "name": ring.reader.name, "rank": info.rank,
                "world_size": info.world_size, "writer_pid": info.writer_pid, "alive": ring.alive,
                "writer_watch": "pidfd" if ring.pidfd is not None else "poll",
                "epoch": info.epoch, "capacity": info.capacity, "pending_bytes": info.backlog_bytes,
                "read_cursor": info.read_cursor, "write_cursor": info.write_cursor, "corrupt": ring.reader.corrupt,
                "rejected": ring.reader.rejected, "writer": dict(info.stats),
            })
        reasm_stats: dict[str, int] = {}
        requests: list[dict[str, Any]] = []
        for r in self._reasm.values():
            for k, v in r.stats.items():
                reasm_stats[k] = reasm_stats.get(k, 0) + v
            requests.extend(r.requests())
        c = self.counters
        p = self._peers
        return {
            "pid": os.getpid(),
            "wire_version": wf.WIRE_VERSION,
            "uptime_s": time.time() - self._started_at,
            "endpoint": self.endpoint,
            "shm_dir": self.config.shm_dir,
            # Writers wake the daemon through it; null: it polls the rings on a timer.
            "doorbell": self._doorbell.path if self._doorbell is not None else None,
            "doorbell_wakeups": c.doorbell_wakeups,
            # Shared memory the delivered arrays live in (null: off, or shm_dir not there yet).
            "arena": dict(self.arena.snapshot(), pinned_bytes=self._pinned_bytes,
                          pinned_captures=sum(len(v) for v in self._pins.values())) if self.arena is not None else None,
            "discovery": "inotify" if self._dir.watching else "scan",
            "rings": rings,
            "rings_refused": c.rings_refused,
            "dirs_refused": self._dir.dirs_refused,  # instance directories (or the shm dir) failing the access rules
            "rings_broken": c.rings_broken,
            "broken_rings": list(self._broken[-10:]),
            "rejected_records": rejected,
            "corrupt_records": corrupt,
            "writers_exited": c.writers_exited,
            "requests_in_flight": sum(r.in_flight() for r in self._reasm.values()),
            "requests": requests[:100],
            "inflight_bytes": self.inflight_bytes(),
            "inflight_budget": self.config.inflight_bytes,
            "captures_cut": c.captures_cut,
            "retained_requests": self.store.retained,
            "retained_bytes": self.store.retained_bytes,
            "evicted_requests": self.store.evictions,
            "records_in": c.records_in,
            "bytes_in": c.payload_bytes_in,
            "drops": {"records": dropped_records, "bytes": dropped_bytes,
                      "missing_positions": reasm_stats.get("missing_positions", 0),
                      "captures_shed": reasm_stats.get("captures_shed", 0)},
            "reassembly": reasm_stats,
            "reassembly_errors": c.reassembly_errors,
            "subscribers": len(self._subs),
            "subscribers_waiting": self._n_pending,
            "subscribers_total": c.subscribers_total,
            "subscribers_too_slow": c.subscribers_too_slow,
            "subscriptions_refused": c.subscriptions_refused,
            "subscriptions_dropped_peer_gone": c.subscriptions_dropped_peer_gone,
            "connections": {"open": p.total if p else 0, "accepted": p.accepted if p else 0,
                            "refused": p.refused if p else 0, "peers": p.peers if p else 0,
                            "refused_key": p.refused_key if p else 0,
                            "curve": bool(p and p.curve is not None),
                            "accept_paused": bool(p and p.paused), "descriptor_limit": self.nofile},
            "delivered_messages": c.delivered_messages,
            "delivered_bytes": c.delivered_bytes,
            # Of those, through the arena (descriptors; watchers included): messages, payload bytes described.
            "arena_messages": c.arena_messages + self.watch.arena_messages,
            "arena_bytes": c.arena_bytes + self.watch.arena_bytes,
            "bad_requests": c.bad_requests,
            "delivery_latency_s": self._latency.to_dict(),
            # watch: "sequence" (numbers given, retained range, state file) and "watchers"
            **self.watch.snapshot(time.monotonic()),
        }


def _prepare_endpoint(endpoint: str, ctx: zmq.Context, gid: int | None = None) -> None:
    """Make an ipc socket's directory (or refuse a squatted one: UnsafePath); refuse to take over a
    socket another daemon still serves."""
    if endpoint.startswith("ipc://"):
        path = socket_path(endpoint)
        if path is None:  # abstract namespace: nothing on disk
            return
        d = os.path.dirname(path)
        if d:
            try:
                prepare_socket_dir(d, gid)
            except UnsafePath:
                raise
            except OSError as e:
                raise DaemonError(f"cannot create the socket directory {d}: {e}") from None
        if os.path.exists(path) and _answers(ctx, endpoint):
            raise DaemonError(f"another daemon is already serving {endpoint}")
    elif not endpoint.startswith(("tcp://", "inproc://")):
        raise DaemonError(f"unsupported endpoint {endpoint!r}: use ipc://PATH or tcp://HOST:PORT")


_FENCE = threading.Lock()


def _arm(readers: list) -> bool:
    """Raise every ring's waiting flag before sleeping, then look again (futex-style: a writer that
    committed before it saw the flag is found here; one that commits after it rings). False, with
    the flags lowered, when something is there to read."""
    for r in readers:
        try:
            r.set_waiting(True)
        except OSError:
            pass  # a broken ring: the next read finds out
    with _FENCE:  # a locked instruction: our flag stores are visible before the cursor loads below
        pass
    for r in readers:
        try:
            new = r.has_new()
        except Exception:  # noqa: BLE001 - RingBroken and the like: let the next round handle it
            new = True
        if new:
            _disarm(readers)
            return False
    return True


def _disarm(readers: list) -> None:
    for r in readers:
        try:
            r.set_waiting(False)
        except OSError:
            pass


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
