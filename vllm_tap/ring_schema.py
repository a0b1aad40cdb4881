"""Typed ring records: the one place where untrusted ring bytes become Python values, and the
control records' meta Structs (BeginMeta, EndMeta, DropMeta, LiveMeta, ShedMeta) that writers
encode (`encode_control`) and the reader decodes, the same type on both sides.

Any process that may open a ring for writing can put anything in it, so the reader trusts nothing
it finds there. Rules this module keeps:
- every header field is bounds-checked against the record it sits in before it is used;
- every size derived from a record (rows, widths, list lengths, strings) has a fixed upper bound
  here, checked before anything of that size is allocated;
- every msgpack section is decoded against a msgspec schema (no untyped decoding of a whole
  section: a typed decoder rejects a wrong shape at its first byte, so a small record cannot
  expand into a large object graph);
- a record that does not fit is rejected whole, as a `Rejection` naming what was wrong and the
  request ids that could still be read from it, so the daemon can end those captures with a reason.

Record layout (constants in ring_format; all little-endian):

    0  ┌ header (RECORD_HEADER, 64 bytes) ────────────────────────────────────────────────┐
       │ "TAPR" total_len │ kind tensor dtype flags │ layer rank │ n_rows n_requests      │
       │ key_len pad meta_len │ step │ slice_start slice_stop full_dim │ payload_offset   │
   64  ├ key: request id NUL tap key (control records; empty for DATA) ───────────────────┤
       ├ meta: msgpack; control records: one map per kind (BeginMeta, EndMeta, DropMeta,  │
       │ LiveMeta); DATA: the request table, an array of REQUEST_FIELDS arrays            │
       ├ (8-aligned) slots int32[n] │ positions int32[n] │ token ids int32[n]  (DATA)      │
       ├ (64-aligned) payload: [n, slice_stop - slice_start] of dtype             (DATA)   │
       └ total_len (a multiple of 64) ─────────────────────────────────────────────────────┘
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Iterator, NamedTuple, Union

import msgspec
import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap.ring_payload import DataLayout, Destination, SectionLayout, land
from vllm_tap.ring_records import ControlRecord, Record, RequestRef, RequestTable, Section, TensorId
from vllm_tap.spec import CaptureSpec

# -- bounds (a legitimate writer stays far inside every one of them) --

MAX_POSITION = (1 << 31) - 1  # positions are int32 in DATA records; END's end_position is a stop, <= this
MAX_REQUEST_ID_CHARS = 4096
MAX_TAP_KEY_CHARS = 1024
MAX_SOURCE_CHARS = 32
MAX_REASON_CHARS = 256
MAX_MODEL_CHARS = 4096
MAX_TOKEN_LIST = 1 << 24  # prompt / output token ids of one request
MAX_DROP_POSITIONS = 1 << 24
MAX_LIVE_REQUESTS = 1 << 20
MAX_SPEC_BYTES = rf.MAX_SPEC_BYTES
MAX_CONTROL_META_BYTES = 64 << 20  # a BEGIN of a 10M-token prompt fits
MAX_TABLE_BYTES = 64 << 20
MAX_RANKS = 1 << 16
MAX_RANK_PARTS = 1 << 12
MAX_FULL_DIM = 1 << 24
MAX_LAYER = 1 << 15
MAX_REDUCER_INDEX = 255  # a reducer tensor's index in its capture spec (vllm_tap.reducers.MAX_REDUCERS is less)
MAX_SAMPLES = 1 << 16  # n of a request
MAX_STEP = (1 << 63) - 1

_DATA = rf.RecordKind.DATA
_CONTROL_KINDS = (rf.RecordKind.BEGIN, rf.RecordKind.END, rf.RecordKind.DROP, rf.RecordKind.LIVE, rf.RecordKind.SHED)
_ITEMSIZE = {int(c): rf.storage_dtype(c).itemsize for c in rf.DType}
_TENSOR_KINDS = {int(k) for k in rf.TensorKind}

Position = Annotated[int, msgspec.Meta(ge=0, le=MAX_POSITION)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_POSITION)]
TokenId = Annotated[int, msgspec.Meta(ge=-(1 << 31), le=(1 << 31) - 1)]
RequestIdStr = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]
TapKeyStr = Annotated[str, msgspec.Meta(max_length=MAX_TAP_KEY_CHARS)]
SourceStr = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SOURCE_CHARS)]


# -- schemas --


class BeginMeta(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """BEGIN: a request started capturing (hooks/engine_events)."""

    spec: msgspec.Raw = msgspec.Raw()  # CaptureSpec.to_meta(), decoded on its own (bounded, see _spec)
    num_prompt_tokens: Count = 0
    prompt_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKEN_LIST)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_SAMPLES)] = 1
    model: Annotated[str, msgspec.Meta(max_length=MAX_MODEL_CHARS)] = ""
    # Whether the engine schedules asynchronously (a finished request may be computed once more).
    # None: not said (the reader then assumes it may).
    async_scheduling: bool | None = None
    source: SourceStr | None = None  # who asked (spec.SOURCE_*); the spec says it too


class EndMeta(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """END: how a request finished; spec and source again, for a reader that missed the BEGIN."""

    reason: Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)] = "finished"
    num_prompt_tokens: Count = 0
    num_output_tokens: Count = 0
    output_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_TOKEN_LIST)] = []
    end_position: Position = 0
    spec: msgspec.Raw = msgspec.Raw()
    source: SourceStr | None = None


class DropMeta(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """DROP: the writer dropped a record; these positions of the request are missing."""

    tensor: int = 0
    layer: int = -1
    positions: Annotated[list[Position], msgspec.Meta(max_length=MAX_DROP_POSITIONS)] = []


class LiveMeta(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """LIVE (engine ring): the requests still capturing."""

    requests: Annotated[list[RequestIdStr], msgspec.Meta(max_length=MAX_LIVE_REQUESTS)] = []


class ShedMeta(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """SHED (worker ring): the writer did not admit the capture; why, and what places it."""

    reason: Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)] = "overloaded"
    num_prompt_tokens: Count = 0
    spec: msgspec.Raw = msgspec.Raw()
    source: SourceStr | None = None
    unread_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 48)] = 0  # what the writer saw when it decided
    capacity: Annotated[int, msgspec.Meta(ge=0, le=1 << 48)] = 0


class RequestEntry(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One entry of a DATA record's request table, in ring_format.REQUEST_FIELDS order."""

    request_id: RequestIdStr
    tap_key: TapKeyStr
    num_prompt_tokens: Count
    expected_ranks: Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
    rank_parts: Annotated[int, msgspec.Meta(ge=1, le=MAX_RANK_PARTS)]
    start: Annotated[int, msgspec.Meta(ge=-1, le=MAX_POSITION)]
    tail: Count
    source: SourceStr


