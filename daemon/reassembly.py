"""Reassembly of ring records into ordered per-request events: a pure state machine (no IO).

The daemon feeds every record it reads, from all rings of one engine instance, in whatever order it
reads them; out come events per request: Begin, then Tokens and Gap covering every expected
position exactly once in increasing order, then End. Nothing here reads a clock, a socket or a
file: time comes in as `now`, so tests drive it deterministically.

How records become tokens (the record contract, see ring_format / hooks):
- DATA records of one (request, step) form a group. It is complete when `expected_ranks` distinct
  ranks have each delivered their `rank_parts` records. Then, per tensor, the slices of the last
  dimension must tile [0, full_dim) exactly; if they do not, the group's positions are missing. A
  wrong concatenation is never delivered.
- Rings are FIFO per writer and every rank writes steps in order. So once a later group of a
  request completes, an earlier group whose ranks all took part in the later one can no longer
  complete (its missing parts were dropped or consumed by a previous daemon), and positions below a
  completed group that no pending group covers were never computed: both become gaps at once
  instead of waiting for the end.
- Positions at or below what was already delivered (preemption recomputes them) are dropped.

Rules for what is expected and when a capture ends:
- Where a capture starts is known from its BEGIN (the spec), or from any DATA record's request table
  (`start`), so a daemon that missed the BEGIN (restarted) still reports the head it never saw as a
  Gap, in order, before any data. A tail capture (`tail` N > 0: the last N computed positions)
  holds the newest N positions until the END says where the request stopped.
- Async scheduling can compute a request one step past its end. Positions at or past the END's
  end_position are never delivered: the newest output position of a capture is held back until a
  later one is seen or the END comes (HOLD_NEWEST). Prompt positions are never past the end, and
  nothing is held when the BEGIN says the engine does not schedule asynchronously.
- A capture a worker did not admit (a SHED record from any of its ranks: the daemon was behind, see
  hooks/admission.py) is delivered as one Gap over its expected positions, with the SHED's reason
  (`overloaded`), once its END says where it stops; whatever other ranks wrote for it is discarded
  (without the shedding rank's records none of its steps could complete).
- Every capture ends: by its END, by its writer's death (after gone_grace_s, once the dead ring is
  drained), by the engine's LIVE records no longer naming it (END lost), by a malformed record
  naming it, or by the daemon cutting it to stay inside its memory budget. The End says which;
  `complete` holds only when the END was seen and no expected position is missing.
- A capture with its END ends as soon as every expected position is resolved. One that still misses
  positions waits for its data, not for a clock: the END is read from the engine's small ring at
  once, the data from the workers' rings, maybe long after (the daemon is behind). end_grace_s after
  the END was read (daemon time), the capture joins a Barrier: where every worker ring's writer had
  got to then (the daemon reports each ring's write cursor as it polls, `ring_read`). Once the daemon
  has read every ring that far, nothing more of the capture can come (a writer commits a step's
  records before the engine ENDs it; the grace covers records committed a little later, a GPU's
  copies), and what is missing becomes Gaps: `incomplete` for steps some of whose records came and
  others did not (for a capture met half way after a restart, the other records of its first steps
  went with the previous daemon: NOT_CAPTURED_PREVIOUS), holes below what came as ever, `timeout`
  past everything that came. A capture whose END is lost (the LIVE rule) waits the same
  way before it ends `end lost`. Each ring is at most its capacity ahead of the daemon, and a ring
  that is closed (replaced, broken) stops counting (`ring_closed`), so every Barrier is passed.
- Missing positions are kept as ranges, never as lists of positions: one far-off position costs
  one range, not memory in proportion to the distance.
- Bytes held here (pending groups, ready chunks) are counted per request and in `held_bytes`, so
  the daemon can keep all captures in flight inside a budget.

A DATA record of whole tensors may come read whole (a DataBatch: the daemon's ring reader): a
capture whose step is all in it and comes next in order takes a direct way, its rows of each
tensor delivered as one Tokens chunk of views into the record's buffer, with no group; anything
else is fed as the record's single records would be. Either way the events are the same.

Where arrays live (the one copy): the reassembler is given an allocator (`alloc(shape, dtype) ->
array | None`, the daemon's delivery arena; None here means numpy's heap). Before a DATA record's
payload is read, the ring reader asks `target()` where its rows go: a whole tensor gets an array
of its own; a tensor-parallel slice gets its columns of one [rows, full_dim] array shared by the
step's slices, so reading the slices assembles the tensor and _complete has nothing to
concatenate. Only if the slices turn out not to tile that array (a duplicate of other rows, a
rank that sent other positions) is the tensor concatenated, as before. The allocator is an
interface: no IO happens here.
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Union

import numpy as np

from vllm_tap import ring_schema
from vllm_tap import ring_format as rf
from vllm_tap.positions import PositionRanges
from vllm_tap.ring_records import DataBatch, RingRecord, TensorId
from vllm_tap.spec import CaptureSpec

from . import handover as ho

log = logging.getLogger(__name__)

ENGINE_SOURCE = "engine" + rf.RING_SUFFIX  # the engine ring's name: its writer carries the ENDs

# Why positions are missing (Gap.reason), and why a capture ended without its END (End.reason).
DROPPED = "dropped"  # the writer's ring was full
INCOMPLETE = "incomplete"  # some rank's slice never arrived, or the slices did not tile the tensor
NOT_CAPTURED = "not captured"  # never written (e.g. cached prefix)
NOT_CAPTURED_PREVIOUS = "not captured: consumed by a previous daemon"  # read by the daemon before a restart
TIMEOUT = "timeout"  # past all that came, and not in any ring read up to where it was end_grace_s after the END
WRITER_GONE = "writer gone"  # the ring's writer died
RING_BROKEN = "ring broken"  # the ring file changed under the daemon (truncated, grown): no longer read
END_LOST = "end lost"  # the engine stopped naming the request in its LIVE records and no END came
MALFORMED = "malformed record"  # a record of the capture did not fit the ring schema
OVER_BUDGET = "over budget"  # the daemon's in-flight memory budget (inflight_bytes) was exceeded
OVERLOADED = rf.SHED_OVERLOADED  # a worker shed the capture: its ring was over the shed threshold

# The reasons gap_positions counts by name; any other (a SHED record's own text) counts as OTHER.
GAP_REASONS = (DROPPED, OVERLOADED, INCOMPLETE, NOT_CAPTURED, NOT_CAPTURED_PREVIOUS, TIMEOUT, WRITER_GONE, RING_BROKEN,
               END_LOST, MALFORMED, OVER_BUDGET)
OTHER = "other"

Alloc = Callable[[tuple[int, int], Any], "np.ndarray | None"]  # (shape, dtype) -> array, None: use the heap
MAX_TARGETS = 1 << 16  # tensor-parallel targets waiting for their other slices, at most

HOLD_NEWEST = 1  # output positions held back until a later one is seen or the END comes (async scheduling)
LIVE_SILENCE_S = 3.0  # left out of the latest LIVE, then nothing about it for this long: as good as two absences
GONE_GRACE_S = 0.25  # after a dead writer's ring is drained: one more read of the other rings


# -- events --


@dataclass(frozen=True)
class Begin:
    instance: str
    request_id: str
    tap_key: str
    num_prompt_tokens: int
    prompt_token_ids: list[int] | None
    n: int  # samples per prompt (for the choice index)
    model: str
    spec: dict[str, Any] | None  # CaptureSpec.to_meta(), None when no BEGIN was seen
    start_position: int | None  # first position to be captured, None while unknown
    lazy: bool  # made from a DATA/DROP/END record because the BEGIN was not seen
    update: bool  # a late BEGIN completing the metadata of a lazily made request
    at: float
    source: str = "client"  # "client" (the request opted in) or "policy" (the server's capture policy)

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.request_id)


@dataclass(frozen=True, eq=False)
class Tokens:
    """Consecutive positions of one request with every captured tensor, [n, full_dim] each.

    Arrays are in the ring's storage dtype (bfloat16 as uint16; `dtypes` holds the DType codes)
    and, when one record carried a whole tensor, views of that record's array (no copy).
    """

    instance: str
    request_id: str
    positions: np.ndarray  # int32 [n], consecutive
    token_ids: np.ndarray  # int32 [n]
    num_prompt_tokens: int
    tensors: dict[str, np.ndarray]
    dtypes: dict[str, int]
    at: float  # `now` of the feed that completed it (the ring read), for delivery latency

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.request_id)

    @property
    def start(self) -> int:
        return int(self.positions[0])

    @property
    def stop(self) -> int:
        return int(self.positions[-1]) + 1

    @functools.cached_property
    def nbytes(self) -> int:  # asked several times per event (budgets, retention): computed once
        return sum(a.nbytes for a in self.tensors.values()) + self.positions.nbytes + self.token_ids.nbytes

    def cut(self, from_position: int) -> "Tokens":
        """The part at or after from_position (views)."""
        k = max(0, from_position - self.start)
        if k == 0:
            return self
        return Tokens(self.instance, self.request_id, self.positions[k:], self.token_ids[k:],
                      self.num_prompt_tokens, {n: a[k:] for n, a in self.tensors.items()}, self.dtypes, self.at)

    def head(self, stop: int) -> "Tokens":
        """The part before stop (views)."""
        k = max(0, stop - self.start)
        return Tokens(self.instance, self.request_id, self.positions[:k], self.token_ids[:k], self.num_prompt_tokens,
                      {n: a[:k] for n, a in self.tensors.items()}, self.dtypes, self.at)


@dataclass(frozen=True)
class Gap:
    instance: str
    request_id: str
    positions: range  # consecutive
    reason: str
    at: float

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.request_id)


@dataclass(frozen=True)
class End:
    instance: str
    request_id: str
    reason: str  # the engine's finish reason; without an END: WRITER_GONE, END_LOST, MALFORMED
    num_prompt_tokens: int
    num_output_tokens: int
    output_token_ids: list[int]
    end_position: int | None  # the model computed positions [0, end_position); None: no END was seen
    expected: tuple[int, int] | None  # [start, stop) of positions that should have been captured
    missing_positions: PositionRanges | list[int]  # every expected position not delivered, as ranges
    delivered: int  # positions delivered
    at: float
    source: str = "client"

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.request_id)

    @property
    def complete(self) -> bool:
        """The END was seen and every expected position was delivered."""
        return self.end_position is not None and not self.missing_positions


Event = Union[Begin, Tokens, Gap, End]


# -- internal state --


_NAMES: dict[TensorId, str] = {}


def _tensor_name(tid: TensorId) -> str:
    name = _NAMES.get(tid)
    if name is None:
        name = _NAMES[tid] = tid.name
    return name


class _Named(dict):
    """A batch's sections by tensor name, in the order single records assemble them, with their
    DType codes (one dict, shared by the batch's Tokens)."""

    dtypes: dict[str, int]
    row_bytes: int  # one position's bytes: every tensor's row, its position and its token id


def batch_names(batch: DataBatch) -> _Named:
    named = _Named()
    named.dtypes = {}
    named.row_bytes = batch.positions.itemsize + batch.token_ids.itemsize
    for tid, dtype, a in sorted(batch.sections, key=lambda s: (s[0].kind, s[0].layer)):
        name = _tensor_name(tid)
        named[name] = a
        named.dtypes[name] = dtype
        named.row_bytes += a.shape[1] * a.itemsize
    return named


def _new_tokens(instance: str, request_id: str, positions: np.ndarray, token_ids: np.ndarray, num_prompt_tokens: int,
                tensors: dict[str, np.ndarray], dtypes: dict[str, int], at: float, nbytes: int) -> Tokens:
    """Tokens(...) without the frozen dataclass's per-field setattr (once per request and step on the
    daemon's hot path), its nbytes known beforehand."""
    t = object.__new__(Tokens)
    t.__dict__.update(instance=instance, request_id=request_id, positions=positions, token_ids=token_ids,
                      num_prompt_tokens=num_prompt_tokens, tensors=tensors, dtypes=dtypes, at=at, nbytes=nbytes)
    return t


def _overlaps_ready(req: _Request, p0: int) -> bool:
    """A chunk waiting for delivery reaches p0 or past it."""
    for item in req.ready:
        if item[3].stop > p0:
            return True
    return False


def _record_bytes(r: RingRecord) -> int:
    return (r.data.nbytes if r.data is not None else 0) + r.positions.nbytes + r.token_ids.nbytes


@dataclass
class _Group:
    """The records of one (request, step) seen so far."""

    step: int
    expected_ranks: int
    positions: np.ndarray
    token_ids: np.ndarray
    num_prompt_tokens: int
    parts: dict[int, dict[tuple, RingRecord]] = field(default_factory=dict)  # rank -> slice key -> record
    wanted: dict[int, int] = field(default_factory=dict)  # rank -> rank_parts
    nbytes: int = 0

    def add(self, r: RingRecord) -> int:
        """Add a record; returns the change in bytes held."""
        assert r.tensor is not None
        # Keyed by slice so a duplicate record replaces rather than double-counts.
        recs = self.parts.setdefault(r.rank, {})
        k = (r.tensor, r.slice_start, r.slice_stop)
        old = recs.get(k)
        recs[k] = r
        self.wanted[r.rank] = max(r.rank_parts, 1)
        delta = _record_bytes(r) - (_record_bytes(old) if old is not None else 0)
        self.nbytes += delta
        return delta

    def complete(self) -> bool:
        done = sum(1 for rank, recs in self.parts.items() if len(recs) >= self.wanted[rank])
        return done >= self.expected_ranks

    def overlaps(self, lo: int, hi: int) -> bool:
        return bool(np.any((self.positions >= lo) & (self.positions < hi)))


@dataclass
class _Chunk:
    """Consecutive positions [start, stop) ready for delivery: data, or missing with a reason."""

    start: int
    stop: int
    tokens: Tokens | None = None
    reason: str = ""

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes if self.tokens is not None else 0


@dataclass(eq=False)
class _Barrier:
    """Where each worker ring's writer had got to at one moment (a tick): the captures waiting on it
    end once the daemon has read every ring that far. A ring's cursor is the first one the daemon
    reports after the Barrier was made (so it is at or past that moment), and a ring closed meanwhile
    no longer counts."""

    requests: list["_Request"]
    cursors: dict[str, int] = field(default_factory=dict)  # ring -> write cursor


@dataclass
class _Request:
    request_id: str
    tap_key: str
    num_prompt_tokens: int
    lazy: bool
    source: str = "client"
    begin: Any = None  # ring_schema.BeginMeta, once a BEGIN was seen
    spec: CaptureSpec | None = None
    tail: int = 0  # N > 0: the capture is the last N computed positions
    start: int | None = None  # first expected position, if known
    frontier: int | None = None  # next position to deliver
    first_frontier: int | None = None  # where delivery started (for End's missing ranges)
    groups: dict[int, _Group] = field(default_factory=dict)
    ready: list[tuple[int, int, int, _Chunk]] = field(default_factory=list)  # heap
    missing: list[range] = field(default_factory=list)
    delivered: int = 0
    sources: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)
    dead_at: float | None = None
    dead_reason: str = WRITER_GONE
    end: Any = None  # ring_schema.EndMeta, once the END was seen
    end_at: float | None = None
    stop: int | None = None  # expected stop, known at END
    max_seen: int = -1  # highest position any record of it carried
    nbytes: int = 0  # held here: pending groups and ready chunks
    inherited: bool = False  # first seen in a ring that a previous daemon had been reading
    records: int = 0  # records seen (activity, for the LIVE rule)
    live_absent: int = 0  # successive LIVE records without it, with no record of it since the first
    absent_mark: int = 0  # `records` at the first of those
    listed: bool | None = None  # whether the latest LIVE record named it (None: no LIVE seen yet)
    last_record_at: float = 0.0
    lost_at: float | None = None  # when the LIVE rule declared its END lost
    barrier: "_Barrier | None" = None  # the rings' read cursors it waits for before it ends (END, or END lost)
    cut: str | None = None  # why its data is no longer kept (over budget)
    shed: str | None = None  # why a worker did not admit it (a SHED record): delivered as one Gap
    hold: int = HOLD_NEWEST  # output positions held back (0 when the BEGIN says the engine is not async)

    def resolved(self, positions: np.ndarray) -> bool:
        """Every position already delivered or waiting in `ready` (a duplicate or recompute)."""
        if self.frontier is None:
            return False
        if _top(positions) < self.frontier:
            return True
        rest = positions[positions >= self.frontier]
        for _, _, _, ch in self.ready:
            rest = rest[(rest < ch.start) | (rest >= ch.stop)]
            if not len(rest):
                return True
        return False


