"""Typed records that travel through a ring, shared by the writer (hooks) and the reader (daemon).

The writer packs a DATA record's request table from RequestRefs (a RequestTable). Readers get
records only from vllm_tap.ring_schema and vllm_tap.ring_reader, which check the bytes against the
schema, as one type, `Record`: a ControlRecord for each BEGIN, END, DROP, LIVE or SHED record, and a
DataRecord for each DATA record whatever its shape (whole tensors read into one block, tensor-parallel
slices read into their columns of one array per step, or decode steps joined into one). A
DataRecord's rows of one capture and one tensor are a Slice (`slices(i)`): what reassembly tiles
across ranks, and what a reader that looks at one capture and tensor at a time reads (`per_tensor`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

import msgpack
import msgspec
import numpy as np

from vllm_tap.ring_format import NUMBERED_KINDS, TENSOR_NAMES, RecordKind, TensorKind, msgpack_array_header


@dataclass(frozen=True)
class TensorId:
    """Which tensor a slice belongs to. `layer` is the layer of HIDDEN, a reducer's index in the capture
    spec for a reducer's tensors (PROBE, LATENT_*), and -1 for everything else. `TensorId.of` gives the
    one instance of each (made once, its name with it)."""

    kind: TensorKind
    layer: int = -1

    @functools.cached_property
    def name(self) -> str:
        base = TENSOR_NAMES[self.kind]
        return f"{base}.{self.layer}" if self.kind in NUMBERED_KINDS else base

    @staticmethod
    def of(kind: int, layer: int = -1) -> "TensorId":
        key = (kind, layer if kind in NUMBERED_KINDS else -1)
        tid = _TENSOR_IDS.get(key)
        if tid is None:
            tid = _TENSOR_IDS[key] = TensorId(TensorKind(kind), key[1])
        return tid


_TENSOR_IDS: dict[tuple[int, int], TensorId] = {}


@dataclass(frozen=True)
class RequestRef:
    """One request's entry in a DATA record's request table (ring_format.REQUEST_FIELDS)."""

    request_id: str
    tap_key: str = ""
    num_prompt_tokens: int = 0
    expected_ranks: int = 1  # ranks that write records for one of its steps
    rank_parts: int = 1  # records (tensors) this rank writes for one of its steps
    start: int = -1  # first expected position, -1 when only the END can tell (a tail capture)
    tail: int = 0  # N > 0: only the last N computed positions are the capture
    source: str = "client"  # "client" (opted in) or "policy" (chosen by the server's capture policy)

    def packed(self) -> bytes:
        return msgpack.packb(
            [self.request_id, self.tap_key, self.num_prompt_tokens, self.expected_ranks, self.rank_parts,
             self.start, self.tail, self.source],
            use_bin_type=True,
        )


class RequestTable:
    """The requests a step's DATA records refer to, packed once and shared by all of them.

    `packed` entries are RequestRef.packed() bytes, which a writer caches per request: building a
    step's table is then one join, whatever the number of requests."""

    __slots__ = ("refs", "blob")

    def __init__(self, refs: list[RequestRef], packed: list[bytes] | None = None):
        self.refs = refs
        entries = packed if packed is not None else [r.packed() for r in refs]
        self.blob = msgpack_array_header(len(refs)) + b"".join(entries)

    def __len__(self) -> int:
        return len(self.refs)


@dataclass
class ControlRecord:
    """A BEGIN, END, DROP, LIVE or SHED record as read back from a ring. `control` is its meta as
    vllm_tap.ring_schema decoded it (BeginMeta, EndMeta, DropMeta, LiveMeta, ShedMeta) and `spec`,
    for those that carry one, the capture spec."""

    kind: RecordKind
    request_id: str
    tap_key: str = ""
    step: int = 0
    rank: int = 0
    num_prompt_tokens: int = 0
    source: str = "client"
    # Where it came from: (ring name, epoch) lets the reassembler tell writers apart; `cursor` is
    # where it starts in that ring (-1: not read from a ring of this host).
    ring: str = ""
    epoch: int = 0
    control: Any = None
    spec: Any = None
    cursor: int = -1

    @property
    def meta(self) -> dict[str, Any]:
        """The meta as plain values (its spec as CaptureSpec.to_meta())."""
        if self.control is None:
            return {}
        out = msgspec.structs.asdict(self.control)
        if "spec" in out:
            out["spec"] = self.spec.to_meta() if self.spec is not None else None
        return out