assert tuple(RequestEntry.__struct_fields__) == rf.REQUEST_FIELDS, "REQUEST_FIELDS and RequestEntry must agree"


class _IdOnly(msgspec.Struct, array_like=True, forbid_unknown_fields=False):
    """What can be salvaged from a bad table entry: its request id, to end that capture."""

    request_id: RequestIdStr


ControlMeta = Union[BeginMeta, EndMeta, DropMeta, LiveMeta, ShedMeta]
# Each control record's kind and its meta's type: the writer encodes the Struct it is given, the
# reader decodes the same Struct (fields left at their default are omitted: the reader fills them in).
CONTROL_KINDS: dict[type, rf.RecordKind] = {
    BeginMeta: rf.RecordKind.BEGIN,
    EndMeta: rf.RecordKind.END,
    DropMeta: rf.RecordKind.DROP,
    LiveMeta: rf.RecordKind.LIVE,
    ShedMeta: rf.RecordKind.SHED,
}
_CONTROL_DECODERS = {kind: msgspec.msgpack.Decoder(t) for t, kind in CONTROL_KINDS.items()}
_CONTROL_ENCODER = msgspec.msgpack.Encoder()


def encode_control(meta: ControlMeta) -> tuple[rf.RecordKind, bytes]:
    """A control record's kind and meta section, from its meta Struct."""
    return CONTROL_KINDS[type(meta)], _CONTROL_ENCODER.encode(meta)


