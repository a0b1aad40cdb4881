"""Single-producer / single-consumer record ring in a shared-memory file.

The writer lives in a serving process and must never wait for the reader: when a record does not
fit it is dropped, counted in the header, and reported per request through a DROP control record.
Control records queue in the writer until there is room, in a bounded backlog (records and bytes):
beyond it they are dropped and counted (`control_dropped`), so a stalled or absent reader never
grows the serving process's memory. Writers reserve space, fill the payload (possibly
asynchronously, by a device-to-host copy), then commit; commits publish in reservation order, so
the reader only ever sees whole records.

The writer must never fault the process it lives in:
  - a ring's whole size is reserved when it is created (posix_fallocate), so a full /dev/shm is a
    `RingSpaceError` at start-up, never a SIGBUS when a sparse page is first touched;
  - and its pages are mapped into the writer at creation (MADV_POPULATE_WRITE, else one store per
    page), so the step thread's first lap of the ring does not take a page fault every 4 KiB (copying
    1 MB into fresh pages ran at ~1 GB/s against ~8 GB/s into mapped ones);
  - before it stores, the writer checks that its file still has its size (one fstat at a step's
    first reservation, one at its commit, one per control record). A file someone truncated is
    abandoned: every later write is dropped and counted in the process (`lost()`), one error is
    logged, serving goes on. What no check in Python can close is a truncation between that fstat
    and the stores after it (microseconds; for a reservation, until its payload is filled and
    committed, a step): only file permissions keep other processes from truncating a ring (see
    the ring's mode and group).

Ordering: the writer stores payload bytes before the cursor, and the reader loads the cursor before
the payload. x86-64 keeps stores in order, which is where this runs; on weakly ordered CPUs the
numpy stores below would need explicit fences.

The reader (vllm_tap.ring_reader) persists its own cursor in the file; the paths, directory checks
and errors both ends share are in vllm_tap.ring_files.
"""

from __future__ import annotations

import collections
import errno
import grp
import logging
import mmap
import os
import struct
import threading
import time
from typing import Iterable

import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap.doorbell import DoorbellPush, doorbell_path
from vllm_tap.prefault import populate_write
from vllm_tap.ring_records import RequestRef, RequestTable, TensorId
from vllm_tap.ring_schema import ControlMeta, ShedMeta, drop_metas, encode_control
from vllm_tap.ring_files import RingSpaceError, ensure_dir, free_bytes

log = logging.getLogger(__name__)

# Hot-path lookups (reserve runs once per captured tensor per step): item sizes by dtype code and
# the positions of the writer statistics in the header.
_ITEMSIZE = {int(code): rf.storage_dtype(code).itemsize for code in rf.DType}
_RECORDS_WRITTEN = rf.STATS_FIELDS.index("records_written")
_BYTES_WRITTEN = rf.STATS_FIELDS.index("bytes_written")
_ROW_DTYPE = np.dtype("<i4")
# A DATA record's step number within its header, and the two writer counters every record bumps.
_STEP = struct.Struct("<Q")
_STEP_OFFSET = 32
_COUNTS = struct.Struct("<QQ")
assert (_RECORDS_WRITTEN, _BYTES_WRITTEN) == (0, 1)
_MAX_PREPARED = 256  # prepared record prefixes kept per writer
MAX_BACKLOG_RECORDS = 1 << 15  # control records queued while the ring is full, at most (default)
MAX_BACKLOG_BYTES = 8 << 20  # ... and their bytes


_PAGE_BYTES = mmap.PAGESIZE


def _prefault(mm: mmap.mmap) -> None:
    """Map every page of a new ring for writing now, at start-up, not on the step thread later."""
    if populate_write(mm):
        return
    # An older kernel: touch the pages (the file is fresh, all zeros).
    a = np.frombuffer(mm, np.uint8)
    a[::_PAGE_BYTES] = 0
    del a


