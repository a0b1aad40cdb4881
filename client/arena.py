"""The subscriber's read-only view of the daemon's delivery arena (layout: vllm_tap.arena_format).

A subscriber on the same host maps the arena the daemon names in its first reply and copies each
array out of it once. Rules:
- The map is read-only (O_RDONLY, PROT_READ): nothing here can change what the daemon or other
  subscribers see. Opening goes through O_NOFOLLOW, a regular file only, its header checked
  (magic, version, size, and the arena id the daemon advertised).
- Descriptors come from the daemon over ZeroMQ and are checked against the mapped size before any
  byte is read; a bad one is a ProtocolError, never a read outside the map.
- Never garbage: `copy_out` copies, then reads the region's generation; if it moved, the daemon
  freed the region under us (we were too slow and it was evicted or cut) and the copy is thrown
  away: the caller turns those positions into a Gap with OVERWRITTEN as its reason.
- Mappings are shared per (path, arena id) within the process and kept for its life (a few
  page-table entries; closing one under a live numpy view would crash).
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import threading
from typing import Any, Sequence

import numpy as np

from vllm_tap import arena_format as af
from vllm_tap import ring_format as rf
from vllm_tap import wire_format as wf

log = logging.getLogger(__name__)

OVERWRITTEN = "overwritten: the daemon reused the arena region before this subscriber copied it (subscriber too slow)"


class ArenaError(OSError):
    """The arena cannot be mapped here (another host or container, no permission, another version)."""


class ArenaView:
    def __init__(self, path: str, arena_id: int):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            raise ArenaError(e.errno, f"cannot open the daemon's arena {path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ArenaError(0, f"{path} is not a regular file")
            head = os.pread(fd, af.HEADER.size, 0)
            if len(head) < af.HEADER.size:
                raise ArenaError(0, f"{path} is too short for an arena header")
            (magic, version, header_size, aid, capacity, block, _flags, n_blocks, gen_off, data_off, _pid,
             _ns) = af.HEADER.unpack(head)
            if magic != af.ARENA_MAGIC or version != af.ARENA_FORMAT_VERSION:
                raise ArenaError(0, f"{path}: not an arena of format v{af.ARENA_FORMAT_VERSION}")
            if aid != arena_id:
                raise ArenaError(0, f"{path} is arena {aid:016x}, the daemon named {arena_id:016x}")
            if (header_size, block) != (af.HEADER_SIZE, af.BLOCK) or af.layout(capacity) != (
                    n_blocks, gen_off, data_off, st.st_size):
                raise ArenaError(0, f"{path}: inconsistent arena header")
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.path = path
        self.arena_id = arena_id
        self.capacity = capacity
        self.n_blocks = n_blocks
        self._mm = mm
        self._gens = np.frombuffer(mm, "<u8", count=n_blocks, offset=gen_off)
        self._data = np.frombuffer(mm, np.uint8, count=capacity, offset=data_off)
        self.overwritten = 0

    def copy_out(self, descs: Sequence[Sequence[Any]]) -> dict[str, tuple[int, np.ndarray]] | None:
        """(dtype code, private array) per name, or None when any region was reused before it was
        copied (OVERWRITTEN). A name may come several times (a run of records in one message): its
        parts are stacked row-wise, in order, into one array. ValueError for a descriptor that does
        not fit the arena, or parts of one name that do not stack."""
        parts: dict[str, list[tuple[int, int, int, int]]] = {}
        codes: dict[str, int] = {}
        checks = []
        data_len = self.capacity
        for d in descs:
            try:
                name, dtype_name, rows, cols, block, gen, offset = d
                code = rf.DTYPE_BY_NAME[dtype_name]
                rows, cols, block, gen, offset = int(rows), int(cols), int(block), int(gen), int(offset)
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"bad arena descriptor {d!r}") from None
            n = rows * cols * _ITEMSIZE[code]
            if (rows < 0 or cols < 0 or not 0 <= block < self.n_blocks or offset < block * af.BLOCK
                    or offset + n > data_len):
                raise ValueError(f"arena descriptor {d!r} lies outside the arena of {self.capacity} bytes")
            if codes.setdefault(name, code) != code or (name in parts and parts[name][0][1] != cols):
                raise ValueError(f"arena descriptors of {name!r} do not stack: {d!r}")
            parts.setdefault(name, []).append((rows, cols, offset, n))
            checks.append((block, gen))
        out: dict[str, tuple[int, np.ndarray]] = {}
        data = self._data
        for name, ps in parts.items():
            dt = _STORAGE[codes[name]]
            if len(ps) == 1:  # one memcpy into a private array (numpy's copy of a slice of the map)
                rows, cols, offset, n = ps[0]
                arr = data[offset : offset + n].copy().view(dt).reshape(rows, cols)
            else:  # each part once, straight into its rows of the one array
                total = sum(p[3] for p in ps)
                flat = np.empty(total, np.uint8)
                at = 0
                for _rows, _cols, offset, n in ps:
                    flat[at : at + n] = data[offset : offset + n]
                    at += n
                arr = flat.view(dt).reshape(sum(p[0] for p in ps), ps[0][1])
            out[name] = (codes[name], arr)
        # After every copy: a region freed (and maybe rewritten) meanwhile shows a new generation.
        gens = self._gens
        for block, gen in checks:
            if int(gens[block]) != gen:
                self.overwritten += 1
                return None
        return out


_STORAGE = {code: rf.storage_dtype(code) for code in rf.DTYPE_NAMES}
_ITEMSIZE = {code: dt.itemsize for code, dt in _STORAGE.items()}
_views: dict[tuple[str, int], ArenaView] = {}
_failed: dict[tuple[str, int], str] = {}
_lock = threading.Lock()


def view(path: str, arena_id: int) -> ArenaView:
    """The process's mapping of an arena (ArenaError, remembered, when it cannot be mapped here)."""
    key = (path, arena_id)
    with _lock:
        v = _views.get(key)
        if v is not None:
            return v
        why = _failed.get(key)
        if why is not None:
            raise ArenaError(0, why)
        try:
            v = _views[key] = ArenaView(path, arena_id)
        except (ArenaError, OSError, ValueError) as e:
            _failed[key] = str(e)
            # Once per arena and process: the data is the same, the path slower (and the operator's
            # access model is probably not what they meant: docs/operate.md, "Access model").
            log.warning("delivery through shared memory unavailable (%s): payloads come as frames (slower)", e)
            raise ArenaError(0, str(e)) from None
        return v


