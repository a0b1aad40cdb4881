"""One subscription's protocol state, without IO (shared by the blocking and the asyncio client).

The daemon sends each position once, as data or as a gap, in order. Resuming after silence (the
daemon may have restarted) or after the daemon said it is stopping (a graceful restart) resends the
subscription from the next expected position; whatever then comes twice is dropped here, and
whatever never comes becomes a Gap here, so the caller sees every position exactly once either way.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any, Sequence

import msgspec
import numpy as np
import zmq

from vllm_tap import wire_format as wf
from vllm_tap.defaults import default_endpoint
from vllm_tap.positions import PositionRanges

from .arena import OVERWRITTEN, ArenaUse
from .errors import (CaptureLost, CaptureNotFound, CaptureTimeout, DaemonStopped, DaemonUnavailable, ProtocolError,
                     Refused, error_for)
from .records import CaptureBegin, CaptureEnd, Chunk, Gap, reducer_names, widen

log = logging.getLogger(__name__)

ENDPOINT_ENV = "VLLM_TAP_ENDPOINT"
HEARTBEAT_S = 1.0  # silence after which the subscription is resent (a cheap no-op for a live daemon)
RECONNECT_IVL_MAX_MS = 2000  # back off between reconnects the daemon refused
LOST = "lost: the daemon restarted mid-stream"
_ids = itertools.count(1)


def resolve_endpoint(endpoint: str | None = None) -> str:
    """The endpoint given, else $VLLM_TAP_ENDPOINT, else the default one, whose directory is checked
    first: at a predictable path (/tmp/vllm-tap-$UID) anyone could have made it and be waiting there
    to answer in the daemon's place. Refused (one line) when it is not this user's or root's, or
    others may write in it."""
    chosen = endpoint or os.environ.get(ENDPOINT_ENV)
    if chosen:
        return chosen
    ep = default_endpoint()
    _check_default_dir(os.path.dirname(ep[len("ipc://"):]))
    return ep


def _check_default_dir(path: str) -> None:
    from vllm_tap.safe_paths import Expect, UnsafePath, dir_mode, me, open_dir

    try:
        fd = open_dir(path, "the default socket directory")
    except FileNotFoundError:
        return  # no daemon there: connecting says so
    except UnsafePath as e:
        raise Refused(f"vllm-tap: {e}") from None
    try:
        Expect(max_mode=dir_mode(0o640), owners=me()).check_fd(fd, path, "the default socket directory")
    except UnsafePath as e:
        raise Refused(f"vllm-tap: {e}") from None
    finally:
        os.close(fd)


def decode_begin(m: wf.BeginReply) -> CaptureBegin:
    """A begin message (subscription or watch) as the client's record of it."""
    return CaptureBegin(
        m.request_id, m.instance, m.tap_key, tuple(m.names), m.response_id, m.choice_index, m.num_prompt_tokens,
        m.prompt_token_ids, m.n, m.model, m.spec, m.start_position, m.lazy, m.source or wf.SOURCES[0],
    )


def _expected(m: wf.EndReply) -> tuple[int, int] | None:
    if not m.expected:
        return None
    if len(m.expected) != 2:
        raise ProtocolError(f"unreadable expected range from the daemon: {m.expected!r}")
    return (m.expected[0], m.expected[1])


def end_missing(m: wf.EndReply) -> PositionRanges:
    """The missing positions an end message names."""
    try:
        return PositionRanges(m.missing)
    except (TypeError, ValueError, IndexError):
        raise ProtocolError(f"unreadable missing ranges from the daemon: {m.missing!r}") from None


def decode_end(m: wf.EndReply, missing: PositionRanges) -> CaptureEnd:
    """An end message (subscription or watch), with the missing positions the caller accounted."""
    return CaptureEnd(
        m.request_id, m.instance, m.reason, m.num_prompt_tokens, m.num_output_tokens, m.output_token_ids,
        m.end_position, _expected(m), missing, m.response_id, m.choice_index, m.source or wf.SOURCES[0],
    )


