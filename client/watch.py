"""Watch every capture: the client side of the resumable capture stream (numpy only).

    from . import Client, LostCaptures

    w = Client().watch(since=last_stored_seq, source="policy")       # whole=True: one item per capture
    for item in w:
        if isinstance(item, LostCaptures):     # captures item.first..item.last will not come, item.reason says why
            ...
        else:                                  # a WatchedCapture: item.seq, item.begin, item.capture, item.end
            store(item); persist(w.last_seq)

Rules (the daemon side, daemon/watch.py, keeps the same ones):
- Every capture has a sequence number `seq`, given by the daemon when the capture begins, strictly
  increasing across daemon restarts. `since` is the last seq the caller has safely stored; it then
  gets every capture with seq > since exactly once while the daemon still retains it. since=None:
  only captures that begin after the watch started.
- Whole mode (the default) yields one WatchedCapture per capture at its end, in seq order: a capture
  that ends late holds back later ones for this watcher. Streamed mode (whole=False) yields
  WatchStart / WatchData / WatchEnd as captures run: starts come in seq order, the data of
  concurrent captures interleaves, each capture's positions come in order.
- What will not come arrives as LostCaptures(first, last, reason), never as a silent hole (reasons:
  wire_format.LOST_REASONS). Over shared memory (same host), a capture whose arrays the daemon
  reused before this watcher copied them is lost as "watcher too slow" in whole mode; in streamed
  mode those positions come as a Gap (client.arena.OVERWRITTEN). Captures the filters exclude are skipped silently; they still advance
  `last_seq` (the daemon sends a watermark), so a caller that persists `last_seq` makes progress.
  watermarks=True also yields Watermark items, for callers that persist only between items.
- `last_seq` is the highest seq such that every capture up to it has been yielded, reported lost or
  filtered out: persist it after storing what was yielded, and pass it as `since` after a restart.
- If the daemon goes silent (it sends a watermark every second when idle), the watch is resent with
  since=last_seq; a restarted daemon answers with LostCaptures for what its predecessor held.
  A daemon that says it is stopping (SIGTERM, `systemctl restart`) is treated the same way: the watch
  waits for the next daemon and resends itself, so a graceful restart and a crash look alike to the
  caller; with watermarks=True the stop is yielded as a DaemonStopping item (a Watermark: every
  capture up to its seq was handled), the moment to persist what is held, since the captures the
  stopping daemon retains go with it. DaemonUnavailable after `timeout` seconds without contact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Sequence, Union

import msgspec
import zmq
import zmq.asyncio

from vllm_tap import wire_format as wf
from vllm_tap.positions import PositionRanges

from .arena import OVERWRITTEN, ArenaUse
from .errors import DaemonStopped, DaemonUnavailable, ProtocolError, TapError, error_for
from .records import Capture, CaptureBegin, CaptureBuilder, CaptureEnd, Chunk, Gap
from .stream import decode_begin, decode_chunk, decode_end, end_missing

log = logging.getLogger(__name__)

WATCH_HEARTBEAT_S = 1.0  # the daemon's keepalive period; 3 missed ones and the watch is resent
WATCH_TIMEOUT_S = 60.0  # contact lost this long: DaemonUnavailable
RCVHWM = 1024  # messages buffered from the daemon; beyond that the daemon waits (and the watcher may lose)
_POLL_S = 0.2  # how often a blocked iterator looks at close()
_ids = itertools.count(1)


def new_watch_id() -> int:
    """A watch id unique on this host: the upper half of the pid's id range (subscriptions use the lower)."""
    return (os.getpid() << 20) + (1 << 19) + next(_ids) % (1 << 19)


def watch_state(endpoint: str, since: int | None, *, instance: str | None, source: str | None,
                tap_key_prefix: str | None, model: str | None, whole: bool, watermarks: bool, timeout: float,
                heartbeat_s: float) -> "WatchState":
    filters = {"instance": instance, "source": source, "tap_key_prefix": tap_key_prefix, "model": model}
    return WatchState(endpoint, since, filters, whole, watermarks, timeout, heartbeat_s, new_watch_id())


# -- what a watcher gets --


@dataclass(frozen=True)
class LostCaptures:
    """Captures first..last (inclusive) will not be delivered. `reason` is one of
    wire_format.LOST_REASONS: "evicted", "watcher too slow", "daemon restarted", "dropped"."""

    first: int
    last: int
    reason: str
    detail: str = ""

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, int) and self.first <= seq <= self.last


