"""Reassembly of ring records into ordered per-capture events: a pure state machine (no IO).

The daemon feeds every record it reads, from all rings of one engine instance, in whatever order it
reads them, and what it learns of the rings (how far each is read, a writer gone, a ring closed) and
the time; out come events per capture (daemon/events.py): Begin, then Tokens and Gap covering every
expected position exactly once in increasing order, then End. Nothing here reads a clock, a socket
or a file: time comes in as `now`, so tests drive it deterministically.

Split by job, each module with its own rules:

    events.py     what comes out, and the reasons positions are missing
    lifecycle.py  a capture's phase and its transition table; Barriers
    assembly.py   one capture being reassembled (an Assembly) and the reassembler's Tally
    tiling.py     a step's records across ranks and tensors become one span's tensors
    ordering.py   the ready spans of a capture, in position order
    delivery.py   ready spans out as events, in order; the capture's End
    handover.py   the codec between assemblies and the file a stopping daemon leaves its successor
    reassembly.py (this module) the inputs: records by kind, ring facts, time

How records become tokens (the record contract, see ring_format / hooks):
- DATA records of one (capture, step) form a step group (tiling.py). Rings are FIFO per writer and
  every rank writes steps in order. So once a later group of a capture completes, an earlier group
  whose ranks all took part in the later one can no longer complete (its missing parts were dropped
  or consumed by a previous daemon), and positions below a completed group that no pending group
  covers were never computed: both become gaps at once instead of waiting for the end.
- Positions at or below what was already delivered (preemption recomputes them) are dropped.
- A DATA record of whole tensors (the usual record of one rank): a capture whose step is all in it
  and comes next in order takes a direct way, its rows of each tensor one Tokens span of views into
  the record's block, with no group; anything else goes its Slices' way, one step group at a time.
  Either way the events are the same.

Rules for what is expected and when a capture ends:
- Where a capture starts is known from its BEGIN (the spec), or from any DATA record's request table
  (`start`), so a daemon that missed the BEGIN (restarted) still reports the head it never saw as a
  Gap, in order, before any data. A tail capture (`tail` N > 0: the last N computed positions)
  holds the newest N positions until the END says where the request stopped.
- Async scheduling can compute a request one step past its end. Positions at or past the END's
  end_position are never delivered (delivery.py, HOLD_NEWEST); nothing is held when the BEGIN says
  the engine does not schedule asynchronously.
- A capture a worker did not admit (a SHED record from any of its ranks: the daemon was behind, see
  hooks/admission.py) is delivered as one Gap over its expected positions, with the SHED's reason
  (`overloaded`), once its END says where it stops; whatever other ranks wrote for it is discarded
  (without the shedding rank's records none of its steps could complete).
- Every capture ends (lifecycle.py): by its END, by its writer's death (after gone_grace_s, once the
  dead ring is drained), by the engine's LIVE records no longer naming it (END lost), by a malformed
  record naming it, or by the daemon cutting it to stay inside its memory budget. The End says which;
  `complete` holds only when the END was seen and no expected position is missing.
- A capture with its END ends as soon as every expected position is resolved. One that still misses
  positions waits for its data, not for a clock: end_grace_s after the END was read (daemon time) it
  joins a Barrier, and once the daemon has read every ring that far (`ring_read`), what is missing
  becomes Gaps: `incomplete` for steps some of whose records came and others did not (for a capture
  met half way after a restart, the other records of its first steps went with the previous daemon:
  NOT_CAPTURED_PREVIOUS), holes below what came as ever, `timeout` past everything that came. A
  capture whose END is lost (the LIVE rule) waits the same way before it ends `end lost`. Each ring
  is at most its capacity ahead of the daemon, and a ring that is closed (replaced, broken) stops
  counting (`ring_closed`), so every Barrier is passed.
- Missing positions are kept as ranges, never as lists of positions: one far-off position costs
  one range, not memory in proportion to the distance.

Where arrays live is decided before they are read, outside this state machine (the ring reader's
destination: daemon/destination.py); a tensor's slices read into their columns of one array are that
array. Only slices that do not tile such an array are concatenated, into what the allocator given
here gives (`alloc(shape, dtype) -> array | None`, the daemon's delivery arena; None: numpy's heap).
The allocator is an interface: no IO happens here.
"""

from __future__ import annotations

import collections
import logging
from collections import OrderedDict
from typing import Any, Callable, Iterable

import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap import ring_schema
from vllm_tap.positions import PositionRanges
from vllm_tap.ring_records import ControlRecord, DataRecord, Record, Slice
from vllm_tap.spec import CaptureSpec

from . import delivery, ordering
from . import handover as ho
from .assembly import HOLD_NEWEST, Assembly, Tally, bottom, top
from .events import (DROPPED, END_LOST, INCOMPLETE, MALFORMED, NOT_CAPTURED_PREVIOUS, OVER_BUDGET, OVERLOADED, TIMEOUT,
                     WRITER_GONE, Begin, Event, Gap, Tokens, new_tokens)
