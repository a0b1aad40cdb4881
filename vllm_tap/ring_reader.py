"""The consumer side of a record ring (vllm_tap.ring_writer is the producer), run by the daemon.

The reader persists its cursor in the file, so a restarted daemon resumes exactly where the last
one stopped; a restarted writer creates a fresh file (new inode, new epoch) that the reader notices.

Ordering: the writer stores payload bytes before the cursor, and the reader loads the cursor before
the payload. x86-64 keeps stores in order, which is where this runs; on weakly ordered CPUs the
writer's numpy stores would need explicit fences.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import logging
import os
import stat
import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import numpy as np

from vllm_tap import placement
from vllm_tap import ring_format as rf
from vllm_tap import ring_schema
from vllm_tap.placement import Placement
from vllm_tap.ring_files import RingFormatError
from vllm_tap.ring_payload import Destination, Landing, land
from vllm_tap.ring_records import Record

log = logging.getLogger(__name__)


@dataclass
class RingInfo:
    path: str
    rank: int
    world_size: int
    capacity: int
    epoch: int
    writer_pid: int
    write_cursor: int
    read_cursor: int
    stats: dict[str, int]
    placement: Placement | None = None  # where the writer runs (format 7; None before)

    @property
    def backlog_bytes(self) -> int:
        return self.write_cursor - self.read_cursor


class RingBroken(RuntimeError):
    """The ring file changed under the reader (truncated, grown, cursors that cannot be): stop using it."""


# The reader's rules (see the module docstring for the ring itself):
# - It never maps the file: everything is read with pread into its own buffers, so a file that is
#   truncated, grown or punched under it gives a short read or a size mismatch (RingBroken), never
#   a SIGBUS. Its cursor and liveness go back with pwrite.
# - The writer stores its cursor with one aligned 8-byte store; a pread copy of it is not promised
#   to be one load, so the cursor is read until two reads agree.
# - It opens a ring without following symlinks (O_NOFOLLOW, relative to an already opened
#   directory when given one), without blocking (a FIFO named *.ring), and only a regular file.
# - Every record goes through vllm_tap.ring_schema; one that does not fit is skipped alone (its
#   length was sane), counted in `rejected`, logged with ring and cursor, and kept in `rejections`
#   for the daemon to end the captures it names.
MAX_CAPACITY = 1 << 40
_PAGE = 4096
_CURSOR_READS = 8  # reads of the write cursor before giving up on two that agree
_LIVENESS_EVERY_NS = 500_000_000  # how often the reader stamps its pid and time into the header
_LOG_FIRST = 20  # rejected or corrupt records logged one by one per ring; then a count per minute
_LOG_EVERY_S = 60.0
_KEEP_REJECTIONS = 4096
_WINDOW = 256 << 10  # bytes read at once among records that are not large
_PREFIX = 4096  # bytes read at once after a large record (header, table and rows of the next)
_DIRECT = 64 << 10  # DATA records at least this large have their payload read straight into its arrays
_IOV_MAX = 1024  # pieces per preadv (the kernel's UIO_MAXIOV)
# A payload at least this large is read by several threads at once, each a part (preadv releases
# the GIL; a read from tmpfs runs at a few GB/s on one core, below what memory allows).
_SPLIT_READ = 4 << 20
_READ_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
_pool: "concurrent.futures.ThreadPoolExecutor | None" = None
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)


def _ring_fd(path: str, dir_fd: int | None, name: str | None, writable: bool) -> int:
    flags = (os.O_RDWR if writable else os.O_RDONLY) | _OPEN_FLAGS
    try:
        return os.open(name if dir_fd is not None and name else path, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RingFormatError(f"{path}: is a symbolic link (not followed)") from None
        raise


def allocated_enough(st: os.stat_result, write_cursor: int, capacity: int) -> bool:
    """Whether the file has storage behind what its cursor says was written.

    A writer reserves the whole file when it creates it (posix_fallocate); a file mostly made of
    holes where records are said to be was made by something else. (Half, not all: a writer that
    only truncated the file to size, as before reservations, leaves the tail of a PAD unwritten.)"""
    written = rf.HEADER_SIZE + min(max(write_cursor, 0), capacity)
    return st.st_blocks * 512 + _PAGE >= min(st.st_size, written) // 2


def _placement(path: str, head: bytes) -> Placement | None:
    """The writer's placement in a format-7 header (None when it gave none); RingFormatError when
    the bytes there are not one (a ring file is untrusted)."""
    (n,) = rf.placement_len_struct().unpack_from(head, rf.PLACEMENT_OFFSET)
    if n == 0:
        return None
    if n > rf.PLACEMENT_MAX:
        raise RingFormatError(f"{path}: placement of {n} bytes (at most {rf.PLACEMENT_MAX})")
    at = rf.PLACEMENT_OFFSET + 4
    try:
        return placement.decode(head[at : at + n])
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise RingFormatError(f"{path}: bad placement ({e})") from None
class Copier(Protocol):
    """Copies a payload from a ring into a buffer another way than pread (the daemon's copier, a
    child process that maps the rings)."""

    def copy(self, reader: "RingReader", offset: int, buf: np.ndarray) -> bool:
        """Copy len(buf) bytes at file `offset` into buf now; False: read it with pread after all."""

    def start(self, reader: "RingReader", offset: int, buf: np.ndarray) -> Any:
        """Start such a copy and return at once: a token for finish(), or None."""

    def finish(self, token: Any) -> bool:
        """Wait for a started copy; whether it landed."""

    def forget(self, reader: "RingReader") -> None:
        """The reader is closed."""


class RingReader:
    """The consumer side: copies records out with pread and persists the read cursor in the file.

    `destination` says where DATA payloads go (vllm_tap.ring_payload: the daemon's delivery arena; by
    default the heap), `copier` copies large ones another way than pread (and the next one ahead)."""

    def __init__(self, path: str, *, dir_fd: int | None = None, name: str | None = None, writable: bool = True,
                 require_allocated: bool = True, destination: Destination | None = None, copier: Copier | None = None):
        self.path = path
        self.name = name or os.path.basename(path)
        fd = _ring_fd(path, dir_fd, name, writable)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RingFormatError(f"{path}: not a regular file")
            if st.st_size < rf.HEADER_SIZE:
                raise RingFormatError(f"{path}: too short for a ring header")
            head = os.pread(fd, rf.HEADER_SIZE, 0)
            if len(head) < rf.HEADER_SIZE:
                raise RingFormatError(f"{path}: too short for a ring header")
            magic, version, header_size, capacity, epoch, pid, rank, world, _flags = rf.ident_struct().unpack_from(
                head, rf.IDENT_OFFSET)
            if magic != rf.RING_MAGIC:
                raise RingFormatError(f"{path}: not a vllm-tap ring (bad magic)")
            if version not in rf.READABLE_VERSIONS:
                raise RingFormatError(f"{path}: ring format v{version}, this reader reads "
                                      f"v{', v'.join(map(str, rf.READABLE_VERSIONS))}")
            if (header_size != rf.HEADER_SIZE or capacity % rf.ALIGN or not 4 * rf.ALIGN <= capacity <= MAX_CAPACITY
                    or st.st_size != header_size + capacity):
                raise RingFormatError(f"{path}: inconsistent header (size {st.st_size}, capacity {capacity})")
            if not -1 <= rank < 0xFFFF or not 0 < world <= 0xFFFF:
                raise RingFormatError(f"{path}: inconsistent header (rank {rank} of {world})")
            where = _placement(path, head) if version >= 7 else None
            read = int.from_bytes(head[rf.READ_CURSOR_OFFSET : rf.READ_CURSOR_OFFSET + 8], "little")
            write = int.from_bytes(head[rf.WRITE_CURSOR_OFFSET : rf.WRITE_CURSOR_OFFSET + 8], "little")
            if require_allocated and not allocated_enough(st, write, capacity):
                raise RingFormatError(
                    f"{path}: sparse file ({st.st_blocks * 512} bytes allocated of {st.st_size}): not made by a writer")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.inode = st.st_ino
        self.dev = st.st_dev
        self.size = st.st_size
        self.capacity = capacity
        self.epoch = epoch
        self.writer_pid = pid
        self.rank = rank
        self.world_size = world
        self.placement = where
        self._writable = writable
        self._r = read
        self._committed = read  # the cursor as the file has it
        self.defer_commit = False  # commit() moves the file's cursor, not every poll
        self.written = read  # the writer's cursor as the last poll found it (before reading)
        self.resumed = read > 0  # a previous reader consumed part of it (a restarted daemon)
        self.corrupt = 0
        self.rejected = 0
        self.destination_failures = 0  # records the destination's memory could not take (read privately instead)
        self.rejections: collections.deque = collections.deque(maxlen=_KEEP_REJECTIONS)
        self._scratch = np.empty(0, np.uint8)
        self._table_cache = ring_schema.TableCache()
        self.destination = destination
        self.copier = copier
        # The next large record's payload on its way into its block through the copier, asked for by
        # read_ahead while the daemon handles the last one: (cursor, landing, token). By cursor, not
        # file offset: a cursor never comes back, an offset does every lap.
        self._ahead: tuple[int, Landing, Any] | None = None
        self._at_cursor = 0  # the cursor of the record poll is reading
        self._last_large = False  # the last record poll read was a large DATA record
        self.read_aheads = 0  # copies read_ahead started, and of those, the ones poll took
        self.read_aheads_taken = 0
        self._stamped = 0
        self._logged = 0
        self._unlogged = 0
        self._log_at = 0.0

    # -- raw access --

    def _short(self, got: int, n: int, offset: int) -> RingBroken:
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            size = -1
        return RingBroken(f"{self.path}: size changed from {self.size} to {size} bytes "
                          f"(read {got} of {n} bytes at {offset})")

    def _pread_split(self, buf: np.ndarray, offset: int) -> None:
        """_pread_into, a large buffer in parts read at once by the shared read threads."""
        global _pool
        n = len(buf)
        parts = min(_READ_THREADS, n // (_SPLIT_READ // 2))
        if parts < 2:
            return self._pread_into(buf, offset)
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_READ_THREADS - 1, thread_name_prefix="vllm-tap-read")
        step = (n // parts + _PAGE - 1) // _PAGE * _PAGE
        cuts = list(range(0, n, step)) + [n]
        futures = [_pool.submit(self._pread_into, buf[a:b], offset + a) for a, b in zip(cuts[1:-1], cuts[2:])]
        try:
            self._pread_into(buf[: cuts[1]], offset)
        finally:
            errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e

    def _pread_into(self, buf: np.ndarray, offset: int) -> None:
        n = len(buf)
        got = os.preadv(self._fd, [memoryview(buf)], offset) if n else 0
        if got != n:
            raise self._short(got, n, offset)

    def _preadv(self, iov: list[memoryview], offset: int, n: int) -> None:
        got = 0
        for k in range(0, len(iov), _IOV_MAX):
            got += os.preadv(self._fd, iov[k : k + _IOV_MAX], offset + got) if n else 0
        if got != n:
            raise self._short(got, n, offset)

    def _u64(self, offset: int) -> int:
        b = os.pread(self._fd, 8, offset)
        if len(b) != 8:
            raise self._short(len(b), 8, offset)
        return int.from_bytes(b, "little")

    def write_cursor(self) -> int:
        a = self._u64(rf.WRITE_CURSOR_OFFSET)
        for _ in range(_CURSOR_READS):
            b = self._u64(rf.WRITE_CURSOR_OFFSET)
            if a == b:
                return a
            a = b
        raise RingBroken(f"{self.path}: the write cursor never read the same twice")

    def _store_read_cursor(self, r: int) -> None:
        self._r = r
        if not self.defer_commit:
            self.commit()

    def commit(self, cursor: int | None = None) -> None:
        """Move the ring file's read cursor to what was read (or to `cursor`, a record boundary between
        the file's cursor and what was read): the writer may reuse what lies below. With
        `defer_commit` the owner calls it once what it read is safe elsewhere (the daemon's
        journal), so a reader killed before that reads it again next time."""
        r = self._r if cursor is None else max(min(cursor, self._r), self._committed)
        if r != self._committed:
            if self._writable:
                os.pwrite(self._fd, r.to_bytes(8, "little"), rf.READ_CURSOR_OFFSET)
            self._committed = r

    @property
    def uncommitted(self) -> bool:
        return self._r != self._committed

    @property
    def committed(self) -> int:
        """The read cursor as the ring file has it."""
        return self._committed

    def skip_to(self, cursor: int) -> bool:
        """Go on from `cursor`, a record boundary an earlier reader of this ring read to and accounted
        for elsewhere (the file's cursor had not moved there yet), if it lies aligned between this
        reader's cursor and the writer's; False, and nothing changes, if it does not."""
        r = self._r
        if cursor <= r or cursor % rf.ALIGN or cursor - r > self.capacity or cursor > self.write_cursor():
            return False
        self._r = cursor
        self.resumed = True
        self.commit()
        return True

    def _stamp(self) -> None:
        now = time.time_ns()
        if self._writable and now - self._stamped >= _LIVENESS_EVERY_NS:
            self._stamped = now
            os.pwrite(self._fd, rf.reader_struct().pack(os.getpid(), 0, now), rf.READER_OFFSET)

    def _scratch_of(self, n: int) -> np.ndarray:
        if len(self._scratch) < n:
            self._scratch = np.empty(max(n, min(2 * len(self._scratch), self.capacity)), np.uint8)
        return self._scratch[:n]

    def check(self) -> None:
        """RingBroken if the file is no longer the size it was created with."""
        st = os.fstat(self._fd)
        if st.st_size != self.size:
            raise RingBroken(f"{self.path}: size changed from {self.size} to {st.st_size} bytes")

    # -- what the daemon asks --

    def info(self) -> RingInfo:
        head = os.pread(self._fd, rf.STATS_OFFSET + 8 * len(rf.STATS_FIELDS), 0)
        if len(head) < rf.STATS_OFFSET + 8 * len(rf.STATS_FIELDS):
            raise self._short(len(head), rf.STATS_OFFSET + 8 * len(rf.STATS_FIELDS), 0)
        stats = {name: int.from_bytes(head[rf.STATS_OFFSET + 8 * i : rf.STATS_OFFSET + 8 * i + 8], "little")
                 for i, name in enumerate(rf.STATS_FIELDS)}
        write = int.from_bytes(head[rf.WRITE_CURSOR_OFFSET : rf.WRITE_CURSOR_OFFSET + 8], "little")
        read = int.from_bytes(head[rf.READ_CURSOR_OFFSET : rf.READ_CURSOR_OFFSET + 8], "little")
        return RingInfo(self.path, self.rank, self.world_size, self.capacity, self.epoch, self.writer_pid,
                        write, read, stats, self.placement)

    def writer_alive(self) -> bool:
        try:
            os.kill(self.writer_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def replaced(self, dir_fd: int | None = None) -> bool:
        """True once the path names another file (the writer restarted), a link, or nothing."""
        try:
            if dir_fd is not None:
                st = os.stat(self.name, dir_fd=dir_fd, follow_symlinks=False)
            else:
                st = os.lstat(self.path)
        except OSError:  # gone, or its directory went with it
            return True
        return st.st_ino != self.inode or st.st_dev != self.dev or not stat.S_ISREG(st.st_mode)

    @property
    def read_cursor(self) -> int:
        """Everything below it was read (and returned by poll)."""
        return self._r

    def pending_bytes(self) -> int:
        return self.write_cursor() - self._r

    def set_waiting(self, on: bool) -> None:
        """Tell the writer we are about to block (it rings the doorbell at its next commit) or are
        awake (it does not). See ring_format.READER_WAITING_OFFSET for the protocol."""
        if self._writable:
            os.pwrite(self._fd, b"\x01\0\0\0\0\0\0\0" if on else bytes(8), rf.READER_WAITING_OFFSET)

    def has_new(self) -> bool:
        """Whether the writer committed past what this reader has consumed."""
        return self.write_cursor() != self._r

    def fileno(self) -> int:
        return self._fd

    # -- records --

    def _span(self) -> tuple[int, int] | None:
        """(read, write) cursors a poll reads between; None when there is nothing to read, or nothing
        that can be trusted (RingBroken when the file changed size)."""
        w = self.write_cursor()
        self.written = w
        self._stamp()
        r = self._r
        if w == r:
            return None
        if w < r or w - r > self.capacity or r % rf.ALIGN:
            # Cursors a writer never makes: nothing between them can be trusted to be a record.
            self._lose(r, w, f"write cursor {w} against read cursor {r} and capacity {self.capacity}")
            self._store_read_cursor(w)
            return None
        self.check()
        return r, w

    def poll(self, max_records: int = 1 << 30, max_bytes: int = 1 << 62) -> list[Record]:
        """Copy out committed records (up to the limits) and advance the persisted read cursor.

        Records that do not fit the schema are skipped and kept in `rejections` (each with its
        place among the records returned). RingBroken when the file changed under the reader (it
        must not be read any more)."""
        span = self._span()
        if span is None:
            return []
        r, w = span
        cap = self.capacity
        out: list[Record] = []
        start = r
        w_full = w
        w -= (w - r) % rf.ALIGN  # a writer's cursor is always aligned: read up to where it could be
        window = max(min(max_bytes, _WINDOW), rf.ALIGN)
        win = self._scratch
        win_lo = win_hi = r  # file bytes of cursors [win_lo, win_hi) are in `win`
        after_large = False
        while r < w and len(out) < max_records and r - start < max_bytes:
            at = r % cap
            if r + rf.RECORD_HEADER_SIZE > win_hi:  # a record header always fits before the end of the area
                # After a large record the next is likely large too: read little, its payload goes
                # straight into its arrays; among small records, read many at once.
                n = min(w - r, cap - at, _PREFIX if after_large else window)
                win = self._scratch_of(n)
                self._pread_into(win, rf.HEADER_SIZE + at)
                win_lo, win_hi = r, r + n
            o = r - win_lo
            magic, total = rf.PAD_HEADER.unpack_from(win, o)
            if total < rf.ALIGN or total % rf.ALIGN or total > cap - at or total > w - r:
                self._lose(r, w, f"bad record length {total}")
                r = w
                break
            if magic == rf.PAD_MAGIC:
                r += total
                continue
            if magic != rf.RECORD_MAGIC:
                self._lose(r, w, f"bad record magic {bytes(magic)!r}")
                r = w
                break
            n0 = len(out)
            try:
                self._at_cursor = r
                h = ring_schema.parse_header(win, o)
                after_large = self._last_large = h.kind == rf.RecordKind.DATA and total >= _DIRECT
                if after_large:
                    out.extend(self._read_data(at, h, win[o:win_hi - win_lo]))
                elif r + total <= win_hi:
                    out.extend(ring_schema.decode_record(win[o : o + total], ring=self.name, epoch=self.epoch,
                                                         table_cache=self._table_cache, destination=self.destination))
                else:  # larger than what is left of the window: read it whole
                    win = self._scratch_of(total)
                    self._pread_into(win, rf.HEADER_SIZE + at)
                    win_lo, win_hi = r, r + total
                    out.extend(ring_schema.decode_record(win, ring=self.name, epoch=self.epoch,
                                                         table_cache=self._table_cache, destination=self.destination))
            except ring_schema.Rejected as e:
                self._reject(r, e, len(out))
            for rec in out[n0:]:
                rec.cursor = r  # where it starts: a daemon may keep the ring's cursor there (RingPoller.commit)
            r += total
            if after_large and self.copier is not None:
                break  # one large record a poll: read_ahead copies the next while the caller handles it
        if r == w and w != w_full:
            self._lose(r, w_full, f"write cursor {w_full} is not on a record boundary")
            r = w_full
        self._store_read_cursor(r)
        return out

    def poll_raw(self, max_bytes: int, first_max: int = 0) -> list[bytes]:
        """Committed records as their bytes, undecoded (PADs skipped), at most `max_bytes` of them
        (a record that does not fit stays for a later poll; the first may be up to `first_max`, so
        one larger than the usual budget still goes), advancing the persisted read cursor: what a peer daemon
        forwards to the home daemon, which decodes them against the schema itself. RingBroken as poll."""
        span = self._span()
        if span is None:
            return []
        r, w = span
        cap = self.capacity
        out: list[bytes] = []
        got = 0
        head = bytearray(rf.RECORD_HEADER_SIZE)
        while r + rf.RECORD_HEADER_SIZE <= w and got < max(max_bytes, first_max if not out else 0):
            at = r % cap
            n = os.preadv(self._fd, [head], rf.HEADER_SIZE + at)
            if n != len(head):
                raise self._short(n, len(head), rf.HEADER_SIZE + at)
            magic, total = rf.PAD_HEADER.unpack_from(head, 0)
            if total < rf.ALIGN or total % rf.ALIGN or total > cap - at or total > w - r:
                self._lose(r, w, f"bad record length {total}")
                r = w
                break
            if magic == b"PAD\x00":
                r += total
                continue
            if magic != rf.RECORD_MAGIC or got + total > (max(max_bytes, first_max) if not out else max_bytes):
                if magic != rf.RECORD_MAGIC:
                    self._lose(r, w, f"bad record magic {bytes(magic)!r}")
                    r = w
                break
            rec = bytearray(total)
            n = os.preadv(self._fd, [rec], rf.HEADER_SIZE + at)
            if n != total:
                raise self._short(n, total, rf.HEADER_SIZE + at)
            out.append(bytes(rec))
            got += total
            r += total
        if w - r < rf.ALIGN and r != w:  # never a record: a cursor off the record boundaries
            self._lose(r, w, f"write cursor {w} is not on a record boundary")
            r = w
        self._store_read_cursor(r)
        return out

    def _layout(self, at: int, h: "ring_schema.Header", have: np.ndarray) -> "ring_schema.DataLayout | None":
        """A large DATA record's layout, from `have` (what was read of it) or a read of its prefix."""
        prefix_len = ring_schema.body_offsets(h)[4]
        if len(have) >= prefix_len:
            prefix = have[:prefix_len]
        else:
            prefix = np.empty(prefix_len, np.uint8)
            self._pread_into(prefix, rf.HEADER_SIZE + at)
        return ring_schema.data_layout(prefix, h, ring=self.name, epoch=self.epoch, table_cache=self._table_cache)

    def _read_data(self, at: int, h: "ring_schema.Header", have: np.ndarray) -> list[Record]:
        """A large DATA record: its layout from `have` (what was read of it) or a read of its own,
        its payload straight into where it lands (one copy, not two): by the copier (or taken from
        read_ahead), else by preadv."""
        layout = self._layout(at, h, have)
        if layout is None:
            return []
        ahead = self._take_ahead(self._at_cursor)
        if ahead is not None:
            return [ahead.done()]
        landing = land(layout, self.destination)
        base = rf.HEADER_SIZE + at
        try:
            if landing.block is not None:
                off = base + landing.lo
                if self.copier is None or not self.copier.copy(self, off, landing.block):
                    self._pread_split(landing.block, off)
            else:
                self._preadv([memoryview(p) for _, p in landing.pieces], base + landing.lo, landing.hi - landing.lo)
        except OSError as e:
            if e.errno != errno.EFAULT or not landing.placed:
                raise
            # The destination's memory could not take the read (the daemon's arena, its tmpfs full
            # under it): the reader's problem, not the ring's. Read it into private memory.
            self.destination_failures += 1
            self._say("ring %s: the record at offset %d could not be read into its delivery memory (%s); "
                      "read into private memory instead", self.path, at, e.strerror)
            landing = land(layout)
            self._preadv([memoryview(p) for _, p in landing.pieces], base + landing.lo, landing.hi - landing.lo)
        return [landing.done()]

    def read_ahead(self) -> None:
        """After a poll that ended on a large DATA record, with a copier: start copying the next
        committed record's payload (if it is a large one of whole tensors, one block), so the copy
        runs while the caller handles what poll returned. The record is not consumed: the next poll
        takes the block once the copy has landed. Never raises; whatever stands in the way (nothing
        committed, a PAD, a record that does not fit the schema) is left to poll."""
        if self.copier is None or self.destination is None or self._ahead is not None or not self._last_large:
            return
        try:
            r, w, cap = self._r, self.write_cursor(), self.capacity
            at = r % cap
            n = min(w - r, cap - at, _PREFIX)
            if n < rf.RECORD_HEADER_SIZE or w - r > cap:
                return
            head = np.empty(n, np.uint8)
            self._pread_into(head, rf.HEADER_SIZE + at)
            magic, total = rf.PAD_HEADER.unpack_from(head, 0)
            if magic != rf.RECORD_MAGIC or total < _DIRECT or total % rf.ALIGN or total > min(w - r, cap - at):
                return
            h = ring_schema.parse_header(head, 0)
            if h.kind != rf.RecordKind.DATA or ring_schema.body_offsets(h)[4] > total:
                return
            layout = self._layout(at, h, head)
            if layout is None or not layout.all_whole or not layout.contiguous:
                return  # captures' rows interleaved: its sections land in pieces, which poll reads with preadv
            landing = land(layout, self.destination)
            if not landing.placed or landing.block is None:  # per-capture arrays, not one block: poll reads it
                return
            token = self.copier.start(self, rf.HEADER_SIZE + at + landing.lo, landing.block)
            if token is not None:
                self._ahead = (r, landing, token)
                self.read_aheads += 1
        except (ring_schema.Rejected, RingBroken, OSError, ValueError):
            return

    def _take_ahead(self, cursor: int) -> Landing | None:
        """What read_ahead filled, if it is the record at `cursor`; a copy for anything else is
        waited for (its block may be freed only once nothing writes into it) and dropped."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        landed = self.copier.finish(ahead[2]) if self.copier is not None else False
        if landed and ahead[0] == cursor:
            self.read_aheads_taken += 1
            return ahead[1]
        return None

    def _reject(self, r: int, e: "ring_schema.Rejected", index: int) -> None:
        self.rejected += 1
        self.rejections.append(ring_schema.Rejection(self.name, self.epoch, r, e.why, e.request_ids, e.kind, index))
        self._say("ring %s: record at cursor %d rejected (%s)%s", self.path, r, e.why,
                  f"; ends request {', '.join(e.request_ids[:3])}" if e.request_ids else "")

    def _lose(self, r: int, w: int, why: str) -> None:
        self.corrupt += 1
        self._say("ring %s corrupt at cursor %d (%s): skipping %d bytes", self.path, r, why, w - r)

    def _say(self, fmt: str, *args: Any) -> None:
        """One line per event, the first few per ring; then one count a minute, so a flood of bad
        records cannot flood the journal."""
        now = time.monotonic()
        if self._logged < _LOG_FIRST:
            self._logged += 1
            log.error(fmt, *args)
            return
        self._unlogged += 1
        if now - self._log_at >= _LOG_EVERY_S:
            self._log_at = now
            log.error("ring %s: %d more rejected or corrupt records (rejected %d, corrupt %d in all)",
                      self.path, self._unlogged, self.rejected, self.corrupt)
            self._unlogged = 0

    def close(self) -> None:
        """Commit (the owner closes a ring once it accounted for what it read: a stop hands it over)
        and let go of the file."""
        if self.copier is not None:
            self._take_ahead(-1)
            self.copier.forget(self)
        if self._fd >= 0:
            try:
                self.commit()
            except OSError:
                pass
            os.close(self._fd)
            self._fd = -1


def read_info(path: str) -> RingInfo:
    """Header snapshot of a ring without consuming anything (for `vllm-tap status`)."""
    r = RingReader(path, writable=False, require_allocated=False)
    try:
        return r.info()
    finally:
        r.close()
