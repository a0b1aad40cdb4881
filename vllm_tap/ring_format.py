"""Byte layout of a capture ring: the one place its constants live.

A ring is one file under the shm directory, written by exactly one process (a tensor-parallel
rank of an engine, or the engine core) and read by exactly one daemon. Any change to a layout
below must bump RING_FORMAT_VERSION: readers refuse rings of another version rather than
misread them.
"""

from __future__ import annotations

import enum
import struct

import numpy as np

RING_FORMAT_VERSION = 7  # 2: DATA records carry rows of several requests (a request table)
# 3: request table entries also carry the capture's first expected position, tail length and source
# 4: the reader's waiting flag (READER_WAITING_OFFSET): writers ring the doorbell only while it is set;
#    LOGSUMEXP records beside top-k and chosen-index records
# 5: a DATA record may carry several tensors of the same rows (sections, see body_layout): a step's
#    states, or its logits parts, in one record. A record of one section is laid out as in 4.
# 6: SHED records (a worker did not admit a capture: the daemon was behind); the captures_shed stat
# 7: the writer's placement in the header (PLACEMENT_OFFSET; vllm_tap/placement.py); PROBE, LATENT_IDS and
#    LATENT_VALUES tensors (reducers' outputs), numbered by their `layer` field
READABLE_VERSIONS = (4, 5, 6, 7)  # 4 reads as 5's one-section records; 5 is 6 without SHED; 6 is 7 without
#                                   placement and reducers' tensors
RING_MAGIC = b"VLLMTAP\x00"
RING_SUFFIX = ".ring"

# The header is one page so the data area starts page-aligned (pinned-memory registration and
# DMA engines like that) and the cursors below each own a cache line, so the writer's and the
# reader's stores never share one.
HEADER_SIZE = 4096
ALIGN = 64

# Fixed part of the header, written once when the ring is created.
_IDENT = struct.Struct("<8sIIQQIiII")  # magic, version, header_size, capacity, epoch_ns, pid, rank, world, flags
IDENT_OFFSET = 0
# Monotonic byte counts (never wrap); position in the data area is cursor % capacity.
WRITE_CURSOR_OFFSET = 128
READ_CURSOR_OFFSET = 192
# Writer statistics, one u64 each, on their own cache line (room for 8; a field added in the
# unused tail of the line needs no version bump: a writer that does not know it leaves it 0).
STATS_OFFSET = 256
STATS_FIELDS = (
    "records_written",
    "bytes_written",
    "records_dropped",  # DATA records that did not fit (each reported by DROP records)
    "bytes_dropped",
    "control_backlog",  # control records waiting in the writer for room in the ring
    "last_write_ns",
    "control_dropped",  # control records (BEGIN/END/DROP) dropped because the writer's bounded
    #                     backlog was full: the reader cannot see them; LIVE records cover BEGIN/END
    "captures_shed",  # captures this writer did not admit because its reader was behind (SHED records)
)
assert STATS_OFFSET + 8 * len(STATS_FIELDS) <= STATS_OFFSET + ALIGN
# The reader's waiting flag, a u64 on its own cache line: the daemon sets it (1) before it blocks
# and clears it when it wakes; a writer that commits while it is set clears it and rings the
# doorbell (vllm_tap.doorbell). So a writer makes the system call only when the daemon sleeps: under
# load, when the daemon is busy reading, a commit costs no syscall. The race (a commit just as the
# daemon goes to sleep) is closed like a futex: the daemon sets the flag, then re-reads the write
# cursors, then blocks; the writer stores its cursor, then reads the flag; each side has a full
# barrier between its store and its load (a locked instruction: a lock release). Whatever slips
# through costs the daemon's backstop timer in latency, never data.
READER_WAITING_OFFSET = 320
# Reader liveness: pid and last poll time, so `status` can tell a stalled daemon.
READER_OFFSET = 384
_READER = struct.Struct("<IIQ")  # reader pid, pad, last_read_ns