def spec_field(spec: CaptureSpec) -> msgspec.Raw:
    """A capture spec as BEGIN, END and SHED carry it (CaptureSpec.to_meta(), packed)."""
    return msgspec.Raw(_CONTROL_ENCODER.encode(spec.to_meta()))


def drop_metas(table: RequestTable, slots: np.ndarray, positions: np.ndarray,
               tensor: TensorId) -> Iterator[tuple[RequestRef, DropMeta]]:
    """One DROP per request with rows among `slots` (its table slots; `positions` beside them): those
    positions of that tensor will never arrive, and the daemon turns them into gaps."""
    slots = np.asarray(slots)
    positions = np.asarray(positions)
    for slot in np.unique(slots).tolist():
        yield table.refs[slot], DropMeta(int(tensor.kind), tensor.layer, positions[slots == slot].tolist())
_TABLE = msgspec.msgpack.Decoder(list[RequestEntry])
_RAW_LIST = msgspec.msgpack.Decoder(list[msgspec.Raw])
_ENTRY = msgspec.msgpack.Decoder(RequestEntry)
_ID_ONLY = msgspec.msgpack.Decoder(_IdOnly)
_ANY = msgspec.msgpack.Decoder()


class Rejected(ValueError):
    """A record that does not fit the schema; `request_ids` are the captures it names readably."""

    def __init__(self, why: str, request_ids: tuple[str, ...] = (), kind: int = 0):
        super().__init__(why)
        self.why = why
        self.request_ids = request_ids
        self.kind = kind


@dataclass(frozen=True)
class Rejection:
    """A rejected record, in the order it was read (so the daemon ends its captures in order)."""

    ring: str
    epoch: int
    offset: int  # the ring cursor where the record starts
    why: str
    request_ids: tuple[str, ...]
    kind: int
    index: int = 0  # how many records the same poll returned before it


# -- header --


class Header(NamedTuple):
    total: int
    kind: int
    tensor: int
    dtype: int
    layer: int
    rank: int
    n_rows: int
    n_requests: int
    key_len: int
    meta_len: int
    step: int
    slice_start: int
    slice_stop: int
    full_dim: int
    payload_offset: int
    n_sections: int = 0  # DATA: 0 or 1 for one section (the header's tensor), else the section table's


def parse_header(buf: memoryview | bytes | np.ndarray, at: int = 0) -> Header:
    (magic, total, kind, tensor, dtype, _flags, layer, rank16, n, n_requests, key_len, n_sections, meta_len, step,
     s0, s1, full_dim, payload_off) = rf.RECORD_HEADER.unpack_from(buf, at)
    if magic != rf.RECORD_MAGIC:
        raise Rejected(f"bad record magic {magic!r}")
    return Header(total, kind, tensor, dtype, layer, rf.rank_of_u16(rank16), n, n_requests, key_len, meta_len, step, s0, s1, full_dim,
                  payload_off, n_sections)


# -- records --


def decode_record(rec: memoryview | bytes | np.ndarray, *, ring: str = "", epoch: int = 0,
                  table_cache: "TableCache | None" = None, destination: Destination | None = None) -> list[Record]:
    """One whole record (its total_len bytes) -> a ControlRecord, or a DataRecord (none for a DATA
    record without rows), its payload copied where `destination` says (vllm_tap.ring_payload). Raises
    Rejected."""
    mv = memoryview(rec).cast("B") if not isinstance(rec, np.ndarray) else memoryview(rec)
    total = len(mv)
    if total < rf.RECORD_HEADER_SIZE:
        raise Rejected(f"record of {total} bytes is shorter than its header")
    h = parse_header(mv)
    if h.total != total:
        raise Rejected(f"record length {h.total} does not match the {total} bytes given")
    if h.kind == rf.RecordKind.DATA:
        layout = data_layout(mv, h, ring=ring, epoch=epoch, table_cache=table_cache)
        if layout is None:
            return []
        landing = land(layout, destination)
        landing.fill_from(np.frombuffer(mv, np.uint8))
        return [landing.done()]
    if h.kind in _CONTROL_KINDS:
        return [_decode_control(mv, h, ring, epoch)]
    raise Rejected(f"unknown record kind {h.kind}")