def _runs(positions: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """(start, stop, row indices) of each consecutive run of the sorted unique positions."""
    n = len(positions)
    if n == 1 or (n and int(positions[-1]) - int(positions[0]) == n - 1 and np.all(np.diff(positions) == 1)):
        return [(int(positions[0]), int(positions[-1]) + 1, np.arange(n))]
    order = np.argsort(positions, kind="stable")
    sp = positions[order]
    keep = np.ones(len(sp), bool)
    keep[1:] = sp[1:] != sp[:-1]
    order, sp = order[keep], sp[keep]
    cuts = np.flatnonzero(np.diff(sp) != 1) + 1
    return [(int(s[0]), int(s[-1]) + 1, o) for s, o in zip(np.split(sp, cuts), np.split(order, cuts)) if len(s)]


class Reassembler:
    """Per-request reassembly for the rings of one engine instance."""

    def __init__(self, instance: str = "default", *, end_grace_s: float = 5.0, gone_grace_s: float = GONE_GRACE_S,
                 finished_memory: int = 65536, hold_newest: int = HOLD_NEWEST, live_silence_s: float = LIVE_SILENCE_S,
                 alloc: Alloc | None = None):
        self.instance = instance
        self.alloc = alloc
        # (request id, step, tensor) -> the [rows, full_dim] array its slices are read into
        self._targets: OrderedDict[tuple[str, int, TensorId], np.ndarray] = OrderedDict()
        self.end_grace_s = end_grace_s
        self.gone_grace_s = min(gone_grace_s, end_grace_s)
        self.hold_newest = hold_newest
        self.live_silence_s = live_silence_s
        self._requests: dict[str, _Request] = {}
        # Ids recently finished, so records straggling in after the End do not start a new capture.
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._finished_memory = finished_memory
        self._seq = itertools.count()
        self._resumed: set[str] = set()  # rings a previous daemon had been reading
        self._last_live_at: float | None = None
        self._read: dict[str, int] = {}  # worker ring -> its read cursor, as the daemon last reported it
        self._barriers: collections.deque[_Barrier] = collections.deque()  # oldest first
        self.held_bytes = 0
        self.gap_positions: dict[str, int] = {}  # reason (GAP_REASONS, OTHER) -> positions delivered as gaps
        self.stats = {"records": 0, "late_records": 0, "duplicate_records": 0, "bad_records": 0,
                      "past_end_records": 0, "rejected_records": 0, "requests_started": 0, "requests_finished": 0,
                      "missing_positions": 0, "live_records": 0, "ends_lost": 0, "captures_cut": 0,
                      "captures_shed": 0, "shed_records": 0,
                      "direct": 0}  # (capture, record) pairs of whole records delivered the direct way (feed_batch)

    # -- inspection --

    def in_flight(self) -> int:
        return len(self._requests)

    def requests(self) -> list[dict[str, Any]]:
        return [
            {"instance": self.instance, "request_id": r.request_id, "frontier": r.frontier,
             "pending_groups": len(r.groups), "delivered": r.delivered, "held_bytes": r.nbytes,
             "missing": sum(len(m) for m in r.missing), "ended": r.end is not None, "source": r.source,
             "waiting_for_rings": r.barrier is not None}
            for r in self._requests.values()
        ]

    def waiting_for_rings(self) -> int:
        """Captures that end once the daemon has read their rings up to a Barrier."""
        return sum(1 for r in self._requests.values() if r.barrier is not None)

    def request_bytes(self) -> Iterable[tuple[str, int]]:
        """(request id, bytes held here) of every capture in flight."""
        return ((rid, r.nbytes) for rid, r in self._requests.items())

    # -- inputs --

    def resumed_ring(self, ring: str) -> None:
        """`ring` was being read by a previous daemon: captures first seen in it may have lost their head to it."""
        self._resumed.add(ring)

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
        for b in self._barriers:
            b.cursors.pop(ring, None)
        return self._pass_barriers(now)

    def target(self, request_id: str, step: int, tensor: TensorId, slice_start: int, slice_stop: int, full_dim: int,
               rows: int, dtype: Any) -> np.ndarray | None:
        """Where the rows of a DATA record go before it is read ([rows, slice_stop - slice_start]),
        or None for a private array: a whole tensor gets its own array from the allocator; a slice,
        its columns of the array shared by the step's slices of that tensor."""
        if self.alloc is None or request_id in self._finished:
            return None
        if slice_start == 0 and slice_stop == full_dim:
            return self.alloc((rows, full_dim), dtype)
        key = (request_id, step, tensor)
        t = self._targets.get(key)
        if t is None or t.shape != (rows, full_dim) or t.dtype != dtype:
            t = self.alloc((rows, full_dim), dtype)
            if t is None:
                return None
            self._targets[key] = t
            if len(self._targets) > MAX_TARGETS:  # slices that never completed (their requests are gone)
                self._targets.popitem(last=False)
        return t[:, slice_start:slice_stop]

    def feed(self, record: RingRecord, now: float) -> list[Event]:
        out: list[Event] = []
        self.stats["records"] += 1
        kind = record.kind
        if kind == rf.RecordKind.DATA:
            self._on_data(record, now, out)
        elif kind == rf.RecordKind.BEGIN:
            self._on_begin(record, now, out)
        elif kind == rf.RecordKind.END:
            self._on_end(record, now, out)
        elif kind == rf.RecordKind.DROP:
            self._on_drop(record, now, out)
        elif kind == rf.RecordKind.LIVE:
            self._on_live(record, now)
        elif kind == rf.RecordKind.SHED:
            self._on_shed(record, now, out)
        return out

    def feed_batch(self, batch: DataBatch, now: float) -> list[Event]:
        """A DATA record read whole, or a run of decode steps joined (daemon/step_runs): the same
        events as feeding batch.records(i) for every group, in table order (for a run, the same
        positions and values in fewer Tokens). A capture whose step is all in this record and comes
        next (one rank, no step pending, positions consecutive from its frontier, before its END's
        stop) takes the direct way: its rows of each section become one Tokens chunk at once (views,
        no copy, no group). Anything else takes the way of single records, step by step."""
        out: list[Event] = []
        nsec = len(batch.sections)
        stats = self.stats
        stats["records"] += batch.parts
        steps = len(batch.steps) if batch.steps else 1
        names = batch_names(batch)
        requests = self._requests
        groups = batch.groups
        if groups is ring_schema.one_row_each(len(groups)):
            # A decode step (row i is request i's): every row's views at once, not one slice each.
            starts = batch.positions.tolist()
            pos_rows = list(batch.positions[:, None])
            id_rows = list(batch.token_ids[:, None])
            sec_rows = [(name, list(a[:, None, :])) for name, a in names.items()]
        else:
            starts = None
        for i, (slot, rows) in enumerate(groups):
            e = batch.entries[slot]
            req = requests.get(e.request_id)
            if (req is None or e.expected_ranks != 1 or e.rank_parts != nsec or req.groups or req.frontier is None
                    or req.shed is not None or req.cut is not None or req.tail
                    or (req.spec is None and req.start is None) or not (rows is None or type(rows) is slice)):
                for r in batch.records(i):
                    self._on_data(r, now, out)
                continue
            if starts is not None:
                n = 1
                p0 = starts[i]
            else:
                pos = batch.positions if rows is None else batch.positions[rows]
                n = len(pos)
                p0 = int(pos[0])
            if (p0 < req.frontier or (req.stop is not None and p0 + n > req.stop)
                    or (n > 1 and (int(pos[-1]) - p0 != n - 1 or not bool(np.all(np.diff(pos) == 1))))
                    or (req.ready and _overlaps_ready(req, p0))):
                for r in batch.records(i):  # a recompute, a duplicate, past the end, or positions out of order
                    self._on_data(r, now, out)
                continue
            stats["direct"] += steps
            req.records += 1
            req.last_record_at = now
            if req.live_absent or req.lost_at is not None:
                self._revive(req)
            req.sources.add(batch.ring)
            if req.num_prompt_tokens == 0:
                req.num_prompt_tokens = e.num_prompt_tokens
            if p0 + n - 1 > req.max_seen:
                req.max_seen = p0 + n - 1
            if starts is not None:
                pos, ids = pos_rows[i], id_rows[i]
                tensors = {name: rs[i] for name, rs in sec_rows}
            else:
                ids = batch.token_ids if rows is None else batch.token_ids[rows]
                tensors = {name: a if rows is None else a[rows] for name, a in names.items()}
            tok = _new_tokens(self.instance, req.request_id, pos, ids, req.num_prompt_tokens or e.num_prompt_tokens,
                              tensors, names.dtypes, now, n * names.row_bytes)
            if not self._in_order(req, tok, p0, n, now, out):
                self._push(req, _Chunk(p0, p0 + n, tok))
                self._pump(req, now, out)
        return out

    def _in_order(self, req: _Request, tok: Tokens, p0: int, n: int, now: float, out: list[Event]) -> bool:
        """What _push then _pump would do with the next chunk of a capture, done directly in the two
        cases of every decode step: nothing waits and the chunk goes out (no position held back),
        or the one chunk held back (HOLD_NEWEST) goes out and this one is held in its place.
        False: neither case; nothing was done."""
        lim = self._limit(req)
        ready = req.ready
        if not ready:
            if p0 != req.frontier or (lim is not None and p0 + n > lim):
                return False
            req.delivered += n
            req.frontier = p0 + n
            out.append(tok)
            if req.stop is not None and req.frontier >= req.stop:
                self._finish(req, now, out, None)
            return True
        if len(ready) != 1 or req.stop is not None or lim is None:
            return False
        held = ready[0][3]
        if held.tokens is None or held.start != req.frontier or held.stop != p0 or not held.stop <= lim <= p0:
            return False
        ready[0] = (p0, 0, next(self._seq), _Chunk(p0, p0 + n, tok))  # a heap of one
        self._account(req, tok.nbytes - held.tokens.nbytes)
        req.delivered += held.stop - held.start
        req.frontier = held.stop
        out.append(held.tokens)
        return True

    def reject(self, request_ids: Iterable[str], why: str, now: float) -> list[Event]:
        """A record naming these requests did not fit the schema: end them, saying so."""
        out: list[Event] = []
        self.stats["rejected_records"] += 1
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is None:
                if rid in self._finished:
                    continue
                req = self._new_request(RingRecord(kind=rf.RecordKind.BEGIN, request_id=rid), now, out, lazy=True)
            log.warning("request %s: ended, a record of it was malformed (%s)", rid, why)
            self._finish(req, now, out, MALFORMED)
        return out

    def cut(self, request_id: str, now: float, reason: str = OVER_BUDGET) -> list[Event]:
        """Stop keeping the data of a capture in flight: what is held and what comes later become gaps."""
        out: list[Event] = []
        req = self._requests.get(request_id)
        if req is None or req.cut is not None:
            return out
        req.cut = reason
        self.stats["captures_cut"] += 1
        self._fail_groups(req, list(req.groups.values()), reason)
        kept = []
        for item in req.ready:
            ch = item[3]
            if ch.tokens is not None:
                self._account(req, -ch.nbytes)
                ch = _Chunk(ch.start, ch.stop, None, reason)
            kept.append((ch.start, 1, item[2], ch))
        heapq.heapify(kept)
        req.ready = kept
        self._pump(req, now, out)
        return out

    def tick(self, now: float) -> list[Event]:
        """Resolve what time decides: captures past their END's grace (or declared END lost) join a
        Barrier of the rings as they are now; dead writers; lost ENDs."""
        out: list[Event] = []
        due: list[_Request] = []
        for req in list(self._requests.values()):
            if req.end_at is not None and req.barrier is None and now >= req.end_at + self.end_grace_s:
                due.append(req)
            elif req.dead_at is not None and now >= req.dead_at + self.gone_grace_s:
                self._fail_groups(req, list(req.groups.values()), req.dead_reason)
                self._pump(req, now, out)
                if ENGINE_SOURCE in req.gone or req.sources <= req.gone:
                    self._finish(req, now, out, req.dead_reason)
                else:
                    req.dead_at = None  # the engine lives on and will END it
            elif req.end is None:
                if req.lost_at is None and req.listed is False and self._last_live_at is not None:
                    # The latest LIVE left it out, and since then neither a record of it nor a LIVE
                    # naming it came: none will (the engine writes a LIVE about once a second).
                    quiet = max(self._last_live_at, req.last_record_at) + self.live_silence_s
                    if now >= quiet:
                        req.lost_at = quiet
                elif req.lost_at is None and req.inherited and self._last_live_at is None:
                    # Its head went with a previous daemon, and no engine writes LIVE records here
                    # (vLLM is gone, its rings with it): quiet this long, it is as good as unlisted.
                    quiet = req.last_record_at + 2 * self.live_silence_s
                    if now >= quiet:
                        req.lost_at = quiet
                if req.lost_at is not None and req.barrier is None and now >= req.lost_at + self.end_grace_s:
                    due.append(req)
        if due:
            b = _Barrier(due)
            for req in due:
                req.barrier = b
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
            for req in b.requests:
                if req.barrier is b and self._requests.get(req.request_id) is req:
                    req.barrier = None
                    self._settle(req, now, out)
        return out

    def _settle(self, req: _Request, now: float, out: list[Event]) -> None:
        """Every ring was read past where it stood end_grace_s after the END (or after the END was
        declared lost): what the capture still misses will not come."""
        if req.end is not None:
            if req.inherited and not req.delivered and not req.groups and not req.ready:
                self._finish(req, now, out, NOT_CAPTURED_PREVIOUS)  # its records went with a previous daemon
                return
            self._fail_groups(req, list(req.groups.values()), _unfinished(req))
            # Holes below what came are resolved as ever (never computed; a head a previous daemon
            # read); what is left, past everything that came, is what nothing came for.
            self._pump(req, now, out)
            if self._requests.get(req.request_id) is req:
                self._finish(req, now, out, TIMEOUT)
        elif req.lost_at is not None:
            self.stats["ends_lost"] += 1
            log.warning("request %s: no END, and the engine no longer lists it as capturing: ended", req.request_id)
            self._finish(req, now, out, END_LOST)

    def writer_gone(self, source: str, now: float, reason: str = WRITER_GONE) -> list[Event]:
        """The writer of ring `source` died or was replaced, and its ring was drained (or the ring
        broke, `reason`): what waits on it is resolved after gone_grace_s (one more read of the
        other rings)."""
        for req in self._requests.values():
            if source == ENGINE_SOURCE or source in req.sources:
                req.gone.add(source)
                if req.dead_at is None:
                    req.dead_at = now
                    req.dead_reason = reason
        return []

    # -- handover (a graceful stop to the next daemon, daemon/handover.py) --

    def export_state(self) -> list[ho.Capture]:
        """Every capture in flight: what was read of it and not delivered (metadata, held data)."""
        return [_export(req) for req in self._requests.values()]

    def restore(self, captures: list[ho.Capture], now: float) -> list[Event]:
        """Continue captures a previous daemon handed over: the positions it delivered come first as
        one Gap NOT_CAPTURED_PREVIOUS, then what it held, then what the rings bring."""
        out: list[Event] = []
        for c in captures:
            if c.request_id in self._requests:
                continue
            try:
                self._restore(c, now, out)
            except (ring_schema.Rejected, ValueError, KeyError, TypeError) as e:
                log.error("request %s: handed-over state unusable (%s); it continues as a capture never seen",
                          c.request_id, e)
                self._requests.pop(c.request_id, None)
        return out

    def _restore(self, c: ho.Capture, now: float, out: list[Event]) -> None:
        begin = ring_schema.control_record(rf.RecordKind.BEGIN, c.request_id, c.begin, tap_key=c.tap_key) \
            if c.begin is not None else None
        end = ring_schema.control_record(rf.RecordKind.END, c.request_id, c.end, tap_key=c.tap_key) \
            if c.end is not None else None
        req = _Request(c.request_id, c.tap_key, c.num_prompt_tokens, c.lazy, source=c.source, inherited=True,
                       hold=c.hold, tail=c.tail, max_seen=c.max_seen, sources=set(c.sources), cut=c.cut,
                       shed=c.shed)
        if begin is not None:
            self._apply_begin(req, begin)
        if c.spec is not None and req.spec is None:
            self._apply_spec(req, CaptureSpec.from_meta(c.spec), c.source)
        req.source = c.source
        start = c.start if c.start is not None else c.frontier
        if start is not None:
            req.start = req.frontier = req.first_frontier = start
            if c.frontier is not None and c.frontier > start:  # delivered by the previous daemon
                self._push(req, _Chunk(start, c.frontier, None, NOT_CAPTURED_PREVIOUS))
        self._requests[req.request_id] = req
        self._finished.pop(req.request_id, None)
        self.stats["requests_started"] += 1
        out.append(self._begin_event(req, now, update=False))
        if end is not None:
            req.end, req.end_at, req.stop = end.control, now, c.stop
        req.last_record_at = now
        for ch in c.chunks:
            if ch.positions is None:
                self._push(req, _Chunk(ch.start, ch.stop, None, ch.reason))
            else:
                pos, ids = ch.positions.array(), ch.token_ids.array() if ch.token_ids is not None else None
                tensors = {name: a.array() for name, a in ch.tensors.items()}
                self._push(req, _Chunk(ch.start, ch.stop, Tokens(self.instance, req.request_id, pos, ids,
                                                                 req.num_prompt_tokens, tensors, dict(ch.dtypes), now)))
        for sl in c.slices:
            self._on_data(RingRecord(
                kind=rf.RecordKind.DATA, request_id=req.request_id, tap_key=req.tap_key, step=sl.step, rank=sl.rank,
                expected_ranks=sl.expected_ranks, rank_parts=sl.rank_parts, tensor=TensorId(rf.TensorKind(sl.kind), sl.layer),
                dtype=sl.dtype, slice_start=sl.slice_start, slice_stop=sl.slice_stop, full_dim=sl.full_dim,
                num_prompt_tokens=sl.num_prompt_tokens, positions=sl.positions.array(), token_ids=sl.token_ids.array(),
                data=sl.data.array(), ring=sl.ring, epoch=sl.epoch, source=req.source), now, out)
        if req.shed is not None and req.end is not None:
            self._finish(req, now, out, req.shed)
            return
        self._pump(req, now, out)

    # -- record kinds --

    def _new_request(self, r: RingRecord, now: float, out: list[Event], lazy: bool) -> _Request:
        self._finished.pop(r.request_id, None)
        req = _Request(r.request_id, r.tap_key, r.num_prompt_tokens, lazy, source=r.source or "client",
                       inherited=lazy and r.ring in self._resumed, hold=self.hold_newest)
        self._requests[r.request_id] = req
        self.stats["requests_started"] += 1
        if not lazy:
            self._apply_begin(req, r)
        elif r.kind == rf.RecordKind.DATA:
            self._apply_table(req, r)
        elif r.kind == rf.RecordKind.END and r.spec is not None:
            self._apply_spec(req, r.spec, r.source)
        out.append(self._begin_event(req, now, update=False))
        return req

    def _touch(self, req: _Request, now: float) -> None:
        req.records += 1
        req.last_record_at = now
        if req.live_absent or req.lost_at is not None:
            self._revive(req)

    @staticmethod
    def _revive(req: _Request) -> None:
        """A record of it came: whatever the LIVE records said, it was still running."""
        req.live_absent = 0
        req.lost_at = None
        if req.end is None:
            req.barrier = None  # no longer waiting to end `end lost`

    def _lazy(self, r: RingRecord, now: float, out: list[Event]) -> _Request | None:
        req = self._requests.get(r.request_id)
        if req is not None:
            return req
        if r.request_id in self._finished:
            self.stats["late_records"] += 1
            return None
        return self._new_request(r, now, out, lazy=True)

    def _arrived(self, r: RingRecord, now: float, out: list[Event]) -> _Request | None:
        """The capture a worker's record (DATA, DROP, SHED) is about, made if new and noted active;
        None when it already finished."""
        req = self._lazy(r, now, out)
        if req is not None:
            self._touch(req, now)
            req.sources.add(r.ring)
        return req

    def _set_start(self, req: _Request, start: int) -> None:
        req.start = start
        if req.frontier is None:
            req.frontier = req.first_frontier = start

    def _apply_spec(self, req: _Request, spec: CaptureSpec, source: str | None) -> None:
        req.spec = spec
        req.tail = spec.tail
        if source:
            req.source = source
        first = spec.first_position(req.num_prompt_tokens)
        if first is not None:
            self._set_start(req, first)

    def _apply_table(self, req: _Request, r: RingRecord) -> None:
        """What a DATA record's request table says about a capture whose BEGIN was not seen."""
        if r.source:
            req.source = r.source
        if req.spec is not None:
            return
        if r.tail > 0:
            req.tail = r.tail
        elif r.start >= 0 and req.start is None:
            self._set_start(req, r.start)

    def _apply_begin(self, req: _Request, r: RingRecord) -> None:
        info = r.control
        req.begin = info
        if info is not None and info.num_prompt_tokens:
            req.num_prompt_tokens = info.num_prompt_tokens
        if info is not None and info.async_scheduling is False:
            req.hold = 0  # no step runs past the end: nothing to hold back
        if r.spec is not None:
            self._apply_spec(req, r.spec, r.source)

    def _begin_event(self, req: _Request, now: float, update: bool) -> Begin:
        b = req.begin
        prompt = b.prompt_token_ids if b is not None else None
        return Begin(
            self.instance, req.request_id, req.tap_key, req.num_prompt_tokens,
            list(prompt) if prompt is not None else None, b.n if b is not None else 1, b.model if b is not None else "",
            req.spec.to_meta() if req.spec else None, req.start if req.start is not None else req.frontier,
            req.lazy, update, now, req.source,
        )

    def _on_begin(self, r: RingRecord, now: float, out: list[Event]) -> None:
        req = self._requests.get(r.request_id)
        if req is None:
            self._new_request(r, now, out, lazy=False)
        elif req.begin is None:
            self._touch(req, now)
            self._apply_begin(req, r)
            out.append(self._begin_event(req, now, update=True))
            self._pump(req, now, out)
        # else: a duplicate BEGIN; the first one stands

    def _seen(self, req: _Request, positions: np.ndarray) -> None:
        top = _top(positions)
        if top > req.max_seen:
            req.max_seen = top

    def _on_data(self, r: RingRecord, now: float, out: list[Event]) -> None:
        n = len(r.positions)
        if r.tensor is None or r.data is None or r.data.shape != (n, r.slice_stop - r.slice_start) or n == 0:
            self.stats["bad_records"] += 1
            log.warning("request %s: malformed DATA record from %s ignored", r.request_id, r.ring)
            return
        req = self._arrived(r, now, out)
        if req is None:
            return
        if req.shed is not None:
            self.stats["shed_records"] += 1  # another rank admitted what one rank shed
            return
        if req.num_prompt_tokens == 0:
            req.num_prompt_tokens = r.num_prompt_tokens
        if req.spec is None and req.start is None and not req.tail:
            self._apply_table(req, r)
        if req.frontier is None and req.start is None and req.lazy and not req.tail:
            req.frontier = req.first_frontier = _bottom(r.positions)  # capture starts at the first position seen
        if req.stop is not None and _bottom(r.positions) >= req.stop:
            self.stats["past_end_records"] += 1  # computed after the end (async scheduling): never delivered
            return
        self._seen(req, r.positions)
        if req.cut is not None:
            self._add_missing(req, r.positions, req.cut)
            self._pump(req, now, out)
            return
        if req.resolved(r.positions):
            self.stats["duplicate_records"] += 1
            return
        g = req.groups.get(r.step)
        if g is None:
            g = req.groups[r.step] = _Group(r.step, max(r.expected_ranks, 1), r.positions, r.token_ids, r.num_prompt_tokens)
        elif not np.array_equal(g.positions, r.positions):
            self.stats["bad_records"] += 1
            log.warning("request %s step %d: records cover different positions; the step is missing",
                        req.request_id, r.step)
            self._fail_groups(req, [g], INCOMPLETE)
            self._pump(req, now, out)
            return
        self._account(req, g.add(r))
        if g.complete():
            self._take_group(req, g, keep_targets=True)  # _complete takes them
            self._complete(req, g, now)
            self._pump(req, now, out)

    def _on_drop(self, r: RingRecord, now: float, out: list[Event]) -> None:
        req = self._arrived(r, now, out)
        if req is None or req.shed is not None:
            return
        positions = r.control.positions if r.control is not None else r.meta.get("positions", [])
        dropped = np.asarray(positions, np.int64)
        if not len(dropped):
            return
        if req.frontier is None and req.start is None and req.lazy and not req.tail:
            req.frontier = req.first_frontier = int(dropped.min())
        self._seen(req, dropped)
        lo, hi = int(dropped.min()), int(dropped.max()) + 1
        hit = [g for g in req.groups.values() if g.overlaps(lo, hi) and np.isin(g.positions, dropped).any()]
        self._fail_groups(req, hit, DROPPED)
        self._add_missing(req, dropped, DROPPED)
        self._pump(req, now, out)

    def _on_end(self, r: RingRecord, now: float, out: list[Event]) -> None:
        req = self._requests.get(r.request_id)
        if req is None:
            if r.request_id in self._finished:
                return
            req = self._new_request(r, now, out, lazy=True)
        if req.end is not None:
            return
        self._touch(req, now)
        m = r.control
        req.end = m
        req.end_at = now
        if not req.num_prompt_tokens:
            req.num_prompt_tokens = m.num_prompt_tokens
        if req.spec is None and r.spec is not None:
            self._apply_spec(req, r.spec, r.source)
        elif r.source and req.begin is None:
            req.source = r.source
        end = m.end_position
        if req.spec is not None:
            start, stop = req.spec.position_range(req.num_prompt_tokens, end)
        elif req.tail:
            start, stop = max(end - req.tail, 0), end
        else:
            # No spec: capture starts where the table said, else at the first position seen, which
            # is unknown until data comes (the engine ring is read first, so END often leads).
            start, stop = (req.start if req.start is not None else req.first_frontier), end
        req.stop = stop if start is None else max(stop, start)
        if start is not None:
            req.start = start
            if req.frontier is None or req.frontier < start:
                req.frontier = start
                if req.first_frontier is None:
                    req.first_frontier = start
        if req.shed is not None:
            self._finish(req, now, out, req.shed)
            return
        self._pump(req, now, out)

    def _on_shed(self, r: RingRecord, now: float, out: list[Event]) -> None:
        req = self._arrived(r, now, out)
        if req is None or req.shed is not None:
            return  # finished, or another rank shed it too
        if not req.num_prompt_tokens:
            req.num_prompt_tokens = r.num_prompt_tokens
        if req.spec is None and r.spec is not None:
            self._apply_spec(req, r.spec, r.source)
        req.shed = r.control.reason if r.control is not None and r.control.reason else OVERLOADED
        self.stats["captures_shed"] += 1
        # What other ranks wrote for it is discarded: one Gap covers the capture.
        for g in list(req.groups.values()):
            self._take_group(req, g)
        for item in req.ready:
            self._account(req, -item[3].nbytes)
        req.ready = []
        if req.end is not None:
            self._finish(req, now, out, req.shed)

    def _on_live(self, r: RingRecord, now: float) -> None:
        self.stats["live_records"] += 1
        if r.ring != ENGINE_SOURCE or r.control is None:
            return
        self._last_live_at = now
        live = set(r.control.requests)
        for req in self._requests.values():
            if req.end is not None or req.lost_at is not None:
                continue
            if req.request_id in live:
                req.listed = True
                req.live_absent = 0
                continue
            req.listed = False
            if req.live_absent and req.records != req.absent_mark:
                req.live_absent = 0  # it had a record since the first absence: start counting again
            if req.live_absent == 0:
                req.absent_mark = req.records
            req.live_absent += 1
            if req.live_absent >= 2:
                req.lost_at = now

    # -- byte accounting --

    def _account(self, req: _Request, delta: int) -> None:
        req.nbytes += delta
        self.held_bytes += delta

    def _take_group(self, req: _Request, g: _Group, keep_targets: bool = False) -> None:
        if req.groups.get(g.step) is g:
            del req.groups[g.step]
            self._account(req, -g.nbytes)
        if not keep_targets:
            self._drop_targets(req, g)

    def _drop_targets(self, req: _Request, g: _Group) -> None:
        if self._targets:
            for recs in g.parts.values():
                for rec in recs.values():
                    self._targets.pop((req.request_id, g.step, rec.tensor), None)

    # -- assembly --

    def _complete(self, req: _Request, g: _Group, now: float) -> None:
        by_tensor: dict[TensorId, list[RingRecord]] = {}
        for recs in g.parts.values():
            for rec in recs.values():
                by_tensor.setdefault(rec.tensor, []).append(rec)  # type: ignore[arg-type]
        tensors: dict[str, np.ndarray] = {}
        dtypes: dict[str, int] = {}
        targets = {tid: self._targets.pop((req.request_id, g.step, tid), None) for tid in by_tensor} \
            if self._targets else {}
        for tid in sorted(by_tensor, key=lambda t: (t.kind, t.layer)):
            recs = sorted(by_tensor[tid], key=lambda x: x.slice_start)
            full, dt = recs[0].full_dim, recs[0].dtype
            edge = 0
            ok = True
            for rec in recs:
                if rec.full_dim != full or rec.dtype != dt or rec.slice_start != edge:
                    ok = False
                    break
                edge = rec.slice_stop
            if not ok or edge != full:
                log.warning("request %s step %d: slices of %s do not tile [0, %d): %s; positions missing",
                            req.request_id, g.step, tid.name, full,
                            [(x.rank, x.slice_start, x.slice_stop) for x in recs])
                self._fail_groups(req, [g], INCOMPLETE)
                self._kill_stale(req, g)
                return
            # One record: its own array, no copy. Several: read into their places of one array
            # (target()), else one concatenation in slice order.
            name = _tensor_name(tid)
            if len(recs) == 1:
                tensors[name] = recs[0].data
            else:
                t = targets.get(tid)
                if t is not None and _tiles(t, recs):
                    tensors[name] = t
                else:
                    shape = (len(recs[0].data), full)
                    out = self.alloc(shape, recs[0].data.dtype) if self.alloc is not None else None
                    tensors[name] = np.concatenate([x.data for x in recs], axis=1, out=out)
            dtypes[name] = dt
        num_prompt = req.num_prompt_tokens or g.num_prompt_tokens
        for start, stop, rows in _runs(g.positions):
            if len(rows) == len(g.positions) and stop - start == len(rows) and rows[0] == 0:
                pos, ids, ts = g.positions, g.token_ids, tensors  # the common case: already in order
            else:
                pos, ids = g.positions[rows], g.token_ids[rows]
                ts = {k: np.ascontiguousarray(a[rows]) for k, a in tensors.items()}
            self._push(req, _Chunk(start, stop, Tokens(self.instance, req.request_id, pos, ids, num_prompt, ts, dtypes, now)))
        self._kill_stale(req, g)

    def _kill_stale(self, req: _Request, done: _Group) -> None:
        """Earlier groups that can no longer complete (every rank they wait on has moved past them)."""
        ranks = set(done.parts)
        stale = [g for g in req.groups.values()
                 if g.step < done.step and set(g.parts) <= ranks and len(ranks) >= g.expected_ranks]
        if stale:
            self._fail_groups(req, stale, _unfinished(req))

    def _fail_groups(self, req: _Request, groups: list[_Group], reason: str) -> None:
        for g in groups:
            self._take_group(req, g)
            self._add_missing(req, g.positions, reason)

    def _add_missing(self, req: _Request, positions, reason: str) -> None:
        ps = np.asarray(positions, np.int64)
        if req.frontier is not None:
            ps = ps[ps >= req.frontier]
        for a, b in PositionRanges.of(ps).ranges:
            self._push(req, _Chunk(a, b, None, reason))

    def _push(self, req: _Request, ch: _Chunk) -> None:
        # Data sorts before a gap at the same start: a recomputed copy beats a drop report.
        heapq.heappush(req.ready, (ch.start, 0 if ch.tokens is not None else 1, next(self._seq), ch))
        self._account(req, ch.nbytes)
        if _holding(req):
            # Only the newest positions can turn out to be the last ones: keep the tail's worth,
            # plus the held-back newest (a position computed past the end).
            latest = max(c.stop for _, _, _, c in req.ready)
            keep = req.tail + req.hold
            kept = []
            for item in req.ready:
                if item[3].stop > latest - keep:
                    kept.append(item)
                else:
                    self._account(req, -item[3].nbytes)
            if len(kept) != len(req.ready):
                heapq.heapify(kept)
                req.ready = kept

    def _pop(self, req: _Request) -> _Chunk:
        ch = heapq.heappop(req.ready)[3]
        self._account(req, -ch.nbytes)
        return ch

    # -- delivery --

    def _may_skip(self, req: _Request, lo: int, hi: int) -> bool:
        """Positions [lo, hi) can be declared missing: no pending group could still fill them."""
        return not any(g.overlaps(lo, hi) for g in req.groups.values())

    def _emit_gap(self, req: _Request, lo: int, hi: int, reason: str, now: float, out: list[Event]) -> None:
        if req.stop is not None:
            hi = min(hi, req.stop)
        if hi <= lo:
            return
        rng = range(lo, hi)
        req.missing.append(rng)
        self.stats["missing_positions"] += len(rng)
        key = reason if reason in GAP_REASONS else OVER_BUDGET if reason.startswith(OVER_BUDGET) else OTHER
        self.gap_positions[key] = self.gap_positions.get(key, 0) + len(rng)
        out.append(Gap(self.instance, req.request_id, rng, reason, now))

    def _limit(self, req: _Request) -> int | None:
        """Positions below this may be delivered now (None: no limit)."""
        if req.stop is not None:
            return req.stop
        if req.hold:
            # Only a decode step can run past the end (the END's end_position is at least the
            # prompt length once a token was generated, and covers a prefill chunk in flight when
            # none was), so prompt positions never wait.
            return max(req.max_seen + 1 - req.hold, req.num_prompt_tokens)
        return None

    def _pump(self, req: _Request, now: float, out: list[Event], force_reason: str | None = None) -> None:
        """Deliver ready chunks in position order; finish the request when everything is resolved."""
        while req.ready and not _holding(req):
            start, _, _, ch = req.ready[0]
            if req.frontier is None:
                req.frontier = req.first_frontier = start
            lim = self._limit(req)
            if lim is not None and req.frontier >= lim:
                break
            if ch.stop <= req.frontier:
                self._pop(req)
                continue
            if start > req.frontier:
                if force_reason is None and not self._may_skip(req, req.frontier, start):
                    break
                hi = start if lim is None else min(start, lim)
                reason = force_reason or (NOT_CAPTURED_PREVIOUS if req.inherited and not req.delivered
                                          and req.frontier == req.start else NOT_CAPTURED)
                self._emit_gap(req, req.frontier, hi, reason, now, out)
                req.frontier = hi
                continue
            ch = self._pop(req)
            hi = ch.stop if lim is None else min(ch.stop, lim)
            if ch.tokens is None:
                self._emit_gap(req, req.frontier, hi, ch.reason, now, out)
                if hi < ch.stop:
                    self._push(req, _Chunk(hi, ch.stop, None, ch.reason))
            else:
                tok = ch.tokens.cut(req.frontier)
                if hi < ch.stop:
                    self._push(req, _Chunk(hi, ch.stop, tok.cut(hi)))  # held back, see HOLD_NEWEST
                    tok = tok.head(hi)
                req.delivered += len(tok.positions)
                out.append(tok)
            req.frontier = hi
        if force_reason is not None and req.stop is not None and req.frontier is not None and req.frontier < req.stop:
            self._emit_gap(req, req.frontier, req.stop, force_reason, now, out)
            req.frontier = req.stop
        if req.stop is not None and req.frontier is not None and req.frontier >= req.stop and force_reason is None:
            self._finish(req, now, out, None)

    def _finish(self, req: _Request, now: float, out: list[Event], force_reason: str | None) -> None:
        if self._requests.get(req.request_id) is not req:
            return
        if force_reason is not None:
            gap_reason = req.shed or force_reason  # a shed capture's positions are missing for that reason
            self._fail_groups(req, list(req.groups.values()), gap_reason)
            if req.stop is None:  # no END: the expected positions end where capture got to
                top = max((ch.stop for _, _, _, ch in req.ready), default=req.frontier or 0)
                req.stop = max(top, req.frontier or 0)
                if req.tail and req.start is None and req.ready:
                    # A tail capture without its END: keep the last `tail` positions it reached.
                    self._set_start(req, max(min(ch.start for _, _, _, ch in req.ready), req.stop - req.tail))
                    req.frontier = req.start
            self._pump(req, now, out, gap_reason)
        del self._requests[req.request_id]
        self._account(req, -req.nbytes)
        req.ready = []
        for g in req.groups.values():
            self._drop_targets(req, g)
        self._finished[req.request_id] = None
        while len(self._finished) > self._finished_memory:
            self._finished.popitem(last=False)
        self.stats["requests_finished"] += 1
        m = req.end
        start = req.start if req.start is not None else req.first_frontier
        if start is None:  # nothing seen and nothing known: no claim either way
            start = stop = 0
        else:
            stop = req.stop if req.stop is not None else start
        missing = PositionRanges(req.missing).clip(start, stop)
        if req.first_frontier is not None and req.first_frontier > start:
            # Capture started late (the BEGIN came after data, or a previous daemon consumed the
            # head) and the head could not be reported as a Gap in order.
            missing = missing.union([(start, min(req.first_frontier, stop))])
        reason = m.reason if m is not None else (force_reason or WRITER_GONE)
        out.append(End(
            self.instance, req.request_id, reason, req.num_prompt_tokens,
            m.num_output_tokens if m is not None else 0, list(m.output_token_ids) if m is not None else [],
            m.end_position if m is not None else None, (start, stop) if stop > start else None, missing,
            req.delivered, now, req.source,
        ))


def _meta(struct: Any, spec: CaptureSpec | None) -> dict[str, Any] | None:
    """A decoded control meta (BeginMeta, EndMeta) as a plain meta the ring schema decodes the same
    (its spec, kept raw there, from the decoded one)."""
    if struct is None:
        return None
    out = {name: getattr(struct, name) for name in struct.__struct_fields__}
    out.pop("spec", None)
    if spec is not None:
        out["spec"] = spec.to_meta()
    return out


def _export(req: _Request) -> ho.Capture:
    chunks = []
    for _, _, _, ch in sorted(req.ready, key=lambda item: item[:3]):
        t = ch.tokens
        if t is None:
            chunks.append(ho.Chunk(ch.start, ch.stop, ch.reason))
        else:
            chunks.append(ho.Chunk(ch.start, ch.stop, "", ho.Array.of(t.positions), ho.Array.of(t.token_ids),
                                   {n: ho.Array.of(a) for n, a in t.tensors.items()}, dict(t.dtypes)))
    slices = [ho.Slice(r.ring, r.epoch, r.rank, g.step, g.expected_ranks, r.rank_parts, int(r.tensor.kind), r.tensor.layer,
                       r.dtype, r.slice_start, r.slice_stop, r.full_dim, r.num_prompt_tokens, ho.Array.of(r.positions),
                       ho.Array.of(r.token_ids), ho.Array.of(r.data))
              for g in req.groups.values() for recs in g.parts.values() for r in recs.values()
              if r.tensor is not None and r.data is not None]
    return ho.Capture(
        req.request_id, req.tap_key, req.num_prompt_tokens, req.lazy, req.source, _meta(req.begin, req.spec),
        _meta(req.end, req.spec),
        req.spec.to_meta() if req.spec is not None else None, req.tail, req.start, req.frontier, req.stop, req.max_seen,
        sorted(req.sources), req.cut, req.hold, chunks, slices, req.shed)


def _top(positions: np.ndarray) -> int:
    # One row (a decode step) is the common case: a scalar read, not a reduction.
    return int(positions[0]) if len(positions) == 1 else int(positions.max())


def _bottom(positions: np.ndarray) -> int:
    return int(positions[0]) if len(positions) == 1 else int(positions.min())


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _tiles(t: np.ndarray, recs: list[RingRecord]) -> bool:
    """Every slice was read into its own columns of `t` (target()), and they cover all of it."""
    base = _addr(t)
    step = t.dtype.itemsize
    return all(x.data is not None and x.data.shape[0] == t.shape[0] and x.data.strides == t.strides
               and x.data.dtype == t.dtype and _addr(x.data) == base + x.slice_start * step for x in recs)


def _unfinished(req: _Request) -> str:
    """Why steps of a capture that can no longer complete are missing. Some of their records came and
    others never will: a rank's slice never arrived (`incomplete`), unless the capture was met half way
    in a ring a previous daemon was reading and nothing was delivered yet. Then these are its first
    steps, whose other records that daemon read before it stopped (a step's hidden states and its
    logits are two records, a SIGKILL can fall between them)."""
    return NOT_CAPTURED_PREVIOUS if req.inherited and not req.delivered else INCOMPLETE


def _holding(req: _Request) -> bool:
    """True while which positions to deliver depends on the END (a tail capture: workers write
    every position it might include, and only the END says which are the last ones)."""
    return req.tail > 0 and req.stop is None
