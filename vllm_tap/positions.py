"""Sets of token positions kept as sorted, disjoint [start, stop) ranges.

Missing positions are reported per capture; one far-off position in a record must not turn into a
list of billions of ints in the daemon or the client. `PositionRanges` stores ranges and behaves as
a read-only sorted sequence of ints (len, iteration, indexing, `in`, == with a list), so code that
treated `missing_positions` as a list keeps working, at the cost of ranges.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Iterator, Sequence, overload

import numpy as np


def _normalise(ranges: Iterable[tuple[int, int] | range | Sequence[int]]) -> list[tuple[int, int]]:
    rs = sorted((int(r.start), int(r.stop)) if isinstance(r, range) else (int(r[0]), int(r[1])) for r in ranges)
    out: list[tuple[int, int]] = []
    for a, b in rs:
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class PositionRanges(Sequence[int]):
    """An immutable sorted set of ints as disjoint ranges; a Sequence of the ints it holds."""

    __slots__ = ("_r", "_cum")

    def __init__(self, ranges: Iterable[tuple[int, int] | range | Sequence[int]] = ()):
        self._r = _normalise(ranges)
        acc = 0
        self._cum = []
        for a, b in self._r:
            acc += b - a
            self._cum.append(acc)

    @classmethod
    def of(cls, positions: Iterable[int]) -> "PositionRanges":
        """From individual positions (any order, duplicates allowed)."""
        ps = np.unique(np.fromiter((int(p) for p in positions), np.int64)) if not isinstance(positions, np.ndarray) \
            else np.unique(positions.astype(np.int64))
        if not len(ps):
            return cls()
        cuts = np.flatnonzero(np.diff(ps) != 1) + 1
        starts = np.concatenate([[0], cuts])
        stops = np.concatenate([cuts, [len(ps)]])
        return cls((int(ps[a]), int(ps[b - 1]) + 1) for a, b in zip(starts, stops))

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """[start, stop) pairs, sorted and disjoint."""
        return list(self._r)

    def as_lists(self) -> list[list[int]]:
        return [[a, b] for a, b in self._r]

    def union(self, other: Iterable[tuple[int, int] | range | Sequence[int]] | "PositionRanges") -> "PositionRanges":
        theirs = other._r if isinstance(other, PositionRanges) else list(other)
        return PositionRanges([*self._r, *theirs])

    def clip(self, start: int, stop: int) -> "PositionRanges":
        return PositionRanges((max(a, start), min(b, stop)) for a, b in self._r)

    def __len__(self) -> int:
        return self._cum[-1] if self._cum else 0

    def __bool__(self) -> bool:
        return bool(self._r)

    def __iter__(self) -> Iterator[int]:
        for a, b in self._r:
            yield from range(a, b)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("position index out of range")
        k = bisect.bisect_right(self._cum, i)
        before = self._cum[k - 1] if k else 0
        return self._r[k][0] + (i - before)

    def __contains__(self, p: object) -> bool:
        if not isinstance(p, (int, np.integer)):
            return False
        k = bisect.bisect_right(self._r, (int(p), float("inf"))) - 1
        return k >= 0 and self._r[k][0] <= p < self._r[k][1]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PositionRanges):
            return self._r == other._r
        if isinstance(other, (list, tuple, range)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._r))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        parts = [np.arange(a, b, dtype=np.int64) for a, b in self._r]
        out = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return out.astype(dtype) if dtype is not None else out

    def __repr__(self) -> str:
        if len(self) <= 16:
            return repr(list(self))
        return "PositionRanges(" + ", ".join(f"{a}..{b - 1}" for a, b in self._r[:8]) + (
            ", ..." if len(self._r) > 8 else "") + ")"