def decode_chunk(m: wf.TokensReply, frames: Sequence[Any], arena: ArenaUse | None = None,
                 begin: CaptureBegin | None = None) -> Chunk | None:
    """A tokens message's Chunk (arrays from its frames, or copied out of the daemon's arena; its
    reducers' outputs named by the capture's spec, from `begin`); None when its arena regions were
    reused before they were copied."""
    try:
        if m.arena is not msgspec.UNSET and arena is not None:
            tensors = arena.tensors(m)
            if tensors is None:
                return None
        else:
            tensors = wf.read_tensors(m.tensors, frames)
    except wf.WireError as e:
        raise ProtocolError(e.message) from None
    except ValueError as e:
        raise ProtocolError(str(e)) from None
    ids = np.frombuffer(m.token_ids, "<i4")
    for _code, a in tensors.values():
        if len(a) != len(ids):
            raise ProtocolError(f"tokens message of {len(ids)} positions carries an array of {len(a)} rows")
    return Chunk.from_tensors(m.request_id, m.start, ids, m.num_prompt_tokens,
                              {n: widen(code, a) for n, (code, a) in tensors.items()},
                              reducer_names(begin.spec) if begin is not None else ())


class StreamState:
    """`timeout`: how long the capture may take to appear (and the daemon to stay silent).
    `overall`: fetch()'s deadline for the whole call, from start() to the END (None: none)."""

    def __init__(self, endpoint: str, name: str, index: int | None, instance: str | None, timeout: float,
                 heartbeat_s: float = HEARTBEAT_S, overall: float | None = None):
        self.endpoint = endpoint
        self.name = name
        self.index = index
        self.instance = instance
        self.timeout = timeout
        self.heartbeat_s = heartbeat_s
        self.overall = overall
        self._deadline = float("inf")
        self.received = 0  # positions that arrived as data
        self.sub_id = (os.getpid() << 20) + next(_ids)
        self.arena = ArenaUse(endpoint)  # same host: arrays are copied out of the daemon's shared memory
        self.outbox: list[list[bytes]] = []  # messages on_frames wants sent (the caller sends them)
        self.begin: CaptureBegin | None = None
        self.end: CaptureEnd | None = None
        self.next_position: int | None = None
        self.lost = PositionRanges()  # positions the client noticed never arrived
        self.done = False
        self._stopped: str | None = None  # the reason of a stop no daemon has answered since
        self._t0 = 0.0
        self._heard = 0.0

    # -- what to send --

    def start(self, now: float) -> list[bytes]:
        self._t0 = self._heard = now
        if self.overall is not None:
            self._deadline = now + self.overall
        return self._subscribe(self.timeout)

    def wait_ms(self, now: float) -> int:
        """How long the caller may wait for the next message: a heartbeat, or less before the deadline."""
        return max(0, int(min(self.heartbeat_s, self._deadline - now) * 1000))

    def _check_deadline(self, now: float) -> None:
        if now < self._deadline or self.done:
            return
        if self.begin is None:
            raise self._not_found(self.overall)
        raise CaptureTimeout(
            f"capture {self._what()} did not end within {self.overall:g} s ({self.received} positions arrived, "
            f"the next expected is {self.next_position}); a capture that runs longer needs a larger timeout, "
            "or subscribe() to stream it")

    def _subscribe(self, timeout: float) -> list[bytes]:
        return wf.Subscribe(self.sub_id, self.name, self.index, self.instance, self.next_position,
                            max(0.0, timeout), self.arena.offer).frames()

    def cancel(self) -> list[bytes]:
        return wf.Cancel(self.sub_id).frames()

    def on_silence(self, now: float) -> list[bytes]:
        """Frames to resend after `heartbeat_s` without a message; raises once it is hopeless."""
        self._check_deadline(now)
        what = self._what()
        if self.begin is None:
            if now - self._t0 > self.timeout + self.heartbeat_s:
                raise self._not_found(self.timeout)
            return self._subscribe(self.timeout - (now - self._t0))
        silent = now - self._heard
        limit = max(self.timeout, 3 * self.heartbeat_s)
        # The daemon is asked to answer by `limit` (below); its answer gets one heartbeat to arrive
        # before silence means it is gone (else a restarted daemon's "not found" loses the race).
        if silent > limit + self.heartbeat_s:
            if self._stopped is not None:
                raise DaemonStopped(f"daemon stopped: {self._stopped}; no daemon answered at {self.endpoint} in the "
                                    f"{silent:.1f} s since, while streaming {what} (next position {self.next_position})")
            raise DaemonUnavailable(
                f"lost contact with the daemon at {self.endpoint} for {silent:.1f} s while streaming "
                f"{what} (next position {self.next_position})"
            )
        # The daemon's wait for the name counts from the first silence, not from each resend: a
        # restarted daemon that never sees this capture again says so once that time is up.
        return self._subscribe(limit - silent)

    def _not_found(self, waited: float) -> CaptureNotFound | DaemonStopped:
        if self._stopped is not None:
            return DaemonStopped(f"daemon stopped: {self._stopped}; no daemon answered at {self.endpoint} since, and "
                                 f"no capture named {self._what()} appeared within {waited:g} s")
        return CaptureNotFound(f"no capture named {self._what()} within {waited:g} s (and no answer from a daemon "
                               f"at {self.endpoint}: is `vllm-tap daemon` running?)")

    def _what(self) -> str:
        return repr(self.name) + (f" index {self.index}" if self.index is not None else "") + (
            f" in instance {self.instance!r}" if self.instance is not None else "")

    # -- what came --

    def on_frames(self, frames: Sequence[Any], now: float) -> list[Chunk | Gap]:
        out = self._on_frames(frames, now)
        self._check_deadline(now)  # a stream that never ends is bounded too, not only silence
        return out

    def _on_frames(self, frames: Sequence[Any], now: float) -> list[Chunk | Gap]:
        try:
            m = wf.decode_reply(_bytes(frames[0]))
        except wf.WireError as e:
            raise ProtocolError(f"unreadable message from the daemon at {self.endpoint}: {e.message}") from None
        if m.id != self.sub_id:
            return []  # an answer to a previous subscription on this socket
        self._heard = now
        if isinstance(m, wf.ErrorReply) and m.code == wf.E_STOPPING:
            # A graceful stop is ridden through like a crash: the subscription is resent from the
            # next position once the silence limit passes, to whichever daemon answers (the next
            # one continues the captures in flight that this one handed over).
            self._stopped = m.message
            log.warning("the daemon at %s is stopping (%s): %s goes on from position %s with the next daemon",
                        self.endpoint, self._stopped, self._what(), self.next_position)
            return []
        self._stopped = None
        if isinstance(m, wf.ErrorReply):
            self.done = True
            if m.code == wf.E_NOT_FOUND and self.begin is not None:
                raise CaptureLost(f"the daemon no longer knows {self._what()} (it restarted?); positions from "
                                  f"{self.next_position} on are lost")
            raise error_for(m.code, m.message)
        if isinstance(m, wf.BeginReply):
            if not self.arena.advert(m.arena):
                # The daemon's arena cannot be mapped here (another container, no permission): the
                # same subscription again, under a new id, with payloads as frames.
                self.outbox.append(self.cancel())
                self.sub_id = (os.getpid() << 20) + next(_ids)
                self.outbox.append(self._subscribe(max(self.timeout - (now - self._t0), 1.0)))
                return []
            if self.begin is None:  # a resumed subscription repeats it: keep the first
                self.begin = decode_begin(m)
                if self.next_position is None:
                    self.next_position = self.begin.start_position
            return []
        if isinstance(m, wf.TokensReply):
            return self._tokens(m, frames[1:])
        if isinstance(m, wf.GapReply):
            return self._gap(m.request_id, m.start, m.stop, m.reason)
        if isinstance(m, wf.EndReply):
            return self._end(m)
        raise ProtocolError(f"unexpected message type {m.__struct_config__.tag!r} from the daemon")

    def _advance(self, start: int, stop: int, rid: str) -> tuple[int, list[Chunk | Gap]]:
        """Where new material starts (>= start), and a Gap for anything skipped before it."""
        nxt = self.next_position
        if nxt is None or start <= nxt:
            return (start if nxt is None else max(start, nxt)), []
        lost = range(nxt, start)
        self.lost = self.lost.union([lost])
        log.warning("capture %s: positions %d..%d lost (daemon restarted mid-stream)", rid, nxt, start - 1)
        return start, [Gap(lost, LOST, rid)]

    def _tokens(self, m: wf.TokensReply, frames: Sequence[Any]) -> list[Chunk | Gap]:
        start, count, rid = m.start, m.count, m.request_id
        if self.next_position is not None and start + count <= self.next_position:
            return []
        chunk = decode_chunk(m, frames, self.arena, self.begin)
        if chunk is None:  # copied too late: the daemon had reused the region
            at = start if self.next_position is None else max(start, self.next_position)
            self.lost = self.lost.union([range(at, start + count)])
            return self._gap(rid, start, start + count, OVERWRITTEN)
        at, out = self._advance(start, start + count, rid)
        self.next_position = start + count
        self.received += start + count - at
        out.append(chunk.cut(at))
        return out

    def _gap(self, rid: str, start: int, stop: int, reason: str) -> list[Chunk | Gap]:
        if self.next_position is not None and stop <= self.next_position:
            return []
        at, out = self._advance(start, stop, rid)
        self.next_position = stop
        # Kept here too: the End of a resumed subscription (after silence, or from the next daemon)
        # lists only what is missing from where it resumed, and this gap came before that.
        self.lost = self.lost.union([range(at, stop)])
        log.warning("capture %s: positions %d..%d missing (%s)", rid, at, stop - 1, reason)
        out.append(Gap(range(at, stop), reason, rid))
        return out

    def _end(self, m: wf.EndReply) -> list[Chunk | Gap]:
        rid = m.request_id
        expected = _expected(m)
        out: list[Chunk | Gap] = []
        if expected is not None and expected[1] > expected[0]:
            if self.next_position is None:
                self.next_position = expected[0]
            if self.next_position < expected[1]:
                _, out = self._advance(expected[1], expected[1], rid)  # anything the stream skipped
                self.next_position = expected[1]
        self.end = decode_end(m, end_missing(m).union(self.lost))
        self.done = True
        return out