@dataclass(frozen=True)
class WatchedCapture:
    """One whole capture (whole mode): its sequence number, begin, stacked data and end."""

    seq: int
    begin: CaptureBegin
    capture: Capture
    end: CaptureEnd
    gaps: tuple[Gap, ...] = ()  # the missing ranges with their reasons, in position order

    @property
    def request_id(self) -> str:
        return self.begin.request_id

    @property
    def instance(self) -> str:
        return self.begin.instance

    @property
    def tap_key(self) -> str:
        return self.begin.tap_key

    @property
    def response_id(self) -> str:
        return self.begin.response_id

    @property
    def choice_index(self) -> int:
        return self.begin.choice_index

    @property
    def model(self) -> str:
        return self.begin.model

    @property
    def source(self) -> str:
        return self.capture.source  # the daemon's last word (the END), as fetch() and the dataset have it


@dataclass(frozen=True)
class WatchStart:
    """Streamed mode: capture `seq` began (or, after a replay, is replayed from its beginning)."""

    seq: int
    begin: CaptureBegin

    @property
    def source(self) -> str:
        return self.begin.source


@dataclass(frozen=True)
class WatchData:
    """Streamed mode: the next consecutive positions of capture `seq`, as data (Chunk) or a Gap."""

    seq: int
    item: Union[Chunk, Gap]


@dataclass(frozen=True)
class WatchEnd:
    """Streamed mode: capture `seq` ended; every expected position came before it as data or a Gap."""

    seq: int
    end: CaptureEnd


@dataclass(frozen=True)
class Watermark:
    """Every capture up to `seq` has been yielded, reported lost or filtered out (watermarks=True)."""

    seq: int


@dataclass(frozen=True)
class DaemonStopping(Watermark):
    """The daemon said it is stopping (`reason`); the watch goes on with the next daemon, from `seq`.
    What the stopping daemon retains goes with it: persist what is held (watermarks=True)."""

    reason: str = ""


WatchItem = Union[WatchedCapture, WatchStart, WatchData, WatchEnd, LostCaptures, Watermark]


class WatchRejected(TapError, ValueError):
    """The daemon refused the watch: a bad filter, a `since` it never gave out, or too many watches."""


def _bytes(frame: Any) -> bytes | memoryview:
    return frame.buffer if hasattr(frame, "buffer") else frame


_REJECTED = {wf.E_BAD_FILTER, wf.E_BAD_SINCE, wf.E_LIMIT}


