"""The daemon's ring side: finding rings, opening them, watching their writers, polling them into the
reassemblers, and retiring or dropping them.

Methods of the Daemon (daemon/server.py), which owns the state they use: the open rings
(`_rings`, `_order`, `_by_pidfd`, `_broken`), the ring directory (`_dir`, `access`), the
reassemblers (`_reasm`) and the counters. Their rules are the module docstring of daemon/server.py:
a ring's bytes are decoded against a schema, a ring that changes under the daemon is dropped with
one line and its captures end, a writer's death ends its captures after what its ring still holds
is read, and each ring is read a bounded amount per round. After each poll of a ring the reassembler
is told how far its writer had written and how far it is read (`ring_read`; the captures whose
Barrier that passes end), and when a ring is no longer read (`ring_closed`).
"""

from __future__ import annotations

import logging
import os
import select
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap.doorbell import Doorbell
from vllm_tap.ring_files import RingFormatError
from vllm_tap.ring_reader import RingBroken, RingReader
from vllm_tap.ring_records import DataBatch
from vllm_tap.ring_schema import tensor_id
from vllm_tap.safe_paths import UnsafePath

from . import step_runs
from .discovery import Candidate
from .reassembly import RING_BROKEN, Reassembler
from .ring_lag import RingLag

log = logging.getLogger("vllm_tap.daemon.server")  # the daemon logs under one name, whichever side speaks

DISCOVERY_WALK = 4096  # directory entries looked at per discovery round
DISCOVERY_OPENS = 256  # candidate files tried per discovery round
RECENT_WRITE_NS = 10 * 10**9  # a ring written this recently counts as alive even if its pid is not
# visible (a writer in another pid namespace)
READ_BUDGET_BYTES = 16 << 20  # per ring per round, so one busy ring cannot starve the others
LOG_FIRST = 20  # refused ring files logged one by one; then a count per minute


@dataclass(eq=False)
class OpenRing:
    """A ring the daemon reads, and what it knows of its writer."""

    reader: RingReader
    instance: str
    dir_fd: int
    alive: bool = True
    gone: bool = False  # writer_gone reported
    checked: float = 0.0
    pidfd: int | None = None
    exited_at_cursor: int | None = None  # where the ring was when its writer's pidfd said it exited
    sink_failures: int = 0  # reader.sink_failures already counted by the arena
    lag: RingLag = field(default_factory=RingLag)  # how long its oldest unread byte has waited

    @property
    def path(self) -> str:
        return self.reader.path

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.reader.name)