# Monitor events that mean the daemon will not talk to this client (see refusal()).
REFUSAL_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
MECHANISM_MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH


def close_monitored(sock: zmq.Socket, mon: zmq.Socket, linger_ms: int = 0) -> None:
    """Close a socket and the monitor watching it for refusals (blocking or asyncio sockets);
    `linger_ms`: how long a last message (a cancel) may still go out, in the background."""
    try:
        sock.disable_monitor()
    except zmq.ZMQError:
        pass
    mon.close(linger=0)
    sock.close(linger=linger_ms)


def refused_message(endpoint: str, status: int, curve: bool = False) -> str:
    """`curve`: this client used CURVE keys (a key the daemon does not allow is refused with 400 too)."""
    if curve and status == 400:
        return (f"the daemon at {endpoint} refused the connection (status 400): this client's CURVE key is not among "
                "its allowed client keys (curve_clients), or it already has as many connections as its "
                "max_connections / max_connections_per_peer allow (its log says which)")
    if status == MECHANISM_MISMATCH:
        return (f"the daemon at {endpoint} and this client disagree on CURVE: the daemon requires keys "
                "(--server-key / --client-key, $VLLM_TAP_SERVER_KEY / $VLLM_TAP_CLIENT_KEY) or has none")
    return (f"the daemon at {endpoint} refused the connection (status {status}): it already has as many connections "
            "as its max_connections / max_connections_per_peer allow; close others or raise those settings")


