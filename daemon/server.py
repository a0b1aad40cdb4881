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
- A backlog: the rings are read a few milliseconds a round (ring_poller.READ_TURN_S) and requests
  are answered between rounds, so a daemon catching up after a restart stays reachable.
- Writers: each ring's writer is watched through a pidfd (kill(pid, 0) where there is none); its
  death ends its captures within a second, after what its ring still holds is read.
- Connections: the descriptor limit is raised to the hard limit; connections are capped per peer
  and in all (peers.py), subscriptions per connection and in all; frames larger than
  MAX_FRAME_BYTES are refused by libzmq before they are buffered; subscriptions waiting for a name
  are indexed by name and dropped when their peer goes.
- Memory: what captures in flight hold (reassembly and histories) is kept inside `inflight_bytes`;
  beyond it the biggest capture is cut, its remaining positions becoming gaps with a reason.

Delivery (daemon/arena.py): payloads are read from the rings straight into the delivery arena, a
shared-memory file of the daemon's own (one copy; tensor-parallel slices into their columns; small
decode steps of the same captures read in one round are joined into one region, daemon/step_runs.py,
a second copy of a few kB per step that saves one event per capture and step).
Subscribers and watchers that offered to map it (same host: ipc://) get descriptors; the others
get the same arrays as frames. Regions go back when the daemon drops what references them. A
descriptor handed to zmq is not yet copied by its subscriber (up to two socket queues of them
may be on the way), so a capture whose last message went to an arena subscriber stays pinned for
`arena_linger_s` more (retention may have dropped it meanwhile), or until that peer is gone or
says it read to the End (it cancels the finished subscription), and
pins never hold more than half of arena_bytes in all (oldest let go first). A subscriber still slower
than that finds the generation of a reused region moved: a Gap, never other bytes. A dead
subscriber's pins go with its connection (the liveness probe notices within a second).

Where each job lives: the Daemon here is the wiring, start-up, loop and shutdown; it is composed of
parts that each own their state behind a few methods, data flowing one way through them:

    RingPoller (daemon/ring_poller.py)     finds, opens, watches and reads the rings
        │ records and ring facts (its RingFacts)
        ▼
    Instances (daemon/instances.py)        a reassembler per engine instance (daemon/reassembly.py),
        │ events                           the in-flight budget, the handover
        ▼
    SubscriberHub (daemon/subscribers.py)  files events (Store, WatchHub) and delivers them; requests,
                                           subscriptions, pins (daemon/pins.py)
    StatusView (daemon/status.py)          reads the parts for `status` and the metrics

One thread drives them all, so no part waits for another.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
import time
from typing import Callable

import zmq

from vllm_tap import ring_format as rf
from vllm_tap import ring_schema
from vllm_tap import wire_format as wf
from vllm_tap.ring_records import ControlRecord
from vllm_tap.safe_paths import UnsafePath
from vllm_tap.spec import CaptureSpec
from vllm_tap.status_format import DaemonStatus, to_map

from .access import RingAccess, narrow_socket, prepare_arena_dir, prepare_socket_dir, socket_gid, socket_path
from . import adoption, handover
from . import journal_format as jf
from .adoption import Previous
from .arena import Arena
from .config import DaemonConfig
from .config_load import is_loopback
from .copier import Copier
from .curve import CurveServer
from .instances import Instances
from .journal import Journal
from .peer_link import HomeLink, PeerLink, link_of
from .peers import Peers
from .pins import Pins
from .destination import ArenaDestination
from .engine_check import EngineCheck, placements_of
from .events import Begin
from .ring_poller import RingPoller
from .sequence import SequenceCounter
from .status import StatusView
from .store import Entry, Store
from .subscribers import HubLimits, SubscriberHub
from .watch import WatchHub

log = logging.getLogger(__name__)

DISCOVERY_INTERVAL_S = 0.05  # how often discovery runs (inotify events, or a slice of a scan)
LIVENESS_INTERVAL_S = 1.0  # rings without a pidfd: how often kill(pid, 0) runs; all rings: replaced?
TICK_INTERVAL_S = 0.05  # reassembler timeouts, retention, subscription timeouts
ON_TICK_INTERVAL_S = 0.05
PROBE_INTERVAL_S = 1.0  # how often connections holding subscriptions are checked for having gone
SNDHWM = 256  # messages the socket holds per subscriber before sends to it would block
MAX_FRAME_BYTES = 1 << 20  # a request is one frame of at most wire_format.MAX_REQUEST_BYTES
ZERO_IDLE_S = 0.05  # this long with nothing to do, and the arena's freed regions are zeroed
IDLE_AFTER_S = 1.0  # after this long with nothing to do ...
IDLE_SLEEP_S = 0.005  # ... sleep up to this long between ring polls (no doorbell)
DOORBELL_BACKSTOP_S = TICK_INTERVAL_S  # with the doorbell: the longest sleep (the tick is due then)
STOP_FLUSH_S = 1.0  # how long stop() tries to get the final messages out
MAX_NOFILE = 1 << 20  # the soft descriptor limit is raised to the hard one, up to this


class DaemonError(RuntimeError):
    """The daemon cannot start (bad endpoint, address in use); the message says why in one line."""


class AccessError(DaemonError):
    """A squatted or too open directory, or unusable keys: restarting cannot fix it, the operator must."""


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


class Daemon:
    """The daemon (see the module docstring); `run()` serves until `stop()`."""

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
        self._lock = threading.RLock()  # the parts against snapshot() from another thread
        self._sock: zmq.Socket | None = None
        self._peers: Peers | None = None
        self.nofile = 0
        self.arena: Arena | None = None  # delivered arrays; created at start-up (arena_bytes > 0)
        self.copier: Copier | None = None  # copies large ring payloads into the arena (daemon/copier.py)
        self.store = Store(config.retain_bytes, config.retain_ttl_s)
        self.pins = Pins(config.arena_linger_s, config.arena_bytes // 2)
        # watch: sequence numbers and watchers (daemon/watch.py); told of every filed event and drop
        self.watch = WatchHub(pin=lambda rid, entry: self.pins.pin(rid, entry, None, time.monotonic()))
        self.store.on_drop = self._dropped
        self.journal: Journal | None = None  # what the arena holds, for the next daemon (daemon/journal.py)
        self._previous: Previous | None = None  # an earlier run's journal, its arena reopened for adoption
        self._stale_segments: list[str] = []
        self.adopted = {"captures": 0, "in_flight": 0, "regions": 0, "refused": 0}
        self.hub = SubscriberHub(self.store, self.watch, self.pins,
                                 HubLimits(config.subscriber_queue, config.max_subscriptions,
                                           config.max_subscriptions_per_connection),
                                 status=lambda: to_map(self._snapshot()))
        self.instances = Instances(self.store, self.hub.dispatch, end_grace_s=config.end_grace_s,
                                   inflight_bytes=config.inflight_bytes)
        self.access = RingAccess.from_config(config)
        self.link = link_of(config, self.instances)  # federation (daemon/peer_link.py): None, a peer or a home
        self.rings = RingPoller(config.shm_dir, self.access, self.link if isinstance(self.link, PeerLink) else
                                self.instances)
        self.rings.forward = self.link.forward if isinstance(self.link, PeerLink) else None
        if isinstance(self.link, HomeLink):
            self.instances.on_control = self.link.control
        self.status = StatusView(self.endpoint, config.shm_dir, self.rings, self.instances, self.hub, self.store,
                                 self.watch)
        self.engines = EngineCheck()  # world sizes and settings of engines across hosts (daemon/engine_check.py)
        self._last_discovery = self._last_tick = self._last_probe = self._last_liveness = -1e9
        self._fd_due = False

    def stop(self, reason: str = "daemon stopping") -> None:
        """Ask run() to return; safe from a signal handler or any thread."""
        if not self._stopping:
            self._stop_reason = reason
        self._stopping = True

    def snapshot(self) -> DaemonStatus:
        """The status (daemon/status.py); another thread may call it."""
        with self._lock:
            return self._snapshot()

    def _dropped(self, entry: Entry, why: str) -> None:
        self.watch.dropped(entry, why)
        if self.journal is not None:
            self.journal.dropped(entry, why)

    def _snapshot(self) -> DaemonStatus:
        snap = self.status.snapshot(arena=self.arena, copier=self.copier, peers=self._peers, nofile=self.nofile)
        if snap.arena is not None:
            snap.arena["journal"] = self.journal.snapshot() if self.journal is not None else None
            snap.arena["adopted"] = dict(self.adopted)
        if self.link is not None:
            snap.federation = self.link.status()
        snap.engines = self.engines.status(time.monotonic())
        return snap

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
                if not isinstance(self.link, PeerLink):  # a peer forwards raw records: it delivers nothing itself
                    self._open_arena(gid)
                if self.link is not None:
                    self.link.start()
            except UnsafePath as e:
                raise AccessError(str(e)) from None
            except zmq.ZMQError as e:
                raise DaemonError(f"cannot listen on {self.config.federation_endpoint} for peer daemons: {e}") from None
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
            self.hub.serve(sock)
            # watch: the persisted sequence counter; SequenceStateError stops start-up (one line)
            self.watch.open(SequenceCounter(self.config.resolved_state_dir()))
            with self._lock:
                state_dir = self.config.resolved_state_dir()
                taken = handover.take(state_dir)
                self._adopt(taken, time.monotonic())
                self.instances.take_handover(state_dir, time.monotonic(), taken)
                self.rings.discover(time.monotonic())
            log.info("serving %s; watching %s (%d rings, %s; descriptor limit %d)", self.endpoint,
                     self.config.shm_dir, len(self.rings.rings), "inotify" if self.rings.uses_inotify else "scanning",
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
                self.hub.serve(None)
                if self.copier is not None:
                    self.copier.close()
                if self.journal is not None:
                    self.journal.close(keep=False)  # start-up failed after making it (a stop closed it already)
                    self.journal = None
                if self.arena is not None:
                    self.arena.close()  # also when start-up failed after making it
                if self.link is not None:
                    self.link.close()
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
        if isinstance(self.link, HomeLink):
            poller.register(self.link.socket(), zmq.POLLIN)
        watched: set[int] = set()
        polled_bell = None
        rings = self.rings
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
            if self.arena is not None and self.arena.unzeroed_bytes and now - idle_since >= ZERO_IDLE_S:
                with self._lock:
                    self.arena.sweep()
            # Descriptors that wake the loop besides the socket: inotify, and one pidfd per writer.
            want = rings.wake_fds()
            for fd in watched - want:
                poller.unregister(fd)
            for fd in want - watched:
                poller.register(fd, zmq.POLLIN)
            watched = want
            bell = rings.doorbell
            if bell is not None:
                # Writers ring after a commit while we sleep (the rings' waiting flags): wait for that
                # or a request. The timer is the tick, and a backstop for a writer that could not
                # ring (no permission, a lost wake-up).
                if polled_bell is not bell:
                    poller.register(bell.fileno(), zmq.POLLIN)
                    polled_bell = bell
                if not rings.arm():
                    continue  # a commit came in as we were about to sleep: read it first
                try:
                    woke = dict(poller.poll(timeout=max(interval, DOORBELL_BACKSTOP_S) * 1000))
                finally:
                    rings.disarm()
                if bell.fileno() in woke:
                    rings.drain_doorbell()
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
        rings, hub = self.rings, self.hub
        busy = self._peers.pump() if self._peers is not None else False
        if self.link is not None:
            busy |= self.link.pump(now)
        tick = now - self._last_tick >= TICK_INTERVAL_S
        if self._fd_due or tick:
            self._fd_due = False
            rings.check_writers(now)
        if now - self._last_discovery >= DISCOVERY_INTERVAL_S:
            self._last_discovery = now
            rings.discover(now)
        busy |= rings.read()
        busy |= hub.recv(now)
        if tick:
            self._last_tick = now
            self.instances.tick(now)
            self.store.evict(now)
            if self.arena is not None:
                self.arena.sweep(now)
            self.watch.tick(now)
            if self.journal is not None:
                self.journal.tick()
            hub.expire(now)
            if now - self._last_liveness >= LIVENESS_INTERVAL_S:
                self._last_liveness = now
                rings.check_rings(now)
                self.engines.observe(placements_of(rings.rings, self.link), now)
            if now - self._last_probe >= PROBE_INTERVAL_S:
                self._last_probe = now
                hub.probe()
        if self.journal is not None:
            self._journal_reads(tick)  # nothing goes out, and no ring cursor moves, before the journal has it
        busy |= hub.send_all()
        busy |= self.watch.pump(hub.send, now)
        return busy

    def _journal_reads(self, every: bool = True) -> None:
        """What was filed, then how far the rings were read, into the journal; then the rings' own
        cursors move, never past a record whose data is held unfiled (a daemon killed before that
        reads those records again, and no more). Where nothing was read, what is held is looked at
        again only if `every` (a capture that ended without a read lets its rings' cursors go on)."""
        journal, rings = self.journal, self.rings
        assert journal is not None
        floors = rings.floors(every)
        if floors:
            journal.read(rings.uncommitted(floors, self.instances.holds(floors)))
        journal.flush()
        rings.commit()

    def _end_read(self, instance: str, record: ControlRecord) -> None:
        if self.journal is not None:
            entry = self.store.get((instance, record.request_id))
            if entry is not None and entry.end is None:
                self.journal.end_read(entry, record)

    def _open_arena(self, gid: int | None) -> None:
        """The delivery arena in its own directory (daemon/access.py: readable by the subscribers'
        group only). UnsafePath for a squatted or too open directory; one that cannot be made or
        filled here (a read-only parent, no space) costs the arena only: subscribers get frames."""
        if self.config.arena_bytes <= 0:
            return
        directory = self.config.resolved_arena_dir()
        try:
            made = prepare_arena_dir(directory, gid)
            previous, self._stale_segments = adoption.find(directory)
            if previous is not None:
                self.arena = Arena.reopen(directory, previous.arena_id, self.config.arena_bytes, gid)
                if self.arena is not None:
                    self._previous = previous
                else:
                    self._stale_segments += previous.names
            if self.arena is None:
                self.arena = Arena.create(directory, self.config.arena_bytes, gid)
        except UnsafePath:
            raise
        except OSError as e:
            log.warning("no delivery arena in %s (%s): every subscriber gets payloads as frames", directory,
                        e.strerror or e)
            return
        self.arena.remove_dir = made
        if self.config.ring_copier:
            self.copier = Copier(self.arena)
        self.rings.use_arena(self.arena, ArenaDestination(self.arena), self.copier)
        if isinstance(self.link, HomeLink):
            self.link.destination = ArenaDestination(self.arena)
        self.instances.use_arena(self.arena)
        self.hub.use_arena(self.arena)
        self.watch.use_arena(self.arena)

    def _adopt(self, taken: dict[str, list[handover.InFlight]], now: float) -> None:
        """The captures the earlier run's journal names, adopted with its arena: retained ones under
        their numbers, those in flight continued (unless its graceful stop handed them over, `taken`:
        then the handover continues them); then this run's journal, beginning with all of them."""
        arena, previous, self._previous = self.arena, self._previous, None
        if arena is None:
            return
        held: list[Entry] = []
        endings: dict[int, jf.Ending] = {}
        first_segment = 1
        if previous is not None:
            t0, cpu0 = time.monotonic(), time.process_time()
            handed = {(inst, c.request_id) for inst, cs in taken.items() for c in cs}
            t_replay = t_check = t0
            try:
                replayed = adoption.replay(previous.arena_id, previous.blobs)
                logs = replayed.logs
                t_replay = time.monotonic()
                found = adoption.captures(logs, arena, now)
                t_check = time.monotonic()
                self.rings.resume = replayed.reads
            except Exception:  # a journal must never keep the daemon from starting
                log.exception("the earlier daemon run's journal could not be replayed: nothing of it is adopted")
                logs, found = {}, []
            self.adopted["refused"] = len(logs) - len(found)
            wall = time.time()
            for c in found:
                begin = c.history[0]
                ended = c.ended_wall is not None
                if not ended and (begin.instance, begin.request_id) in handed:
                    continue
                finished_at = now - max(0.0, wall - c.ended_wall) if ended else now  # type: ignore[operator]
                entry = self.store.adopt(c.seq, c.history, now, finished_at)
                if entry is None:
                    continue
                self.watch.adopt(entry)
                held.append(entry)
                if not ended:
                    if c.end_read is not None:
                        endings[c.seq] = c.end_read
                    self.instances.continue_filed(entry, now, _end_record(begin, c.end_read))
                    self.adopted["in_flight"] += 1
                else:
                    self.instances.finished_before(begin)
            self.adopted["captures"] = len(held)
            first_segment = max((jf.parse_name(n) or (0, 0))[1] for n in previous.names) + 1 if previous.names else 1
            self._stale_segments += previous.names
        t_filed = time.monotonic()
        self.adopted["regions"] = arena.end_adoption()
        if held:
            t1 = time.monotonic()
            log.info("adopted %d captures of the earlier daemon run from its arena (%d in flight), under their "
                     "sequence numbers, in %.2f s, %.2f s of CPU (journal of %d KiB replayed in %.2f s, checked in %.2f "
                     "s, filed in %.2f s; the rest of the arena given back in %.2f s)", len(held),
                     self.adopted["in_flight"], t1 - t0, time.process_time() - cpu0, sum(map(len, previous.blobs)) >> 10,
                     t_replay - t0, t_check - t_replay, t_filed - t_check, t1 - t_filed)
        self.journal = Journal.start(arena, held, first_segment, self._stale_segments, endings, self.rings.resume)
        self._stale_segments = []
        self.rings.defer_commit = not self.journal.failed
        self.instances.on_end_read = self._end_read
        self.hub.journal = self.journal.filed
        self.store.on_shed = self.journal.shed
        self.store.evict(now)  # adopted captures past retain_ttl_s or beyond retain_bytes go now

    def _shutdown(self) -> None:
        reason = self._stop_reason
        hub = self.hub
        hub.fail_all(wf.E_STOPPING, reason, STOP_FLUSH_S)
        self.watch.stop(reason, time.monotonic())
        deadline = time.monotonic() + STOP_FLUSH_S
        while (hub.busy or self.watch.busy) and time.monotonic() < deadline:
            hub.send_all()
            self.watch.pump(hub.send, time.monotonic())
            if hub.busy or self.watch.busy:
                time.sleep(0.005)
        self.instances.hand_over(self.config.resolved_state_dir())
        if self.journal is not None:
            self._journal_reads()
        self.rings.close()
        if self.copier is not None:
            self.copier.close()
        # What the arena holds stays for the next daemon when the journal names any of it.
        keep = self.journal is not None and not self.journal.failed and self.journal.held > 0
        if self.journal is not None:
            self.journal.close(keep=keep)
            self.journal = None
        if self.arena is not None:
            self.arena.close(keep=keep)
            if keep:
                log.info("the arena %s and its journal stay for the next daemon (%d captures)", self.arena.path,
                         self.store.retained + self.store.in_flight)


def _end_record(begin: Begin, e: jf.Ending | None) -> ControlRecord | None:
    """The END an earlier run had read for a capture in flight, as its ring record."""
    if e is None:
        return None
    meta = ring_schema.EndMeta(reason=e.reason, num_prompt_tokens=e.num_prompt_tokens,
                               num_output_tokens=e.num_output_tokens, output_token_ids=list(e.output_token_ids),
                               end_position=e.end_position, source=e.source)
    return ControlRecord(kind=rf.RecordKind.END, request_id=begin.request_id, tap_key=begin.tap_key,
                         num_prompt_tokens=e.num_prompt_tokens, source=e.source or begin.source, control=meta,
                         spec=CaptureSpec.from_meta(e.spec) if e.spec is not None else None)


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
