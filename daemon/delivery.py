"""Delivery: a capture's ready spans out as events, in position order, each expected position exactly
once, as Tokens or as a Gap with its reason.

One way out (`pump`), from the front of the ordering heap (daemon/ordering.py) up to the limit: a
hole before the next span becomes a Gap once no pending step group could fill it; positions at or
past the END's stop never go out; the newest output position waits (HOLD_NEWEST) until a later one
is seen or the END comes, because async scheduling can compute a request one step past its end.
`offer` is how a span of data that arrived in order goes in: its fast case, a branch for the two
shapes of every decode step (nothing waits and the span goes out; or the one span held back goes out
and this one is held in its place), does what pushing and pumping would, without the heap.
"""

from __future__ import annotations

from vllm_tap.positions import PositionRanges

from .assembly import Assembly
from .events import NOT_CAPTURED, NOT_CAPTURED_PREVIOUS, WRITER_GONE, End, Event, Gap, Tokens, gap_key
from .ordering import Span, may_skip, pop, push


def limit(a: Assembly) -> int | None:
    """Positions below this may be delivered now (None: no limit)."""
    if a.stop is not None:
        return a.stop
    if a.hold:
        # Only a decode step can run past the end (the END's end_position is at least the prompt
        # length once a token was generated, and covers a prefill chunk in flight when none was), so
        # prompt positions never wait.
        return max(a.max_seen + 1 - a.hold, a.num_prompt_tokens)
    return None


def gap(a: Assembly, lo: int, hi: int, reason: str, now: float, out: list[Event]) -> None:
    """Positions [lo, hi) (below the stop) go out missing."""
    if a.stop is not None:
        hi = min(hi, a.stop)
    if hi <= lo:
        return
    rng = range(lo, hi)
    a.missing.append(rng)
    tally = a.tally
    tally.stats["missing_positions"] += len(rng)
    key = gap_key(reason)
    tally.gap_positions[key] = tally.gap_positions.get(key, 0) + len(rng)
    out.append(Gap(a.instance, a.request_id, rng, reason, now))


def _tokens(a: Assembly, tok: Tokens, hi: int, out: list[Event]) -> None:
    """`tok`, from the frontier up to hi, goes out."""
    a.delivered += len(tok.positions)
    a.frontier = hi
    out.append(tok)


def resolved(a: Assembly) -> bool:
    """Every expected position went out: the capture can end."""
    return a.stop is not None and a.frontier is not None and a.frontier >= a.stop


def pump(a: Assembly, now: float, out: list[Event], force_reason: str | None = None) -> bool:
    """Deliver ready spans in position order; True when every expected position went out (the
    capture can end). `force_reason`: the capture ends now; holes and what is left up to the stop
    are missing for this reason."""
    while a.ready and not a.holding:
        start, _, _, span = a.ready[0]
        if a.frontier is None:
            a.frontier = a.first_frontier = start
        lim = limit(a)
        if lim is not None and a.frontier >= lim:
            break
        if span.stop <= a.frontier:
            pop(a)
            continue
        if start > a.frontier:
            if force_reason is None and not may_skip(a, a.frontier, start):
                break
            hi = start if lim is None else min(start, lim)
            reason = force_reason or (NOT_CAPTURED_PREVIOUS if a.met_half_way and a.frontier == (
                a.start if a.resumed_at is None else a.resumed_at) else NOT_CAPTURED)
            gap(a, a.frontier, hi, reason, now, out)
            a.frontier = hi
            continue
        span = pop(a)
        hi = span.stop if lim is None else min(span.stop, lim)
        if span.tokens is None:
            gap(a, a.frontier, hi, span.reason, now, out)
            a.frontier = hi
            if hi < span.stop:
                push(a, Span(hi, span.stop, None, span.reason))
        else:
            tok = span.tokens.since(a.frontier)
            if hi < span.stop:
                push(a, Span(hi, span.stop, tok.since(hi), origin=span.origin))  # held back, see HOLD_NEWEST
                tok = tok.before(hi)
            _tokens(a, tok, hi, out)
    if force_reason is not None:
        if a.stop is not None and a.frontier is not None and a.frontier < a.stop:
            gap(a, a.frontier, a.stop, force_reason, now, out)
            a.frontier = a.stop
        return False
    return resolved(a)


def offer(a: Assembly, tok: Tokens, p0: int, p1: int, now: float, out: list[Event],
          origin: tuple[tuple[tuple[str, int], int], ...] = ()) -> bool:
    """Positions [p0, p1) of data that arrived in order (its capture's frontier known, nothing of it
    pending; `origin`: its ring records, Span.origin): deliver what can go now; True when every
    expected position went out."""
    lim = limit(a)
    ready = a.ready
    if not ready:
        if p0 == a.frontier and (lim is None or p1 <= lim) and not a.holding:
            _tokens(a, tok, p1, out)  # nothing waits, and it goes out whole
            return a.stop is not None and p1 >= a.stop
    elif len(ready) == 1 and a.stop is None and lim is not None:
        held = ready[0][3]
        if held.tokens is not None and held.start == a.frontier and held.stop == p0 and held.stop <= lim <= p0:
            # The one span held back goes out, and this one is held in its place (a heap of one).
            ready[0] = (p0, 0, next(a.order), Span(p0, p1, tok, origin=origin))
            a.account(tok.nbytes - held.tokens.nbytes)
            _tokens(a, held.tokens, held.stop, out)
            return False
    push(a, Span(p0, p1, tok, origin=origin))
    return pump(a, now, out)


def end_event(a: Assembly, now: float, force_reason: str | None) -> End:
    """The capture's End: how it finished, what was expected and what of that is missing."""
    m = a.end
    start = a.start if a.start is not None else a.first_frontier
    if start is None:  # nothing seen and nothing known: no claim either way
        start = stop = 0
    else:
        stop = a.stop if a.stop is not None else start
    missing = PositionRanges(a.missing).clip(start, stop)
    if a.first_frontier is not None and a.first_frontier > start:
        # Capture started late (the BEGIN came after data, or a previous daemon consumed the head)
        # and the head could not be reported as a Gap in order.
        missing = missing.union([(start, min(a.first_frontier, stop))])
    reason = m.reason if m is not None else (force_reason or WRITER_GONE)
    return End(
        a.instance, a.request_id, reason, a.num_prompt_tokens,
        m.num_output_tokens if m is not None else 0, list(m.output_token_ids) if m is not None else [],
        m.end_position if m is not None else None, (start, stop) if stop > start else None, missing,
        a.delivered, now, a.source,
    )
