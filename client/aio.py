"""The asyncio client: the same protocol state as the blocking one, over zmq.asyncio."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from vllm_tap import wire_format as wf

from .auth import client_keys, keyed_context
from .errors import DaemonUnavailable, Refused
from .records import Capture, CaptureBuilder, Chunk, Gap, Item
from .stream import (
    HEARTBEAT_S, RECONNECT_IVL_MAX_MS, REFUSAL_EVENTS, StreamState, SubscriptionView, close_monitored, refusal, refused_message, resolve_endpoint,
    unanswered, uses_curve,
)
from .sync import RCVHWM, parse_status
from .watch import WATCH_HEARTBEAT_S, WATCH_TIMEOUT_S, AsyncWatch, watch_state


class AsyncSubscription(SubscriptionView):
    """`async for item in sub` yields TokenRecord and Gap items; `.end` is set once it finished."""


    async def __aiter__(self) -> AsyncIterator[Item]:
        async for item in self.chunks():
            if isinstance(item, Chunk):
                for row in item.rows():
                    yield row
            else:
                yield item

    async def chunks(self) -> AsyncIterator[Chunk | Gap]:
        st = self._state
        if st.done:
            return
        loop = asyncio.get_running_loop()
        sock = _dealer(self._ctx)
        mon = sock.get_monitor_socket(REFUSAL_EVENTS)
        sock.connect(st.endpoint)
        try:
            await _send(sock, st.start(loop.time()))
            while not st.done:
                if await sock.poll(st.wait_ms(loop.time()), zmq.POLLIN):
                    frames = await sock.recv_multipart(copy=False)
                    for item in st.on_frames(frames, loop.time()):
                        yield item
                    while st.outbox:
                        await _send(sock, st.outbox.pop(0))
                else:
                    await _check_refused(mon, st.endpoint)
                    await _send(sock, st.on_silence(loop.time()))
        finally:
            if not st.done or st.arena.view is not None:  # see client/sync.py
                try:
                    sock.send_multipart(st.cancel(), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            close_monitored(sock, mon, linger_ms=100 if st.arena.view is not None else 0)


def _dealer(ctx: zmq.asyncio.Context) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    return sock


async def _answer_or_refusal(sock: zmq.asyncio.Socket, mon: zmq.asyncio.Socket, timeout: float, endpoint: str) -> bool:
    """As the synchronous client's: an answer to read (True), a refusal (Refused at once), or
    neither within `timeout` (False)."""
    poller = zmq.asyncio.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(mon, zmq.POLLIN)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (left := deadline - loop.time()) > 0:
        ready = dict(await poller.poll(max(1, int(left * 1000))))
        if sock in ready:
            return True
        if mon in ready:
            await _check_refused(mon, endpoint)
    return False


async def _check_refused(mon: zmq.asyncio.Socket, endpoint: str) -> None:
    while await mon.poll(0):
        status = refusal(parse_monitor_message(await mon.recv_multipart()))
        if status is not None:
            raise Refused(refused_message(endpoint, status, uses_curve(mon)))


async def _send(sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
    try:
        await sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        pass


class AsyncClient:
    def __init__(self, endpoint: str | None = None, *, heartbeat_s: float = HEARTBEAT_S,
                 context: zmq.asyncio.Context | None = None, server_key: str | None = None,
                 client_key: str | None = None):
        """Client's arguments, for asyncio (server_key / client_key: CURVE, see Client)."""
        self.endpoint = resolve_endpoint(endpoint)
        self.heartbeat_s = heartbeat_s
        self.keys = client_keys(server_key, client_key)
        self._ctx = keyed_context(context or zmq.asyncio.Context.instance(), self.keys)

    def subscribe(self, name: str, index: int | None = None, instance: str | None = None,
                  timeout: float = 30.0) -> AsyncSubscription:
        return AsyncSubscription(self._ctx, StreamState(self.endpoint, name, index, instance, timeout, self.heartbeat_s))

    async def fetch(self, name: str, index: int | None = None, instance: str | None = None,
                    timeout: float = 30.0) -> Capture:
        """Client.fetch: `timeout` bounds the whole call (CaptureNotFound, CaptureTimeout)."""
        sub = AsyncSubscription(self._ctx, StreamState(self.endpoint, name, index, instance, timeout, self.heartbeat_s,
                                                       overall=timeout))
        builder = CaptureBuilder()
        async for item in sub.chunks():
            builder.add(item)
        assert sub.end is not None
        return builder.build(sub.begin, sub.end)

    def watch(self, since: int | None = None, *, instance: str | None = None, source: str | None = None,
              tap_key_prefix: str | None = None, model: str | None = None, whole: bool = True,
              watermarks: bool = False, timeout: float = WATCH_TIMEOUT_S) -> AsyncWatch:
        """Client.watch for asyncio: `async for item in AsyncClient().watch(since)`."""
        return AsyncWatch(self._ctx, watch_state(self.endpoint, since, instance=instance, source=source,
                                                 tap_key_prefix=tap_key_prefix, model=model, whole=whole,
                                                 watermarks=watermarks, timeout=timeout,
                                                 heartbeat_s=WATCH_HEARTBEAT_S))

    async def status(self, timeout: float = 5.0) -> dict[str, Any]:
        sock = _dealer(self._ctx)
        mon = sock.get_monitor_socket(REFUSAL_EVENTS)
        try:
            sock.connect(self.endpoint)
            await sock.send_multipart(wf.StatusRequest(0).frames())
            if not await _answer_or_refusal(sock, mon, timeout, self.endpoint):
                await _check_refused(mon, self.endpoint)
                raise DaemonUnavailable(unanswered(self.endpoint, timeout, self.keys is not None))
            return parse_status(await sock.recv_multipart())
        finally:
            close_monitored(sock, mon)