def uses_curve(sock: zmq.Socket) -> bool:
    """Whether sockets of this one's context carry CURVE keys (client/auth.py puts them there)."""
    return zmq.CURVE_SERVERKEY in getattr(sock.context, "sockopts", {})


def unanswered(endpoint: str, timeout: float, curve: bool) -> str:
    """Why a status request got no answer, as far as the client can tell."""
    msg = f"no daemon answered at {endpoint} within {timeout:g} s"
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
        path = endpoint[len("ipc://"):]
        try:
            os.stat(path)
        except PermissionError:
            return msg + f": this account may not reach {path} (not in the daemon's socket_group?)"
        except OSError:
            return msg + ": is `vllm-tap daemon` running?"
        if not os.access(path, os.W_OK):
            return msg + f": this account may not connect to {path} (not in the daemon's socket_group?)"
    if curve:
        msg += " (with CURVE: is --server-key the daemon's public key?)"
    return msg


def refusal(event: dict[str, Any]) -> int | None:
    """The ZAP status of a monitor event that says the daemon refused the connection (or
    MECHANISM_MISMATCH: one side uses CURVE, the other not), else None."""
    if event.get("event") == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return int(event.get("value") or 0)
    if event.get("event") == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and event.get("value") == MECHANISM_MISMATCH:
        return MECHANISM_MISMATCH
    return None


def _bytes(frame: Any) -> bytes | memoryview:
    return frame.buffer if hasattr(frame, "buffer") else frame


class SubscriptionView:
    """What the blocking and asyncio subscriptions share: the stream's state, read-only."""

    def __init__(self, ctx, state: StreamState):
        self._ctx = ctx
        self._state = state

    @property
    def begin(self):
        return self._state.begin

    @property
    def end(self):
        return self._state.end

    @property
    def missing_positions(self) -> PositionRanges:
        """Missing so far (complete only after the end): a sorted sequence of ints kept as ranges."""
        return self._state.end.missing_positions if self._state.end else self._state.lost