class WatchState:
    """One watch's protocol state, without IO (shared by the blocking and the asyncio watch)."""

    def __init__(self, endpoint: str, since: int | None, filters: dict[str, str | None], whole: bool,
                 watermarks: bool, timeout: float, heartbeat_s: float, sub_id: int):
        if since is not None and (isinstance(since, bool) or not isinstance(since, int) or since < 0):
            raise WatchRejected(f"since must be a sequence number >= 0 or None, got {since!r}")
        self.endpoint = endpoint
        self.filters = {k: v for k, v in filters.items() if v is not None}
        for k in self.filters:
            if k not in wf.WATCH_FILTERS:
                raise WatchRejected(f"unknown watch filter {k!r} (known: {', '.join(wf.WATCH_FILTERS)})")
        self.whole = whole
        self.watermarks = watermarks
        self.timeout = timeout
        self.heartbeat_s = heartbeat_s
        self.sub_id = sub_id
        self.arena = ArenaUse(endpoint)  # same host: arrays are copied out of the daemon's shared memory
        self.outbox: list[list[bytes]] = []  # messages on_frames wants sent (the caller sends them)
        self._overwritten: dict[int, PositionRanges] = {}  # seq -> positions lost to a reused arena region
        self.last_seq: int | None = since
        self.accepted: dict[str, Any] | None = None  # the daemon's `watching` answer
        self.done = False
        self._stopped: str | None = None  # the reason of a stop no daemon has answered since
        self._heard = 0.0
        self._sent = 0.0
        # whole mode: the capture being received
        self._cur_seq: int | None = None
        self._cur_next: int | None = None  # whole mode: the next position the capture being built needs
        self._cur_begin: CaptureBegin | None = None
        self._cur: CaptureBuilder | None = None
        # streamed mode: captures started and not yet ended, and ended ones above last_seq
        self._open: dict[int, CaptureBegin] = {}
        self._next_pos: dict[int, int | None] = {}  # streamed: next position of each open capture
        self._done: list[list[int]] = []  # sorted, disjoint [first, last] handled above last_seq

    # -- what to send --

    def request(self, now: float) -> list[bytes]:
        self._sent = now
        if not self._heard:
            self._heard = now
        return wf.WatchRequest(self.sub_id, self.last_seq, self.whole, **self.filters, arena=self.arena.offer).frames()

    def cancel(self) -> list[bytes]:
        return wf.Cancel(self.sub_id).frames()

    def silence_limit(self) -> float:
        return 3 * self.heartbeat_s

    def on_silence(self, now: float) -> list[bytes] | None:
        """Frames to send after a quiet spell (None: keep waiting); raises once contact is lost for good."""
        if now - self._heard > self.timeout:
            if self._stopped is not None:
                raise DaemonStopped(f"daemon stopped: {self._stopped}; no daemon answered at {self.endpoint} in the "
                                    f"{now - self._heard:.0f} s since (last seq {self.last_seq})")
            raise DaemonUnavailable(
                f"no word from the daemon at {self.endpoint} for {now - self._heard:.0f} s while watching "
                f"(last seq {self.last_seq}); is `vllm-tap daemon` running?")
        if now - self._heard >= self.silence_limit() and now - self._sent >= self.heartbeat_s:
            # A live daemon ignores the repeat of a watch it serves; a restarted one starts it afresh.
            return self.request(now)
        return None

    # -- what came --

    def on_frames(self, frames: Sequence[Any], now: float) -> list[WatchItem]:
        try:
            m = wf.decode_reply(_bytes(frames[0]))
        except wf.WireError as e:
            raise ProtocolError(f"unreadable message from the daemon at {self.endpoint}: {e.message}") from None
        if m.id != self.sub_id:
            return []
        self._heard = now
        if isinstance(m, wf.ErrorReply) and m.code == wf.E_STOPPING:
            return self._stopping(m.message)
        self._stopped = None
        if isinstance(m, wf.ErrorReply):
            self.done = True
            if m.code in _REJECTED:
                raise WatchRejected(m.message)
            raise error_for(m.code, m.message)
        if isinstance(m, wf.WatchingReply):
            if not self.arena.advert(m.arena):
                # The daemon's arena cannot be mapped here: the same watch again, under a new id,
                # with payloads as frames.
                self.outbox.append(self.cancel())
                self.sub_id = new_watch_id()
                self.outbox.append(self.request(now))
                return []
            self.accepted = msgspec.to_builtins(m)
            # A watch (re)started by the daemon replays from since: a half-received capture starts over.
            self._cur_seq = self._cur_begin = self._cur = None
            if self.last_seq is None:
                self.last_seq = m.since
            return []
        if isinstance(m, wf.WatermarkReply):
            return self._watermark(m.seq)
        if isinstance(m, wf.LostReply):
            return self._lost(m.first, m.last, m.reason, m.detail)
        if not isinstance(m, (wf.BeginReply, wf.TokensReply, wf.GapReply, wf.EndReply)):
            raise ProtocolError(f"unexpected message type {m.__struct_config__.tag!r} from the daemon")
        seq = m.seq
        if seq is None:
            raise ProtocolError(f"watch message {m.__struct_config__.tag!r} without a sequence number")
        if isinstance(m, wf.BeginReply):
            return self._on_begin(seq, decode_begin(m))
        if isinstance(m, wf.TokensReply):
            begin = self._cur_begin if self._cur_seq == seq else self._open.get(seq)
            chunk = decode_chunk(m, frames[1:], self.arena, begin)
            if chunk is None:  # copied too late: the daemon had reused the region
                start, stop = m.start, m.start + m.count
                self._overwritten[seq] = self._overwritten.get(seq, PositionRanges()).union([range(start, stop)])
                return self._on_item(seq, Gap(range(start, stop), OVERWRITTEN, m.request_id))
            return self._on_item(seq, chunk)
        if isinstance(m, wf.GapReply):
            return self._on_item(seq, Gap(range(m.start, m.stop), m.reason, m.request_id))
        end = decode_end(m, end_missing(m))
        lost = self._overwritten.pop(seq, None)
        if lost and self.whole and not self._handled(seq):
            # A whole capture is delivered exact or not at all: this one went while we lagged.
            return self._lost(seq, seq, wf.LOST_TOO_SLOW, OVERWRITTEN)
        if lost:
            end = dataclasses.replace(end, missing_positions=end.missing_positions.union(lost))
        return self._on_end(seq, end)

    def _stopping(self, reason: str) -> list[WatchItem]:
        """The daemon stops: wait for the next one as after a crash (on_silence resends the watch
        once the silence limit passes; `timeout` counts from now)."""
        log.warning("the daemon at %s is stopping (%s): the watch goes on from seq %s with the next daemon",
                    self.endpoint, reason, self.last_seq)
        self._cur_seq = self._cur_begin = self._cur = None  # a half-received capture: the next daemon decides
        self._stopped = reason
        if self.watermarks and self.last_seq is not None:
            return [DaemonStopping(self.last_seq, reason)]
        return []

    def _advance(self, first: int, last: int | None = None) -> None:
        """Captures first..last are handled; move last_seq over every handled capture that follows it."""
        last = first if last is None else last
        if self.whole:  # in order: nothing above last_seq is ever handled early
            if self.last_seq is None or last > self.last_seq:
                self.last_seq = last
            return
        _add_interval(self._done, first, last)
        if self.last_seq is None:
            return
        while self._done and self._done[0][0] <= self.last_seq + 1:
            a, b = self._done.pop(0)
            self.last_seq = max(self.last_seq, b)

    def _watermark(self, seq: int) -> list[WatchItem]:
        if self.last_seq is None or seq > self.last_seq:
            self._advance(seq if self.last_seq is None else self.last_seq + 1, seq)
        return [Watermark(seq)] if self.watermarks else []

    def _lost(self, first: int, last: int, reason: str, detail: str) -> list[WatchItem]:
        lo = first if self.last_seq is None else max(first, self.last_seq + 1)
        if lo > last:
            return []
        if self.whole:
            if self._cur_seq is not None and lo <= self._cur_seq <= last:
                self._cur_seq = self._cur_begin = self._cur = None  # a partial capture: never yielded
            self._advance(lo, last)
            return [LostCaptures(lo, last, reason, detail)]
        # Streamed: leave out captures that already ended (a restarted daemon reports its
        # predecessor's whole range), so every capture ends exactly once, as data or as lost.
        out: list[WatchItem] = []
        at = lo
        for a, b in [iv for iv in self._done if iv[1] >= lo and iv[0] <= last]:
            if a > at:
                out.append(LostCaptures(at, a - 1, reason, detail))
            at = max(at, b + 1)
        if at <= last:
            out.append(LostCaptures(at, last, reason, detail))
        for seq in [s for s in self._open if lo <= s <= last]:
            del self._open[seq]
            self._next_pos.pop(seq, None)
        self._advance(lo, last)
        return out

    def _handled(self, seq: int) -> bool:
        """Capture `seq` was already yielded to its end, or reported lost (a replay must not repeat it)."""
        if self.last_seq is not None and seq <= self.last_seq:
            return True
        return any(a <= seq <= b for a, b in self._done)

    def _on_begin(self, seq: int, begin: CaptureBegin) -> list[WatchItem]:
        if self.whole:
            if self._handled(seq):
                return []
            if seq == self._cur_seq:
                self._cur_begin = begin  # a late BEGIN completed the metadata: keep the data so far
                return []
            self._cur_seq, self._cur_begin, self._cur = seq, begin, CaptureBuilder()
            self._cur_next = None
            return []
        # Streamed: a watch the daemon had to start again (a new connection) replays captures above
        # last_seq from their beginning: positions already yielded are dropped here.
        if self._handled(seq) or seq in self._open:
            return []
        self._open[seq] = begin
        self._next_pos[seq] = None
        return [WatchStart(seq, begin)]

    def _on_item(self, seq: int, item: Chunk | Gap) -> list[WatchItem]:
        if self.whole:
            if self._cur_seq != seq:
                if self._handled(seq):
                    return []
                raise ProtocolError(f"data of capture {seq} without its begin")
            assert self._cur is not None
            # A watch started again (a restarted daemon that adopted this capture replays it from
            # its beginning): what the builder has is not added twice.
            item = _since(item, self._cur_next)
            if item is not None:
                self._cur_next = item.stop if isinstance(item, Chunk) else item.positions.stop
                self._cur.add(item)
            return []
        if seq not in self._open:
            if self._handled(seq):
                return []
            raise ProtocolError(f"data of capture {seq} without its begin")
        item = _since(item, self._next_pos[seq])
        if item is None:
            return []
        self._next_pos[seq] = item.stop if isinstance(item, Chunk) else item.positions.stop
        if isinstance(item, Gap):
            log.info("capture %d (%s): positions %d..%d missing (%s)", seq, item.request_id, item.positions.start,
                     item.positions.stop - 1, item.reason)
        return [WatchData(seq, item)]

    def _on_end(self, seq: int, end: CaptureEnd) -> list[WatchItem]:
        if self.whole:
            if self._cur_seq != seq or self._cur is None or self._cur_begin is None:
                if self._handled(seq):
                    return []
                raise ProtocolError(f"end of capture {seq} without its begin")
            cap = self._cur.build(self._cur_begin, end)
            item = WatchedCapture(seq, self._cur_begin, cap, end, tuple(self._cur.gaps))
            self._cur_seq = self._cur_begin = self._cur = None
            self._advance(seq)
            return [item]
        if self._open.pop(seq, None) is None:
            if self._handled(seq):
                return []
            raise ProtocolError(f"end of capture {seq} without its begin")
        self._next_pos.pop(seq, None)
        self._advance(seq)
        return [WatchEnd(seq, end)]


