"""What the daemon remembers per capture: the delivered events, for replay to late subscribers.

A capture's history is the list of its events from Begin to End. Subscribers read it by index, so
live delivery and replay are the same loop and nothing is queued twice. Finished captures stay
for late subscribers within a byte budget and a TTL, least recently used first out; in-flight ones
are never evicted, but their bytes are counted (`inflight_bytes`) so the daemon can keep them
inside its own budget (shed: their data becomes gaps saying why). Every name a user may know a capture by (identity.names) points at it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from vllm_tap import wire_format as wf
from vllm_tap.identity import identify

from .events import Begin, End, Event, Gap, Tokens

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (instance, request_id)
_EVENT_OVERHEAD = 256  # bytes charged per event beyond its arrays (headers, bookkeeping)


class LookupFailed(LookupError):
    """A name resolves to no single capture; `code` is a wire_format error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Entry:
    key: Key
    serial: int  # creation order: the newest wins among captures sharing a name and choice
    begin: Begin
    response_id: str
    choice_index: int
    names: tuple[str, ...]
    history: list[Event] = field(default_factory=list)
    nbytes: int = 0
    seq: int = 0  # the capture's sequence number (daemon/watch.py gives it when the Begin is filed)
    finished_at: float | None = None
    end: End | None = None

    @property
    def instance(self) -> str:
        return self.key[0]

    @property
    def request_id(self) -> str:
        return self.key[1]


@dataclass
class _Tombstone:
    key: Key
    choice_index: int
    why: str


