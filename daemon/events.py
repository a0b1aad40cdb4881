"""What reassembly emits, per capture: Begin, then Tokens and Gap covering every expected position
exactly once in increasing order, then End. Also the words those events use for why positions are
missing (Gap.reason) and why a capture ended without its END (End.reason).

The store, the watch, the subscriber hub and the wire encoding (daemon/messages.py) read these and
nothing else of reassembly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap.positions import PositionRanges

# Why positions are missing (Gap.reason), and why a capture ended without its END (End.reason).
DROPPED = "dropped"  # the writer's ring was full
INCOMPLETE = "incomplete"  # some rank's slice never arrived, or the slices did not tile the tensor
NOT_CAPTURED = "not captured"  # never written (e.g. cached prefix)
NOT_CAPTURED_PREVIOUS = "not captured: consumed by a previous daemon"  # read by the daemon before a restart
TIMEOUT = "timeout"  # past all that came, and not in any ring read up to where it was end_grace_s after the END
WRITER_GONE = "writer gone"  # the ring's writer died
RING_BROKEN = "ring broken"  # the ring file changed under the daemon (truncated, grown): no longer read
END_LOST = "end lost"  # the engine stopped naming the request in its LIVE records and no END came
MALFORMED = "malformed record"  # a record of the capture did not fit the ring schema
OVER_BUDGET = "over budget"  # the daemon's in-flight memory budget (inflight_bytes) was exceeded
OVERLOADED = rf.SHED_OVERLOADED  # a worker shed the capture: its ring was over the shed threshold

# The reasons gap_positions counts by name; any other (a SHED record's own text) counts as OTHER.
GAP_REASONS = (DROPPED, OVERLOADED, INCOMPLETE, NOT_CAPTURED, NOT_CAPTURED_PREVIOUS, TIMEOUT, WRITER_GONE, RING_BROKEN,
               END_LOST, MALFORMED, OVER_BUDGET)
OTHER = "other"


def gap_key(reason: str) -> str:
    """The name gap_positions counts a reason under."""
    return reason if reason in GAP_REASONS else OVER_BUDGET if reason.startswith(OVER_BUDGET) else OTHER


@dataclass(frozen=True)
class Begin:
    instance: str
    request_id: str
    tap_key: str
    num_prompt_tokens: int
    prompt_token_ids: list[int] | None
    n: int  # samples per prompt (for the choice index)
    model: str
    spec: dict[str, Any] | None  # CaptureSpec.to_meta(), None when no BEGIN was seen
    start_position: int | None  # first position to be captured, None while unknown
    lazy: bool  # made from a DATA/DROP/END record because the BEGIN was not seen
    update: bool  # a late BEGIN completing the metadata of a lazily made request
    at: float
    source: str = "client"  # "client" (the request opted in) or "policy" (the server's capture policy)
    # (ring, epoch, cursor) of the BEGIN record it was made from, None when none was read here: a
    # later daemon that reads that record again (its journal adopted) knows it is not a new capture
    origin: tuple[str, int, int] | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.request_id)


@dataclass(frozen=True, eq=False)
class Tokens:
    """Consecutive positions of one request with every captured tensor, [n, full_dim] each.

    Arrays are in the ring's storage dtype (bfloat16 as uint16; `dtypes` holds the DType codes)
    and, when one record carried a whole tensor, views of that record's array (no copy).
    """

    instance: str
    request_id: str
    positions: np.ndarray  # int32 [n], consecutive
    token_ids: np.ndarray  # int32 [n]
    num_prompt_tokens: int
    tensors: dict[str, np.ndarray]
    dtypes: dict[str, int]
    at: float  # `now` of the feed that completed it (the ring read), for delivery latency

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.request_id)

    @property
    def start(self) -> int:
        return int(self.positions[0])

    @property
    def stop(self) -> int:
        return int(self.positions[-1]) + 1

    @functools.cached_property
    def nbytes(self) -> int:  # asked several times per event (budgets, retention): computed once
        return sum(a.nbytes for a in self.tensors.values()) + self.positions.nbytes + self.token_ids.nbytes

    def since(self, position: int) -> "Tokens":
        """The part at or after `position` (views)."""
        k = max(0, position - self.start)
        if k == 0:
            return self
        return Tokens(self.instance, self.request_id, self.positions[k:], self.token_ids[k:],
                      self.num_prompt_tokens, {n: a[k:] for n, a in self.tensors.items()}, self.dtypes, self.at)

    def before(self, stop: int) -> "Tokens":
        """The part before `stop` (views)."""
        k = max(0, stop - self.start)
        return Tokens(self.instance, self.request_id, self.positions[:k], self.token_ids[:k], self.num_prompt_tokens,
                      {n: a[:k] for n, a in self.tensors.items()}, self.dtypes, self.at)


def new_tokens(instance: str, request_id: str, positions: np.ndarray, token_ids: np.ndarray, num_prompt_tokens: int,
               tensors: dict[str, np.ndarray], dtypes: dict[str, int], at: float, nbytes: int) -> Tokens:
    """Tokens(...) without the frozen dataclass's per-field setattr (once per request and step on the
    daemon's hot path), its nbytes known beforehand."""
    t = object.__new__(Tokens)
    t.__dict__.update(instance=instance, request_id=request_id, positions=positions, token_ids=token_ids,
                      num_prompt_tokens=num_prompt_tokens, tensors=tensors, dtypes=dtypes, at=at, nbytes=nbytes)
    return t


@dataclass(frozen=True)
class Gap:
    instance: str
    request_id: str
    positions: range  # consecutive
    reason: str
    at: float

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.request_id)


@dataclass(frozen=True)
class End:
    instance: str
    request_id: str
    reason: str  # the engine's finish reason; without an END: WRITER_GONE, END_LOST, MALFORMED
    num_prompt_tokens: int
    num_output_tokens: int
    output_token_ids: list[int]
    end_position: int | None  # the model computed positions [0, end_position); None: no END was seen
    expected: tuple[int, int] | None  # [start, stop) of positions that should have been captured
    missing_positions: PositionRanges | list[int]  # every expected position not delivered, as ranges
    delivered: int  # positions delivered
    at: float
    source: str = "client"

    @property
    def key(self) -> tuple[str, str]:
        return (self.instance, self.request_id)

    @property
    def complete(self) -> bool:
        """The END was seen and every expected position was delivered."""
        return self.end_position is not None and not self.missing_positions


Event = Union[Begin, Tokens, Gap, End]