from .lifecycle import NO_END, Barrier, Happens, Phase
from .ordering import Span
from .tiling import Alloc, StepGroup, named_sections, runs, tile

log = logging.getLogger(__name__)

ENGINE_SOURCE = "engine" + rf.RING_SUFFIX  # the engine ring's name: its writer carries the ENDs
LIVE_SILENCE_S = 3.0  # left out of the latest LIVE, then nothing about it for this long: as good as two absences
GONE_GRACE_S = 0.25  # after a dead writer's ring is drained: one more read of the other rings
_LOST = frozenset({Phase.END_LOST, Phase.END_LOST_WAITING})


class Reassembler:
    """Per-capture reassembly for the rings of one engine instance."""

    def __init__(self, instance: str = "default", *, end_grace_s: float = 5.0, gone_grace_s: float = GONE_GRACE_S,
                 finished_memory: int = 65536, hold_newest: int = HOLD_NEWEST, live_silence_s: float = LIVE_SILENCE_S,
                 alloc: Alloc | None = None):
        self.instance = instance
        self.alloc = alloc
        self.end_grace_s = end_grace_s
        self.gone_grace_s = min(gone_grace_s, end_grace_s)
        self.hold_newest = hold_newest
        self.live_silence_s = live_silence_s
        self._requests: dict[str, Assembly] = {}
        # Ids recently finished, so records straggling in after the End do not start a new capture.
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._finished_memory = finished_memory
        self._resumed: set[str] = set()  # rings a previous daemon had been reading
        # ring -> the cursor below which an earlier run of the daemon read and accounted for its records
        # (its journal): read again, they matter only to captures still in flight here
        self._replay: dict[str, int] = {}
        # (ring, epoch, cursor) of the BEGIN records of captures an earlier run finished (adopted from
        # its journal): met again (a journal whose last Read frames were lost), they start nothing
        self._begun: dict[tuple[str, int, int], str] = {}
        self._last_live_at: float | None = None
        self._read: dict[str, int] = {}  # worker ring -> its read cursor, as the daemon last reported it
        self._barriers: collections.deque[Barrier] = collections.deque()  # oldest first
        self.tally = Tally()

    # -- inspection --

    @property
    def held_bytes(self) -> int:
        """Bytes held for captures in flight (pending step groups, ready spans)."""
        return self.tally.held_bytes

    @property
    def stats(self) -> dict[str, int]:
        return self.tally.stats

    @property
    def gap_positions(self) -> dict[str, int]:
        """reason (events.GAP_REASONS, OTHER) -> positions delivered as gaps."""
        return self.tally.gap_positions

    def in_flight(self) -> int:
        return len(self._requests)

    def requests(self) -> list[dict[str, Any]]:
        return [
            {"instance": self.instance, "request_id": r.request_id, "frontier": r.frontier,
             "pending_groups": len(r.groups), "delivered": r.delivered, "held_bytes": r.nbytes,
             "missing": sum(len(m) for m in r.missing), "ended": r.end is not None, "source": r.source,
             "waiting_for_rings": r.life.waiting}
            for r in self._requests.values()
        ]

    def waiting_for_rings(self) -> int:
        """Captures that end once the daemon has read their rings up to a Barrier."""
        return sum(1 for r in self._requests.values() if r.life.waiting)

    def request_bytes(self) -> Iterable[tuple[str, int]]:
        """(request id, bytes held here) of every capture in flight."""
        return ((rid, r.nbytes) for rid, r in self._requests.items())

    # -- what the daemon learns of the rings --

    def resumed_ring(self, ring: str, replay_until: int = 0) -> None:
        """`ring` was being read by a previous daemon: captures first seen in it may have lost their head
        to it. Its records below `replay_until` that previous daemon had read, and what it filed of
        them is adopted: they are read again for the captures it left in flight, whose data it held
        unfiled (the ring's cursor had stayed below it, see holds), and nothing else."""
        self._resumed.add(ring)
        if replay_until > 0:
            self._replay[ring] = replay_until

    def holds(self, floors: dict[tuple[str, int], int], out: dict[tuple[str, int], int]) -> None:
        """Where the records whose data is held here (a step waiting for its other records, the newest
        position waiting for the END) start: into `out`, (ring, epoch) -> the lowest cursor at or
        above that ring's floor (its cursor as the file has it; holds below it are given up)."""
        def take(origin: Iterable[tuple[tuple[str, int], int]]) -> None:
            for key, c in origin:
                if c < out.get(key, 1 << 62) and c >= floors.get(key, 1 << 62):
                    out[key] = c

        last = None
        for a in self._requests.values():
            if not a.nbytes:
                continue
            for item in a.ready:
                origin = item[3].origin
                if origin is not last:  # else the same record's (a decode step holds each capture's newest)
                    last = origin
                    take(origin)
            for g in a.groups.values():
                take(g.cursors.items())

    def finished_before(self, request_id: str, origin: tuple[str, int, int] | None) -> None:
        """A capture an earlier daemon run finished (adopted from its journal; `origin`: its BEGIN
        record, events.Begin.origin): records of it read again start nothing, its BEGIN record
        included. A later BEGIN of the same request id (another record) starts a new capture."""
        self._finished[request_id] = None
        while len(self._finished) > self._finished_memory:
            self._finished.popitem(last=False)
        if origin is not None:
            self._begun[origin] = request_id
            while len(self._begun) > self._finished_memory:
                del self._begun[next(iter(self._begun))]

    def _replayed(self, r: ControlRecord | Slice) -> bool:
        """A record an earlier daemon run read and accounted for (resumed_ring), met again."""
        until = self._replay.get(r.ring)
        if until is not None and 0 <= r.cursor < until:
            self.stats["replayed_records"] += 1
            return True
        return False

    def ring_read(self, ring: str, read: int, written: int, now: float) -> list[Event]:
        """The daemon polled worker ring `ring`: its writer had written up to `written` when the poll
        began, and the daemon has now read (and fed) everything below `read`. Captures whose Barrier
        every ring has now been read up to end."""
        if ring == ENGINE_SOURCE:
            return []  # control records only: nothing a capture's data waits for
        self._read[ring] = read
        if not self._barriers:
            return []
        for b in reversed(self._barriers):  # the newest lack this ring's cursor, the older have it
            if ring in b.cursors:
                break
            b.cursors[ring] = written
        return self._pass_barriers(now)

    def ring_closed(self, ring: str, now: float) -> list[Event]:
        """The daemon no longer reads `ring` (replaced, removed, broken): no Barrier waits for it. A
        ring opened later under the same name is a new file, counted from its first poll."""
        self._read.pop(ring, None)
        self._replay.pop(ring, None)
        for b in self._barriers:
            b.cursors.pop(ring, None)
        return self._pass_barriers(now)

    def writer_gone(self, source: str, now: float, reason: str = WRITER_GONE) -> list[Event]:
        """The writer of ring `source` died or was replaced, and its ring was drained (or the ring
        broke, `reason`): what waits on it is resolved after gone_grace_s (one more read of the
        other rings)."""
        for a in self._requests.values():
            if source == ENGINE_SOURCE or source in a.sources:
                a.gone.add(source)
                if a.life.dead_at is None:
                    a.life.dead_at = now
                    a.life.dead_reason = reason
        return []

    def ranks_lost(self, source: str, now: float, reason: str) -> list[Event]:
        """Ring `source` of a peer host (daemon/federation.py) stopped reporting: any capture in flight
        may wait on its ranks, whether or not a record of it came from there yet. Each resolves what
        waits after gone_grace_s, as for a dead writer; one whose END is read (now or later) then
        ends, what it misses a Gap with `reason`."""
        for a in self._requests.values():
            a.gone.add(source)
            a.lost = reason
            if a.life.dead_at is None:
                a.life.dead_at = now
                a.life.dead_reason = reason
        return []

    # -- records --

    def feed(self, record: Record, now: float) -> list[Event]:
        """A record read from one of the instance's rings."""
        out: list[Event] = []
        kind = record.kind
        if kind == rf.RecordKind.DATA:
            self._on_data(record, now, out)  # type: ignore[arg-type]
            return out
        self.stats["records"] += 1
        if kind == rf.RecordKind.BEGIN:
            self._on_begin(record, now, out)  # type: ignore[arg-type]
        elif kind == rf.RecordKind.END:
            self._on_end(record, now, out)  # type: ignore[arg-type]
        elif kind == rf.RecordKind.DROP:
            self._on_drop(record, now, out)  # type: ignore[arg-type]
        elif kind == rf.RecordKind.LIVE:
            self._on_live(record, now)  # type: ignore[arg-type]
        elif kind == rf.RecordKind.SHED:
            self._on_shed(record, now, out)  # type: ignore[arg-type]
        return out

    def reject(self, request_ids: Iterable[str], why: str, now: float) -> list[Event]:
        """A record naming these requests did not fit the schema: end them, saying so."""
        out: list[Event] = []
        self.stats["rejected_records"] += 1
        for rid in request_ids:
            a = self._requests.get(rid)
            if a is None:
                if rid in self._finished:
                    continue
                a = self._new(ControlRecord(kind=rf.RecordKind.BEGIN, request_id=rid), now, out, lazy=True)
            log.warning("request %s: ended, a record of it was malformed (%s)", rid, why)
            self._finish(a, now, out, MALFORMED)
        return out

    def cut(self, request_id: str, now: float, reason: str = OVER_BUDGET) -> list[Event]:
        """Stop keeping the data of a capture in flight: what is held and what comes later become gaps."""
        out: list[Event] = []
        a = self._requests.get(request_id)
        if a is None or a.cut is not None:
            return out
        a.cut = reason
        self.stats["captures_cut"] += 1
        self._fail_groups(a, list(a.groups.values()), reason)
        ordering.discard_data(a, reason)
        self._pump(a, now, out)
        return out

    # -- time --

    def tick(self, now: float) -> list[Event]:
        """Resolve what time decides: captures past their END's grace (or declared END lost) join a
        Barrier of the rings as they are now; dead writers; lost ENDs."""
        out: list[Event] = []
        due: list[Assembly] = []
        for a in list(self._requests.values()):
            life = a.life
            if life.phase is Phase.ENDED and now >= life.since + self.end_grace_s:
                due.append(a)
            elif life.dead_at is not None and now >= life.dead_at + self.gone_grace_s:
                self._fail_groups(a, list(a.groups.values()), life.dead_reason)
                self._pump(a, now, out)
                if ENGINE_SOURCE in a.gone or a.sources <= a.gone or (a.lost and a.end is not None):
                    self._finish(a, now, out, life.dead_reason)
                else:
                    life.dead_at = None  # the engine lives on and will END it
            elif life.phase in NO_END:
                if life.phase is Phase.RUNNING and a.listed is False and self._last_live_at is not None:
                    # The latest LIVE left it out, and since then neither a record of it nor a LIVE
                    # naming it came: none will (the engine writes a LIVE about once a second).
                    quiet = max(self._last_live_at, a.last_record_at) + self.live_silence_s
                    if now >= quiet:
                        life.go(Happens.UNLISTED, quiet)
                elif life.phase is Phase.RUNNING and a.inherited and self._last_live_at is None:
                    # Its head went with a previous daemon, and no engine writes LIVE records here
                    # (vLLM is gone, its rings with it): quiet this long, it is as good as unlisted.
                    quiet = a.last_record_at + 2 * self.live_silence_s
                    if now >= quiet:
                        life.go(Happens.UNLISTED, quiet)
                if life.phase is Phase.END_LOST and now >= life.since + self.end_grace_s:
                    due.append(a)
        if due:
            b = Barrier(due)
            for a in due:
                a.life.go(Happens.GRACE, barrier=b)
            self._barriers.append(b)
        if self._barriers:
            out += self._pass_barriers(now)
        return out

    def _pass_barriers(self, now: float) -> list[Event]:
        """End the captures of every Barrier the daemon has read all rings up to (oldest first: a
        later Barrier is nowhere behind an earlier one)."""
        out: list[Event] = []
        read = self._read
        while self._barriers:
            b = self._barriers[0]
            cursors = b.cursors
            for ring, at in read.items():
                want = cursors.get(ring)
                if want is None or at < want:
                    return out
            self._barriers.popleft()
            for a in b.captures:
                if a.life.barrier is b and self._requests.get(a.request_id) is a:
                    self._settle(a, now, out)
        return out

    def _settle(self, a: Assembly, now: float, out: list[Event]) -> None:
        """Every ring was read past where it stood end_grace_s after the END (or after the END was
        declared lost): what the capture still misses will not come."""
        if a.life.phase is Phase.ENDED_WAITING:
            if a.met_half_way and not a.groups and not a.ready:
                self._finish(a, now, out, NOT_CAPTURED_PREVIOUS, Happens.BARRIER)  # its records went with a previous daemon
                return
            self._fail_groups(a, list(a.groups.values()), a.unfinished())
            # Holes below what came are resolved as ever (never computed; a head a previous daemon
            # read); what is left, past everything that came, is what nothing came for.
            self._pump(a, now, out)
            if self._requests.get(a.request_id) is a:
                self._finish(a, now, out, TIMEOUT, Happens.BARRIER)
        else:
            self.stats["ends_lost"] += 1
            log.warning("request %s: no END, and the engine no longer lists it as capturing: ended", a.request_id)
            self._finish(a, now, out, END_LOST, Happens.BARRIER)

    # -- handover (a graceful stop to the next daemon; the codec is daemon/handover.py) --

    def export_state(self, history: Callable[[str], list[Event]] = lambda rid: []) -> list[ho.InFlight]:
        """Every capture in flight: what was read of it and not delivered (metadata, held data), and
        what was delivered (history(request_id): the events filed for it)."""
        return [ho.export(a, history(a.request_id)) for a in self._requests.values()]

    def restore(self, captures: list[ho.InFlight], now: float) -> list[Event]:
        """Continue captures a previous daemon handed over: the positions it delivered come first (as it
        delivered them), then what it held, then what the rings bring."""
        out: list[Event] = []
        for c in captures:
            if c.request_id in self._requests:
                continue
            try:
                a, end, slices = ho.resume(c, self.instance, self.tally, now, self.alloc)
            except (ring_schema.Rejected, ValueError, KeyError, TypeError) as e:
                log.error("request %s: handed-over state unusable (%s); it continues as a capture never seen",
                          c.request_id, e)
                continue
            self._adopt(a, end, slices, now, out)
        return out

    def continue_filed(self, begin: Begin, history: list[Event], now: float,
                       end: ControlRecord | None = None) -> list[Event]:
        """A capture in flight that an earlier daemon run filed (`history`: its Begin, Tokens and Gaps,
        adopted from its journal, daemon/adoption.py) and whose rest is still to be read: records of
        it go on from where that history stops, and what lies between (read by that run and never
        filed) is a Gap NOT_CAPTURED_PREVIOUS, as for any head a previous daemon consumed. `end`:
        the END that run had read for it (its ring cursor is past it), taken as if read now. Emits
        only what that END brings (what it continues is filed already)."""
        out: list[Event] = []
        if begin.request_id in self._requests:
            return out
        a = Assembly(self.instance, begin.request_id, begin.tap_key, begin.num_prompt_tokens, begin.lazy, self.tally,
                     source=begin.source, inherited=True, hold=self.hold_newest)
        if begin.spec is not None:
            a.apply_spec(CaptureSpec.from_meta(begin.spec), begin.source)
        if not begin.lazy:
            a.begin = ring_schema.BeginMeta(num_prompt_tokens=begin.num_prompt_tokens,
                                            prompt_token_ids=begin.prompt_token_ids, n=begin.n, model=begin.model,
                                            source=begin.source)
        if a.start is None and begin.start_position is not None:
            a.set_start(begin.start_position)
        for ev in history[1:]:
            if type(ev) is Tokens:
                a.delivered += len(ev.positions)
                lo, hi = ev.start, ev.stop
            elif type(ev) is Gap:
                a.missing.append(ev.positions)
                lo, hi = ev.positions.start, ev.positions.stop
            else:
                continue
            if a.frontier is None:
                a.frontier = a.first_frontier = lo
                if a.start is None:
                    a.start = lo
            a.frontier = hi
            a.max_seen = max(a.max_seen, hi - 1)
        a.adopted = a.delivered
        a.resumed_at = a.frontier
        self._requests[a.request_id] = a
        self._finished.pop(a.request_id, None)
        a.last_record_at = now
        if end is not None:
            self._on_end(end, now, out)
        return out

    def _adopt(self, a: Assembly, end: ControlRecord | None, slices: list[Slice], now: float,
               out: list[Event]) -> None:
        self._requests[a.request_id] = a
        self._finished.pop(a.request_id, None)
        self.stats["requests_started"] += 1
        out.append(self._begin_event(a, now, update=False))
        if end is not None:
            a.end = end.control
            a.life.go(Happens.END_READ, now)
        a.last_record_at = now
        for r in slices:
            self._on_slice(r, now, out)
        if a.shed is not None and a.end is not None:
            self._finish(a, now, out, a.shed)
            return
        self._pump(a, now, out)

    # -- records by kind --

    def _new(self, r: ControlRecord | Slice, now: float, out: list[Event], lazy: bool) -> Assembly:
        self._finished.pop(r.request_id, None)
        a = Assembly(self.instance, r.request_id, r.tap_key, r.num_prompt_tokens, lazy, self.tally,
                     source=r.source or "client", inherited=lazy and r.ring in self._resumed, hold=self.hold_newest)
        self._requests[r.request_id] = a
        self.stats["requests_started"] += 1
        if not lazy:
            a.apply_begin(r)
        elif r.kind == rf.RecordKind.DATA:
            a.apply_table(r)
        elif r.kind == rf.RecordKind.END and r.spec is not None:
            a.apply_spec(r.spec, r.source)
        out.append(self._begin_event(a, now, update=False))
        return a

    def _touch(self, a: Assembly, now: float) -> None:
        """A record of it was read: whatever the LIVE records said, it is running."""
        a.records += 1
        a.last_record_at = now
        if a.live_absent or a.life.phase in _LOST:
            a.live_absent = 0
            a.life.go(Happens.RECORD)

    def _lazy(self, r: ControlRecord | Slice, now: float, out: list[Event]) -> Assembly | None:
        a = self._requests.get(r.request_id)
        if a is not None:
            return a
        if r.request_id in self._finished:
            self.stats["late_records"] += 1
            return None
        if self._replay and self._replayed(r):
            return None
        return self._new(r, now, out, lazy=True)

    def _arrived(self, r: ControlRecord | Slice, now: float, out: list[Event]) -> Assembly | None:
        """The capture a worker's record (DATA, DROP, SHED) is about, made if new and noted active;
        None when it already finished."""
        a = self._lazy(r, now, out)
        if a is not None:
            self._touch(a, now)
            a.sources.add(r.ring)
        return a

    def _begin_event(self, a: Assembly, now: float, update: bool) -> Begin:
        b = a.begin
        prompt = b.prompt_token_ids if b is not None else None
        return Begin(
            self.instance, a.request_id, a.tap_key, a.num_prompt_tokens,
            list(prompt) if prompt is not None else None, b.n if b is not None else 1, b.model if b is not None else "",
            a.spec.to_meta() if a.spec else None, a.start if a.start is not None else a.frontier,
            a.lazy, update, now, a.source, a.begin_at,
        )

    def _on_begin(self, r: ControlRecord, now: float, out: list[Event]) -> None:
        a = self._requests.get(r.request_id)
        if a is None:
            if self._replay and self._replayed(r):
                return
            if self._begun and self._begun.get((r.ring, r.epoch, r.cursor)) == r.request_id:
                self.stats["replayed_records"] += 1  # the BEGIN of a capture an earlier run finished
                return
            self._new(r, now, out, lazy=False)
        elif a.begin is None:
            self._touch(a, now)
            a.apply_begin(r)
            out.append(self._begin_event(a, now, update=True))
            self._pump(a, now, out)
        # else: a duplicate BEGIN; the first one stands

    @staticmethod
    def _seen(a: Assembly, positions: np.ndarray) -> None:
        t = top(positions)
        if t > a.max_seen:
            a.max_seen = t

    def _on_data(self, rec: DataRecord, now: float, out: list[Event]) -> None:
        """A DATA record (one rank's rows of one step for every capture in its table; or a run of
        decode steps joined, daemon/step_runs: the same events as its steps' records, in fewer
        Tokens). A capture whose step is all in this record of whole tensors and comes next (one rank,
        no step pending, positions consecutive from its frontier, before its END's stop) takes the
        direct way: its rows of each section become one Tokens span at once (views, no copy, no
        group), offered for delivery. Anything else goes its slices' way, step by step."""
        stats = self.stats
        stats["records"] += rec.n_slices
        requests = self._requests
        groups = rec.groups
        if not rec.whole:
            for i in range(len(groups)):
                for r in rec.slices(i):
                    self._on_slice(r, now, out)
            return
        nsec = len(rec.sections)
        steps = len(rec.steps) if rec.steps else 1
        names = named_sections(rec)
        if groups is ring_schema.one_row_each(len(groups)):
            # A decode step (row i is request i's): every row's views at once, not one slice each.
            starts = rec.positions.tolist()
            pos_rows = list(rec.positions[:, None])
            id_rows = list(rec.token_ids[:, None])
            sec_rows = [(name, list(x[:, None, :])) for name, x in names.items()]
        else:
            starts = None
        # One for the record, shared by its captures' spans (Reassembler.holds looks at each once).
        origin = (((rec.ring, rec.epoch), rec.cursor),) if rec.cursor >= 0 else ()
        for i, (slot, rows) in enumerate(groups):
            e = rec.entries[slot]
            a = requests.get(e.request_id)
            if (a is None or e.expected_ranks != 1 or e.rank_parts != nsec or a.groups or a.frontier is None
                    or a.shed is not None or a.cut is not None or a.tail
                    or (a.spec is None and a.start is None) or not (rows is None or type(rows) is slice)):
                for r in rec.slices(i):
                    self._on_slice(r, now, out)
                continue
            if starts is not None:
                n = 1
                p0 = starts[i]
            else:
                pos = rec.positions if rows is None else rec.positions[rows]
                n = len(pos)
                p0 = int(pos[0])
            if (p0 < a.frontier or (a.stop is not None and p0 + n > a.stop)
                    or (n > 1 and (int(pos[-1]) - p0 != n - 1 or not bool(np.all(np.diff(pos) == 1))))
                    or (a.ready and ordering.reaches(a, p0))):
                for r in rec.slices(i):  # a recompute, a duplicate, past the end, or positions out of order
                    self._on_slice(r, now, out)
                continue
            stats["direct"] += steps
            self._touch(a, now)
            a.sources.add(rec.ring)
            if a.num_prompt_tokens == 0:
                a.num_prompt_tokens = e.num_prompt_tokens
            if p0 + n - 1 > a.max_seen:
                a.max_seen = p0 + n - 1
            if starts is not None:
                pos, ids = pos_rows[i], id_rows[i]
                tensors = {name: rs[i] for name, rs in sec_rows}
            else:
                ids = rec.token_ids if rows is None else rec.token_ids[rows]
                tensors = {name: x if rows is None else x[rows] for name, x in names.items()}
            tok = new_tokens(self.instance, a.request_id, pos, ids, a.num_prompt_tokens or e.num_prompt_tokens,
                             tensors, names.dtypes, now, n * names.row_bytes)
            if delivery.offer(a, tok, p0, p0 + n, now, out, origin):
                self._finish(a, now, out, None)

    def _on_slice(self, r: Slice, now: float, out: list[Event]) -> None:
        """One capture's rows of one tensor from one rank: into its step group."""
        n = len(r.positions)
        if r.tensor is None or r.data is None or r.data.shape != (n, r.slice_stop - r.slice_start) or n == 0:
            self.stats["bad_records"] += 1
            log.warning("request %s: malformed DATA slice from %s ignored", r.request_id, r.ring)
            return
        a = self._arrived(r, now, out)
        if a is None:
            return
        if a.shed is not None:
            self.stats["shed_records"] += 1  # another rank admitted what one rank shed
            return
        if a.num_prompt_tokens == 0:
            a.num_prompt_tokens = r.num_prompt_tokens
        if a.spec is None and a.start is None and not a.tail:
            a.apply_table(r)
        if a.frontier is None and a.start is None and a.lazy and not a.tail:
            a.frontier = a.first_frontier = bottom(r.positions)  # capture starts at the first position seen
        if a.stop is not None and bottom(r.positions) >= a.stop:
            self.stats["past_end_records"] += 1  # computed after the end (async scheduling): never delivered
            return
        self._seen(a, r.positions)
        if a.cut is not None:
            self._add_missing(a, r.positions, a.cut)
            self._pump(a, now, out)
            return
        if a.resolved(r.positions):
            self.stats["duplicate_records"] += 1
            return
        g = a.groups.get(r.step)
        if g is None:
            g = a.groups[r.step] = StepGroup(r.step, max(r.expected_ranks, 1), r.positions, r.token_ids,
                                             r.num_prompt_tokens)
        elif not np.array_equal(g.positions, r.positions):
            self.stats["bad_records"] += 1
            log.warning("request %s step %d: records cover different positions; the step is missing",
                        a.request_id, r.step)
            self._fail_groups(a, [g], INCOMPLETE)
            self._pump(a, now, out)
            return
        a.account(g.add(r))
        if g.complete():
            self._take_group(a, g)
            self._complete(a, g, now)
            self._pump(a, now, out)

    def _on_drop(self, r: ControlRecord, now: float, out: list[Event]) -> None:
        a = self._arrived(r, now, out)
        if a is None or a.shed is not None:
            return
        positions = r.control.positions if r.control is not None else r.meta.get("positions", [])
        dropped = np.asarray(positions, np.int64)
        if not len(dropped):
            return
        if a.frontier is None and a.start is None and a.lazy and not a.tail:
            a.frontier = a.first_frontier = int(dropped.min())
        self._seen(a, dropped)
        lo, hi = int(dropped.min()), int(dropped.max()) + 1
        hit = [g for g in a.groups.values() if g.overlaps(lo, hi) and np.isin(g.positions, dropped).any()]
        self._fail_groups(a, hit, DROPPED)
        self._add_missing(a, dropped, DROPPED)
        self._pump(a, now, out)

    def _on_end(self, r: ControlRecord, now: float, out: list[Event]) -> None:
        a = self._requests.get(r.request_id)
        if a is None:
            if r.request_id in self._finished or (self._replay and self._replayed(r)):
                return
            a = self._new(r, now, out, lazy=True)
        if a.end is not None:
            return
        self._touch(a, now)
        m = r.control
        a.end = m
        a.life.go(Happens.END_READ, now)
        if not a.num_prompt_tokens:
            a.num_prompt_tokens = m.num_prompt_tokens
        if a.spec is None and r.spec is not None:
            a.apply_spec(r.spec, r.source)
        elif r.source and a.begin is None:
            a.source = r.source
        end = m.end_position
        if a.spec is not None:
            start, stop = a.spec.position_range(a.num_prompt_tokens, end)
        elif a.tail:
            start, stop = max(end - a.tail, 0), end
        else:
            # No spec: capture starts where the table said, else at the first position seen, which
            # is unknown until data comes (the engine ring is read first, so END often leads).
            start, stop = (a.start if a.start is not None else a.first_frontier), end
        a.stop = stop if start is None else max(stop, start)
        if start is not None:
            a.start = start
            if a.frontier is None or a.frontier < start:
                a.frontier = start
                if a.first_frontier is None:
                    a.first_frontier = start
        if a.shed is not None:
            self._finish(a, now, out, a.shed)
            return
        if a.lost and a.life.dead_at is None:  # a peer's ranks went while it ran: one more read, then it ends
            a.life.dead_at, a.life.dead_reason = now, a.lost
        self._pump(a, now, out)

    def _on_shed(self, r: ControlRecord, now: float, out: list[Event]) -> None:
        a = self._arrived(r, now, out)
        if a is None or a.shed is not None:
            return  # finished, or another rank shed it too
        if not a.num_prompt_tokens:
            a.num_prompt_tokens = r.num_prompt_tokens
        if a.spec is None and r.spec is not None:
            a.apply_spec(r.spec, r.source)
        a.shed = r.control.reason if r.control is not None and r.control.reason else OVERLOADED
        self.stats["captures_shed"] += 1
        # What other ranks wrote for it is discarded: one Gap covers the capture.
        for g in list(a.groups.values()):
            self._take_group(a, g)
        ordering.clear(a)
        if a.end is not None:
            self._finish(a, now, out, a.shed)

    def _on_live(self, r: ControlRecord, now: float) -> None:
        self.stats["live_records"] += 1
        if r.ring != ENGINE_SOURCE or r.control is None:
            return
        self._last_live_at = now
        live = set(r.control.requests)
        for a in self._requests.values():
            if a.life.phase is not Phase.RUNNING:
                continue  # its END was read, or it is already declared lost
            if a.request_id in live:
                a.listed = True
                a.live_absent = 0
                continue
            a.listed = False
            if a.live_absent and a.records != a.absent_mark:
                a.live_absent = 0  # it had a record since the first absence: start counting again
            if a.live_absent == 0:
                a.absent_mark = a.records
            a.live_absent += 1
            if a.live_absent >= 2:
                a.life.go(Happens.UNLISTED, now)

    # -- step groups --

    def _take_group(self, a: Assembly, g: StepGroup) -> None:
        if a.groups.get(g.step) is g:
            del a.groups[g.step]
            a.account(-g.nbytes)

    def _complete(self, a: Assembly, g: StepGroup, now: float) -> None:
        tiled = tile(a.request_id, g, self.alloc)
        if tiled is None:
            self._fail_groups(a, [g], INCOMPLETE)
            self._kill_stale(a, g)
            return
        tensors, dtypes = tiled
        num_prompt = a.num_prompt_tokens or g.num_prompt_tokens
        origin = g.origin()
        for start, stop, rows in runs(g.positions):
            if len(rows) == len(g.positions) and stop - start == len(rows) and rows[0] == 0:
                pos, ids, ts = g.positions, g.token_ids, tensors  # the common case: already in order
            else:
                pos, ids = g.positions[rows], g.token_ids[rows]
                ts = {k: np.ascontiguousarray(x[rows]) for k, x in tensors.items()}
            ordering.push(a, Span(start, stop, Tokens(self.instance, a.request_id, pos, ids, num_prompt, ts, dtypes,
                                                       now), origin=origin))
        self._kill_stale(a, g)

    def _kill_stale(self, a: Assembly, done: StepGroup) -> None:
        """Earlier groups that can no longer complete (every rank they wait on has moved past them)."""
        ranks = set(done.parts)
        stale = [g for g in a.groups.values()
                 if g.step < done.step and set(g.parts) <= ranks and len(ranks) >= g.expected_ranks]
        if stale:
            self._fail_groups(a, stale, a.unfinished())

    def _fail_groups(self, a: Assembly, groups: list[StepGroup], reason: str) -> None:
        for g in groups:
            self._take_group(a, g)
            self._add_missing(a, g.positions, reason)

    @staticmethod
    def _add_missing(a: Assembly, positions: Any, reason: str) -> None:
        ps = np.asarray(positions, np.int64)
        if a.frontier is not None:
            ps = ps[ps >= a.frontier]
        for lo, hi in PositionRanges.of(ps).ranges:
            ordering.push(a, Span(lo, hi, None, reason))

    # -- delivery --

    def _pump(self, a: Assembly, now: float, out: list[Event], force_reason: str | None = None) -> None:
        if delivery.pump(a, now, out, force_reason):
            self._finish(a, now, out, None)

    def _finish(self, a: Assembly, now: float, out: list[Event], force_reason: str | None,
                happens: Happens = Happens.FINISH) -> None:
        if self._requests.get(a.request_id) is not a:
            return
        if force_reason is not None:
            gap_reason = a.shed or force_reason  # a shed capture's positions are missing for that reason
            self._fail_groups(a, list(a.groups.values()), gap_reason)
            if a.stop is None:  # no END: the expected positions end where capture got to
                top_ = max((s.stop for _, _, _, s in a.ready), default=a.frontier or 0)
                a.stop = max(top_, a.frontier or 0)
                if a.tail and a.start is None and a.ready:
                    # A tail capture without its END: keep the last `tail` positions it reached.
                    a.set_start(max(min(s.start for _, _, _, s in a.ready), a.stop - a.tail))
                    a.frontier = a.start
            delivery.pump(a, now, out, gap_reason)
        a.life.go(happens)
        del self._requests[a.request_id]
        a.account(-a.nbytes)
        a.ready = []
        self._finished[a.request_id] = None
        while len(self._finished) > self._finished_memory:
            self._finished.popitem(last=False)
        self.stats["requests_finished"] += 1
        out.append(delivery.end_event(a, now, force_reason))

