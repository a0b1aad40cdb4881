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
- Half the descriptor limit is kept free: when accepted connections reach the other half,
  accepting stops until they fall back, so accept() does not meet EMFILE. libzmq accepts on its own
  thread, so the free half is the room for a burst that arrives faster than we react (32,768
  connections under the shipped units). On a filesystem ipc:// socket the reaction does not wait
  for the daemon's loop, which may be busy or starved by the flood itself: a thread of its own
  reads the monitor, counts, and pauses the listener in one system call (daemon/accept_gate.py);
  connections that arrive meanwhile are refused (closed at once) while every connection already
  accepted keeps being served. Elsewhere (tcp://, whose libzmq listener survives EMFILE, and
  abstract ipc://) the loop closes the listener (unbind), which also drops the connections still
  in their handshake without a monitor event. While accepting is stopped the counted descriptors
  are checked again (nothing new is accepted meanwhile, so a descriptor that is still a socket to
  the same peer is still that connection).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from .accept_gate import AcceptGate
from .access import socket_path

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"vllm-tap"
FD_MARGIN = 128  # descriptors always kept for rings, pidfds and libzmq's own
RESUME_AT = 0.9  # accept again below this share of the descriptor budget
RECHECK_S = 0.5  # while not accepting, how often the counted descriptors are checked again
SWITCH_INTERVAL_S = 0.0005  # the longest the loop holds the GIL while the connection watcher waits for it
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
        self._paused_logged = False
        # Counts are shared with the monitor thread (when there is a gate).
        self._lock = threading.RLock()
        self.gate: AcceptGate | None = None
        self._watcher: threading.Thread | None = None
        self._stop = False

    def bind(self) -> None:
        """Listen: through an AcceptGate on a filesystem ipc:// socket (and count from a thread of
        its own), else zmq's own listener (counted by pump())."""
        path = socket_path(self._endpoint)
        if path is not None:
            self.gate = AcceptGate(path)
            self._router.setsockopt(zmq.USE_FD, self.gate.fd)
        self._router.bind(self._endpoint)
        if self.gate is not None:
            # The watcher waits for the GIL after every wake-up; by default the loop may hold it 5 ms,
            # time for a flood to open hundreds of connections. Nothing else here waits for it often.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            self._watcher = threading.Thread(target=self._watch, name="vllm-tap-connections", daemon=True)
            self._watcher.start()

    def sockets(self) -> list[zmq.Socket]:
        return [self.zap] if self._watcher is not None else [self.monitor, self.zap]

    def _watch(self) -> None:
        """The monitor, read as events come (a blocking poll releases the GIL): count, and pause the
        gate the moment the budget is reached, whatever the daemon's loop is doing."""
        while not self._stop:
            try:
                if not self.monitor.poll(200):
                    continue
            except zmq.ZMQError:
                continue
            # Everything queued, at once: each wait for the GIL costs a switch interval, in which a
            # flood opens hundreds of connections.
            with self._lock:
                if self._descriptors_short() and self.gate is not None and self.gate.pause():
                    self.paused = True
                for _ in range(100_000):
                    try:
                        msg = self.monitor.recv_multipart(zmq.NOBLOCK)
                    except zmq.ZMQError:
                        break
                    self._event(parse_monitor_message(msg))
                    if self.total >= self.fd_budget and self.gate is not None and self.gate.pause():
                        self.paused = True

    def _descriptors_short(self) -> bool:
        """Whether the lowest free descriptor number (what accept() gets next) is past the budget:
        exact, where the monitor's counts lag (and drop events when its queue is full)."""
        return self.gate is not None and self.gate.lowest_free() >= self.fd_budget + FD_MARGIN

    @property
    def peers(self) -> int:
        return len(self._per_peer)

    def pump(self, budget: int = 1000) -> bool:
        """Handle what the monitor and the ZAP socket hold; True if anything was."""
        busy = False
        with self._lock:
            for _ in range(budget if self._watcher is None else 0):
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

    def _zap(self, req: list[bytes]) -> None:  # under self._lock (pump)
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
        """Stop accepting before accept() could run out of descriptors; accept again below the mark."""
        if not self.paused and self.total >= self.fd_budget:
            try:
                if self.gate is not None:
                    self.gate.pause()
                else:
                    self._router.unbind(self._endpoint)
                self.paused = True
            except (zmq.ZMQError, OSError) as e:
                log.error("cannot pause accepting connections: %s", e)
        if self.paused and not self._paused_logged:
            self._paused_logged = True
            log.error("%d connections: not accepting more until some close (descriptor limit %d)",
                      self.total, 2 * (self.fd_budget + FD_MARGIN))
        elif self.paused and time.monotonic() - self._rechecked >= RECHECK_S:
            self._rechecked = time.monotonic()
            for fd, peer in list(self._by_fd.items()):
                if peer_of_fd(fd) != peer:
                    self._event({"event": zmq.EVENT_DISCONNECTED, "value": fd})
        if self.paused and self.total < RESUME_AT * self.fd_budget:
            try:
                if self.gate is not None:
                    self.gate.resume()
                else:
                    self._router.bind(self._endpoint)
                    if self._on_bind is not None:
                        self._on_bind()
                self.paused = False
                self._paused_logged = False
                log.info("accepting connections again (%d open%s)", self.total,
                         f"; {self.gate.refused} refused meanwhile" if self.gate is not None else "")
            except (zmq.ZMQError, OSError) as e:
                log.error("cannot listen again on %s: %s", self._endpoint, e)

    def close(self) -> None:
        """Before the router closes: its listener must be the real one again (libzmq removes that
        from its poller, and aborts if the number names another)."""
        self._stop = True
        if self._watcher is not None:
            self._watcher.join(2.0)
        if self.gate is not None:
            self.gate.resume()
        try:
            self._router.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.zap.close(linger=0)

    def close_gate(self) -> None:
        """After the router closed: the gate's drain thread and socket file go too."""
        if self.gate is not None:
            self.gate.close()