# Where the writer runs (format 7): a u32 length, then that many bytes of msgpack (vllm_tap/placement.py),
# written once before the ring is renamed into place; length 0: not given.
PLACEMENT_OFFSET = 1024
PLACEMENT_MAX = HEADER_SIZE - PLACEMENT_OFFSET - 4
_PLACEMENT_LEN = struct.Struct("<I")


def placement_len_struct() -> struct.Struct:
    return _PLACEMENT_LEN


# The daemon's wake-up socket in the shm directory (vllm_tap.doorbell); the leading dot keeps it
# out of the instance scan.
DOORBELL_NAME = ".doorbell"

# A ring whose writer is the engine core rather than a model rank (finish reasons).
ENGINE_RANK = -1


def ident_struct() -> struct.Struct:
    return _IDENT


def reader_struct() -> struct.Struct:
    return _READER


class RecordKind(enum.IntEnum):
    DATA = 1  # a tensor slice for some token positions of one request
    PAD = 2  # filler up to the end of the data area; the next record starts at offset 0
    BEGIN = 3  # a request started capturing; meta carries its spec and prompt length
    END = 4  # a request finished (meta: reason, counts, and its spec and source again, so a reader
    #          that missed the BEGIN still knows which positions were expected)
    DROP = 5  # the writer dropped records of a request (meta: tensor, layer, positions)
    LIVE = 6  # engine ring only: the requests still capturing (meta: {"requests": [ids]}), written about
    #          once a second while any capture runs and once after the last one ends, so a reader can end
    #          a capture whose END it will never see (lost or consumed by a previous reader)
    SHED = 7  # worker rings: this writer did not admit the capture because its reader was behind (meta:
    #          reason, and the spec and prompt length so a reader that missed the BEGIN can place it). It
    #          writes no DATA for it; the reader delivers the capture as one Gap (the reason) from any rank.


# A SHED record's reason when the writer's reader was behind (its ring over the shed threshold): the
# reader delivers the capture as one Gap with this reason.
SHED_OVERLOADED = "overloaded"


class TensorKind(enum.IntEnum):
    LOGITS = 1  # raw logits [n, vocab] (last dim sliced across tensor-parallel ranks)
    HIDDEN = 2  # residual stream after decoder layer `layer` [n, hidden]
    TOPK_IDS = 3  # [n, k] token ids, sorted by value descending
    TOPK_VALUES = 4  # [n, k] logits at TOPK_IDS
    CHOSEN = 5  # [n, len(indices)] logits at the request's chosen token indices
    LOGSUMEXP = 6  # [n, 1] float32: log sum exp of the whole raw logit row (format 4), written beside
    #                TOPK_* and CHOSEN so that logit - logsumexp is the exact log-probability
    # A reducer's output (format 7). Their `layer` field is not a layer: it is the reducer's index in the
    # capture spec's sorted reducers (vllm_tap.reducers), 0..MAX_REDUCERS-1.
    PROBE = 7  # [n, k] float32: a probe's scores
    LATENT_IDS = 8  # [n, k] int32: an SAE encoder's most active latents, most active first; -1: none in that slot
    LATENT_VALUES = 9  # [n, k] float32: their activations (0 where the id is -1)


# Names used in client records and on the wire for each tensor kind.
TENSOR_NAMES = {
    TensorKind.LOGITS: "logits",
    TensorKind.HIDDEN: "hidden",
    TensorKind.TOPK_IDS: "topk_ids",
    TensorKind.TOPK_VALUES: "topk_values",
    TensorKind.CHOSEN: "chosen",
    TensorKind.LOGSUMEXP: "logsumexp",
    TensorKind.PROBE: "probe",
    TensorKind.LATENT_IDS: "latent_ids",
    TensorKind.LATENT_VALUES: "latent_values",
}
# The kinds whose `layer` field numbers the tensor (a layer, or a reducer's index in the spec): one
# record may carry several of each, told apart by it.
NUMBERED_KINDS = frozenset({TensorKind.HIDDEN, TensorKind.PROBE, TensorKind.LATENT_IDS, TensorKind.LATENT_VALUES})
REDUCER_KINDS = frozenset({TensorKind.PROBE, TensorKind.LATENT_IDS, TensorKind.LATENT_VALUES})


