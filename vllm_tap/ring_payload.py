"""Where a DATA record's payload bytes land, and the one way they get there.

A checked DATA record (vllm_tap.ring_schema.data_layout: header, request table, section table and
rows all fit) is a DataLayout: its sections' payloads lie in order, each 64-aligned, in [lo, hi) of
the record. `land(layout, destination)` decides where every byte goes before any is read:

- a whole tensor (every section, in the usual record of one rank): one block of hi - lo bytes for the
  record, from the destination (the daemon's delivery arena) or the heap, each section a view of it;
  the one copy, which the daemon's copier may make instead of pread, and start ahead of time;
- a tensor-parallel slice: each capture's rows into its columns of the [rows, full_dim] array the
  destination keeps for that capture, step and tensor (shared by the step's slices of every rank), so
  reading the slices assembles the tensor, or into an array of its own;
- rows of a capture spread over the record (not together: a prefill's extra rows before the step's
  sampled rows): each capture's rows of each tensor into an array of its own from the destination,
  through scratch (read whole, then copied to their places);
- whole tensors of a record that also has slices: one block of their bytes.

The Landing's `pieces` (record offset, destination) cover [lo, hi) in order; they are filled from
bytes already in memory (`fill_from`) or by the ring reader's preadv, and `record` is then the
DataRecord. The destination is an interface (a small protocol): nothing here allocates in the arena
or decides which capture a step belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from vllm_tap.ring_records import DataRecord, Section, TensorId

_U8 = np.dtype(np.uint8)


class Destination(Protocol):
    """Where a ring reader puts the payloads it reads (the daemon's delivery arena)."""

    def block(self, nbytes: int) -> np.ndarray | None:
        """A uint8 buffer for a record's whole tensors, every byte of which the reader writes; None:
        the heap."""

    def columns(self, request_id: str, step: int, tensor: TensorId, slice_start: int, slice_stop: int,
                full_dim: int, rows: int, dtype: np.dtype) -> np.ndarray | None:
        """The [rows, full_dim] array this slice of the capture's step is read into the columns of;
        None: an array of its own."""


@dataclass
class DataLayout:
    """A DATA record whose header, request table, section table and row arrays were checked (by
    vllm_tap.ring_schema): what is left is to put its payload bytes somewhere."""

    step: int
    rank: int
    n_rows: int
    entries: list[Any]  # ring_schema.RequestEntry, one per table slot
    positions: np.ndarray  # int32 [n_rows], a view of the bytes read
    token_ids: np.ndarray
    groups: list[tuple[int, Any]]  # (table slot, rows: None = all, a slice, or an index array)
    contiguous: bool  # each capture's rows lie together and in table order (no index array)
    sections: list["SectionLayout"]
    ring: str
    epoch: int

    @property
    def span(self) -> tuple[int, int]:
        """[lo, hi): the record's payload bytes, every section's (they lie in order, aligned)."""
        last = self.sections[-1]
        return self.sections[0].offset, last.offset + last.nbytes

    @property
    def all_whole(self) -> bool:
        """Every section is a whole tensor (no tensor-parallel slice)."""
        return all(s.section.whole for s in self.sections)

    def group_rows(self, i: int) -> int:
        """Rows of group i, whatever form its rows take (all, a slice, or an index array)."""
        rows = self.groups[i][1]
        if rows is None:
            return self.n_rows
        return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


class SectionLayout(NamedTuple):
    """One section of a checked DATA record: which tensor and columns (its Section, whose rows land()
    puts in), its storage dtype, and where its payload lies."""

    section: Section
    dtype: np.dtype
    offset: int  # of its payload, from the record's start
    nbytes: int


class Landing:
    """Where one record's payload goes: `pieces` to fill, then `record`."""

    __slots__ = ("record", "lo", "hi", "pieces", "block", "placed", "_scatter")

    def __init__(self, record: DataRecord, lo: int, hi: int, pieces: list[tuple[int, np.ndarray]],
                 block: np.ndarray | None, placed: bool, scatter: list[tuple[Section, np.ndarray, list[Any]]]):
        self.record = record
        self.lo = lo
        self.hi = hi
        self.pieces = pieces  # (offset from the record's start, uint8 destination), covering [lo, hi) in order
        self.block = block  # the one destination of a record of whole tensors (the copier's, read-ahead's)
        self.placed = placed  # some destination came from the destination
        self._scatter = scatter  # sections read into scratch: (section, scratch [n, width], rows per group)

    def fill_from(self, rec: np.ndarray) -> None:
        """The payload from `rec`, the record's bytes (uint8, from its start)."""
        for off, dst in self.pieces:
            dst[:] = rec[off : off + len(dst)]

    def done(self) -> DataRecord:
        """The record, once every piece is filled."""
        for sec, scratch, rows in self._scatter:
            for part, r in zip(sec.parts or (), rows):
                part[...] = scratch[r]
        self._scatter = []
        return self.record


def _u8(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(_U8)


def land(layout: DataLayout, destination: Destination | None = None) -> Landing:
    """Where each byte of the record's payload goes (see the module docstring)."""
    lo, hi = layout.span
    n = layout.n_rows
    positions, token_ids = layout.positions.copy(), layout.token_ids.copy()
    secs = layout.sections
    pieces: list[tuple[int, np.ndarray]] = []
    scatter: list[tuple[Section, np.ndarray, list[Any]]] = []
    placed = False
    together = layout.contiguous
    if together and layout.all_whole:
        block = destination.block(hi - lo) if destination is not None else None
        placed = block is not None
        if block is None:
            block = np.empty(hi - lo, _U8)
        sections = []
        for s in secs:
            sec = s.section
            sec.data = block[s.offset - lo : s.offset - lo + s.nbytes].view(s.dtype).reshape(n, -1)
            sections.append(sec)
        record = DataRecord(layout.step, layout.rank, layout.ring, layout.epoch, layout.entries, positions, token_ids,
                            layout.groups, sections, True)
        return Landing(record, lo, hi, [(lo, block)], block, placed, scatter)
    whole_bytes = sum(s.nbytes for s in secs if s.section.whole) if together else 0
    block = None
    if whole_bytes:
        block = destination.block(whole_bytes) if destination is not None else None
        placed = block is not None
        if block is None:
            block = np.empty(whole_bytes, _U8)
    sections = []
    at = lo  # the next payload byte to cover
    used = 0  # of the block
    for s in secs:
        sec = s.section
        if s.offset > at:  # alignment padding before it
            pieces.append((at, np.empty(s.offset - at, _U8)))
        if sec.whole and together:
            assert block is not None
            data = block[used : used + s.nbytes]
            used += s.nbytes
            pieces.append((s.offset, data))
            sec.data = data.view(s.dtype).reshape(n, sec.width)
            sections.append(sec)
        else:
            parts: list[np.ndarray] = []
            wholes: list[np.ndarray | None] = []
            for i, (slot, _) in enumerate(layout.groups):
                rows = layout.group_rows(i)
                t = destination.columns(layout.entries[slot].request_id, layout.step, sec.tensor, sec.slice_start,
                                      sec.slice_stop, sec.full_dim, rows, s.dtype) if destination is not None else None
                if t is not None:
                    placed = True
                    parts.append(t[:, sec.slice_start : sec.slice_stop])
                else:
                    parts.append(np.empty((rows, sec.width), s.dtype))
                wholes.append(t)
            sec.parts, sec.wholes = parts, wholes
            sections.append(sec)
            if together:  # each capture's rows straight into their place, in record order
                off = s.offset
                for p in parts:
                    if p.flags.c_contiguous:
                        pieces.append((off, _u8(p)))
                        off += p.nbytes
                    else:  # a column slice of a wider array: one piece per row
                        for row in p:
                            pieces.append((off, row.view(_U8)))
                            off += row.nbytes
            else:  # rows of a capture spread over the record: read whole, then each capture's rows
                scratch = np.empty((n, sec.width), s.dtype)
                pieces.append((s.offset, _u8(scratch)))
                scatter.append((sec, scratch, [rows for _, rows in layout.groups]))
        at = s.offset + s.nbytes
    record = DataRecord(layout.step, layout.rank, layout.ring, layout.epoch, layout.entries, positions, token_ids,
                        layout.groups, sections)
    return Landing(record, lo, hi, pieces, None, placed, scatter)

