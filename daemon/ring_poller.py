"""The ring poller: finds the rings of every engine instance, opens them, watches their writers,
reads them a bounded amount per round, and tells its target (RingFacts: daemon/instances.py) what it
read and learnt: records, rejected records, how far a ring is read, a writer gone, a ring no longer
read.

It owns the open rings, the ring directory and the doorbell; nothing else touches them. Its rules
(daemon/server.py says them for the whole daemon): a ring's bytes are decoded against a schema; a
ring that changes under the daemon is dropped with one line and its captures end; a writer's death
ends its captures after what its ring (and the instance's other rings of dead writers) still holds
is read, in turns like any backlog; each ring is read a bounded amount per
turn, and a turn's reading takes a few milliseconds (READ_TURN_S), so requests are answered while
the daemon catches up. After each poll of a ring its target is told how far its writer had written and how far it
is read (`ring_read`: the captures whose Barrier that passes end), and when a ring is no longer
read (`ring_closed`).
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from vllm_tap import ring_format as rf
from vllm_tap.doorbell import Doorbell
from vllm_tap.ring_files import RingFormatError
from vllm_tap.ring_payload import Destination
from vllm_tap.ring_reader import Copier, RingBroken, RingReader
from vllm_tap.ring_records import DataRecord, Record
from vllm_tap.safe_paths import UnsafePath

from . import step_runs
from .access import RingAccess
from .discovery import Candidate, RingDirectory
from .events import RING_BROKEN, WRITER_GONE
from .ring_lag import RingLag

log = logging.getLogger(__name__)

DISCOVERY_WALK = 4096  # directory entries looked at per discovery round
DISCOVERY_OPENS = 256  # candidate files tried per discovery round
RECENT_WRITE_NS = 10 * 10**9  # a ring written this recently counts as alive even if its pid is not
# visible (a writer in another pid namespace)
READ_BUDGET_BYTES = 16 << 20  # per ring per turn, so one busy ring cannot starve the others
# A turn's reading stops once it has taken READ_TURN_S (each ring still gets one chunk a turn), so the
# loop answers requests between turns while it catches up on a backlog of thousands of steps. A
# chunk is what one poll of a ring reads: few enough records that handling them takes milliseconds,
# many enough that decode steps still join (daemon/step_runs.py).
READ_TURN_S = 0.005
READ_CHUNK_RECORDS = 256
READ_CHUNK_BYTES = 4 << 20
# A ring's file cursor stays below records whose data the daemon holds unfiled (so a daemon killed
# meanwhile reads them again) by at most capacity / HOLD_SHARE: the writer keeps its room.
HOLD_SHARE = 8
LOG_FIRST = 20  # refused ring files logged one by one; then a count per minute
KEEP_BROKEN = 100  # rings dropped because they changed under the daemon, remembered for `status`


class RingFacts(Protocol):
    """What the poller tells about the rings of each engine instance, in the order it learns it."""

    def ring_resumed(self, instance: str, ring: str, replay_until: int = 0) -> None:
        """`ring` was being read by a previous daemon (its read cursor was not at the start); its
        records below `replay_until` that previous daemon read, and its journal has what it filed
        of them (Reassembler.resumed_ring)."""

    def record(self, instance: str, record: Record, now: float, path: str) -> None:
        """A record read (`now`: when its poll read it)."""

    def rejected(self, instance: str, request_ids: tuple[str, ...], why: str, now: float) -> None:
        """A record that did not fit the ring schema, naming these captures."""

    def ring_read(self, instance: str, ring: str, read: int, written: int, now: float) -> None:
        """A poll of `ring` is done: its writer had written up to `written`, everything below `read`
        was read and told."""

    def writer_gone(self, instance: str, ring: str, now: float, reason: str) -> None:
        """The ring's writer died or was replaced and its ring was drained (or the ring broke)."""

    def ring_closed(self, instance: str, ring: str, now: float) -> None:
        """`ring` is no longer read (replaced, removed, broken)."""