class _Cursor:
    """One little-endian u64 in the header. An aligned 8-byte numpy store is a single move."""

    __slots__ = ("_a",)

    def __init__(self, buf: np.ndarray, offset: int):
        self._a = buf[offset : offset + 8].view("<u8")

    def get(self) -> int:
        return int(self._a[0])

    def set(self, v: int) -> None:
        self._a[0] = v


class PreparedRecord:
    """A DATA record's layout for one request table, row count and set of sections, worked out
    once (RingWriter.prepare_record) and reserved against step after step. Offsets are from the
    record's start."""

    __slots__ = ("sections", "prefix", "slots_off", "ids_off", "section_table", "section_table_off",
                 "offsets", "nbytes", "total")

    def __init__(self, sections: tuple, prefix: bytes, slots_off: int, ids_off: int, section_table: bytes,
                 section_table_off: int, offsets: tuple[int, ...], nbytes: tuple[int, ...], total: int):
        self.sections = sections
        self.prefix = prefix  # header (step 0), request table, padding: everything before the slots
        self.slots_off = slots_off
        self.ids_off = ids_off  # the int32 token ids
        self.section_table = section_table  # b"" for a record of one section
        self.section_table_off = section_table_off
        self.offsets = offsets  # each section's payload
        self.nbytes = nbytes  # each section's payload bytes
        self.total = total  # the record's length, padding included

    @property
    def data_end(self) -> int:
        """Just past the last section's payload."""
        return self.offsets[-1] + self.nbytes[-1]


class Reservation:
    """Space held in the ring for one record; fill its sections' payloads, then `RingWriter.commit` it.

    Offsets are within the whole file mapping. (A slotted class, not a dataclass: one is made per
    record per step.)"""

    __slots__ = ("start", "end", "record_offset", "prep", "done", "_buf")

    def __init__(self, start: int, end: int, record_offset: int, prep: PreparedRecord | None = None,
                 buf: np.ndarray | None = None):
        self.start = start  # cursor where this reservation begins (including any PAD before the record)
        self.end = end
        self.record_offset = record_offset  # byte offset of the record header within the file mapping
        self.prep = prep  # None for a control record
        self.done = False
        self._buf = buf

    @property
    def payload(self) -> np.ndarray:
        """uint8 view of section 0's payload bytes."""
        at = self.record_offset + self.prep.offsets[0]
        return self._buf[at : at + self.prep.nbytes[0]]

    @property
    def token_ids_offset(self) -> int:
        """Byte offset of the int32 token ids within the file mapping."""
        return self.record_offset + self.prep.ids_off

    @property
    def sections(self) -> list[tuple[int, int]]:
        """(payload offset within the file mapping, bytes) of each section."""
        at = self.record_offset
        return [(at + o, nb) for o, nb in zip(self.prep.offsets, self.prep.nbytes)]

    @property
    def data_end(self) -> int:
        """Offset within the mapping just past the last section's payload."""
        return self.record_offset + self.prep.data_end


