"""Large ring payloads copied into the delivery arena by a child process that maps the rings.

Why: pread from tmpfs copies in the kernel, which loads every destination line before it writes it;
a copy between two mappings writes around the cache and costs ~0.14 CPU s/GB here against pread's
~0.22 (and no page lookup per 4 KiB). With full logits the copy is most of the daemon's work. But a
ring file that is truncated under a mapping faults (SIGBUS) on the next load, and no Python process
survives that: anyone who can write a ring can shrink it. So the daemon itself never maps a ring;
this child does, and dies instead of the daemon.

Rules this module keeps:
- The child maps each ring read-only and the arena read-write, from descriptors the daemon passes
  (SCM_RIGHTS over a socketpair): it opens no path and trusts nothing it was not handed.
- The daemon waits for each copy's answer (the region is not read before it lands). No answer, a
  wrong one, or the child gone (a ring truncated under it, killed, COPY_TIMEOUT_S without an answer)
  and `copy` returns False: the caller reads the record with pread as without a copier (a truncated
  ring then gives a short read: RingBroken, as always). The child is then killed and a new one is
  started on a later copy, at most once per RESTART_AFTER_S; each loss is logged and counted.
- Only what is worth a round trip goes through it: payloads of at least MIN_BYTES, in the arena.
  The daemon overlaps copies with its own work: `start` asks and returns, `finish` waits (the ring
  reader reads the next large record ahead this way while the daemon handles the last one).
- A ring reader that closes tells the copier (`forget`), which unmaps it in the child: a deleted
  ring's pages are not kept alive by a stale mapping.

Messages (SOCK_SEQPACKET, one struct each, little-endian):
  daemon -> child  MAP    <B Q        kind 1, key; the ring's descriptor attached
                   ARENA  <B Q        kind 2, 0; the arena's descriptor attached
                   UNMAP  <B Q        kind 3, key
                   COPY   <B Q Q Q Q Q kind 4, key, ring offset, arena offset, bytes, sequence
  child -> daemon  DONE   <Q B       sequence, status (0 copied, 1 out of bounds or unknown key);
                                     sequence 0 once, when it has mapped the arena (ready)
"""

from __future__ import annotations

import concurrent.futures
import logging
import mmap
import os
import socket
import struct
import subprocess
import sys
import time
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MIN_BYTES = 2 << 20  # smaller payloads are read with pread (a round trip to the child is ~50 µs)
COPY_TIMEOUT_S = 5.0  # no answer by then: the child is taken for stuck, killed, and pread takes over
RESTART_AFTER_S = 10.0

_MAP, _ARENA, _UNMAP, _COPY = 1, 2, 3, 4
_CMD = struct.Struct("<BQ")
_COPY_CMD = struct.Struct("<BQQQQQ")
_DONE = struct.Struct("<QB")