def _since(item: Chunk | Gap, nxt: int | None) -> Chunk | Gap | None:
    """The part of `item` at or after position `nxt` (None: all of it); None when nothing is."""
    start, stop = (item.start, item.stop) if isinstance(item, Chunk) else (item.positions.start, item.positions.stop)
    if nxt is None or start >= nxt:
        return item
    if stop <= nxt:
        return None
    return item.cut(nxt) if isinstance(item, Chunk) else Gap(range(nxt, stop), item.reason, item.request_id)


# -- blocking --


def _add_interval(ivs: list[list[int]], a: int, b: int) -> None:
    """Merge [a, b] into the sorted, disjoint intervals `ivs` (adjacent ones join)."""
    i = 0
    while i < len(ivs) and ivs[i][1] < a - 1:
        i += 1
    j = i
    while j < len(ivs) and ivs[j][0] <= b + 1:
        a, b = min(a, ivs[j][0]), max(b, ivs[j][1])
        j += 1
    ivs[i:j] = [[a, b]]


class Watch:
    """`for item in watch` blocks for the next item; it ends only on an error or close()."""

    def __init__(self, ctx: zmq.Context, state: WatchState):
        self._ctx = ctx
        self._state = state
        self._closed = False

    @property
    def last_seq(self) -> int | None:
        """Highest seq such that every capture up to it was yielded, reported lost or filtered out
        (None until the daemon answered a watch with since=None)."""
        return self._state.last_seq

    @property
    def accepted(self) -> dict[str, Any] | None:
        """The daemon's answer: since, oldest (lowest seq it retains), next, run_first."""
        return self._state.accepted

    def __iter__(self) -> Iterator[WatchItem]:
        st = self._state
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.connect(st.endpoint)
        try:
            _send(sock, st.request(time.monotonic()))
            while not st.done and not self._closed:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    if not sock.poll(int(min(_POLL_S, st.heartbeat_s) * 1000), zmq.POLLIN):
                        again = st.on_silence(time.monotonic())
                        if again is not None:
                            _send(sock, again)
                    continue
                yield from st.on_frames(frames, time.monotonic())
                while st.outbox:
                    _send(sock, st.outbox.pop(0))
        finally:
            if not st.done:
                _send(sock, st.cancel())
            sock.close(linger=0)

    def close(self) -> None:
        """Stop: an iteration in progress returns within a fraction of a second."""
        self._closed = True

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _send(sock: zmq.Socket, frames: list[bytes]) -> None:
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass  # not connected yet: resent after the silence limit


