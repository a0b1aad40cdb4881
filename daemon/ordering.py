"""Ordering: what of a capture is ready for delivery, in position order.

A capture's ready spans (Span: consecutive positions [start, stop), data or missing with a reason)
wait in a heap by start; data sorts before a gap at the same start, so a recomputed copy beats a drop
report. A tail capture (`tail` N > 0) keeps only the newest positions that can still turn out to be
its last N (plus the one held back, HOLD_NEWEST) until its END says where it stopped. Positions are
given up as missing only where no pending step group could still fill them (`may_skip`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .assembly import Assembly
from .events import Tokens


@dataclass
class Span:
    """Consecutive positions [start, stop) ready for delivery: data, or missing with a reason."""

    start: int
    stop: int
    tokens: Tokens | None = None
    reason: str = ""
    # ((ring, epoch), cursor) of each ring record its data came from: while it is held, those rings'
    # cursors stay at or below it (Reassembler.holds)
    origin: tuple[tuple[tuple[str, int], int], ...] = ()

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes if self.tokens is not None else 0


def push(a: Assembly, span: Span) -> None:
    heapq.heappush(a.ready, (span.start, 0 if span.tokens is not None else 1, next(a.order), span))
    a.account(span.nbytes)
    if a.holding:
        # Only the newest positions can turn out to be the last ones: keep the tail's worth, plus
        # the held-back newest (a position computed past the end).
        latest = max(s.stop for _, _, _, s in a.ready)
        keep = a.tail + a.hold
        kept = []
        for item in a.ready:
            if item[3].stop > latest - keep:
                kept.append(item)
            else:
                a.account(-item[3].nbytes)
        if len(kept) != len(a.ready):
            heapq.heapify(kept)
            a.ready = kept


def pop(a: Assembly) -> Span:
    span = heapq.heappop(a.ready)[3]
    a.account(-span.nbytes)
    return span


def discard_data(a: Assembly, reason: str) -> None:
    """Every ready span of data becomes missing with `reason` (the data is let go)."""
    kept = []
    for item in a.ready:
        span = item[3]
        if span.tokens is not None:
            a.account(-span.nbytes)
            span = Span(span.start, span.stop, None, reason)
        kept.append((span.start, 1, item[2], span))
    heapq.heapify(kept)
    a.ready = kept


def clear(a: Assembly) -> None:
    """Let go of every ready span."""
    for item in a.ready:
        a.account(-item[3].nbytes)
    a.ready = []


def reaches(a: Assembly, p0: int) -> bool:
    """A ready span reaches p0 or past it."""
    for item in a.ready:
        if item[3].stop > p0:
            return True
    return False


def may_skip(a: Assembly, lo: int, hi: int) -> bool:
    """Positions [lo, hi) can be declared missing: no pending step group could still fill them."""
    return not any(g.overlaps(lo, hi) for g in a.groups.values())
