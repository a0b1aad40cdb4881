"""Captures kept a while after their last message went to a subscriber that maps the arena.

A descriptor handed to zmq is not yet copied by its subscriber (up to two socket queues of them may
be on the way), so a capture whose last message went to an arena subscriber stays pinned for
`arena_linger_s` more (retention may have dropped it meanwhile), or until that peer is gone or says
it read to the End (it cancels the finished subscription). Pins never hold more than half of
arena_bytes in all: beyond it the oldest are let go first. A subscriber still slower than that finds
the generation of a reused region moved: a Gap, never other bytes.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

from .store import Entry


class Pin(NamedTuple):
    deadline: float
    entry: Entry
    sub_id: int | None  # the subscription it was sent to (None: a watch)


class Pins:
    """The pins of every peer (routing id), and the bytes they hold."""

    def __init__(self, linger_s: float, max_bytes: int):
        self.linger_s = linger_s
        self.max_bytes = max_bytes
        self._by_peer: dict[bytes, list[Pin]] = {}
        self.pinned_bytes = 0

    def __bool__(self) -> bool:
        return bool(self._by_peer)

    @property
    def captures(self) -> int:
        return sum(len(v) for v in self._by_peer.values())

    def peers(self) -> list[bytes]:
        return list(self._by_peer)

    def holds(self, routing_id: bytes) -> bool:
        return routing_id in self._by_peer

    def pin(self, routing_id: bytes, entry: Entry, sub_id: int | None, now: float) -> None:
        if self.linger_s <= 0:
            return
        self._by_peer.setdefault(routing_id, []).append(Pin(now + self.linger_s, entry, sub_id))
        self.pinned_bytes += entry.nbytes
        if self.pinned_bytes > self.max_bytes:
            self._unpin(lambda deadline: True, self.pinned_bytes - self.max_bytes)

    def expire(self, now: float) -> None:
        """Let go of the pins whose time is up."""
        if self._by_peer:
            self._unpin(lambda deadline: deadline <= now)

    def peer_gone(self, routing_id: bytes) -> None:
        if routing_id in self._by_peer:
            self._unpin(lambda deadline: True, peers=[routing_id])

    def release(self, routing_id: bytes, sub_id: int) -> None:
        """A client cancels a subscription that already ended: it has read (copied) everything up
        to the End, so what was pinned for it may go now rather than at its deadline."""
        pins = self._by_peer.get(routing_id)
        if not pins:
            return
        kept = [p for p in pins if p.sub_id != sub_id]
        if len(kept) == len(pins):
            return
        self.pinned_bytes -= sum(p.entry.nbytes for p in pins if p.sub_id == sub_id)
        if kept:
            self._by_peer[routing_id] = kept
        else:
            del self._by_peer[routing_id]

    def _unpin(self, drop: Callable[[float], bool], at_least: int = 1 << 62, peers: Iterable[bytes] | None = None) -> None:
        """Let go of the pins `drop(deadline)` picks, oldest first until at_least bytes went, of `peers` or all."""
        items = sorted(((pin.deadline, k, rid, pin) for rid in (peers if peers is not None else list(self._by_peer))
                        for k, pin in enumerate(self._by_peer.get(rid, ()))), key=lambda x: x[:2])
        freed = 0
        gone: set[int] = set()
        for deadline, _, rid, pin in items:
            if freed >= at_least:
                break
            if drop(deadline):
                gone.add(id(pin))
                freed += pin.entry.nbytes
        if not gone:
            return
        for rid in {x[2] for x in items}:
            kept = [pin for pin in self._by_peer.get(rid, ()) if id(pin) not in gone]
            if kept:
                self._by_peer[rid] = kept
            else:
                self._by_peer.pop(rid, None)
        self.pinned_bytes -= freed