def _key(mv: memoryview, h: Header, kind: rf.RecordKind) -> tuple[str, str]:
    key = bytes(mv[rf.RECORD_HEADER_SIZE : rf.RECORD_HEADER_SIZE + h.key_len])
    rid_b, sep, tap_b = key.partition(rf.KEY_SEPARATOR)
    try:
        rid, tap_key = rid_b.decode(), tap_b.decode()
    except UnicodeDecodeError:
        raise Rejected("request id or tap key is not UTF-8") from None
    if kind != rf.RecordKind.LIVE and not rid:
        raise Rejected("empty request id")
    if len(rid) > MAX_REQUEST_ID_CHARS or len(tap_key) > MAX_TAP_KEY_CHARS or rf.KEY_SEPARATOR in tap_b:
        raise Rejected("request id or tap key too long or malformed", (rid,) if rid and len(rid) <= MAX_REQUEST_ID_CHARS else ())
    return rid, tap_key


def _spec(raw: msgspec.Raw, rid: str) -> "CaptureSpec | None":
    if not len(raw):
        return None
    if len(raw) > MAX_SPEC_BYTES:
        raise Rejected(f"capture spec of {len(raw)} bytes", (rid,))
    value = _ANY.decode(raw)  # bounded by MAX_SPEC_BYTES
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Rejected(f"capture spec is a {type(value).__name__}, not a map", (rid,))
    try:
        spec = CaptureSpec.from_meta(value)
        # What the daemon will ask of it, on small numbers: a spec that cannot answer is malformed.
        spec.first_position(4)
        spec.position_range(4, 8)
        int(spec.tail)
    except Exception as e:  # from_meta belongs to the spec's owner: whatever it raises, the record is bad
        raise Rejected(f"capture spec unreadable: {type(e).__name__}: {e}", (rid,)) from None
    return spec


def _decode_control(mv: memoryview, h: Header, ring: str, epoch: int) -> ControlRecord:
    kind = rf.RecordKind(h.kind)
    if h.meta_len > MAX_CONTROL_META_BYTES:
        raise Rejected(f"{kind.name} meta of {h.meta_len} bytes")
    if rf.RECORD_HEADER_SIZE + h.key_len + h.meta_len > h.total:
        raise Rejected(f"{kind.name} key ({h.key_len}) and meta ({h.meta_len}) overrun the record ({h.total})")
    rid, tap_key = _key(mv, h, kind)
    ids = (rid,) if rid else ()
    meta_off = rf.RECORD_HEADER_SIZE + h.key_len
    raw = mv[meta_off : meta_off + h.meta_len]
    try:
        info = _CONTROL_DECODERS[kind].decode(raw) if h.meta_len else _CONTROL_DECODERS[kind].decode(b"\x80")
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise Rejected(f"{kind.name} meta: {e}", ids, h.kind) from None
    spec = None
    source = None
    if isinstance(info, (BeginMeta, EndMeta, ShedMeta)):
        try:
            spec = _spec(info.spec, rid)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise Rejected(f"{kind.name} capture spec: {e}", ids, h.kind) from None
        source = spec.source if spec is not None else None
        if info.source:
            source = info.source
    num_prompt = info.num_prompt_tokens if isinstance(info, (BeginMeta, EndMeta, ShedMeta)) else 0
    return ControlRecord(kind=kind, request_id=rid, tap_key=tap_key, step=h.step, rank=h.rank,
                         num_prompt_tokens=num_prompt, source=source or "client", ring=ring, epoch=epoch, control=info,
                         spec=spec)


class TableCache:
    """The last request table decoded (a step's records of every tensor share one table), and the last
    sections (a decode step's record is laid out as the one before it: the same header but for the
    step, the same section table)."""

    __slots__ = ("blob", "entries", "layout_key", "sections")

    def __init__(self) -> None:
        self.blob = b""
        self.entries: list[RequestEntry] = []
        self.layout_key = b""
        self.sections: list[tuple] = []


