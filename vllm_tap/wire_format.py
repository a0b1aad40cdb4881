"""The ZeroMQ protocol between the daemon and subscribers: the one place its constants live.

Every message is multipart. Frame 0 is a msgpack map, the header; any further frames are raw
tensor buffers, described in order by the header's "tensors" list as [name, dtype, rows, cols], so
arrays travel without being packed into (or copied out of) the header. Subscribers talk to the
daemon's ROUTER socket from a DEALER socket. Every message carries the subscription id ("id") the
client chose, so one socket may carry several subscriptions.

Client -> daemon:
  subscribe {id, name, index?, instance?, from_position?, timeout, arena?}
  watch     {id, since?, whole, instance?, source?, tap_key_prefix?, model?, arena?}    (see "watch" below)
  status    {id}
  cancel    {id}                                    ends a subscription or a watch
Daemon -> client (the tagged union `Reply` below: one msgspec Struct per type, tagged by "type",
which the daemon encodes and the client decodes in one call, `decode_reply`):
  begin  {id, seq, request_id, instance, names, response_id, choice_index, num_prompt_tokens, source, ...}
  tokens {id, seq, request_id, start, count, token_ids (int32 bytes), num_prompt_tokens, tensors} + buffers
         or, through the arena, tokens {..., arena: arena_id, tensors: arena descriptors} and no buffers
  gap    {id, seq, request_id, start, stop, reason}       positions [start, stop) are missing
  end    {id, seq, request_id, reason, missing [[start, stop], ...], complete, output_token_ids, source, ...}
         missing: expected positions not delivered, as sorted [start, stop) ranges, never as a list
         of positions; complete: the END was seen and nothing is missing
  error  {id, code, message}                              ends the subscription
  status {id, status}
  ping   {id: nil}                                        a liveness probe of the connection: ignore it
  watching  {id, since, oldest, next, run_first}          a watch was accepted (its first message)
  lost      {id, first, last, reason, detail}             captures first..last (inclusive) will not come
  watermark {id, seq}                                     every capture <= seq is handled for this watch

Shared memory (the "arena", vllm_tap.arena_format). A client that can map files of the daemon's host
(it connects over ipc://) says `arena: true` in its subscribe or watch. If the daemon has an arena,
its first reply (begin, or watching) carries `arena: [path, arena_id]`, and tokens messages whose
arrays lie in the arena then carry descriptors [name, dtype, rows, cols, block, gen, offset]
instead of buffers; others (an array the arena had no room for) carry buffers as before. Such a
message may carry a run of consecutive records (what one pass of the daemon read for this
subscriber): a name then comes once per record, in position order, and the client stacks its parts
row-wise into one array of `count` rows. A client
that cannot map that path cancels and asks again, under a new id, without `arena`. A client whose
copy finds a region's generation moved delivers those positions as a Gap (client.arena.OVERWRITTEN).

`seq` is the capture's sequence number (daemon/sequence.py): given when the capture begins,
strictly increasing across daemon restarts; every message of a capture carries it.

Any change a peer of the previous version would misread must bump WIRE_VERSION; both sides
answer a message of another version with an error instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence, Union

import msgpack
import msgspec
import numpy as np

from vllm_tap import ring_format as rf

# 2: watch / watching / lost / watermark; capture messages carry "seq".
# 3: tokens may carry arena descriptors instead of buffers (a v2 client would read them as frames).
# 4: arena tokens may carry a run of records, a name once per record (a v3 client would keep one part).
WIRE_VERSION = 4

# Header keys every message has.
K_VERSION = "v"
K_TYPE = "type"
K_ID = "id"

# Client -> daemon.
SUBSCRIBE = "subscribe"
STATUS = "status"
CANCEL = "cancel"
WATCH = "watch"
REQUEST_TYPES = (SUBSCRIBE, STATUS, CANCEL, WATCH)

# Daemon -> client (STATUS doubles as the reply type).
BEGIN = "begin"
TOKENS = "tokens"
GAP = "gap"
END = "end"
ERROR = "error"
PING = "ping"  # the daemon checks that a connection holding subscriptions is still there; clients ignore it
WATCHING = "watching"
LOST = "lost"
WATERMARK = "watermark"
REPLY_TYPES = (BEGIN, TOKENS, GAP, END, ERROR, STATUS, PING, WATCHING, LOST, WATERMARK)

# Error codes (the "code" of an error message); every error ends the subscription it names.
E_BAD_REQUEST = "bad_request"  # not a message this version understands
E_VERSION = "version"  # another wire version
E_NOT_FOUND = "not_found"  # no capture by that name appeared within the timeout
E_AMBIGUOUS = "ambiguous"  # the name matches several captures: pass index= or instance=
E_EVICTED = "evicted"  # the capture ended and was dropped from memory (retain_bytes / retain_ttl_s)
E_TOO_SLOW = "too_slow"  # the subscriber fell more than subscriber_queue messages behind
E_STOPPING = "stopping"  # the daemon is stopping; message is its reason
E_LIMIT = "limit"  # too many subscriptions on this connection or in all (max_subscriptions*), or watches
E_INTERNAL = "internal"
E_BAD_FILTER = "bad_filter"  # a watch filter that is unknown or has a bad value
E_BAD_SINCE = "bad_since"  # a watch `since` that is not a sequence number this daemon gave out yet

# Limits on what a client may send, so a hostile or broken peer costs little.
MAX_REQUEST_BYTES = 64 << 10
MAX_NAME_CHARS = 1024
MAX_TIMEOUT_S = 24 * 3600.0


class WireError(ValueError):
    """A message that cannot be accepted; `code` is one of the E_* codes."""

    def __init__(self, code: str, message: str, sub_id: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.sub_id = sub_id


def pack(msg_type: str, sub_id: int | None, **fields: Any) -> bytes:
    fields[K_VERSION] = WIRE_VERSION
    fields[K_TYPE] = msg_type
    fields[K_ID] = sub_id
    return msgpack.packb(fields, use_bin_type=True)


# -- replies (daemon -> client): one tagged union, encoded from and decoded into the same Structs --
#
# A field the daemon always sends has no default; one it may leave out has the default a reader
# assumes then. UNSET fields travel only when set (a tokens message names an arena only when its
# arrays lie in one).


class _Reply(msgspec.Struct, tag_field=K_TYPE, kw_only=True, forbid_unknown_fields=False):
    v: int = WIRE_VERSION
    id: int | None  # the subscription or watch it answers (None: a ping)


class BeginReply(_Reply, tag=BEGIN):
    request_id: str
    instance: str
    seq: int | None = None
    tap_key: str = ""
    names: list[str] = []
    response_id: str = ""
    choice_index: int = 0
    num_prompt_tokens: int = 0
    prompt_token_ids: list[int] | None = None
    n: int = 1
    model: str = ""
    spec: dict[str, Any] | None = None
    start_position: int | None = None
    lazy: bool = False
    source: str | None = None
    arena: list[Any] | None = None  # [path, arena_id], for a client that offered to map it


class TokensReply(_Reply, tag=TOKENS):
    request_id: str
    start: int
    count: int
    token_ids: bytes  # int32, little-endian
    seq: int | None = None
    instance: str = ""
    num_prompt_tokens: int = 0
    tensors: list[list[Any]] = []  # [name, dtype, rows, cols] (+ [block, gen, offset] in the arena)
    arena: int | msgspec.UnsetType = msgspec.UNSET  # the arena's id when `tensors` lie in it


class GapReply(_Reply, tag=GAP):
    request_id: str
    start: int
    stop: int
    seq: int | None = None
    instance: str = ""
    reason: str = ""


class EndReply(_Reply, tag=END):
    request_id: str
    instance: str
    reason: str
    seq: int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    output_token_ids: list[int] = []
    end_position: int | None = None
    expected: list[int] | None = None  # [start, stop)
    missing: list[Any] = []  # [[start, stop], ...], read by positions.PositionRanges
    complete: bool = False
    delivered: int = 0
    response_id: str = ""
    choice_index: int = 0
    source: str | None = None


class ErrorReply(_Reply, tag=ERROR):
    code: str = ""
    message: str = ""


class StatusReply(_Reply, tag=STATUS):
    status: dict[str, Any]


class PingReply(_Reply, tag=PING):
    pass


class WatchingReply(_Reply, tag=WATCHING):
    since: int
    oldest: int | None = None
    next: int | None = None
    run_first: int | None = None
    arena: list[Any] | None = None


class LostReply(_Reply, tag=LOST):
    first: int
    last: int
    reason: str = ""
    detail: str = ""


class WatermarkReply(_Reply, tag=WATERMARK):
    seq: int


Reply = Union[BeginReply, TokensReply, GapReply, EndReply, ErrorReply, StatusReply, PingReply, WatchingReply,
              LostReply, WatermarkReply]
assert tuple(t.__struct_config__.tag for t in Reply.__args__) == REPLY_TYPES  # type: ignore[attr-defined]
_REPLY = msgspec.msgpack.Decoder(Reply)
_ENCODER = msgspec.msgpack.Encoder()


def encode(reply: Reply) -> bytes:
    """A reply's header frame."""
    return _ENCODER.encode(reply)


