"""Reassembly of ring records into ordered per-request events: a pure state machine (no IO).

The daemon feeds every record it reads, from all rings of one engine instance, in whatever order it
reads them; out come events per request: Begin, then Tokens and Gap covering every captured
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
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap.records import RingRecord, TensorId
from vllm_tap.spec import CaptureSpec

log = logging.getLogger(__name__)

ENGINE_SOURCE = "engine" + rf.RING_SUFFIX  # the engine ring's name: its writer carries the ENDs

# Why positions are missing (Gap.reason).
DROPPED = "dropped"  # the writer's ring was full
INCOMPLETE = "incomplete"  # some rank's slice never arrived, or the slices did not tile the tensor
NOT_CAPTURED = "not captured"  # never written (e.g. cached prefix), or consumed by a previous daemon
TIMEOUT = "timeout"  # still incomplete end_grace_s after the request's END
WRITER_GONE = "writer gone"  # the ring's writer died


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

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.tensors.values()) + self.positions.nbytes + self.token_ids.nbytes

    def cut(self, from_position: int) -> "Tokens":
        """The part at or after from_position (views)."""
        k = max(0, from_position - self.start)
        if k == 0:
            return self
        return Tokens(self.instance, self.request_id, self.positions[k:], self.token_ids[k:],
                      self.num_prompt_tokens, {n: a[k:] for n, a in self.tensors.items()}, self.dtypes, self.at)


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
    reason: str  # the engine's finish reason, or WRITER_GONE when no END ever came
    num_prompt_tokens: int
    num_output_tokens: int
    output_token_ids: list[int]
    end_position: int | None  # the model computed positions [0, end_position)
    expected: tuple[int, int] | None  # [start, stop) of positions that should have been captured
    missing_positions: list[int]  # every expected position not delivered
    delivered: int  # positions delivered
    at: float

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.request_id)


Event = Union[Begin, Tokens, Gap, End]


# -- internal state --


_NAMES: dict[TensorId, str] = {}


def _tensor_name(tid: TensorId) -> str:
    name = _NAMES.get(tid)
    if name is None:
        name = _NAMES[tid] = tid.name
    return name


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

    def add(self, r: RingRecord) -> None:
        # Keyed by slice so a duplicate record replaces rather than double-counts.
        assert r.tensor is not None
        self.parts.setdefault(r.rank, {})[(r.tensor, r.slice_start, r.slice_stop)] = r
        self.wanted[r.rank] = max(r.rank_parts, 1)

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


@dataclass
class _Request:
    request_id: str
    tap_key: str
    num_prompt_tokens: int
    lazy: bool
    begin_meta: dict[str, Any] | None = None
    spec: CaptureSpec | None = None
    start: int | None = None  # first expected position, if known
    frontier: int | None = None  # next position to deliver
    first_frontier: int | None = None  # where delivery started (for End's missing list)
    groups: dict[int, _Group] = field(default_factory=dict)
    ready: list[tuple[int, int, int, _Chunk]] = field(default_factory=list)  # heap
    missing: list[range] = field(default_factory=list)
    delivered: int = 0
    sources: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)
    dead_at: float | None = None
    end_meta: dict[str, Any] | None = None
    end_at: float | None = None
    stop: int | None = None  # expected stop, known at END

    def resolved(self, positions: np.ndarray) -> bool:
        """Every position already delivered or waiting in `ready` (a duplicate or recompute)."""
        if self.frontier is None:
            return False
        if int(positions.max()) < self.frontier:
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


def _ranges(positions: list[int] | np.ndarray) -> list[range]:
    ps = sorted(set(int(p) for p in positions))
    out: list[range] = []
    for p in ps:
        if out and out[-1].stop == p:
            out[-1] = range(out[-1].start, p + 1)
        else:
            out.append(range(p, p + 1))
    return out


class Reassembler:
    """Per-request reassembly for the rings of one engine instance."""

    def __init__(self, instance: str = "default", *, end_grace_s: float = 5.0, finished_memory: int = 65536):
        self.instance = instance
        self.end_grace_s = end_grace_s
        self._requests: dict[str, _Request] = {}
        # Ids recently finished, so records straggling in after the End do not start a new capture.
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._finished_memory = finished_memory
        self._seq = itertools.count()
        self.stats = {"records": 0, "late_records": 0, "duplicate_records": 0, "bad_records": 0,
                      "requests_started": 0, "requests_finished": 0, "missing_positions": 0}

    # -- inspection --

    def in_flight(self) -> int:
        return len(self._requests)

    def requests(self) -> list[dict[str, Any]]:
        return [
            {"instance": self.instance, "request_id": r.request_id, "frontier": r.frontier,
             "pending_groups": len(r.groups), "delivered": r.delivered,
             "missing": sum(len(m) for m in r.missing), "ended": r.end_meta is not None}
            for r in self._requests.values()
        ]

    # -- inputs --

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
        return out

    def tick(self, now: float) -> list[Event]:
        """Resolve what timed out: requests past their END's grace, groups of dead writers."""
        out: list[Event] = []
        for req in list(self._requests.values()):
            if req.end_at is not None and now >= req.end_at + self.end_grace_s:
                self._finish(req, now, out, TIMEOUT)
            elif req.dead_at is not None and now >= req.dead_at + self.end_grace_s:
                self._fail_groups(req, list(req.groups.values()), WRITER_GONE)
                self._pump(req, now, out)
                if ENGINE_SOURCE in req.gone or req.sources <= req.gone:
                    self._finish(req, now, out, WRITER_GONE)
                else:
                    req.dead_at = None  # the engine lives on and will END it
        return out

    def writer_gone(self, source: str, now: float) -> list[Event]:
        """The writer of ring `source` died or was replaced: what waits on it is resolved after the grace."""
        for req in self._requests.values():
            if source == ENGINE_SOURCE or source in req.sources:
                req.gone.add(source)
                if req.dead_at is None:
                    req.dead_at = now
        return []

    # -- record kinds --

    def _new_request(self, r: RingRecord, now: float, out: list[Event], lazy: bool) -> _Request:
        self._finished.pop(r.request_id, None)
        req = _Request(r.request_id, r.tap_key, r.num_prompt_tokens, lazy)
        self._requests[r.request_id] = req
        self.stats["requests_started"] += 1
        if not lazy:
            self._apply_begin(req, r.meta)
        out.append(self._begin_event(req, now, update=False))
        return req

    def _lazy(self, r: RingRecord, now: float, out: list[Event]) -> _Request | None:
        req = self._requests.get(r.request_id)
        if req is not None:
            return req
        if r.request_id in self._finished:
            self.stats["late_records"] += 1
            return None
        return self._new_request(r, now, out, lazy=True)

    def _apply_begin(self, req: _Request, meta: dict[str, Any]) -> None:
        req.begin_meta = meta
        req.num_prompt_tokens = int(meta.get("num_prompt_tokens", req.num_prompt_tokens) or 0)
        try:
            req.spec = CaptureSpec.from_meta(meta["spec"]) if meta.get("spec") is not None else None
        except (KeyError, ValueError, TypeError) as e:
            log.warning("request %s: unreadable capture spec in BEGIN (%s); capturing from the first position seen",
                        req.request_id, e)
            req.spec = None
        if req.spec is not None:
            req.start = req.spec.first_position(req.num_prompt_tokens)
            if req.frontier is None:
                req.frontier = req.first_frontier = req.start

    def _begin_event(self, req: _Request, now: float, update: bool) -> Begin:
        m = req.begin_meta or {}
        prompt = m.get("prompt_token_ids")
        return Begin(
            self.instance, req.request_id, req.tap_key, req.num_prompt_tokens,
            list(prompt) if prompt is not None else None, int(m.get("n", 1) or 1), str(m.get("model", "")),
            req.spec.to_meta() if req.spec else None, req.start if req.start is not None else req.frontier,
            req.lazy, update, now,
        )

    def _on_begin(self, r: RingRecord, now: float, out: list[Event]) -> None:
        req = self._requests.get(r.request_id)
        if req is None:
            self._new_request(r, now, out, lazy=False)
        elif req.begin_meta is None:
            self._apply_begin(req, r.meta)
            out.append(self._begin_event(req, now, update=True))
            self._pump(req, now, out)
        # else: a duplicate BEGIN; the first one stands

    def _on_data(self, r: RingRecord, now: float, out: list[Event]) -> None:
        n = len(r.positions)
        if r.tensor is None or r.data is None or r.data.shape != (n, r.slice_stop - r.slice_start) or n == 0:
            self.stats["bad_records"] += 1
            log.warning("request %s: malformed DATA record from %s ignored", r.request_id, r.ring)
            return
        req = self._lazy(r, now, out)
        if req is None:
            return
        req.sources.add(r.ring)
        if req.num_prompt_tokens == 0:
            req.num_prompt_tokens = r.num_prompt_tokens
        if req.frontier is None and req.start is None and req.lazy:
            req.frontier = req.first_frontier = int(r.positions.min())  # capture starts at the first position seen
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
            del req.groups[r.step]
            self._fail_groups(req, [g], INCOMPLETE)
            self._pump(req, now, out)
            return
        g.add(r)
        if g.complete():
            del req.groups[r.step]
            self._complete(req, g, now)
            self._pump(req, now, out)

    def _on_drop(self, r: RingRecord, now: float, out: list[Event]) -> None:
        req = self._lazy(r, now, out)
        if req is None:
            return
        req.sources.add(r.ring)
        dropped = np.asarray(r.meta.get("positions", []), np.int64)
        if not len(dropped):
            return
        if req.frontier is None and req.start is None and req.lazy:
            req.frontier = req.first_frontier = int(dropped.min())
        lo, hi = int(dropped.min()), int(dropped.max()) + 1
        hit = [g for g in req.groups.values() if g.overlaps(lo, hi) and np.isin(g.positions, dropped).any()]
        for g in hit:
            del req.groups[g.step]
        self._fail_groups(req, hit, DROPPED)
        self._add_missing(req, dropped, DROPPED)
        self._pump(req, now, out)

    def _on_end(self, r: RingRecord, now: float, out: list[Event]) -> None:
        req = self._requests.get(r.request_id)
        if req is None:
            if r.request_id in self._finished:
                return
            req = self._new_request(r, now, out, lazy=True)
        if req.end_meta is not None:
            return
        m = r.meta
        req.end_meta = m
        req.end_at = now
        if not req.num_prompt_tokens:
            req.num_prompt_tokens = int(m.get("num_prompt_tokens", 0) or 0)
        end = int(m.get("end_position", 0) or 0)
        if req.spec is not None:
            start, stop = req.spec.position_range(req.num_prompt_tokens, end)
        else:
            # No BEGIN (a restarted daemon consumed it): capture starts at the first position seen,
            # which is unknown until data comes (the engine ring is read first, so END often leads).
            start, stop = req.first_frontier, end
        req.stop = stop if start is None else max(stop, start)
        if start is not None:
            req.start = start
            if req.frontier is None or req.frontier < start:
                req.frontier = start
                if req.first_frontier is None:
                    req.first_frontier = start
        self._pump(req, now, out)

    # -- assembly --

    def _complete(self, req: _Request, g: _Group, now: float) -> None:
        by_tensor: dict[TensorId, list[RingRecord]] = {}
        for recs in g.parts.values():
            for rec in recs.values():
                by_tensor.setdefault(rec.tensor, []).append(rec)  # type: ignore[arg-type]
        tensors: dict[str, np.ndarray] = {}
        dtypes: dict[str, int] = {}
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
            # One record: its own array, no copy. Several: one concatenation in slice order.
            name = _tensor_name(tid)
            tensors[name] = recs[0].data if len(recs) == 1 else np.concatenate([x.data for x in recs], axis=1)
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
        for g in stale:
            del req.groups[g.step]
        self._fail_groups(req, stale, INCOMPLETE)

    def _fail_groups(self, req: _Request, groups: list[_Group], reason: str) -> None:
        for g in groups:
            req.groups.pop(g.step, None)
            self._add_missing(req, g.positions, reason)

    def _add_missing(self, req: _Request, positions, reason: str) -> None:
        ps = np.asarray(positions, np.int64)
        if req.frontier is not None:
            ps = ps[ps >= req.frontier]
        for rng in _ranges(ps):
            self._push(req, _Chunk(rng.start, rng.stop, None, reason))

    def _push(self, req: _Request, ch: _Chunk) -> None:
        # Data sorts before a gap at the same start: a recomputed copy beats a drop report.
        heapq.heappush(req.ready, (ch.start, 0 if ch.tokens is not None else 1, next(self._seq), ch))
        if _holding(req):
            # Only the newest positions can turn out to be the last: keep just those.
            latest = max(c.start for _, _, _, c in req.ready)
            req.ready = [item for item in req.ready if item[3].stop > latest]
            heapq.heapify(req.ready)

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
        out.append(Gap(self.instance, req.request_id, rng, reason, now))

    def _pump(self, req: _Request, now: float, out: list[Event], force_reason: str | None = None) -> None:
        """Deliver ready chunks in position order; finish the request when everything is resolved."""
        while req.ready and not _holding(req):
            start, _, _, ch = req.ready[0]
            if req.frontier is None:
                req.frontier = req.first_frontier = start
            if req.stop is not None and req.frontier >= req.stop:
                break
            if ch.stop <= req.frontier:
                heapq.heappop(req.ready)
                continue
            if start > req.frontier:
                if force_reason is None and not self._may_skip(req, req.frontier, start):
                    break
                self._emit_gap(req, req.frontier, start, force_reason or NOT_CAPTURED, now, out)
                req.frontier = start
            heapq.heappop(req.ready)
            if ch.tokens is None:
                self._emit_gap(req, req.frontier, ch.stop, ch.reason, now, out)
            else:
                tok = ch.tokens.cut(req.frontier)
                if req.stop is not None and tok.stop > req.stop:
                    tok = _head(tok, req.stop)
                req.delivered += len(tok.positions)
                out.append(tok)
            req.frontier = ch.stop
        if force_reason is not None and req.stop is not None and req.frontier is not None and req.frontier < req.stop:
            self._emit_gap(req, req.frontier, req.stop, force_reason, now, out)
            req.frontier = req.stop
        if req.stop is not None and req.frontier is not None and req.frontier >= req.stop and force_reason is None:
            self._finish(req, now, out, None)

    def _fail_all(self, req: _Request, reason: str) -> None:
        self._fail_groups(req, list(req.groups.values()), reason)

    def _finish(self, req: _Request, now: float, out: list[Event], force_reason: str | None) -> None:
        if req.request_id not in self._requests:
            return
        if force_reason is not None:
            self._fail_all(req, force_reason)
            if req.stop is None:  # no END: expected positions end where capture got to
                tail = max((ch.stop for _, _, _, ch in req.ready), default=req.frontier or 0)
                req.stop = max(tail, req.frontier or 0)
            self._pump(req, now, out, force_reason)
        del self._requests[req.request_id]
        self._finished[req.request_id] = None
        while len(self._finished) > self._finished_memory:
            self._finished.popitem(last=False)
        self.stats["requests_finished"] += 1
        m = req.end_meta or {}
        start = req.start if req.start is not None else req.first_frontier
        if start is None:  # nothing seen and nothing known: no claim either way
            start = stop = 0
        else:
            stop = req.stop if req.stop is not None else start
        missing = [p for rng in req.missing for p in rng if start <= p < stop]
        if req.first_frontier is not None and req.first_frontier > start:
            # Capture started late (the BEGIN came after data, or a previous daemon consumed the
            # head): those positions were never delivered, though not reported as a Gap in order.
            missing = list(range(start, min(req.first_frontier, stop))) + missing
        out.append(End(
            self.instance, req.request_id, str(m.get("reason", force_reason or WRITER_GONE)) if req.end_meta else WRITER_GONE,
            req.num_prompt_tokens, int(m.get("num_output_tokens", 0) or 0), list(m.get("output_token_ids", []) or []),
            m.get("end_position"), (start, stop) if stop > start else None, missing, req.delivered, now,
        ))


def _holding(req: _Request) -> bool:
    """True while which positions to deliver depends on the END (last_output: workers write every
    output position, and only the one the END names as last is the capture)."""
    return req.spec is not None and req.start is None and req.stop is None


def _head(tok: Tokens, stop: int) -> Tokens:
    k = max(0, stop - tok.start)
    return Tokens(tok.instance, tok.request_id, tok.positions[:k], tok.token_ids[:k], tok.num_prompt_tokens,
                  {n: a[:k] for n, a in tok.tensors.items()}, tok.dtypes, tok.at)
