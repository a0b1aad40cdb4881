"""Test helper: write ring files byte by byte, as a hostile or broken writer could.

RingForge lays out a ring exactly as ring_format draws it, but takes whatever it is given for the
key, the meta (any msgpack-able object) and the request table, so tests can put the records an
attacker would into a real file under the shm directory and watch a real daemon read it. It never
uses RingWriter, so it keeps working whatever the writer's internals become.
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Any

import msgpack
import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap.doorbell import DoorbellPush, doorbell_path
from vllm_tap.ring_files import ring_path


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def control(kind: rf.RecordKind, request_id: str | bytes, meta: Any, tap_key: str = "", *,
            raw_meta: bytes | None = None, rank: int = rf.ENGINE_RANK) -> bytes:
    rid = request_id.encode() if isinstance(request_id, str) else request_id
    key = rid + rf.control_key("", tap_key)
    mb = raw_meta if raw_meta is not None else pack(meta)
    *_, payload_off = rf.body_layout(len(key), len(mb), 0)
    total = rf.align_up(payload_off)
    buf = bytearray(total)
    rf.pack_record_header(buf, 0, total=total, kind=int(kind), rank=rank, payload_off=payload_off, key_len=len(key),
                          meta_len=len(mb))
    buf[rf.RECORD_HEADER_SIZE : rf.RECORD_HEADER_SIZE + len(key)] = key
    buf[rf.RECORD_HEADER_SIZE + len(key) : rf.RECORD_HEADER_SIZE + len(key) + len(mb)] = mb
    return bytes(buf)


def entry(request_id: Any, tap_key: Any = "", num_prompt_tokens: Any = 0, expected_ranks: Any = 1,
          rank_parts: Any = 1, start: Any = 0, tail: Any = 0, source: Any = "client") -> list:
    """A request table entry (ring_format.REQUEST_FIELDS), any field of any type."""
    return [request_id, tap_key, num_prompt_tokens, expected_ranks, rank_parts, start, tail, source]


def data(table: list | bytes, slots, positions, token_ids, payload: np.ndarray, *, tensor: int = rf.TensorKind.LOGITS,
         layer: int = -1, dtype: int = rf.DType.FLOAT32, step: int = 0, slice_: tuple[int, int] | None = None,
         full_dim: int | None = None, n_requests: int | None = None, rank: int = 0) -> bytes:
    """A DATA record; `table` is a list of entries (packed here) or the raw msgpack bytes."""
    tb = table if isinstance(table, bytes) else rf.msgpack_array_header(len(table)) + b"".join(pack(e) for e in table)
    n = len(positions)
    payload = np.ascontiguousarray(payload)
    width = payload.shape[1] if payload.ndim == 2 else 0
    s0, s1 = slice_ if slice_ is not None else (0, width)
    _, slots_off, pos_off, ids_off, payload_off = rf.body_layout(0, len(tb), n)
    total = rf.align_up(payload_off + payload.nbytes)
    buf = bytearray(total)
    nreq = n_requests if n_requests is not None else len(table)  # give n_requests with raw table bytes
    rf.pack_record_header(buf, 0, total=total, kind=int(rf.RecordKind.DATA), rank=rank, payload_off=payload_off,
                          tensor=int(tensor), dtype=int(dtype), layer=layer, n_rows=n, n_requests=nreq,
                          meta_len=len(tb), step=step, slice_start=s0, slice_stop=s1,
                          full_dim=full_dim if full_dim is not None else s1)
    buf[rf.RECORD_HEADER_SIZE : rf.RECORD_HEADER_SIZE + len(tb)] = tb
    buf[slots_off:pos_off] = np.asarray(slots, "<i4").tobytes()
    buf[pos_off:ids_off] = np.asarray(positions, "<i4").tobytes()
    buf[ids_off : ids_off + 4 * n] = np.asarray(token_ids, "<i4").tobytes()
    buf[payload_off : payload_off + payload.nbytes] = payload.tobytes()
    return bytes(buf)


class RingForge:
    """One ring file under <shm_dir>/<instance>/, written record by record."""

    def __init__(self, shm_dir: str, instance: str, rank: int, capacity: int = 1 << 20, world: int = 1,
                 pid: int | None = None, allocate: bool = True):
        self.path = ring_path(shm_dir, instance, rank)
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)  # as a writer makes it (access rules)
        self.capacity = capacity
        tmp = self.path + ".forge.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, rf.HEADER_SIZE + capacity)
            if allocate:
                os.posix_fallocate(fd, 0, rf.HEADER_SIZE + capacity)
            self._mm = mmap.mmap(fd, rf.HEADER_SIZE + capacity)
        finally:
            os.close(fd)
        self.epoch = time.time_ns()
        rf.ident_struct().pack_into(self._mm, rf.IDENT_OFFSET, rf.RING_MAGIC, rf.RING_FORMAT_VERSION, rf.HEADER_SIZE,
                                    capacity, self.epoch, pid if pid is not None else os.getpid(), rank, world, 0)
        os.rename(tmp, self.path)
        self._bell = DoorbellPush(doorbell_path(shm_dir))

    @property
    def write_cursor(self) -> int:
        return int.from_bytes(self._mm[rf.WRITE_CURSOR_OFFSET : rf.WRITE_CURSOR_OFFSET + 8], "little")

    @property
    def read_cursor(self) -> int:
        return int.from_bytes(self._mm[rf.READ_CURSOR_OFFSET : rf.READ_CURSOR_OFFSET + 8], "little")

    def set_write_cursor(self, w: int) -> None:
        self._mm[rf.WRITE_CURSOR_OFFSET : rf.WRITE_CURSOR_OFFSET + 8] = w.to_bytes(8, "little")
        self._bell.ring()

    def append(self, *records: bytes) -> int:
        """Append whole records (no wrap-around: tests stay inside one lap); returns the first's cursor."""
        w = first = self.write_cursor
        for rec in records:
            assert len(rec) % rf.ALIGN == 0 and w + len(rec) <= self.capacity, "the forge does not wrap"
            at = rf.HEADER_SIZE + w
            self._mm[at : at + len(rec)] = rec
            w += len(rec)
        self.set_write_cursor(w)
        return first

    def close(self) -> None:
        self._bell.close()
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass
