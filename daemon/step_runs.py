"""Decode steps of the same captures, read from one ring in one round, joined into one record.

A daemon that is behind reads many records of a ring per round. Each decode step of 64 captures is
64 Tokens events, each filed, checked and dispatched in Python: ~5 µs a capture, so the daemon's
pace was its captures times its steps. Joined, a run of k steps is one event per capture: the work
of a round grows with its captures, not its steps, so a daemon that falls behind catches up. A
daemon that keeps up reads one step per round and is not affected.

Rules this module keeps:
- Only whole decode steps join: every table slot one row (ring_schema.one_row_each), every tensor
  whole and of the step in the record (a step written as several records is joined first,
  DataRecord.joined),
  of the same ring, epoch and rank, with the same request table and tensors, each row's position
  one past its position in the step before. The caller joins only records read one after another,
  with nothing rejected between them.
- Only small records join (RUN_RECORD_BYTES): joining copies the rows (a capture's rows of the run
  lie together), which pays where a step's Python costs more than its bytes; a large record costs
  its bytes, not its steps. A run stops at RUN_BYTES, so its buffer stays one arena region.
- A joined record keeps its steps (DataRecord.steps): a capture that cannot take the direct way gets
  the slices of each step, as if nothing had been joined; what it delivers is the same either way.

Layout of a run of k steps of n rows (capture-major, so capture i's rows are one slice):

    positions, token_ids   [n * k]          row i * k + j = step j's row i
    each section           [n * k, width]   the same rows, in one buffer of the run's sections
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterator

import numpy as np

from vllm_tap.ring_records import DataRecord, Section
from vllm_tap.ring_schema import one_row_each

RUN_RECORD_BYTES = 256 << 10  # records above this are not joined
RUN_BYTES = 16 << 20  # a run's payload at most

_GROUPS: dict[tuple[int, int], list[tuple[int, Any]]] = {}


def runs(recs: list, breaks: Collection[int]) -> Iterator[tuple[int, list]]:
    """What to feed, in order, of the records one round read: (index of its first record, the steps
    to feed as one: one record, a step written as several records joined (DataRecord.joined), or
    several such steps to `join`). `breaks`: indices of records that a rejected record came just
    before: nothing joins across one."""
    i, n = 0, len(recs)
    ahead = None  # the step after a run, already joined: (start, step, index after it)
    while i < n:
        start, rec, i = ahead if ahead is not None else (i, *_step_at(recs, i, breaks))
        ahead = None
        run = [rec]
        if joinable(rec):
            run_bytes = rec.nbytes
            while i < n and i not in breaks:
                nxt, j = _step_at(recs, i, breaks)
                if not (joinable(nxt) and continues(run[-1], nxt, run_bytes)):
                    ahead = (i, nxt, j)
                    break
                run.append(nxt)
                run_bytes += nxt.nbytes
                i = j
        yield start, run


def _step_at(recs: list, i: int, breaks: Collection[int]) -> tuple[Any, int]:
    """The record at i, and the index after it. A step written as several records (hidden states,
    then logits) is one record again when they were read together, with nothing rejected between."""
    rec = recs[i]
    while (type(rec) is DataRecord and rec.wants_more and i + 1 < len(recs) and type(recs[i + 1]) is DataRecord
           and i + 1 not in breaks):
        joined = rec.joined(recs[i + 1])
        if joined is None:
            break
        rec, i = joined, i + 1  # its parts and bytes are both records'
    return rec, i + 1


def joinable(b: object) -> bool:
    """A record that may start or extend a run: a whole decode step of a small record of whole tensors."""
    return (type(b) is DataRecord and b.steps is None and not b.wants_more and b.whole
            and b.groups is one_row_each(len(b.groups)) and 0 < b.nbytes <= RUN_RECORD_BYTES)


def continues(prev: DataRecord, nxt: DataRecord, run_bytes: int) -> bool:
    """`nxt` (joinable) is the step after `prev` for the same captures and tensors."""
    if (nxt.ring != prev.ring or nxt.epoch != prev.epoch or nxt.rank != prev.rank or nxt.step <= prev.step
            or run_bytes + nxt.nbytes > RUN_BYTES or len(nxt.sections) != len(prev.sections)
            or (nxt.entries is not prev.entries and nxt.entries != prev.entries)):
        return False
    for s1, s2 in zip(prev.sections, nxt.sections):
        a1, a2 = s1.data, s2.data
        if s1.tensor != s2.tensor or s1.dtype != s2.dtype or a1.shape != a2.shape or a1.dtype != a2.dtype:
            return False
    return bool(np.array_equal(nxt.positions, prev.positions + 1))


def join(run: list[DataRecord], alloc: Callable[[int], Any] | None) -> DataRecord:
    """One record for a run of steps (`continues` held for each pair): capture i's rows of every step
    together, in a buffer from `alloc` (an arena region; the heap when it gives None)."""
    first = run[0]
    n, k = len(first.groups), len(run)
    total = sum(b.nbytes for b in run)
    buf = alloc(total) if alloc is not None else None
    if buf is None:
        buf = np.empty(total, np.uint8)
    sections = []
    at = 0
    for s, sec in enumerate(first.sections):
        a = sec.data
        width = a.shape[1]
        nb = n * k * width * a.itemsize
        out = buf[at : at + nb].view(a.dtype).reshape(n, k, width)
        np.stack([b.sections[s].data for b in run], axis=1, out=out)
        sections.append(Section.whole_of(sec.tensor, sec.dtype, out.reshape(n * k, width)))
        at += nb
    positions = np.stack([b.positions for b in run], axis=1).reshape(-1)
    token_ids = np.stack([b.token_ids for b in run], axis=1).reshape(-1)
    groups = _GROUPS.get((n, k))
    if groups is None:
        if len(_GROUPS) >= 256:
            _GROUPS.clear()
        groups = _GROUPS[(n, k)] = [(i, slice(i * k, (i + 1) * k)) for i in range(n)]
    return DataRecord(first.step, first.rank, first.ring, first.epoch, first.entries, positions, token_ids, groups,
                      sections, True, steps=run, cursor=first.cursor)
