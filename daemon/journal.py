"""The arena journal's writer: what the daemon filed per capture, appended as it files it, so the next
daemon can adopt the arena with every capture in it (layout: daemon/journal_format.py; reading it
back: daemon/adoption.py).

Rules:
- The daemon files events (`filed`), lets captures go (`dropped`), sheds their data (`shed`), reads
  the END of a capture still in flight (`end_read`) and says how far it read each ring (`read`);
  each becomes a frame in memory, written to the current segment by `flush`, which the daemon calls
  every turn of its loop before it sends anything and before it moves the rings' read cursors
  (RingPoller.commit), and at stop. A daemon killed before a flush loses nothing: the rings still
  hold what it read since the last one, and the next daemon reads on from the journal's cursors.
  What it held unfiled at a flush (a position held back for a later one, a step waiting for its
  other records) is still in its ring too: a ring's cursor stays below it (Reassembler.holds), up to
  a share of the ring (RingPoller.uncommitted), beyond which it is a Gap `not captured: consumed by
  a previous daemon` if the daemon is killed.
- Writes go to the arena's directory (tmpfs, like the arena): a write is a copy into the page cache,
  never a disk's fsync. The arena and its journal live and go together (a reboot empties both).
- Bounded: a segment is closed at SEGMENT_BYTES and a new one begun. A closed segment is removed
  once no capture still held has an entry in it. Captures held long (retained for retain_ttl_s) would
  keep old segments alive: when the segments hold more than twice what the held captures need (and
  more than MIN_RELOCATE_BYTES), the oldest segment's captures are written again into the current
  one (a Began with reset, their events, their End), a bounded amount per flush, and the segment goes.
- Arrays in the arena are written as references (region, generation, offset); an array the arena
  could not hold (it was full) inline up to MAX_INLINE_BYTES, and beyond that its positions as a
  Hole with the reason the next daemon would give them anyway.
- A write that fails (the directory full) costs the journal, never the daemon: it logs one line,
  stops journaling, and removes its segments (a journal with holes would adopt captures without
  saying what they miss); status says so (`journal.failed`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from . import journal_format as jf
from .arena import Arena, create_private_file
from vllm_tap.ring_records import ControlRecord

from .events import NOT_CAPTURED_PREVIOUS, Begin, End, Event, Gap, Tokens
from .store import Entry

log = logging.getLogger(__name__)

SEGMENT_BYTES = 16 << 20
MIN_RELOCATE_BYTES = 64 << 20
RELOCATE_PER_FLUSH = 4 << 20  # bytes of frames written again per flush, at most (keeps a tick short)


def begun(ev: Begin, seq: int, reset: bool = False) -> jf.Began:
    return jf.Began(seq, ev.instance, ev.request_id, ev.tap_key, ev.num_prompt_tokens,
                    list(ev.prompt_token_ids) if ev.prompt_token_ids is not None else None, ev.n, ev.model,
                    ev.spec, ev.start_position, ev.lazy, ev.source, time.time(), reset, ev.origin)


def ended(ev: End, seq: int) -> jf.Ended:
    missing = ev.missing_positions
    ranges = missing.ranges if hasattr(missing, "ranges") else [(p, p + 1) for p in missing]
    return jf.Ended(seq, ev.reason, ev.num_prompt_tokens, ev.num_output_tokens, list(ev.output_token_ids),
                    ev.end_position, ev.expected, [(int(a), int(b)) for a, b in ranges], ev.delivered, ev.source,
                    time.time())


def data(ev: Tokens, seq: int, arena: Arena) -> jf.Data | jf.Hole:
    refs = []
    for name, arr in ev.tensors.items():
        if arr.ndim != 2:
            return jf.Hole(seq, ev.start, ev.stop, NOT_CAPTURED_PREVIOUS)
        where = arena.region_of(arr)
        if where is not None:
            block, blocks, gen, offset = where
            refs.append(jf.Ref(name, ev.dtypes[name], arr.shape[0], arr.shape[1], block, blocks, gen, offset))
        elif arr.nbytes <= jf.MAX_INLINE_BYTES:
            refs.append(jf.Ref(name, ev.dtypes[name], arr.shape[0], arr.shape[1], -1, 0, 0, 0,
                               np.ascontiguousarray(arr).tobytes()))
        else:
            return jf.Hole(seq, ev.start, ev.stop, NOT_CAPTURED_PREVIOUS)
    return jf.Data(seq, ev.start, np.ascontiguousarray(ev.token_ids, "<i4").tobytes(), ev.num_prompt_tokens, refs)


def ending(seq: int, r: ControlRecord) -> jf.Ending:
    m = r.control
    return jf.Ending(seq, m.reason, m.num_prompt_tokens, m.num_output_tokens, list(m.output_token_ids), m.end_position,
                     r.spec.to_meta() if r.spec is not None else None, m.source)


def entry_frames(e: Entry, arena: Arena, end_read: jf.Ending | None = None) -> list[bytes]:
    """A capture's whole history as frames (a Began with reset first, the END read for it last):
    a checkpoint's or a relocation's."""
    out = [jf.frame(begun(e.begin, e.seq, reset=True))]
    for ev in e.history[1:]:
        out.append(jf.frame(_entry_of(ev, e.seq, arena)))
    if end_read is not None and e.end is None:
        out.append(jf.frame(end_read))
    return out


def _entry_of(ev: Event, seq: int, arena: Arena) -> Any:
    if type(ev) is Tokens:
        return data(ev, seq, arena)
    if type(ev) is Gap:
        return jf.Hole(seq, ev.positions.start, ev.positions.stop, ev.reason)
    if type(ev) is End:
        return ended(ev, seq)
    return begun(ev, seq)  # type: ignore[arg-type]


class Journal:
    """Open with Journal.start(arena, held); the daemon calls filed/dropped/shed as the store changes,
    flush() every tick, close() at stop."""

    def __init__(self, arena: Arena, dir_fd: int, directory: str, segment: int):
        self.arena = arena
        self.directory = directory
        self._dir_fd = dir_fd
        self._segment = segment - 1  # _roll() opens `segment`
        self._fd = -1
        self._segment_bytes = 0
        self._sizes: dict[int, int] = {}  # segment -> bytes, every segment file of ours
        self._buf: list[bytes] = []
        # Captures held: their Entry, the first segment with an entry of theirs, the bytes they take
        self._entries: dict[int, Entry] = {}
        self._first: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._endings: dict[int, jf.Ending] = {}  # captures in flight whose END was read
        self.live_bytes = 0
        self.failed = ""
        self.frames = 0
        self.written_bytes = 0
        self.relocated_bytes = 0

    @classmethod
    def start(cls, arena: Arena, held: list[Entry], first_segment: int, stale: list[str],
              endings: dict[int, jf.Ending] | None = None,
              reads: dict[tuple[str, str], tuple[int, int, int]] | None = None) -> "Journal":
        """A journal for this run, beginning with a checkpoint of the captures `held` (those adopted
        from an earlier run, with the ENDs read for those in flight: `endings`) and of how far that
        run read each ring (`reads`); then the earlier run's segments (`stale`, names in the arena's
        directory) are removed: the checkpoint restates all of theirs that still counts."""
        directory = os.path.dirname(arena.path)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        j = cls(arena, dir_fd, directory, first_segment)
        try:
            j._roll(checkpoint=True)
            for e in held:
                j._track(e, j._segment)
                end_read = (endings or {}).get(e.seq)
                if end_read is not None and e.end is None:
                    j._endings[e.seq] = end_read
                for f in entry_frames(e, arena, end_read):
                    j._append(e.seq, f)
            j.read([(inst, ring, *at) for (inst, ring), at in (reads or {}).items()])
            j.flush()
        except OSError as e:
            j._fail(e)
        for name in stale:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except OSError:
                pass
        return j

    # -- what the store does --

    def filed(self, ev: Event, entry: Entry) -> None:
        seq = entry.seq
        if self.failed or not seq:
            return
        t = type(ev)
        if t is Begin:
            if seq not in self._entries:
                self._track(entry, self._segment)
            self._append(seq, jf.frame(begun(ev, seq)))  # type: ignore[arg-type]
        elif seq in self._entries:
            if t is End:
                self._endings.pop(seq, None)
            self._append(seq, jf.frame(_entry_of(ev, seq, self.arena)))

    def end_read(self, entry: Entry, r: ControlRecord) -> None:
        """The END of a capture still in flight was read: with it, the next daemon can end the
        capture as the engine did, should this one die before it files the End."""
        seq = entry.seq
        if self.failed or seq not in self._entries or entry.end is not None or seq in self._endings:
            return
        e = self._endings[seq] = ending(seq, r)
        self._append(seq, jf.frame(e))

    def read(self, cursors: list[tuple[str, str, int, int, int]]) -> None:
        """How far rings were read ((instance, ring, epoch, cursor, read) each, jf.Read): written with
        the frames of what was read there, before the rings' own cursors move (RingPoller.commit)."""
        if self.failed:
            return
        for instance, ring, epoch, cursor, read in cursors:
            self._append(0, jf.frame(jf.Read(instance, ring, epoch, cursor, read)))

    def dropped(self, entry: Entry, why: str) -> None:
        seq = entry.seq
        if self.failed or seq not in self._entries:
            return
        self._append(seq, jf.frame(jf.Forgot(seq)))
        self._endings.pop(seq, None)
        del self._entries[seq]
        del self._first[seq]
        self.live_bytes -= self._bytes.pop(seq)

    def shed(self, entry: Entry, reason: str) -> None:
        if not self.failed and entry.seq in self._entries:
            self._append(entry.seq, jf.frame(jf.Shed(entry.seq, reason)))

    # -- files --

    def flush(self) -> None:
        """Write what was filed since the last flush (the daemon calls it before it sends anything, so
        what a subscriber was sent is in the journal)."""
        if self.failed or not self._buf:
            return
        try:
            if self._segment_bytes >= SEGMENT_BYTES:
                self._roll(checkpoint=False)
            data = b"".join(self._buf)
            self._buf.clear()
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            self._segment_bytes += len(data)
            self._sizes[self._segment] = self._segment_bytes
            self.written_bytes += len(data)
        except OSError as e:
            self._fail(e)

    def tick(self) -> None:
        """Let go of segments no held capture needs; write again the oldest captures when old
        segments hold much more than the held captures need."""
        if self.failed:
            return
        self.flush()
        self._collect()
        self.flush()

    def close(self, keep: bool) -> None:
        """At stop: the last frames out, and the segments kept for the next daemon (`keep`) or removed."""
        if not self.failed and keep:
            self.flush()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if not keep or self.failed:
            self._remove_all()
        os.close(self._dir_fd)

    @property
    def held(self) -> int:
        return len(self._entries)

    def snapshot(self) -> dict[str, Any]:
        return {"segments": len(self._sizes), "bytes": sum(self._sizes.values()), "live_bytes": self.live_bytes,
                "captures": len(self._entries), "frames": self.frames, "written_bytes": self.written_bytes,
                "relocated_bytes": self.relocated_bytes, "failed": self.failed or None}

    # -- inside --

    def _track(self, entry: Entry, segment: int) -> None:
        seq = entry.seq
        self._entries[seq] = entry
        self._first[seq] = segment
        self._bytes.setdefault(seq, 0)

    def _append(self, seq: int, f: bytes) -> None:
        self._buf.append(f)
        self.frames += 1
        if seq in self._bytes:
            self._bytes[seq] += len(f)
            self.live_bytes += len(f)

    def _roll(self, checkpoint: bool) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._segment += 1
        name = jf.segment_name(self.arena.arena_id, self._segment)
        self._fd = create_private_file(self._dir_fd, name, jf.FILE_MODE)
        head = jf.frame(jf.SegmentHead(jf.JOURNAL_VERSION, self.arena.arena_id, self.arena.capacity, self._segment,
                                       checkpoint, os.getpid()))
        os.write(self._fd, head)
        self._segment_bytes = len(head)
        self._sizes[self._segment] = self._segment_bytes

    def _collect(self) -> None:
        """Remove closed segments below every held capture's first; relocate the oldest captures when
        old segments hold much more than the held captures need."""
        low = min(self._first.values(), default=self._segment)
        for seg in [s for s in self._sizes if s < low and s != self._segment]:
            self._unlink(seg)
        total = sum(self._sizes.values())
        if total <= max(MIN_RELOCATE_BYTES, 2 * self.live_bytes) or low >= self._segment:
            return
        budget = RELOCATE_PER_FLUSH
        for seq in sorted((s for s, f in self._first.items() if f == low), key=lambda s: s):
            if budget <= 0:
                break
            e = self._entries[seq]
            self.live_bytes -= self._bytes[seq]
            self._bytes[seq] = 0
            self._first[seq] = self._segment
            for f in entry_frames(e, self.arena, self._endings.get(seq)):
                self._append(seq, f)
                budget -= len(f)
                self.relocated_bytes += len(f)

    def _unlink(self, seg: int) -> None:
        self._sizes.pop(seg, None)
        try:
            os.unlink(jf.segment_name(self.arena.arena_id, seg), dir_fd=self._dir_fd)
        except OSError:
            pass

    def _remove_all(self) -> None:
        for seg in list(self._sizes):
            self._unlink(seg)

    def _fail(self, e: OSError) -> None:
        if self.failed:
            return
        self.failed = str(e.strerror or e)
        log.error("arena journal in %s: %s; journaling stops (a restart will not adopt this run's captures)",
                  self.directory, self.failed)
        self._buf.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._remove_all()
        self._entries.clear()
        self._first.clear()
        self._bytes.clear()
        self._endings.clear()

