"""Adopting what an earlier daemon run left in its arena: its journal read back, checked, and turned
into captures again (retained ones fetchable and watchable under their sequence numbers, those in
flight continued by reassembly), their arrays the same bytes, in the same regions of the same file.

The journal (daemon/journal_format.py) and the arena are files of the daemon's own user in the
arena's directory. Nothing in them is trusted: segment files are opened without following links and
must be regular files of that user, no larger than MAX_SEGMENT_FILE; frames are decoded against the
schema, a torn or failing frame ends the replay there (what came before stands); every reference is
checked against the arena's bounds and its region's generation (a region freed after the journal
named it is not that capture's any more); positions must follow each other exactly as the daemon
files them. A capture whose log breaks these rules is not adopted, in one log line; its sequence
number is then reported to watchers as lost, as after any restart. Data whose reference fails is a
Gap `not captured: consumed by a previous daemon`, and its End says it is missing.

`replay` (bytes in, capture logs and ring cursors out) and `captures` (logs and an arena in, events out) are pure of
IO but the arena's memory; `find` reads the files.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field

import msgspec
import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap.arena_format import ARENA_PREFIX, arena_name
from vllm_tap.positions import PositionRanges
from vllm_tap.spec import CaptureSpec

from . import journal_format as jf
from .arena import Arena
from .events import NOT_CAPTURED_PREVIOUS, Begin, End, Event, Gap, Tokens, new_tokens

log = logging.getLogger(__name__)

MAX_SEGMENT_FILE = 1 << 30
MAX_POSITION = 1 << 31
_SPEC_ERRORS = (ValueError, TypeError, KeyError, msgspec.ValidationError)


@dataclass
class CaptureLog:
    began: jf.Began
    items: list = field(default_factory=list)  # jf.Data | jf.Hole, in the order filed
    ended: jf.Ended | None = None
    end_read: jf.Ending | None = None  # its END, read while positions were still to come


@dataclass
class Replayed:
    """What a journal says: the captures the arena holds, by seq (those it let go of are not among
    them), and how far each ring was read ((instance, ring) -> (epoch, cursor, read), jf.Read)."""

    logs: dict[int, CaptureLog] = field(default_factory=dict)
    reads: dict[tuple[str, str], tuple[int, int, int]] = field(default_factory=dict)


@dataclass
class Previous:
    """An earlier run's journal: the arena it indexes and its segments' bytes, in order."""

    arena_id: int
    names: list[str]
    blobs: list[bytes]


@dataclass
class Adopted:
    seq: int
    history: list[Event]  # Begin, Tokens and Gap in position order, End if it ended
    ended_wall: float | None  # time.time() of its End
    end_read: jf.Ending | None = None  # in flight: its END, read and not yet acted on


def find(directory: str) -> tuple[Previous | None, list[str]]:
    """The journal of the newest earlier run in `directory` whose arena file is still there, and the
    names of every other journal segment there (stale: to remove)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None, []
    try:
        names = os.listdir(dir_fd)
        runs: dict[int, list[tuple[int, str]]] = {}
        for name in names:
            parsed = jf.parse_name(name)
            if parsed is not None:
                runs.setdefault(parsed[0], []).append((parsed[1], name))
        arenas = {n for n in names if n.startswith(ARENA_PREFIX)}
        best: tuple[float, int] | None = None
        for arena_id, segs in runs.items():
            if arena_name(arena_id) not in arenas:
                continue
            newest = max(_mtime(dir_fd, name) for _, name in segs)
            if best is None or newest > best[0]:
                best = (newest, arena_id)
        stale = [name for aid, segs in runs.items() if best is None or aid != best[1] for _, name in segs]
        if best is None:
            return None, stale
        arena_id = best[1]
        segs = sorted(runs[arena_id])
        blobs = []
        for _, name in segs:
            blob = _read(dir_fd, directory, name)
            if blob is None:
                break  # what follows an unreadable segment cannot be replayed in order
            blobs.append(blob)
        return Previous(arena_id, [name for _, name in segs], blobs), stale
    finally:
        os.close(dir_fd)


