"""Linux inotify through ctypes: the daemon learns of new and replaced rings without rescanning.

Only what the daemon needs: watch directories (never through a symlink), read events without
blocking, and a file descriptor to poll. Where inotify is missing or its limits are reached,
`Inotify.open()` returns None and the caller falls back to periodic scans.

Event layout (struct inotify_event): int wd; u32 mask; u32 cookie; u32 len; char name[len].
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import struct
from dataclasses import dataclass

log = logging.getLogger(__name__)

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

# What changes the set of rings: names appearing, going or being renamed over, and the watched
# directory itself going away.
DIR_EVENTS = (IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF
              | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK)

_EVENT = struct.Struct("iIII")
_READ_BYTES = 64 << 10


@dataclass(frozen=True)
class Event:
    wd: int
    mask: int
    name: str

    @property
    def overflow(self) -> bool:
        return bool(self.mask & IN_Q_OVERFLOW)


class Inotify:
    def __init__(self, libc: ctypes.CDLL, fd: int):
        self._libc = libc
        self.fd = fd

    @classmethod
    def open(cls) -> "Inotify | None":
        name = ctypes.util.find_library("c") or "libc.so.6"
        try:
            libc = ctypes.CDLL(name, use_errno=True)
            init = libc.inotify_init1
        except (OSError, AttributeError):
            return None
        init.argtypes = [ctypes.c_int]
        init.restype = ctypes.c_int
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_add_watch.restype = ctypes.c_int
        libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.inotify_rm_watch.restype = ctypes.c_int
        fd = init(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            log.warning("inotify unavailable (%s): scanning the ring directory instead", os.strerror(ctypes.get_errno()))
            return None
        return cls(libc, fd)

    def add(self, path: str, mask: int = DIR_EVENTS) -> int | None:
        """Watch directory `path` (not through a symlink); None if it cannot be watched."""
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), mask)
        if wd < 0:
            err = ctypes.get_errno()
            if err not in (errno.ENOENT, errno.ENOTDIR):
                log.warning("cannot watch %s: %s", path, os.strerror(err))
            return None
        return wd

    def remove(self, wd: int) -> None:
        self._libc.inotify_rm_watch(self.fd, wd)

    def read(self) -> list[Event]:
        """Events queued now (never blocks)."""
        out: list[Event] = []
        while True:
            try:
                buf = os.read(self.fd, _READ_BYTES)
            except BlockingIOError:
                return out
            except InterruptedError:
                continue
            at = 0
            while at + _EVENT.size <= len(buf):
                wd, mask, _cookie, n = _EVENT.unpack_from(buf, at)
                raw = buf[at + _EVENT.size : at + _EVENT.size + n]
                out.append(Event(wd, mask, os.fsdecode(raw.split(b"\0", 1)[0])))
                at += _EVENT.size + n
            if len(buf) < _READ_BYTES // 2:
                return out

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
