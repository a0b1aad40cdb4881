"""A wake-up from ring writers to the daemon, so it need not poll the rings on a timer.

The daemon binds a Unix datagram socket in the shm directory; a writer sends it one byte after it
commits records, if the daemon said in the ring's header that it is about to sleep (the waiting
flag, ring_format.READER_WAITING_OFFSET): a busy daemon is not rung, so under load a commit costs
no system call. Nothing but the wake-up goes through it (the records stay in the rings), and a
writer never waits for it: the send is non-blocking, and when no daemon listens (or its queue is
full, or the socket is not ours to write) the byte is simply not sent. The daemon still reads
every ring at least every tick (50 ms), so a missed wake-up costs latency, never data.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time

from vllm_tap import ring_format as rf

log = logging.getLogger(__name__)

# After a failed send (no daemon), the writer tries again only after this long: a serving process
# without a daemon should not pay a failing system call every step.
RETRY_AFTER_S = 0.5


def doorbell_path(shm_dir: str) -> str:
    return os.path.join(shm_dir, rf.DOORBELL_NAME)


class DoorbellPush:
    """The writer side: `ring()` costs one non-blocking sendto."""

    def __init__(self, path: str):
        self.path = path
        self._sock: socket.socket | None = None
        self._retry_at = 0.0
        self.sent = 0

    def ring(self) -> None:
        if self._retry_at and time.monotonic() < self._retry_at:
            return
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto(b"\x01", self.path)
            self._retry_at = 0.0
            self.sent += 1
        except BlockingIOError:
            pass  # the daemon has wake-ups queued already
        except OSError:
            # No daemon (ENOENT, ECONNREFUSED) or not allowed to wake it: it polls anyway.
            self._retry_at = time.monotonic() + RETRY_AFTER_S

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Doorbell:
    """The daemon side: a socket to wait on (`fileno`) and `drain` after waking."""

    def __init__(self, sock: socket.socket, path: str, inode: int):
        self._sock = sock
        self.path = path
        self._inode = inode

    @classmethod
    def bind(cls, shm_dir: str) -> "Doorbell | None":
        """None when there is no shm directory yet or another daemon holds the doorbell."""
        if not os.path.isdir(shm_dir):
            return None
        path = doorbell_path(shm_dir)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            try:
                sock.bind(path)
            except OSError as e:
                if e.errno != errno.EADDRINUSE or _is_live(path):
                    if e.errno == errno.EADDRINUSE:
                        log.warning("%s is held by another daemon: polling the rings on a timer", path)
                    else:
                        log.warning("cannot bind %s (%s): polling the rings on a timer", path, e)
                    sock.close()
                    return None
                os.unlink(path)  # left behind by a daemon that died
                sock.bind(path)
            # Any writer may wake the daemon: the byte carries nothing, the directory guards the rings.
            os.chmod(path, 0o666)
            sock.setblocking(False)
            return cls(sock, path, os.stat(path).st_ino)
        except OSError as e:
            log.warning("cannot set up %s (%s): polling the rings on a timer", path, e)
            sock.close()
            return None

    def fileno(self) -> int:
        return self._sock.fileno()

    def drain(self) -> int:
        n = 0
        while True:
            try:
                self._sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return n
            n += 1

    def close(self) -> None:
        self._sock.close()
        try:
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def _is_live(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.setblocking(False)
        probe.sendto(b"", path)
        return True
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        probe.close()