def _mtime(dir_fd: int, name: str) -> float:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def _read(dir_fd: int, directory: str, name: str) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as e:
        log.warning("arena journal %s/%s cannot be opened (%s): not replayed", directory, name, e.strerror or e)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            log.warning("arena journal %s/%s is not a private file of this daemon's user: not replayed",
                        directory, name)
            return None
        if st.st_size > MAX_SEGMENT_FILE:
            log.warning("arena journal %s/%s is %d bytes, more than a segment can be: not replayed", directory, name,
                        st.st_size)
            return None
        chunks = []
        left = st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 16 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def replay(arena_id: int, blobs: list[bytes]) -> Replayed:
    """What the journal of `arena_id` says, from its segments' bytes in order."""
    out = Replayed()
    logs, reads = out.logs, out.reads
    for i, blob in enumerate(blobs):
        try:
            for k, entry in enumerate(jf.frames(blob)):
                t = type(entry)
                if k == 0:
                    if (t is not jf.SegmentHead or entry.version != jf.JOURNAL_VERSION  # type: ignore[union-attr]
                            or entry.arena_id != arena_id):  # type: ignore[union-attr]
                        raise jf.Torn("its first frame is not this journal's segment head")
                    if entry.checkpoint:  # type: ignore[union-attr]
                        logs.clear()
                    continue
                if t is jf.Began:
                    have = logs.get(entry.seq)  # type: ignore[union-attr]
                    if have is None or entry.reset:  # type: ignore[union-attr]
                        logs[entry.seq] = CaptureLog(entry)  # type: ignore[union-attr, arg-type]
                    elif have.ended is None:
                        have.began = entry  # type: ignore[assignment]
                elif t is jf.Data or t is jf.Hole:
                    have = logs.get(entry.seq)  # type: ignore[union-attr]
                    if have is not None and have.ended is None:
                        have.items.append(entry)
                elif t is jf.Ended:
                    have = logs.get(entry.seq)  # type: ignore[union-attr]
                    if have is not None and have.ended is None:
                        have.ended = entry  # type: ignore[assignment]
                elif t is jf.Ending:
                    have = logs.get(entry.seq)  # type: ignore[union-attr]
                    if have is not None and have.ended is None:
                        have.end_read = entry  # type: ignore[assignment]
                elif t is jf.Read:
                    reads[(entry.instance, entry.ring)] = (entry.epoch, entry.cursor, entry.read)  # type: ignore[union-attr]
                elif t is jf.Shed:
                    have = logs.get(entry.seq)  # type: ignore[union-attr]
                    if have is not None:
                        have.items = [jf.Hole(x.seq, x.start, x.start + len(x.token_ids) // 4, entry.reason)
                                      if type(x) is jf.Data else x for x in have.items]  # type: ignore[union-attr]
                elif t is jf.Forgot:
                    logs.pop(entry.seq, None)  # type: ignore[union-attr]
                else:
                    raise jf.Torn("a segment head inside a segment")
        except jf.Torn as e:
            log.warning("arena journal, segment %d of %d: %s; replayed up to there", i + 1, len(blobs), e)
            break
    return out


class Unfit(ValueError):
    """A capture's log breaks the journal's rules."""


def captures(logs: dict[int, CaptureLog], arena: Arena, now: float) -> list[Adopted]:
    """The captures of `logs`, their arrays adopted from `arena` (Arena.reopen; call end_adoption()
    after), in seq order. A log that breaks the rules is left out, in one log line."""
    out: list[Adopted] = []
    refused = 0
    for seq in sorted(logs):
        try:
            out.append(_capture(seq, logs[seq], arena, now))
        except (Unfit, ValueError, TypeError, KeyError, OverflowError) as e:
            refused += 1
            if refused <= 3:
                log.warning("capture seq %d of the earlier run's journal is not adopted: %s", seq, e)
    if refused > 3:
        log.warning("%d captures of the earlier run's journal not adopted in all", refused)
    return out


def _capture(seq: int, cl: CaptureLog, arena: Arena, now: float) -> Adopted:
    b = cl.began
    if seq < 1 or not b.request_id or len(b.request_id) > jf.MAX_NAME_CHARS or len(b.instance) > jf.MAX_NAME_CHARS:
        raise Unfit("its names are out of bounds")
    if b.n < 1 or b.num_prompt_tokens < 0 or (b.start_position is not None and not 0 <= b.start_position < MAX_POSITION):
        raise Unfit("its begin is out of bounds")
    _check_spec(b.spec, "its spec")
    origin = b.origin
    if origin is not None and (len(origin[0]) > jf.MAX_NAME_CHARS or origin[1] < 0 or origin[2] < 0):
        raise Unfit("its BEGIN record's place is out of bounds")
    begin = Begin(b.instance, b.request_id, b.tap_key, b.num_prompt_tokens, b.prompt_token_ids, b.n, b.model, b.spec,
                  b.start_position, b.lazy, False, now, b.source, origin)
    history: list[Event] = [begin]
    at: int | None = None
    for item in cl.items:
        if type(item) is jf.Hole:
            lo, hi = item.start, item.stop
            ev: Event = Gap(b.instance, b.request_id, range(lo, hi), item.reason, now)
        else:
            lo = item.start
            hi = lo + len(item.token_ids) // 4
            tok = _tokens(b, item, arena, now)
            if tok is None:  # its reference failed: a Gap, which the End counts as missing
                ev = Gap(b.instance, b.request_id, range(lo, hi), NOT_CAPTURED_PREVIOUS, now)
            else:
                ev = tok
        if not 0 <= lo < hi <= MAX_POSITION or (at is not None and lo != at):
            raise Unfit(f"positions [{lo}, {hi}) do not follow {at}")
        at = hi
        history.append(ev)
    ended_wall = None
    end_read = None
    if cl.ended is not None:
        history.append(_end(b, cl.ended, history, now))
        ended_wall = cl.ended.wall
    elif cl.end_read is not None:
        e = end_read = cl.end_read
        if (not 0 <= e.end_position < MAX_POSITION or len(e.output_token_ids) > MAX_POSITION
                or len(e.reason) > jf.MAX_NAME_CHARS or len(e.source or "") > jf.MAX_NAME_CHARS):
            raise Unfit("its END is out of bounds")
        _check_spec(e.spec, "its END's spec")
    return Adopted(seq, history, ended_wall, end_read)


def _check_spec(spec: dict | None, what: str) -> None:
    if spec is not None:
        try:
            CaptureSpec.from_meta(spec)
        except _SPEC_ERRORS as e:
            raise Unfit(f"{what} does not decode ({e})") from None


def _tokens(b: jf.Began, d: jf.Data, arena: Arena, now: float) -> Tokens | None:
    if len(d.token_ids) % 4 or not d.token_ids:
        raise Unfit("token ids of a data entry are not int32")
    n = len(d.token_ids) // 4
    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, int] = {}
    if not 1 <= len(d.tensors) <= jf.MAX_TENSORS:
        raise Unfit(f"a data entry with {len(d.tensors)} tensors")
    nbytes = 8 * n
    for ref in d.tensors:
        try:
            dt = rf.storage_dtype(ref.dtype)
        except (KeyError, ValueError):
            raise Unfit(f"tensor {ref.name!r} of dtype code {ref.dtype}") from None
        if ref.rows != n or not 1 <= ref.cols < jf.MAX_DIM or len(ref.name) > jf.MAX_NAME_CHARS or ref.name in tensors:
            raise Unfit(f"tensor {ref.name!r} of shape [{ref.rows}, {ref.cols}] for {n} positions")
        if ref.inline is not None:
            if len(ref.inline) != n * ref.cols * dt.itemsize:
                raise Unfit(f"tensor {ref.name!r}: {len(ref.inline)} inline bytes for [{n}, {ref.cols}]")
            arr = np.frombuffer(ref.inline, dt).reshape(n, ref.cols)
        else:
            region = arena.adopt_region(ref.block, ref.blocks, ref.gen)
            arr = arena.view(region, ref.offset, (n, ref.cols), dt) if region is not None else None
            if arr is None:
                return None
        tensors[ref.name] = arr
        dtypes[ref.name] = ref.dtype
        nbytes += arr.nbytes
    positions = np.arange(d.start, d.start + n, dtype=np.int32)
    token_ids = np.frombuffer(d.token_ids, "<i4").astype(np.int32)
    return new_tokens(b.instance, b.request_id, positions, token_ids, d.num_prompt_tokens, tensors, dtypes, now,
                      nbytes)


def _end(b: jf.Began, e: jf.Ended, history: list[Event], now: float) -> End:
    """The End as filed, made to agree with the history adopted: every Gap in it is missing (data the
    journal could not name, a reference that failed), and what was delivered is its data."""
    if any(not 0 <= lo < hi <= MAX_POSITION for lo, hi in e.missing) or len(e.output_token_ids) > MAX_POSITION:
        raise Unfit("its End's missing positions are out of bounds")
    gaps = [(ev.positions.start, ev.positions.stop) for ev in history if type(ev) is Gap]
    missing = PositionRanges([tuple(r) for r in e.missing]).union(gaps)
    if e.expected is not None:
        missing = missing.clip(*e.expected)
    delivered = sum(len(ev.positions) for ev in history if type(ev) is Tokens)
    return End(b.instance, b.request_id, e.reason, e.num_prompt_tokens, e.num_output_tokens, list(e.output_token_ids),
               e.end_position, tuple(e.expected) if e.expected is not None else None, missing, delivered, now,
               e.source)
