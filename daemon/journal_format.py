"""Byte layout of the arena journal: the index a daemon keeps of what its delivery arena holds, so the
next daemon (after a crash or a stop) can adopt the arena with the captures in it.

The journal is a log of what the daemon filed per capture (daemon/journal.py writes it, daemon/
adoption.py reads it back): a capture's Begin, its data (token ids inline, every tensor as a
reference to a region of the arena), its gaps, its End, and that the daemon let go of it. It lives
beside the arena in the arena's directory, in segment files only the daemon's user may read:

    <arena_dir>/.journal-<arena_id:016x>-<segment:010d>      mode 0600

    segment file
    0        +-----------------------------------------------------------+
             | frame: SegmentHead (the arena it indexes, this segment's  |
             |        number, whether it is a checkpoint)                |
             +-----------------------------------------------------------+
             | frame: Began | Data | Hole | Ending | Ended | Shed |     |
             |        Forgot | Read ...                                 |
             +-----------------------------------------------------------+

    frame    +------------+------------+------------------------------+
             | length u32 | crc32  u32 | body: msgpack of one Entry   |
             +------------+------------+------------------------------+
             little-endian; length = len(body) <= MAX_FRAME_BYTES; crc32 (zlib) of the body

Replay reads the segments of one arena in number order, each frame in order; a checkpoint segment
says "forget everything before me" (it restates every capture still held). A frame that is torn (the
daemon died while writing it), fails its crc, or does not decode against the schema below ends the
replay of its segment: everything before it stands. References are checked against the arena
(bounds, the region's generation) before anything is adopted (daemon/adoption.py).

The daemon moves a ring's read cursor (the writer reuses what lies below it) only after the frames of
what it read there are written, and writes that cursor first (Read), and never past a record whose
data it still holds unfiled (the newest position of a capture waiting for its END, a step waiting
for its other records): a killed daemon's successor reads again from the cursor in the ring file,
or from the journal's where that is further on (the frames were written, the cursor not yet). What
it reads again below the Read's `read` (how far the killed daemon had read) counts only for the
captures it continues, whose filed positions it skips: the held data is filed once, nothing twice.
An END read for a capture still waiting for its data is written as it is read (Ending): its
successor ends the capture with it instead of as `end lost`. A Began says where the capture's BEGIN
record lies in its engine ring (ring, epoch, cursor): a successor that reads that record again
(the last Read frames cut off by a kill part-way through a write) starts nothing with it, and
records of captures the journal finished are late records to it.

A capture is named by its sequence number (daemon/sequence.py: unique for the life of the state
directory), so a capture filed again (a later Begin of the same request) is a new seq and the old
one was Forgot.

Any change a reader of the previous version would misread bumps JOURNAL_VERSION; a reader ignores
journals of another version (their captures are not adopted, and the arena is not either).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Iterator, Union

import msgspec

JOURNAL_VERSION = 3
JOURNAL_PREFIX = ".journal-"
FRAME = struct.Struct("<II")  # length, crc32
MAX_FRAME_BYTES = 16 << 20  # one entry: a Began with a long prompt is the largest
MAX_INLINE_BYTES = 64 << 10  # an array outside the arena (the arena was full) is written inline up to this
MAX_NAME_CHARS = 256
MAX_TENSORS = 4096
MAX_DIM = 1 << 31
FILE_MODE = 0o600


def segment_name(arena_id: int, segment: int) -> str:
    return f"{JOURNAL_PREFIX}{arena_id:016x}-{segment:010d}"


def parse_name(name: str) -> tuple[int, int] | None:
    """(arena_id, segment) of a segment file's name, None for any other name."""
    if not name.startswith(JOURNAL_PREFIX):
        return None
    rest = name[len(JOURNAL_PREFIX):]
    if len(rest) != 27 or rest[16] != "-":
        return None
    try:
        return int(rest[:16], 16), int(rest[17:], 10)
    except ValueError:
        return None


