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

RING_FORMAT_VERSION = 1
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
# Writer statistics, one u64 each, on their own line.
STATS_OFFSET = 256
STATS_FIELDS = (
    "records_written",
    "bytes_written",
    "records_dropped",
    "bytes_dropped",
    "control_backlog",
    "last_write_ns",
)
# Reader liveness: pid and last poll time, so `status` can tell a stalled daemon.
READER_OFFSET = 384
_READER = struct.Struct("<IIQ")  # reader pid, pad, last_read_ns

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
    END = 4  # a request finished (meta: reason, counts)
    DROP = 5  # the writer dropped records of a request (meta: tensor, layer, positions)


class TensorKind(enum.IntEnum):
    LOGITS = 1  # raw logits [n, vocab] (last dim sliced across tensor-parallel ranks)
    HIDDEN = 2  # residual stream after decoder layer `layer` [n, hidden]
    TOPK_IDS = 3  # [n, k] token ids, sorted by value descending
    TOPK_VALUES = 4  # [n, k] logits at TOPK_IDS
    CHOSEN = 5  # [n, len(indices)] logits at the request's chosen token indices


# Names used in client records and on the wire for each tensor kind.
TENSOR_NAMES = {
    TensorKind.LOGITS: "logits",
    TensorKind.HIDDEN: "hidden",
    TensorKind.TOPK_IDS: "topk_ids",
    TensorKind.TOPK_VALUES: "topk_values",
    TensorKind.CHOSEN: "chosen",
}


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
    "hHHH"  # layer, rank (u16; 0xFFFF = engine), expected_ranks, rank_parts
    "IHH"  # n_tokens, key_len, pad
    "I"  # meta_len
    "Q"  # step
    "III"  # slice_start, slice_stop, full_dim
    "I"  # num_prompt_tokens
    "I"  # payload_offset from record start
)
assert RECORD_HEADER.size <= ALIGN
RECORD_HEADER_SIZE = ALIGN
ENGINE_RANK_U16 = 0xFFFF
# A PAD record needs only magic and length; any tail is a multiple of ALIGN, so it always fits.
PAD_HEADER = struct.Struct("<4sI")

# Key section: request id, NUL, tap key (may be empty). Every DATA record carries both, so a
# reader that missed the BEGIN (daemon restart) can still file the record under the right names.
KEY_SEPARATOR = b"\x00"


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def body_layout(key_len: int, meta_len: int, n_tokens: int) -> tuple[int, int, int, int]:
    """Offsets (from record start) of meta, positions, token_ids and payload; the key is at 64."""
    meta_off = RECORD_HEADER_SIZE + key_len
    pos_off = align_up(meta_off + meta_len, 8)
    ids_off = pos_off + 4 * n_tokens
    payload_off = align_up(ids_off + 4 * n_tokens, ALIGN)
    return meta_off, pos_off, ids_off, payload_off
