"""The capture stream ("watch"): every capture to every watcher, in sequence order, resumable.

A sans-IO state machine: the daemon's loop files events (`filed`), store drops (`dropped`), watch
requests (`attach`, `cancel`) and the time (`tick`) into it, and `pump(send)` hands it a
non-blocking send; tests call the same methods directly.

Rules:
- Numbering. Every capture gets `seq` from the persisted counter (daemon/sequence.py) when its
  first Begin is filed; a late Begin that completes a lazily made capture keeps the number. One
  counter for all instances of the daemon.
- Resume. A watch names `since`, the last seq its owner has safely stored (None: the newest seq
  now, i.e. only captures that begin later). It then gets every capture with seq > since that
  passes its filters, exactly once, while the daemon retains it. A `since` above the newest seq
  given out is refused (E_BAD_SINCE), as are unknown filters or bad values (E_BAD_FILTER).
- Nothing silently missing. A seq the watch cannot deliver comes as `lost {first, last, reason}`:
  "daemon restarted" below this run's first number (the earlier run's memory is gone, and after a
  crash the numbers it reserved but never used), "evicted" for a capture the store dropped before
  the watch began, "watcher too slow" for one dropped while the watch was attached but had not
  reached it, "dropped" for one taken out before it ended. A dropped capture's instance, source,
  tap_key and model are kept (TOMBSTONES of them), so a filtering watch is not told about losses
  it would not have wanted; beyond that memory a loss is reported, never hidden.
- Filters (AND): instance (exact), source (exact), tap_key_prefix, model (exact), decided on the
  capture's begin when the watch reaches it. Filtered-out captures produce no message; the watch's
  handled point moves past them and a `watermark` tells the client (at most every WATERMARK_S).
- Order. Whole mode sends capture after capture in seq order: the capture at the head goes out as
  its events are filed, the next one only after the head's End, so a capture that ends late holds
  later ones back for this watcher (every capture ends within bounded time: its END and its rings
  read that far, a lost END, its writer's death; daemon/reassembly.py). The client yields each capture whole at its End. A late Begin that
  completes a lazily made head capture is sent again; the client keeps the fuller one. Streamed
  mode starts captures in seq order and then sends each capture's events as they are filed, so the
  events of concurrent captures interleave; within a capture, positions are in order.
- Bounded, never blocking. A watcher holds no copies: its queue is a cursor into the store's
  retained history plus the socket's SNDHWM messages. Sends never block; a watcher whose socket is
  full simply waits while others go on. What retention (retain_bytes / retain_ttl_s) drops before
  a slow watcher reaches it becomes "watcher too slow" — including the rest of a capture it was in
  the middle of (a started capture is abandoned, not pinned) — and the watcher goes on after it.
  So a stalled watcher costs the daemon no memory beyond retention and never slows anyone else.
- Keepalive. A watcher that was sent nothing for KEEPALIVE_S gets a watermark, which tells the
  client the daemon is alive; a client that hears nothing resends its watch with since = its
  last_seq. The daemon ignores the repeat of a watch it is serving (same peer, same id), and a
  restarted daemon, which knows no such watch, starts it afresh from that since.
"""

from __future__ import annotations

import bisect
import collections
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm_tap import wire_format as wf

from .messages import Frames, arena_advert, encode
from .events import Begin, End, Event, Tokens
from .sequence import SequenceCounter
from .store import Entry

log = logging.getLogger(__name__)

KEEPALIVE_S = 1.0  # a watcher sent nothing this long gets a watermark (the client's sign of life)
WATERMARK_S = 0.25  # at most this often, a watermark for captures skipped by filters
SEND_BATCH = 64  # messages per watcher per round, for fairness
MAX_WATCHERS = 256
TOMBSTONES = 1 << 16  # dropped captures whose filter fields are remembered
FINAL_FLUSH_S = 1.0

Send = Callable[[list[bytes], Frames], "bool | None"]  # True sent, False socket full, None peer gone


def source_of(begin: Begin) -> str:
    src = getattr(begin, "source", None)  # a Begin field once the records carry it
    if src:
        return str(src)
    return str((begin.spec or {}).get("source") or wf.SOURCES[0])


@dataclass(frozen=True)
class _Fields:
    """What filters look at."""

    instance: str
    source: str
    tap_key: str
    model: str

    @classmethod
    def of(cls, begin: Begin) -> "_Fields":
        return cls(begin.instance, source_of(begin), begin.tap_key, begin.model)


@dataclass(frozen=True)
class _Tomb:
    fields: _Fields
    ended: bool
    drop_no: int
    detail: str