class Copier:
    """The daemon's end: `copy(reader, offset, buf)` copies a ring's bytes into an arena array."""

    def __init__(self, arena: Any):
        self.arena = arena
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        # reader -> the key the child maps its ring under (the reader itself as the key: an id
        # could be another reader's once this one is gone).
        self._keys: dict[Any, int] = {}
        self._next_key = 1
        self._seq = 0
        self._down_until = 0.0
        self._ready = False  # the child said it mapped the arena
        self._generation = 0  # of the child: tokens of one that is gone fail
        self._answers: dict[int, int] = {}  # sequence -> status, answered and not finished yet
        self.copies = 0
        self.waited_s = 0.0  # the daemon's time waiting for copies to land
        self.losses = 0  # children that died or stopped answering

    # -- the daemon side --

    def copy(self, reader: Any, offset: int, buf: np.ndarray) -> bool:
        """Copy len(buf) bytes at `offset` of reader's ring file into buf (an arena array).
        False when it did not (too small, not in the arena, no child): read it another way."""
        token = self.start(reader, offset, buf)
        return token is not None and self.finish(token)

    def start(self, reader: Any, offset: int, buf: np.ndarray) -> tuple[int, int] | None:
        """Ask for the copy and return at once: a token for `finish`, or None (not taken: read it
        another way). The ring's bytes must stay where they are until `finish` (not consumed)."""
        n = buf.nbytes
        if n < MIN_BYTES:
            return None
        where = self.arena.locate(buf)
        if where is None:
            return None
        if self._sock is None and not self._start():
            return None
        if not self._ready and not self._check_ready():
            return None  # still starting: pread meanwhile, never a wait
        try:
            key = self._keys.get(reader)
            if key is None:
                key = self._map(reader)
            self._seq += 1
            self._sock.send(_COPY_CMD.pack(_COPY, key, offset, self.arena.data_offset + where[2], n, self._seq))
        except OSError as e:
            self._lost(str(e) or type(e).__name__)
            return None
        return (self._generation, self._seq)

    def finish(self, token: tuple[int, int]) -> bool:
        """Wait for a copy `start` took: True once it landed; False if it did not (read it another
        way: the bytes in its buffer are undefined)."""
        generation, seq = token
        if generation != self._generation or self._sock is None:
            return False  # that child is gone
        t0 = time.perf_counter()
        try:
            while seq not in self._answers:
                msg = self._sock.recv(64)
                if len(msg) != _DONE.size:
                    raise ConnectionError("the copier closed its socket" if not msg else "a malformed answer")
                got, status = _DONE.unpack(msg)
                if got > self._seq or got in self._answers:
                    raise ConnectionError(f"an answer to copy {got}, not asked")
                self._answers[got] = status
        except (OSError, ConnectionError) as e:
            self._lost(str(e) or type(e).__name__)
            return False
        self.waited_s += time.perf_counter() - t0
        # Not 0: bounds the daemon computed from a ring it checked; the ring changed size. pread
        # tells that properly, and the child is fine.
        if self._answers.pop(seq) != 0:
            return False
        self.copies += 1
        return True

    def forget(self, reader: Any) -> None:
        key = self._keys.pop(reader, None)
        if key is not None and self._sock is not None:
            try:
                self._sock.send(_CMD.pack(_UNMAP, key))
            except OSError as e:
                self._lost(str(e))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        self._keys.clear()

    def snapshot(self) -> dict[str, Any]:
        return {"running": self._sock is not None, "pid": self._proc.pid if self._proc is not None else None,
                "copies": self.copies, "waited_s": round(self.waited_s, 3), "losses": self.losses}

    def _start(self) -> bool:
        if time.monotonic() < self._down_until:
            return False
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_tap.daemon.copier", str(child.fileno())],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        except OSError as e:
            parent.close()
            child.close()
            self._down_until = time.monotonic() + RESTART_AFTER_S
            log.error("cannot start the ring copier (%s): large records are read with pread", e)
            return False
        child.close()
        parent.settimeout(COPY_TIMEOUT_S)
        self._sock = parent
        self._ready = False
        try:
            socket.send_fds(parent, [_CMD.pack(_ARENA, 0)], [self.arena.fileno()])
        except OSError as e:
            self._lost(str(e))
            return False
        log.info("ring copier started (pid %d): ring payloads of %d MiB and more are copied by it",
                 self._proc.pid, MIN_BYTES >> 20)
        return True

    def _check_ready(self) -> bool:
        try:
            msg = self._sock.recv(64, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError as e:
            self._lost(str(e))
            return False
        if msg != _DONE.pack(0, 0):
            self._lost("it closed its socket while starting" if not msg else "a malformed greeting")
            return False
        self._ready = True
        return True

    def _map(self, reader: Any) -> int:
        key = self._next_key
        self._next_key += 1
        socket.send_fds(self._sock, [_CMD.pack(_MAP, key)], [reader.fileno()])
        self._keys[reader] = key
        return key

    def _lost(self, why: str) -> None:
        self.losses += 1
        code = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            code = self._proc.wait()
        log.error("ring copier lost (%s%s): large records are read with pread; a new copier in %.0f s",
                  why, f", exit {code}" if code is not None else "", RESTART_AFTER_S)
        self._proc = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._keys.clear()
        self._answers.clear()
        self._generation += 1
        self._down_until = time.monotonic() + RESTART_AFTER_S


# -- the child --

def _child(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    rings: dict[int, tuple[mmap.mmap, np.ndarray]] = {}
    arena: np.ndarray | None = None
    # One copying thread, in the order asked (the receiving thread stays free): two copying halves
    # at once were no faster here and cost ~1.4x the CPU per GB (memory, not cores, bounds a copy).
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def copy(seq: int, key: int, src: int, dst: int, n: int) -> None:
        ring = rings.get(key)
        ok = (ring is not None and arena is not None and src >= 0 and dst >= 0
              and src + n <= len(ring[1]) and dst + n <= len(arena))
        if ok:
            np.copyto(arena[dst : dst + n], ring[1][src : src + n])
        sock.send(_DONE.pack(seq, 0 if ok else 1))

    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
        if not msg:
            return  # the daemon went
        kind = msg[0]
        if kind == _COPY:
            _, key, src, dst, n, seq = _COPY_CMD.unpack(msg)
            pool.submit(copy, seq, key, src, dst, n)
            continue
        _, key = _CMD.unpack(msg)
        if kind == _UNMAP:
            old = rings.pop(key, None)
            if old is not None:
                del old
            continue
        if not fds:
            continue
        try:
            size = os.fstat(fds[0]).st_size
            if kind == _MAP:
                m = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ)
                rings[key] = (m, np.frombuffer(m, np.uint8))
            elif kind == _ARENA:
                m = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                arena = np.frombuffer(m, np.uint8)
                sock.send(_DONE.pack(0, 0))  # ready
        finally:
            for f in fds:
                os.close(f)


if __name__ == "__main__":
    _child(int(sys.argv[1]))
