"""Moving captured rows from the model's tensors into ring reservations.

A record's payload is filled from one or two segments (a tensor and the rows of it to take); rows
that form one run are a slice, others a gather (index_select).

Two publishers, one interface (`write` a record, `end_step`, `abandon_step`, `close`):

- `Publisher` (CPU): the rows are copied straight into the ring on the step thread (one memcpy or
  gather per segment) and the step's records commit at `end_step`.
- `StagedPublisher` (CUDA): the compute stream never waits for a device-to-host copy.

      compute stream:  forward ─ gather rows → staging slot ─ event E1 ─ next forward …
      copy stream:                             wait E1 ─ D2H staging → ring ─ event E2
      publisher thread:                                                    wait E2 ─ commit, free slot

  The gathers go into a preallocated device staging buffer on the compute stream, right behind the
  forward that produced the tensors, so they are ordered before anything (the next forward, CUDA-
  graph replays, the grammar mask) can overwrite the source. An event E1 marks the end of the
  step's gathers; the copy stream waits on it and copies each record's staged bytes into the ring,
  which is page-locked once (cudaHostRegister) so the copies are asynchronous DMA; an event E2 marks
  their end. A thread (which sets its CUDA device first, as vLLM's own async-output thread does)
  waits on E2, commits the step's records, and only then frees their staging bytes. The staging
  buffer is handed out in order like a ring (`StagingRing`); when a record's bytes do not fit in
  what is free, the record is dropped and reported (DROP records, so the daemon makes gaps) rather
  than waiting for a copy to finish: the forward is never blocked.

  The thread commits the steps of a short while together (COMMIT_BATCH_S, or at once when half the
  staging is in flight): it takes the GIL, which vLLM's step thread needs, once per batch of steps.

  A record written step after step in the same layout (a decode step of an unchanged batch:
  hooks/steady_step.py) has its own few staging blocks (`FixedRecord`, `StagingRing.alloc_slot`):
  the same bytes of the staging buffer each lap, so their views are made once and kept, and a step
  makes no view but the ring's.

  All of it but the streams and events is plain Python over tensors, so the CPU tests run the very
  same class with a `HostBackend` whose "copy stream" is the publisher thread: the copies happen when
  the thread waits on the step's event, after the step has returned, as a DMA would.

A step that fails half-way (an exception in our code) is abandoned: records already reserved are
turned into PAD records (the reader skips them) and committed, so the ring's in-order publication
never stalls, and the step's rows are reported as dropped.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import NamedTuple, Sequence

import numpy as np
import torch

from vllm_tap import ring_format as rf
from vllm_tap.ring_records import RequestTable, TensorId
from vllm_tap.ring_schema import drop_metas
from vllm_tap.ring_writer import PreparedRecord, Reservation, RingWriter

log = logging.getLogger("vllm_tap.hooks")

STORAGE = {torch.float32: rf.DType.FLOAT32, torch.float16: rf.DType.FLOAT16,
           torch.bfloat16: rf.DType.BFLOAT16, torch.int32: rf.DType.INT32}


class RecordSection(NamedTuple):
    """One section (tensor) of a DATA record as the hook writes it: the ring writer's five fields
    (RingWriter.prepare_record), then the torch dtype its rows are stored in."""

    tensor: TensorId
    code: int  # ring_format.DType
    width: int  # columns: slice[1] - slice[0]
    slice: tuple[int, int]
    full_dim: int
    dtype: torch.dtype
# The device staging buffer is this share of the ring: a decode step of 128 requests capturing full
# logits at vocab 128256 in bf16 (33 MB) fits several times in the default ring's (256 MiB / 4).
STAGING_RING_SHARE = 4
MIN_STAGING_BYTES = 1 << 20
# Device memory: a few steps in flight need no more, however large the ring (hooks/ring_size.py sizes
# rings up to gigabytes).
MAX_STAGING_BYTES = 256 << 20
STAGING_ALIGN = 256  # every staged block starts aligned for any dtype and for fast DMA
# Staging blocks a record written step after step rotates through (FixedRecord), at most: its copy
# out may lag this many steps behind the step thread (the publisher thread waits for the GIL, up to
# a switch interval of 5 ms at a time) before one is dropped. Fewer when the staging holds fewer.
FIXED_BLOCKS = 64
# How long the publisher thread gathers steps before it commits them together (a record reaches the
# daemon this much later at most); it commits at once when half the staging is in flight.
COMMIT_BATCH_S = 0.005
# Shapes of such records whose block views are kept: a batch that changes and comes back to the
# same shape (the same number of capturing requests, ids of the same length) reuses them.
FIXED_SHAPES = 16

Segment = tuple[torch.Tensor, "np.ndarray | None"]
_UNIT = (1,)


def staging_bytes(ring_bytes: int) -> int:
    """Size of the device staging buffer for a ring of `ring_bytes`."""
    n = min(max(ring_bytes // STAGING_RING_SHARE, MIN_STAGING_BYTES), MAX_STAGING_BYTES)
    return n - n % STAGING_ALIGN


def report_drop(writer: RingWriter, table: RequestTable, rows: np.ndarray, tensor: TensorId) -> None:
    """One DROP record per request with rows in `rows` (int32 [3, n]: slot, position, token id):
    the daemon turns those positions into gaps."""
    for ref, meta in drop_metas(table, rows[0], rows[1], tensor):
        writer.write_control(ref.request_id, meta, tap_key=ref.tap_key)


def _pad_out(writer: RingWriter, starts: Sequence[int]) -> None:
    """Turn reserved, uncommitted DATA records into PAD records (same length): the reader skips
    them, whatever their payload holds."""
    mm = writer.buffer
    for at in starts:
        mm[at : at + 4] = rf.PAD_MAGIC


class _RingViews:
    """The whole ring as one host tensor: reservations become views of it, never new buffers."""

    def __init__(self, buffer):
        self.ring = torch.frombuffer(buffer, dtype=torch.uint8)
        self._typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        # One as_strided on a cached typed view: this runs for every captured tensor of every step,
        # and a slice-then-view chain costs several times as much.
        typed = self._typed.get(dtype)
        if typed is None:
            base = self.ring.view(dtype)
            typed = self._typed[dtype] = (base, base.element_size())
        base, size = typed
        start, misaligned = divmod(offset, size)
        if misaligned:
            raise ValueError(f"offset {offset} is not aligned for {dtype}")
        strides = (shape[1], 1) if len(shape) == 2 else (1,)  # payloads [n, width], token ids [n]
        return torch.as_strided(base, shape, strides, start)


class FixedRecord:
    """A record of one layout written step after step (a decode step of an unchanged batch): its
    prepared header and where its tensors go. Under the staged publisher its staging is one of a
    few fixed blocks, whose views are made the first time each block is used and then kept: a step
    makes no view but the ring's.

    `reserve_fixed` gives (dests, derived): dests are the token-id destination (None when the ids
    are on the host and travel with the row table) and one [n, width] destination per section, in
    the record's order; derived is what `derive(dests)` makes of them (further views), once per
    block and kept with it, or None."""

    __slots__ = ("prep", "n", "device_ids", "dtypes", "first", "size", "shape", "stride", "count", "blocks", "derive")

    def __init__(self, prep: PreparedRecord, n: int, dtypes: Sequence[torch.dtype], device_ids: bool,
                 derive=None):
        self.prep = prep
        self.n = n
        self.device_ids = device_ids
        self.dtypes = tuple(dtypes)
        # The bytes one copy moves: from the ids (when the device fills them) or section 0's payload
        # to the end of the last payload, relative to the record's start.
        self.first = prep.ids_off if device_ids else prep.offsets[0]
        self.size = prep.data_end - self.first
        self.shape = (self.size,)
        self.stride = -(-self.size // STAGING_ALIGN) * STAGING_ALIGN
        self.count = 0  # staging blocks (StagedPublisher)
        self.blocks: list = []
        self.derive = derive


class Publisher:
    """CPU: copy into the ring on the step thread, commit at the end of the step."""

    def __init__(self, writer: RingWriter):
        self.writer = writer
        self._ring = _RingViews(writer.buffer)
        self._step: list[Reservation] = []
        self._starts: list[int] = []

    def write(self, table: RequestTable, rows: np.ndarray, sections: tuple[RecordSection, ...], fills: list[list[Segment]], *,
              step: int, device_ids: tuple[torch.Tensor, np.ndarray] | None = None) -> bool:
        """Reserve one record for `rows` with a payload per section (tensor id, dtype code, width,
        slice, full dim, storage dtype) and queue the copies: section i gets the rows `index` (all
        when None) of each of fills[i]'s (tensor, index) segments, one after the other, converted to
        its dtype; and, when the token ids live on the accelerator, device_ids = (ids tensor, flat
        rows) into the record's id area. False when it was dropped (and reported)."""
        res = self.writer.reserve_sections(table, rows, sections, step=step)
        if res is None:
            return False
        n = rows.shape[1]
        self._step.append(res)
        self._starts.append(res.record_offset)
        view = self._ring.view
        for (at, _), sec, segments in zip(res.sections, sections, fills):
            _fill_segments(view(at, sec.dtype, (n, sec.width)), segments, self._gather_into)
        if device_ids is not None:
            self._gather_into(view(res.token_ids_offset, torch.int32, (n,)), *device_ids)
        return True

    def fixed_record(self, prep: PreparedRecord, n: int, dtypes: Sequence[torch.dtype], device_ids: bool,
                     derive=None) -> FixedRecord | None:
        """A record of this layout to write step after step (None: this publisher cannot)."""
        return FixedRecord(prep, n, dtypes, device_ids, derive)

    def reserve_fixed(self, rec: FixedRecord, table: RequestTable, rows: np.ndarray, step: int) -> tuple | None:
        """Reserve one step's record of `rec`'s layout (rows as for `write`): its destinations, or
        None when it was dropped (and reported). Here they are views of the ring itself."""
        res = self.writer.reserve_prepared(rec.prep, table, rows, step)
        if res is None:
            return None
        self._step.append(res)
        self._starts.append(res.record_offset)
        view = self._ring.view
        at = res.record_offset
        n = rec.n
        prep = rec.prep
        dests = [view(at + prep.ids_off, torch.int32, (n,)) if rec.device_ids else None]
        for off, dtype, sec in zip(prep.offsets, rec.dtypes, prep.sections):
            dests.append(view(at + off, dtype, (n, sec.width)))
        return dests, None if rec.derive is None else rec.derive(dests)

    def _gather_into(self, dst: torch.Tensor, src: torch.Tensor, index: np.ndarray | None) -> None:
        rows = _slice_rows(src, index)
        if rows is not None:
            # Contiguous rows (a decode batch in which every request captures; a prefill chunk): a slice.
            dst.copy_(rows)
        elif dst.dtype == src.dtype:
            torch.index_select(src, 0, torch.from_numpy(index), out=dst)
        else:
            dst.copy_(src.index_select(0, torch.from_numpy(index)))

    def end_step(self) -> None:
        if self._step:
            self.writer.commit_many(self._step)
            self._step, self._starts = [], []

    def abandon_step(self) -> None:
        """Give up the step's records: they become PAD records and are committed."""
        if self._step:
            _pad_out(self.writer, self._starts)
            self.writer.commit_many(self._step)
            self._step, self._starts = [], []

    def close(self) -> None:
        pass


