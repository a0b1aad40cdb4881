"""The subscriber hub: requests in from the daemon's socket, subscriptions resolved by name, the
events reassembly hands it filed (the store, the watch) and delivered, slow or vanished peers cut
off, arena pins held and let go (daemon/pins.py).

It owns the subscriptions, the pins, its counters and the delivery latency; the socket is the
daemon's, lent to it while the daemon serves. Sends never block: a subscriber more than
`subscriber_queue` live messages behind is cut off as too slow, so it cannot hold up the rings or
the other subscribers; each gets at most SEND_BATCH messages per round.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from vllm_tap import wire_format as wf

from .arena import Arena
from .latency import Histogram
from .messages import Frames, encode_run
from .pins import Pins
from .events import Begin, Event, Tokens
from .store import Entry, LookupFailed, Store
from .watch import WatchHub

log = logging.getLogger(__name__)

SEND_BATCH = 64  # messages per subscriber per round, for fairness between subscribers
TOO_SLOW_FLUSH_S = 5.0  # how long a cut-off subscriber's error is retried


@dataclass(eq=False)
class Subscription:
    """One subscriber's request for one capture, and how far its delivery got."""

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
class HubCounters:
    """What the hub counts, reported by the status view."""

    delivered_messages: int = 0
    delivered_bytes: int = 0
    arena_messages: int = 0  # tokens messages sent as arena descriptors (their payload bytes below)
    arena_bytes: int = 0
    subscribers_total: int = 0
    subscribers_too_slow: int = 0
    subscriptions_refused: int = 0
    subscriptions_dropped_peer_gone: int = 0
    bad_requests: int = 0
    by_type: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class HubLimits:
    subscriber_queue: int  # live messages a subscriber may be behind before it is cut off
    max_subscriptions: int
    max_subscriptions_per_connection: int


def _frames_nbytes(frames: Frames) -> int:
    return sum(len(f) if isinstance(f, (bytes, bytearray)) else f.nbytes for f in frames)