# -- asyncio --


class AsyncWatch:
    """`async for item in watch`: the same items and rules as Watch."""

    def __init__(self, ctx: zmq.asyncio.Context, state: WatchState):
        self._ctx = ctx
        self._state = state
        self._closed = False

    @property
    def last_seq(self) -> int | None:
        return self._state.last_seq

    @property
    def accepted(self) -> dict[str, Any] | None:
        return self._state.accepted

    async def __aiter__(self) -> AsyncIterator[WatchItem]:
        st = self._state
        loop = asyncio.get_running_loop()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.connect(st.endpoint)
        try:
            await _asend(sock, st.request(loop.time()))
            while not st.done and not self._closed:
                if await sock.poll(int(min(_POLL_S, st.heartbeat_s) * 1000), zmq.POLLIN):
                    frames = await sock.recv_multipart(copy=False)
                    for item in st.on_frames(frames, loop.time()):
                        yield item
                    while st.outbox:
                        await _asend(sock, st.outbox.pop(0))
                else:
                    again = st.on_silence(loop.time())
                    if again is not None:
                        await _asend(sock, again)
        finally:
            if not st.done:
                try:
                    sock.send_multipart(st.cancel(), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            sock.close(linger=0)

    def close(self) -> None:
        self._closed = True


async def _asend(sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
    try:
        await sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass
