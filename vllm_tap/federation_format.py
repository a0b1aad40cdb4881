"""The federation format: what a peer daemon (a host of a multi-host engine that is not its home)
and the home daemon say to each other over tcp:// with CURVE (daemon/federation.py is the protocol,
daemon/peer_link.py the sockets).

One ZeroMQ message is one or more frames:

    frame 0     a msgspec-msgpack message below, tagged by its type name
    frame 1..n  RecordBatch and Controls only: one raw ring record each (ring_format's record layout,
                PADs left out), exactly as the sender's ring holds it

Records travel undecoded: the receiver decodes every one against the ring schema
(vllm_tap.ring_schema), as it does its own rings' records, because the bytes come from another
machine. The home sends its peers the control records of its engine rings (Controls: BEGIN, END,
LIVE), so a peer daemon can deliver captures its own ranks' records suffice for (a layer on a stage
of its host).

Flow control is by credit in bytes of record frames: the home grants (Welcome, Credit), the peer
sends batches only within what it was granted (a record larger than the whole window goes alone,
once nothing else is in flight), and reads its rings no further than its credit (what it does not
read stays in the ring, whose writer then keeps to the ring's own rules).

Every message is decoded against its type with bounds (strings, lists and counts below), and a
message of another version is refused.
"""

from __future__ import annotations

from typing import Union

import msgspec

from vllm_tap.ring_format import RecordKind

FEDERATION_VERSION = 2
MAX_HEADER_BYTES = 64 << 10  # frame 0
MAX_RECORDS_PER_BATCH = 4096  # record frames of one RecordBatch or Controls
CONTROL_KINDS = frozenset({RecordKind.BEGIN, RecordKind.END, RecordKind.LIVE})  # what Controls carry
MAX_RECORD_BYTES = 1 << 40  # one record (a ring's largest); larger than the credit window, it goes alone
MAX_NAME = 256  # host, instance and ring names
MAX_PLACEMENT_BYTES = 4096  # the ring header's placement, as the peer's ring holds it (vllm_tap.placement)
DEFAULT_CREDIT_BYTES = 64 << 20  # what the home grants a peer at once (and tops up as it takes records)
BEAT_INTERVAL_S = 0.1  # both sides: a message at least this often
# A closed connection (the other daemon killed, crashed, stopped) is seen at once; a connection
# that stays open and quiet this long (a hung daemon, a host or network gone without a word) is as
# good as closed. Long enough for the largest message on the way to arrive behind the beats.
SILENCE_S = 5.0


class Hello(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """peer -> home, first: who it is. `session` is new for every connection the peer makes."""

    version: int
    host: str
    session: int


class Welcome(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """home -> peer: the session is taken, and the first credit."""

    version: int
    session: int
    credit: int


class Refused(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """home -> peer: the session is not taken (another version); the reason in one line."""

    reason: str


class Credit(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """home -> peer: `grant` more bytes of records may be sent (0: a heartbeat)."""

    session: int
    grant: int


class RingOpened(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """peer -> home: a ring the peer reads from now on, and what its header says."""

    session: int
    ring_id: int
    instance: str
    name: str
    epoch: int
    rank: int
    world_size: int
    placement: bytes = b""  # the header's encoded Placement (empty: none)


class RecordBatch(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """peer -> home: records of one ring (the frames after this one), and that ring's cursors after
    the poll that read them (`written`: its writer's cursor when the poll began)."""

    session: int
    seq: int  # batches of the session, counted from 0: a hole means the connection lost some
    ring_id: int
    read: int
    written: int
    sizes: list[int]  # each record frame's length


class RingGone(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """peer -> home: the ring's writer died or the ring is no longer read (`reason`)."""

    session: int
    seq: int
    ring_id: int
    reason: str
    closed: bool  # the ring is no longer read at all


class Beat(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """peer -> home: nothing else to say; still here."""

    session: int


class Controls(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """home -> peer: control records (BEGIN, END, LIVE; the frames after this one) the home read from
    the engine ring of `instance`, in the order it read them."""

    session: int
    instance: str
    sizes: list[int]  # each record frame's length


Message = Union[Hello, Welcome, Refused, Credit, RingOpened, RecordBatch, RingGone, Beat, Controls]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class FormatError(ValueError):
    """A message that does not fit the format; one line."""


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frames: list[bytes]) -> tuple[Message, list[bytes]]:
    """(the message, its record frames), checked against the bounds; FormatError otherwise."""
    if not frames:
        raise FormatError("an empty message")
    head = frames[0]
    if len(head) > MAX_HEADER_BYTES:
        raise FormatError(f"a message header of {len(head)} bytes (at most {MAX_HEADER_BYTES})")
    try:
        msg = _decoder.decode(head)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise FormatError(f"not a federation message: {e}") from None
    records = frames[1:]
    if isinstance(msg, (RecordBatch, Controls)):
        if len(msg.sizes) > MAX_RECORDS_PER_BATCH or len(msg.sizes) != len(records):
            raise FormatError(f"a batch of {len(records)} record frames says {len(msg.sizes)}")
        if any(len(r) != n or not 0 < n <= MAX_RECORD_BYTES for r, n in zip(records, msg.sizes)):
            raise FormatError("a record frame whose length is not the one its batch says")
        if isinstance(msg, RecordBatch) and (msg.read < 0 or msg.written < 0):
            raise FormatError("negative ring cursors")
    elif records:
        raise FormatError(f"{type(msg).__name__} with {len(records)} frames after it")
    for field in ("host", "instance", "name", "reason"):
        value = getattr(msg, field, None)
        if value is not None and len(value) > MAX_NAME:
            raise FormatError(f"{field} longer than {MAX_NAME} characters")
    if isinstance(msg, RingOpened) and len(msg.placement) > MAX_PLACEMENT_BYTES:
        raise FormatError(f"a placement of {len(msg.placement)} bytes (at most {MAX_PLACEMENT_BYTES})")
    return msg, records
