"""The steady decode step: every capturing request decodes one row in a batch unchanged since the
last step, and the step is written as one record by a few torch calls.

This is the step that dominates serving, and on a GPU each torch call is a launch and each
microsecond of Python is the step thread's, so everything that does not change from step to step
is worked out once, when the batch changes (`SteadyRecord`), and a step only fills in what does
(`SteadyStep`):

    per batch   the record's header, request table and section table (the ring writer's
                PreparedRecord); the rows to gather, as device indices; where each tensor goes
                (the publisher's FixedRecord: under the staged publisher a few staging blocks, laid
                out like the ring record, whose views are made once); the top-k buffers
    per step    positions (and host token ids) into the row table; one reservation; then one
                torch call per tensor into its destination (index_select with out=, or one copy
                when the rows are the whole tensor); for top-k: topk, the ids' copy to int32,
                log_softmax, gather, sub (the row's logsumexp, as vLLM's logprobs compute it); and
                under the staged publisher one device-to-host copy and one event for the record

A step is one record: its hidden-state and reducer sections first (written when the runner has the
layers' rows; a reducer runs on rows the record already holds in float32 when it can, else on its
layer's, straight into its sections: hooks/reducer_ops.py), then its logits sections (written when
the logits appear: V2 computes them later, inside sample()). Torch calls per step, counted by
tests/hooks/test_hook_ops.py with the token ids on the device: full logits + 2 layers 5 on the step thread (4 gathers, the ring view) and the record's copy; top-20 8
(the ids' gather, topk, the ids' copy to int32, the conversion to float32, log_softmax, gather,
sub, the ring view) and the copy. (On CUDA the copy is issued from the step thread too; a float16
model's log_softmax needs no conversion first.)

It holds only while every capturing request asks for the same parts (one record fits them all)
and the record fits the publisher's blocks; otherwise, and for every step that is not such a step
(a prefill chunk of ours, a request joining, leaving or moving), the capture core takes its
general path. Nothing here syncs with the device.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from vllm_tap.ring_records import RequestTable
from vllm_tap.ring_writer import RingWriter

from .parts import (CHOSEN_ID, LOGIT_PARTS, LOGITS_ID, LSE_ID, STATE_PARTS, TOPK_IDS_ID, TOPK_VALUES_ID, hidden_id,
                    reducer_ids, section, stored_dtype)
from .publisher import report_drop
from .reductions import log_softmax_f32, topk_into
from .step_view import StepView


class Core(Protocol):
    """What a steady record needs of the capture core (hooks/capture_core.py)."""

    writer: RingWriter
    publisher: Any  # hooks/publisher.py: Publisher or StagedPublisher
    device: torch.device
    step: int
    steady_steps: int
    shares: int  # writers of this rank's stage, among which the last dimension is split
    is_last_stage: bool
    max_record_bytes: int
    aux_index: dict[int, int]
    reducers: dict[str, Any]  # hooks/reducer_ops.py DeviceReducer by name
    logits_like: tuple[int, torch.dtype] | None

    def to_device(self, index: np.ndarray) -> torch.Tensor: ...

    def shard_of(self, dim: int) -> tuple[int, int]: ...

    def _shard(self, src: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int], int]: ...

    def _indices_tensor(self, indices: tuple[int, ...]) -> torch.Tensor: ...

    def forget_steady(self) -> None: ...


def _take(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, whole: bool) -> None:
    """dst <- rows `index` of src (whole: src's rows are exactly those rows): one call when the
    dtypes agree, converting otherwise."""
    if whole and src.shape[0] == dst.shape[0]:
        dst.copy_(src)
    elif dst.dtype == src.dtype:
        torch.index_select(src, 0, index, out=dst)
    else:
        dst.copy_(torch.index_select(src, 0, index))


class SteadyRecord:
    """One batch's steady step, worked out when the batch last changed. `build` returns None when
    the batch cannot take the steady way (then the general path writes its steps)."""

    __slots__ = ("core", "fixed", "table", "block", "n", "whole", "rows_dev", "states", "reducers", "logits_fill",
                 "topk", "vocab", "logits_dtype", "tids", "wants_logits", "device_ids")

    @classmethod
    def build(cls, core: Core, table: RequestTable, by_part: list, block: np.ndarray, batch_rows: np.ndarray,
              view: StepView) -> "SteadyRecord | None":
        n = block.shape[1]
        if not n or any(len(sel) != n for _, sel in by_part):
            return None  # requests asking different tensors: several records a step
        parts = [p for p, _ in by_part]
        logit_parts = [p for p in parts if p.what in LOGIT_PARTS]
        if logit_parts and view.logits is not None:
            vocab, ldtype = view.logits.shape[-1], view.logits.dtype
        elif logit_parts:
            if core.logits_like is None:
                return None  # no logits seen yet (V2 computes them later): their width is not known
            vocab, ldtype = core.logits_like
        if any(p.what in STATE_PARTS for p in parts) and view.aux is None:
            return None
        rec = cls.__new__(cls)
        rec.core, rec.table, rec.block, rec.n = core, table, block, n
        rec.whole = bool(batch_rows[0] == 0 and batch_rows[-1] == n - 1)  # rows 0..n-1: whole tensors
        rec.rows_dev = core.to_device(batch_rows)
        sections, rec.states, rec.reducers = [], [], []
        float_rows = {}  # layer -> the record's section holding its whole rows in float32 (a reducer's input)
        for p in parts:
            if p.what == "hidden":
                i = core.aux_index[p.layer]
                src, sl, full = core._shard(view.aux[i])
                rec.states.append((i, len(sections) + 1, sl if core.shares > 1 else None))
                stored = stored_dtype(src, p.to_f32)
                if stored == torch.float32 and core.shares == 1:
                    float_rows[p.layer] = len(sections) + 1
                sections.append(section(hidden_id(p.layer), stored, sl, full))
        for p in parts:
            if p.what in STATE_PARTS and p.what != "hidden":
                red = core.reducers[p.reducer]
                outs = []
                for tid, dtype in zip(reducer_ids(p), red.out_dtypes):
                    outs.append(len(sections) + 1)
                    sections.append(section(tid, dtype, (0, red.width), red.width))
                rec.reducers.append((red, core.aux_index[p.layer], float_rows.get(p.layer), tuple(outs)))
        rec.logits_fill = rec.topk = None
        rec.vocab = rec.logits_dtype = None
        derive = None
        for p in logit_parts:
            rec.vocab, rec.logits_dtype = vocab, ldtype
            stored = stored_dtype(ldtype, p.to_f32)
            if p.what == "logits":
                sl = core.shard_of(vocab)
                rec.logits_fill = (len(sections) + 1, sl if core.shares > 1 else None)
                sections.append(section(LOGITS_ID, stored, sl, vocab))
                continue
            # top-k or chosen ids: their ids, values and the row's logsumexp (k=1 for chosen ids: the
            # row's largest element, where the logsumexp is read).
            k = p.topk if p.what == "topk" else 1
            at = len(sections) + 1
            ids = torch.empty((n, k), dtype=torch.long, device=core.device)
            direct = p.what == "topk" and stored == ldtype  # topk writes its values into the record
            values = None if direct else torch.empty((n, k), dtype=ldtype, device=core.device)
            if p.what == "topk":
                sections += [section(TOPK_IDS_ID, torch.int32, (0, k), k), section(TOPK_VALUES_ID, stored, (0, k), k)]
                chosen = None
            else:
                chosen = core._indices_tensor(p.indices)
                sections.append(section(CHOSEN_ID, stored, (0, len(p.indices)), len(p.indices)))
            sections.append(section(LSE_ID, torch.float32, (0, 1), 1))
            lse_at = len(sections)
            rec.topk = (k, at, direct, chosen, lse_at, ids, ids[:, :1], values, None if direct else values[:, :1])
            if direct:
                derive = (lambda dests, v=at + 1: dests[v][:, :1])  # the values' first column, per block
        nbytes = n * sum(sec.width * sec.dtype.itemsize for sec in sections)
        if n > 1 and nbytes > core.max_record_bytes:
            return None  # the general path splits it by request
        prep = core.writer.prepare_record(table, n, tuple(sections))
        device_ids = not isinstance(view.token_ids, np.ndarray)
        rec.fixed = core.publisher.fixed_record(prep, n, [sec.dtype for sec in sections], device_ids, derive)
        if rec.fixed is None:
            return None
        rec.tids = [sec.tensor for sec in sections]
        rec.wants_logits = bool(logit_parts)
        rec.device_ids = device_ids  # the token ids are a device tensor (gathered into the record)
        return rec

    def start(self, view: StepView, flat: np.ndarray | None) -> "SteadyStep | None":
        """This step's record, its row table filled (flat: the rows' indices in the step's tokens
        when they are not the batch rows, i.e. others' prefill chunks share the step). None when it
        was dropped (reported)."""
        core = self.core
        got = core.publisher.reserve_fixed(self.fixed, self.table, self.block, core.step)
        if got is None:
            core.publisher.end_step()  # a record the publisher made PAD is committed in order
            core.writer.flush()
            return None
        core.steady_steps += 1
        dests, derived = got
        if flat is None:
            return SteadyStep(self, view, dests, derived, self.rows_dev, self.whole)
        return SteadyStep(self, view, dests, derived, core.to_device(flat), False)


class SteadyStep:
    """One steady step's record: `write_states`, `write_logits`, then `finish` (or `abandon`), the
    interface of the general path's CaptureStep."""

    __slots__ = ("rec", "view", "dests", "derived", "flat", "whole", "logits_done", "logits_ns", "closed")

    def __init__(self, rec: SteadyRecord, view: StepView, dests: list, derived: Any, flat: torch.Tensor,
                 whole: bool):
        self.rec = rec
        self.view = view
        self.dests = dests  # the record's destinations (FixedRecord): token ids, then each section
        self.derived = derived  # the top-k values' first column in the record, when topk writes there
        self.flat = flat  # the rows in the step's flattened tokens (ids, hidden states)
        self.whole = whole
        self.logits_done = False
        self.logits_ns = 0
        self.closed = False

    @property
    def wants_logits(self) -> bool:
        return self.rec.wants_logits

    def write_states(self) -> None:
        rec, flat, whole, dests = self.rec, self.flat, self.whole, self.dests
        if rec.fixed.device_ids:
            _take(self.view.token_ids, dests[0], flat, whole)
        aux = self.view.aux
        for i, k, sl in rec.states:
            src = aux[i]
            _take(src if sl is None else src[:, sl[0]:sl[1]], dests[k], flat, whole)
        # Each reducer on the rows just gathered when the record holds them in float32, else on its layer's.
        for red, i, rows_at, outs in rec.reducers:
            if rows_at is not None:
                red.run_rows(dests[rows_at], None, [dests[k] for k in outs])
            else:
                red.run_rows(aux[i], None if whole else flat, [dests[k] for k in outs])

    def write_logits(self, logits: torch.Tensor | None) -> None:
        if self.logits_done or not self.rec.wants_logits:
            return
        self.logits_done = True
        rec = self.rec
        if logits is None or logits.shape[-1] != rec.vocab or logits.dtype != rec.logits_dtype:
            # Not the logits this batch's record was laid out for (it should not happen): the step
            # is given up and reported, and the next step lays its record out afresh.
            rec.core.forget_steady()
            self.abandon()
            return
        if rec.logits_fill is not None:
            k, sl = rec.logits_fill
            _take(logits if sl is None else logits[:, sl[0]:sl[1]], self.dests[k], rec.rows_dev, rec.whole)
            return
        k, at, direct, chosen, lse_at, ids, ids0, values, values0 = rec.topk
        dests = self.dests
        if direct:
            values, values0 = dests[at + 1], self.derived
        x = logits if rec.whole and logits.shape[0] == rec.n else torch.index_select(logits, 0, rec.rows_dev)
        topk_into(x, k, values, ids)
        if chosen is None:
            dests[at].copy_(ids)
        else:
            _take_columns(x, chosen, dests[at])
        # The row's logsumexp: its largest logit minus its log_softmax there (vLLM's logprobs are
        # log_softmax in float32; x - log_softmax(x) at the maximum has no cancellation).
        torch.sub(values0, log_softmax_f32(x).gather(1, ids0), out=dests[lse_at])
        if not direct and chosen is None:
            dests[at + 1].copy_(values)

    def finish(self) -> None:
        if self.closed:
            return
        rec = self.rec
        if rec.wants_logits and not self.logits_done and rec.core.is_last_stage:
            # The runner never produced this step's logits (it should not happen): the record cannot
            # go out half written; the step is reported.
            self.abandon()
            return
        rec.core.publisher.end_step()
        self.closed = True  # only now: if publishing failed, abandon() still gives the record up
        rec.core.writer.flush()

    def abandon(self) -> None:
        """Our code failed mid-step, or the record cannot be completed: it is not published, and
        its rows are reported lost (a DROP per request and tensor)."""
        if self.closed:
            return
        self.closed = True
        rec = self.rec
        core = rec.core
        core.publisher.abandon_step()
        for tid in rec.tids:
            report_drop(core.writer, rec.table, rec.block, tid)
        core.writer.flush()


def _take_columns(x: torch.Tensor, columns: torch.Tensor, dst: torch.Tensor) -> None:
    if dst.dtype == x.dtype:
        torch.index_select(x, 1, columns, out=dst)
    else:
        dst.copy_(torch.index_select(x, 1, columns))