class SubscriberHub:
    """Subscriptions, pins and the requests of every peer of the daemon's socket."""

    def __init__(self, store: Store, watch: WatchHub, pins: Pins, limits: HubLimits,
                 status: Callable[[], dict[str, Any]]):
        self._store = store
        self._watch = watch
        self.pins = pins
        self._limits = limits
        self._status = status
        self._sock: zmq.Socket | None = None
        self._arena: Arena | None = None
        self._subs: dict[tuple[bytes, int], Subscription] = {}
        self._by_conn: dict[bytes, set[Subscription]] = {}  # routing id -> its subscriptions
        self._by_key: dict[tuple[str, str], set[Subscription]] = {}
        self._pending: dict[str, set[Subscription]] = {}  # name -> subscriptions waiting for it
        self.waiting = 0  # subscriptions waiting for their name
        self._deadlines: list[tuple[float, int, Subscription]] = []  # heap of pending subscriptions' deadlines
        self._tiebreak = itertools.count()
        self._active: set[Subscription] = set()  # subscriptions with something to send
        self.latency = Histogram()
        self.counters = HubCounters()
        # Told of every event filed, after the watch numbered it (the arena journal, daemon/journal.py)
        self.journal: Callable[[Event, Entry], None] | None = None

    def serve(self, sock: zmq.Socket | None) -> None:
        """Answer on `sock` (the daemon's ROUTER socket) from now on; None: no longer."""
        self._sock = sock

    def use_arena(self, arena: Arena) -> None:
        """Subscribers that offer to map it get descriptors into `arena`."""
        self._arena = arena

    @property
    def subscriptions(self) -> int:
        return len(self._subs)

    @property
    def busy(self) -> bool:
        """Something is waiting to be sent."""
        return bool(self._active)

    # -- events in (from reassembly) --

    def dispatch(self, events: list[Event], now: float) -> None:
        """File each event (store, watch) and wake the subscriptions of its capture."""
        add, filed, by_key, active, journal = self._store.add, self._watch.filed, self._by_key, self._active, self.journal
        for ev in events:
            entry = add(ev, now)
            if entry is None:
                continue
            filed(ev, entry)
            if journal is not None:
                journal(ev, entry)
            if type(ev) is Begin:
                self._resolve_pending(entry, now)
                continue
            subs = by_key.get(entry.key)
            if subs:
                active.update(subs)

    def _resolve_pending(self, entry: Entry, now: float) -> None:
        for name in entry.names:
            waiting = self._pending.get(name)
            if not waiting:
                continue
            for sub in list(waiting):
                self._unpend(sub)
                self._resolve(sub, now)

    # -- subscriptions --

    def _pend(self, sub: Subscription) -> None:
        sub.pending = True
        self._pending.setdefault(sub.req.name, set()).add(sub)
        self.waiting += 1
        heapq.heappush(self._deadlines, (sub.deadline, next(self._tiebreak), sub))

    def _unpend(self, sub: Subscription) -> None:
        if not sub.pending:
            return
        sub.pending = False
        self.waiting -= 1
        waiting = self._pending.get(sub.req.name)
        if waiting is not None:
            waiting.discard(sub)
            if not waiting:
                del self._pending[sub.req.name]

    def expire(self, now: float) -> None:
        """Subscriptions whose name did not appear in time."""
        d = self._deadlines
        while d and d[0][0] <= now:
            deadline, _, sub = heapq.heappop(d)
            if sub.pending and sub.deadline == deadline:
                self._not_found(sub)
        if len(d) > 4 * max(self.waiting, 1024):  # replaced or resolved subscriptions left behind
            self._deadlines = [x for x in d if x[2].pending and x[2].deadline == x[0]]
            heapq.heapify(self._deadlines)

    def _resolve(self, sub: Subscription, now: float) -> None:
        r = sub.req
        try:
            entry = self._store.resolve(r.name, r.index, r.instance)
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
        self._store.touch(entry)
        self._active.add(sub)

    def _not_found(self, sub: Subscription) -> None:
        r = sub.req
        what = repr(r.name) + (f" index {r.index}" if r.index is not None else "") + (
            f" in instance {r.instance!r}" if r.instance is not None else "")
        self._fail(sub, wf.E_NOT_FOUND, f"no capture named {what} appeared within {r.timeout:g} s")

    def fail_all(self, code: str, message: str, flush_s: float) -> None:
        """End every subscription with an error (the daemon is stopping)."""
        for sub in list(self._subs.values()):
            self._fail(sub, code, message, flush_s)

    def _fail(self, sub: Subscription, code: str, message: str, flush_s: float = 1.0) -> None:
        """End a subscription with an error message (sent as soon as the socket takes it)."""
        self._unpend(sub)
        self._detach(sub)
        sub.frames = None
        sub.final = wf.error_frames(code, message, sub.req.id)
        sub.final_deadline = time.monotonic() + flush_s
        self._active.add(sub)

    def _too_slow(self, sub: Subscription) -> None:
        self.counters.subscribers_too_slow += 1
        queue = self._limits.subscriber_queue
        log.warning("subscriber %s to %r is more than %d messages behind: cut off", sub.envelope[0].hex(),
                    sub.req.name, queue)
        self._fail(sub, wf.E_TOO_SLOW, f"too slow: more than {queue} messages behind", TOO_SLOW_FLUSH_S)

    def _add(self, sub: Subscription) -> None:
        self._subs[sub.key] = sub
        self._by_conn.setdefault(sub.envelope[0], set()).add(sub)

    def _remove(self, sub: Subscription) -> None:
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

    def _detach(self, sub: Subscription) -> None:
        """Stop feeding the subscription live events of its capture."""
        if sub.entry is not None:
            subs = self._by_key.get(sub.entry.key)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._by_key[sub.entry.key]
            sub.entry = None

    # -- peers --

    def pin(self, routing_id: bytes, entry: Entry, sub_id: int | None = None) -> None:
        """Keep `entry` a while: its last message went to a peer that maps the arena (daemon/pins.py)."""
        self.pins.pin(routing_id, entry, sub_id, time.monotonic())

    def _peer_gone(self, routing_id: bytes) -> None:
        self.pins.peer_gone(routing_id)
        subs = self._by_conn.get(routing_id, ())
        self.counters.subscriptions_dropped_peer_gone += len(subs)
        for sub in list(subs):
            self._remove(sub)

    def probe(self) -> None:
        """Connections that hold subscriptions or pins but went away silently (a waiting subscription
        gets no sends that would notice): a one-frame ping each, which clients ignore. Pins whose time
        is up go."""
        assert self._sock is not None
        ping = wf.encode(wf.PingReply(id=None))
        self.pins.expire(time.monotonic())
        for rid in [r for r in self.pins.peers() if r not in self._by_conn]:  # pins of peers with nothing else here
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

    # -- sending --

    def send(self, envelope: list[bytes], frames: Frames) -> bool | None:
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

    def _pump_sub(self, sub: Subscription) -> bool:
        """Send what the subscriber may have now; True if anything went out."""
        sent = 0
        while sent < SEND_BATCH:
            if sub.final is not None:
                ok = self.send(sub.envelope, sub.final)
                if ok or ok is None or time.monotonic() >= sub.final_deadline:
                    self._remove(sub)
                return bool(ok) or sent > 0
            e = sub.entry
            if e is None or sub.index >= len(e.history):
                self._active.discard(sub)
                if e is not None and e.end is not None:
                    if sub.arena is not None:
                        self.pin(sub.envelope[0], e, sub.req.id)
                    self._remove(sub)  # everything up to the End went out
                return sent > 0
            ev = e.history[sub.index]
            if sub.frames is None:
                sub.frames, sub.covers = encode_run(e.history, sub.index, e, sub.req.id, sub.req.from_position,
                                                    sub.arena)
                if sub.frames is None:  # before from_position
                    sub.index += 1
                    continue
            ok = self.send(sub.envelope, sub.frames)
            if ok is None:
                log.debug("subscriber %s went away", sub.envelope[0].hex())
                self._peer_gone(sub.envelope[0])
                return sent > 0
            if not ok:
                # The socket holds SNDHWM messages for this peer and refused another: what is
                # left is our queue for it. Past the bound it is too slow (a replay does not count).
                if len(e.history) - max(sub.index, sub.live_from) > self._limits.subscriber_queue:
                    self._too_slow(sub)
                return sent > 0
            n = sub.covers
            if sub.arena is not None and isinstance(ev, Tokens) and len(sub.frames) == 1:
                self.counters.arena_messages += n
                self.counters.arena_bytes += sum(e.history[i].nbytes for i in range(sub.index, sub.index + n))
            if sub.index + n > sub.live_from:
                now = time.monotonic()
                for i in range(max(sub.index, sub.live_from), sub.index + n):
                    self.latency.observe(now - e.history[i].at)
            sub.index += n
            sub.frames = None
            sub.covers = 1
            sent += 1
        return True

    def send_all(self) -> bool:
        """Every subscription with something to send, a batch each; True if anything went out."""
        busy = False
        for sub in list(self._active):
            busy |= self._pump_sub(sub)
        return busy

    def _reply(self, envelope: list[bytes], frames: Frames) -> None:
        if not self.send(envelope, frames):
            log.debug("reply to %s dropped (peer busy or gone)", envelope[0].hex())

    # -- requests --

    def recv(self, now: float) -> bool:
        """Take the requests waiting on the socket (a bounded number); True if there were any."""
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
                self._reply(envelope, [wf.encode(wf.StatusReply(id=req.id, status=self._status()))])
            elif isinstance(req, wf.Cancel):
                old = self._subs.get((envelope[0], req.id))
                if old is not None:
                    self._remove(old)
                else:
                    self.pins.release(envelope[0], req.id)
                    self._watch.cancel(envelope, req.id)
            elif isinstance(req, wf.WatchRequest):
                refused = self._watch.attach(envelope, req, now)
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
                sub = Subscription(envelope, req, deadline=now + req.timeout,
                                   arena=self._arena if req.arena else None)
                self._add(sub)
                self._resolve(sub, now)
        return got

    def _over_limit(self, routing_id: bytes) -> str:
        lim = self._limits
        if len(self._by_conn.get(routing_id, ())) >= lim.max_subscriptions_per_connection:
            return (f"this connection already has {lim.max_subscriptions_per_connection} subscriptions "
                    "(max_subscriptions_per_connection)")
        if len(self._subs) >= lim.max_subscriptions:
            return f"the daemon already serves {lim.max_subscriptions} subscriptions (max_subscriptions)"
        return ""
