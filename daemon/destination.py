"""Where the ring readers put the payloads they read: the delivery arena (daemon/arena.py). The
readers ask before they read (vllm_tap.ring_payload.Destination), so a payload is copied once, from
the ring to where subscribers will find it.

- A record of whole tensors: one region for all its sections.
- A capture's rows of a whole tensor, where they are not read with the others: a region of their own.
- A tensor-parallel slice: its columns of one [rows, full_dim] region per (capture, step, tensor),
  shared by that step's slices of every rank, so reading the slices assembles the tensor and
  reassembly has nothing to concatenate. The region is handed out until every column of it was
  (a later slice of the same key is another copy of the step: a region of its own). It is held
  weakly: the slices read into it keep it, and when reassembly lets them go (the step completed,
  failed, or its capture ended) it goes back to the arena; a key whose region went is forgotten.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from vllm_tap.ring_records import TensorId

from .arena import Arena

MAX_OPEN = 1 << 16  # steps whose slices are still being read, at most (the oldest is forgotten first)


class _Open:
    __slots__ = ("ref", "spans")

    def __init__(self, t: np.ndarray):
        self.ref = weakref.ref(t)
        self.spans: set[tuple[int, int]] = set()  # column ranges handed out


class ArenaDestination:
    """Payloads into the delivery arena."""

    def __init__(self, arena: Arena):
        self._arena = arena
        self._open: OrderedDict[tuple[str, int, TensorId], _Open] = OrderedDict()

    def block(self, nbytes: int) -> np.ndarray | None:
        return self._arena.alloc((nbytes,), np.uint8, overwrite=True)

    def columns(self, request_id: str, step: int, tensor: TensorId, slice_start: int, slice_stop: int,
                full_dim: int, rows: int, dtype: Any) -> np.ndarray | None:
        if slice_start == 0 and slice_stop == full_dim:  # a whole tensor: a region of its own
            return self._arena.alloc((rows, full_dim), dtype, overwrite=True)
        key = (request_id, step, tensor)
        o = self._open.get(key)
        t = o.ref() if o is not None else None
        if t is None or t.shape != (rows, full_dim) or t.dtype != dtype:
            t = self._arena.alloc((rows, full_dim), dtype)
            if t is None:
                return None
            o = self._open[key] = _Open(t)
            if len(self._open) > MAX_OPEN:
                self._open.popitem(last=False)
        o.spans.add((slice_start, slice_stop))
        if sum(b - a for a, b in o.spans) >= full_dim:
            del self._open[key]  # every column handed out
        return t
