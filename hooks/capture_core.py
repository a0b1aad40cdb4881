"""The capture core: which rows each request contributes in a step, and the ring records they go in.

It knows nothing of vLLM or of a model runner (it imports torch, numpy and vllm_tap only): a runner
adapter (hooks/runner_v1.py, hooks/runner_v2.py) hands it a `StepView` built from the runner's own
state, and tells it about requests (`learn`, `forget`). The same core runs under both runners, on CPU
and CUDA, and in `vllm-tap bench hook` and the tests with torch alone.

    StepView (per step)          request id → batch row (row_of), rows of each batch row (query_start), first position of each
                                 request's rows (computed), token ids (host array, or a device tensor
                                 gathered on the device), hidden / aux / logits tensors, the lm head
    RankPlace (per worker)       tensor-parallel rank and size, pipeline stage, layers per stage

    core.begin(view) → step      plan: per capturing request its live rows (vectorised row tables)
    step.write_states()          hidden-state records (the aux tensors of this stage's layers)
    step.write_logits(logits)    logits / top-k / chosen records (+ one extra lm-head pass for rows
                                 that have no logits yet: prompt positions)
    core.end(step)               the step's records are published (CPU: now; CUDA: after the copy)

Both adapters learn a request when the runner admits it (`scheduled_new_reqs`, whose sampling params
carry the spec) and forget it when the runner drops it. V1 has every tensor at the top of
`sample_tokens` and calls `core.capture(view)` (all four at once);
V2 computes logits only inside `sample()`, so its adapter writes the states first and the logits
when they appear, before the grammar mask modifies them in place.

Rules kept here (performance and correctness):
- Per step, the cost is proportional to what is captured: the core keeps only the requests that
  capture (learned at admission, forgotten at finish, by the runner adapter) and with none of them
  in the step it returns at once. Otherwise, when the batch changed, one lookup of its batch row
  (`StepView.row_of`) and a few integer operations per *capturing* request; requests that do not
  capture cost nothing per step, however many there are. Then one ring record per set of requests
  asking the same tensors and per phase (states, then logits; one for both in a steady step), a
  section per tensor: the rows' ids gathered once, each
  tensor's rows by one copy (two for logits: extra-pass rows, then sampled rows), top-k and
  logsumexp once for every row that needs them. So a step issues the same torch calls for 8 or 64
  requests (tests/hooks/test_hook_ops.py counts them); on a GPU each call is microseconds of the step
  thread's host time, so their number is the cost to keep down. No per-token Python, no device
  sync. Per-request work (spec, parts, request-table entry) is done once, when the request is
  learned. The runner adapters do nothing at all in a step in which nobody captures, and count
  the host time of those in which someone does (hooks/cost.py).
- A decode step of an unchanged batch (every capturing request one row, its sampled one, inside
  its live range; the same requests at the same batch rows) is planned from a layout kept from the
  step that first saw that batch: request table, parts, row-table buffer, and in the ring writer
  each record's packed header. Whether the batch is unchanged is one comparison of its request ids
  with the last step's (in C), not a lookup per request. When every capturing request asks the same
  tensors (the usual case), the step is the steady step (hooks/steady_step.py): one record of a
  few torch calls into destinations laid out with the batch. Per step only positions and token ids
  are filled in. Any other step (a prefill chunk of ours, a request joining, leaving or moving) is
  planned in full.
- Under tensor parallelism every rank holds the full logits and residual stream; each rank copies
  only its 1/tp share of the last dimension (no collective). Top-k and chosen indices need whole
  rows: TP rank 0 writes them. The extra lm-head pass is a collective, so every TP rank of the last
  stage runs it identically (the plan is the same on every rank).
- A capture is admitted or shed once, when its request is learned (hooks/admission.py: one read of
  two ring cursors); a shed request is not kept, so it costs nothing per step.
- A request's malformed spec means no capture for it (one logged error), never an exception.
- A request's rows are positions [computed, computed + scheduled) cut to its live range; rows at or
  past its end (async scheduling computes a finished request once more) are written like any other:
  the daemon drops rows at or after the END's end position.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_tap.ring_records import RequestRef, RequestTable
from vllm_tap.ring_writer import RingWriter
from vllm_tap.spec import DEFAULT_SHED_AT, CaptureSpec, DTypeMode, LogitsMode

from . import guard
from .admission import Admission
from .cost import StepCost
from .parts import (CHOSEN_ID, LOGIT_PARTS, LOGITS_ID, LSE_ID, STATE_PARTS, TOPK_IDS_ID, TOPK_VALUES_ID, Part, hidden_id,
                    reducer_ids, section, stored_dtype, tensor_ids, tensors_per_step)
from .publisher import DeviceIndices, Publisher, RecordSection, gather_rows, report_drop
from .reducer_ops import DeviceReducer
from .reductions import logsumexp_rows, topk_rows
from .settings import SPEC_EXTRA_ARG
from .steady_step import SteadyRecord, SteadyStep
from .step_view import RankPlace, StepView, host_ids, shard

# StepView, RankPlace, host_ids and shard live in hooks/step_view.py; the adapters take them from here.
__all__ = ["CaptureCore", "CaptureStep", "RankPlace", "StepView", "host_ids", "shard"]

log = logging.getLogger("vllm_tap.hooks")

_NO_ROWS = np.zeros(0, np.int64)


def _first(pair: tuple) -> Any:
    return pair[0]


@dataclass
class _Request:
    """What the core keeps per capturing request, worked out once, when it is learned."""

    spec: CaptureSpec
    parts: tuple[Part, ...]
    live: tuple[int, int]  # [first, stop) of the positions it captures
    ref: RequestRef  # its entry in the records' request tables, and that entry packed
    packed: bytes


@dataclass
class _Plan:
    """What one request contributes in one step."""

    row: int  # index of the request in the batch (and of its sampled logits row)
    req: _Request
    first: int  # first captured position
    row_lo: int  # rows of the step's flattened tokens
    row_hi: int
    sampled: bool  # whether the request's sampled row (last scheduled token) is among them
    extra_at: int  # offset of its rows in the extra lm-head pass output


class _StepRows:
    """The step's plans as arrays, and the row tables of any subset of them (vectorised).

    A row table is what reserve_rows takes: int32 [3, n] of (request slot, position, token id),
    plus the rows' indices into the step's flattened tokens (`flat`) for gathering."""

    def __init__(self, plans: list[_Plan], token_ids: np.ndarray | None, single: bool):
        cols = np.array([(p.row, p.first, p.row_lo, p.row_hi - p.row_lo, p.sampled, p.extra_at) for p in plans],
                        dtype=np.int64).reshape(len(plans), 6).T
        self.row, self.first, self.lo, self.len, sampled, self.extra_at = cols
        self.sampled = sampled.astype(bool)
        # Decode: one row per request, the sampled one: every kind of row table is the same.
        self.single = single
        self.token_ids = token_ids  # host ids of the flattened tokens, when on the host
        self._cache: dict[bytes, tuple] = {}

    def _table(self, slots, flat, pos) -> tuple[np.ndarray, np.ndarray]:
        block = np.empty((3, len(flat)), np.int32)
        block[0], block[1] = slots, pos
        if self.token_ids is not None:
            block[2] = self.token_ids[flat]
        return block, flat

    @staticmethod
    def _expand(slots, flat0, pos0, length, src0):
        """Rows of segments [start, start + length) per plan: (slots, flat rows, positions, source rows)."""
        if len(length) == int(length.sum()):  # one row each: nothing to expand
            return slots, flat0, pos0, src0
        rep = np.repeat(np.arange(len(length)), length)
        off = np.arange(len(rep)) - np.repeat(np.cumsum(length) - length, length)
        return slots[rep], flat0[rep] + off, pos0[rep] + off, src0[rep] + off

    def rows(self, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """All captured rows of the plans in `sel`, in batch order: (row table, flat rows)."""
        key = b"r" + sel.tobytes()
        got = self._cache.get(key)
        if got is None:
            lo = self.lo[sel]
            slots, flat, pos, _ = self._expand(sel, lo, self.first[sel], self.len[sel], lo)
            got = self._cache[key] = self._table(slots, flat, pos)
        return got

    def logit_rows(self, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Logit rows of the plans in `sel`: first those of the extra lm-head pass, then the sampled
        rows. (row table, flat rows, extra-pass rows, sampled logits rows)."""
        if self.single:
            return (*self.rows(sel), _NO_ROWS, self.row[sel])
        key = b"l" + sel.tobytes()
        got = self._cache.get(key)
        if got is None:
            k = self.len[sel] - self.sampled[sel]
            e = sel[k > 0]
            es, ef, ep, ex = self._expand(e, self.lo[e], self.first[e], k[k > 0], self.extra_at[e])
            s = sel[self.sampled[sel]]
            last = self.len[s] - 1
            block, flat = self._table(np.concatenate((es, s)), np.concatenate((ef, self.lo[s] + last)),
                                      np.concatenate((ep, self.first[s] + last)))
            got = self._cache[key] = (block, flat, ex, self.row[s])
        return got


