"""The daemon's subscriber side: requests in, subscriptions resolved by name, events filed and
delivered, slow or vanished peers cut off, arena pins held and let go.

Methods of the Daemon (daemon/server.py), which owns the state they use: the subscriptions
(`_subs`, `_by_conn`, `_by_key`, `_pending`, `_deadlines`, `_active`), the pins (`_pins`,
`_pinned_bytes`), the socket and the counters. Sends never block: a subscriber more than
`subscriber_queue` live messages behind is cut off as too slow, so it cannot hold up the rings or
the other subscribers; each gets at most SEND_BATCH messages per round.
"""

from __future__ import annotations

import errno
import heapq
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from vllm_tap import wire_format as wf

from .arena import Arena
from .messages import Frames, encode_run
from .reassembly import Begin, Event, Tokens
from .store import Entry, LookupFailed

log = logging.getLogger("vllm_tap.daemon.server")  # the daemon logs under one name, whichever side speaks

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


def _frames_nbytes(frames: Frames) -> int:
    return sum(len(f) if isinstance(f, (bytes, bytearray)) else f.nbytes for f in frames)


class SubscriberSide:
    """The subscriber side of the Daemon (mixed into it)."""

    def _dispatch(self, events: list[Event], now: float) -> None:
        add, filed, by_key, active = self.store.add, self.watch.filed, self._by_key, self._active
        for ev in events:
            entry = add(ev, now)
            if entry is None:
                continue
            filed(ev, entry)
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

    def _pend(self, sub: Subscription) -> None:
        sub.pending = True
        self._pending.setdefault(sub.req.name, set()).add(sub)
        self._n_pending += 1
        heapq.heappush(self._deadlines, (sub.deadline, next(self._seq), sub))

    def _unpend(self, sub: Subscription) -> None:
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

    def _resolve(self, sub: Subscription, now: float) -> None:
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

    def _not_found(self, sub: Subscription) -> None:
        r = sub.req
        what = repr(r.name) + (f" index {r.index}" if r.index is not None else "") + (
            f" in instance {r.instance!r}" if r.instance is not None else "")
        self._fail(sub, wf.E_NOT_FOUND, f"no capture named {what} appeared within {r.timeout:g} s")

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
        log.warning("subscriber %s to %r is more than %d messages behind: cut off",
                    sub.envelope[0].hex(), sub.req.name, self.config.subscriber_queue)
        self._fail(sub, wf.E_TOO_SLOW, f"too slow: more than {self.config.subscriber_queue} messages behind",
                   TOO_SLOW_FLUSH_S)

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

    def _pump_sub(self, sub: Subscription) -> bool:
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
                sub = Subscription(envelope, req, deadline=now + req.timeout, arena=self.arena if req.arena else None)
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