@dataclass
class RingCounters:
    """What the poller counts, reported by the status view."""

    records_in: int = 0
    payload_bytes_in: int = 0
    steps_joined: int = 0  # decode steps of the same captures read in one round, handled as one (step_runs)
    doorbell_wakeups: int = 0
    rings_refused: int = 0
    rings_broken: int = 0
    writers_exited: int = 0
    rejected_closed: int = 0  # rejected records of rings no longer read
    corrupt_closed: int = 0  # corrupt records of rings no longer read


@dataclass(eq=False)
class OpenRing:
    """A ring the daemon reads, and what it knows of its writer."""

    reader: RingReader
    instance: str
    dir_fd: int
    alive: bool = True
    gone: bool = False  # writer_gone reported
    draining: bool = False  # its writer is gone: writer_gone is reported once it is read to its end ...
    drained: bool = False  # ... and so are the instance's other rings whose writers are gone
    checked: float = 0.0
    pidfd: int | None = None
    exited_at_cursor: int | None = None  # where the ring was when its writer's pidfd said it exited
    destination_failures: int = 0  # reader.destination_failures already counted by the arena
    lag: RingLag = field(default_factory=RingLag)  # how long its oldest unread byte has waited
    reported: int = -1  # the read cursor the last `uncommitted` reported
    target: int | None = None  # where `commit` moves its file's cursor

    @property
    def path(self) -> str:
        return self.reader.path

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.reader.name)


