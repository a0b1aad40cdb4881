"""Stop libzmq accepting on the daemon's ipc:// socket at once, from any thread, without touching zmq.

libzmq aborts the whole process when accept() on an ipc:// listener fails with EMFILE, and it
accepts on its own I/O thread, as fast as connections arrive. Closing the listener (zmq unbind)
must happen on the thread that owns the zmq socket, which may be busy, or starved of CPU by the very
flood it should stop. Rules this module keeps:
- The listening socket is the daemon's own (bound, made non-blocking, then given to libzmq with
  ZMQ_USE_FD), so its descriptor number is known: `fd`.
- pause() puts a listener nobody can reach (bound in a private directory, the name then removed;
  non-blocking, so its queue is always empty) in place of that number with dup2: from that
  instant libzmq's accept() on it returns EAGAIN, which libzmq tolerates. The real listener stays
  open on a duplicate we hold, so libzmq's poller registration (of the real one) stays valid for
  resume() and for the socket's close. It is one system call, safe from any thread.
- While paused, a drain thread accepts what reaches the real listener and closes it at once (the
  client sees its connection refused and retries later), so the queue stays empty and libzmq's
  poller is not woken for it. It never holds more than one descriptor at a time.
- resume() puts the real listener back with dup2. close() unlinks the socket file if it is still
  ours (libzmq leaves a ZMQ_USE_FD listener's file alone).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import tempfile
import threading

log = logging.getLogger(__name__)

BACKLOG = 128
_DRAIN_POLL_MS = 200  # how often the drain thread looks at its stop flag


def _set_nonblocking(fd: int) -> None:
    os.set_blocking(fd, False)


class AcceptGate:
    def __init__(self, path: str, backlog: int = BACKLOG):
        self.path = path
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if os.path.lexists(path):
                os.unlink(path)  # a dead daemon's socket (start-up checked that nobody answers there)
            s.bind(path)
            s.listen(backlog)
        except BaseException:
            s.close()
            raise
        self.fd = s.detach()
        _set_nonblocking(self.fd)  # libzmq does not for a ZMQ_USE_FD listener; the drain thread shares it
        self._ino = os.stat(path).st_ino
        self._real = socket.socket(fileno=os.dup(self.fd))  # the real listener, whatever `fd` names
        self._real.setblocking(False)
        self._dummy = _unreachable_listener()
        self._lock = threading.Lock()
        self.paused = False
        self.refused = 0  # connections closed by the drain thread while paused
        self._stop = False
        self._wake = threading.Event()
        self._drainer = threading.Thread(target=self._drain, name="vllm-tap-accept-gate", daemon=True)
        self._drainer.start()

    def pause(self) -> bool:
        """True if this call paused it."""
        with self._lock:
            if self.paused or self._stop:
                return False
            os.dup2(self._dummy, self.fd)
            self.paused = True
        self._wake.set()
        return True

    def resume(self) -> bool:
        with self._lock:
            if not self.paused or self._stop:
                return False
            os.dup2(self._real.fileno(), self.fd)
            self.paused = False
        return True

    def lowest_free(self) -> int:
        """The descriptor number accept() would get now (the limit itself when none is left)."""
        try:
            fd = os.dup(self._dummy)
        except OSError:
            return 1 << 30
        os.close(fd)
        return fd

    def _drain(self) -> None:
        poller = select.poll()
        poller.register(self._real.fileno(), select.POLLIN)
        while not self._stop:
            if not self.paused:
                self._wake.wait(_DRAIN_POLL_MS / 1000)
                self._wake.clear()
                continue
            if not poller.poll(_DRAIN_POLL_MS):
                continue
            with self._lock:
                if not self.paused:
                    continue  # libzmq accepts again: leave the connection to it
                try:
                    conn, _ = self._real.accept()
                except BlockingIOError:
                    continue  # gone already (the client gave up)
                except OSError:
                    conn = None  # no descriptor to spare this instant
            if conn is None:
                self._wake.wait(0.01)
                continue
            conn.close()
            self.refused += 1

    def close(self) -> None:
        """After the zmq socket closed (it closes `fd`): stop the drain thread, unlink the file."""
        self._stop = True
        self._wake.set()
        self._drainer.join(2.0)
        self._real.close()
        try:
            os.close(self._dummy)
        except OSError:
            pass
        try:
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass


def _unreachable_listener() -> int:
    """A listening unix socket with no name left to connect to (non-blocking: accept says EAGAIN)."""
    d = tempfile.mkdtemp(prefix="vllm-tap-gate-")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        name = os.path.join(d, "s")
        s.bind(name)
        s.listen(1)
        os.unlink(name)
    finally:
        os.rmdir(d)
    fd = s.detach()
    _set_nonblocking(fd)
    return fd