def _fill_segments(dst: torch.Tensor, segments: list[Segment], gather) -> None:
    if len(segments) == 1:
        gather(dst, *segments[0])
        return
    at = 0
    for src, index in segments:
        k = src.shape[0] if index is None else len(index)
        gather(dst[at : at + k], src, index)
        at += k


class StagingRing:
    """Byte ranges of the staging buffer, handed out in order by the step thread and given back in
    order by the publisher thread once the step's copy out of them has completed. Bookkeeping only.

    Cursors grow without bound (like the ring's); a block never wraps: the bytes left at the end
    are skipped. The step thread moves `head`, the publisher thread `tail` (single stores)."""

    def __init__(self, capacity: int, align: int = STAGING_ALIGN):
        self.capacity = capacity - capacity % align
        self.align = align
        self.head = 0
        self.tail = 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free block of `nbytes` in the buffer, or None when there is none now."""
        n = -(-nbytes // self.align) * self.align
        cap = self.capacity
        if n > cap:
            return None
        pos = self.head % cap
        skip = cap - pos if pos + n > cap else 0
        if self.head + skip + n - self.tail > cap:
            return None
        self.head += skip
        at = self.head % cap
        self.head += n
        return at

    def alloc_slot(self, stride: int, count: int) -> int | None:
        """The next of `count` fixed blocks of `stride` bytes (an aligned multiple) at the start of
        the buffer, in order with every other block: its index, or None when it is not free yet.
        A record of the same shape written step after step always lands on one of them, so views
        of the blocks can be made once and kept (FixedRecord)."""
        cap = self.capacity
        pos = self.head % cap
        k = -(-pos // stride)
        if k < count:
            skip = k * stride - pos
        else:  # past the last block: the rest of this lap goes unused
            skip, k = cap - pos, 0
        if self.head + skip + stride - self.tail > cap:
            return None
        self.head += skip + stride
        return k

    def free_to(self, cursor: int) -> None:
        self.tail = cursor


class HostBackend:
    """The staged path on the CPU, for tests: staging is a host tensor and the "copy stream" is the
    publisher thread, which performs a step's copies when it waits on the step's event."""

    device = torch.device("cpu")

    class _Copies:
        def __init__(self, pairs):
            self.pairs = pairs

        def run(self) -> None:
            for dst, src in self.pairs:
                dst.copy_(src)

    def register(self, ring: torch.Tensor) -> None:
        pass

    def unregister(self, ring: torch.Tensor) -> None:
        pass

    def thread_init(self) -> None:
        pass

    def index(self, index: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(index)

    def copy_after_compute(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        return self._Copies(pairs)

    def wait_all(self, dones: list) -> None:
        for done in dones:
            done.run()

    def recycle(self, done) -> None:
        pass


class DeviceIndices:
    """Row indices as device tensors, kept by value: a batch that stays the same from step to step
    (decode) asks for the same rows every step, and each upload would cost a host allocation and a
    copy on the step thread. A miss goes through torch's pinned host allocator (an asynchronous
    copy: nothing waits for it)."""

    def __init__(self, device: torch.device, size: int = 64):
        self.device = device
        self.size = size
        self._cache: dict[bytes, torch.Tensor] = {}
        self.misses = 0

    def __call__(self, index: np.ndarray) -> torch.Tensor:
        key = index.tobytes() + bytes((index.dtype.itemsize,))
        got = self._cache.get(key)
        if got is None:
            self.misses += 1
            if len(self._cache) >= self.size:
                self._cache.pop(next(iter(self._cache)))  # the oldest: batches come and go
            got = self._cache[key] = torch.from_numpy(index).pin_memory().to(self.device, non_blocking=True)
        return got


class CudaBackend:
    """Streams and events for the staged path on a CUDA device. Events come from a pool the
    publisher thread refills once a step's copies are done: none is created per step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)
        self.index = DeviceIndices(device)
        self._events: collections.deque = collections.deque()

    def _event(self) -> torch.cuda.Event:
        try:
            return self._events.popleft()  # deque ends are thread-safe: the thread appends
        except IndexError:
            return torch.cuda.Event()

    def register(self, ring: torch.Tensor) -> None:
        # cudaHostRegisterDefault = 0: page-lock the mapping so D2H copies into it are async DMA.
        err = torch.cuda.cudart().cudaHostRegister(ring.data_ptr(), ring.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"vllm-tap: cudaHostRegister of the ring failed ({err})")

    def unregister(self, ring: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(ring.data_ptr())

    def thread_init(self) -> None:
        # Without it the thread's first CUDA call would make a context on device 0.
        torch.cuda.set_device(self.device)

    def copy_after_compute(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        ready, done = self._event(), self._event()
        compute = torch.cuda.current_stream(self.device)
        ready.record(compute)
        s = self.copy_stream
        s.wait_event(ready)  # the copy stream waits for the compute stream, never the reverse
        # set_stream and back rather than the `torch.cuda.stream` context: the same switch for a
        # third of the host time (each microsecond here is the step thread's).
        torch.cuda.set_stream(s)
        try:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        finally:
            torch.cuda.set_stream(compute)
        done.record(s)
        return ready, done

    def wait_all(self, dones: list) -> None:
        # One copy stream: its copies complete in the order they were queued.
        dones[-1][1].synchronize()

    def recycle(self, done) -> None:
        """Both events of a step whose copies have completed go back to the pool."""
        self._events.extend(done)


class StagedPublisher(Publisher):
    """Gather into device staging on the compute stream; D2H on a copy stream; commit from a thread."""

    def __init__(self, writer: RingWriter, backend, staging_nbytes: int):
        super().__init__(writer)
        self.backend = backend
        self.staging = StagingRing(staging_nbytes)
        self._buf = torch.empty(self.staging.capacity, dtype=torch.uint8, device=backend.device)
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._shapes: dict[tuple, list] = {}  # FixedRecord block views by the record's shape
        self.staging_drops = 0  # records dropped because the staging buffer was full
        self._queued_mark = 0  # staging cursor at the end of the last step handed to the thread
        self._mark = 0  # the thread's: staging cursor of the last step it committed
        # The thread's own CPU time handling steps (GIL held), and how often it woke for them.
        self.thread_ns = 0
        self.thread_wakes = 0
        backend.register(self._ring.ring)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        # Put to (by the step thread, when staging runs short, and by drain/close) to end the
        # thread's wait for more steps at once.
        self._hurry: queue.SimpleQueue = queue.SimpleQueue()
        self.batch_s = COMMIT_BATCH_S
        self._thread = threading.Thread(target=self._run, name="vllm-tap-publisher", daemon=True)
        self._thread.start()

    def _staged(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        base = self._typed.get(dtype)
        if base is None:
            base = self._typed[dtype] = self._buf.view(dtype)
        start = offset // base.element_size()
        strides = (shape[1], 1) if len(shape) == 2 else (1,)
        return torch.as_strided(base, shape, strides, start)

    def write(self, table, rows, sections, fills, *, step, device_ids=None) -> bool:
        res = self.writer.reserve_sections(table, rows, sections, step=step)
        if res is None:
            return False
        # One staging block holds the record as the ring will (ids, the record's padding, each
        # section's payload and padding), so one copy moves it all.
        first = res.sections[0][0] if device_ids is None else res.token_ids_offset
        size = res.data_end - first
        at = self.staging.alloc(size)
        self._step.append(res)
        self._starts.append(res.record_offset)
        if at is None:
            self._staging_full(res, table, rows, sections)
            return False
        n = rows.shape[1]
        if device_ids is not None:
            self._gather_into(self._staged(at, torch.int32, (n,)), *device_ids)
        for (off, _), sec, segments in zip(res.sections, sections, fills):
            _fill_segments(self._staged(at + off - first, sec.dtype, (n, sec.width)), segments, self._gather_into)
        self._pairs.append((self._ring.view(first, torch.uint8, (size,)), self._staged(at, torch.uint8, (size,))))
        return True

    def fixed_record(self, prep, n, dtypes, device_ids, derive=None) -> FixedRecord | None:
        rec = FixedRecord(prep, n, dtypes, device_ids, derive)
        # Several blocks, so the step's copy may lag steps behind before a record is dropped; fewer
        # than two would drop every other step: such a record takes the general way.
        rec.count = min(FIXED_BLOCKS, self.staging.capacity // rec.stride)
        if rec.count < 2:
            return None
        shape = (rec.first, rec.size, tuple(prep.offsets), rec.dtypes, tuple(sec.width for sec in prep.sections),
                 n, device_ids, derive is not None and (derive.__code__, derive.__defaults__))
        blocks = self._shapes.pop(shape, None)
        if blocks is None:
            blocks = [None] * rec.count
            if len(self._shapes) >= FIXED_SHAPES:
                self._shapes.pop(next(iter(self._shapes)))  # the least recently laid out
        self._shapes[shape] = rec.blocks = blocks
        return rec

    def reserve_fixed(self, rec: FixedRecord, table: RequestTable, rows: np.ndarray, step: int) -> tuple | None:
        res = self.writer.reserve_prepared(rec.prep, table, rows, step)
        if res is None:
            return None
        self._step.append(res)
        self._starts.append(res.record_offset)
        k = self.staging.alloc_slot(rec.stride, rec.count)
        if k is None:
            self._staging_full(res, table, rows, rec.prep.sections)
            return None
        got = rec.blocks[k]
        if got is None:
            got = rec.blocks[k] = self._block_views(rec, k * rec.stride)
        self._pairs.append((torch.as_strided(self._ring.ring, rec.shape, _UNIT, res.record_offset + rec.first), got[0]))
        return got[1]

    def _block_views(self, rec: FixedRecord, at: int) -> tuple:
        """A staging block's whole-record view and its destinations (as reserve_fixed returns them)."""
        prep, n = rec.prep, rec.n
        dests = [self._staged(at, torch.int32, (n,)) if rec.device_ids else None]
        for off, dtype, sec in zip(prep.offsets, rec.dtypes, prep.sections):
            dests.append(self._staged(at + off - rec.first, dtype, (n, sec.width)))
        return self._staged(at, torch.uint8, (rec.size,)), (dests, None if rec.derive is None else rec.derive(dests))

    def _staging_full(self, res: Reservation, table: RequestTable, rows: np.ndarray, sections) -> None:
        """Waiting for a copy to free staging would stall the forward: the record becomes PAD
        (committed in order with the step), its rows are reported dropped, and it is counted."""
        _pad_out(self.writer, [res.record_offset])
        self.staging_drops += 1
        if self.staging_drops == 1 or self.staging_drops % 1000 == 0:
            log.warning("vllm-tap: device staging buffer full (%d bytes); %d records dropped so far",
                        self.staging.capacity, self.staging_drops)
        for sec, nbytes in zip(sections, res.prep.nbytes):
            self.writer.drop_rows(table, rows, sec.tensor, nbytes)

    def _gather_into(self, dst: torch.Tensor, src: torch.Tensor, index: np.ndarray | None) -> None:
        # On the compute stream, into staging (ours, preallocated: nothing to free across streams).
        rows = _slice_rows(src, index)
        if rows is not None:
            dst.copy_(rows)
            return
        idx = self.backend.index(index)
        if dst.dtype == src.dtype:
            torch.index_select(src, 0, idx, out=dst)
        else:
            dst.copy_(src.index_select(0, idx))

    def end_step(self) -> None:
        if not self._step:
            self._free_unqueued()
            return
        done = self.backend.copy_after_compute(self._pairs)
        staging = self.staging
        self._queued_mark = staging.head
        self._q.put((done, self._step, self._starts, self._queued_mark, False))
        self._step, self._starts, self._pairs = [], [], []
        if staging.head - staging.tail > staging.capacity >> 1:
            self._hurry.put(True)  # half the staging in flight: the thread commits what it has now

    def abandon_step(self) -> None:
        if not self._step:
            self._free_unqueued()
            return
        # No copy of this step was queued; the thread PADs and commits in order after earlier steps.
        self._queued_mark = self.staging.head
        self._q.put((None, self._step, self._starts, self._queued_mark, True))
        self._step, self._starts, self._pairs = [], [], []

    def _free_unqueued(self) -> None:
        """Staging taken since the last queued step with no record to carry its release (none is
        taken by a dropped record, so this is a guard): freed in order behind the queued steps."""
        if self.staging.head != self._queued_mark:
            self._queued_mark = self.staging.head
            self._q.put((None, [], [], self._queued_mark, False))

    def _run(self) -> None:
        try:
            self.backend.thread_init()
        except Exception:
            log.exception("vllm-tap: publisher thread could not set its device")
        q, hurry = self._q, self._hurry
        while True:
            # The steps of a short while handled together: the thread takes the GIL, which vLLM's
            # step thread needs, once per batch of steps rather than once per step. A batch ends
            # after `batch_s`, or at once when staging runs short (or on drain and close).
            items = [q.get()]
            try:
                hurry.get(timeout=self.batch_s)
                while True:
                    hurry.get_nowait()
            except queue.Empty:
                pass
            while True:
                try:
                    items.append(q.get_nowait())
                except queue.Empty:
                    break
            stop = None in items
            if stop:
                items = items[: items.index(None)]
            copies = [it[0] for it in items if it[0] is not None and type(it[0]) is not _Signal]
            failed = False
            if copies:
                try:
                    self.backend.wait_all(copies)  # releases the GIL while it waits
                except Exception:
                    log.exception("vllm-tap: a step's device-to-host copy failed; its records are dropped")
                    failed = True
            t0 = time.thread_time_ns()
            ready: list = []
            for done, reservations, starts, mark, abandon in items:
                if type(done) is _Signal:
                    self._commit(ready, mark)
                    ready = []
                    done.run()
                    continue
                if abandon or (failed and done is not None):
                    _pad_out(self.writer, starts)
                ready.extend(reservations)
                self._mark = mark
            self._commit(ready, self._mark)
            for done in copies:
                self.backend.recycle(done)
            self.thread_ns += time.thread_time_ns() - t0
            self.thread_wakes += 1
            if stop:
                return

    def _commit(self, reservations: list, mark: int) -> None:
        if reservations:
            self.writer.commit_many(reservations)
        self.staging.free_to(mark)

    def drain(self, timeout: float = 5.0) -> None:
        """Wait until every queued step is committed (tests, shutdown)."""
        ev = threading.Event()
        self._q.put((_Signal(ev), [], [], self._queued_mark, False))
        self._hurry.put(True)
        ev.wait(timeout)

    def close(self) -> None:
        self._q.put(None)
        self._hurry.put(True)
        self._thread.join(timeout=5)
        try:
            self.backend.unregister(self._ring.ring)
        except Exception:
            pass


class _Signal:
    """A queue item's `done` that just tells the caller the thread got this far."""

    def __init__(self, ev: threading.Event):
        self.ev = ev

    def run(self) -> None:
        self.ev.set()

    def synchronize(self) -> None:
        self.ev.set()


def gather_rows(src: torch.Tensor, index: np.ndarray | None, to_device=torch.from_numpy) -> torch.Tensor:
    """src's rows `index` (all when None) as a tensor on src's device (a view when contiguous);
    `to_device` makes the index a tensor on that device (DeviceIndices on an accelerator)."""
    rows = _slice_rows(src, index)
    if rows is not None:
        return rows
    return src.index_select(0, to_device(index))


def _slice_rows(src: torch.Tensor, index: np.ndarray | None) -> torch.Tensor | None:
    """src's rows `index` as a view when they are one run (index ascending, as every row index
    here is; None = all rows), else None: then they need a gather."""
    if index is None:
        return src
    a, b = int(index[0]), int(index[-1])
    if b - a + 1 != len(index):
        return None
    return src if a == 0 and b + 1 == src.shape[0] else src[a : b + 1]


def make_publisher(writer: RingWriter, device: torch.device, ring_bytes: int) -> Publisher:
    if device.type == "cuda":
        return StagedPublisher(writer, CudaBackend(device), staging_bytes(ring_bytes))
    return Publisher(writer)