def wanted(endpoint: str) -> bool:
    """Whether to offer to map the arena: ipc:// endpoints only (same host by construction; over tcp
    the daemon is taken to be remote), and not when VLLM_TAP_ARENA=0."""
    return endpoint.startswith("ipc://") and os.environ.get("VLLM_TAP_ARENA", "1") not in ("0", "false", "no")


class ArenaUse:
    """One subscription's or watch's use of the arena: whether it offers to map it, and the view of
    the one the daemon named in its first reply."""

    def __init__(self, endpoint: str):
        self.offer = wanted(endpoint)
        self.view: ArenaView | None = None

    def advert(self, adv: Any) -> bool:
        """Take the daemon's [path, arena_id] (None: it sends frames). False when it cannot be mapped
        here: the caller asks again, under a new id, without offering."""
        if adv is None or not self.offer:
            self.view = None
            return True
        try:
            path, arena_id = adv
            self.view = view(str(path), int(arena_id))
        except (ArenaError, TypeError, ValueError):
            self.offer = False
            self.view = None
            return False
        return True

    def tensors(self, m: wf.TokensReply) -> dict[str, tuple[int, np.ndarray]] | None:
        """The arrays a tokens message describes, copied out; None when the arena reused a region first.
        ValueError for a message naming another arena or a descriptor outside it."""
        v = self.view
        if v is None or m.arena != v.arena_id:
            raise ValueError(f"tokens in arena {m.arena!r}, but this subscription maps "
                             f"{'none' if v is None else format(v.arena_id, '016x')}")
        return v.copy_out(m.tensors)