class _DecodeLayout:
    """What stays the same from one decode step to the next while the batch does: which batch rows
    hold capturing requests, their request table and parts, and the row table's buffer (slots fixed;
    positions and token ids filled each step); and, when every capturing request asks the same
    tensors, the steady step's record (hooks/steady_step.py). Valid for the core's request version
    and a batch of these request ids in this order (or, the ids having changed, the same batch row
    for each capturing request)."""

    def __init__(self, core: "CaptureCore", rows: list, view: StepView):
        self.version = core._version
        self.rows = rows
        self.req_ids = view.req_ids[:]  # a copy made in C (V1 changes its list in place)
        reqs = core.requests
        found = sorted((i, reqs[rid]) for rid, i in zip(core._rids, rows) if i is not None)
        # Every request in the batch must have one row (no extra lm-head rows); those with parts
        # must be live (they are the plans).
        self.present = np.array([i for i, _ in found], dtype=np.int64)
        self.present1 = self.present + 1
        with_parts = [(i, r) for i, r in found if r.parts]
        self.n = n = len(with_parts)
        self.idx = np.array([i for i, _ in with_parts], dtype=np.int64)
        self.run = slice(int(self.idx[0]), int(self.idx[-1]) + 1) if n and self.idx[-1] - self.idx[0] + 1 == n else None
        self.live_lo = np.array([r.live[0] for _, r in with_parts], dtype=np.int64)
        self.live_span = np.array([r.live[1] - r.live[0] for _, r in with_parts], dtype=np.int64).view(np.uint64)
        self.live = np.empty(n, np.int64)  # each step's c - lo, and whether it is below the span
        self.live_ok = np.empty(n, bool)
        self.block = np.zeros((3, n), np.int32)
        self.block[0] = np.arange(n)
        plans = [_Plan(i, r, 0, 0, 1, True, 0) for i, r in with_parts]
        self.table, self.by_part = core._parts_of(plans) if n else (None, [])
        self.everyone = self.by_part[0][1] if self.by_part and len(self.by_part[0][1]) == n else np.arange(n)
        for k, (part, sel) in enumerate(self.by_part):
            if len(sel) == n:
                self.by_part[k] = (part, self.everyone)
        self.wants_logits = any(part.what in LOGIT_PARTS for part, _ in self.by_part)
        self.steady: SteadyRecord | None = None
        self.steady_tried = False
        if n:
            self.try_steady(core, view)

    def try_steady(self, core: "CaptureCore", view: StepView) -> None:
        """Lay out the steady step's record (once; again when it waited for the logits' width)."""
        self.steady = SteadyRecord.build(core, self.table, self.by_part, self.block, self.idx, view)
        # Under V2 the logits appear after the step is planned: a batch laid out before any logits
        # were seen tries again once they have been.
        self.steady_tried = self.steady is not None or not self.wants_logits or core.logits_like is not None