class RingWriter:
    """The producer side. Thread-safe between one step thread and one publisher thread."""

    def __init__(
        self,
        path: str,
        capacity: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        mode: int = 0o600,
        group: str | None = None,
        block_timeout: float = 0.0,
        wake_daemon: bool = True,
        max_backlog_records: int = MAX_BACKLOG_RECORDS,
        max_backlog_bytes: int = MAX_BACKLOG_BYTES,
        placement: bytes = b"",
    ):
        if capacity < 4 * rf.ALIGN or capacity % rf.ALIGN:
            raise ValueError(f"ring capacity must be a multiple of {rf.ALIGN} and at least {4 * rf.ALIGN}")
        if len(placement) > rf.PLACEMENT_MAX:
            raise ValueError(f"a ring's placement holds at most {rf.PLACEMENT_MAX} bytes, got {len(placement)}")
        self.path = path
        self.capacity = capacity
        self.rank = rank
        self.block_timeout = block_timeout
        dirname = os.path.dirname(path)
        ensure_dir(dirname, 0o770 if group else 0o700, group)
        # Build the file beside its final name and rename it in: a reader never sees a half header,
        # and a restarted writer gets a new inode that the reader can tell from the old one.
        tmp = f"{path}.{os.getpid()}.tmp"
        self._size = rf.HEADER_SIZE + capacity
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            if group is not None:
                try:
                    os.fchown(fd, -1, grp.getgrnam(group).gr_gid)
                    os.fchmod(fd, mode | 0o060)
                except PermissionError:
                    log.warning("cannot give %s to group %s", path, group)
            try:
                # Every page now, not on first touch: a tmpfs that cannot back a page of a sparse
                # mapping kills the writer with SIGBUS, and nothing can catch that.
                os.posix_fallocate(fd, 0, self._size)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise
                raise RingSpaceError(dirname, self._size, free_bytes(dirname)) from None
            self._mm = mmap.mmap(fd, self._size)
            _prefault(self._mm)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        # Kept open: one fstat before each store tells whether someone truncated the file.
        self._fd = fd
        self._dead = False
        self._checked = False  # size checked since the last commit
        self._lost = {"records": 0, "control": 0}
        self._buf = np.frombuffer(self._mm, np.uint8)
        self._data = self._buf[rf.HEADER_SIZE :]
        self.epoch = time.time_ns()
        rf.ident_struct().pack_into(
            self._mm, rf.IDENT_OFFSET, rf.RING_MAGIC, rf.RING_FORMAT_VERSION, rf.HEADER_SIZE,
            capacity, self.epoch, os.getpid(), rank, world_size, 0,
        )
        rf.placement_len_struct().pack_into(self._mm, rf.PLACEMENT_OFFSET, len(placement))
        at = rf.PLACEMENT_OFFSET + 4
        self._mm[at : at + len(placement)] = placement
        os.rename(tmp, path)
        self._write = _Cursor(self._buf, rf.WRITE_CURSOR_OFFSET)
        self._read = _Cursor(self._buf, rf.READ_CURSOR_OFFSET)
        self._stats = {
            name: _Cursor(self._buf, rf.STATS_OFFSET + 8 * i) for i, name in enumerate(rf.STATS_FIELDS)
        }
        self._waiting = self._buf[rf.READER_WAITING_OFFSET : rf.READER_WAITING_OFFSET + 8].view("<u8")
        self._reserved = 0  # cursor just past the last reservation
        self._records_written = 0  # mirrors of the header's counters (only reserve_rows bumps them)
        self._bytes_written = 0
        self._prepared: dict[tuple, tuple] = {}
        self._pending: collections.deque[Reservation] = collections.deque()
        self._lock = threading.Lock()
        # Control records (BEGIN/END/DROP) wait here when the ring is full, in order, packed:
        # (kind, key section, msgpack meta). Bounded by count and by bytes.
        self._backlog: collections.deque[tuple[rf.RecordKind, bytes, bytes]] = collections.deque()
        self._backlog_bytes = 0
        self.max_backlog_records = max_backlog_records
        self.max_backlog_bytes = max_backlog_bytes
        # Rings live in <shm_dir>/<instance>/; the daemon's doorbell is in <shm_dir>.
        self._doorbell = DoorbellPush(doorbell_path(os.path.dirname(dirname))) if wake_daemon else None

    # The whole mapping, for frameworks that want to view the ring as one host tensor.
    @property
    def buffer(self) -> mmap.mmap:
        return self._mm

    def stats(self) -> dict[str, int]:
        # Checked first: reading the header of a file truncated under us would fault (SIGBUS).
        with self._lock:
            if self._fd >= 0:
                self._usable()  # marks the ring dead (and keeps what its header said) if it lost its size
            if self._dead:
                return dict(self._stats_at_death)
            return {k: c.get() for k, c in self._stats.items()}

    def lost(self) -> dict[str, int]:
        """What was dropped after the ring was abandoned (its header can no longer count it):
        DATA records and control records."""
        return dict(self._lost)

    @property
    def abandoned(self) -> bool:
        return self._dead

    def backlog_records(self) -> int:
        return len(self._backlog)

    def backlog_bytes(self) -> int:
        return self._backlog_bytes

    def _usable(self) -> bool:
        """False once the file lost its size (callers hold the lock, or run before any store)."""
        if self._dead or self._fd < 0:
            return False
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            size = -1
        if size == self._size:
            return True
        self._dead = True
        # The header can be read while the file still covers it; else reading would fault too.
        self._stats_at_death = ({k: c.get() for k, c in self._stats.items()} if size >= rf.HEADER_SIZE
                                else {k: 0 for k in rf.STATS_FIELDS})
        self._lost["control"] += len(self._backlog)
        self._backlog.clear()
        self._backlog_bytes = 0
        self._pending.clear()
        log.error("vllm-tap: ring %s changed size under its writer (%d bytes, expected %d): it is abandoned, "
                  "captures through it are dropped from now on; restart vLLM to get a new ring "
                  "(and check who can write to %s)", self.path, size, self._size, os.path.dirname(self.path))
        return False

    def _bump(self, name: str, by: int = 1) -> None:
        c = self._stats[name]
        c.set(c.get() + by)

    # -- space management (callers hold the lock) --

    def _try_reserve(self, total: int) -> tuple[int, int] | None:
        """Returns (reservation start, record start cursor) or None when it does not fit now."""
        cap = self.capacity
        if total > cap:
            return None
        w = self._reserved
        tail = cap - (w % cap)
        need = total if total <= tail else tail + total
        if need > cap - (w - self._read.get()):
            return None
        start = w
        if total > tail:
            rf.pack_pad(self._data, w % cap, tail)
            w += tail
        self._reserved = w + total
        return start, w

    def _reserve_data(self, total: int) -> tuple[int, int] | None:
        """Room for a DATA record, behind every queued control record: one that stays queued (a
        DROP of an earlier step) is never overtaken, because the reader takes a position missing
        below data it has read as never computed; read after that data, the DROP would come too
        late and its positions would be reported "not captured" instead of "dropped"."""
        if self._backlog and not self._flush_backlog():
            return None
        return self._try_reserve(total)

    def _reserve_blocking(self, total: int) -> tuple[int, int] | None:
        got = self._reserve_data(total)
        if got is not None or self.block_timeout <= 0 or total > self.capacity:
            return got
        deadline = time.monotonic() + self.block_timeout
        while time.monotonic() < deadline:
            self._lock.release()
            try:
                time.sleep(0.0002)
            finally:
                self._lock.acquire()
            got = self._reserve_data(total)
            if got is not None:
                return got
        return None

    def _publish(self) -> None:
        pending = self._pending
        end = -1
        while pending and pending[0].done:
            end = pending.popleft().end
        if end >= 0:  # one cursor store for all of them: what was done before it is published with it
            self._write.set(end)
            self._stats["last_write_ns"].set(time.time_ns())

    def _encode_header(
        self, at: int, total: int, kind: rf.RecordKind, key: bytes, meta: bytes, n_rows: int,
        payload_off: int, *, tensor: TensorId | None = None, dtype: int = 0, step: int = 0,
        n_requests: int = 0, slice_: tuple[int, int] = (0, 0), full_dim: int = 0,
    ) -> None:
        rf.pack_record_header(
            self._data, at, total=total, kind=kind, rank=self.rank, payload_off=payload_off,
            tensor=tensor.kind if tensor else 0, dtype=dtype, layer=tensor.layer if tensor else -1, n_rows=n_rows,
            n_requests=n_requests, key_len=len(key), meta_len=len(meta), step=step, slice_start=slice_[0],
            slice_stop=slice_[1], full_dim=full_dim,
        )
        # Byte strings go in through the mapping itself: a slice store, no numpy wrapper per call.
        base = rf.HEADER_SIZE + at + rf.RECORD_HEADER_SIZE
        if key:
            self._mm[base : base + len(key)] = key
        if meta:
            self._mm[base + len(key) : base + len(key) + len(meta)] = meta

    # -- control records --

    def _write_control_now(self, kind: rf.RecordKind, key: bytes, mb: bytes) -> bool:
        *_, payload_off = rf.body_layout(len(key), len(mb), 0)
        total = rf.align_up(payload_off)
        got = self._try_reserve(total)
        if got is None:
            return False
        start, at = got
        self._encode_header(at % self.capacity, total, kind, key, mb, 0, payload_off)
        res = Reservation(start, at + total, rf.HEADER_SIZE + at % self.capacity)
        res.done = True
        self._pending.append(res)
        return True

    def _flush_backlog(self) -> bool:
        backlog = self._backlog
        while backlog:
            entry = backlog[0]
            if not self._write_control_now(*entry):
                self._stats["control_backlog"].set(len(backlog))
                self._publish()
                return False
            backlog.popleft()
            self._backlog_bytes -= len(entry[1]) + len(entry[2])
        self._stats["control_backlog"].set(0)
        self._publish()
        return True

    def _enqueue(self, request_id: str, tap_key: str, meta: ControlMeta) -> bool:
        """Queue one control record behind the others; False (dropped and counted) when the
        backlog is at its bound. Callers hold the lock."""
        if len(self._backlog) >= self.max_backlog_records:
            self._bump("control_dropped")
            return False
        key = rf.control_key(request_id, tap_key)
        kind, mb = encode_control(meta)
        size = len(key) + len(mb)
        if self._backlog and self._backlog_bytes + size > self.max_backlog_bytes:
            self._bump("control_dropped")
            return False
        if rf.align_up(rf.body_layout(len(key), len(mb), 0)[-1]) > self.capacity:
            # It would never fit, and would hold back every control record queued after it.
            self._bump("control_dropped")
            log.warning("vllm-tap: a %s record of %d bytes for %s does not fit ring %s at all: dropped",
                        kind.name, size, request_id, self.path)
            return False
        self._backlog.append((kind, key, mb))
        self._backlog_bytes += size
        return True

    def write_control(self, request_id: str, meta: ControlMeta, tap_key: str = "") -> bool:
        """Queue a control record (its kind is its meta's type: BeginMeta, EndMeta, DropMeta, ...); it
        is written now if there is room, else on a later call. False when it was dropped: the backlog
        was full (counted) or the ring abandoned."""
        with self._lock:
            if not self._usable():
                self._lost["control"] += 1
                return False
            queued = self._enqueue(request_id, tap_key, meta)
            self._flush_backlog()
        self._wake()
        return queued

    def write_control_if_room(self, request_id: str, meta: ControlMeta, tap_key: str = "") -> bool:
        """Write a control record now or not at all (periodic records like LIVE, which the next
        one supersedes): never queued, and never ahead of records still queued."""
        with self._lock:
            if not self._usable() or not self._flush_backlog():
                return False
            kind, mb = encode_control(meta)
            ok = self._write_control_now(kind, rf.control_key(request_id, tap_key), mb)
            if ok:
                self._publish()
        if ok:
            self._wake()
        return ok

    def unread_bytes(self) -> int:
        """Bytes reserved in the ring that its reader has not consumed yet: how far the reader lags
        this writer (0 once the ring is abandoned: its header may no longer be there to read)."""
        with self._lock:
            if not self._usable():
                return 0
            return self._reserved - self._read.get()

    def write_shed(self, request_id: str, meta: ShedMeta, tap_key: str = "") -> bool:
        """A SHED record (queued like any control record) and the captures_shed count."""
        with self._lock:
            if self._usable():
                self._bump("captures_shed")
        return self.write_control(request_id, meta, tap_key=tap_key)

    def flush(self) -> bool:
        """Retry queued control records; True when none are left waiting."""
        if not self._backlog:
            return True
        with self._lock:
            done = self._usable() and self._flush_backlog()
            if not self._backlog:
                done = True
        self._wake()
        return done

    @property
    def reader_waiting(self) -> bool:
        """Whether the reader said it is about to block (and has not woken since)."""
        return bool(self._waiting[0])

    def _wake(self) -> None:
        # Called after the lock that published the cursor was released: that release is the barrier
        # between the cursor store and this load (ring_format.READER_WAITING_OFFSET).
        if self._doorbell is not None and self._waiting[0]:
            self._waiting[0] = 0  # one ring per sleep; the reader sets it again before it next blocks
            self._doorbell.ring()

    # -- data records --

    def reserve(
        self, request_id: str, tensor: TensorId, positions: Iterable[int] | np.ndarray,
        token_ids: Iterable[int] | np.ndarray | None, *, dtype: int, width: int, step: int = 0,
        tap_key: str = "", slice_: tuple[int, int] | None = None, full_dim: int | None = None,
        num_prompt_tokens: int = 0, expected_ranks: int = 1, rank_parts: int = 1,
    ) -> Reservation | None:
        """Hold room for one request's [len(positions), width] slice; None (and counted as dropped) if full.

        token_ids=None leaves them for the caller to fill before commit (at token_ids_offset),
        e.g. by a device copy when the ids only exist on the accelerator.
        """
        part = (tensor, dtype, width, slice_ if slice_ is not None else (0, width),
                full_dim if full_dim is not None else width)
        return self.reserve_many(request_id, positions, token_ids, [part], step=step, tap_key=tap_key,
                                 num_prompt_tokens=num_prompt_tokens, expected_ranks=expected_ranks,
                                 rank_parts=rank_parts)[0]

    def reserve_many(
        self, request_id: str, positions: Iterable[int] | np.ndarray, token_ids: Iterable[int] | np.ndarray | None,
        parts: list[tuple[TensorId, int, int, tuple[int, int], int]], *, step: int = 0, tap_key: str = "",
        num_prompt_tokens: int = 0, expected_ranks: int = 1, rank_parts: int | None = None,
    ) -> list[Reservation | None]:
        """`reserve` for several tensors at the same positions of one request, in order.

        parts: (tensor, dtype code, width, (slice start, stop), full_dim) per record; rank_parts
        defaults to len(parts).
        """
        pos = np.ascontiguousarray(positions, dtype="<i4")
        table = RequestTable([RequestRef(request_id, tap_key, num_prompt_tokens, expected_ranks,
                                         len(parts) if rank_parts is None else rank_parts)])
        rows = np.zeros((3, len(pos)), "<i4")
        rows[1] = pos
        if token_ids is not None:
            rows[2] = np.asarray(token_ids)
        return [self.reserve_rows(table, rows, tensor, dtype=dtype, width=width, slice_=slice_,
                                  full_dim=full_dim, step=step)
                for tensor, dtype, width, slice_, full_dim in parts]

    def reserve_rows(
        self, table: RequestTable, rows: np.ndarray, tensor: TensorId, *, dtype: int, width: int,
        slice_: tuple[int, int] | None = None, full_dim: int | None = None, step: int = 0,
    ) -> Reservation | None:
        """Hold room for one step's rows of one tensor: `reserve_sections` with one section."""
        return self.reserve_sections(
            table, rows, ((tensor, dtype, width, slice_ if slice_ is not None else (0, width),
                           full_dim if full_dim is not None else width),), step=step)

    def reserve_sections(self, table: RequestTable, rows: np.ndarray, sections: tuple, *, step: int = 0
                         ) -> Reservation | None:
        """Hold room for one step's rows of one or more tensors, for the requests of `table`.

        rows: C-contiguous int32 [3, n]: per row its table entry (slot), its position and its token
        id; the ids may be left for the caller to fill before commit (at token_ids_offset), e.g. by a
        device copy when they only exist on the accelerator. A request's rows must be in position
        order among themselves. sections: a tuple of (tensor id, dtype code, width, (slice start,
        stop), full dim), each a payload [n, width] of the same rows, in this order.
        None when it does not fit: counted as dropped and reported by one DROP record per request
        and section that had rows in it.
        """
        if rows.dtype != _ROW_DTYPE or rows.ndim != 2 or rows.shape[0] != 3 or not rows.flags.c_contiguous:
            raise ValueError("rows must be a C-contiguous int32 array of shape [3, n]")
        return self.reserve_prepared(self.prepare_record(table, rows.shape[1], sections), table, rows, step)

    def prepare_record(self, table: RequestTable, n: int, sections: tuple) -> PreparedRecord:
        """The layout of a DATA record of `n` rows for `table`'s requests with these sections. The
        header, request table and section table are the same from step to step while the batch is
        (only the step number differs): packed once, kept for the recent batches."""
        key = (table.blob, n, sections)
        prep = self._prepared.get(key)
        if prep is None:
            prep = self._prepare(key, len(table))
        return prep

    def reserve_prepared(self, prep: PreparedRecord, table: RequestTable, rows: np.ndarray, step: int
                        ) -> Reservation | None:
        """`reserve_sections` for a record prepared before (`prepare_record` with this table, rows'
        count and sections): what a decode step of an unchanged batch does, with nothing to work
        out. rows as for reserve_sections (not checked again)."""
        with self._lock:
            # Checked at the first reservation after a commit (a step's first record) and at the
            # commit: one fstat each, not one per record.
            if self._dead or (not self._checked and not self._usable()):
                self._lost["records"] += 1
                return None
            self._checked = True
            total = prep.total
            # The usual case inline (nothing queued, no blocking): _try_reserve's check, then its
            # two stores.
            w = self._reserved
            cap = self.capacity
            pos = w % cap
            if (not self._backlog and self.block_timeout <= 0 and pos + total <= cap
                    and total <= cap - (w - int(self._read._a[0]))):
                got = (w, w)
                self._reserved = w + total
            else:
                got = self._reserve_blocking(total)
            if got is None:
                for sec in prep.sections:
                    self._drop(table, rows[0], rows[1], sec[0], total)
                self._checked = False  # no commit may follow: check again at the next record
                return None
            start, at = got
            rel = at % self.capacity
            mm = self._mm
            base = rf.HEADER_SIZE + rel
            slots_off = prep.slots_off
            mm[base : base + slots_off] = prep.prefix
            _STEP.pack_into(mm, base + _STEP_OFFSET, step)
            n = rows.shape[1]
            sec_table = prep.section_table
            if sec_table:
                mm[base + slots_off : base + slots_off + 8 * n] = rows[:2]
                sec_off = prep.section_table_off
                mm[base + sec_off : base + sec_off + len(sec_table)] = sec_table
                ids_off = prep.ids_off
                mm[base + ids_off : base + ids_off + 4 * n] = rows[2]
            else:  # slots, positions and ids lie together: one store
                mm[base + slots_off : base + slots_off + 12 * n] = rows
            self._records_written += 1
            self._bytes_written += total
            _COUNTS.pack_into(mm, rf.STATS_OFFSET, self._records_written, self._bytes_written)
            res = Reservation(start, at + total, base, prep, self._buf)
            self._pending.append(res)
            return res

    def _prepare(self, key: tuple, n_requests: int) -> PreparedRecord:
        """A DATA record prepared: its prefix (header with step 0, request table, padding), its
        section table and its offsets."""
        meta, n, sections = key
        if n_requests > rf.MAX_REQUESTS_PER_RECORD:
            raise ValueError(f"a record holds at most {rf.MAX_REQUESTS_PER_RECORD} requests")
        if not 1 <= len(sections) <= rf.MAX_SECTIONS:
            raise ValueError(f"a record holds 1..{rf.MAX_SECTIONS} sections")
        k = len(sections)
        nbytes = []
        for sec in sections:  # (tensor, dtype code, width, slice, full dim[, anything the caller keeps])
            dtype, width = sec[1], sec[2]
            itemsize = _ITEMSIZE.get(dtype) or rf.storage_dtype(dtype).itemsize  # the latter raises on a bad code
            nbytes.append(n * width * itemsize)
        _, slots_off, pos_off, ids_off, payload_off = rf.body_layout(0, len(meta), n, k)
        offsets, total = rf.section_offsets(payload_off, nbytes)
        tensor, dtype, width, sl, full_dim = sections[0][:5]
        head = bytearray(rf.RECORD_HEADER_SIZE)
        rf.pack_record_header(
            head, 0, total=total, kind=rf.RecordKind.DATA, rank=self.rank, payload_off=payload_off, tensor=tensor.kind,
            dtype=dtype, layer=tensor.layer, n_rows=n, n_requests=n_requests, n_sections=k if k > 1 else 0,
            meta_len=len(meta), slice_start=sl[0], slice_stop=sl[1], full_dim=full_dim)
        prefix = bytes(head) + meta
        prefix = prefix.ljust(slots_off, b"\0")
        sec_table = b"".join(rf.SECTION.pack(sec[0].kind, sec[1], sec[0].layer, 0, *sec[3], sec[4], o)
                             for sec, o in zip(sections, offsets)) if k > 1 else b""
        if len(self._prepared) >= _MAX_PREPARED:  # batches come and go: keep the recent ones
            self._prepared.clear()
        prep = self._prepared[key] = PreparedRecord(sections, prefix, slots_off, ids_off, sec_table, pos_off + 4 * n,
                                                tuple(offsets), tuple(nbytes), total)
        return prep

    def drop_rows(self, table: RequestTable, rows: np.ndarray, tensor: TensorId, nbytes: int) -> None:
        """A record the caller could not write (its own buffers were full): counted with the ring's
        drops and reported like them, by one DROP record per request in it."""
        with self._lock:
            if not self._usable():
                self._lost["records"] += 1
                return
            self._drop(table, rows[0], rows[1], tensor, nbytes)
            self._flush_backlog()
        self._wake()

    def _drop(self, table: RequestTable, slots: np.ndarray, positions: np.ndarray, tensor: TensorId, total: int) -> None:
        self._bump("records_dropped")
        self._bump("bytes_dropped", total)
        for ref, meta in drop_metas(table, slots, positions, tensor):
            self._enqueue(ref.request_id, ref.tap_key, meta)
        self._stats["control_backlog"].set(len(self._backlog))

    def commit(self, res: Reservation) -> None:
        self.commit_many((res,))

    def commit_many(self, reservations: Iterable[Reservation]) -> None:
        """Commit several reservations at once (one lock, one publish): a step's records."""
        with self._lock:
            self._checked = False
            if not self._usable():
                return  # their payloads were written before the check: nothing more to store
            for res in reservations:
                res.done = True
            self._publish()
        self._wake()

    def write(self, request_id: str, tensor: TensorId, positions, token_ids, data: np.ndarray, **kw) -> bool:
        """Reserve, copy `data` ([n, width]) in, commit. False when the record was dropped."""
        data = np.ascontiguousarray(data)
        if data.ndim != 2 or data.shape[0] != len(positions):
            raise ValueError(f"data must be [n_positions, width], got {data.shape}")
        if "dtype" not in kw:  # not setdefault: bf16 arrives as uint16, which has no code of its own
            kw["dtype"] = rf.dtype_code(data.dtype)
        res = self.reserve(request_id, tensor, positions, token_ids, width=data.shape[1], **kw)
        if res is None:
            return False
        res.payload[:] = data.reshape(-1).view(np.uint8)
        self.commit(res)
        return True

    def close(self, unlink: bool = False) -> None:
        if self._doorbell is not None:
            self._doorbell.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._buf = self._data = self._waiting = None  # type: ignore[assignment]
        self._write = self._read = None  # type: ignore[assignment]
        self._stats = {}
        try:
            self._mm.close()
        except BufferError:
            pass  # a framework still holds a view; the mapping goes when it does
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