class DType(enum.IntEnum):
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3  # numpy has no bfloat16: carried as raw uint16, widened by the client
    INT32 = 4
    INT64 = 5


_NUMPY_STORAGE = {
    DType.FLOAT32: np.dtype("<f4"),
    DType.FLOAT16: np.dtype("<f2"),
    DType.BFLOAT16: np.dtype("<u2"),
    DType.INT32: np.dtype("<i4"),
    DType.INT64: np.dtype("<i8"),
}
DTYPE_NAMES = {
    DType.FLOAT32: "float32",
    DType.FLOAT16: "float16",
    DType.BFLOAT16: "bfloat16",
    DType.INT32: "int32",
    DType.INT64: "int64",
}
DTYPE_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


def storage_dtype(code: int) -> np.dtype:
    """The numpy dtype whose bytes equal the ring's bytes for this code."""
    return _NUMPY_STORAGE[DType(code)]


def dtype_code(dt: np.dtype) -> DType:
    dt = np.dtype(dt)
    for code, nd in _NUMPY_STORAGE.items():
        if code != DType.BFLOAT16 and nd == dt.newbyteorder("<"):
            return code
    raise ValueError(f"unsupported dtype for capture: {dt}")


# Record header: fixed 64 bytes at the start of every record.
RECORD_MAGIC = b"TAPR"
RECORD_HEADER = struct.Struct(
    "<4sI"  # magic, total_len (header + body + padding, multiple of ALIGN)
    "BBBB"  # kind, tensor, dtype, flags
    "hH"  # layer, rank (u16; 0xFFFF = engine)
    "I"  # n_rows (DATA; 0 for control records)
    "I"  # n_requests in the request table (DATA)
    "HH"  # key_len (control records), n_sections (DATA; 0 or 1: the header's tensor is the only one)
    "I"  # meta_len: msgpack meta (control) or the request table (DATA)
    "Q"  # step
    "III"  # slice_start, slice_stop, full_dim
    "I"  # payload_offset from record start
)
assert RECORD_HEADER.size <= ALIGN
RECORD_HEADER_SIZE = ALIGN
ENGINE_RANK_U16 = 0xFFFF
# A PAD record needs only magic and length; any tail is a multiple of ALIGN, so it always fits.
PAD_MAGIC = b"PAD\x00"
PAD_HEADER = struct.Struct("<4sI")


def rank_u16(rank: int) -> int:
    """A rank as the record header stores it (the engine's ENGINE_RANK as ENGINE_RANK_U16)."""
    return ENGINE_RANK_U16 if rank == ENGINE_RANK else rank


def rank_of_u16(rank16: int) -> int:
    return ENGINE_RANK if rank16 == ENGINE_RANK_U16 else rank16


def pack_record_header(
    buf, at: int, *, total: int, kind: int, rank: int, payload_off: int, tensor: int = 0, dtype: int = 0,
    layer: int = -1, n_rows: int = 0, n_requests: int = 0, key_len: int = 0, n_sections: int = 0, meta_len: int = 0,
    step: int = 0, slice_start: int = 0, slice_stop: int = 0, full_dim: int = 0,
) -> None:
    """Write a record header (RECORD_HEADER) into `buf` at `at`: the one place its fields are packed."""
    RECORD_HEADER.pack_into(buf, at, RECORD_MAGIC, total, kind, tensor, dtype, 0, layer, rank_u16(rank), n_rows,
                            n_requests, key_len, n_sections, meta_len, step, slice_start, slice_stop, full_dim,
                            payload_off)


