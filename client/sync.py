"""The blocking client."""

from __future__ import annotations

import time
from typing import Any, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from vllm_tap import wire_format as wf

from .auth import client_keys, keyed_context
from .errors import DaemonUnavailable, ProtocolError, Refused, error_for
from .records import Capture, CaptureBuilder, Chunk, Gap, Item
from .stream import (
    HEARTBEAT_S, RECONNECT_IVL_MAX_MS, REFUSAL_EVENTS, StreamState, SubscriptionView, close_monitored, refusal, refused_message, resolve_endpoint,
    unanswered, uses_curve,
)
from .watch import WATCH_HEARTBEAT_S, WATCH_TIMEOUT_S, Watch, watch_state

RCVHWM = 256  # messages buffered from the daemon; beyond that the daemon waits (and may cut us off)


class Subscription(SubscriptionView):
    """Iterate for TokenRecord and Gap items in position order; `.end` is set once it finished.

    Iterating `chunks()` instead yields the same data a message at a time (Chunk objects of
    consecutive positions), which is cheaper when you stack arrays anyway.
    """

    def __init__(self, ctx: zmq.Context, state: StreamState):
        super().__init__(ctx, state)
        self._sock: zmq.Socket | None = None

    def __iter__(self) -> Iterator[Item]:
        for item in self.chunks():
            if isinstance(item, Chunk):
                yield from item.rows()
            else:
                yield item

    def chunks(self) -> Iterator[Chunk | Gap]:
        st = self._state
        if st.done:
            return
        sock = self._sock = _dealer(self._ctx)
        mon = sock.get_monitor_socket(REFUSAL_EVENTS)
        sock.connect(st.endpoint)
        try:
            _send(sock, st.start(time.monotonic()))
            while not st.done:
                try:  # poll only when nothing is waiting: a poll per message costs as much as the recv
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    if not sock.poll(st.wait_ms(time.monotonic()), zmq.POLLIN):
                        _check_refused(mon, st.endpoint)
                        _send(sock, st.on_silence(time.monotonic()))
                    continue
                yield from st.on_frames(frames, time.monotonic())
                while st.outbox:
                    _send(sock, st.outbox.pop(0))
        finally:
            # Not done: stop the daemon sending. Done through the arena: everything up to the End
            # is copied, so what the daemon still keeps for us (arena_linger_s) may go now.
            if not st.done or st.arena.view is not None:
                _send(sock, st.cancel())
            close_monitored(sock, mon, linger_ms=100 if st.arena.view is not None else 0)
            self._sock = None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _dealer(ctx: zmq.Context) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    return sock