@dataclass
class Slice:
    """One capture's rows of one tensor from one rank's DATA record, for one step (the columns
    [slice_start, slice_stop) of a tensor-parallel slice, or all of them). `data` is
    [len(positions), slice_stop - slice_start] in the ring's storage dtype (bfloat16 arrives as
    uint16); `dtype` is the ring_format.DType code. `whole`: the [rows, full_dim] array a slice was
    read into the columns of (shared by the step's slices of every rank), when it was."""

    request_id: str
    tap_key: str = ""
    step: int = 0
    rank: int = 0
    expected_ranks: int = 1
    rank_parts: int = 1
    tensor: TensorId | None = None
    dtype: int = 0
    slice_start: int = 0
    slice_stop: int = 0
    full_dim: int = 0
    num_prompt_tokens: int = 0
    start: int = -1  # the request table's start / tail / source (ring_format.REQUEST_FIELDS)
    tail: int = 0
    source: str = "client"
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    data: np.ndarray | None = None
    ring: str = ""
    epoch: int = 0
    whole: np.ndarray | None = None
    cursor: int = -1  # where its record starts in the ring (-1: not read from a ring of this host)

    kind = RecordKind.DATA  # what it was read from

    @property
    def nbytes(self) -> int:
        return (self.data.nbytes if self.data is not None else 0) + self.positions.nbytes + self.token_ids.nbytes


class Section:
    """One tensor of a DATA record: its columns [slice_start, slice_stop) of full_dim, and where its
    rows were read to. A whole tensor (all columns) lies in `data`, [n_rows, width], a view of the
    record's one block; a tensor-parallel slice lies in `parts`, one [rows, width] array per group
    of the record (`wholes`: the [rows, full_dim] array each is the columns of, or None)."""

    __slots__ = ("tensor", "dtype", "slice_start", "slice_stop", "full_dim", "data", "parts", "wholes")

    def __init__(self, tensor: TensorId, dtype: int, slice_start: int, slice_stop: int, full_dim: int,
                 data: np.ndarray | None = None, parts: list[np.ndarray] | None = None,
                 wholes: list[np.ndarray | None] | None = None):
        self.tensor = tensor
        self.dtype = dtype
        self.slice_start = slice_start
        self.slice_stop = slice_stop
        self.full_dim = full_dim
        self.data = data
        self.parts = parts
        self.wholes = wholes

    @property
    def whole(self) -> bool:
        return self.slice_start == 0 and self.slice_stop == self.full_dim

    @property
    def width(self) -> int:
        return self.slice_stop - self.slice_start

    @property
    def nbytes(self) -> int:
        if self.data is not None:
            return self.data.nbytes
        return sum(p.nbytes for p in self.parts or ())

    def rows_of(self, i: int, rows: Any) -> np.ndarray:
        """Group i's rows (`rows`: None for all, a slice, or an index array)."""
        if self.parts is not None:
            return self.parts[i]
        assert self.data is not None
        return self.data if rows is None else self.data[rows]

    @classmethod
    def whole_of(cls, tensor: TensorId, dtype: int, data: np.ndarray) -> "Section":
        """A whole tensor, [n_rows, full_dim]."""
        return cls(tensor, dtype, 0, data.shape[1], data.shape[1], data)


