"""What a gracefully stopping daemon hands to the next one: the captures in flight it read from the
rings and did not deliver.

Ring read cursors are persisted as records are read, so a restarted daemon resumes exactly where
the last one stopped; what the last one had read but not yet delivered would be lost with it: the
BEGIN and END records of captures still in flight (from the engine ring, so their ENDs would never
be seen again), pending tensor-parallel slices, positions held back until a later one or the END
comes. On a graceful stop (SIGTERM, the systemd stop) the daemon writes these to
`<state_dir>/handover.msgpack`; the next daemon reads the file once at start-up, deletes it, and
continues those captures from where they were (the positions the previous daemon delivered come as
one Gap `not captured: consumed by a previous daemon`, as after a crash). A crash writes nothing:
captures then end through the engine's LIVE records.

Rules: the file is written beside its final name and renamed in (a reader never sees half of
one), in the daemon's own state directory. It is decoded against the schema below with bounds:
a file that does not fit is logged in one line and ignored, never a reason not to start. Control
records go back through the ring schema (vllm_tap.ring_schema.control_record), arrays are checked
against their dtype and shape.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import numpy as np

log = logging.getLogger(__name__)

HANDOVER_FILE = "handover.msgpack"
HANDOVER_VERSION = 1
MAX_HANDOVER_BYTES = 1 << 32  # a bound on what is read back; the daemon's inflight_bytes keeps it far below
_DTYPES = frozenset({"<f4", "<f2", "<u2", "<i4", "<i8", "<f8", "|u1"})


class Array(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, a: np.ndarray) -> "Array":
        a = np.ascontiguousarray(a)
        return cls(a.dtype.str, list(a.shape), a.tobytes())

    def array(self) -> np.ndarray:
        if self.dtype not in _DTYPES or not 1 <= len(self.shape) <= 2 or min(self.shape) < 0:
            raise ValueError(f"array of dtype {self.dtype!r} and shape {self.shape}")
        dt = np.dtype(self.dtype)
        if int(np.prod(self.shape)) * dt.itemsize != len(self.data):
            raise ValueError(f"array of shape {self.shape} and dtype {self.dtype} in {len(self.data)} bytes")
        return np.frombuffer(self.data, dt).reshape(self.shape).copy()


class Slice(msgspec.Struct, forbid_unknown_fields=True):
    """A DATA record of a pending group (one rank's slice of one tensor at one step)."""

    ring: str
    epoch: int
    rank: int
    step: int
    expected_ranks: int
    rank_parts: int
    kind: int
    layer: int
    dtype: int
    slice_start: int
    slice_stop: int
    full_dim: int
    num_prompt_tokens: int
    positions: Array
    token_ids: Array
    data: Array


class Chunk(msgspec.Struct, forbid_unknown_fields=True):
    """Consecutive positions ready for delivery: data (tensors by name), or a gap (reason)."""

    start: int
    stop: int
    reason: str = ""
    positions: Array | None = None
    token_ids: Array | None = None
    tensors: dict[str, Array] = {}
    dtypes: dict[str, int] = {}


class Capture(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    tap_key: str
    num_prompt_tokens: int
    lazy: bool
    source: str
    begin: dict[str, Any] | None  # the BEGIN record's meta, None when none was seen
    end: dict[str, Any] | None  # the END record's meta, None when none was seen
    spec: dict[str, Any] | None
    tail: int
    start: int | None
    frontier: int | None
    stop: int | None
    max_seen: int
    sources: list[str]
    cut: str | None
    hold: int
    chunks: list[Chunk]
    slices: list[Slice]
    shed: str | None = None  # a worker shed it (SHED record read): it ends as one Gap with this reason


class Handover(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    instances: dict[str, list[Capture]]


def path_in(state_dir: str) -> str:
    return os.path.join(state_dir, HANDOVER_FILE)


def write(state_dir: str, instances: dict[str, list[Capture]]) -> int:
    """Write the handover (replacing any); the number of captures in it. Nothing to hand over: no file."""
    n = sum(len(v) for v in instances.values())
    path = path_in(state_dir)
    if not n:
        return 0
    tmp = f"{path}.{os.getpid()}.tmp"
    data = msgspec.msgpack.encode(Handover(HANDOVER_VERSION, instances))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    return n


def take(state_dir: str) -> dict[str, list[Capture]]:
    """Read and delete the handover a previous daemon left ({} when there is none or it is unusable)."""
    path = path_in(state_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.error("handover %s cannot be opened (%s): ignored", path, e)
        return {}
    try:
        size = os.fstat(fd).st_size
        if size > MAX_HANDOVER_BYTES:
            log.error("handover %s is %d bytes, more than %d: ignored", path, size, MAX_HANDOVER_BYTES)
            return {}
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(size)
    finally:
        os.close(fd)
        try:
            os.unlink(path)  # taken once: a crash after this must not hand the same captures over again
        except OSError:
            pass
    try:
        h = msgspec.msgpack.decode(raw, type=Handover)
    except msgspec.DecodeError as e:
        log.error("handover %s does not fit its schema (%s): ignored", path, e)
        return {}
    if h.version != HANDOVER_VERSION:
        log.error("handover %s is version %d, this daemon reads %d: ignored", path, h.version, HANDOVER_VERSION)
        return {}
    return h.instances
