"""Who is connected to the daemon's socket, and how many may be: connection limits for the ROUTER.

libzmq aborts the whole process when accept() fails with EMFILE on an ipc:// listener, so a flood of
idle connections must never reach the descriptor limit. Rules this module keeps:
- Every connection is counted from the socket's monitor (ACCEPTED +1, DISCONNECTED -1) and
  attributed to its peer: one process over ipc:// (SO_PEERCRED: uid, gid, pid), one address over
  tcp://.
- Every handshake asks the ZAP handler here (ZAP_DOMAIN is set; NULL mechanism, or CURVE when the
  daemon has keys): with CURVE, a client key that is not allowed (daemon/curve.py) is refused;
  then a connection beyond `max_connections_per_peer` for its peer or `max_connections` in all is
  refused. Both with ZAP status 400 (libzmq sends 300 to no one: the client would just hang);
  libzmq closes a refused connection and the peer's monitor reports the refusal (the client turns
  it into an error; the daemon's log says which it was). Monitor events are drained before ZAP requests, so the connection being decided is
  already counted.
- Half the descriptor limit is kept free: when accepted connections reach the other half, the
  listener is closed (unbind) until they fall back, so accept() does not meet EMFILE. libzmq
  accepts on its own thread while this loop decides, so the free half is the room for a burst
  that arrives faster than the loop reacts (32,768 connections under the shipped units). Closing the listener also
  drops the connections still in their handshake without a monitor event, so while it is closed
  the counted descriptors are checked again (nothing new is accepted meanwhile, so a descriptor
  that is still a socket to the same peer is still that connection).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import time
from typing import Any, Callable

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"vllm-tap"
FD_MARGIN = 128  # descriptors always kept for rings, pidfds and libzmq's own
RESUME_AT = 0.9  # accept again below this share of the descriptor budget
RECHECK_S = 0.5  # while not accepting, how often the counted descriptors are checked again
HANDSHAKE_IVL_MS = 5000  # a connection that does not complete its handshake in this long is closed
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
STATUS_KEY_REFUSED = b"400"  # ZAP: authentication failed (the client's key is not allowed)
STATUS_LIMIT = b"400"  # the same: libzmq's NULL mechanism tells the client of no other refusal


def peer_of_fd(fd: int) -> str:
    """A connection's peer, spelled as libzmq spells it in ZAP requests."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return "?"
    try:
        if s.family == socket.AF_UNIX:
            pid, uid, gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return f"localhost:{uid}:{gid}:{pid}"
        return str(s.getpeername()[0])
    except OSError:
        return "?"
    finally:
        s.close()


class Peers:
    def __init__(self, ctx: zmq.Context, router: zmq.Socket, endpoint: str, *, max_connections: int,
                 max_per_peer: int, fd_limit: int, curve: Any = None, on_bind: Callable[[], None] | None = None):
        self._router = router
        self.curve = curve  # daemon/curve.CurveServer: which client keys may connect (None: no CURVE)
        self._on_bind = on_bind  # after the listener is opened again (the ipc socket's mode is set anew)
        self.refused_key = 0
        self._endpoint = endpoint
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.fd_budget = max(fd_limit // 2 - FD_MARGIN, 16)
        self.zap = ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        self.monitor = router.get_monitor_socket(_EVENTS)
        self._by_fd: dict[int, str] = {}
        self._per_peer: collections.Counter[str] = collections.Counter()
        self.total = 0
        self.accepted = 0
        self.refused = 0
        self.paused = False
        self._rechecked = 0.0
        self._log_refusals = 20

    def sockets(self) -> list[zmq.Socket]:
        return [self.monitor, self.zap]

    @property
    def peers(self) -> int:
        return len(self._per_peer)

    def pump(self, budget: int = 1000) -> bool:
        """Handle what the monitor and the ZAP socket hold; True if anything was."""
        busy = False
        for _ in range(budget):
            try:
                msg = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            busy = True
            self._event(parse_monitor_message(msg))
        for _ in range(budget):
            try:
                req = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            busy = True
            self._zap(req)
        self._flow()
        return busy

    def _event(self, ev: dict) -> None:
        fd = ev["value"]
        if ev["event"] == zmq.EVENT_ACCEPTED:
            peer = peer_of_fd(fd)
            self._by_fd[fd] = peer
            self._per_peer[peer] += 1
            self.total += 1
            self.accepted += 1
        elif ev["event"] == zmq.EVENT_DISCONNECTED:
            peer = self._by_fd.pop(fd, None)
            if peer is None:
                return
            self._per_peer[peer] -= 1
            if self._per_peer[peer] <= 0:
                del self._per_peer[peer]
            self.total = max(self.total - 1, 0)

    def _zap(self, req: list[bytes]) -> None:
        if len(req) < 6:
            return
        version, rid, _domain, address = req[0], req[1], req[2], req[3].decode(errors="replace")
        if self.curve is not None and (req[5] != b"CURVE" or len(req) < 7 or not self.curve.allowed(req[6])):
            self.refused_key += 1
            if self._log_refusals:
                self._log_refusals -= 1
                key = z85.encode(req[6]).decode() if len(req) > 6 and len(req[6]) == 32 else "-"
                log.warning("connection from %s refused: client key %s is not in curve_clients", address, key)
            self.zap.send_multipart([version, rid, STATUS_KEY_REFUSED, b"client key not allowed", b"", b""])
            return
        why = ""
        if self._per_peer.get(address, 0) > self.max_per_peer:
            why = f"more than {self.max_per_peer} connections from {address} (max_connections_per_peer)"
        elif self.total > self.max_connections:
            why = f"more than {self.max_connections} connections (max_connections)"
        if why:
            self.refused += 1
            if self._log_refusals:
                self._log_refusals -= 1
                log.warning("connection refused: %s", why)
            self.zap.send_multipart([version, rid, STATUS_LIMIT, why.encode(), b"", b""])
        else:
            self.zap.send_multipart([version, rid, b"200", b"OK", b"", b""])

    def _flow(self) -> None:
        """Close the listener before accept() could run out of descriptors; reopen it below the mark."""
        if not self.paused and self.total >= self.fd_budget:
            try:
                self._router.unbind(self._endpoint)
                self.paused = True
                log.error("%d connections: not accepting more until some close (descriptor limit %d)",
                          self.total, 2 * (self.fd_budget + FD_MARGIN))
            except zmq.ZMQError as e:
                log.error("cannot pause accepting connections: %s", e)
        elif self.paused and time.monotonic() - self._rechecked >= RECHECK_S:
            self._rechecked = time.monotonic()
            for fd, peer in list(self._by_fd.items()):
                if peer_of_fd(fd) != peer:
                    self._event({"event": zmq.EVENT_DISCONNECTED, "value": fd})
        if self.paused and self.total < RESUME_AT * self.fd_budget:
            try:
                self._router.bind(self._endpoint)
                if self._on_bind is not None:
                    self._on_bind()
                self.paused = False
                log.info("accepting connections again (%d open)", self.total)
            except zmq.ZMQError as e:
                log.error("cannot listen again on %s: %s", self._endpoint, e)

    def close(self) -> None:
        try:
            self._router.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.zap.close(linger=0)
