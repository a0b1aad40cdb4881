"""Finding rings: which `<shm_dir>/<instance>/*.ring` files exist, cheaply and without following links.

Rules this module keeps:
- Nothing is followed through a symbolic link: directories are opened O_NOFOLLOW relative to their
  parent's descriptor and entries are classified from the directory itself (d_type), so a link
  under the ring directory can never make the daemon read someone else's ring.
- The shm directory and every instance directory must pass the access rules (`root_rule`,
  `dir_rule`: owner, group, mode; daemon/access.py), judged by fstat of the opened directory. One
  that does not is not read: one line (once per directory inode), counted in `dirs_refused`.
- The directories are watched with inotify, so a new or replaced ring is noticed when it appears,
  not by rescanning; a full scan runs at start, after the kernel's event queue overflowed, and
  slowly in the background as a safety net (fast, where inotify is missing).
- Work per call is bounded (`step(budget)`): a directory holding 100,000 junk files is walked a
  slice at a time, so the daemon's loop never stalls on it. A file that is not a ring is remembered
  by inode and skipped without a system call until it changes.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Iterator

from vllm_tap import ring_format as rf
from vllm_tap.safe_paths import Expect

from . import inotify as ino

log = logging.getLogger(__name__)

SCAN_INTERVAL_S = 0.25  # full rescans without inotify
SAFETY_RESCAN_S = 30.0  # full rescans with inotify (a watch that could not be added, say)
MAX_REMEMBERED = 1 << 20  # rejected files remembered; beyond, the memory is cleared and they are retried
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_RING_NAME = re.compile(r"^(engine|rank-\d{5})" + re.escape(rf.RING_SUFFIX) + "$")  # vllm_tap.ring_files.ring_path


@dataclass(frozen=True)
class Candidate:
    """A name that may be a ring: open it relative to `dir_fd`, no links followed."""

    instance: str
    name: str
    dir_fd: int
    inode: int | None  # from the directory entry (None: unknown, from an event)

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.name)


@dataclass
class _Instance:
    name: str
    fd: int
    wd: int | None = None
    inode: int = 0


@dataclass
class RingDirectory:
    shm_dir: str
    use_inotify: bool = True
    root_rule: Expect | None = None  # what the shm directory must pass (None: anything)
    dir_rule: Expect | None = None  # ... and each instance directory
    dirs_refused: int = 0
    _refused_dirs: dict = field(default_factory=dict)  # name -> inode refused (logged once)
    _root: int = -1
    _root_wd: int | None = None
    _inotify: ino.Inotify | None = None
    _instances: dict[str, _Instance] = field(default_factory=dict)
    _by_wd: dict[int, _Instance] = field(default_factory=dict)
    _queue: collections.deque = field(default_factory=collections.deque)
    _urgent: collections.deque = field(default_factory=collections.deque)  # just created, or named like a ring
    _queued: set = field(default_factory=set)
    _rejected: dict = field(default_factory=dict)  # (instance, name) -> inode
    _walks: collections.deque = field(default_factory=collections.deque)  # bounded walks in progress
    _last_scan: float = -1e18
    _root_tried: float = -1e18
    changed: set = field(default_factory=set)  # (instance, name) of open rings that may have been replaced
    scans: int = 0

    def __post_init__(self) -> None:
        if self.use_inotify:
            self._inotify = ino.Inotify.open()

    # -- what the daemon polls --

    def fileno(self) -> int | None:
        return self._inotify.fileno() if self._inotify is not None else None

    @property
    def watching(self) -> bool:
        return self._inotify is not None and self._root_wd is not None

    def reject(self, c: Candidate, inode: int | None) -> None:
        """`c` is not a readable ring: skip it until its inode changes."""
        if len(self._rejected) >= MAX_REMEMBERED:
            self._rejected.clear()
        if inode is not None:
            self._rejected[c.key] = inode

    def step(self, now: float, budget: int = 2048, max_candidates: int = 256) -> list[Candidate]:
        """New candidates (at most `max_candidates`: a ring just created, or named as a writer names
        one, first), doing at most about `budget` units of work (directory entries)."""
        if self._root < 0 and now - self._root_tried >= SCAN_INTERVAL_S:
            self._root_tried = now
            self._ensure_root()
        if self._inotify is not None:
            self._events()
        interval = SAFETY_RESCAN_S if self.watching else SCAN_INTERVAL_S
        if not self._walks and now - self._last_scan >= interval:
            self._last_scan = now
            self.scans += 1
            self._walks.append(self._walk())
        work = 0
        while self._walks and work < budget:
            try:
                next(self._walks[0])
                work += 1
            except StopIteration:
                self._walks.popleft()
        out = []
        for q in (self._urgent, self._queue):
            while q and len(out) < max_candidates:
                c = q.popleft()
                self._queued.discard(c.key)
                out.append(c)
        return out

    def close(self) -> None:
        for inst in self._instances.values():
            os.close(inst.fd)
        self._instances.clear()
        self._by_wd.clear()
        if self._root >= 0:
            os.close(self._root)
            self._root = -1
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    # -- internals --

    def _ensure_root(self) -> None:
        if self._root >= 0:
            return
        try:
            fd = os.open(self.shm_dir, _DIR_FLAGS)
        except OSError:
            return
        if not self._allowed(fd, "", self.root_rule, f"shm directory {self.shm_dir}"):
            os.close(fd)
            return
        self._root = fd
        if self._inotify is not None:
            self._root_wd = self._inotify.add(self.shm_dir, ino.DIR_EVENTS)
        self._walks.clear()
        self._last_scan = -1e18  # scan it now

    def _reset_root(self) -> None:
        self.close_instances()
        if self._root >= 0:
            os.close(self._root)
        self._root = -1
        self._root_wd = None
        self._walks.clear()

    def close_instances(self) -> None:
        for inst in list(self._instances.values()):
            self._drop_instance(inst.name)

    def _offer(self, instance: str, name: str, inode: int | None, urgent: bool = False) -> None:
        if not name.endswith(rf.RING_SUFFIX) or name.startswith("."):
            return
        key = (instance, name)
        if inode is not None and self._rejected.get(key) == inode:
            return  # known junk, unchanged
        inst = self._instances.get(instance)
        if inst is None or key in self._queued:
            return
        self._queued.add(key)
        q = self._urgent if urgent or _RING_NAME.match(name) else self._queue
        q.append(Candidate(instance, name, inst.fd, inode))

    def _open_instance(self, name: str) -> _Instance | None:
        if name.startswith(".") or self._root < 0:
            return None
        inst = self._instances.get(name)
        if inst is not None:
            return inst
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self._root)  # ELOOP for a link, ENOTDIR for a file
        except OSError:
            return None
        if not self._allowed(fd, name, self.dir_rule, f"instance directory {os.path.join(self.shm_dir, name)}"):
            os.close(fd)
            return None
        st = os.fstat(fd)
        inst = self._instances[name] = _Instance(name, fd, inode=st.st_ino)
        if self._inotify is not None:
            # Watched by path, but only after the no-follow open: the path now names this directory.
            inst.wd = self._inotify.add(os.path.join(self.shm_dir, name), ino.DIR_EVENTS)
            if inst.wd is not None:
                self._by_wd[inst.wd] = inst
        return inst

    def _allowed(self, fd: int, name: str, rule: Expect | None, what: str) -> bool:
        if rule is None:
            return True
        st = os.fstat(fd)
        why = rule.problem(st)
        if why is None:
            self._refused_dirs.pop(name, None)
            return True
        if self._refused_dirs.get(name) != st.st_ino:  # one line per directory, not per scan
            if len(self._refused_dirs) >= MAX_REMEMBERED:
                self._refused_dirs.clear()
            self._refused_dirs[name] = st.st_ino
            self.dirs_refused += 1
            log.warning("not reading %s: %s (ring_group / ring_owners / ring_mode)", what, why)
        return False

    def _drop_instance(self, name: str) -> None:
        inst = self._instances.pop(name, None)
        if inst is None:
            return
        if inst.wd is not None:
            self._by_wd.pop(inst.wd, None)
            if self._inotify is not None:
                self._inotify.remove(inst.wd)
        os.close(inst.fd)

    def _walk(self) -> Iterator[None]:
        """A full scan, one directory entry per iteration."""
        if self._root < 0:
            return
        try:
            with os.scandir(self._root) as it:
                names = []
                for e in it:
                    yield
                    if e.is_dir(follow_symlinks=False) and not e.name.startswith("."):
                        names.append(e.name)
        except OSError:
            self._reset_root()
            return
        for name in names:
            if self._open_instance(name) is not None:
                yield from self._walk_instance(name)

    def _events(self) -> None:
        assert self._inotify is not None
        for ev in self._inotify.read():
            if ev.overflow:
                log.warning("inotify queue overflowed: rescanning %s", self.shm_dir)
                self._walks.clear()
                self._last_scan = -1e18
                continue
            if ev.wd == self._root_wd and self._root_wd is not None:
                if ev.mask & (ino.IN_DELETE_SELF | ino.IN_MOVE_SELF | ino.IN_IGNORED):
                    self._reset_root()
                elif ev.mask & ino.IN_ISDIR and ev.mask & (ino.IN_CREATE | ino.IN_MOVED_TO):
                    if self._open_instance(ev.name) is not None:
                        self._walks.append(self._walk_instance(ev.name))
                elif ev.mask & ino.IN_ISDIR and ev.mask & (ino.IN_DELETE | ino.IN_MOVED_FROM):
                    self._drop_instance(ev.name)
                continue
            inst = self._by_wd.get(ev.wd)
            if inst is None:
                continue
            if ev.mask & (ino.IN_DELETE_SELF | ino.IN_MOVE_SELF | ino.IN_IGNORED):
                self._drop_instance(inst.name)
                continue
            if not ev.name.endswith(rf.RING_SUFFIX) or ev.mask & ino.IN_ISDIR:
                continue
            self.changed.add((inst.name, ev.name))
            if ev.mask & (ino.IN_CREATE | ino.IN_MOVED_TO):
                try:
                    st = os.stat(ev.name, dir_fd=inst.fd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    self._offer(inst.name, ev.name, st.st_ino, urgent=True)

    def _walk_instance(self, name: str) -> Iterator[None]:
        """A new instance directory may already hold rings (made before its watch was added)."""
        inst = self._instances.get(name)
        if inst is None:
            return
        try:
            with os.scandir(inst.fd) as it:
                for e in it:
                    yield
                    if e.name.endswith(rf.RING_SUFFIX) and e.is_file(follow_symlinks=False):
                        self._offer(name, e.name, e.inode())
        except OSError:
            pass