@dataclass(eq=False)
class DataRecord:
    """One DATA record as read back: the rows one rank wrote for one step, of every request in its
    table. `groups` say which rows are whose, as the request table's (slot, rows) where rows is None
    (all), a slice, or an index array; `sections` hold each tensor's rows. slices(i) gives group i
    as one Slice per section (views where the rows lie together).

    `whole`: every section is a whole tensor whose rows all lie in its `data` (the usual record of one
    rank, read into one block). Decode steps of the same requests read together may be joined into
    one (`steps`: the steps' own records, in order; group i's rows are its rows of each step, in step
    order)."""

    step: int
    rank: int
    ring: str
    epoch: int
    entries: list[Any]  # ring_schema.RequestEntry, one per table slot
    positions: np.ndarray  # int32 [n_rows], owned
    token_ids: np.ndarray  # int32 [n_rows], owned
    groups: list[tuple[int, Any]]
    sections: list[Section]
    whole: bool = False
    steps: "list[DataRecord] | None" = None
    cursor: int = -1  # where it starts in its ring (joined: the first step's); -1: not read from a ring here

    kind = RecordKind.DATA

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sections)

    @property
    def n_slices(self) -> int:
        """(request, tensor) slices: the Slices it stands for, over all its steps."""
        return len(self.groups) * len(self.sections) * (len(self.steps) if self.steps else 1)

    def slices(self, i: int) -> list[Slice]:
        if self.steps:  # what each step's record gave, step by step
            return [s for b in self.steps for s in b.slices(i)]
        slot, rows = self.groups[i]
        e = self.entries[slot]
        take = (lambda a: a) if rows is None else (lambda a: a[rows])  # noqa: E731 (a view, or a fancy-index copy)
        positions, token_ids = take(self.positions), take(self.token_ids)
        return [Slice(
            request_id=e.request_id, tap_key=e.tap_key, step=self.step, rank=self.rank,
            expected_ranks=e.expected_ranks, rank_parts=e.rank_parts, tensor=s.tensor, dtype=s.dtype,
            slice_start=s.slice_start, slice_stop=s.slice_stop, full_dim=s.full_dim,
            num_prompt_tokens=e.num_prompt_tokens, start=e.start, tail=e.tail, source=e.source, positions=positions,
            token_ids=token_ids, data=s.rows_of(i, rows), ring=self.ring, epoch=self.epoch,
            whole=s.wholes[i] if s.wholes is not None else None, cursor=self.cursor,
        ) for s in self.sections]

    def joined(self, other: "DataRecord") -> "DataRecord | None":
        """This record and `other`, the next record of the same ring, as one: a rank that writes a
        step's tensors in several records (hidden states during the forward, logits after it) writes
        them for the same rows of the same requests. None unless they are that: the same step, request
        table, rows and ids, and other tensors."""
        if (other.step != self.step or other.rank != self.rank or other.ring != self.ring or other.epoch != self.epoch
                or (other.entries is not self.entries and other.entries != self.entries)
                or not np.array_equal(other.positions, self.positions)
                or not np.array_equal(other.token_ids, self.token_ids)):
            return None
        if other.groups is not self.groups:
            if len(other.groups) != len(self.groups):
                return None
            for (s1, r1), (s2, r2) in zip(self.groups, other.groups):
                if s1 != s2 or type(r1) is not type(r2) or not (r1 == r2 if not isinstance(r1, np.ndarray)
                                                                 else np.array_equal(r1, r2)):
                    return None
        if {s.tensor for s in self.sections} & {s.tensor for s in other.sections}:
            return None
        return DataRecord(self.step, self.rank, self.ring, self.epoch, self.entries, self.positions, self.token_ids,
                          self.groups, self.sections + other.sections, self.whole and other.whole,
                          cursor=self.cursor)

    @property
    def wants_more(self) -> bool:
        """Its requests' steps have more tensors than it carries: the rest may be the next record."""
        return bool(self.entries) and self.entries[0].rank_parts > len(self.sections)


Record = Union[ControlRecord, DataRecord]  # what a ring reader returns


def per_tensor(records: Iterable[Record]) -> list[ControlRecord | Slice]:
    """Records as one item per control record and per (capture, tensor) of a DATA record, in order:
    for readers that look at one capture and tensor at a time (tests, tools)."""
    out: list[ControlRecord | Slice] = []
    for r in records:
        if type(r) is DataRecord:
            for s in range(len(r.sections)):
                out.extend(r.slices(i)[s] for i in range(len(r.groups)))
        else:
            out.append(r)
    return out
