"""Slice tiling: how the DATA records of one capture's step become one Tokens span's tensors.

A step's records (one per rank and tensor, each a slice [slice_start, slice_stop) of the tensor's
last dimension) gather in a StepGroup. It is complete when `expected_ranks` distinct ranks have each
delivered their `rank_parts` records. Then, per tensor, the slices must tile [0, full_dim) exactly;
if they do not, the step's positions are missing: a wrong concatenation is never delivered. Slices
read into their columns of one array (the ring reader asked where they go before it read them) are
that array; others are concatenated once, in slice order.

A record of whole tensors needs no tiling: its sections are named here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from vllm_tap.ring_records import DataRecord, Slice, TensorId

log = logging.getLogger(__name__)

Alloc = Callable[[tuple[int, int], Any], "np.ndarray | None"]  # (shape, dtype) -> array, None: use the heap

@dataclass
class StepGroup:
    """The slices of one (capture, step) seen so far."""

    step: int
    expected_ranks: int
    positions: np.ndarray
    token_ids: np.ndarray
    num_prompt_tokens: int
    parts: dict[int, dict[tuple, Slice]] = field(default_factory=dict)  # rank -> slice key -> slice
    wanted: dict[int, int] = field(default_factory=dict)  # rank -> rank_parts
    nbytes: int = 0
    # (ring, epoch) -> where the earliest of its records there starts: the ring's cursor stays at or
    # below it while the group is held, so a daemon killed meanwhile reads it again.
    cursors: dict[tuple[str, int], int] = field(default_factory=dict)

    def add(self, r: Slice) -> int:
        """Add a slice; returns the change in bytes held."""
        assert r.tensor is not None
        # Keyed by slice so a duplicate record replaces rather than double-counts.
        recs = self.parts.setdefault(r.rank, {})
        k = (r.tensor, r.slice_start, r.slice_stop)
        old = recs.get(k)
        recs[k] = r
        self.wanted[r.rank] = max(r.rank_parts, 1)
        delta = r.nbytes - (old.nbytes if old is not None else 0)
        self.nbytes += delta
        if r.cursor >= 0:
            key = (r.ring, r.epoch)
            c = self.cursors.get(key)
            if c is None or r.cursor < c:
                self.cursors[key] = r.cursor
        return delta

    def origin(self) -> tuple[tuple[tuple[str, int], int], ...]:
        """((ring, epoch), cursor) of the earliest record of each ring it came from."""
        return tuple(self.cursors.items())

    def complete(self) -> bool:
        done = sum(1 for rank, recs in self.parts.items() if len(recs) >= self.wanted[rank])
        return done >= self.expected_ranks

    def overlaps(self, lo: int, hi: int) -> bool:
        return bool(np.any((self.positions >= lo) & (self.positions < hi)))

    def by_tensor(self) -> dict[TensorId, list[Slice]]:
        out: dict[TensorId, list[Slice]] = {}
        for recs in self.parts.values():
            for rec in recs.values():
                out.setdefault(rec.tensor, []).append(rec)  # type: ignore[arg-type]
        return out


def tile(request_id: str, g: StepGroup, alloc: Alloc | None) -> tuple[dict[str, np.ndarray], dict[str, int]] | None:
    """The step's tensors by name, [rows, full_dim] each, and their DType codes; None when some
    tensor's slices do not tile [0, full_dim)."""
    by_tensor = g.by_tensor()
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
                        request_id, g.step, tid.name, full, [(x.rank, x.slice_start, x.slice_stop) for x in recs])
            return None
        # One record: its own array, no copy. Several: read into their places of one array, else one
        # concatenation in slice order.
        name = tid.name
        if len(recs) == 1:
            tensors[name] = recs[0].data  # type: ignore[assignment]
        else:
            t = recs[0].whole
            if t is not None and all(x.whole is t for x in recs) and _tiles(t, recs):
                tensors[name] = t
            else:
                shape = (len(recs[0].data), full)  # type: ignore[arg-type]
                out = alloc(shape, recs[0].data.dtype) if alloc is not None else None  # type: ignore[union-attr]
                tensors[name] = np.concatenate([x.data for x in recs], axis=1, out=out)
        dtypes[name] = dt
    return tensors, dtypes


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _tiles(t: np.ndarray, recs: list[Slice]) -> bool:
    """Every slice was read into its own columns of `t`, and they cover all of it."""
    base = _addr(t)
    step = t.dtype.itemsize
    return all(x.data is not None and x.data.shape[0] == t.shape[0] and x.data.strides == t.strides
               and x.data.dtype == t.dtype and _addr(x.data) == base + x.slice_start * step for x in recs)


def runs(positions: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
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


class Named(dict):
    """A record's sections by tensor name, in the order single records assemble them, with their
    DType codes (one dict, shared by the record's Tokens)."""

    dtypes: dict[str, int]
    row_bytes: int  # one position's bytes: every tensor's row, its position and its token id


def named_sections(rec: DataRecord) -> Named:
    """The sections of a record of whole tensors, by name."""
    named = Named()
    named.dtypes = {}
    named.row_bytes = rec.positions.itemsize + rec.token_ids.itemsize
    for sec in sorted(rec.sections, key=lambda s: (s.tensor.kind, s.tensor.layer)):
        a = sec.data
        name = sec.tensor.name
        named[name] = a
        named.dtypes[name] = sec.dtype
        named.row_bytes += a.shape[1] * a.itemsize
    return named
