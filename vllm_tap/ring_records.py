"""Typed records that travel through a ring, shared by the writer (hooks) and the reader (daemon).

Readers get RingRecords only from vllm_tap.ring_schema, which checks the bytes against the schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from vllm_tap.ring_format import RecordKind, TensorKind, msgpack_array_header


@dataclass(frozen=True)
class TensorId:
    """Which tensor a slice belongs to. `layer` is the layer of HIDDEN, a reducer's index in the capture
    spec for a reducer's tensors (PROBE, LATENT_*), and -1 for everything else."""

    kind: TensorKind
    layer: int = -1

    @property
    def name(self) -> str:
        from vllm_tap.ring_format import NUMBERED_KINDS, TENSOR_NAMES

        base = TENSOR_NAMES[self.kind]
        return f"{base}.{self.layer}" if self.kind in NUMBERED_KINDS else base


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
class RingRecord:
    """One record as read back from a ring (arrays are private copies, safe after the ring moves on).

    For DATA records `data` has shape [len(positions), slice_stop - slice_start] in the ring's
    storage dtype (bfloat16 arrives as uint16); `dtype` is the ring_format.DType code.
    """

    kind: RecordKind
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
    meta: dict[str, Any] = field(default_factory=dict)  # control records: the validated meta, as plain values
    # Where it came from: (ring name, epoch) lets the reassembler tell writers apart.
    ring: str = ""
    epoch: int = 0
    # Control records: the meta as decoded by vllm_tap.ring_schema (BeginMeta, EndMeta, DropMeta,
    # LiveMeta) and, for BEGIN and END, the capture spec it carries.
    control: Any = None
    spec: Any = None


@dataclass(eq=False)
class DataBatch:
    """One DATA record read whole, for a reader that handles a record at once (the daemon): every
    section's tensor is whole (no tensor-parallel slice), and all its payloads were read with one
    copy into one buffer. `sections` hold [n_rows, full_dim] views of it, in the record's order;
    `groups` say which rows are whose, as the request table's (slot, rows) where rows is None (all),
    a slice, or an index array. records(i) gives group i as the RingRecords a reader without
    batches returns (views where the rows lie together)."""

    step: int
    rank: int
    ring: str
    epoch: int
    entries: list[Any]  # ring_schema.RequestEntry, one per table slot
    positions: np.ndarray  # int32 [n_rows], owned
    token_ids: np.ndarray  # int32 [n_rows], owned
    groups: list[tuple[int, Any]]
    sections: list[tuple[TensorId, int, np.ndarray]]  # (tensor, DType code, [n_rows, full_dim])
    # Decode steps of the same requests joined into one batch by a reader that took them in together:
    # the steps' own batches, in order (group i's rows are its rows of each step, in step order).
    steps: "list[DataBatch] | None" = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, _, a in self.sections)

    @property
    def parts(self) -> int:
        """(request, tensor) parts: the RingRecords it stands for."""
        return len(self.groups) * len(self.sections) * (len(self.steps) if self.steps else 1)

    def records(self, i: int) -> list[RingRecord]:
        if self.steps:  # what each step's record gave, step by step
            return [r for b in self.steps for r in b.records(i)]
        slot, rows = self.groups[i]
        e = self.entries[slot]
        take = (lambda a: a) if rows is None else (lambda a: a[rows])  # noqa: E731 (a view, or a fancy-index copy)
        positions, token_ids = take(self.positions), take(self.token_ids)
        return [RingRecord(
            kind=RecordKind.DATA, request_id=e.request_id, tap_key=e.tap_key, step=self.step, rank=self.rank,
            expected_ranks=e.expected_ranks, rank_parts=e.rank_parts, tensor=tid, dtype=dtype, slice_start=0,
            slice_stop=a.shape[1], full_dim=a.shape[1], num_prompt_tokens=e.num_prompt_tokens, start=e.start,
            tail=e.tail, source=e.source, positions=positions, token_ids=token_ids, data=take(a), ring=self.ring,
            epoch=self.epoch,
        ) for tid, dtype, a in self.sections]

    def joined(self, other: "DataBatch") -> "DataBatch | None":
        """This record and `other`, the next record of the same ring, as one: a rank that writes a
        step's tensors in several records (hidden states during the forward, logits after it) writes
        them for the same rows of the same requests. None unless they are that: the same step,
        request table, rows and ids, and other tensors."""
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
        if {tid for tid, _, _ in self.sections} & {tid for tid, _, _ in other.sections}:
            return None
        return DataBatch(self.step, self.rank, self.ring, self.epoch, self.entries, self.positions, self.token_ids,
                         self.groups, self.sections + other.sections)

    @property
    def wants_more(self) -> bool:
        """Its requests' steps have more tensors than it carries: the rest may be the next record."""
        return bool(self.entries) and self.entries[0].rank_parts > len(self.sections)