class RingSide:
    """The ring side of the Daemon (mixed into it)."""

    def _reassembler(self, instance: str) -> Reassembler:
        r = self._reasm.get(instance)
        if r is None:
            r = self._reasm[instance] = Reassembler(instance, end_grace_s=self.config.end_grace_s,
                                                    alloc=self.arena.alloc if self.arena is not None else None)
        return r

    def _sink(self, instance: str) -> Any:
        """Where a ring's DATA payloads go: the places reassembly picks in the arena."""
        reasm = self._reassembler(instance)

        def sink(plan: Any, i: int) -> Any:
            h = plan.h
            return reasm.target(plan.request_id(i), h.step, tensor_id(h.tensor, h.layer), h.slice_start, h.slice_stop, h.full_dim,
                                plan.part_rows(i), plan.dtype)

        return sink

    def _batch_alloc(self, nbytes: int) -> Any:
        """Where a record read whole (a DataBatch), or a run of steps, goes: one region of the arena
        for all of it, every byte of which the caller writes (the read, or step_runs.join)."""
        return self.arena.alloc((nbytes,), np.uint8, overwrite=True) if self.arena is not None else None

    def _discover(self, now: float) -> None:
        if self._doorbell is None:
            self._doorbell = Doorbell.bind(self.config.shm_dir)
        for c in self._dir.step(now, DISCOVERY_WALK, DISCOVERY_OPENS):
            self._open(c, now)
        if self._dir.changed:
            changed, self._dir.changed = self._dir.changed, set()
            for key in changed:
                ring = self._rings.get(key)
                if ring is not None and ring.reader.replaced(ring.dir_fd):
                    self._retire(ring, now, "replaced or removed")

    def _open(self, c: Candidate, now: float) -> None:
        old = self._rings.get(c.key)
        if old is not None:
            if not old.reader.replaced(old.dir_fd):
                return
            self._retire(old, now, "replaced")
        path = os.path.join(self.config.shm_dir, c.instance, c.name)
        try:
            reader = RingReader(path, dir_fd=c.dir_fd, name=c.name)
            why = self.access.files.problem(os.fstat(reader.fileno()))
            if why:
                reader.close()
                raise UnsafePath(f"{why} (ring_group / ring_owners / ring_mode)")
        except (RingFormatError, OSError, ValueError, UnsafePath) as e:
            inode = c.inode
            if inode is None:
                try:
                    inode = os.stat(c.name, dir_fd=c.dir_fd, follow_symlinks=False).st_ino
                except OSError:
                    inode = None
            self._dir.reject(c, inode)
            self.counters.rings_refused += 1
            if self._refusal_logs > 0:
                self._refusal_logs -= 1
                log.warning("ignoring %s: %s%s", path, e, "" if self._refusal_logs else
                            " (further refused files are only counted: `vllm-tap status`)")
            return
        reader.sink = self._sink(c.instance)
        reader.batch_alloc = self._batch_alloc
        reader.copier = self.copier
        ring = self._rings[c.key] = OpenRing(reader, c.instance, c.dir_fd, checked=now)
        if reader.resumed:
            self._reassembler(c.instance).resumed_ring(reader.name)
        self._watch_writer(ring, now)
        self._order = sorted(self._rings.values(),
                             key=lambda r: (r.reader.rank != rf.ENGINE_RANK, r.instance, r.reader.rank))
        log.info("reading ring %s (instance %s, rank %d, writer pid %d, epoch %d%s)", path, c.instance,
                 reader.rank, reader.writer_pid, reader.epoch, ", resuming a previous reader's cursor" if reader.resumed else "")

    def _watch_writer(self, ring: OpenRing, now: float) -> None:
        """A pidfd for the writer where its pid is visible here; else kill(pid, 0) every second."""
        try:
            fd = os.pidfd_open(ring.reader.writer_pid)
        except (OSError, AttributeError):
            self._check_alive(ring, now)
            return
        ring.pidfd = fd
        self._by_pidfd[fd] = ring
        self._fd_events.register(fd, select.POLLIN)
        self._check_fds(now)

    def _unwatch_writer(self, ring: OpenRing) -> None:
        if ring.pidfd is not None:
            self._by_pidfd.pop(ring.pidfd, None)
            try:
                self._fd_events.unregister(ring.pidfd)
            except KeyError:
                pass
            os.close(ring.pidfd)
            ring.pidfd = None

    def _check_fds(self, now: float) -> None:
        """pidfds of writers that exited (and inotify, which discovery reads itself)."""
        if not self._by_pidfd:
            return
        for fd, _ in self._fd_events.poll(0):
            ring = self._by_pidfd.get(fd)
            if ring is not None:
                self._writer_exited(ring, now)

    def _writer_exited(self, ring: OpenRing, now: float) -> None:
        self._unwatch_writer(ring)
        self._drain(ring)  # what it committed before it died still counts
        if ring.key not in self._rings:
            return
        self.counters.writers_exited += 1
        try:
            ring.exited_at_cursor = ring.reader.write_cursor()
        except (RingBroken, OSError):
            ring.exited_at_cursor = None
        ring.alive = False
        if not ring.gone:
            ring.gone = True
            log.info("writer %d of %s exited", ring.reader.writer_pid, ring.path)
            self._reassembler(ring.instance).writer_gone(ring.reader.name, now)

    def _check_rings(self, now: float) -> None:
        for ring in list(self._rings.values()):
            if ring.reader.replaced(ring.dir_fd):
                self._retire(ring, now, "replaced or removed")
                continue
            try:
                ring.reader.check()
            except (RingBroken, OSError) as e:
                self._break(ring, now, str(e))
                continue
            if ring.pidfd is None and ring.exited_at_cursor is None:
                self._check_alive(ring, now)
            elif ring.exited_at_cursor is not None:
                self._written_after_exit(ring)

    def _written_after_exit(self, ring: OpenRing) -> None:
        """A ring still written after its writer's pid exited: the pid was another process (the writer
        lives in another pid namespace). Fall back to kill(pid, 0) and recent writes."""
        try:
            w = ring.reader.write_cursor()
        except (RingBroken, OSError):
            return
        if ring.exited_at_cursor is not None and w > ring.exited_at_cursor:
            log.warning("ring %s is still written after pid %d exited: its writer is in another pid namespace? "
                        "Run the daemon in vLLM's.", ring.path, ring.reader.writer_pid)
            ring.exited_at_cursor = None
            ring.gone = False
            ring.alive = True

    def _check_alive(self, ring: OpenRing, now: float) -> None:
        alive = ring.reader.writer_alive()
        if not alive:
            try:
                last = ring.reader.info().stats["last_write_ns"]
            except (RingBroken, OSError):
                last = 0
            alive = last > 0 and time.time_ns() - last < RECENT_WRITE_NS
        ring.alive = alive
        if not alive and not ring.gone:
            ring.gone = True
            log.info("writer %d of %s is gone", ring.reader.writer_pid, ring.path)
            self._drain(ring)
            self._reassembler(ring.instance).writer_gone(ring.reader.name, now)
        elif alive:
            ring.gone = False

    def _retire(self, ring: OpenRing, now: float, why: str) -> None:
        """The path names another file now (the writer restarted) or none: finish the old one first,
        it may hold records committed before the writer went away."""
        self._drain(ring)
        self._close_ring(ring)
        reasm = self._reassembler(ring.instance)
        reasm.writer_gone(ring.reader.name, now)
        self._dispatch(reasm.ring_closed(ring.reader.name, now), now)
        log.info("ring %s %s (epoch %d done)", ring.path, why, ring.reader.epoch)

    def _break(self, ring: OpenRing, now: float, why: str) -> None:
        """The file changed under us: stop reading it at once, say so, end its captures."""
        self.counters.rings_broken += 1
        log.error("ring %s: %s; no longer read (its captures end)", ring.path, why)
        self._broken.append({"path": ring.path, "instance": ring.instance, "why": why, "at": time.time()})
        del self._broken[:-100]
        self._close_ring(ring)
        reasm = self._reassembler(ring.instance)
        reasm.writer_gone(ring.reader.name, now, RING_BROKEN)
        self._dispatch(reasm.ring_closed(ring.reader.name, now), now)
        self._dir.reject(Candidate(ring.instance, ring.reader.name, ring.dir_fd, None), ring.reader.inode)

    def _close_ring(self, ring: OpenRing) -> None:
        if self._rings.get(ring.key) is ring:
            del self._rings[ring.key]
        self._unwatch_writer(ring)
        r, c = self._closed_ring_counts
        self._closed_ring_counts = (r + ring.reader.rejected, c + ring.reader.corrupt)
        ring.reader.close()
        self._order = [x for x in self._order if x is not ring]

    def _poll_ring(self, ring: OpenRing) -> int:
        try:
            recs = ring.reader.poll(max_bytes=READ_BUDGET_BYTES)
        except (RingBroken, OSError) as e:
            self._break(ring, time.monotonic(), str(e))
            return 0
        if ring.reader.sink_failures != ring.sink_failures and self.arena is not None:
            self.arena.write_failed(ring.reader.sink_failures - ring.sink_failures,
                                    "a region handed out could not be written (EFAULT)")
            ring.sink_failures = ring.reader.sink_failures
        reader = ring.reader
        if recs:
            reader.read_ahead()  # the next large record copies while these are handled
        reasm = self._reassembler(ring.instance)
        now = time.monotonic()  # the read time: delivery latency is measured from here
        ring.lag.observe(reader.read_cursor, reader.written, now)
        rejections = ring.reader.rejections
        n = len(recs) + len(rejections)
        c = self.counters
        for start, run in step_runs.plan(recs, {rej.index for rej in rejections}):
            while rejections and rejections[0].index <= start:  # in the order they were read
                self._rejected(reasm, rejections.popleft(), now)
            rec = run[0]
            if len(run) > 1:
                try:
                    rec = step_runs.join(run, self._batch_alloc)
                    c.steps_joined += len(run)
                except Exception:  # never worth a capture: feed its steps one by one
                    log.exception("decode steps from %s could not be joined", ring.path)
                    for b in run[:-1]:
                        self._feed(reasm, b, now, ring)
                    rec = run[-1]
            self._feed(reasm, rec, now, ring)
        while rejections:
            self._rejected(reasm, rejections.popleft(), now)
        # After what was read is fed: captures waiting for this ring to be read this far end now.
        self._dispatch(reasm.ring_read(reader.name, reader.read_cursor, reader.written, now), now)
        return n

    def _feed(self, reasm: Reassembler, rec: Any, now: float, ring: OpenRing) -> None:
        c = self.counters
        batch = type(rec) is DataBatch
        c.records_in += rec.parts if batch else 1
        if batch:
            c.payload_bytes_in += rec.nbytes
        elif rec.data is not None:
            c.payload_bytes_in += rec.data.nbytes
        try:
            events = reasm.feed_batch(rec, now) if batch else reasm.feed(rec, now)
        except Exception:  # a bug here must cost one record, not the daemon and everyone's captures
            c.reassembly_errors += 1
            if c.reassembly_errors <= LOG_FIRST:
                log.exception("record of request %s from %s could not be reassembled",
                              rec.entries[0].request_id if batch else rec.request_id, ring.path)
            return
        self._dispatch(events, now)

    def _rejected(self, reasm: Reassembler, rej: Any, now: float) -> None:
        if rej.request_ids:
            self._dispatch(reasm.reject(rej.request_ids, rej.why, now), now)

    def _read_rings(self) -> bool:
        got = 0
        for ring in list(self._order):
            got += self._poll_ring(ring)
        return got > 0

    def _drain(self, ring: OpenRing) -> None:
        while ring.key in self._rings and self._poll_ring(ring):
            pass