def _array_len(raw: memoryview) -> int | None:
    """Element count from a msgpack array header, or None if it is not an array."""
    if not len(raw):
        return None
    b = raw[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(raw) >= 3:
        return int.from_bytes(raw[1:3], "big")
    if b == 0xDD and len(raw) >= 5:
        return int.from_bytes(raw[1:5], "big")
    return None


def _salvage_ids(raw: memoryview) -> tuple[str, ...]:
    """Request ids of the table entries that still have a readable one."""
    try:
        items = _RAW_LIST.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return ()
    out = []
    for item in items:
        try:
            out.append(_ID_ONLY.decode(item).request_id)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass
    return tuple(dict.fromkeys(out))


_PATH = re.compile(r"`\$\[(\d+)\]\[(\d+)\]")


def _named(message: str) -> str:
    """msgspec names table entries' fields by index ($[0][3]); say which field that is."""
    def name(m: re.Match) -> str:
        j = int(m.group(2))
        return f"`entry {m.group(1)}, {rf.REQUEST_FIELDS[j] if j < len(rf.REQUEST_FIELDS) else f'field {j}'}"
    return _PATH.sub(name, message)


def _table(mv: memoryview, meta_off: int, h: Header, cache: TableCache | None) -> list[RequestEntry]:
    raw = mv[meta_off : meta_off + h.meta_len]
    if cache is not None and len(cache.blob) == h.meta_len and cache.blob == raw:
        return cache.entries
    count = _array_len(raw)
    if count != h.n_requests:
        raise Rejected(f"request table holds {count} entries, the header says {h.n_requests}", _salvage_ids(raw) if count else ())
    try:
        entries = _TABLE.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise Rejected(f"request table: {_named(str(e))}", _salvage_ids(raw)) from None
    if cache is not None:
        cache.blob = bytes(raw)
        cache.entries = entries
    return entries


def _check_tensor(tensor: int, dtype: int, layer: int, s0: int, s1: int, full_dim: int) -> None:
    if tensor not in _TENSOR_KINDS:
        raise Rejected(f"unknown tensor kind {tensor}")
    if dtype not in _ITEMSIZE:
        raise Rejected(f"unknown dtype code {dtype}")
    if not 0 <= s0 < s1 <= full_dim <= MAX_FULL_DIM:
        raise Rejected(f"slice [{s0}, {s1}) of {full_dim}")
    if tensor == rf.TensorKind.HIDDEN and not 0 <= layer <= MAX_LAYER:
        raise Rejected(f"hidden layer {layer}")
    if tensor in rf.REDUCER_KINDS:
        if not 0 <= layer <= MAX_REDUCER_INDEX:
            raise Rejected(f"{rf.TENSOR_NAMES[rf.TensorKind(tensor)]} of reducer index {layer}")
        if dtype != (rf.DType.INT32 if tensor == rf.TensorKind.LATENT_IDS else rf.DType.FLOAT32):
            raise Rejected(f"{rf.TENSOR_NAMES[rf.TensorKind(tensor)]} of dtype code {dtype}")


def body_offsets(h: Header) -> tuple[int, int, int, int, int]:
    """Check a DATA header against itself and its record length; the body offsets (ring_format.body_layout)."""
    n = h.n_rows
    _check_tensor(h.tensor, h.dtype, h.layer, h.slice_start, h.slice_stop, h.full_dim)
    if not 1 <= h.n_requests <= rf.MAX_REQUESTS_PER_RECORD:
        raise Rejected(f"{h.n_requests} requests in one record (1..{rf.MAX_REQUESTS_PER_RECORD})")
    if h.meta_len > MAX_TABLE_BYTES:
        raise Rejected(f"request table of {h.meta_len} bytes")
    if h.key_len:
        raise Rejected("a DATA record with a key section")
    if h.n_sections > rf.MAX_SECTIONS:
        raise Rejected(f"{h.n_sections} sections in one record (at most {rf.MAX_SECTIONS})")
    # Sizes from the header, checked against the record before any array is made from them.
    if n > h.total // 12:
        raise Rejected(f"{n} rows cannot fit a record of {h.total} bytes")
    layout = rf.body_layout(0, h.meta_len, n, max(h.n_sections, 1))
    payload_off = layout[4]
    width = h.slice_stop - h.slice_start
    itemsize = _ITEMSIZE[h.dtype]
    if h.payload_offset != payload_off or payload_off + n * width * itemsize > h.total:
        raise Rejected(f"payload at {h.payload_offset} (expected {payload_off}) of {n}x{width}x{itemsize} bytes "
                       f"overruns the record ({h.total})")
    return layout


def sections(mv: memoryview, h: Header, layout: tuple[int, int, int, int, int]) -> list[Header]:
    """Each section of a DATA record as a header of its own (its tensor fields and payload offset).
    Checked: kinds, dtypes, slices, and that the payloads lie where the layout puts them, inside the
    record. Raises Rejected."""
    if h.n_sections <= 1:
        return [h]
    n = h.n_rows
    at = layout[2] + 4 * n
    if len(mv) < at + rf.section_bytes(h.n_sections):
        raise Rejected("record shorter than its section table")
    entries = [rf.SECTION.unpack_from(mv, at + rf.SECTION.size * i) for i in range(h.n_sections)]
    for tensor, dtype, layer, _pad, s0, s1, full_dim, _off in entries:
        _check_tensor(tensor, dtype, layer, s0, s1, full_dim)
    if entries[0][:3] + entries[0][4:7] != (h.tensor, h.dtype, h.layer, h.slice_start, h.slice_stop, h.full_dim):
        raise Rejected("section 0 differs from the record header")
    if len({(e[0], e[2] if e[0] in rf.NUMBERED_KINDS else -1) for e in entries}) != len(entries):
        raise Rejected("a tensor twice in one record")
    offsets, end = rf.section_offsets(layout[4], [n * (e[5] - e[4]) * _ITEMSIZE[e[1]] for e in entries])
    if [e[7] for e in entries] != offsets or end > h.total:
        raise Rejected(f"section payloads at {[e[7] for e in entries][:4]} (expected {offsets[:4]}) overrun "
                       f"or misplace the record ({h.total} bytes)")
    return [h._replace(tensor=e[0], dtype=e[1], layer=e[2], slice_start=e[4], slice_stop=e[5], full_dim=e[6],
                       payload_offset=e[7]) for e in entries]


def _section_layouts(mv: memoryview, h: Header, layout: tuple[int, int, int, int, int],
                     cache: TableCache | None) -> list[SectionLayout]:
    """The record's sections (checked by `sections`), each a fresh Section for its rows."""
    key = b""
    if cache is not None:
        # Everything the sections depend on: the header but for its step, and the section table.
        at = layout[2] + 4 * h.n_rows
        key = bytes(mv[4:32]) + bytes(mv[40:56]) + bytes(mv[at : at + rf.section_bytes(h.n_sections)])
    if cache is None or cache.layout_key != key:
        n = h.n_rows
        static = []
        for sh in sections(mv, h, layout):
            dt = rf.storage_dtype(sh.dtype)
            static.append((TensorId.of(sh.tensor, sh.layer), sh.dtype, sh.slice_start, sh.slice_stop, sh.full_dim, dt,
                           sh.payload_offset, n * (sh.slice_stop - sh.slice_start) * dt.itemsize))
        if cache is None:
            return [SectionLayout(Section(*x[:5]), *x[5:]) for x in static]
        cache.layout_key, cache.sections = key, static
    return [SectionLayout(Section(tid, code, s0, s1, full), dt, off, nb)
            for tid, code, s0, s1, full, dt, off, nb in cache.sections]


def data_layout(prefix: memoryview | bytes | np.ndarray, h: Header, *, ring: str = "", epoch: int = 0,
                table_cache: TableCache | None = None) -> DataLayout | None:
    """Check what precedes the payloads of a DATA record (`prefix`: at least its first
    payload_offset bytes): where its sections' payloads lie and whose its rows are (None for a record
    without rows). Raises Rejected."""
    mv = memoryview(prefix).cast("B") if not isinstance(prefix, np.ndarray) else memoryview(prefix)
    layout = body_offsets(h)
    meta_off, slots_off, pos_off, ids_off, payload_off = layout
    if len(mv) < ids_off + 4 * h.n_rows:
        raise Rejected("record shorter than its header says")
    n = h.n_rows
    entries = _table(mv, meta_off, h, table_cache)
    secs = _section_layouts(mv, h, layout, table_cache)
    if n == 0:
        return None
    base = np.frombuffer(mv, np.uint8)
    slots = base[slots_off:pos_off].view("<i4")
    positions = base[pos_off : pos_off + 4 * n].view("<i4")
    token_ids = base[ids_off : ids_off + 4 * n].view("<i4")
    if n == 1:  # one row (a decode step of one request): scalar checks, no reductions
        bad_slot = not 0 <= int(slots[0]) < h.n_requests
        bad_position = int(positions[0]) < 0
    else:
        bad_slot = bool(slots.any()) if h.n_requests == 1 else (int(slots.min()) < 0 or int(slots.max()) >= h.n_requests)
        bad_position = int(positions.min()) < 0
    if bad_slot:
        raise Rejected("a row names a request outside the table", tuple(dict.fromkeys(e.request_id for e in entries)))
    if bad_position:
        raise Rejected("a negative position", tuple(dict.fromkeys(e.request_id for e in entries)))
    contiguous = True
    if h.n_requests == 1:
        groups: list[tuple[int, Any]] = [(0, None)]
    else:
        # Rows of one request may be spread over the record (a prefill's extra lm-head rows come
        # before the batch's sampled rows): a stable sort by slot keeps each request's rows in
        # their position order, and each request's rows are then taken with one copy.
        order = None if bool(np.all(slots[1:] >= slots[:-1])) else np.argsort(slots, kind="stable")
        contiguous = order is None
        sorted_slots = slots if order is None else slots[order]
        bounds = (np.flatnonzero(np.diff(sorted_slots)) + 1).tolist()
        if order is None and n == h.n_requests and len(bounds) == n - 1:
            groups = one_row_each(n)  # a decode step: row i is request i's (sorted, n distinct of n)
        else:
            groups = [(int(sorted_slots[a]), slice(a, b) if order is None else order[a:b])
                      for a, b in zip([0, *bounds], [*bounds, n])]
    return DataLayout(h.step, h.rank, n, entries, positions, token_ids, groups, contiguous, secs, ring, epoch)


_ONE_ROW_EACH: dict[int, list[tuple[int, Any]]] = {}


def one_row_each(n: int) -> list[tuple[int, Any]]:
    """Groups of a record whose row i is table slot i's only row: the same list for every such
    record of n rows (its readers only iterate it)."""
    g = _ONE_ROW_EACH.get(n)
    if g is None:
        g = _ONE_ROW_EACH[n] = [(i, slice(i, i + 1)) for i in range(n)]
    return g


# -- building records in memory (tests, tools; a home daemon's control records for its peers): the same
# decoder, so the same checks --


def control_bytes(meta: ControlMeta, request_id: str, *, tap_key: str = "", rank: int = rf.ENGINE_RANK,
                  step: int = 0) -> bytes:
    """A control record as a ring holds it (ring_format's record layout)."""
    key = rf.control_key(request_id, tap_key)
    kind, mb = encode_control(meta)
    *_, payload_off = rf.body_layout(len(key), len(mb), 0)
    total = rf.align_up(payload_off)
    buf = bytearray(total)
    rf.pack_record_header(buf, 0, total=total, kind=kind, rank=rank, payload_off=payload_off, key_len=len(key),
                          meta_len=len(mb), step=step)
    buf[rf.RECORD_HEADER_SIZE : rf.RECORD_HEADER_SIZE + len(key)] = key
    buf[rf.RECORD_HEADER_SIZE + len(key) : rf.RECORD_HEADER_SIZE + len(key) + len(mb)] = mb
    return bytes(buf)


def control_record(meta: ControlMeta, request_id: str, *, tap_key: str = "", rank: int = rf.ENGINE_RANK,
                   ring: str = "engine" + rf.RING_SUFFIX, epoch: int = 0, step: int = 0) -> ControlRecord:
    """A control record as the reader would return it for this meta (Rejected if it would reject it)."""
    raw = control_bytes(meta, request_id, tap_key=tap_key, rank=rank, step=step)
    (rec,) = decode_record(raw, ring=ring, epoch=epoch)
    assert isinstance(rec, ControlRecord)
    return rec