@dataclass(eq=False)
class _Open:
    entry: Entry
    index: int = 0  # next history event to send
    gone: str | None = None  # why the store dropped it, once it did
    resend_begin: bool = False  # whole mode: a late Begin completed the one already sent


@dataclass(eq=False)
class Watcher:
    envelope: list[bytes]
    req: wf.WatchRequest
    since: int
    cursor: int  # next seq to consider
    attached_at: float
    attach_drop_no: int  # drops numbered above this happened while attached
    attach_next: int  # seqs from this one on were given out while attached
    current: _Open | None = None  # whole mode: the capture being sent
    open: dict[int, _Open] = field(default_factory=dict)  # streamed: started, not yet ended
    dirty: dict[int, None] = field(default_factory=dict)  # streamed: open captures with events to send
    waiting_for: int | None = None  # whole mode: the running capture it is sending, which holds later ones back
    control: collections.deque = field(default_factory=collections.deque)  # watching / watermark
    arena: Any = None  # the daemon's arena, when the watcher maps it: descriptors instead of payloads
    pending: Frames | None = None  # taken by neither socket nor peer yet: sent first
    final: Frames | None = None
    final_deadline: float = 0.0
    last_send: float = 0.0
    announced: int = -1  # the handled point the client can know of
    wm_at: float = 0.0
    delivered: int = 0
    lost: int = 0
    lost_too_slow: int = 0
    filtered: int = 0
    messages: int = 0

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.envelope[0], self.req.id)

    @property
    def whole(self) -> bool:
        return self.req.whole

    @property
    def handled(self) -> int:
        """Every seq up to this one was sent, reported lost or filtered out for this watcher."""
        if self.whole:
            return self.current.entry.seq - 1 if self.current is not None else self.cursor - 1
        return min(self.open) - 1 if self.open else self.cursor - 1

    def matches(self, f: _Fields) -> bool:
        r = self.req
        return ((r.instance is None or f.instance == r.instance) and (r.source is None or f.source == r.source)
                and (r.model is None or f.model == r.model)
                and (r.tap_key_prefix is None or f.tap_key.startswith(r.tap_key_prefix)))