def _answer_or_refusal(sock: zmq.Socket, mon: zmq.Socket, timeout: float, endpoint: str) -> bool:
    """Wait up to `timeout` for something to read on `sock`; a refusal the monitor reports first
    raises Refused at once (a refused client need not wait out its timeout). False: neither came."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(mon, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(max(1, int(left * 1000))))
        if sock in ready:
            return True
        if mon in ready:
            _check_refused(mon, endpoint)
    return False


def _check_refused(mon: zmq.Socket, endpoint: str) -> None:
    while mon.poll(0):
        status = refusal(recv_monitor_message(mon))
        if status is not None:
            raise Refused(refused_message(endpoint, status, uses_curve(mon)))


def _send(sock: zmq.Socket, frames: list[bytes]) -> None:
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass  # not connected yet: the next heartbeat resends


class Client:
    """Subscribe to captures from a daemon at `endpoint` (default: $VLLM_TAP_ENDPOINT, else the
    daemon's default socket).

    A daemon with CURVE keys needs `server_key` (its public certificate file or key) and
    `client_key` (this client's secret certificate file); default $VLLM_TAP_SERVER_KEY and
    $VLLM_TAP_CLIENT_KEY (vllm_tap.client.auth)."""

    def __init__(self, endpoint: str | None = None, *, heartbeat_s: float = HEARTBEAT_S, context: zmq.Context | None = None,
                 server_key: str | None = None, client_key: str | None = None):
        self.endpoint = resolve_endpoint(endpoint)
        self.heartbeat_s = heartbeat_s
        self.keys = client_keys(server_key, client_key)
        self._ctx = keyed_context(context or zmq.Context.instance(), self.keys)

    def subscribe(self, name: str, index: int | None = None, instance: str | None = None,
                  timeout: float = 30.0) -> Subscription:
        """Stream a capture by any of its names (request id, response id, X-Request-Id, tap_key).

        Waits up to `timeout` for it to appear (CaptureNotFound after that); replays from the first
        position if it started earlier or already ended; ends after the capture's end, however long
        it streams.
        """
        return Subscription(self._ctx, StreamState(self.endpoint, name, index, instance, timeout, self.heartbeat_s))

    def fetch(self, name: str, index: int | None = None, instance: str | None = None, timeout: float = 30.0) -> Capture:
        """The whole capture, stacked, once it has ended.

        `timeout` bounds the whole call: the capture must appear and end within it (CaptureNotFound
        if it did not appear, CaptureTimeout if it began but had not ended). A capture of a long
        generation needs a timeout as long as the generation; subscribe() streams it without one."""
        sub = Subscription(self._ctx, StreamState(self.endpoint, name, index, instance, timeout, self.heartbeat_s,
                                                  overall=timeout))
        builder = CaptureBuilder()
        for item in sub.chunks():
            builder.add(item)
        assert sub.end is not None
        return builder.build(sub.begin, sub.end)

    def watch(self, since: int | None = None, *, instance: str | None = None, source: str | None = None,
              tap_key_prefix: str | None = None, model: str | None = None, whole: bool = True,
              watermarks: bool = False, timeout: float = WATCH_TIMEOUT_S) -> Watch:
        """Every capture with seq > `since` (None: those that begin from now on), in seq order.

        Filters (all optional, combined with AND): `instance` (exact), `source` ("client" or
        "policy"), `tap_key_prefix`, `model` (exact). whole=True yields a WatchedCapture per capture
        at its end; whole=False streams WatchStart / WatchData / WatchEnd. LostCaptures says what
        will not come. `Watch.last_seq` is what to persist and pass as `since` after a restart.
        See vllm_tap.client.watch for the rules; WatchRejected for a bad filter or a future since.
        """
        return Watch(self._ctx, watch_state(self.endpoint, since, instance=instance, source=source,
                                            tap_key_prefix=tap_key_prefix, model=model, whole=whole,
                                            watermarks=watermarks, timeout=timeout, heartbeat_s=WATCH_HEARTBEAT_S))

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        """The daemon's snapshot: rings, writers, requests in flight, bytes, drops, subscribers."""
        sock = _dealer(self._ctx)
        mon = sock.get_monitor_socket(REFUSAL_EVENTS)
        try:
            sock.connect(self.endpoint)
            sock.send_multipart(wf.StatusRequest(0).frames())
            if not _answer_or_refusal(sock, mon, timeout, self.endpoint):
                _check_refused(mon, self.endpoint)
                raise DaemonUnavailable(unanswered(self.endpoint, timeout, self.keys is not None))
            return parse_status(sock.recv_multipart())
        finally:
            close_monitored(sock, mon)

    def close(self) -> None:
        pass  # sockets live per subscription; the shared context outlives clients

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def parse_status(frames: list[bytes]) -> dict[str, Any]:
    try:
        m = wf.decode_reply(frames[0])
    except wf.WireError as e:
        raise ProtocolError(f"unreadable status reply: {e.message}") from None
    if isinstance(m, wf.ErrorReply):
        raise error_for(m.code, m.message)
    if not isinstance(m, wf.StatusReply):
        raise ProtocolError(f"expected a status reply, got {m.__struct_config__.tag!r}")
    return m.status