class Ref(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One tensor of a Data entry: rows x cols items of `dtype` (a ring_format DType code), at data-area
    byte `offset` inside the region of `blocks` blocks from `block`, whose generation was `gen`; or,
    outside the arena, its bytes `inline` (block -1)."""

    name: str
    dtype: int
    rows: int
    cols: int
    block: int
    blocks: int
    gen: int
    offset: int
    inline: bytes | None = None


class SegmentHead(msgspec.Struct, tag="h", array_like=True, forbid_unknown_fields=True):
    version: int
    arena_id: int
    capacity: int
    segment: int
    checkpoint: bool
    pid: int


class Began(msgspec.Struct, tag="b", array_like=True, forbid_unknown_fields=True):
    """A capture filed (or its Begin filled in later: the same seq again, the fuller one stands)."""

    seq: int
    instance: str
    request_id: str
    tap_key: str
    num_prompt_tokens: int
    prompt_token_ids: list[int] | None
    n: int
    model: str
    spec: dict[str, Any] | None
    start_position: int | None
    lazy: bool
    source: str
    wall: float  # time.time() when filed
    reset: bool = False  # the capture's whole history follows (a checkpoint, a relocation): forget what came before
    # (ring, epoch, cursor) of its BEGIN record (events.Begin.origin), None: none was read
    origin: tuple[str, int, int] | None = None


class Data(msgspec.Struct, tag="d", array_like=True, forbid_unknown_fields=True):
    """Consecutive positions [start, start + len(token_ids)) with every captured tensor."""

    seq: int
    start: int
    token_ids: bytes  # int32 little-endian
    num_prompt_tokens: int
    tensors: list[Ref]


class Hole(msgspec.Struct, tag="g", array_like=True, forbid_unknown_fields=True):
    seq: int
    start: int
    stop: int
    reason: str


class Ended(msgspec.Struct, tag="e", array_like=True, forbid_unknown_fields=True):
    seq: int
    reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    output_token_ids: list[int]
    end_position: int | None
    expected: tuple[int, int] | None
    missing: list[tuple[int, int]]
    delivered: int
    source: str
    wall: float


class Ending(msgspec.Struct, tag="n", array_like=True, forbid_unknown_fields=True):
    """The capture's END record was read while positions of it were still to come (an END's meta,
    ring_schema.EndMeta, with its spec as CaptureSpec.to_meta())."""

    seq: int
    reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    output_token_ids: list[int]
    end_position: int
    spec: dict[str, Any] | None
    source: str | None


class Read(msgspec.Struct, tag="r", array_like=True, forbid_unknown_fields=True):
    """Everything below `cursor` of the ring (the instance's file `ring`, created at `epoch`) is in the
    frames before this one, and the ring was read up to `read` (>= cursor): what was filed of the
    records between is in those frames too, the rest was held."""

    instance: str
    ring: str
    epoch: int
    cursor: int
    read: int


class Shed(msgspec.Struct, tag="s", array_like=True, forbid_unknown_fields=True):
    """The daemon replaced the data of a capture in flight by gaps with `reason` (its budget)."""

    seq: int
    reason: str


class Forgot(msgspec.Struct, tag="x", array_like=True, forbid_unknown_fields=True):
    """The daemon let go of the capture (evicted, replaced): its regions may be reused."""

    seq: int


Entry = Union[SegmentHead, Began, Data, Hole, Ending, Ended, Shed, Forgot, Read]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Entry)


def frame(entry: Any) -> bytes:
    body = _encoder.encode(entry)
    return FRAME.pack(len(body), zlib.crc32(body)) + body


class Torn(ValueError):
    """Where a segment stops being readable, and why."""


def frames(buf: bytes | memoryview) -> Iterator[Entry]:
    """The entries of one segment's bytes, in order; raises Torn at the first frame that is cut off,
    fails its crc or does not fit the schema (what came before it stands)."""
    view = memoryview(buf)
    at = 0
    while at < len(view):
        if len(view) - at < FRAME.size:
            raise Torn(f"a frame header cut off at byte {at}")
        length, crc = FRAME.unpack_from(view, at)
        body = view[at + FRAME.size: at + FRAME.size + length]
        if length > MAX_FRAME_BYTES or len(body) < length:
            raise Torn(f"a frame of {length} bytes at byte {at} {'cut off' if len(body) < length else 'too large'}")
        if zlib.crc32(body) != crc:
            raise Torn(f"a frame at byte {at} fails its crc")
        try:
            entry = _decoder.decode(body)
        except msgspec.DecodeError as e:
            raise Torn(f"a frame at byte {at} does not fit the schema ({e})") from None
        yield entry
        at += FRAME.size + length
