"""The daemon's delivery arena: shared memory that holds the arrays it delivers (layout: vllm_tap.arena_format).

Rules this module keeps:
- One file per daemon run, `<arena_dir>/.arena-<arena_id>`, created O_EXCL | O_NOFOLLOW with mode
  0640 (set again with fchmod, whatever the umask) in the subscribers' group (socket_group; the
  daemon's own group without one): the daemon's user writes it, that group may map it read-only,
  nobody else can open it. The directory is the daemon's own (daemon/access.prepare_arena_dir):
  not the shm directory, which subscribers may not enter. Files of earlier runs whose daemon is
  dead are removed at start; our own is removed at stop (clients that mapped it keep their mapping).
- The daemon never faults on it: tmpfs pages are reserved with posix_fallocate, COMMIT_CHUNK at a
  time, and mapped into the daemon (MADV_POPULATE_WRITE) before a region in them is handed out;
  a chunk counts as committed only once all of it is reserved (reserve what you count: /dev/shm
  is world-writable and may fill at any moment). When
  /dev/shm is full, or the arena is, `alloc` returns None and the caller keeps the array on its heap
  (delivered as frames): slower, never lost. Should a region still fail to take a read (EFAULT),
  that is the daemon's own memory: the ring reader reads the record privately and `write_failed`
  counts it; the ring is never blamed.
- A freed region's values do not outlive it (the file must not keep the values of a capture the
  daemon let go: evicted, or finished and no longer pinned): they are overwritten whole by the
  record that next takes the region, or zeroed: at once when the daemon is idle, and under load
  once they have been free for ZERO_WITHIN_S (`sweep`). Zeroing at every free cost a pass over
  memory per GB ingested (a seventh of the daemon's time with full logits), and under load a freed
  region is taken again within milliseconds. A region handed out for anything but a whole overwrite
  has its stale blocks zeroed first, so every array the arena hands out reads as zeros until
  written, as fresh tmpfs pages do. A region that holds
  a whole ring record (several captures' rows, ring_records.DataRecord), or a run of decode steps
  (daemon/step_runs), is freed when the last of them goes.
- Regions are freed by the garbage collector: each region's arrays keep a small owner object
  alive, whose finalizer returns the region and bumps its generation. So every holder in the
  daemon (reassembly, the store's history, watch cursors, a frame zmq has not sent yet) pins what
  it references, exactly as with heap arrays, and nothing a subscriber does can pin anything: a
  subscriber that dies or stalls holds nothing up; it notices by the generation that a region it
  was told about went away (see arena_format).
- The allocator is a buddy heap over BLOCK-sized units: a request takes a block of BLOCK * 2**k
  bytes at a multiple of its size and gives the tail it does not need straight back (as aligned
  buddies), so a region wastes less than one BLOCK; freed buddies merge, so a change of record
  sizes does not strand space.
  A request takes the lowest free region of the smallest size that has one, so the footprint
  stays at the bottom of the arena: the same pages are reused, already reserved and mapped, and
  the daemon pays for fresh tmpfs pages (reserve, zero, fault: slower than the copy itself) only
  when it really holds more. Buddies are merged only when a request finds no free region big enough.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import heapq
import logging
import mmap
import os
import secrets
import stat
import time
from typing import Any

import numpy as np

from vllm_tap import arena_format as af
from vllm_tap.prefault import populate_write

log = logging.getLogger(__name__)

COMMIT_CHUNK = 16 << 20  # tmpfs reserved this much at a time, as the heap first reaches it
MAX_TOP = 1 << 30  # the largest region; a bigger array stays on the heap
ZERO_WITHIN_S = 1.0  # under load, a freed region not taken again is zeroed after this long
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _sizing(capacity: int) -> tuple[int, int]:
    """(top order, capacity) of an arena asked for `capacity` bytes: its largest region is up to
    MAX_TOP, and the capacity a whole number of those."""
    top_order = 0
    want = max(af.BLOCK, min(capacity, MAX_TOP))
    while (af.BLOCK << top_order) < want:
        top_order += 1
    top = af.BLOCK << top_order
    return top_order, (max(capacity, af.BLOCK) + top - 1) // top * top


def create_private_file(dir_fd: int, name: str, mode: int, gid: int | None = None) -> int:
    """A new regular file `name` under an opened directory, readable as `mode` allows and no more:
    O_EXCL (never someone else's file or link), O_NOFOLLOW, in group `gid` if given, then fchmod
    (the umask cannot widen or narrow it unexpectedly). Returns the read-write descriptor."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode & 0o600, dir_fd=dir_fd)
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        os.unlink(name, dir_fd=dir_fd)
        raise
    return fd


class _Region:
    """Base of the per-size ctypes array types whose instances own one region (see _region_type)."""


_TYPES: dict[int, type] = {}


def _region_type(nbytes: int) -> type:
    t = _TYPES.get(nbytes)
    if t is None:
        def __del__(self: Any) -> None:
            a = self._arena
            if a is not None:
                a._free(self._off, self._blocks)

        t = _TYPES[nbytes] = type(f"_Region{nbytes}", (ctypes.c_char * nbytes, _Region), {"__del__": __del__})
    return t


def _owner(arr: np.ndarray) -> Any:
    b = arr.base
    while isinstance(b, np.ndarray):
        b = b.base
    return b


class Arena:
    """Create with Arena.create(directory, capacity); alloc(shape, dtype) hands out arrays in it."""

    def __init__(self, path: str, dir_fd: int, name: str, fd: int, mm: mmap.mmap, arena_id: int, capacity: int,
                 top_order: int):
        self.path = path
        self.arena_id = arena_id
        self.capacity = capacity
        self._dir_fd = dir_fd
        self._name = name
        self._fd = fd
        self._mm = mm
        n_blocks, gen_off, data_off, size = af.layout(capacity)
        self.n_blocks = n_blocks
        self.data_offset = data_off
        self.file_size = size
        self._gens = np.frombuffer(mm, "<u8", count=n_blocks, offset=gen_off)
        self._data_addr = np.frombuffer(mm, np.uint8, count=1, offset=data_off).ctypes.data
        self._top = top_order
        # Free regions per order (BLOCK * 2**order bytes), offsets in BLOCK units: a set, and a
        # min-heap of the same offsets for the lowest one (entries no longer in the set are stale,
        # dropped when they reach the top).
        self._free_at: list[set[int]] = [set() for _ in range(top_order + 1)]
        self._heap_at: list[list[int]] = [[] for _ in range(top_order + 1)]
        top_blocks = 1 << top_order
        for b in range(0, n_blocks, top_blocks):
            self._add_free(top_order, b)
        self._committed = bytearray((size + COMMIT_CHUNK - 1) // COMMIT_CHUNK)
        # Blocks freed and neither zeroed nor taken again (a set bit is always a free block), and
        # when each freed region went, oldest first, for `sweep`.
        self._dirty = np.zeros(n_blocks, np.bool_)
        self._freed: collections.deque[tuple[float, int, int]] = collections.deque()
        self.unzeroed_bytes = 0
        self.zeroed_bytes = 0
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.regions = 0
        self.allocations = 0
        self.fallbacks = 0  # arrays kept on the heap because the arena (or /dev/shm) was full
        self.write_failures = 0  # of those: regions handed out that could not be written (write_failed)
        self.committed_bytes = 0
        self._closed = False
        self._warned = False
        self.remove_dir = False  # close() removes the directory too (the daemon made it for this run)
        self._adopting: dict[int, Any] | None = None  # regions adopted from an earlier run, until end_adoption()
        self._claimed: np.ndarray | None = None
        self._kept = False  # closed for the next daemon to adopt: nothing is freed into it any more

    # -- life --

    @classmethod
    def create(cls, directory: str, capacity: int, gid: int | None = None) -> "Arena":
        """OSError when the directory cannot hold it. `gid`: the group that may map it (subscribers)."""
        top_order, capacity = _sizing(capacity)
        dir_fd = os.open(directory, _DIR_FLAGS)
        try:
            remove_stale(dir_fd, directory)
            arena_id = secrets.randbits(63) | 1
            name = af.arena_name(arena_id)
            fd = create_private_file(dir_fd, name, af.FILE_MODE, gid)
        except BaseException:
            os.close(dir_fd)
            raise
        try:
            n_blocks, gen_off, data_off, size = af.layout(capacity)
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, data_off)  # header and generation table, touched at once
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            af.HEADER.pack_into(mm, 0, af.ARENA_MAGIC, af.ARENA_FORMAT_VERSION, af.HEADER_SIZE, arena_id, capacity,
                                af.BLOCK, 0, n_blocks, gen_off, data_off, os.getpid(), time.time_ns())
        except BaseException:
            os.close(fd)
            os.unlink(name, dir_fd=dir_fd)
            os.close(dir_fd)
            raise
        a = cls(os.path.join(directory, name), dir_fd, name, fd, mm, arena_id, capacity, top_order)
        a._mark_committed(0, data_off)
        log.info("delivery arena %s: %d MiB (regions up to %d MiB)", a.path, capacity >> 20, (af.BLOCK << top_order) >> 20)
        return a

    @classmethod
    def reopen(cls, directory: str, arena_id: int, capacity: int, gid: int | None = None) -> "Arena | None":
        """The arena a previous daemon run left in `directory` (its journal names it), for adoption
        (daemon/adoption.py); None, with one line of log, when it is gone or unfit: not a regular file
        of ours, writable by others, another size than `capacity` asks for, a header that does not
        match its layout, or its daemon still running. Then adopt_region() for each region to keep,
        and end_adoption() before the first alloc()."""
        top_order, capacity = _sizing(capacity)
        name = af.arena_name(arena_id)
        dir_fd = os.open(directory, _DIR_FLAGS)
        fd = -1
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
            st = os.fstat(fd)
            n_blocks, gen_off, data_off, size = af.layout(capacity)
            head = os.pread(fd, af.HEADER.size, 0)
            fields = af.HEADER.unpack(head) if len(head) == af.HEADER.size else None
            why = _unfit(st, fields, arena_id, capacity, size)
            if why:
                log.warning("the arena %s/%s of an earlier daemon run is not adopted: %s", directory, name, why)
                os.close(fd)
                os.close(dir_fd)
                return None
            if gid is not None and st.st_gid != gid:
                os.fchown(fd, -1, gid)
            os.fchmod(fd, af.FILE_MODE)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            os.close(dir_fd)
            if e.errno != errno.ENOENT:
                log.warning("the arena %s/%s of an earlier daemon run is not adopted: %s", directory, name,
                            e.strerror or e)
            return None
        a = cls(os.path.join(directory, name), dir_fd, name, fd, mm, arena_id, capacity, top_order)
        af.PID.pack_into(mm, af.HEADER_PID_OFFSET, os.getpid())  # ours now: a later start must not take it for stale
        for k in range(top_order + 1):  # nothing is free until end_adoption() says what is
            a._free_at[k].clear()
            a._heap_at[k].clear()
        a._adopting = {}
        a._claimed = np.zeros(a.n_blocks, np.bool_)  # the blocks adopted regions hold
        a._mark_committed(0, data_off)
        return a

    def adopt_region(self, block: int, blocks: int, gen: int) -> Any:
        """The region a journal names (its first block, size in blocks, generation), as alloc() would
        have handed it out; None when it is out of bounds, overlaps another adopted region, or its
        generation moved on (it was freed after the journal named it)."""
        adopting = self._adopting
        if adopting is None:
            raise RuntimeError("adopt_region() after end_adoption()")
        have = adopting.get(block)
        if have is not None:
            return have if have._blocks == blocks and have._gen == gen else None
        if not (0 <= block and 1 <= blocks and block + blocks <= self.n_blocks and blocks <= (1 << self._top)):
            return None
        if int(self._gens[block]) != gen:
            return None
        claimed = self._claimed
        if claimed[block:block + blocks].any():
            return None  # overlaps another adopted region
        claimed[block:block + blocks] = True
        size = blocks * af.BLOCK
        region = _region_type(size).from_buffer(self._mm, self.data_offset + block * af.BLOCK)
        region._arena = self
        region._off = block
        region._blocks = blocks
        region._gen = gen
        adopting[block] = region
        self.allocated_bytes += size
        self.regions += 1
        return region

    def end_adoption(self) -> int:
        """Everything no adopted region holds is free (its values zeroed by `sweep`, its generation
        moved on so no earlier descriptor of it still matches). Returns the regions adopted."""
        adopting, self._adopting = self._adopting or {}, None
        self._claimed = None
        held = sorted((r._off, r._off + r._blocks) for r in adopting.values())
        at = 0
        # The rest goes back to tmpfs (a hole reads as zeros and holds no memory): zeroing it would
        # touch, and so allocate, every page of an arena the earlier run may never have used. Its
        # chunks are reserved again, as at creation, before a region in them is handed out.
        self._committed[:] = bytes(len(self._committed))
        self.committed_bytes = 0
        self._mark_committed(0, self.data_offset)
        for lo, hi in held + [(self.n_blocks, self.n_blocks)]:
            if lo > at:
                self._gens[at:lo] += 1
                if not _punch(self._fd, self.data_offset + at * af.BLOCK, (lo - at) * af.BLOCK):
                    self._dirty[at:lo] = True  # no hole punched: zeroed before reuse, as any freed region
                    self.unzeroed_bytes += (lo - at) * af.BLOCK
                    self._freed.append((time.monotonic(), at, lo - at))
                self._give_range(at, lo)
            at = hi
        self.peak_bytes = self.allocated_bytes
        if adopting:
            log.info("delivery arena %s adopted from an earlier daemon run: %d regions, %d MiB", self.path,
                     len(adopting), self.allocated_bytes >> 20)
        return len(adopting)

    def close(self, keep: bool = False) -> None:
        """Unlink the file, unless `keep` (a journal names what it holds: the next daemon adopts it).
        The mapping stays until the daemon exits: arrays in it may still be referenced (and clients
        keep their own mappings)."""
        if self._closed:
            return
        self._closed = True
        if keep:
            # What the journal names must reach the next daemon as it is: regions the exiting
            # process lets go of (its objects finalized) keep their generations and values.
            self._kept = True
            os.close(self._dir_fd)
            return
        try:
            st = os.stat(self._name, dir_fd=self._dir_fd, follow_symlinks=False)
            if st.st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self._name, dir_fd=self._dir_fd)
        except OSError:
            pass
        if self.remove_dir:  # made by this run (not by systemd or tmpfiles.d): leave nothing behind
            d = os.path.dirname(self.path)
            try:
                if os.stat(d, follow_symlinks=False).st_ino == os.fstat(self._dir_fd).st_ino:
                    os.rmdir(d)
            except OSError:
                pass  # not empty (someone else's file?), or gone: leave it
        os.close(self._dir_fd)

    def fileno(self) -> int:
        return self._fd

    # -- allocation --

    def alloc(self, shape: tuple[int, ...], dtype: Any, overwrite: bool = False) -> np.ndarray | None:
        """An array of `shape` in a fresh region, all zeros; None when it does not fit (keep it on
        the heap). `overwrite`: the caller writes every byte of the array before anyone reads it (a
        read from a ring straight into it), so only what lies past its end is zeroed."""
        dt = np.dtype(dtype)
        count = 1
        for s in shape:
            count *= s
        nbytes = count * dt.itemsize
        if nbytes <= 0 or self._closed:
            return None
        blocks = (nbytes + af.BLOCK - 1) // af.BLOCK
        order = (blocks - 1).bit_length()
        if order > self._top:
            self.fallbacks += 1
            return None
        b = self._take(order)
        if b is None:
            self.fallbacks += 1
            self._warn("the arena is full")
            return None
        if blocks < (1 << order):
            self._give_range(b + blocks, b + (1 << order))  # the tail it does not need
        size = blocks * af.BLOCK
        off = b * af.BLOCK
        if not self._commit(off, size):
            self._give_range(b, b + blocks)
            self.fallbacks += 1
            return None
        if self.unzeroed_bytes and self._dirty[b : b + blocks].any():
            if overwrite:
                self._zero_dirty(b + blocks - 1, b + blocks, nbytes - (blocks - 1) * af.BLOCK)
                self._forget_dirty(b, b + blocks - 1)
            else:
                self._zero_dirty(b, b + blocks)
        region = _region_type(size).from_buffer(self._mm, self.data_offset + off)
        region._arena = self
        region._off = b
        region._blocks = blocks
        region._gen = int(self._gens[b])
        self.allocated_bytes += size
        self.regions += 1
        self.allocations += 1
        if self.allocated_bytes > self.peak_bytes:
            self.peak_bytes = self.allocated_bytes
        return np.frombuffer(region, dt, count=count).reshape(shape)

    def locate(self, arr: np.ndarray) -> tuple[int, int, int] | None:
        """(block, gen, offset) of an array that lies in this arena (C-contiguous), else None."""
        b = arr.base
        if (type(b) is np.ndarray and isinstance(b.base, _Region) and b.size == arr.size and b.dtype == arr.dtype
                and arr.flags.c_contiguous):
            # What alloc() handed out, whole (the usual case): it starts where its region starts,
            # and asking numpy for the address (arr.ctypes) costs more than the rest of this.
            owner = b.base
            if owner._arena is not self:
                return None
            return owner._off, owner._gen, owner._off * af.BLOCK
        owner = _owner(arr)
        if not isinstance(owner, _Region) or owner._arena is not self or not arr.flags.c_contiguous:
            return None
        return owner._off, owner._gen, arr.ctypes.data - self._data_addr

    def region_of(self, arr: np.ndarray) -> tuple[int, int, int, int] | None:
        """(block, blocks, gen, offset) of a C-contiguous array in this arena: its region (first block,
        size in blocks, generation) and its data-area byte offset; None for any other array."""
        owner = _owner(arr)
        if not isinstance(owner, _Region) or owner._arena is not self or not arr.flags.c_contiguous:
            return None
        return owner._off, owner._blocks, owner._gen, arr.ctypes.data - self._data_addr

    def view(self, region: Any, offset: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
        """An array of `shape` at data-area byte `offset`, inside `region` (adopt_region's); None when
        it would reach outside the region."""
        dt = np.dtype(dtype)
        count = 1
        for s in shape:
            count *= s
        lo = offset - region._off * af.BLOCK
        if lo < 0 or lo % dt.itemsize or lo + count * dt.itemsize > region._blocks * af.BLOCK:
            return None
        # A slice of the whole region's bytes, not frombuffer(region, offset=lo): locate() takes an
        # array whose base is a frombuffer of its region for one that starts where the region does.
        return np.frombuffer(region, np.uint8)[lo:lo + count * dt.itemsize].view(dt).reshape(shape)

    def _take(self, order: int) -> int | None:
        b = self._find(order)
        if b is None and self._coalesce():
            b = self._find(order)
        return b

    def _add_free(self, k: int, b: int) -> None:
        self._free_at[k].add(b)
        heap = self._heap_at[k]
        heapq.heappush(heap, b)
        if len(heap) > 2 * len(self._free_at[k]) + 64:
            self._heap_at[k] = sorted(self._free_at[k])  # shed stale entries (a sorted list is a heap)

    def _lowest(self, k: int) -> int | None:
        heap, free = self._heap_at[k], self._free_at[k]
        while heap and heap[0] not in free:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _find(self, order: int) -> int | None:
        # The smallest size that has a free region, its lowest one (splitting keeps lower halves,
        # so what is left free of a size tends to lie above what is in use).
        k = order
        free_at = self._free_at
        while k <= self._top and not free_at[k]:
            k += 1
        if k > self._top:
            return None
        best = self._lowest(k)
        heapq.heappop(self._heap_at[k])
        self._free_at[k].discard(best)
        while k > order:  # split: keep the lower half, free the upper
            k -= 1
            self._add_free(k, best + (1 << k))
        return best

    def _give_range(self, lo: int, hi: int) -> None:
        """Blocks [lo, hi) back, as the largest aligned buddies that tile them."""
        while lo < hi:
            k = min((lo & -lo).bit_length() - 1 if lo else self._top, (hi - lo).bit_length() - 1, self._top)
            self._add_free(k, lo)
            lo += 1 << k

    def _coalesce(self) -> bool:
        """Merge every pair of free buddies, smallest first; True if anything merged."""
        merged = False
        for order in range(self._top):
            fl = self._free_at[order]
            for b in sorted(fl):
                if b in fl and (b ^ (1 << order)) in fl:
                    fl.discard(b)
                    fl.discard(b ^ (1 << order))
                    self._add_free(order + 1, min(b, b ^ (1 << order)))
                    merged = True
        return merged

    def _free(self, b: int, blocks: int) -> None:
        if self._kept:
            return
        # The generation first: a reader that copied from the region before this store sees the
        # old value; any byte written into it after this comes after the new value (x86-64 TSO).
        self._gens[b] += 1
        # Nothing in the daemon holds it any more (a pin neither): what it held goes with the next
        # record written into it or with `sweep` (its pages stay reserved, unlike a punched hole).
        self._dirty[b : b + blocks] = True
        self._freed.append((time.monotonic(), b, blocks))
        self.unzeroed_bytes += blocks * af.BLOCK
        self.allocated_bytes -= blocks * af.BLOCK
        self.regions -= 1
        self._give_range(b, b + blocks)

    def sweep(self, now: float | None = None) -> int:
        """Zero the freed regions that have been free for ZERO_WITHIN_S at `now` (monotonic), or all
        of them when `now` is None (the daemon is idle). Returns the bytes zeroed."""
        freed = self._freed
        before = self.zeroed_bytes
        while freed and (now is None or now - freed[0][0] >= ZERO_WITHIN_S):
            _, b, blocks = freed.popleft()
            if self.unzeroed_bytes:
                self._zero_dirty(b, b + blocks)
        return self.zeroed_bytes - before

    def _zero_dirty(self, lo: int, hi: int, skip: int = 0) -> None:
        """Zero the freed blocks among [lo, hi), past the first `skip` bytes of block lo, and mark
        them clean."""
        seg = self._dirty[lo:hi]
        if seg.all():
            runs = [(0, hi - lo)]
        elif not seg.any():
            return
        else:
            edges = np.flatnonzero(np.diff(seg.view(np.int8), prepend=0, append=0))
            runs = list(zip(edges[::2].tolist(), edges[1::2].tolist()))
        for s, e in runs:
            start = (lo + s) * af.BLOCK + (skip if s == 0 else 0)
            n = (lo + e) * af.BLOCK - start
            ctypes.memset(self._data_addr + start, 0, n)
            self.zeroed_bytes += n
        self._forget_dirty(lo, hi)

    def _forget_dirty(self, lo: int, hi: int) -> None:
        seg = self._dirty[lo:hi]
        n = int(np.count_nonzero(seg))
        if n:
            seg[:] = False
            self.unzeroed_bytes -= n * af.BLOCK

    def _commit(self, off: int, size: int) -> bool:
        lo = (self.data_offset + off) // COMMIT_CHUNK
        hi = (self.data_offset + off + size - 1) // COMMIT_CHUNK
        for c in range(lo, hi + 1):
            if self._committed[c]:
                continue
            start = c * COMMIT_CHUNK
            n = min(COMMIT_CHUNK, self.file_size - start)
            try:
                os.posix_fallocate(self._fd, start, n)
            except OSError as e:
                self._warn(f"cannot reserve {n >> 20} MiB of {os.path.dirname(self.path)} ({os.strerror(e.errno)})")
                return False
            # Mapped into the daemon now: large records are written by the copier, so the daemon's
            # first touch of a page would otherwise be the zeroing of a freed region, a fault every
            # 4 KiB in the middle of ingest.
            populate_write(self._mm, start, n)
            self._committed[c] = 1
            self.committed_bytes += n
        return True

    def _mark_committed(self, start: int, n: int) -> None:
        """Chunks that [start, start + n) reserved whole. One it reserved only part of stays
        uncommitted: _commit reserves all of it before a region in it is handed out (a chunk counted
        but not reserved is a page the daemon faults on, or fails to read into, when tmpfs is full)."""
        end = start + n
        for c in range(start // COMMIT_CHUNK, (end - 1) // COMMIT_CHUNK + 1):
            lo, hi = c * COMMIT_CHUNK, min((c + 1) * COMMIT_CHUNK, self.file_size)
            if not self._committed[c] and start <= lo and hi <= end:
                self._committed[c] = 1
                self.committed_bytes += hi - lo

    def write_failed(self, n: int, why: str) -> None:
        """`n` arrays could not be read into their regions (memory of the daemon's own that it could
        not write): they were read into the heap instead and go as frames; counted as fallbacks."""
        if not self.write_failures:
            log.error("delivery arena %s: %s; read those arrays into the heap instead (frames; `vllm-tap status` "
                      "counts them as arena write_failures)", self.path, why)
        self.fallbacks += n
        self.write_failures += n

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("delivery arena %s: %s; arrays that do not fit stay on the heap and go to subscribers "
                        "as frames (slower; `vllm-tap status` counts them as arena fallbacks)", self.path, why)

    def snapshot(self) -> dict[str, Any]:
        return {"path": self.path, "id": f"{self.arena_id:016x}", "capacity": self.capacity,
                "allocated_bytes": self.allocated_bytes, "peak_bytes": self.peak_bytes, "regions": self.regions,
                "allocations": self.allocations, "fallbacks": self.fallbacks,
                "write_failures": self.write_failures, "committed_bytes": self.committed_bytes,
                "unzeroed_bytes": self.unzeroed_bytes, "zeroed_bytes": self.zeroed_bytes}


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _punch(fd: int, offset: int, length: int) -> bool:
    """Give [offset, offset + length) of the file back to its file system (it then reads as zeros)."""
    return _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0


def _unfit(st: os.stat_result, fields: tuple | None, arena_id: int, capacity: int, size: int) -> str:
    """Why an earlier run's arena file cannot be adopted ("" when it can)."""
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return "not a regular file of this daemon's user"
    if st.st_mode & 0o022:
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    if fields is None or fields[0] != af.ARENA_MAGIC or fields[1] != af.ARENA_FORMAT_VERSION:
        return "not an arena of this version"
    n_blocks, gen_off, data_off, want_size = af.layout(capacity)
    (_, _, header_size, file_id, file_capacity, block, _, file_blocks, file_gen_off, file_data_off, pid, _) = fields
    if file_capacity != capacity:
        return f"{file_capacity} bytes where arena_bytes now asks for {capacity}"
    if (file_id != arena_id or header_size != af.HEADER_SIZE or block != af.BLOCK or file_blocks != n_blocks
            or file_gen_off != gen_off or file_data_off != data_off or st.st_size != want_size or size != want_size):
        return "its header does not match its layout"
    if pid and pid != os.getpid() and _alive(pid):
        return f"its daemon (pid {pid}) still runs"
    return ""


def remove_stale(dir_fd: int, directory: str) -> None:
    """Arena files of earlier runs (ours, their daemon dead) are removed: nothing reads them any more
    but clients that mapped them, and those keep their mappings."""
    try:
        names = [n for n in os.listdir(dir_fd) if n.startswith(af.ARENA_PREFIX)]
    except OSError:
        return
    for name in names:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            head = os.pread(fd, af.HEADER.size, 0)
            pid = af.HEADER.unpack(head)[10] if len(head) == af.HEADER.size else 0
        finally:
            os.close(fd)
        if pid and pid != os.getpid() and _alive(pid):
            continue
        try:
            os.unlink(name, dir_fd=dir_fd)
            log.info("removed %s/%s, the arena of an earlier daemon run", directory, name)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError as e:
        return e.errno != errno.ESRCH
    return True
