"""The engine instances the daemon reads: one reassembler each (daemon/reassembly.py), fed what the
ring poller reads and learns (it is the poller's RingFacts), its events handed on to `deliver` (the
subscriber hub). Also what spans every instance's captures in flight: the memory budget
(`inflight_bytes`: reassembly and histories; beyond it the biggest capture is cut, its remaining
positions becoming gaps with a reason) and the handover of what was read and not delivered to the
next daemon at a graceful stop.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from vllm_tap import federation_format as ff
from vllm_tap import ring_format as rf
from vllm_tap.ring_records import ControlRecord, DataRecord, Record

from . import handover
from .events import OVER_BUDGET, WRITER_GONE, Event
from .reassembly import ENGINE_SOURCE, Reassembler
from .ring_poller import LOG_FIRST
from .store import Store

log = logging.getLogger(__name__)

Deliver = Callable[[list[Event], float], None]


class Instances:
    """Every instance's reassembler, fed by the ring poller and the clock."""

    def __init__(self, store: Store, deliver: Deliver, *, end_grace_s: float, inflight_bytes: int):
        self._store = store
        self._deliver = deliver
        self.end_grace_s = end_grace_s
        self.inflight_budget = inflight_bytes
        self._reasm: dict[str, Reassembler] = {}
        self._alloc: Any = None
        self.captures_cut = 0
        self.reassembly_errors = 0
        # Told of every END read, after its events (the journal keeps those of captures still in flight).
        self.on_end_read: Callable[[str, ControlRecord], None] | None = None
        # Told of every BEGIN, END and LIVE read from an engine ring here (a home daemon's peers get them).
        self.on_control: Callable[[str, ControlRecord], None] | None = None

    def use_arena(self, arena: Any) -> None:
        """Arrays reassembly makes (a concatenation of slices) go into the delivery arena."""
        self._alloc = arena.alloc
        for r in self._reasm.values():
            r.alloc = arena.alloc

    def reassembler(self, instance: str) -> Reassembler:
        r = self._reasm.get(instance)
        if r is None:
            r = self._reasm[instance] = Reassembler(instance, end_grace_s=self.end_grace_s, alloc=self._alloc)
        return r

    # -- what the ring poller tells (ring_poller.RingFacts) --

    def ring_resumed(self, instance: str, ring: str, replay_until: int = 0) -> None:
        self.reassembler(instance).resumed_ring(ring, replay_until)

    def record(self, instance: str, record: Record, now: float, path: str) -> None:
        try:
            events = self.reassembler(instance).feed(record, now)
        except Exception:  # a bug here must cost one record, not the daemon and everyone's captures
            self.reassembly_errors += 1
            if self.reassembly_errors <= LOG_FIRST:
                log.exception("record of request %s from %s could not be reassembled",
                              record.entries[0].request_id if type(record) is DataRecord else record.request_id,
                              path)
            return
        self._deliver(events, now)
        kind = record.kind
        if kind == rf.RecordKind.DATA:
            return
        if kind == rf.RecordKind.END and self.on_end_read is not None:
            self.on_end_read(instance, record)  # type: ignore[arg-type]
        if self.on_control is not None and kind in ff.CONTROL_KINDS and record.ring == ENGINE_SOURCE:
            self.on_control(instance, record)  # type: ignore[arg-type]

    def rejected(self, instance: str, request_ids: tuple[str, ...], why: str, now: float) -> None:
        self._deliver(self.reassembler(instance).reject(request_ids, why, now), now)

    def ring_read(self, instance: str, ring: str, read: int, written: int, now: float) -> None:
        self._deliver(self.reassembler(instance).ring_read(ring, read, written, now), now)

    def writer_gone(self, instance: str, ring: str, now: float, reason: str = WRITER_GONE) -> None:
        self.reassembler(instance).writer_gone(ring, now, reason)

    def ranks_lost(self, instance: str, ring: str, now: float, reason: str) -> None:
        """A peer host's ring stopped reporting (daemon/peer_link.py)."""
        self.reassembler(instance).ranks_lost(ring, now, reason)

    def ring_closed(self, instance: str, ring: str, now: float) -> None:
        self._deliver(self.reassembler(instance).ring_closed(ring, now), now)

    def holds(self, floors: dict[tuple[str, str, int], int]) -> dict[tuple[str, str, int], int]:
        """(instance, ring, epoch) -> where the earliest record whose data is held unfiled starts, of
        the rings in `floors` (-> their file's cursor: holds below it are given up)."""
        out: dict[tuple[str, str, int], int] = {}
        for inst, reasm in self._reasm.items():
            mine = {(ring, epoch): c for (i, ring, epoch), c in floors.items() if i == inst}
            if not mine:
                continue
            held: dict[tuple[str, int], int] = {}
            reasm.holds(mine, held)
            for (ring, epoch), c in held.items():
                out[(inst, ring, epoch)] = c
        return out

    # -- time --

    def tick(self, now: float) -> None:
        """What time decides (daemon/reassembly.py: grace, barriers, dead writers, lost ENDs), then the budget."""
        for reasm in self._reasm.values():
            self._deliver(reasm.tick(now), now)
        self._shed(now)

    def inflight_bytes(self) -> int:
        return sum(r.held_bytes for r in self._reasm.values()) + self._store.inflight_bytes

    def _shed(self, now: float) -> None:
        """Keep captures in flight inside inflight_bytes: cut the biggest until they fit."""
        over = self.inflight_bytes() - self.inflight_budget
        if over <= 0:
            return
        sizes = []
        for inst, reasm in self._reasm.items():
            for rid, held in reasm.request_bytes():
                sizes.append((held + self._store.history_bytes((inst, rid)), inst, rid))
        sizes.sort(reverse=True)
        for size, inst, rid in sizes:
            if over <= 0:
                break
            reason = f"{OVER_BUDGET}: captures in flight held more than inflight_bytes={self.inflight_budget}"
            log.warning("capture %s/%s cut (%d bytes): %s", inst, rid, size, reason)
            self.captures_cut += 1
            self._deliver(self._reasm[inst].cut(rid, now, reason), now)
            self._store.shed((inst, rid), reason)
            over -= size

    # -- handover --

    def hand_over(self, state_dir: str) -> None:
        """A graceful stop: what was read of the captures in flight and not delivered, for the next daemon."""
        try:
            budget = [handover.MAX_DELIVERED_BYTES]
            state = {inst: reasm.export_state(lambda rid, inst=inst: self._history(inst, rid, budget))
                     for inst, reasm in self._reasm.items()}
            n = handover.write(state_dir, state)
        except Exception as e:  # a stop must complete whatever this finds
            log.error("cannot hand the captures in flight over to the next daemon (%s): they end with it", e,
                      exc_info=not isinstance(e, OSError))
            return
        if n:
            log.info("handed %d captures in flight over to the next daemon", n)

    def _history(self, instance: str, request_id: str, budget: list[int]) -> list:
        """What was delivered of a capture in flight, while `budget` (bytes, spent here) lasts."""
        entry = self._store.get((instance, request_id))
        if entry is None or entry.end is not None or entry.nbytes > budget[0]:
            return []
        budget[0] -= entry.nbytes
        return entry.history

    def continue_filed(self, entry: Any, now: float, end: ControlRecord | None = None) -> None:
        """A capture in flight adopted from an earlier run's arena (its store entry; `end`: the END
        that run had read for it): reassembly goes on with it."""
        self._deliver(self.reassembler(entry.instance).continue_filed(entry.begin, entry.history, now, end), now)

    def finished_before(self, begin: Any) -> None:
        """A capture an earlier daemon run finished, adopted from its journal (its events.Begin)."""
        self.reassembler(begin.instance).finished_before(begin.request_id, begin.origin)

    def take_handover(self, state_dir: str, now: float,
                      taken: "dict[str, list[handover.InFlight]] | None" = None) -> None:
        if taken is None:
            taken = handover.take(state_dir)
        for inst, captures in taken.items():
            self._deliver(self.reassembler(inst).restore(captures, now), now)
        if taken:
            log.info("continuing %d captures in flight handed over by the previous daemon",
                     sum(len(v) for v in taken.values()))

    # -- what the status view reads --

    def all(self) -> Iterable[Reassembler]:
        return self._reasm.values()