class RingPoller:
    """Every ring under shm_dir: found, opened, read into `facts`."""

    def __init__(self, shm_dir: str, access: RingAccess, facts: RingFacts):
        self.shm_dir = shm_dir
        self.access = access
        self._facts = facts
        self._dir = RingDirectory(shm_dir, root_rule=access.root, dir_rule=access.dirs)
        self._rings: dict[tuple[str, str], OpenRing] = {}
        self._order: list[OpenRing] = []  # engine rings first: BEGINs are then usually read before their data
        self._by_pidfd: dict[int, OpenRing] = {}
        self._fd_events = select.poll()
        self.broken: list[dict[str, Any]] = []  # rings dropped because they changed under the daemon (the latest)
        self.doorbell: Doorbell | None = None  # writers wake the daemon through it; bound once shm_dir exists
        self.counters = RingCounters()
        self._refusal_logs = LOG_FIRST
        self._arena: Any = None
        self._destination: Destination | None = None
        self._copier: Copier | None = None
        # A peer daemon (daemon/peer_link.py): each ring is read by this instead, its raw records
        # forwarded to the home daemon; returns how many it read.
        self.forward: Callable[[OpenRing], int] | None = None
        # With a journal (daemon/journal.py) a ring's file cursor moves only once what was read is
        # journaled (`commit`); `resume` has where an earlier run's journal says it had read to.
        self.defer_commit = False
        # (instance, ring) -> (epoch, cursor, read) (journal_format.Read)
        self.resume: dict[tuple[str, str], tuple[int, int, int]] = {}

    def use_arena(self, arena: Any, destination: Destination, copier: Copier | None) -> None:
        """Rings opened from now on read their payloads where `destination` says (the delivery arena,
        daemon/arena.py), large ones through `copier` (or None)."""
        self._arena = arena
        self._destination = destination
        self._copier = copier

    # -- what the daemon's loop asks --

    @property
    def rings(self) -> list[OpenRing]:
        """The open rings, engine rings first."""
        return self._order

    @property
    def discovery(self) -> str:
        return "inotify" if self._dir.watching else "scan"

    @property
    def uses_inotify(self) -> bool:
        return self._dir.fileno() is not None

    @property
    def dirs_refused(self) -> int:
        return self._dir.dirs_refused

    def wake_fds(self) -> set[int]:
        """Descriptors that should wake the loop: one pidfd per writer, and inotify."""
        want = set(self._by_pidfd)
        if self._dir.fileno() is not None:
            want.add(self._dir.fileno())
        return want

    def drain_doorbell(self) -> None:
        if self.doorbell is not None:
            self.counters.doorbell_wakeups += self.doorbell.drain()

    def arm(self) -> bool:
        """Raise every ring's waiting flag before sleeping, then look again (futex-style: a writer that
        committed before it saw the flag is found here; one that commits after it rings). False, with
        the flags lowered, when something is there to read."""
        readers = [r.reader for r in self._order]
        for r in readers:
            try:
                r.set_waiting(True)
            except OSError:
                pass  # a broken ring: the next read finds out
        with _FENCE:  # a locked instruction: our flag stores are visible before the cursor loads below
            pass
        if self.forward is not None:
            return True  # a peer reads within credit: what waits for credit must not keep the loop awake
        for r in readers:
            try:
                new = r.has_new()
            except Exception:  # noqa: BLE001 - RingBroken and the like: let the next round handle it
                new = True
            if new:
                self.disarm()
                return False
        return True

    def disarm(self) -> None:
        for ring in self._order:
            try:
                ring.reader.set_waiting(False)
            except OSError:
                pass

    def read(self, budget_s: float = READ_TURN_S) -> bool:
        """One turn: every ring in order, chunk by chunk until it is read to its end, READ_BUDGET_BYTES
        of it are read or the turn has taken `budget_s` (after that, one chunk for each ring left);
        True if anything was read."""
        got = 0
        deadline = time.monotonic() + budget_s
        for ring in list(self._order):
            start = ring.reader.read_cursor
            while True:
                n = self._poll_ring(ring)
                got += n
                if not n and (ring.draining or ring.drained) and ring.key in self._rings:
                    self._drained(ring, time.monotonic())
                if (not n or ring.key not in self._rings or time.monotonic() >= deadline
                        or ring.reader.read_cursor - start >= READ_BUDGET_BYTES):
                    break
        return got > 0

    def discover(self, now: float) -> None:
        if self.doorbell is None:
            self.doorbell = Doorbell.bind(self.shm_dir)
        for c in self._dir.step(now, DISCOVERY_WALK, DISCOVERY_OPENS):
            self._open(c, now)
        if self._dir.changed:
            changed, self._dir.changed = self._dir.changed, set()
            for key in changed:
                ring = self._rings.get(key)
                if ring is not None and ring.reader.replaced(ring.dir_fd):
                    self._retire(ring, now, "replaced or removed")

    def check_writers(self, now: float) -> None:
        """pidfds of writers that exited (and inotify, which discovery reads itself)."""
        if not self._by_pidfd:
            return
        for fd, _ in self._fd_events.poll(0):
            ring = self._by_pidfd.get(fd)
            if ring is not None:
                self._writer_exited(ring, now)

    def check_rings(self, now: float) -> None:
        """Every ring: replaced, changed size, or its writer gone (where no pidfd tells)."""
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

    def floors(self, every: bool) -> dict[tuple[str, str, int], int]:
        """(instance, ring, epoch) -> the cursor its file has, of the rings read since the last
        `uncommitted` and of those whose file's cursor is behind what was read (a hold may have
        gone), if any ring was read since (or `every`); else none."""
        order = self._order
        if not every and all(r.reader.read_cursor == r.reported for r in order):
            return {}
        return {(r.instance, r.reader.name, r.reader.epoch): r.reader.committed for r in order
                if r.reader.uncommitted or r.reader.read_cursor != r.reported}

    def uncommitted(self, floors: dict[tuple[str, str, int], int],
                    holds: dict[tuple[str, str, int], int]) -> list[tuple[str, str, int, int, int]]:
        """(instance, ring, epoch, cursor, read) (journal_format.Read) of the rings in `floors` whose
        read or file cursor is to move: `cursor` is where `commit` moves the file's, the lowest record
        whose data `holds` says is still held unfiled, else what was read. A hold more than
        capacity / HOLD_SHARE behind what was read is given up: the writer keeps its room."""
        out = []
        for r in self._order:
            reader = r.reader
            key = (r.instance, reader.name, reader.epoch)
            if key not in floors:
                continue
            read = reader.read_cursor
            h = holds.get(key)
            target = h if h is not None and read - h <= reader.capacity // HOLD_SHARE else read
            if read == r.reported and target == reader.committed:
                continue
            r.reported = read
            r.target = target
            out.append((*key, target, read))
        return out

    def commit(self) -> None:
        """Every ring's file cursor to where `uncommitted` said (the daemon journaled it)."""
        for r in self._order:
            if r.target is not None:
                try:
                    r.reader.commit(r.target)
                except OSError:
                    pass  # a ring that went bad: its next poll finds out
                r.target = None

    def close(self) -> None:
        for ring in list(self._rings.values()):
            self._close_ring(ring)  # closing commits each ring's read cursor
        self._order = []
        self._dir.close()
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None

    # -- opening --

    def _open(self, c: Candidate, now: float) -> None:
        old = self._rings.get(c.key)
        if old is not None:
            if not old.reader.replaced(old.dir_fd):
                return
            self._retire(old, now, "replaced")
        path = os.path.join(self.shm_dir, c.instance, c.name)
        try:
            reader = RingReader(path, dir_fd=c.dir_fd, name=c.name, destination=self._destination, copier=self._copier)
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
        reader.defer_commit = self.defer_commit
        ring = self._rings[c.key] = OpenRing(reader, c.instance, c.dir_fd, checked=now)
        epoch, cursor, read = self.resume.pop(c.key, (None, 0, 0))
        replay = 0
        if epoch == reader.epoch:
            if reader.skip_to(cursor):
                log.info("ring %s: read on from %d, where the earlier run's journal says it had read to", path,
                         cursor)
            if reader.read_cursor < read <= reader.read_cursor + reader.capacity and not read % rf.ALIGN:
                replay = read
                log.info("ring %s: %d bytes the earlier run read are read again for the data it held unfiled",
                         path, read - reader.read_cursor)
        if reader.resumed or replay:
            self._facts.ring_resumed(c.instance, reader.name, replay)
        self._watch_writer(ring, now)
        self._order = sorted(self._rings.values(),
                             key=lambda r: (r.reader.rank != rf.ENGINE_RANK, r.instance, r.reader.rank))
        log.info("reading ring %s (instance %s, rank %d, writer pid %d, epoch %d%s)", path, c.instance,
                 reader.rank, reader.writer_pid, reader.epoch, ", resuming a previous reader's cursor" if reader.resumed else "")

    def _block(self, nbytes: int) -> Any:
        """Where a run of steps joined goes (step_runs.join): one block of the destination."""
        return self._destination.block(nbytes) if self._destination is not None else None

    # -- writers --

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
        self.check_writers(now)

    def _unwatch_writer(self, ring: OpenRing) -> None:
        if ring.pidfd is not None:
            self._by_pidfd.pop(ring.pidfd, None)
            try:
                self._fd_events.unregister(ring.pidfd)
            except KeyError:
                pass
            os.close(ring.pidfd)
            ring.pidfd = None

    def _writer_exited(self, ring: OpenRing, now: float) -> None:
        self._unwatch_writer(ring)
        self.counters.writers_exited += 1
        try:
            ring.exited_at_cursor = ring.reader.write_cursor()
        except (RingBroken, OSError):
            ring.exited_at_cursor = None
        ring.alive = False
        if not ring.gone:
            log.info("writer %d of %s exited", ring.reader.writer_pid, ring.path)
            ring.draining = True  # what it committed before it died still counts: read in turns, then gone

    def _drained(self, ring: OpenRing, now: float) -> None:
        """A ring whose writer is gone, read to its end. Its writer is reported gone once every ring
        of the instance whose writer is gone is read to its end: the engine ring is small and read
        first, and its writer gone ends the instance's captures, while what the workers wrote before
        they died may still be in their rings (one process may write both)."""
        ring.draining = False
        ring.drained = True
        same = [r for r in self._order if r.instance == ring.instance]
        if any(r.draining for r in same):
            return
        for r in same:
            if r.drained:
                r.drained = False
                if not r.gone:
                    r.gone = True
                    self._facts.writer_gone(r.instance, r.reader.name, now, WRITER_GONE)

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
            ring.draining = ring.drained = False
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
        if not alive and not ring.gone and not ring.draining and not ring.drained:
            log.info("writer %d of %s is gone", ring.reader.writer_pid, ring.path)
            ring.draining = True  # read in turns, then gone (_drained)
        elif alive:
            ring.gone = False
            ring.draining = ring.drained = False

    # -- closing --

    def _retire(self, ring: OpenRing, now: float, why: str) -> None:
        """The path names another file now (the writer restarted) or none: finish the old one first,
        it may hold records committed before the writer went away."""
        self._drain(ring)
        self._close_ring(ring)
        self._facts.writer_gone(ring.instance, ring.reader.name, now, WRITER_GONE)
        self._facts.ring_closed(ring.instance, ring.reader.name, now)
        log.info("ring %s %s (epoch %d done)", ring.path, why, ring.reader.epoch)

    def _break(self, ring: OpenRing, now: float, why: str) -> None:
        """The file changed under us: stop reading it at once, say so, end its captures."""
        self.counters.rings_broken += 1
        log.error("ring %s: %s; no longer read (its captures end)", ring.path, why)
        self.broken.append({"path": ring.path, "instance": ring.instance, "why": why, "at": time.time()})
        del self.broken[:-KEEP_BROKEN]
        self._close_ring(ring)
        self._facts.writer_gone(ring.instance, ring.reader.name, now, RING_BROKEN)
        self._facts.ring_closed(ring.instance, ring.reader.name, now)
        self._dir.reject(Candidate(ring.instance, ring.reader.name, ring.dir_fd, None), ring.reader.inode)

    def _close_ring(self, ring: OpenRing) -> None:
        if self._rings.get(ring.key) is ring:
            del self._rings[ring.key]
        self._unwatch_writer(ring)
        self.counters.rejected_closed += ring.reader.rejected
        self.counters.corrupt_closed += ring.reader.corrupt
        ring.reader.close()
        self._order = [x for x in self._order if x is not ring]

    # -- reading --

    def _poll_ring(self, ring: OpenRing) -> int:
        try:
            if self.forward is not None:
                return self.forward(ring)
            recs = ring.reader.poll(max_records=READ_CHUNK_RECORDS, max_bytes=READ_CHUNK_BYTES)
        except (RingBroken, OSError) as e:
            self._break(ring, time.monotonic(), str(e))
            return 0
        reader = ring.reader
        if reader.destination_failures != ring.destination_failures and self._arena is not None:
            self._arena.write_failed(reader.destination_failures - ring.destination_failures,
                                     "a region handed out could not be written (EFAULT)")
            ring.destination_failures = reader.destination_failures
        if recs:
            reader.read_ahead()  # the next large record copies while these are handled
        now = time.monotonic()  # the read time: delivery latency is measured from here
        ring.lag.observe(reader.read_cursor, reader.written, now)
        instance, facts, c = ring.instance, self._facts, self.counters
        rejections = reader.rejections
        n = len(recs) + len(rejections)
        for start, run in step_runs.runs(recs, {rej.index for rej in rejections}):
            while rejections and rejections[0].index <= start:  # in the order they were read
                self._rejected(instance, rejections.popleft(), now)
            rec = run[0]
            if len(run) > 1:
                try:
                    rec = step_runs.join(run, self._block)
                    c.steps_joined += len(run)
                except Exception:  # never worth a capture: feed its steps one by one
                    log.exception("decode steps from %s could not be joined", ring.path)
                    for b in run[:-1]:
                        self._count(b)
                        facts.record(instance, b, now, ring.path)
                    rec = run[-1]
            self._count(rec)
            facts.record(instance, rec, now, ring.path)
        while rejections:
            self._rejected(instance, rejections.popleft(), now)
        # After what was read is told: captures waiting for this ring to be read this far end now.
        facts.ring_read(instance, reader.name, reader.read_cursor, reader.written, now)
        return n

    def _count(self, rec: Record) -> None:
        c = self.counters
        if type(rec) is DataRecord:
            c.records_in += rec.n_slices
            c.payload_bytes_in += rec.nbytes
        else:
            c.records_in += 1

    def _rejected(self, instance: str, rej: Any, now: float) -> None:
        if rej.request_ids:
            self._facts.rejected(instance, rej.request_ids, rej.why, now)

    def _drain(self, ring: OpenRing) -> None:
        while ring.key in self._rings and self._poll_ring(ring):
            pass


_FENCE = threading.Lock()
