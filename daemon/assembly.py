"""One capture being reassembled: what is known of it, what of it is held, how far it was delivered,
and its lifecycle (daemon/lifecycle.py). Reassembly (daemon/reassembly.py) keeps one Assembly per
capture in flight; tiling, ordering and delivery read and change it.

Bytes held here (pending step groups, ready spans) are counted per capture and in the reassembler's
Tally, so the daemon can keep all captures in flight inside a budget.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_tap.spec import CaptureSpec

from .events import INCOMPLETE, NOT_CAPTURED_PREVIOUS
from .lifecycle import Lifecycle

HOLD_NEWEST = 1  # output positions held back until a later one is seen or the END comes (async scheduling)


class Tally:
    """A reassembler's totals, shared by its assemblies: bytes held, and what its counters say."""

    __slots__ = ("held_bytes", "stats", "gap_positions")

    def __init__(self) -> None:
        self.held_bytes = 0
        self.gap_positions: dict[str, int] = {}  # reason (events.GAP_REASONS, OTHER) -> positions delivered as gaps
        self.stats = {"records": 0, "late_records": 0, "duplicate_records": 0, "bad_records": 0,
                      "past_end_records": 0, "rejected_records": 0, "requests_started": 0, "requests_finished": 0,
                      "missing_positions": 0, "live_records": 0, "ends_lost": 0, "captures_cut": 0,
                      "captures_shed": 0, "shed_records": 0,
                      "replayed_records": 0,  # read again after a restart, of captures an earlier run finished
                      "direct": 0}  # (capture, record) pairs of whole records delivered the direct way


@dataclass(eq=False)
class Assembly:
    instance: str
    request_id: str
    tap_key: str
    num_prompt_tokens: int
    lazy: bool  # made from a DATA/DROP/END record because the BEGIN was not seen
    tally: Tally
    source: str = "client"
    begin: Any = None  # ring_schema.BeginMeta, once a BEGIN was seen
    begin_at: tuple[str, int, int] | None = None  # (ring, epoch, cursor) of that BEGIN record (events.Begin.origin)
    end: Any = None  # ring_schema.EndMeta, once the END was seen
    spec: CaptureSpec | None = None
    # Which positions are expected
    tail: int = 0  # N > 0: the capture is the last N computed positions
    start: int | None = None  # first expected position, if known
    stop: int | None = None  # expected stop, known at END
    max_seen: int = -1  # highest position any record of it carried
    hold: int = HOLD_NEWEST  # output positions held back (0 when the BEGIN says the engine is not async)
    inherited: bool = False  # first seen in a ring that a previous daemon had been reading
    # What is held (tiling: pending step groups; ordering: ready spans, a heap) and its bytes
    groups: dict[int, Any] = field(default_factory=dict)  # step -> tiling.StepGroup
    ready: list[tuple[int, int, int, Any]] = field(default_factory=list)  # heap of ordering.Span
    nbytes: int = 0
    order: Any = field(default_factory=itertools.count)  # tie-break of the ready heap
    cut: str | None = None  # why its data is no longer kept (over budget)
    shed: str | None = None  # why a worker did not admit it (a SHED record): delivered as one Gap
    # How far delivery got
    frontier: int | None = None  # next position to deliver
    first_frontier: int | None = None  # where delivery started (for End's missing ranges)
    missing: list[range] = field(default_factory=list)
    delivered: int = 0
    # Continued from an earlier daemon run's journal (daemon/adoption.py): the positions it had
    # delivered, and where this run took over (its holes there were read by that run, not filed)
    adopted: int = 0
    resumed_at: int | None = None
    # Who writes it, and whether it still runs (the LIVE rule)
    sources: set[str] = field(default_factory=set)  # rings that carried records of it
    gone: set[str] = field(default_factory=set)  # of those, rings whose writer is gone
    lost: str | None = None  # a peer host's ranks stopped reporting while it ran (why): nothing more comes from them
    records: int = 0  # records seen (activity, for the LIVE rule)
    live_absent: int = 0  # successive LIVE records without it, with no record of it since the first
    absent_mark: int = 0  # `records` at the first of those
    listed: bool | None = None  # whether the latest LIVE record named it (None: no LIVE seen yet)
    last_record_at: float = 0.0
    life: Lifecycle = field(default_factory=Lifecycle)

    def account(self, delta: int) -> None:
        """Bytes held for it changed by `delta`."""
        self.nbytes += delta
        self.tally.held_bytes += delta

    def set_start(self, start: int) -> None:
        self.start = start
        if self.frontier is None:
            self.frontier = self.first_frontier = start

    def apply_spec(self, spec: CaptureSpec, source: str | None) -> None:
        self.spec = spec
        self.tail = spec.tail
        if source:
            self.source = source
        first = spec.first_position(self.num_prompt_tokens)
        if first is not None:
            self.set_start(first)

    def apply_table(self, r: Any) -> None:
        """What a DATA record's request table says about a capture whose BEGIN was not seen."""
        if r.source:
            self.source = r.source
        if self.spec is not None:
            return
        if r.tail > 0:
            self.tail = r.tail
        elif r.start >= 0 and self.start is None:
            self.set_start(r.start)

    def apply_begin(self, r: Any) -> None:
        """What a BEGIN record says (its meta, its spec)."""
        info = r.control
        self.begin = info
        if r.cursor >= 0:
            self.begin_at = (r.ring, r.epoch, r.cursor)
        if info is not None and info.num_prompt_tokens:
            self.num_prompt_tokens = info.num_prompt_tokens
        if info is not None and info.async_scheduling is False:
            self.hold = 0  # no step runs past the end: nothing to hold back
        if r.spec is not None:
            self.apply_spec(r.spec, r.source)

    def resolved(self, positions: np.ndarray) -> bool:
        """Every position already delivered or waiting in `ready` (a duplicate or recompute)."""
        if self.frontier is None:
            return False
        if top(positions) < self.frontier:
            return True
        rest = positions[positions >= self.frontier]
        for _, _, _, span in self.ready:
            rest = rest[(rest < span.start) | (rest >= span.stop)]
            if not len(rest):
                return True
        return False

    @property
    def holding(self) -> bool:
        """True while which positions to deliver depends on the END (a tail capture: workers write
        every position it might include, and only the END says which are the last ones)."""
        return self.tail > 0 and self.stop is None

    def unfinished(self) -> str:
        """Why steps of it that can no longer complete are missing. Some of their records came and
        others never will: a rank's slice never arrived (`incomplete`), unless the capture was met
        half way in a ring a previous daemon was reading and nothing was delivered yet. Then these
        are its first steps, whose other records that daemon read before it stopped (a step's hidden
        states and its logits are two records, a SIGKILL can fall between them)."""
        return NOT_CAPTURED_PREVIOUS if self.met_half_way else INCOMPLETE

    @property
    def met_half_way(self) -> bool:
        """First seen in a ring a previous daemon had been reading, and nothing delivered by this one
        yet: what is missing at its start went with that daemon."""
        return self.inherited and self.delivered == self.adopted


def top(positions: np.ndarray) -> int:
    # One row (a decode step) is the common case: a scalar read, not a reduction.
    return int(positions[0]) if len(positions) == 1 else int(positions.max())


def bottom(positions: np.ndarray) -> int:
    return int(positions[0]) if len(positions) == 1 else int(positions.min())