class Store:
    def __init__(self, retain_bytes: int, retain_ttl_s: float, *, tombstones: int = 65536):
        self.retain_bytes = retain_bytes
        self.retain_ttl_s = retain_ttl_s
        self._entries: dict[Key, Entry] = {}
        self._finished: OrderedDict[Key, None] = OrderedDict()  # LRU order, oldest first
        self._by_name: dict[str, set[Key]] = {}
        # Names of evicted captures, so a late subscriber hears "evicted" rather than waiting.
        self._evicted: OrderedDict[str, list[_Tombstone]] = OrderedDict()
        self._tombstones = tombstones
        self._serial = 0
        self.retained_bytes = 0
        self.inflight_bytes = 0  # histories of captures not ended yet
        self.evictions = 0
        # Told of every capture let go (evicted or replaced), with the reason: watchers report it.
        self.on_drop: Callable[[Entry, str], None] | None = None
        self.on_shed: Callable[[Entry, str], None] | None = None  # told when a capture's data became gaps

    # -- stats --

    @property
    def in_flight(self) -> int:
        return len(self._entries) - len(self._finished)

    @property
    def retained(self) -> int:
        return len(self._finished)

    def get(self, key: Key) -> Entry | None:
        return self._entries.get(key)

    def history_bytes(self, key: Key) -> int:
        e = self._entries.get(key)
        return e.nbytes if e is not None and e.end is None else 0

    def shed(self, key: Key, reason: str) -> int:
        """Replace the data of a capture in flight by gaps saying why (subscribers that already got it
        keep it; later ones get the gap); returns the bytes freed."""
        e = self._entries.get(key)
        if e is None or e.end is not None:
            return 0
        freed = 0
        for i, ev in enumerate(e.history):
            if isinstance(ev, Tokens):
                e.history[i] = Gap(ev.instance, ev.request_id, range(ev.start, ev.stop), reason, ev.at)
                freed += ev.nbytes
        e.nbytes -= freed
        self.inflight_bytes -= freed
        if self.on_shed is not None:
            self.on_shed(e, reason)
        return freed

    def adopt(self, seq: int, history: list[Event], now: float, finished_at: float) -> Entry | None:
        """A capture an earlier daemon run filed (daemon/adoption.py): its Begin, what it delivered,
        its End if it ended (then retained as if it ended at `finished_at`). None when a capture of
        that key is already here."""
        begin = history[0]
        assert isinstance(begin, Begin)
        if begin.key in self._entries:
            return None
        self._serial += 1
        nbytes = sum(ev.nbytes for ev in history if isinstance(ev, Tokens)) + _EVENT_OVERHEAD * len(history)
        e = Entry(begin.key, self._serial, begin, "", 0, (), list(history), nbytes, seq)
        self._entries[begin.key] = e
        self._identify(e)
        last = history[-1]
        if isinstance(last, End):
            e.end = last
            e.finished_at = finished_at
            self._finished[begin.key] = None
            self.retained_bytes += nbytes
        else:
            self.inflight_bytes += nbytes
        return e

    # -- events --

    def add(self, ev: Event, now: float) -> Entry | None:
        """File an event; returns the entry it extended (None for an event of no known capture)."""
        if isinstance(ev, Begin):
            return self._begin(ev, now)
        e = self._entries.get(ev.key)
        if e is None or e.end is not None:
            return None
        size = (ev.nbytes if isinstance(ev, Tokens) else 0) + _EVENT_OVERHEAD
        e.history.append(ev)
        e.nbytes += size
        self.inflight_bytes += size
        if isinstance(ev, End):
            e.end = ev
            e.finished_at = now
            self._finished[ev.key] = None
            self.inflight_bytes -= e.nbytes
            self.retained_bytes += e.nbytes
        return e

    def _begin(self, ev: Begin, now: float) -> Entry:
        e = self._entries.get(ev.key)
        if e is not None and ev.update and e.end is None:
            # A late BEGIN fills in a lazily made capture; late subscribers replay the fuller one.
            self._unindex(e)
            e.begin = ev
            e.history[0] = ev
            self._identify(e)
            return e
        if e is not None:
            self._drop(e, "replaced by a new capture with the same request id")
        self._serial += 1
        e = Entry(ev.key, self._serial, ev, "", 0, (), [ev], _EVENT_OVERHEAD)
        self.inflight_bytes += _EVENT_OVERHEAD
        self._entries[ev.key] = e
        self._identify(e)
        return e

    def _identify(self, e: Entry) -> None:
        ident = identify(e.begin.request_id, e.begin.tap_key, e.begin.n)
        e.response_id, e.choice_index, e.names = ident.response_id, ident.choice_index, ident.names
        for name in e.names:
            self._by_name.setdefault(name, set()).add(e.key)

    def _unindex(self, e: Entry) -> None:
        for name in e.names:
            keys = self._by_name.get(name)
            if keys is not None:
                keys.discard(e.key)
                if not keys:
                    del self._by_name[name]

    def _drop(self, e: Entry, why: str) -> None:
        if self.on_drop is not None:
            self.on_drop(e, why)
        self._unindex(e)
        del self._entries[e.key]
        if e.key in self._finished:
            del self._finished[e.key]
            self.retained_bytes -= e.nbytes
        elif e.end is None:
            self.inflight_bytes -= e.nbytes
        for name in e.names:
            self._evicted.setdefault(name, []).append(_Tombstone(e.key, e.choice_index, why))
            self._evicted.move_to_end(name)
        while len(self._evicted) > self._tombstones:
            self._evicted.popitem(last=False)

    # -- retention --

    def touch(self, e: Entry) -> None:
        if e.key in self._finished:
            self._finished.move_to_end(e.key)

    def evict(self, now: float) -> list[Entry]:
        """Drop finished captures past the TTL, then the least recently used beyond the budget."""
        out: list[Entry] = []
        for key in list(self._finished):
            e = self._entries[key]
            if e.finished_at is not None and now - e.finished_at > self.retain_ttl_s:
                out.append(e)
                self._drop(e, f"evicted {self.retain_ttl_s:g} s after it ended (retain_ttl_s)")
        while self._finished and self.retained_bytes > self.retain_bytes:
            e = self._entries[next(iter(self._finished))]
            out.append(e)
            self._drop(e, f"evicted to stay within retain_bytes={self.retain_bytes}")
        self.evictions += len(out)
        for e in out:
            log.debug("evicted %s/%s (%d bytes)", e.instance, e.request_id, e.nbytes)
        return out

    # -- lookup --

    def resolve(self, name: str, index: int | None = None, instance: str | None = None) -> Entry | None:
        """The capture a subscriber means; None if none yet; LookupFailed if ambiguous or evicted."""
        cands = [self._entries[k] for k in self._by_name.get(name, ())]
        if instance is not None:
            cands = [e for e in cands if e.instance == instance]
        if index is not None:
            cands = [e for e in cands if e.choice_index == index]
        if not cands:
            for t in reversed(self._evicted.get(name, [])):
                if (instance is None or t.key[0] == instance) and (index is None or t.choice_index == index):
                    raise LookupFailed(wf.E_EVICTED, f"capture {name!r} ({t.key[0]}/{t.key[1]}) is gone: {t.why}")
            return None
        instances = sorted({e.instance for e in cands})
        if len(instances) > 1:
            raise LookupFailed(wf.E_AMBIGUOUS, f"{name!r} names captures in instances {', '.join(instances)}: pass instance=")
        choices = sorted({e.choice_index for e in cands})
        if len(choices) > 1:
            raise LookupFailed(
                wf.E_AMBIGUOUS,
                f"{name!r} names {len(choices)} captures (choice indices {', '.join(map(str, choices))}): pass index=",
            )
        return max(cands, key=lambda e: e.serial)