class _DecodeRows:
    """A decode step's row tables: one row per plan, the sampled one (same interface as _StepRows).
    `flat` may be int32 (a view of the runner's query starts): index_select takes int32 indices."""

    __slots__ = ("block", "flat", "batch_rows", "everyone")

    def __init__(self, block: np.ndarray, flat: np.ndarray, batch_rows: np.ndarray, everyone: np.ndarray):
        self.block, self.flat, self.batch_rows, self.everyone = block, flat, batch_rows, everyone

    def rows(self, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if sel is self.everyone:
            return self.block, self.flat
        return np.ascontiguousarray(self.block[:, sel]), self.flat[sel]

    def logit_rows(self, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        block, flat = self.rows(sel)
        return block, flat, _NO_ROWS, self.batch_rows if sel is self.everyone else self.batch_rows[sel]


def _grouped(by_part: list, which) -> list:
    """The parts `which(part.what)` selects, grouped by the requests (sel) that ask for them, in
    order: [(sel, [parts])]. Each group becomes one record."""
    groups: dict[bytes, tuple[np.ndarray, list]] = {}
    for part, sel in by_part:
        if which(part.what):
            key = sel.tobytes()
            got = groups.get(key)
            if got is None:
                groups[key] = (sel, [part])
            else:
                got[1].append(part)
    return list(groups.values())


def _pick(segments: list, mine: np.ndarray) -> list:
    """The segments (tensor, rows or None = all) restricted to the record rows `mine` (ascending)."""
    lengths = [len(i) if i is not None else t.shape[0] for t, i in segments]
    seg_of_row = np.repeat(np.arange(len(segments)), lengths)
    seg_start = np.cumsum([0] + lengths)
    out = []
    for k, (t, i) in enumerate(segments):
        at = mine[seg_of_row[mine] == k] - seg_start[k]
        if len(at):
            out.append((t, at if i is None else i[at]))
    return out


class _Reduced:
    """The top-k and chosen-index parts' shared work: one gather of every logit row they need, one
    logsumexp and one top-k (at the largest k) for all of them; each record then takes its rows."""

    def __init__(self, step: "CaptureStep", parts: list, logits, extra):
        sels = [sel for _, sel in parts]
        self.same = all(s is sels[0] or np.array_equal(s, sels[0]) for s in sels)  # the usual case: one spec
        union = sels[0] if self.same else np.unique(np.concatenate(sels))
        self.block, _, segments = step._segments(union, logits, extra)
        blocks = [gather_rows(t, i, step.core.to_device) for t, i in segments]
        self.rows = blocks[0] if len(blocks) == 1 else torch.cat(blocks)  # cat would copy even one
        # k=1 for chosen parts alone: the row's largest element, which the logsumexp reads at
        # (torch.argmax is ~10x slower than this on the CPU).
        kmax = max((p.topk for p, _ in parts if p.what == "topk"), default=1)
        self.top = topk_rows(self.rows, kmax)
        self.lse = logsumexp_rows(self.rows, self.top[1])
        self._to_device = step.core.to_device

    def taker(self, sel: np.ndarray, block: np.ndarray):
        """A function taking the rows of `block` (a record's row table) out of the reduced rows."""
        if self.same:
            return lambda t: t
        pick = self._to_device(_rows_within(self.block, block))
        return lambda t: t.index_select(0, pick)


def _rows_source(src: torch.Tensor, flat: np.ndarray, to_device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tensor, index) of src's rows `flat` as DeviceReducer.run_rows takes them: a slice and no index
    when they are one run (a decode batch, a prefill chunk), else src and the rows on its device."""
    a, b = int(flat[0]), int(flat[-1])
    if b - a + 1 == len(flat):
        return src[a:b + 1], None
    return src, to_device(np.ascontiguousarray(flat, dtype=np.int64))


def _rows_within(block: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """Indices into `block`'s rows of `sub`'s rows (row tables: slot, position, id); every row of
    sub is in block. Vectorised: a row is its (slot, position)."""
    keys = block[0].astype(np.int64) << 32 | block[1].astype(np.int64)
    want = sub[0].astype(np.int64) << 32 | sub[1].astype(np.int64)
    order = np.argsort(keys, kind="stable")
    return order[np.searchsorted(keys[order], want)]


class CaptureCore:
    """Per worker: the requests it captures for, and each step's records into its ring."""

    def __init__(self, writer: RingWriter, place: RankPlace, publisher: Publisher, *,
                 model_dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                 max_record_bytes: int | None = None, shed_at: float = DEFAULT_SHED_AT,
                 reducers: dict[str, DeviceReducer] | None = None, reducer_layers: dict[str, int] | None = None):
        """reducers: those this rank runs (on tensor-parallel rank 0 of the stage holding their layer),
        by name; reducer_layers: every reducer the server declares, by name, with the layer it reads."""
        self.writer = writer
        self.admission = Admission(writer, shed_at)
        self.place = place
        self.publisher = publisher
        self.model_dtype = model_dtype
        self.device = torch.device(device)
        # Row indices for gathers on the device, uploaded once per distinct batch layout.
        self.to_device = DeviceIndices(self.device) if self.device.type != "cpu" else torch.from_numpy
        self.cost = StepCost(drops=self.records_dropped, shed=lambda: self.admission.shed,
                             thread=lambda: (getattr(publisher, "thread_ns", 0), getattr(publisher, "thread_wakes", 0)),
                             steady=lambda: self.steady_steps)
        self.steady_steps = 0  # capturing steps written the steady way
        self.tp_rank, self.tp_size = place.tp_rank, place.tp_size
        # This rank's share of what its stage writes (the last dimension split among the stage's
        # writers), or None: another rank of its stage writes it all (hooks/step_view.RankPlace).
        self.share, self.shares = place.share, place.shares
        self.is_last_stage = place.is_last_stage
        self.layers = place.layers
        self.aux_index = {layer: i for i, layer in enumerate(self.layers)}
        self.reducers = dict(reducers or {})
        self.reducer_layers = dict(reducer_layers or {r.name: r.layer for r in self.reducers.values()})
        # A step's rows of one tensor share a record up to this size; beyond it they are split by
        # request, so one huge batch (many prefill chunks of full logits) cannot outgrow the ring.
        self.max_record_bytes = max_record_bytes or max(writer.capacity // 8, 1 << 16)
        # The capturing requests only, by id: their number, not the batch's, sets a step's cost.
        self.requests: dict[str, _Request] = {}
        self._contributors: dict[CaptureSpec, int] = {}
        self._parts: dict[CaptureSpec, tuple[Part, ...]] = {}
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}
        self.step = 0
        # Changes whenever the set of capturing requests does: the decode layout below is valid
        # for one version and one placement of those requests in the batch.
        self._version = 0
        self._rids: list[str] = []
        self._rids_version = -1
        self._decode: _DecodeLayout | None = None
        # (width, dtype) of the last logits a step wrote: a steady record is laid out before V2's
        # logits of its first step appear.
        self.logits_like: tuple[int, torch.dtype] | None = None

    # -- requests --

    def learn(self, rid: str, extra_args: dict | None, num_prompt: int) -> None:
        """A request the runner admitted (again, after a preemption): work out what it captures, and
        whether this worker takes the capture on (hooks/admission.py)."""
        req = self._request(rid, extra_args, num_prompt)
        if req is None:
            self.forget(rid)  # a re-used id that captured before does not now
        elif req.parts and not self.admission.admit(rid, req.spec, num_prompt):
            self.forget(rid)
            self.cost.poll()  # shedding may go on with no capturing step to carry the log line
        else:
            self.requests[rid] = req
            self._version += 1

    def forget(self, rid: str) -> None:
        if self.requests.pop(rid, None) is not None:
            self._version += 1

    def _request(self, rid: str, extra: dict | None, num_prompt: int) -> _Request | None:
        if not extra or SPEC_EXTRA_ARG not in extra:
            return None
        try:
            spec = CaptureSpec.from_meta(extra[SPEC_EXTRA_ARG])
            parts = self.parts(spec)
            first = spec.first_position(num_prompt)
            ref = RequestRef(rid, spec.key, num_prompt, self.contributors(spec),
                             tensors_per_step(parts), -1 if first is None else first,
                             spec.tail, spec.source)
            return _Request(spec, parts, spec.live_range(num_prompt), ref, ref.packed())
        except Exception as e:  # noqa: BLE001 - a malformed internal spec: no capture for it
            guard.errors().error(f"capture spec of request {rid!r}", e)
            return None

    def parts(self, spec: CaptureSpec) -> tuple[Part, ...]:
        """The records this rank writes for a request with this spec each step it captures."""
        got = self._parts.get(spec)
        if got is None:
            # A float32 model's tensors already are float32: such requests share records with the rest.
            to_f32 = spec.dtype == DTypeMode.FLOAT32 and self.model_dtype != torch.float32
            out = []
            if self.share is None:
                pass  # another rank of this stage writes what it captures
            elif self.is_last_stage and spec.logits == LogitsMode.FULL:
                out.append(Part("logits", to_f32))
            elif self.is_last_stage and self.share == 0:
                # Small, and needs the whole row: the stage's first writer writes it whole.
                if spec.logits == LogitsMode.TOPK:
                    out.append(Part("topk", to_f32, topk=spec.topk))
                elif spec.logits == LogitsMode.INDICES:
                    out.append(Part("chosen", to_f32, indices=tuple(spec.indices)))
            if self.share is not None:
                out.extend(Part("hidden", to_f32, layer=x) for x in spec.layers if x in self.aux_index)
            for slot, name in enumerate(spec.reducers):
                red = self.reducers.get(name)
                if red is not None and red.layer in self.aux_index:
                    out.append(Part("latents" if red.latents else "probe", layer=red.layer, reducer=name, slot=slot))
                elif name not in self.reducer_layers:
                    # The API process checked the name against the same settings: it should not happen.
                    guard.errors().error(f"capture spec naming reducer {name!r}",
                                         KeyError(f"no reducer {name!r} is declared"))
            got = self._parts[spec] = tuple(out)
        return got

    def contributors(self, spec: CaptureSpec) -> int:
        """How many ranks write records for one of this request's steps (the same on every rank).

        A stage whose part is sharded (full logits, hidden states) has all its writers write (every
        tp rank, or those on the engine's home host); a stage with only whole small tensors (top-k,
        chosen indices, reducers' outputs) has just its first writer.
        """
        n = self._contributors.get(spec)
        if n is None:
            n = 0
            last = self.place.pp_size - 1
            reads = {self.reducer_layers[r] for r in spec.reducers if r in self.reducer_layers}
            for s, layers in enumerate(self.place.stage_layers):
                sharded = any(x in layers for x in spec.layers) or (s == last and spec.logits == LogitsMode.FULL)
                whole = (s == last and spec.logits in (LogitsMode.TOPK, LogitsMode.INDICES)) or \
                    any(x in layers for x in reads)
                n += len(self.place.stage_writers(s)) if sharded else int(whole)
            self._contributors[spec] = n
        return n

    # -- steps --

    def capture(self, view: StepView) -> None:
        """A whole step at once (the runner has every tensor now)."""
        step = self.begin(view)
        if step is None:
            return
        try:
            step.write_states()
            if self.is_last_stage:
                step.write_logits(view.logits)
        except BaseException:
            step.abandon()
            raise
        self.end(step)

    def begin(self, view: StepView) -> "CaptureStep | SteadyStep | None":
        """Plan a step; None when no request captures anything in it."""
        self.step += 1
        if view.finished:
            for rid in view.finished:
                self.forget(rid)
        if not self.requests:
            return None  # nobody captures: nothing per request, nothing per row
        lay = self._decode
        rows = None
        # The same request ids in the same order (compared in C, whatever the batch's size): every
        # capturing request is at its batch row of the last step, with no lookup.
        if lay is None or lay.version != self._version or lay.req_ids != view.req_ids:
            rows = self._rows_of(view)
            lay = self._layout_for(view, rows)
        if lay is not None:
            got = self._decode_step(view, lay)
            if got is not None:
                return got or None
            if rows is None:
                rows = self._rows_of(view)
        plans, extra_rows, single = self._plan(view, rows)
        if not plans and not extra_rows:
            return None
        host = view.token_ids if isinstance(view.token_ids, np.ndarray) else None
        table, by_part = self._parts_of(plans)
        return CaptureStep(self, view, _StepRows(plans, host, single), table, by_part, extra_rows)

    def _parts_of(self, plans: list[_Plan]) -> tuple[RequestTable, list[tuple[Part, np.ndarray]]]:
        """The step's request table, and each part with the plans (by index) that ask for it.
        Requests asking for the same part (the usual case: all of them) share its record."""
        table = RequestTable([p.req.ref for p in plans], [p.req.packed for p in plans])
        by_part: dict[Part, list[int]] = {}
        for j, plan in enumerate(plans):
            for part in plan.req.parts:
                got = by_part.get(part)
                if got is None:
                    by_part[part] = [j]
                else:
                    got.append(j)
        everyone = np.arange(len(plans))
        return table, [(part, everyone if len(js) == len(plans) else np.array(js, dtype=np.int64))
                       for part, js in by_part.items()]

    def _rows_of(self, view: StepView) -> list:
        """The batch row of each capturing request (None: not in this step), in `_rids` order: one
        lookup per capturing request, whatever the batch holds besides."""
        if self._rids_version != self._version:
            self._rids = list(self.requests)
            self._rids_version = self._version
        row_of = view.row_of
        if row_of is None:
            row_of = dict(zip(view.req_ids, range(len(view.req_ids))))
        many = getattr(row_of, "many", None)
        if many is not None:
            return many(self._rids)
        return [row_of.get(rid) for rid in self._rids]

    def _layout_for(self, view: StepView, rows: list) -> "_DecodeLayout | None":
        """The decode layout of a batch whose request ids changed: the last one when every
        capturing request kept its batch row, else a new one if the step is a decode step (None
        when it is not: a batch that changes and mixes in prefill chunks has no layout worth keeping)."""
        lay = self._decode
        if lay is not None and lay.version == self._version and lay.rows == rows:
            lay.req_ids = view.req_ids[:]
            return lay
        nreq = len(view.req_ids)
        if view.query_start[nreq] != nreq:
            return None
        lay = self._decode = _DecodeLayout(self, rows, view)
        return lay

    def _decode_step(self, view: StepView, lay: _DecodeLayout) -> "CaptureStep | SteadyStep | bool | None":
        """A decode step of an unchanged batch, planned from its layout: every capturing request in
        the batch has one scheduled row, the sampled one, inside its live range. The step (or
        False: no record to write); None when the step is not such a step."""
        qsl = view.query_start
        nreq = len(view.req_ids)
        all_single = int(qsl[nreq]) == nreq  # as many rows as requests: every request has one
        if not all_single and len(lay.present) and not (qsl[lay.present1] - qsl[lay.present] == 1).all():
            return None  # a prefill chunk (or several tokens) of ours in the step: the general plan
        if lay.n == 0:
            return False
        at = lay.idx if lay.run is None else lay.run  # a run of batch rows (the usual case): views
        c = view.computed[at]
        # lo <= c < hi for each, as one unsigned comparison: c - lo wraps to a huge value below lo.
        live = lay.live
        np.subtract(c, lay.live_lo, out=live)
        if not np.less(live.view(np.uint64), lay.live_span, out=lay.live_ok).all():
            return None
        block = lay.block
        block[1] = c
        host = view.token_ids if isinstance(view.token_ids, np.ndarray) else None
        # With every request one row, the batch rows are the token rows.
        flat = None if all_single else qsl[at]
        if host is not None:
            block[2] = host[at if flat is None else flat]
        if not lay.steady_tried and self.logits_like is not None:
            lay.try_steady(self, view)
        steady = lay.steady
        if steady is not None and steady.device_ids is (host is None):
            return steady.start(view, flat) or False
        q = qsl[at] if flat is None else flat
        return CaptureStep(self, view, _DecodeRows(block, q, lay.idx, lay.everyone), lay.table, lay.by_part, [],
                           lay.wants_logits)

    def forget_steady(self) -> None:
        """The steady record of the current batch no longer fits its steps: the general path writes
        them until the batch changes."""
        if self._decode is not None:
            self._decode.steady = None
            self._decode.steady_tried = True

    def end(self, step: "CaptureStep") -> None:
        step.finish()

    def _plan(self, view: StepView, rows: list) -> tuple[list[_Plan], list[np.ndarray], bool]:
        """The step's capturing requests, the rows of the extra lm-head pass, and whether every
        plan is one sampled row (a decode step)."""
        reqs = self.requests
        found = [(i, reqs[rid]) for rid, i in zip(self._rids, rows) if i is not None]
        if not found:
            return [], [], True
        found.sort(key=_first)  # batch order: row tables and gathers take rows ascending
        qsl = view.query_start
        computed = view.computed
        plans, extra_rows, extra_n, single = [], [], 0, True
        logits_here = self.is_last_stage
        for i, req in found:
            r0, r1, c = int(qsl[i]), int(qsl[i + 1]), int(computed[i])
            a, b = req.live
            lo, hi = max(a, c), min(b, c + r1 - r0)
            if lo >= hi:
                continue
            row_lo, row_hi = r0 + lo - c, r0 + hi - c
            sampled = row_hi == r1
            at = extra_n
            if logits_here and req.spec.logits != LogitsMode.NONE:
                # Rows other than the sampled one have no logits yet: one extra lm-head pass. It is a
                # collective, so it covers them on every TP rank, whether or not this rank writes them.
                k = row_hi - row_lo - int(sampled)
                if k:
                    extra_rows.append(np.arange(row_lo, row_lo + k))
                    extra_n += k
            if req.parts:
                single = single and sampled and row_hi - row_lo == 1
                plans.append(_Plan(i, req, lo, row_lo, row_hi, sampled, at))
        return plans, extra_rows, single

    def shard_of(self, dim: int) -> tuple[int, int]:
        """This rank's [start, stop) of a last dimension of `dim`."""
        return shard(dim, self.share, self.shares) if self.shares > 1 else (0, dim)

    def _shard(self, src: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int], int]:
        full = src.shape[-1]
        if self.shares == 1:
            return src, (0, full), full
        s0, s1 = shard(full, self.share, self.shares)
        return src[:, s0:s1], (s0, s1), full

    def _indices_tensor(self, indices: tuple[int, ...]) -> torch.Tensor:
        t = self._indices.get(indices)
        if t is None:
            t = self._indices[indices] = torch.tensor(indices, dtype=torch.long, device=self.device)
        return t

    def records_dropped(self) -> int:
        return self.writer.stats()["records_dropped"] + getattr(self.publisher, "staging_drops", 0)

    def close(self) -> None:
        self.publisher.close()


class CaptureStep:
    """One planned step: its row tables and request table, and which of its records are written."""

    def __init__(self, core: CaptureCore, view: StepView, rows: "_StepRows | _DecodeRows", table: RequestTable,
                 by_part: list[tuple[Part, np.ndarray]], extra_rows: list[np.ndarray], wants_logits: bool | None = None):
        self.core = core
        self.view = view
        ids = view.token_ids
        # Host ids go into the ring with the row table; a tensor's are gathered by the publisher.
        self.device_ids = None if isinstance(ids, np.ndarray) else ids
        self.extra_rows = extra_rows
        self.rows = rows
        self.table = table
        self.by_part = by_part
        # Logits to write, or an extra lm-head pass to run (a collective) even with none to write.
        self.wants_logits = (bool(extra_rows) or any(part.what in LOGIT_PARTS for part, _ in by_part)
                             if wants_logits is None else wants_logits)
        self.logits_done = False
        self.logits_ns = 0  # host time of write_logits (the V2 adapter counts it in the step's cost)
        self.closed = False

    # -- writing --

    def write_states(self) -> None:
        """The parts read from the layers' rows: one record per set of requests that asks for them (the
        usual case: one record for the step), a section per layer, and per reducer output (a reducer runs
        on its layer's rows here, into new tensors the record is then filled from)."""
        core = self.core
        for sel, parts in _grouped(self.by_part, lambda what: what in STATE_PARTS):
            block, flat = self.rows.rows(sel)
            sections, fills = [], []
            for part in parts:
                aux = self.view.aux[core.aux_index[part.layer]]
                if part.what == "hidden":
                    src, sl, full = core._shard(aux)
                    sections.append(section(hidden_id(part.layer), stored_dtype(src, part.to_f32), sl, full))
                    fills.append([(src, flat)])
                    continue
                red = core.reducers[part.reducer]
                outs = red.new_outputs(len(flat), aux.device)
                red.run_rows(*_rows_source(aux, flat, core.to_device), outs)
                for tid, out in zip(reducer_ids(part), outs):
                    sections.append(section(tid, out.dtype, (0, red.width), red.width))
                    fills.append([(out, None)])
            self._write(sections, fills, block, flat)

    def write_logits(self, logits: torch.Tensor | None) -> None:
        """The step's sampled logits rows (one per request, batch order), raw: write the logits parts,
        one record per set of requests that asks for the same part (the usual case: one), its
        sections the part's tensors (full logits; top-k ids, values and logsumexp; chosen values and
        logsumexp). Runs the extra lm-head pass for rows that have no logits yet."""
        if self.logits_done or not self.wants_logits:
            return
        self.logits_done = True
        core = self.core
        if logits is not None:
            core.logits_like = (logits.shape[-1], logits.dtype)
        extra = None
        if self.extra_rows:
            idx = np.concatenate(self.extra_rows)
            extra = self.view.compute_logits(gather_rows(self.view.hidden, idx, core.to_device))
        small = [(part, sel) for part, sel in self.by_part if part.what in ("topk", "chosen")]
        reduced = _Reduced(self, small, logits, extra) if small else None
        for sel, parts in _grouped(self.by_part, lambda what: what in LOGIT_PARTS):
            block, flat, segments = self._segments(sel, logits, extra)
            sections, fills = [], []
            lse = None
            for part in parts:
                if part.what == "logits":
                    sharded = [(core._shard(t)[0], i) for t, i in segments]
                    _, sl, full = core._shard(logits if logits is not None else extra)
                    sections.append(section(LOGITS_ID, stored_dtype(sharded[0][0], part.to_f32), sl, full))
                    fills.append(sharded)
                    continue
                take = reduced.taker(sel, block)
                if part.what == "topk":
                    k = part.topk
                    values = reduced.top[0][:, :k]
                    sections += [section(TOPK_IDS_ID, torch.int32, (0, k), k),
                                 section(TOPK_VALUES_ID, stored_dtype(values, part.to_f32), (0, k), k)]
                    fills += [[(take(reduced.top[1][:, :k]), None)], [(take(values), None)]]
                else:
                    chosen = take(reduced.rows)[:, core._indices_tensor(part.indices)]
                    k = chosen.shape[-1]
                    sections.append(section(CHOSEN_ID, stored_dtype(chosen, part.to_f32), (0, k), k))
                    fills.append([(chosen, None)])
                lse = take(reduced.lse)
            if lse is not None:  # once per record: the row's logsumexp is the same whatever the part
                sections.append(section(LSE_ID, torch.float32, (0, 1), 1))
                fills.append([(lse, None)])
            self._write(sections, fills, block, flat)

    def _segments(self, sel: np.ndarray, logits, extra):
        block, flat, extra_idx, sampled_idx = self.rows.logit_rows(sel)
        segments = []
        if len(extra_idx):
            segments.append((extra, extra_idx))
        if len(sampled_idx):
            segments.append((logits, sampled_idx))
        return block, flat, segments

    def _write(self, sections: list[RecordSection], fills: list, block: np.ndarray, flat: np.ndarray) -> None:
        """One record of `block`'s rows, a section per tensor; fills[i]: section i's segments. The copy into the ring
        (or staging) converts to the storage dtype, so no converted temporary is made first."""
        core = self.core
        n = block.shape[1]
        if n > 1 and n * sum(sec.width * sec.dtype.itemsize for sec in sections) > core.max_record_bytes:
            # Too big to share a record (many prefill chunks of full logits): one per request.
            self._write_split(sections, fills, block, flat)
            return
        core.publisher.write(self.table, block, tuple(sections), fills, step=core.step,
                             device_ids=None if self.device_ids is None else (self.device_ids, flat))

    def _write_split(self, sections: list[RecordSection], fills: list, block: np.ndarray, flat: np.ndarray) -> None:
        """A record's rows written as one record per request (its rows picked out of each segment)."""
        for slot in np.unique(block[0]).tolist():
            mine = np.flatnonzero(block[0] == slot)
            sub = np.ascontiguousarray(block[:, mine])
            self.core.publisher.write(self.table, sub, tuple(sections), [_pick(segs, mine) for segs in fills],
                                      step=self.core.step,
                                      device_ids=None if self.device_ids is None else (self.device_ids, flat[mine]))

    # -- ending --

    def _report_parts(self, which) -> None:
        """DROP records for the rows of the parts `which(part)` selects: they will never arrive."""
        core = self.core
        for part, sel in self.by_part:
            if not which(part):
                continue
            block = self.rows.rows(sel)[0] if part.what in STATE_PARTS else self.rows.logit_rows(sel)[0]
            for tid in tensor_ids(part):
                report_drop(core.writer, self.table, block, tid)

    def finish(self) -> None:
        if self.closed:
            return
        if self.wants_logits and not self.logits_done and self.core.is_last_stage:
            # The runner never produced this step's logits (it should not happen): say so.
            self.logits_done = True
            self._report_parts(lambda p: p.what in LOGIT_PARTS)
        self.core.publisher.end_step()
        self.closed = True  # only now: if publishing failed, abandon() still gives the records up
        self.core.writer.flush()

    def abandon(self) -> None:
        """Our code failed mid-step: nothing of it is published; its rows are reported lost."""
        if self.closed:
            return
        self.closed = True
        self.core.publisher.abandon_step()
        self._report_parts(lambda p: True)
        self.core.writer.flush()
