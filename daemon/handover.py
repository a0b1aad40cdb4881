"""What a gracefully stopping daemon hands to the next one: the captures in flight it read from the
rings and did not deliver.

Ring read cursors are persisted as records are read, so a restarted daemon resumes exactly where
the last one stopped; what the last one had read but not yet delivered would be lost with it: the
BEGIN and END records of captures still in flight (from the engine ring, so their ENDs would never
be seen again), pending tensor-parallel slices, positions held back until a later one or the END
comes. On a graceful stop (SIGTERM, the systemd stop) the daemon writes these to
`<state_dir>/handover.msgpack`; the next daemon reads the file once at start-up, deletes it, and
continues those captures from where they were. What the stopping daemon had delivered of them (its
retained history: the data and gaps its subscribers got) goes over as well, so a subscriber of the
next daemon gets every position a graceful stop had read, up to MAX_DELIVERED_BYTES of them in all;
positions delivered and not handed over (past that, or no longer held) come as one Gap `not
captured: consumed by a previous daemon`, as after a crash. A crash writes nothing: captures then end through the engine's LIVE
records.

Rules: the file is written beside its final name and renamed in (a reader never sees half of
one), in the daemon's own state directory. It is decoded against the schema below with bounds:
a file that does not fit is logged in one line and ignored, never a reason not to start. Control
records go back through the ring schema (vllm_tap.ring_schema.control_record), arrays are checked
against their dtype and shape.

This module is the codec between reassembly's state and the file: `export` makes an InFlight of a
capture in flight (daemon/assembly.py), `resume` the Assembly an InFlight continues as, with the
pending slices to feed again; the state machine itself only hands its assemblies out and adopts
resumed ones.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap import ring_records
from vllm_tap.ring_records import ControlRecord, TensorId
from vllm_tap.ring_schema import BeginMeta, ControlMeta, EndMeta, control_record
from vllm_tap.spec import CaptureSpec

from .assembly import Assembly, Tally
from .events import NOT_CAPTURED_PREVIOUS, Event, Gap, Tokens
from .ordering import Span, push

log = logging.getLogger(__name__)

HANDOVER_FILE = "handover.msgpack"
HANDOVER_VERSION = 1
MAX_HANDOVER_BYTES = 1 << 32  # a bound on what is read back; the daemon's inflight_bytes keeps it far below
# What a stop hands over of the positions it had delivered, at most: the file is written within the
# stop's few seconds (systemd gives 15). Captures beyond it hand over their metadata and held data
# alone, and the positions delivered become one Gap NOT_CAPTURED_PREVIOUS, as before.
MAX_DELIVERED_BYTES = 256 << 20
_DTYPES = frozenset({"<f4", "<f2", "<u2", "<i4", "<i8", "<f8", "|u1"})


class Array(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, a: np.ndarray) -> "Array":
        a = np.ascontiguousarray(a)
        return cls(a.dtype.str, list(a.shape), a.tobytes())

    def array(self, alloc: Any = None) -> np.ndarray:
        """The array, in a region `alloc` (the arena's, for a tensor: so the next restart's journal
        can name it) gives, else on the heap."""
        if self.dtype not in _DTYPES or not 1 <= len(self.shape) <= 2 or min(self.shape) < 0:
            raise ValueError(f"array of dtype {self.dtype!r} and shape {self.shape}")
        dt = np.dtype(self.dtype)
        if int(np.prod(self.shape)) * dt.itemsize != len(self.data):
            raise ValueError(f"array of shape {self.shape} and dtype {self.dtype} in {len(self.data)} bytes")
        src = np.frombuffer(self.data, dt).reshape(self.shape)
        out = alloc(tuple(self.shape), dt) if alloc is not None and len(self.shape) == 2 else None
        if out is None:
            return src.copy()
        out[...] = src
        return out


class Slice(msgspec.Struct, forbid_unknown_fields=True):
    """A DATA record of a pending group (one rank's slice of one tensor at one step)."""

    ring: str
    epoch: int
    rank: int
    step: int
    expected_ranks: int
    rank_parts: int
    kind: int
    layer: int
    dtype: int
    slice_start: int
    slice_stop: int
    full_dim: int
    num_prompt_tokens: int
    positions: Array
    token_ids: Array
    data: Array


class HeldSpan(msgspec.Struct, forbid_unknown_fields=True):
    """Consecutive positions ready for delivery (daemon/ordering.py Span): data (tensors by name), or
    a gap (reason)."""

    start: int
    stop: int
    reason: str = ""
    positions: Array | None = None
    token_ids: Array | None = None
    tensors: dict[str, Array] = {}
    dtypes: dict[str, int] = {}


class InFlight(msgspec.Struct, forbid_unknown_fields=True):
    """One capture in flight, as the next daemon continues it."""

    request_id: str
    tap_key: str
    num_prompt_tokens: int
    lazy: bool
    source: str
    begin: dict[str, Any] | None  # the BEGIN record's meta, None when none was seen
    end: dict[str, Any] | None  # the END record's meta, None when none was seen
    spec: dict[str, Any] | None
    tail: int
    start: int | None
    frontier: int | None
    stop: int | None
    max_seen: int
    sources: list[str]
    cut: str | None
    hold: int
    spans: list[HeldSpan] = msgspec.field(name="chunks")
    slices: list[Slice]
    shed: str | None = None  # a worker shed it (SHED record read): it ends as one Gap with this reason
    # What the stopping daemon had delivered below `frontier` (its history), in position order
    delivered: list[HeldSpan] = []


class Handover(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    instances: dict[str, list[InFlight]]


def path_in(state_dir: str) -> str:
    return os.path.join(state_dir, HANDOVER_FILE)


def write(state_dir: str, instances: dict[str, list[InFlight]]) -> int:
    """Write the handover (replacing any); the number of captures in it. Nothing to hand over: no file."""
    n = sum(len(v) for v in instances.values())
    path = path_in(state_dir)
    if not n:
        return 0
    tmp = f"{path}.{os.getpid()}.tmp"
    data = msgspec.msgpack.encode(Handover(HANDOVER_VERSION, instances))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    return n


def take(state_dir: str) -> dict[str, list[InFlight]]:
    """Read and delete the handover a previous daemon left ({} when there is none or it is unusable)."""
    path = path_in(state_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.error("handover %s cannot be opened (%s): ignored", path, e)
        return {}
    try:
        size = os.fstat(fd).st_size
        if size > MAX_HANDOVER_BYTES:
            log.error("handover %s is %d bytes, more than %d: ignored", path, size, MAX_HANDOVER_BYTES)
            return {}
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(size)
    finally:
        os.close(fd)
        try:
            os.unlink(path)  # taken once: a crash after this must not hand the same captures over again
        except OSError:
            pass
    try:
        h = msgspec.msgpack.decode(raw, type=Handover)
    except msgspec.DecodeError as e:
        log.error("handover %s does not fit its schema (%s): ignored", path, e)
        return {}
    if h.version != HANDOVER_VERSION:
        log.error("handover %s is version %d, this daemon reads %d: ignored", path, h.version, HANDOVER_VERSION)
        return {}
    return h.instances


# -- the codec: reassembly's state <-> the file --


def _meta(struct: Any, spec: CaptureSpec | None) -> dict[str, Any] | None:
    """A decoded control meta (BeginMeta, EndMeta) as a plain meta the ring schema decodes the same
    (its spec, kept raw there, from the decoded one)."""
    if struct is None:
        return None
    out = {name: getattr(struct, name) for name in struct.__struct_fields__}
    out.pop("spec", None)
    if spec is not None:
        out["spec"] = spec.to_meta()
    return out


def _data_span(t: Tokens) -> HeldSpan:
    return HeldSpan(t.start, t.stop, "", Array.of(t.positions), Array.of(t.token_ids),
                    {n: Array.of(x) for n, x in t.tensors.items()}, dict(t.dtypes))


def _delivered(history: list[Event], below: int | None) -> list[HeldSpan]:
    """A capture's delivered data and gaps (its history) below `below`, in position order."""
    out: list[HeldSpan] = []
    if below is None:
        return out
    for ev in history:
        if type(ev) is Tokens:
            if ev.start < below:
                out.append(_data_span(ev if ev.stop <= below else ev.before(below)))
        elif type(ev) is Gap and ev.positions.start < below:
            out.append(HeldSpan(ev.positions.start, min(ev.positions.stop, below), ev.reason))
    return out


def export(a: Assembly, history: list[Event] = ()) -> InFlight:  # type: ignore[assignment]
    """What was read of a capture in flight: what it holds, and what it delivered (`history`, the
    events filed for it)."""
    spans = []
    for _, _, _, span in sorted(a.ready, key=lambda item: item[:3]):
        t = span.tokens
        if t is None:
            spans.append(HeldSpan(span.start, span.stop, span.reason))
        else:
            spans.append(_data_span(t))
    slices = [Slice(r.ring, r.epoch, r.rank, g.step, g.expected_ranks, r.rank_parts, int(r.tensor.kind), r.tensor.layer,
                    r.dtype, r.slice_start, r.slice_stop, r.full_dim, r.num_prompt_tokens, Array.of(r.positions),
                    Array.of(r.token_ids), Array.of(r.data))
              for g in a.groups.values() for recs in g.parts.values() for r in recs.values()
              if r.tensor is not None and r.data is not None]
    return InFlight(
        a.request_id, a.tap_key, a.num_prompt_tokens, a.lazy, a.source, _meta(a.begin, a.spec), _meta(a.end, a.spec),
        a.spec.to_meta() if a.spec is not None else None, a.tail, a.start, a.frontier, a.stop, a.max_seen,
        sorted(a.sources), a.cut, a.hold, spans, slices, a.shed, _delivered(list(history), a.frontier))


def _span(held: HeldSpan, instance: str, c: InFlight, now: float, alloc: Any = None) -> Span:
    if held.positions is None:
        return Span(held.start, held.stop, None, held.reason)
    pos, ids = held.positions.array(), held.token_ids.array() if held.token_ids is not None else None
    if len(pos) != held.stop - held.start or (ids is not None and len(ids) != len(pos)):
        raise ValueError(f"a span [{held.start}, {held.stop}) of {len(pos)} positions")
    tensors = {name: x.array(alloc) for name, x in held.tensors.items()}
    if any(len(x) != len(pos) for x in tensors.values()):
        raise ValueError(f"a span [{held.start}, {held.stop}) with tensors of other lengths")
    return Span(held.start, held.stop, Tokens(instance, c.request_id, pos, ids, c.num_prompt_tokens, tensors,
                                              dict(held.dtypes), now))


def _previous(c: InFlight, start: int, instance: str, now: float, alloc: Any = None) -> list[Span]:
    """[start, frontier): what the previous daemon delivered, in order; where it no longer held it, a
    Gap NOT_CAPTURED_PREVIOUS."""
    out: list[Span] = []
    at = start
    for held in sorted(c.delivered, key=lambda h: h.start):
        if held.start < at or held.stop > (c.frontier or 0) or held.stop <= held.start:
            raise ValueError(f"delivered span [{held.start}, {held.stop}) outside [{at}, {c.frontier})")
        if held.start > at:
            out.append(Span(at, held.start, None, NOT_CAPTURED_PREVIOUS))
        out.append(_span(held, instance, c, now, alloc))
        at = held.stop
    if c.frontier is not None and at < c.frontier:
        out.append(Span(at, c.frontier, None, NOT_CAPTURED_PREVIOUS))
    return out


def _control(meta: dict[str, Any], kind: type[ControlMeta]) -> ControlMeta:
    """A BEGIN's or END's meta as a handover file carries it (its spec as CaptureSpec.to_meta()),
    decoded as the ring's record would be."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=kind)


def resume(c: InFlight, instance: str, tally: Tally, now: float, alloc: Any = None
           ) -> tuple[Assembly, ControlRecord | None, list[ring_records.Slice]]:
    """The Assembly a handed-over capture continues as (the positions the previous daemon delivered
    first, as it delivered them, then what it held), its END record (None if it had none), and its
    pending slices to feed again. Raises ring_schema.Rejected, ValueError, KeyError
    or TypeError for a capture that cannot be continued. `alloc`: where its tensors go (the arena)."""
    begin = control_record(_control(c.begin, BeginMeta), c.request_id, tap_key=c.tap_key) \
        if c.begin is not None else None
    end = control_record(_control(c.end, EndMeta), c.request_id, tap_key=c.tap_key) if c.end is not None else None
    spans = [_span(held, instance, c, now, alloc) for held in c.spans]
    slices = [ring_records.Slice(
        request_id=c.request_id, tap_key=c.tap_key, step=sl.step, rank=sl.rank,
        expected_ranks=sl.expected_ranks, rank_parts=sl.rank_parts, tensor=TensorId.of(rf.TensorKind(sl.kind), sl.layer),
        dtype=sl.dtype, slice_start=sl.slice_start, slice_stop=sl.slice_stop, full_dim=sl.full_dim,
        num_prompt_tokens=sl.num_prompt_tokens, positions=sl.positions.array(), token_ids=sl.token_ids.array(),
        data=sl.data.array(), ring=sl.ring, epoch=sl.epoch, source=c.source) for sl in c.slices]
    spec = CaptureSpec.from_meta(c.spec) if c.spec is not None else None
    a = Assembly(instance, c.request_id, c.tap_key, c.num_prompt_tokens, c.lazy, tally, source=c.source,
                 inherited=True, hold=c.hold, tail=c.tail, max_seen=c.max_seen, sources=set(c.sources), cut=c.cut,
                 shed=c.shed)
    if begin is not None:
        a.apply_begin(begin)
    if spec is not None and a.spec is None:
        a.apply_spec(spec, c.source)
    a.source = c.source
    start = c.start if c.start is not None else c.frontier
    if start is not None:
        a.start = a.frontier = a.first_frontier = start
        if c.frontier is not None and c.frontier > start:  # delivered by the previous daemon
            for span in _previous(c, start, instance, now, alloc):
                push(a, span)
    if end is not None:
        a.stop = c.stop
    for span in spans:
        push(a, span)
    return a, end, slices