def decode_reply(frame: bytes | memoryview) -> Reply:
    """A daemon's reply, in one typed decode; WireError when it is not one of this version."""
    try:
        reply = _REPLY.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        h = unpack_header(frame)  # says why when it is not a message of this version at all
        raise WireError(E_BAD_REQUEST, f"bad {h[K_TYPE]!r} message: {e}", h.get(K_ID)) from None
    if reply.v != WIRE_VERSION:
        raise WireError(E_VERSION, f"wire version {reply.v!r} not supported; this side speaks version {WIRE_VERSION}",
                        reply.id)
    return reply


def unpack_header(frame: bytes | memoryview, max_bytes: int | None = None) -> dict[str, Any]:
    """The header map of a message; WireError when it is not one of this version."""
    if max_bytes is not None and len(frame) > max_bytes:
        raise WireError(E_BAD_REQUEST, f"header of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        header = msgpack.unpackb(frame, raw=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise WireError(E_BAD_REQUEST, f"header is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise WireError(E_BAD_REQUEST, f"header must be a msgpack map, got {type(header).__name__}")
    sub_id = header.get(K_ID)
    if not (sub_id is None or (isinstance(sub_id, int) and not isinstance(sub_id, bool))):
        raise WireError(E_BAD_REQUEST, f"'{K_ID}' must be an integer, got {sub_id!r}")
    version = header.get(K_VERSION)
    if version != WIRE_VERSION:
        raise WireError(
            E_VERSION, f"wire version {version!r} not supported; this side speaks version {WIRE_VERSION}", sub_id
        )
    if not isinstance(header.get(K_TYPE), str):
        raise WireError(E_BAD_REQUEST, f"'{K_TYPE}' must be a string", sub_id)
    return header


# -- requests --


@dataclass(frozen=True)
class Subscribe:
    id: int
    name: str
    index: int | None = None  # choice index, for a name shared by several captures
    instance: str | None = None  # engine instance, for request ids that repeat across instances
    from_position: int | None = None  # resume: positions below this are not sent again
    timeout: float = 30.0  # how long the daemon waits for the name to appear
    arena: bool = False  # the client can map the daemon's arena: send descriptors, not buffers

    def frames(self) -> list[bytes]:
        return [pack(SUBSCRIBE, self.id, name=self.name, index=self.index, instance=self.instance,
                     from_position=self.from_position, timeout=self.timeout, arena=self.arena)]


@dataclass(frozen=True)
class StatusRequest:
    id: int

    def frames(self) -> list[bytes]:
        return [pack(STATUS, self.id)]


@dataclass(frozen=True)
class Cancel:
    id: int

    def frames(self) -> list[bytes]:
        return [pack(CANCEL, self.id)]


Request = Union[Subscribe, StatusRequest, Cancel, "WatchRequest"]


def _opt_int(h: dict, key: str, sub_id: int | None) -> int | None:
    v = h.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise WireError(E_BAD_REQUEST, f"'{key}' must be a non-negative integer or nil, got {v!r}", sub_id)
    return v


def parse_request(frames: Sequence[bytes]) -> Request:
    """Validate a client's message; WireError (with the id when it could be read) if it is bad."""
    if len(frames) != 1:
        raise WireError(E_BAD_REQUEST, f"a request is exactly one frame, got {len(frames)}")
    h = unpack_header(frames[0], MAX_REQUEST_BYTES)
    sub_id = h.get(K_ID)
    t = h[K_TYPE]
    if t not in REQUEST_TYPES:
        raise WireError(E_BAD_REQUEST, f"unknown message type {t!r}; expected one of {', '.join(REQUEST_TYPES)}", sub_id)
    sid = 0 if sub_id is None else sub_id
    if t == WATCH:
        return parse_watch(h, sid)
    if t == STATUS:
        return StatusRequest(sid)
    if t == CANCEL:
        return Cancel(sid)
    name = h.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise WireError(E_BAD_REQUEST, f"'name' must be a non-empty string of at most {MAX_NAME_CHARS} characters", sub_id)
    instance = h.get("instance")
    if instance is not None and not isinstance(instance, str):
        raise WireError(E_BAD_REQUEST, f"'instance' must be a string or nil, got {instance!r}", sub_id)
    timeout = h.get("timeout", 30.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= MAX_TIMEOUT_S:
        raise WireError(E_BAD_REQUEST, f"'timeout' must be seconds in 0..{MAX_TIMEOUT_S:g}, got {timeout!r}", sub_id)
    arena = h.get("arena", False)
    if not isinstance(arena, bool):
        raise WireError(E_BAD_REQUEST, f"'arena' must be true or false, got {arena!r}", sub_id)
    return Subscribe(sid, name, _opt_int(h, "index", sub_id), instance, _opt_int(h, "from_position", sub_id),
                     float(timeout), arena)


def error_frames(code: str, message: str, sub_id: int | None = None) -> list[bytes]:
    return [encode(ErrorReply(id=sub_id, code=code, message=message))]


# -- tensors --


def describe_tensors(tensors: dict[str, np.ndarray], dtypes: dict[str, int]) -> tuple[list[list], list[np.ndarray]]:
    """Header descriptors and the buffers to send as frames (C-contiguous, never copied here)."""
    descs: list[list] = []
    bufs: list[np.ndarray] = []
    for name, arr in tensors.items():
        if arr.ndim != 2 or not arr.flags.c_contiguous:
            raise ValueError(f"tensor {name} must be a C-contiguous 2-D array")
        descs.append([name, rf.DTYPE_NAMES[dtypes[name]], arr.shape[0], arr.shape[1]])  # type: ignore[index]
        bufs.append(arr)
    return descs, bufs


def describe_arena(tensors: dict[str, np.ndarray], dtypes: dict[str, int], locate: Any) -> list[list] | None:
    """Arena descriptors of every tensor (arena_format), or None when one of them is not in the arena
    (`locate(array)` -> (block, gen, offset) | None)."""
    descs: list[list] = []
    for name, arr in tensors.items():
        where = locate(arr)
        if where is None or arr.ndim != 2:
            return None
        block, gen, offset = where
        descs.append([name, rf.DTYPE_NAMES[dtypes[name]], arr.shape[0], arr.shape[1], block, gen, offset])  # type: ignore[index]
    return descs


def read_tensors(descs: Iterable[Sequence], frames: Sequence[Any]) -> dict[str, tuple[rf.DType, np.ndarray]]:
    """(dtype code, array in storage dtype) per name; arrays view the frames' memory."""
    descs = list(descs)
    if len(descs) != len(frames):
        raise WireError(E_BAD_REQUEST, f"{len(descs)} tensors described but {len(frames)} buffers sent")
    out: dict[str, tuple[rf.DType, np.ndarray]] = {}
    for desc, frame in zip(descs, frames):
        try:
            name, dtype_name, rows, cols = desc
            code = rf.DTYPE_BY_NAME[dtype_name]
        except (KeyError, TypeError, ValueError):
            raise WireError(E_BAD_REQUEST, f"bad tensor descriptor {desc!r}") from None
        buf = frame.buffer if hasattr(frame, "buffer") else frame
        dt = rf.storage_dtype(code)
        if len(memoryview(buf).cast("B")) != rows * cols * dt.itemsize:
            raise WireError(E_BAD_REQUEST, f"tensor {name}: buffer size does not match [{rows}, {cols}] {dtype_name}")
        out[name] = (code, np.frombuffer(buf, dt).reshape(rows, cols))
    return out


# -- watch: every capture, in sequence order, resumable (daemon/watch.py keeps the rules) --

# Why captures first..last of a `lost` message will not come (its "reason"; "detail" says more).
LOST_EVICTED = "evicted"  # dropped from the daemon's memory (retain_bytes / retain_ttl_s) before the watch began
LOST_TOO_SLOW = "watcher too slow"  # dropped while this watcher was attached but had not read it yet
LOST_RESTARTED = "daemon restarted"  # numbered by an earlier run of the daemon, whose memory is gone
LOST_DROPPED = "dropped"  # taken out before it ended (e.g. replaced by a new capture with the same request id)
LOST_REASONS = (LOST_EVICTED, LOST_TOO_SLOW, LOST_RESTARTED, LOST_DROPPED)

SOURCES = ("client", "policy")  # a capture's source: the request opted in, or the server's policy chose it
WATCH_FILTERS = ("instance", "source", "tap_key_prefix", "model")
_WATCH_KEYS = {K_VERSION, K_TYPE, K_ID, "since", "whole", "arena", *WATCH_FILTERS}
MAX_SEQ = (1 << 63) - 1


@dataclass(frozen=True)
class WatchRequest:
    """Every capture with seq > since (None: only captures that begin from now on) that passes the
    filters; `whole`: each capture in one piece at its end, else streamed as it runs."""

    id: int
    since: int | None = None
    whole: bool = True
    instance: str | None = None
    source: str | None = None
    tap_key_prefix: str | None = None
    model: str | None = None
    arena: bool = False  # the client can map the daemon's arena (see "Shared memory" above)

    def frames(self) -> list[bytes]:
        return [pack(WATCH, self.id, since=self.since, whole=self.whole, instance=self.instance, source=self.source,
                     tap_key_prefix=self.tap_key_prefix, model=self.model, arena=self.arena)]

    def filters(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in WATCH_FILTERS if getattr(self, k) is not None}


def parse_watch(h: dict[str, Any], sub_id: int) -> WatchRequest:
    unknown = sorted(k for k in h if k not in _WATCH_KEYS)
    if unknown:
        raise WireError(E_BAD_FILTER, f"unknown watch filter {unknown[0]!r} (known: {', '.join(WATCH_FILTERS)})", sub_id)
    since = h.get("since")
    if since is not None and (isinstance(since, bool) or not isinstance(since, int) or not 0 <= since <= MAX_SEQ):
        raise WireError(E_BAD_SINCE, f"'since' must be a sequence number >= 0 or nil, got {since!r}", sub_id)
    whole = h.get("whole", True)
    if not isinstance(whole, bool):
        raise WireError(E_BAD_FILTER, f"'whole' must be true or false, got {whole!r}", sub_id)
    arena = h.get("arena", False)
    if not isinstance(arena, bool):
        raise WireError(E_BAD_FILTER, f"'arena' must be true or false, got {arena!r}", sub_id)
    vals: dict[str, str | None] = {}
    for key in WATCH_FILTERS:
        v = h.get(key)
        if v is not None and (not isinstance(v, str) or not v or len(v) > MAX_NAME_CHARS):
            raise WireError(E_BAD_FILTER,
                            f"watch filter {key!r} must be a non-empty string of at most {MAX_NAME_CHARS} characters, "
                            f"got {v!r}", sub_id)
        vals[key] = v
    if vals["source"] is not None and vals["source"] not in SOURCES:
        raise WireError(E_BAD_FILTER, f"watch filter 'source' must be one of {', '.join(SOURCES)}, got {vals['source']!r}",
                        sub_id)
    return WatchRequest(sub_id, since, whole, **vals, arena=arena)