class WatchHub:
    def __init__(self, pin: "Callable[[bytes, Entry], None] | None" = None) -> None:
        self.seqs: SequenceCounter | None = None
        self._by_seq: dict[int, Entry] = {}
        # Sorted seqs given out, with dropped ones left in until compaction (_by_seq is the truth):
        # eviction takes mostly the oldest, and deleting at the front of a long list costs a memmove.
        self._present: list[int] = []
        self._gone: dict[int, _Tomb] = {}
        self._gone_keys: list[int] = []  # sorted
        self._drops = 0
        self._watchers: dict[tuple[bytes, int], Watcher] = {}
        self.arena: Any = None  # the daemon's delivery arena (daemon/arena.py), once it has one
        self.pin = pin  # keep a capture sent whole through the arena a while (daemon/pins.py)
        self.arena_messages = 0  # tokens messages sent as descriptors, and the payload bytes they name
        self.arena_bytes = 0
        self._active: set[Watcher] = set()
        self.watchers_total = 0
        self.rejected = 0
        self.delivered_total = 0  # captures sent whole to a watcher, over all watchers
        self.lost_total: dict[str, int] = {r: 0 for r in wf.LOST_REASONS}  # captures reported lost, by reason

    # -- life --

    def use_arena(self, arena: Any) -> None:
        """Watchers that offer to map it get descriptors into `arena`."""
        self.arena = arena

    def open(self, counter: SequenceCounter) -> None:
        self.seqs = counter.open() if counter.first == 0 else counter

    def close(self) -> None:
        if self.seqs is not None:
            self.seqs.close()

    @property
    def next_seq(self) -> int:
        return self.seqs.next if self.seqs is not None else 1

    @property
    def run_first(self) -> int:
        return self.seqs.first if self.seqs is not None else 1

    @property
    def busy(self) -> bool:
        return bool(self._active)

    # -- inputs from the daemon --

    def filed(self, ev: Event, entry: Entry) -> None:
        """An event the store filed into `entry` (call for every event the store accepted)."""
        if isinstance(ev, Begin):
            if entry.seq:  # a late Begin filling in a lazily made capture keeps its number
                for w in self._watchers.values():
                    o = w.current
                    if o is not None and o.entry is entry and o.index > 0:
                        o.resend_begin = True  # whole mode: the fuller begin replaces the one sent
                        self._active.add(w)
                return
            assert self.seqs is not None, "WatchHub.open() first"
            seq = entry.seq = self.seqs.take()
            self._by_seq[seq] = entry
            self._present.append(seq)  # numbers only grow: stays sorted
            for w in self._watchers.values():
                if not w.whole or w.current is None:  # it may be the next capture this watcher wants
                    self._active.add(w)
            return
        seq = entry.seq
        if not seq or not self._watchers:
            return
        for w in self._watchers.values():
            if w.whole:
                if w.waiting_for == seq:  # the capture it is sending, one event at a time as filed
                    w.waiting_for = None
                    self._active.add(w)
            elif seq in w.open:
                w.dirty[seq] = None
                self._active.add(w)

    def adopt(self, entry: Entry) -> None:
        """A capture an earlier daemon run numbered (daemon/adoption.py), under its number."""
        seq = entry.seq
        if not seq or seq in self._by_seq:
            return
        self._by_seq[seq] = entry
        bisect.insort(self._present, seq)

    def dropped(self, entry: Entry, why: str) -> None:
        """The store let go of `entry` (evicted, or replaced before its end)."""
        seq = entry.seq
        if not seq or self._by_seq.get(seq) is not entry:
            return
        del self._by_seq[seq]
        if len(self._present) > 2 * len(self._by_seq) + 1024:
            self._present = [s for s in self._present if s in self._by_seq]
        self._drops += 1
        self._gone[seq] = _Tomb(_Fields.of(entry.begin), entry.end is not None, self._drops, why)
        bisect.insort(self._gone_keys, seq)  # drops come mostly in seq order: an append
        if len(self._gone_keys) > TOMBSTONES + TOMBSTONES // 4:  # forget the oldest quarter at once
            cut = len(self._gone_keys) - TOMBSTONES
            for k in self._gone_keys[:cut]:
                del self._gone[k]
            del self._gone_keys[:cut]
        for w in self._watchers.values():
            if w.whole and w.waiting_for == seq:  # it will never end: report it and go on
                w.waiting_for = None
                self._active.add(w)
            o = w.current if w.whole else w.open.get(seq)
            if o is not None and o.entry is entry:
                o.gone = why
                if not w.whole:
                    w.dirty[seq] = None
                self._active.add(w)

    def attach(self, envelope: list[bytes], req: wf.WatchRequest, now: float) -> Frames | None:
        """Start a watch; returns an error reply to send when it is refused (None otherwise)."""
        key = (envelope[0], req.id)
        if key in self._watchers:
            return None  # the client's repeat after a quiet spell: the watch goes on as it is
        last = self.next_seq - 1
        if req.since is not None and req.since > last:
            self.rejected += 1
            return wf.error_frames(wf.E_BAD_SINCE, f"since {req.since} is in the future: the newest capture of this "
                                   f"daemon is seq {last} (sequence state {self._state_file()})", req.id)
        if len(self._watchers) >= MAX_WATCHERS:
            self.rejected += 1
            return wf.error_frames(wf.E_LIMIT, f"the daemon serves {MAX_WATCHERS} watches already", req.id)
        since = last if req.since is None else req.since
        w = Watcher(envelope, req, since, since + 1, now, self._drops, self.next_seq, last_send=now, announced=since,
                    wm_at=now, arena=self.arena if req.arena else None)
        self._watchers[key] = w
        self.watchers_total += 1
        oldest = self._next_present(0)
        w.control.append([wf.encode(wf.WatchingReply(id=req.id, since=since, oldest=oldest, next=self.next_seq,
                                                     run_first=self.run_first, arena=arena_advert(w.arena)))])
        self._active.add(w)
        log.info("watch %s/%d from seq %d (%s%s)", envelope[0].hex(), req.id, since + 1,
                 "whole" if req.whole else "streamed", "".join(f", {k}={v!r}" for k, v in req.filters().items()))
        return None

    def cancel(self, envelope: list[bytes], watch_id: int) -> bool:
        w = self._watchers.get((envelope[0], watch_id))
        if w is None:
            return False
        self._remove(w)
        return True

    def stop(self, reason: str, now: float) -> None:
        """Tell every watcher the stream ends (the daemon is stopping)."""
        for w in self._watchers.values():
            self._finish(w, wf.error_frames(wf.E_STOPPING, reason, w.req.id), now)

    def tick(self, now: float) -> None:
        if self.seqs is not None:
            self.seqs.tick(now)
        for w in self._watchers.values():
            if w.final is not None or w.control or w.pending is not None:
                continue  # a message is waiting already: no second one queued behind it
            h = w.handled
            if (h > w.announced and now - w.wm_at >= WATERMARK_S) or now - w.last_send >= KEEPALIVE_S:
                w.control.append([wf.encode(wf.WatermarkReply(id=w.req.id, seq=h))])
                w.announced = max(w.announced, h)
                w.wm_at = w.last_send = now
                self._active.add(w)

    # -- output --

    def pump(self, send: Send, now: float) -> bool:
        """Send what watchers may have now; True if anything went out."""
        busy = False
        for w in list(self._active):
            busy |= self._pump(w, send, now)
        return busy

    def _pump(self, w: Watcher, send: Send, now: float) -> bool:
        if w.final is not None:
            ok = send(w.envelope, w.final)
            if ok or ok is None or now >= w.final_deadline:
                self._remove(w)
            return bool(ok)
        sent = 0
        while sent < SEND_BATCH:
            if w.pending is not None:
                ok = send(w.envelope, w.pending)
                if not ok:
                    if ok is None:
                        log.info("watcher %s/%d went away", w.envelope[0].hex(), w.req.id)
                        self._remove(w)
                    return sent > 0  # full: its turn comes again next round
                w.pending = None
                w.messages += 1
                w.last_send = now
                sent += 1
                continue
            frames = self._next(w)
            if frames is None:  # nothing to send until an event, a drop or the tick wakes it
                self._active.discard(w)
                return sent > 0
            w.pending = frames
        return True

    def _next(self, w: Watcher) -> Frames | None:
        """The watcher's next message, its state already advanced past it; None when it must wait."""
        if w.control:
            return w.control.popleft()
        while True:
            if w.whole:
                o = w.current
                if o is not None:
                    if o.gone is not None:
                        w.current = None
                        return self._lost_one(w, o)
                    h = o.entry.history
                    if o.resend_begin:
                        o.resend_begin = False
                        return encode(h[0], o.entry, w.req.id)
                    if o.index < len(h):
                        ev = h[o.index]
                        o.index += 1
                        frames = self._encode(ev, o.entry, w)
                        if isinstance(ev, End):
                            w.current = None
                            w.delivered += 1
                            self.delivered_total += 1
                            w.announced = max(w.announced, o.entry.seq)
                        return frames
                    if o.entry.end is None:  # sent all it has; the rest follows as it is filed
                        w.waiting_for = o.entry.seq
                        return None
                    w.current = None  # (an End is always last; defensive)
                    continue
            elif w.dirty:
                seq = next(iter(w.dirty))
                o = w.open[seq]
                h = o.entry.history
                if o.gone is not None and not (o.entry.end is not None and o.index >= len(h)):
                    del w.open[seq], w.dirty[seq]
                    return self._lost_one(w, o)
                if o.index < len(h):
                    ev = h[o.index]
                    o.index += 1
                    if isinstance(ev, End):
                        del w.open[seq], w.dirty[seq]
                        w.delivered += 1
                        self.delivered_total += 1
                    return self._encode(ev, o.entry, w)
                del w.dirty[seq]
                continue
            frames = self._advance(w)
            if frames is not False:
                return frames  # type: ignore[return-value]

    def _encode(self, ev: Event, entry: Entry, w: Watcher) -> Frames:
        frames = encode(ev, entry, w.req.id, arena=w.arena)
        assert frames is not None
        if w.arena is not None:
            if isinstance(ev, Tokens) and len(frames) == 1:
                self.arena_messages += 1
                self.arena_bytes += ev.nbytes
            elif isinstance(ev, End) and self.pin is not None:
                self.pin(w.envelope[0], entry)  # its descriptors are on their way, not yet copied
        return frames

    def _advance(self, w: Watcher) -> Frames | None | bool:
        """Consider the capture at the cursor: a message, None to wait, False to look again."""
        c = w.cursor
        if c >= self.next_seq:
            return None
        entry = self._by_seq.get(c)
        if c < self.run_first and entry is None and c not in self._gone:
            # Numbered by an earlier run and not adopted from its arena (daemon/adoption.py): up to
            # the next one that was, or this run's first.
            end = min(self._next_present(c), self.run_first) - 1
            w.cursor = end + 1
            return self._lost(w, c, end, wf.LOST_RESTARTED,
                              "numbered by an earlier run of the daemon, whose memory is gone")
        if entry is None:
            return self._absent(w, c)
        if not w.matches(_Fields.of(entry.begin)):
            w.cursor += 1
            w.filtered += 1
            return False
        if w.whole:
            # The head capture goes out as it is filed (the client assembles it and yields it at its
            # end); the next one starts only after its End, so order holds and transfer overlaps.
            w.current = _Open(entry)
        else:
            w.open[c] = _Open(entry)
            w.dirty[c] = None
        w.cursor += 1
        return False

    def _absent(self, w: Watcher, c: int) -> Frames | bool:
        """Seq c is not retained: report the run of absent seqs from c that share a reason."""
        stop = self._next_present(c)  # first retained seq after c
        if c not in self._gone:  # no tombstone (forgotten): report up to the next one
            j = bisect.bisect_left(self._gone_keys, c)
            end = min(stop, self._gone_keys[j] if j < len(self._gone_keys) else stop) - 1
            if c < w.attach_next:  # given out before the watch began: evicted, as far as we can tell
                end = min(end, w.attach_next - 1)
                reason = wf.LOST_EVICTED
            else:  # given out and dropped while attached
                reason = wf.LOST_TOO_SLOW
            w.cursor = end + 1
            return self._lost(w, c, end, reason, "no longer retained by the daemon")
        why = self._why(w, self._gone[c])
        end = c
        while end + 1 < stop and (end + 1) in self._gone and self._why(w, self._gone[end + 1]) == why:
            end += 1
        w.cursor = end + 1
        if why is None:
            w.filtered += end - c + 1
            return False
        return self._lost(w, c, end, *why)

    def _next_present(self, c: int) -> int:
        """The lowest retained seq >= c (next_seq if none)."""
        i = bisect.bisect_left(self._present, c)
        while i < len(self._present):
            if self._present[i] in self._by_seq:
                return self._present[i]
            i += 1
        return self.next_seq

    def _why(self, w: Watcher, t: _Tomb) -> tuple[str, str] | None:
        if not w.matches(t.fields):
            return None
        if not t.ended:
            return (wf.LOST_DROPPED, t.detail)
        return (wf.LOST_TOO_SLOW if t.drop_no > w.attach_drop_no else wf.LOST_EVICTED, t.detail)

    def _lost_one(self, w: Watcher, o: _Open) -> Frames:
        reason = wf.LOST_TOO_SLOW if o.entry.end is not None else wf.LOST_DROPPED
        return self._lost(w, o.entry.seq, o.entry.seq, reason, o.gone or "")

    def _lost(self, w: Watcher, first: int, last: int, reason: str, detail: str) -> Frames:
        n = last - first + 1
        w.lost += n
        self.lost_total[reason] = self.lost_total.get(reason, 0) + n
        if reason == wf.LOST_TOO_SLOW:
            w.lost_too_slow += n
            log.warning("watcher %s/%d too slow: captures %d..%d lost (%s)", w.envelope[0].hex(), w.req.id, first,
                        last, detail)
        if w.whole:
            w.announced = max(w.announced, last)
        return [wf.encode(wf.LostReply(id=w.req.id, first=first, last=last, reason=reason, detail=detail))]

    def _finish(self, w: Watcher, frames: Frames, now: float, flush_s: float = FINAL_FLUSH_S) -> None:
        w.final = frames
        w.final_deadline = now + flush_s
        w.current = None
        w.open.clear()
        w.dirty.clear()
        self._active.add(w)

    def _remove(self, w: Watcher) -> None:
        if self._watchers.get(w.key) is w:
            del self._watchers[w.key]
        self._active.discard(w)
        w.current = None
        w.open.clear()
        w.dirty.clear()

    # -- status --

    def _state_file(self) -> str:
        return self.seqs.path if self.seqs is not None else "-"

    def snapshot(self, now: float) -> dict[str, Any]:
        seq: dict[str, Any] = self.seqs.snapshot() if self.seqs is not None else {
            "state_file": None, "run_first": self.run_first, "last": self.next_seq - 1, "reserved": None,
            "persist_error": "not open"}
        first = self._next_present(0)
        last = next((s for s in reversed(self._present) if s in self._by_seq), None)
        seq.update(next=self.next_seq, retained=len(self._by_seq),
                   first_retained=first if self._by_seq else None, last_retained=last)
        watchers = []
        for w in self._watchers.values():
            h = w.handled
            watchers.append({
                "peer": w.envelope[0].hex(), "id": w.req.id, "mode": "whole" if w.whole else "streamed",
                "filters": w.req.filters(), "since": w.since, "handled": h, "behind": max(0, self.next_seq - 1 - h),
                "waiting_for": w.waiting_for, "open": len(w.open), "delivered": w.delivered, "lost": w.lost,
                "lost_too_slow": w.lost_too_slow, "filtered": w.filtered, "messages": w.messages,
                "attached_s": now - w.attached_at,
            })
        return {"sequence": seq, "watchers": watchers, "watchers_total": self.watchers_total,
                "watches_refused": self.rejected, "watch_delivered": self.delivered_total,
                "watch_lost": dict(self.lost_total)}
