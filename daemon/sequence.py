"""Capture sequence numbers: strictly increasing for the life of a state directory, across restarts.

Rules:
- Numbers start at 1 (a watcher's since=0 means "before everything"). The daemon takes one when a
  capture begins; all instances of one daemon share the counter.
- The state lives in `<state_dir>/sequence.json`, one JSON object:

      {"version": 1, "next": N}

  a promise that no number >= N was ever handed out by a daemon using this directory.
- Block reservation: before handing out a number >= N, the daemon raises the promise to
  number + BLOCK, so it writes once per BLOCK captures, not once per capture (it refills when half
  a block is left, so the write is never in the way of the next number). A write is crash-safe:
  a temporary file in the same directory, fsync, rename over the old one, fsync of the directory.
  A power cut leaves the old or the new promise, never a torn file.
- A clean stop writes next = last used + 1, so a clean restart goes on without a gap. After a crash
  the restart begins at the promised N: the numbers between the last one used and N are never used,
  and a watcher resuming from before sees them inside LostCaptures "daemon restarted" (like the
  captures the dead daemon held in memory).
- One daemon per state directory: it holds an exclusive flock on `<state_dir>/sequence.lock` while
  it runs. A second daemon on the same directory does not start (two counters would repeat numbers).
- Start-up refuses, with one line, a state file it cannot read or parse, a directory it cannot
  create or write, and a directory another daemon holds. It never guesses a number: starting again
  at 1 would make every watcher's since "in the future", and guessing low would repeat numbers. The
  operator fixes or removes the file (removing it restarts numbering at 1; say so to the watchers).
- A write that fails while running (disk full) does not stop the daemon: it goes on numbering past
  the promise, logs an error, shows `persist_error` in status, and retries every RETRY_S. Until a
  write succeeds, a crash could repeat those numbers after the restart.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

STATE_FILE = "sequence.json"
LOCK_FILE = "sequence.lock"
STATE_VERSION = 1
BLOCK = 10000  # numbers reserved per write
RETRY_S = 10.0


class SequenceStateError(RuntimeError):
    """The sequence state cannot be used; the message is the one line the operator sees."""


class SequenceCounter:
    def __init__(self, state_dir: str, block: int = BLOCK):
        if block < 1:
            raise ValueError("block must be >= 1")
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, STATE_FILE)
        self.block = block
        self.refill_at = block // 2  # reserve the next block when this few numbers are left
        self.first = 0  # first number of this run
        self.next = 0  # next number to hand out
        self.reserved = 0  # the promise on disk: numbers < reserved may be handed out
        self.persist_error = ""  # why the last write failed ("" when it did not)
        self.writes = 0
        self._lock_fd: int | None = None
        self._retry_at = 0.0

    # -- life --

    def open(self) -> "SequenceCounter":
        """Lock the directory, read the promise, reserve the first block; SequenceStateError if not possible."""
        d = self.state_dir
        try:
            os.makedirs(d, mode=0o750, exist_ok=True)
        except OSError as e:
            raise SequenceStateError(f"state_dir {d}: cannot create it: {e.strerror or e}") from None
        try:
            fd = os.open(os.path.join(d, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as e:
            raise SequenceStateError(f"state_dir {d}: cannot write there: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SequenceStateError(
                    f"state_dir {d} is in use by another vllm-tap daemon{f' (pid {holder})' if holder else ''}: "
                    "give each daemon its own --state-dir") from None
            raise SequenceStateError(f"state_dir {d}: cannot lock {LOCK_FILE}: {e.strerror or e}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        try:
            start = self._read()
            self.first = self.next = self.reserved = start
            self._reserve(start + self.block, at_start=True)
        except BaseException:
            self._unlock()
            raise
        log.info("sequence numbers continue at %d (state %s)", start, self.path)
        return self

    def close(self) -> None:
        """Clean stop: promise exactly what was used, so the next run continues without a gap."""
        if self._lock_fd is None:
            return
        try:
            self._write(self.next)
        except OSError as e:
            log.error("sequence state %s: could not record the last number at stop (%s); the next run skips "
                      "to %d", self.path, e.strerror or e, self.reserved)
        finally:
            self._unlock()

    # -- numbers --

    @property
    def last(self) -> int:
        """The newest number handed out (first - 1 before the first of this run)."""
        return self.next - 1

    def take(self) -> int:
        n = self.next
        self.next += 1
        if self.reserved - self.next < self.refill_at:
            self._refill()
        return n

    def tick(self, now: float | None = None) -> None:
        """Retry a failed reservation (called from the daemon's tick)."""
        if self.persist_error and (now or time.monotonic()) >= self._retry_at:
            self._refill()

    def _refill(self) -> None:
        now = time.monotonic()
        if self.persist_error and now < self._retry_at:
            return
        try:
            self._reserve(max(self.reserved, self.next) + self.block)
        except OSError as e:
            self._retry_at = now + RETRY_S
            if not self.persist_error:
                log.error("sequence state %s: cannot reserve numbers (%s); numbering goes on unpersisted and a "
                          "crash now could repeat numbers after the restart; retrying every %.0f s",
                          self.path, e.strerror or e, RETRY_S)
            self.persist_error = str(e.strerror or e)

    def _reserve(self, upto: int, at_start: bool = False) -> None:
        try:
            self._write(upto)
        except OSError as e:
            if at_start:
                raise SequenceStateError(f"state_dir {self.state_dir}: cannot write {STATE_FILE}: "
                                         f"{e.strerror or e}") from None
            raise
        if self.persist_error:
            log.info("sequence state %s writable again", self.path)
        self.persist_error = ""
        self.reserved = upto

    # -- the file --

    def _read(self) -> int:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(4096)
        except FileNotFoundError:
            log.info("no sequence state at %s: numbering starts at 1", self.path)
            return 1
        except OSError as e:
            raise SequenceStateError(f"sequence state {self.path}: cannot read: {e.strerror or e}") from None
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
                raise ValueError(f"expected version {STATE_VERSION}")
            nxt = doc["next"]
            if isinstance(nxt, bool) or not isinstance(nxt, int) or nxt < 1:
                raise ValueError(f"'next' must be an integer >= 1, got {nxt!r}")
        except (ValueError, KeyError, TypeError) as e:
            raise SequenceStateError(
                f"sequence state {self.path} is unreadable ({e}): restore it, or remove it to restart numbering at 1 "
                "(watchers must then resume with since=0)") from None
        return nxt

    def _write(self, nxt: int) -> None:
        tmp = self.path + ".tmp"
        data = json.dumps({"version": STATE_VERSION, "next": nxt}).encode() + b"\n"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.writes += 1

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def snapshot(self) -> dict[str, Any]:
        return {"state_file": self.path, "run_first": self.first, "last": self.last, "reserved": self.reserved,
                "persist_error": self.persist_error or None}


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return None