def pack_pad(buf, at: int, length: int) -> None:
    """A PAD record of `length` bytes (a multiple of ALIGN) at `at`: the reader skips it whole."""
    PAD_HEADER.pack_into(buf, at, PAD_MAGIC, length)

# Control records (BEGIN/END/DROP) carry a key section: request id, NUL, tap key (may be empty).
KEY_SEPARATOR = b"\x00"


def control_key(request_id: str, tap_key: str = "") -> bytes:
    """A control record's key section."""
    return request_id.encode() + KEY_SEPARATOR + tap_key.encode()

# DATA records hold the rows one rank captured for one tensor in one step, for every request that
# captured it then: one record per (step, tensor) instead of one per (request, step, tensor), so the
# serving process pays the per-record cost a few times a step, not once per request. The meta
# section is the request table, a msgpack array with one entry per request (REQUEST_FIELDS, in that
# order); each row names its request by its index in that table (the slots array). A request's rows
# in a record are in position order, but the requests' rows may interleave. Every record carries the
# ids themselves, so a reader that missed the BEGIN (daemon restart) still files rows correctly, and
# what a reader needs to account for every expected position without the BEGIN:
#   start   first position the capture expects (-1: known only at the end, see tail)
#   tail    0, or N: the capture is the last N computed positions (workers write more; the reader
#           keeps the last N once the END says where the request stopped)
#   source  "client" (the request opted in) or "policy" (the server's capture policy chose it)
REQUEST_FIELDS = ("request_id", "tap_key", "num_prompt_tokens", "expected_ranks", "rank_parts", "start", "tail",
                  "source")
MAX_REQUESTS_PER_RECORD = 1 << 16
# A capture spec as BEGIN and END records carry it (msgpack of CaptureSpec.to_meta(), a few hundred
# bytes): readers refuse more, so the API process refuses a request whose spec would be larger.
MAX_SPEC_BYTES = 64 << 10


def msgpack_array_header(n: int) -> bytes:
    """The msgpack header of an n-element array, to prefix n entries packed one by one."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


# A DATA record of several sections (n_sections > 1 in the header) lists them after the positions,
# one SECTION entry each, in payload order; the header's tensor fields repeat section 0's:
#
#   header (64) | key | request table | pad to 8 | slots [n] | positions [n] | section table
#   | token ids [n] | pad to 64 | payload 0 [n, w0] | pad to 64 | payload 1 [n, w1] | ...
#
# Everything before the token ids is written by the host when the record is reserved; the ids and
# payloads may come from the accelerator, as one block in one device-to-host copy.
SECTION = struct.Struct(
    "<BBxx"  # tensor, dtype
    "hH"  # layer, pad
    "III"  # slice_start, slice_stop, full_dim
    "I"  # payload_offset from record start
    "8x"
)
MAX_SECTIONS = 64


def section_bytes(n_sections: int) -> int:
    """Bytes of the section table (none for a record of one section)."""
    return SECTION.size * n_sections if n_sections > 1 else 0


def body_layout(key_len: int, meta_len: int, n_rows: int, n_sections: int = 1) -> tuple[int, int, int, int, int]:
    """Offsets (from record start) of meta, slots, positions, token_ids and payload (of section 0);
    the key is at 64, the section table (if any) right after the positions.

    slots, positions and token ids are int32 [n_rows] each."""
    meta_off = RECORD_HEADER_SIZE + key_len
    slots_off = align_up(meta_off + meta_len, 8)
    pos_off = slots_off + 4 * n_rows
    ids_off = pos_off + 4 * n_rows + section_bytes(n_sections)
    payload_off = align_up(ids_off + 4 * n_rows, ALIGN)
    return meta_off, slots_off, pos_off, ids_off, payload_off


def section_offsets(payload_off: int, nbytes: "list[int]") -> tuple[list[int], int]:
    """Each section's payload offset, given section 0's and every section's byte size, and the
    record's total length."""
    offs, at = [], payload_off
    for nb in nbytes:
        offs.append(at)
        at = align_up(at + nb)
    return offs, at
