"""Reassembly events as wire messages (see vllm_tap.wire_format for the protocol).

With `arena` (the subscriber maps the daemon's arena), a Tokens event whose arrays all lie in the
arena goes out as descriptors (a few dozen bytes); otherwise, and for every other subscriber, its
arrays go out as frames, sent without copying."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_tap import wire_format as wf
from vllm_tap.positions import PositionRanges

from .events import Begin, End, Event, Gap, Tokens
from .store import Entry

if TYPE_CHECKING:
    from .arena import Arena

Frames = list[Any]  # bytes headers and numpy buffers, sent without copying


def arena_advert(arena: "Arena | None") -> list | None:
    """What a first reply says of the arena: [path, arena_id], for a client that offered to map it."""
    return [arena.path, arena.arena_id] if arena is not None else None


# Through the arena, consecutive tokens events of one capture go out as one message (rows stacked):
# what one pass of the daemon has for a subscriber, never waiting for more. Bounded so a header
# stays small (descriptors are ~40 bytes each) and the client's stacked arrays stay well below
# glibc's largest mmap threshold (32 MiB): above it every array would be fresh pages, faulted in
# by the copy at a fraction of memcpy speed.
RUN_EVENTS = 64
RUN_DESCS = 1024
RUN_BYTES = 8 << 20


def _wire(ev: Tokens, arena: "Arena | None") -> list:
    """[token ids as bytes, arena descriptors (False: not asked yet; None: not all in the arena),
    signature] of an event: what every subscriber of it shares, made once."""
    cached = ev.__dict__.get("_wire")
    if cached is None:
        cached = ev.__dict__["_wire"] = [ev.token_ids.astype("<i4", copy=False).tobytes(), False, None]
    if arena is not None and cached[1] is False:
        cached[1] = wf.describe_arena(ev.tensors, ev.dtypes, arena.locate)
        if cached[1] is not None:  # what must match for rows to stack: names, dtypes, widths, prompt length
            cached[2] = (ev.num_prompt_tokens, tuple((d[0], d[1], d[3]) for d in cached[1]))
    return cached


def encode_run(history: list[Event], index: int, entry: Entry, sub_id: int, from_position: int | None,
               arena: "Arena | None") -> tuple[Frames | None, int]:
    """The message for history[index] and how many events it covers: through the arena, the tokens
    events right after it that continue it (next position, same tensors) ride along, their
    descriptors in order, so one send, one receive and one header carry what one daemon pass read
    (the client stacks each tensor's parts: wire_format, "Shared memory")."""
    ev = history[index]
    if arena is None or not isinstance(ev, Tokens) or (from_position is not None and ev.start < from_position):
        return encode(ev, entry, sub_id, from_position, arena), 1
    w = _wire(ev, arena)
    if w[1] is None:
        return encode(ev, entry, sub_id, from_position, arena), 1
    sig = w[2]
    ids, descs = [w[0]], list(w[1])
    stop = ev.stop
    nbytes = ev.nbytes
    j = index + 1
    end = min(len(history), index + RUN_EVENTS)
    while j < end:
        nxt = history[j]
        if not isinstance(nxt, Tokens) or nxt.start != stop:
            break
        nw = _wire(nxt, arena)
        if nw[1] is None or nw[2] != sig or len(descs) + len(nw[1]) > RUN_DESCS or nbytes + nxt.nbytes > RUN_BYTES:
            break
        nbytes += nxt.nbytes
        ids.append(nw[0])
        descs.extend(nw[1])
        stop = nxt.stop
        j += 1
    return [wf.encode(wf.TokensReply(
        id=sub_id, seq=entry.seq, request_id=ev.request_id, instance=ev.instance, start=ev.start,
        count=stop - ev.start, token_ids=ids[0] if len(ids) == 1 else b"".join(ids),
        num_prompt_tokens=ev.num_prompt_tokens, tensors=descs, arena=arena.arena_id,
    ))], j - index


def encode(ev: Event, entry: Entry, sub_id: int, from_position: int | None = None,
           arena: "Arena | None" = None) -> Frames | None:
    """The message for one event of `entry`'s history; None when from_position leaves nothing of it.
    `arena`: the subscriber maps it (it offered, and was told in the Begin / watching reply)."""
    if isinstance(ev, Tokens):
        if from_position is not None:
            if ev.stop <= from_position:
                return None
            ev = ev.since(from_position)
        cached = _wire(ev, arena)
        ids = cached[0]
        if arena is not None:
            adescs = cached[1]
            if adescs is not None:
                return [wf.encode(wf.TokensReply(
                    id=sub_id, seq=entry.seq, request_id=ev.request_id, instance=ev.instance, start=ev.start,
                    count=len(ev.positions), token_ids=ids, num_prompt_tokens=ev.num_prompt_tokens, tensors=adescs,
                    arena=arena.arena_id,
                ))]
        descs, bufs = wf.describe_tensors(ev.tensors, ev.dtypes)
        header = wf.encode(wf.TokensReply(
            id=sub_id, seq=entry.seq, request_id=ev.request_id, instance=ev.instance, start=ev.start,
            count=len(ev.positions), token_ids=ids, num_prompt_tokens=ev.num_prompt_tokens, tensors=descs,
        ))
        return [header, *bufs]
    if isinstance(ev, Gap):
        start, stop = ev.positions.start, ev.positions.stop
        if from_position is not None:
            start = max(start, from_position)
            if start >= stop:
                return None
        return [wf.encode(wf.GapReply(id=sub_id, seq=entry.seq, request_id=ev.request_id, instance=ev.instance,
                                      start=start, stop=stop, reason=ev.reason))]
    if isinstance(ev, Begin):
        b = entry.begin  # the latest, in case a late BEGIN filled in a lazily made capture
        return [wf.encode(wf.BeginReply(
            id=sub_id, seq=entry.seq, request_id=b.request_id, instance=b.instance, tap_key=b.tap_key,
            names=list(entry.names), response_id=entry.response_id, choice_index=entry.choice_index,
            num_prompt_tokens=b.num_prompt_tokens, prompt_token_ids=b.prompt_token_ids, n=b.n, model=b.model,
            spec=b.spec, start_position=b.start_position, lazy=b.lazy, source=b.source, arena=arena_advert(arena),
        ))]
    assert isinstance(ev, End)
    missing = ev.missing_positions if isinstance(ev.missing_positions, PositionRanges) else \
        PositionRanges.of(ev.missing_positions)
    if from_position is not None:
        # A resumed subscription got the positions below from_position from someone else (a
        # previous daemon); the client accounts for those itself.
        missing = missing.clip(from_position, 1 << 62)
    return [wf.encode(wf.EndReply(
        id=sub_id, seq=entry.seq, request_id=ev.request_id, instance=ev.instance, reason=ev.reason,
        num_prompt_tokens=ev.num_prompt_tokens, num_output_tokens=ev.num_output_tokens,
        output_token_ids=ev.output_token_ids, end_position=ev.end_position,
        expected=list(ev.expected) if ev.expected else None, missing=missing.as_lists(),
        complete=ev.end_position is not None and not missing, delivered=ev.delivered,
        response_id=entry.response_id, choice_index=entry.choice_index, source=ev.source,
    ))]
