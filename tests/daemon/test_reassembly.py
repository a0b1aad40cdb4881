"""The reassembler as a pure state machine: records in, events out; no IO, time passed in.

Tests of joining and ordering use `plain()`, a reassembler that does not hold back the newest
position (HOLD_NEWEST, for async scheduling), so each step's positions come out at once; the hold
itself, the ends without an END, tails, budgets and restarts have tests of their own below, with
the daemon's defaults."""

from __future__ import annotations

import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap.daemon.events import (
    DROPPED, END_LOST, INCOMPLETE, MALFORMED, NOT_CAPTURED, NOT_CAPTURED_PREVIOUS, OVER_BUDGET, OVERLOADED, TIMEOUT,
    WRITER_GONE,
    Begin, End, Gap, Tokens,
)
from vllm_tap.daemon.reassembly import ENGINE_SOURCE as ENGINE, Reassembler
from vllm_tap.ring_records import ControlRecord, DataRecord, Slice, TensorId
from vllm_tap.ring_schema import BeginMeta, DropMeta, EndMeta, LiveMeta, ShedMeta, control_record, spec_field
from vllm_tap.spec import CaptureSpec

from slices import record_of

V = 8  # vocab
H = 4  # hidden
LOGITS = TensorId(rf.TensorKind.LOGITS)
RID = "req-1"


def plain(instance: str = "default", **kw) -> Reassembler:
    return Reassembler(instance, hold_newest=0, **kw)


def vals(name: str, positions, s0: int, s1: int) -> np.ndarray:
    p = np.asarray(positions, np.float32)[:, None]
    c = np.arange(s0, s1, dtype=np.float32)[None, :]
    return p * 100 + c + (0.5 if name != "logits" else 0.0)


def data(step, positions, *, tensor=LOGITS, rank=0, expected=1, parts=1, s=None, full=None, rid=RID,
         source=None, n_prompt=4, start=-1, tail=0, origin="client") -> DataRecord:
    full = full or (V if tensor.kind == rf.TensorKind.LOGITS else H)
    s0, s1 = s or (0, full)
    pos = np.asarray(positions, np.int32)
    return record_of(Slice(
        request_id=rid, step=step, rank=rank, expected_ranks=expected, rank_parts=parts,
        tensor=tensor, dtype=rf.DType.FLOAT32, slice_start=s0, slice_stop=s1, full_dim=full, num_prompt_tokens=n_prompt,
        positions=pos, token_ids=pos + 1000, data=vals(tensor.name, pos, s0, s1), ring=source or f"rank-{rank:05d}.ring",
        start=start, tail=tail, source=origin,
    ))


def begin(rid=RID, n_prompt=4, spec=None) -> ControlRecord:
    return control_record(BeginMeta(spec=spec_field(spec or CaptureSpec()), num_prompt_tokens=n_prompt,
                                    prompt_token_ids=list(range(n_prompt)), model="m"), rid)


def end(end_position, rid=RID, n_prompt=4, reason="stop", spec=None) -> ControlRecord:
    n_out = min(max(end_position - n_prompt + 1, 0), 64)  # the ids are not what these tests are about
    meta = EndMeta(reason=reason, num_prompt_tokens=n_prompt, num_output_tokens=n_out,
                   output_token_ids=[7] * n_out, end_position=end_position)
    if spec is not None:
        meta.spec, meta.source = spec_field(spec), spec.source
    return control_record(meta, rid)


def drop(positions, rid=RID, rank=0) -> ControlRecord:
    return control_record(DropMeta(int(rf.TensorKind.LOGITS), -1, list(positions)), rid,
                          rank=rank, ring=f"rank-{rank:05d}.ring")


def live(*rids) -> ControlRecord:
    return control_record(LiveMeta(list(rids)), "")


def feed(r: Reassembler, *records, now=0.0) -> list:
    out = []
    for rec in records:
        out += r.feed(rec, now)
    return out


def delivered(events) -> list[int]:
    return [int(p) for e in events if isinstance(e, Tokens) for p in e.positions]


def gaps(events) -> list[tuple[list[int], str]]:
    return [(list(e.positions), e.reason) for e in events if isinstance(e, Gap)]


def the_end(events) -> End:
    ends = [e for e in events if isinstance(e, End)]
    assert len(ends) == 1, events
    return ends[0]


def test_single_rank_in_order_views_and_end():
    r = plain("inst")
    ev = feed(r, begin())
    assert isinstance(ev[0], Begin) and ev[0].start_position == 0 and not ev[0].lazy
    rec = data(0, [0, 1, 2, 3])
    ev = feed(r, rec, data(1, [4]), end(5))
    assert delivered(ev) == [0, 1, 2, 3, 4]
    first = ev[0]
    assert np.shares_memory(first.tensors["logits"], rec.sections[0].parts[0]), "tp=1 must not copy"
    assert first.tensors["logits"].tobytes() == vals("logits", [0, 1, 2, 3], 0, V).tobytes()
    assert list(first.token_ids) == [1000, 1001, 1002, 1003]
    e = the_end(ev)
    assert e.reason == "stop" and e.missing_positions == [] and e.delivered == 5 and e.expected == (0, 5)
    assert e.instance == "inst" and r.in_flight() == 0


def test_two_rank_slices_join_in_rank_order_whatever_the_arrival_order():
    r = plain()
    feed(r, begin())
    half = V // 2
    ev = feed(r, data(0, [0, 1], rank=1, expected=2, s=(half, V)))
    assert delivered(ev) == []  # half a tensor is never delivered
    ev = feed(r, data(0, [0, 1], rank=0, expected=2, s=(0, half)))
    (tok,) = [e for e in ev if isinstance(e, Tokens)]
    assert tok.tensors["logits"].shape == (2, V)
    assert tok.tensors["logits"].tobytes() == vals("logits", [0, 1], 0, V).tobytes()


def test_missing_rank_slice_makes_positions_missing_never_a_wrong_concat():
    r = plain()
    feed(r, begin())
    half = V // 2
    # Step 0: only rank 0's slice arrives. Step 1: both. Rank 1 has moved past step 0, so step 0 is lost.
    ev = feed(r, data(0, [0, 1], rank=0, expected=2, s=(0, half)),
              data(1, [2], rank=0, expected=2, s=(0, half)), data(1, [2], rank=1, expected=2, s=(half, V)))
    assert gaps(ev) == [([0, 1], INCOMPLETE)]
    assert delivered(ev) == [2]
    ev = feed(r, end(3))
    assert the_end(ev).missing_positions == [0, 1]


def test_overlapping_slices_are_missing_not_concatenated():
    r = plain()
    feed(r, begin())
    ev = feed(r, data(0, [0], rank=0, expected=2, s=(0, V // 2)), data(0, [0], rank=1, expected=2, s=(0, V // 2)))
    assert delivered(ev) == [] and gaps(ev) == [([0], INCOMPLETE)]


def test_pipeline_stages_join_per_token():
    r = plain()
    feed(r, begin(spec=CaptureSpec(layers=(0, 1, 2, 3))))
    hid = [TensorId(rf.TensorKind.HIDDEN, l) for l in range(4)]
    ev = []
    for step, pos in ((0, [0, 1, 2]), (1, [3])):
        part = feed(r, data(step, pos, tensor=hid[0], rank=0, expected=2, parts=2),
                    data(step, pos, tensor=hid[1], rank=0, expected=2, parts=2),
                    data(step, pos, tensor=hid[2], rank=1, expected=2, parts=3))
        assert not delivered(part)  # rank 1 still owes layer 3 and the logits
        ev += feed(r, data(step, pos, tensor=hid[3], rank=1, expected=2, parts=3),
                   data(step, pos, rank=1, expected=2, parts=3))
    toks = [e for e in ev if isinstance(e, Tokens)]
    assert [list(t.positions) for t in toks] == [[0, 1, 2], [3]]
    assert sorted(toks[0].tensors) == ["hidden.0", "hidden.1", "hidden.2", "hidden.3", "logits"]
    assert toks[0].tensors["hidden.2"].tobytes() == vals("hidden.2", [0, 1, 2], 0, H).tobytes()


def test_out_of_order_completion_is_delivered_in_position_order():
    r = plain()
    feed(r, begin())
    # Step 0 needs both ranks; step 1 only rank 0 (say, top-k written whole by one rank).
    ev = feed(r, data(0, [0, 1], rank=0, expected=2, s=(0, 4)))
    ev += feed(r, data(1, [2], rank=0, expected=1))
    assert delivered(ev) == [] and gaps(ev) == []  # position 2 is complete but waits for 0-1
    ev += feed(r, data(0, [0, 1], rank=1, expected=2, s=(4, 8)))
    assert delivered(ev) == [0, 1, 2]
    assert [list(e.positions) for e in ev if isinstance(e, Tokens)] == [[0, 1], [2]]


def test_a_group_no_rank_can_complete_any_more_is_missing_at_once():
    r = plain()
    feed(r, begin())
    # Rank 1's step-0 record never arrives but its step-1 record does: rings are FIFO, so step 0
    # can no longer complete (its record was dropped, or consumed by a previous daemon).
    ev = feed(r, data(0, [0, 1], rank=0, expected=2, s=(0, 4)), data(1, [2], rank=0, expected=2, s=(0, 4)),
              data(1, [2], rank=1, expected=2, s=(4, 8)))
    assert gaps(ev) == [([0, 1], INCOMPLETE)] and delivered(ev) == [2]
    assert feed(r, data(0, [0, 1], rank=1, expected=2, s=(4, 8))) == []  # too late: ignored


def test_recomputed_positions_are_delivered_once():
    r = plain()
    feed(r, begin())
    ev = feed(r, data(0, [0, 1, 2, 3]), data(1, [4]))
    # Preempted and recomputed from scratch: positions 0..5 again in a later step.
    rec = data(2, [0, 1, 2, 3, 4, 5])
    ev += feed(r, rec)
    assert delivered(ev) == [0, 1, 2, 3, 4, 5]
    last = [e for e in ev if isinstance(e, Tokens)][-1]
    assert list(last.positions) == [5] and np.shares_memory(last.tensors["logits"], rec.sections[0].parts[0])
    ev += feed(r, data(3, [0, 1, 2]))  # a pure duplicate changes nothing
    assert delivered(ev) == [0, 1, 2, 3, 4, 5]
    assert r.stats["duplicate_records"] == 1


def test_drop_is_a_gap_at_once_and_late_slices_of_it_are_ignored():
    r = plain()
    feed(r, begin())
    ev = feed(r, data(0, [0, 1], rank=0, expected=2, s=(0, 4)),
              data(0, [0, 1], rank=1, expected=2, s=(4, 8)))
    ev += feed(r, drop([2, 3], rank=1))  # rank 1 had no room for step 1
    assert gaps(ev) == [([2, 3], DROPPED)]
    ev += feed(r, data(1, [2, 3], rank=0, expected=2, s=(0, 4)))  # rank 0's half of the dropped step
    ev += feed(r, data(2, [4], rank=0, expected=2, s=(0, 4)), data(2, [4], rank=1, expected=2, s=(4, 8)), end(5))
    assert delivered(ev) == [0, 1, 4]
    assert the_end(ev).missing_positions == [2, 3]


def test_positions_never_written_become_a_gap_once_later_ones_complete():
    r = plain()
    feed(r, begin())
    ev = feed(r, data(0, [3, 4]))  # e.g. a cached prefix was not recomputed
    assert gaps(ev) == [([0, 1, 2], NOT_CAPTURED)] and delivered(ev) == [3, 4]


def test_end_before_last_data_waits_then_completes():
    r = plain(end_grace_s=5.0)
    feed(r, begin())
    ev = feed(r, data(0, [0, 1, 2, 3]), end(5), now=1.0)
    assert not [e for e in ev if isinstance(e, End)]
    assert r.tick(3.0) == []
    ev = feed(r, data(1, [4]), now=3.5)
    assert delivered(ev) == [4] and the_end(ev).missing_positions == []


def test_end_grace_expiry_with_the_rings_read_declares_the_rest_missing():
    """No ring behind (none reported): end_grace_s after the END the capture ends. Steps a rank's
    slices came for and another's did not are `incomplete`; positions nothing came for, `timeout`."""
    r = plain(end_grace_s=2.0)
    feed(r, begin())
    ev = feed(r, data(0, [0, 1], rank=0, expected=2, s=(0, 4)), data(1, [2, 3], rank=0, expected=2, s=(0, 4)), now=0.0)
    ev += feed(r, end(6), now=1.0)
    assert r.tick(2.9) == []
    ev = r.tick(3.0)
    assert gaps(ev) == [([0, 1], INCOMPLETE), ([2, 3], INCOMPLETE), ([4, 5], TIMEOUT)]
    assert r.gap_positions == {INCOMPLETE: 4, TIMEOUT: 2}
    e = the_end(ev)
    assert e.reason == "stop" and e.missing_positions == [0, 1, 2, 3, 4, 5] and e.delivered == 0
    assert feed(r, data(2, [0, 1], rank=1, expected=2, s=(4, 8))) == []  # stragglers after the end are ignored
    assert r.stats["late_records"] == 1


def test_dead_worker_makes_pending_groups_missing_after_grace():
    r = plain(end_grace_s=1.0)
    feed(r, begin())
    feed(r, data(0, [0, 1], rank=0, expected=2, s=(0, 4), source="rank-00000.ring"),
         data(0, [0, 1], rank=1, expected=2, s=(4, 8), source="rank-00001.ring"))
    feed(r, data(1, [2], rank=0, expected=2, s=(0, 4), source="rank-00000.ring"))
    r.writer_gone("rank-00001.ring", 10.0)  # after its ring was drained: one more read of the others
    assert r.tick(10.2) == []
    ev = r.tick(10.25)
    assert gaps(ev) == [([2], WRITER_GONE)]
    assert r.in_flight() == 1  # the engine is alive: it will END the request
    ev = feed(r, end(3), now=11.5)
    e = the_end(ev)
    assert e.missing_positions == [2] and e.delivered == 2


def test_dead_engine_ends_requests():
    r = plain(end_grace_s=1.0)
    feed(r, begin(), data(0, [0, 1]))
    r.writer_gone("engine.ring", 5.0)
    ev = r.tick(6.0)
    e = the_end(ev)
    assert e.reason == WRITER_GONE and e.delivered == 2 and e.missing_positions == []


def test_data_before_begin_makes_a_lazy_request_then_the_begin_fills_it_in():
    r = plain()
    ev = feed(r, data(0, [0, 1]))
    assert isinstance(ev[0], Begin) and ev[0].lazy and ev[0].spec is None
    assert delivered(ev) == [0, 1]
    ev = feed(r, begin())
    assert len(ev) == 1 and ev[0].update and ev[0].spec is not None and ev[0].prompt_token_ids == [0, 1, 2, 3]
    ev = feed(r, data(1, [2]), end(3))
    assert delivered(ev) == [2] and the_end(ev).missing_positions == []


def test_no_begin_at_all_capture_starts_at_the_first_position_seen():
    r = plain()
    ev = feed(r, data(7, [10, 11]), data(8, [12]), end(13))
    assert delivered(ev) == [10, 11, 12]
    e = the_end(ev)
    assert e.expected == (10, 13) and e.missing_positions == []


def test_instances_are_independent():
    a, b = plain("a"), plain("b")
    ea = feed(a, begin(), data(0, [0]))
    eb = feed(b, begin(), data(0, [0, 1]))
    assert [e.key for e in ea] == [("a", RID)] * 2 and [e.key for e in eb] == [("b", RID)] * 2


def test_end_before_any_data_of_a_lazy_request_starts_where_the_data_does():
    # A restarted daemon reads the engine ring first: the END of a request whose BEGIN (and first
    # positions) the previous daemon consumed comes before the rest of its data.
    r = plain()
    ev = feed(r, end(13))
    assert isinstance(ev[0], Begin) and ev[0].lazy and not [e for e in ev if isinstance(e, End)]
    ev = feed(r, data(7, [11, 12]))
    assert delivered(ev) == [11, 12] and gaps(ev) == []
    e = the_end(ev)
    assert e.expected == (11, 13) and e.missing_positions == []


def test_last_output_holds_positions_until_the_end_names_the_last():
    from vllm_tap.spec import PositionsMode

    r = plain()
    ev = feed(r, begin(spec=CaptureSpec(positions=PositionsMode.LAST_OUTPUT)))
    assert ev[0].start_position is None
    # Workers write every output position (the last is unknown while the request runs).
    ev = feed(r, data(0, [3]), data(1, [4]), data(2, [5]))
    assert delivered(ev) == []
    ev = feed(r, end(6))
    assert delivered(ev) == [5]
    e = the_end(ev)
    assert e.expected == (5, 6) and e.missing_positions == []


# -- with the daemon's defaults: the newest position is held back (async scheduling) --


def test_rows_computed_past_the_end_before_the_end_is_read_are_never_delivered():
    """Async scheduling computes a finished request once more (position end_position); that row
    may be read before the END. Holding the newest position back keeps it out."""
    r = Reassembler()
    feed(r, begin())  # 4 prompt positions
    ev = feed(r, data(0, [0, 1, 2, 3]))
    assert delivered(ev) == [0, 1, 2, 3]  # prompt positions are never past the end
    ev = feed(r, data(1, [4]))
    assert delivered(ev) == []  # 4 waits for a later position or the END
    ev = feed(r, data(2, [5]))  # computed one step past the end: the END will say 5
    assert delivered(ev) == [4]
    ev = feed(r, end(5))
    assert delivered(ev) == []
    e = the_end(ev)
    assert e.complete and e.expected == (0, 5) and e.missing_positions == [] and e.delivered == 5


def test_rows_computed_past_the_end_after_the_end_are_dropped():
    r = Reassembler()
    feed(r, begin(), data(0, [0, 1, 2, 3]), data(1, [4]))
    ev = feed(r, end(5), data(2, [5]))
    assert delivered(ev) == [4] and the_end(ev).complete
    r2 = Reassembler(end_grace_s=5.0)  # the END first, while a rank still owes position 4
    feed(r2, begin(), data(0, [0, 1, 2, 3]))
    ev = feed(r2, end(5), data(2, [5]), data(1, [4]))
    assert delivered(ev) == [4] and the_end(ev).missing_positions == []
    assert r2.stats["past_end_records"] == 1


def test_a_dropped_row_past_the_end_is_not_a_missing_position():
    r = Reassembler()
    feed(r, begin(), data(0, [0, 1, 2, 3]), data(1, [4]))
    ev = feed(r, drop([5]), end(5))
    assert gaps(ev) == [] and delivered(ev) == [4] and the_end(ev).complete


# -- tails: the last N computed positions --


def test_a_tail_capture_keeps_only_its_last_positions_until_the_end_says_which():
    r = Reassembler()
    tail = dict(start=-1, tail=3)
    ev = feed(r, data(0, [0, 1, 2, 3], **tail), data(1, [4], **tail), data(2, [5], **tail))
    assert delivered(ev) == [] and gaps(ev) == []
    held = r.requests()[0]["held_bytes"]
    ev = feed(r, data(3, [6], **tail), data(4, [7], **tail))  # 7: one step past the end
    assert delivered(ev) == [] and r.requests()[0]["held_bytes"] <= held  # old positions are let go
    ev = feed(r, end(7))
    assert delivered(ev) == [4, 5, 6] and gaps(ev) == []
    e = the_end(ev)
    assert e.expected == (4, 7) and e.complete
    assert r.held_bytes == 0


def test_last_output_and_a_row_past_the_end():
    from vllm_tap.spec import PositionsMode

    r = Reassembler()
    feed(r, begin(spec=CaptureSpec(positions=PositionsMode.LAST_OUTPUT)))
    ev = feed(r, data(0, [3]), data(1, [4]), data(2, [5]), data(3, [6]), end(6))
    assert delivered(ev) == [5] and the_end(ev).expected == (5, 6) and the_end(ev).complete


def test_a_tail_capture_whose_writer_dies_keeps_the_last_positions_it_reached():
    r = Reassembler(end_grace_s=1.0)
    tail = dict(start=-1, tail=2)
    feed(r, data(0, [0, 1, 2, 3], **tail), data(1, [4], **tail))
    r.writer_gone("rank-00000.ring", 1.0)
    ev = r.tick(2.0)
    assert delivered(ev) == [3, 4]
    e = the_end(ev)
    assert e.reason == WRITER_GONE and not e.complete and e.expected == (3, 5)


# -- where a capture starts, when the BEGIN was not seen --


def test_a_lazy_capture_reports_its_head_first_from_the_request_tables_start():
    r = Reassembler()
    r.resumed_ring("rank-00000.ring")  # a previous daemon had been reading it
    ev = feed(r, data(5, [8, 9], start=0))
    assert isinstance(ev[0], Begin) and ev[0].lazy and ev[0].start_position == 0
    assert gaps(ev) == [(list(range(8)), NOT_CAPTURED_PREVIOUS)] and delivered(ev) == [8]
    assert [type(e).__name__ for e in ev] == ["Begin", "Gap", "Tokens"]  # the gap before any data
    ev = feed(r, data(6, [10]), end(11))
    assert delivered(ev) == [9, 10]
    e = the_end(ev)
    assert e.expected == (0, 11) and e.missing_positions == list(range(8)) and not e.complete


def test_a_lazy_capture_from_a_ring_nobody_read_before_says_not_captured():
    r = Reassembler()
    ev = feed(r, data(0, [3, 4], start=0))
    assert gaps(ev) == [([0, 1, 2], NOT_CAPTURED)]


def test_an_end_carrying_the_spec_places_a_lazy_capture():
    r = Reassembler()
    r.resumed_ring("engine.ring")
    ev = feed(r, end(10, spec=CaptureSpec()))
    assert isinstance(ev[0], Begin) and ev[0].start_position == 0 and ev[0].spec is not None
    ev = feed(r, data(3, [7, 8, 9]))
    assert gaps(ev) == [(list(range(7)), NOT_CAPTURED_PREVIOUS)] and delivered(ev) == [7, 8, 9]
    assert the_end(ev).missing_positions == list(range(7))


def test_an_end_whose_data_a_previous_daemon_consumed_ends_with_that_reason():
    r = Reassembler(end_grace_s=1.0)
    r.resumed_ring("engine.ring")
    feed(r, end(6, spec=CaptureSpec()), now=0.0)
    ev = r.tick(1.0)
    assert gaps(ev) == [(list(range(6)), NOT_CAPTURED_PREVIOUS)] and not the_end(ev).complete


# -- source --


def test_source_travels_from_begin_and_from_the_request_table():
    r = Reassembler()
    ev = feed(r, begin(n_prompt=1, spec=CaptureSpec(source="policy")), data(0, [0]), end(1, n_prompt=1))
    assert ev[0].source == "policy" and the_end(ev).source == "policy"
    r2 = Reassembler()
    ev = feed(r2, data(0, [0], start=0, origin="policy"))
    assert ev[0].lazy and ev[0].source == "policy"


# -- ends without an END --


def test_two_live_records_without_the_request_end_it_after_the_grace():
    r = Reassembler(end_grace_s=1.0)
    feed(r, begin(n_prompt=1), data(0, [0, 1, 2]), now=0.0)
    feed(r, live(), now=1.0)
    feed(r, live(), now=2.0)
    assert r.tick(2.9) == []
    ev = r.tick(3.0)
    assert delivered(ev) == [2]  # the held newest goes out: nothing says it is past an end
    e = the_end(ev)
    assert e.reason == END_LOST and not e.complete and e.end_position is None and e.expected == (0, 3)


def test_one_live_record_without_the_request_then_silence_ends_it():
    r = Reassembler(end_grace_s=1.0, live_silence_s=3.0)
    feed(r, begin(), data(0, [0, 1]), now=0.0)
    feed(r, live(), now=1.0)  # the last LIVE the engine writes, once no capture runs
    assert r.tick(4.9) == []
    assert the_end(r.tick(5.0)).reason == END_LOST


def test_a_record_after_an_absence_or_a_listing_keeps_the_capture():
    r = Reassembler(end_grace_s=1.0, live_silence_s=3.0)
    feed(r, begin(), data(0, [0, 1]), now=0.0)
    feed(r, live(), now=1.0)
    feed(r, data(1, [2]), now=1.5)  # read after that LIVE but written before it: it still runs
    feed(r, live(), now=2.0)
    assert r.tick(3.5) == []  # two absences in a row, but not two without a record between
    feed(r, live(RID), now=3.6)
    feed(r, live(), now=4.0)
    assert r.tick(7.5) == []  # one absence since it was listed; silence counts from 4.0
    assert the_end(r.tick(8.0)).reason == END_LOST


def test_live_records_count_only_from_the_engine_ring():
    r = Reassembler(end_grace_s=1.0)
    feed(r, begin(), data(0, [0, 1]), now=0.0)
    bogus = control_record(LiveMeta([]), "", ring="rank-00000.ring", rank=0)
    feed(r, bogus, now=1.0)
    feed(r, bogus, now=2.0)
    assert r.tick(20.0) == [] and r.in_flight() == 1


def test_a_dead_writer_ends_its_captures_after_a_short_grace_not_the_end_grace():
    r = Reassembler(end_grace_s=5.0)
    feed(r, begin(), data(0, [0, 1, 2]), now=0.0)
    r.writer_gone("engine.ring", 1.0)
    assert r.tick(1.2) == []
    e = the_end(r.tick(1.25))
    assert e.reason == WRITER_GONE and not e.complete


def test_a_malformed_record_ends_the_captures_it_names():
    r = Reassembler()
    feed(r, begin(n_prompt=1), data(0, [0, 1, 2]), now=0.0)
    ev = r.reject([RID, "never-begun"], "request table: Expected `int`", 1.0)
    mine = [e for e in ev if e.request_id == RID]
    assert delivered(mine) == [2] and the_end(mine).reason == MALFORMED
    other = [e for e in ev if e.request_id == "never-begun"]
    assert isinstance(other[0], Begin) and the_end(other).reason == MALFORMED
    assert feed(r, data(1, [3])) == [] and r.stats["late_records"] == 1  # what follows is late


def test_a_cut_capture_keeps_nothing_and_reports_the_rest_as_gaps():
    r = Reassembler()
    feed(r, begin(), data(0, [0, 1, 2, 3], rank=0, expected=2, s=(0, 4)))
    assert r.held_bytes > 0
    ev = r.cut(RID, 1.0, reason=OVER_BUDGET)
    assert r.held_bytes == 0 and r.stats["captures_cut"] == 1
    ev += feed(r, data(1, [4]), data(2, [5]), end(6))
    assert delivered(ev) == []
    assert [g[1] for g in gaps(ev)] == [OVER_BUDGET] * len(gaps(ev))
    e = the_end(ev)
    assert e.missing_positions == list(range(6)) and not e.complete and r.held_bytes == 0


def test_far_apart_positions_cost_ranges():
    r = Reassembler()
    far = (1 << 31) - 2
    ev = feed(r, begin(), data(0, [0, far]), end(far + 1))
    e = the_end(ev)
    assert delivered(ev) == [0, far] and e.missing_positions.ranges == [(1, far)]
    (gap,) = [x for x in ev if isinstance(x, Gap)]  # not gaps(): it would list two billion positions
    assert gap.positions == range(1, far) and gap.reason == NOT_CAPTURED and len(e.missing_positions) == far - 1


def test_bytes_held_are_counted_and_given_back():
    r = Reassembler()
    feed(r, begin(n_prompt=1))
    feed(r, data(0, [0, 1], rank=0, expected=2, s=(0, 4)))
    one = r.held_bytes
    assert one > 0 and dict(r.request_bytes())[RID] == one
    feed(r, data(0, [0, 1], rank=1, expected=2, s=(4, 8)))  # complete: 0 out, 1 held back as Tokens
    assert 0 < r.held_bytes < 2 * one
    feed(r, end(2, n_prompt=1))
    assert r.held_bytes == 0 and list(r.request_bytes()) == []


def test_a_record_read_after_the_last_live_record_only_delays_the_end():
    """The engine writes one LIVE after the last capture ends; data written before it can be read
    after it (another ring). That must not keep the capture open for ever."""
    r = Reassembler(end_grace_s=1.0, live_silence_s=3.0)
    feed(r, begin(), data(0, [0, 1]), now=0.0)
    feed(r, live(), now=1.0)
    feed(r, data(1, [2]), now=1.1)
    assert r.tick(4.0) == []
    assert the_end(r.tick(5.1)).reason == END_LOST  # 1.1 + 3 s of quiet + 1 s grace


def test_prompt_positions_are_never_held_back():
    """Only a decode step runs past the end: a prompt capture is delivered at prefill, not at the END."""
    from vllm_tap.spec import PositionsMode

    r = Reassembler()
    feed(r, begin(n_prompt=6, spec=CaptureSpec(positions=PositionsMode.PROMPT)))
    ev = feed(r, data(0, [0, 1, 2, 3], n_prompt=6), data(1, [4, 5], n_prompt=6))
    assert delivered(ev) == [0, 1, 2, 3, 4, 5]
    ev = feed(r, data(2, [6], n_prompt=6))  # the first decode step (workers of a prompt capture skip it)
    assert delivered(ev) == []


def test_nothing_is_held_back_when_the_engine_does_not_schedule_asynchronously():
    r = Reassembler()
    b = control_record(BeginMeta(spec=spec_field(CaptureSpec()), num_prompt_tokens=2, async_scheduling=False), RID)
    ev = feed(r, b, data(0, [0, 1]), data(1, [2]))
    assert delivered(ev) == [0, 1, 2]
    ev = feed(r, data(2, [3]))
    assert delivered(ev) == [3]


# -- captures a worker shed (hooks/admission.py) --


def shed(rid=RID, rank=0, n_prompt=4, spec=None) -> ControlRecord:
    s = spec or CaptureSpec()
    return control_record(ShedMeta(reason="overloaded", num_prompt_tokens=n_prompt, spec=spec_field(s),
                                   source=s.source), rid, rank=rank, ring=f"rank-{rank:05d}.ring")


def _one_overloaded_gap(ev, stop: int) -> None:
    assert [(type(e).__name__, list(getattr(e, "positions", ()))) for e in ev if isinstance(e, (Gap, Tokens))] == \
        [("Gap", list(range(stop)))], ev
    assert gaps(ev)[0][1] == OVERLOADED
    e = the_end(ev)
    assert e.reason == "stop" and not e.complete and e.missing_positions == list(range(stop))


def test_a_capture_shed_by_one_rank_is_one_overloaded_gap_whatever_the_other_rank_wrote_and_the_order():
    """Tensor-parallel ranks decide admission from their own rings and may disagree: rank 0 admits
    and writes its slices, rank 1 sheds. The capture is one gap `overloaded`, never a run of
    `incomplete` gaps, in whichever order the daemon reads the rings."""
    r0 = [data(0, [0, 1, 2, 3], rank=0, expected=2, s=(0, 4)), data(1, [4], rank=0, expected=2, s=(0, 4))]
    orders = {
        "data, shed, end": [begin(), *r0, shed(rank=1), end(5)],
        "end, data, shed": [begin(), end(5), *r0, shed(rank=1)],
        "shed, data, end": [begin(), shed(rank=1), *r0, end(5)],
        "no begin": [shed(rank=1), *r0, end(5)],
    }
    for name, records in orders.items():
        r = plain()
        ev = feed(r, *records)
        _one_overloaded_gap(ev, 5)
        assert r.stats["captures_shed"] == 1, name
        assert r.held_bytes == 0 and r.in_flight() == 0, name


def test_a_capture_shed_by_every_rank_is_counted_once():
    r = plain()
    ev = feed(r, begin(), shed(rank=0), shed(rank=1), end(5))
    _one_overloaded_gap(ev, 5)
    assert r.stats["captures_shed"] == 1


def test_a_shed_capture_whose_end_never_comes_still_ends_as_overloaded():
    r = Reassembler(end_grace_s=1.0)
    feed(r, begin(), shed(rank=0), now=0.0)
    feed(r, live(), now=1.0)
    feed(r, live(), now=2.0)
    ev = r.tick(3.0)
    e = the_end(ev)
    assert e.reason == END_LOST and not e.complete
    assert {reason for _, reason in gaps(ev)} <= {OVERLOADED}


def test_a_shed_capture_handed_over_to_the_next_daemon_still_ends_as_one_overloaded_gap():
    """A graceful stop after the SHED was read and before the END: the next daemon never reads that
    SHED again (the ring cursor moved past it), so the handover carries it."""
    import msgspec

    from vllm_tap.daemon import handover as ho

    first = plain()
    feed(first, begin(), shed(rank=0))
    blob = msgspec.msgpack.encode(first.export_state())
    second = plain()
    ev = second.restore(msgspec.msgpack.decode(blob, type=list[ho.InFlight]), 1.0)
    ev += feed(second, end(5), now=1.0)
    _one_overloaded_gap(ev, 5)


def test_a_handover_carries_what_the_stopping_daemon_delivered_and_the_next_delivers_it_again():
    """A graceful stop mid-capture: the positions already delivered (the history the stopping daemon
    filed) go over with the handover, so a subscriber of the next daemon gets them as they were,
    then what was held, then what the rings bring: no position lost, none twice. Where the history
    no longer holds some (retention), those are one Gap NOT_CAPTURED_PREVIOUS."""
    import msgspec

    from vllm_tap.daemon import handover as ho

    for keep in (slice(None), slice(1, None)):
        first = Reassembler()
        history = feed(first, begin(n_prompt=2), data(0, [0, 1]), data(1, [2]), data(2, [3]))
        assert delivered(history) == [0, 1, 2]  # 3 is held back (HOLD_NEWEST)
        filed = [e for e in history if isinstance(e, (Tokens, Gap))][keep]
        blob = msgspec.msgpack.encode(first.export_state(lambda rid: filed))
        second = Reassembler()
        ev = second.restore(msgspec.msgpack.decode(blob, type=list[ho.InFlight]), 1.0)
        ev += feed(second, data(3, [4]), end(5, n_prompt=2), now=1.0)
        assert delivered(ev) == ([0, 1, 2, 3, 4] if keep.start is None else [2, 3, 4])
        assert gaps(ev) == ([] if keep.start is None else [([0, 1], NOT_CAPTURED_PREVIOUS)])
        toks = [e for e in ev if isinstance(e, Tokens)]
        got = np.concatenate([t.tensors["logits"] for t in toks])
        assert got.tobytes() == vals("logits", delivered(ev), 0, V).tobytes()
        e = the_end(ev)
        assert e.complete == (keep.start is None) and e.missing_positions == ([] if keep.start is None else [0, 1])


def test_a_handover_whose_delivered_spans_overlap_is_refused_for_that_capture_alone():
    import msgspec

    from vllm_tap.daemon import handover as ho

    first = Reassembler()
    history = feed(first, begin(n_prompt=2), data(0, [0, 1]), data(1, [2]), data(2, [3]))
    filed = [e for e in history if isinstance(e, Tokens)]
    state = first.export_state(lambda rid: filed + filed)  # the same positions twice: not what a daemon writes
    ev = Reassembler().restore(msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=list[ho.InFlight]), 1.0)
    assert ev == []


# -- a capture's end waits for its rings to be read, not for a clock --

R0, R1 = "rank-00000.ring", "rank-00001.ring"


def tp2(step, positions, rank) -> DataRecord:
    half = V // 2
    return data(step, positions, rank=rank, expected=2, s=(0, half) if rank == 0 else (half, V),
                source=f"rank-{rank:05d}.ring")


def test_an_end_read_long_before_its_data_waits_for_it_in_every_order_across_ranks():
    """The daemon reads the engine ring's END at once and the two ranks' rings minutes later (it is
    behind): however the ranks' records interleave (each ring is in its writer's order), the
    capture is complete, and it does not end before its last slice, however long past end_grace_s."""
    import itertools

    records = [tp2(0, [0, 1, 2, 3], 0), tp2(1, [4], 0), tp2(2, [5], 0),
               tp2(0, [0, 1, 2, 3], 1), tp2(1, [4], 1), tp2(2, [5], 1)]
    orders = []  # every interleaving of rank 0's three records with rank 1's
    for mine in itertools.combinations(range(6), 3):
        r0, r1 = iter(range(3)), iter(range(3, 6))
        orders.append([next(r0) if k in mine else next(r1) for k in range(6)])
    assert len(orders) == 20
    for order in orders:
        r = Reassembler(end_grace_s=5.0)
        r.ring_read(R0, 0, 1000, 0.0)  # far behind both rings
        r.ring_read(R1, 0, 1000, 0.0)
        ev = feed(r, begin(), end(6), now=0.0)
        ev += r.tick(10.0)  # past the grace: the capture waits on where the rings are now
        ev += r.ring_read(R0, 100, 2000, 10.1)
        ev += r.ring_read(R1, 100, 2000, 10.1)
        ev += r.tick(600.0)
        assert not [e for e in ev if isinstance(e, End)], order
        read = {R0: 100, R1: 100}
        for k, i in enumerate(order):
            rec = records[i]
            ev += r.feed(rec, 600.0 + k)
            read[rec.ring] += 300
            ev += r.ring_read(rec.ring, read[rec.ring], 2000, 600.0 + k)
            ev += r.tick(600.5 + k)
        assert delivered(ev) == list(range(6)) and gaps(ev) == [], order
        assert the_end(ev).complete and r.in_flight() == 0, order


def test_what_the_rings_held_when_the_barrier_is_passed_decides_the_gaps_and_their_reasons():
    """Behind by minutes; once every ring was read past where it stood end_grace_s after the END,
    the positions still missing are gaps saying what happened: `dropped` (a DROP read late),
    `incomplete` (rank 1's slice never came), `timeout` (nothing came)."""
    r = Reassembler(end_grace_s=5.0)
    r.ring_read(R0, 0, 5000, 0.0)
    r.ring_read(R1, 0, 5000, 0.0)
    ev = feed(r, begin(), end(7), now=0.0)
    ev += r.tick(5.0)
    ev += r.ring_read(R0, 10, 6000, 5.1) + r.ring_read(R1, 10, 7000, 5.1)  # the Barrier: 6000 and 7000
    ev += feed(r, tp2(0, [0, 1, 2, 3], 0), tp2(0, [0, 1, 2, 3], 1), now=300.0)
    ev += feed(r, drop([4], rank=1), tp2(2, [5], 0), now=300.0)  # rank 0's half of step 1 came and went: 4 is dropped
    ev += r.ring_read(R0, 6000, 9000, 300.0)  # rank 0 is read up to its cursor; rank 1 is not yet
    ev += r.tick(300.1)
    assert delivered(ev) == [0, 1, 2, 3] and gaps(ev) == [([4], DROPPED)]
    assert not [e for e in ev if isinstance(e, End)]
    ev = r.ring_read(R1, 7000, 9000, 301.0)
    assert gaps(ev) == [([5], INCOMPLETE), ([6], TIMEOUT)]
    e = the_end(ev)
    assert e.reason == "stop" and e.missing_positions == [4, 5, 6] and e.delivered == 4
    assert r.gap_positions == {DROPPED: 1, INCOMPLETE: 1, TIMEOUT: 1}


def test_a_ring_closed_stops_counting_and_a_ring_opened_later_counts_from_its_first_poll():
    r = plain(end_grace_s=1.0)
    r.ring_read(R0, 0, 100, 0.0)
    r.ring_read(R1, 0, 100, 0.0)
    feed(r, begin(), data(0, [0, 1]), end(3), now=0.0)
    r.tick(1.0)
    r.ring_read(R0, 100, 100, 1.1)
    r.ring_read(R1, 50, 200, 1.1)  # rank 1 is behind: the Barrier waits for 200
    assert r.tick(100.0) == [] and r.waiting_for_rings() == 1
    assert r.ring_read("engine.ring", 0, 10**9, 100.0) == []  # control records only: never waited for
    assert r.requests()[0]["waiting_for_rings"]
    r2 = "rank-00002.ring"
    assert r.ring_read(r2, 0, 10, 100.0) == []  # a ring found after the Barrier: its cursor at its first poll
    assert r.ring_closed(R1, 100.1) == []  # no longer read: no longer waited for; rank 2 still is
    ev = r.ring_read(r2, 10, 10, 100.2)
    assert gaps(ev) == [([2], TIMEOUT)] and the_end(ev).missing_positions == [2]
    assert r.waiting_for_rings() == 0


def test_an_end_lost_waits_for_the_rings_too_and_a_record_read_meanwhile_keeps_the_capture():
    """The engine ring is read at once, so LIVE records stop naming a capture while its data is
    still in a worker ring the daemon is behind on: it does not end `end lost` before that is read,
    and a record of it read meanwhile keeps it going."""
    r = Reassembler(end_grace_s=1.0)
    r.ring_read(R0, 0, 1000, 0.0)
    feed(r, begin(n_prompt=1), data(0, [0, 1, 2]), now=0.0)
    feed(r, live(), live(), now=1.0)  # two LIVE records without it, read in one go after a stop
    ev = r.tick(2.0)  # lost at 1.0, plus the grace: waits for rank 0 up to 1000 (its next poll)
    ev += r.ring_read(R0, 500, 1000, 2.1)
    assert r.tick(2.2) == [] and r.waiting_for_rings() == 1
    ev += feed(r, data(1, [3]), now=2.3)  # it was running after all
    ev += r.ring_read(R0, 1000, 1000, 2.4)
    assert not [e for e in ev if isinstance(e, End)] and r.waiting_for_rings() == 0
    feed(r, live(), now=3.0)
    feed(r, live(), now=4.0)
    ev = r.tick(5.0) + r.ring_read(R0, 1000, 1000, 5.1)
    e = the_end(ev)
    assert e.reason == END_LOST and delivered(ev) == [3] and e.missing_positions == [] and r.stats["ends_lost"] == 1


def test_gap_positions_are_counted_by_reason_with_free_text_kept_out_of_the_names():
    r = plain()
    feed(r, begin(), data(0, [2, 3]))  # 0..1 never written
    r.cut(RID, 1.0, reason=f"{OVER_BUDGET}: captures in flight held more than inflight_bytes=1")
    feed(r, data(1, [4]), end(5))
    r2 = plain()
    feed(r2, begin())
    feed(r2, control_record(ShedMeta(reason="x" * 40, num_prompt_tokens=4, spec=spec_field(CaptureSpec())), RID,
                            rank=0, ring=R0), end(5))
    assert r.gap_positions == {NOT_CAPTURED: 2, OVER_BUDGET: 1}
    assert r2.gap_positions == {"other": 5}


def test_a_step_whose_other_record_a_previous_daemon_read_is_consumed_not_incomplete():
    """A worker writes a step's hidden states and its logits as two records; a daemon killed between
    reading them leaves the next daemon the second alone. Those positions went with the previous
    daemon, whether a later step shows it at once or the capture's end does."""
    hidden = TensorId(rf.TensorKind.HIDDEN, 0)
    for later_step in (True, False):
        r = plain(end_grace_s=1.0)
        r.resumed_ring(R0)
        ev = feed(r, data(3, [6], tensor=hidden, parts=2, start=0, source=R0), now=0.0)  # its logits went before
        if later_step:
            ev += feed(r, data(4, [7], parts=2, source=R0), data(4, [7], tensor=hidden, parts=2, source=R0))
        ev += feed(r, end(8))
        ev += r.tick(1.0)
        got = [(p, reason) for ps, reason in gaps(ev) for p in ps]
        assert got == [(p, NOT_CAPTURED_PREVIOUS) for p in range(7)] + ([] if later_step else [(7, TIMEOUT)]), got
        assert delivered(ev) == ([7] if later_step else [])
        assert INCOMPLETE not in r.gap_positions
    r = plain()  # a capture this daemon saw begin: a step missing a record is `incomplete`
    ev = feed(r, begin(), data(0, [0, 1], tensor=hidden, parts=2), data(1, [2], parts=2), data(1, [2], tensor=hidden, parts=2))
    assert gaps(ev) == [([0, 1], INCOMPLETE)]


# -- what a restarted daemon reads again (the rings' cursors stay below what is held unfiled) --


def _at(rec, cursor: int):
    rec.cursor = cursor  # where a ring reader read it from
    return rec


def _holds(r: Reassembler, floors: dict) -> dict:
    out: dict = {}
    r.holds(floors, out)
    return out


def test_what_is_held_unfiled_names_where_its_records_start_in_their_rings():
    r = Reassembler()  # the daemon's defaults: the newest position is held back
    r0, r1 = ("rank-00000.ring", 0), ("rank-00001.ring", 0)  # (ring, epoch)
    floors = {r0: 0, r1: 0}
    feed(r, begin())
    feed(r, _at(data(0, [0, 1, 2, 3], expected=2, s=(0, 4)), 64))
    assert _holds(r, floors) == {r0: 64}  # a step waiting for its other rank
    ev = feed(r, _at(data(0, [0, 1, 2, 3], rank=1, expected=2, s=(4, 8)), 128))
    assert delivered(ev) == [0, 1, 2, 3] and _holds(r, floors) == {}  # prompt positions are never held
    feed(r, _at(data(1, [4], expected=2, s=(0, 4)), 192), _at(data(1, [4], rank=1, expected=2, s=(4, 8)), 256))
    assert _holds(r, floors) == {r0: 192, r1: 256}  # the newest position, held back for a later one
    ev = feed(r, _at(data(2, [5], expected=2, s=(0, 4)), 320), _at(data(2, [5], rank=1, expected=2, s=(4, 8)), 384))
    assert delivered(ev) == [4] and _holds(r, floors) == {r0: 320, r1: 384}
    assert _holds(r, {r0: 400, r1: 0}) == {r1: 384}  # a hold below a ring's file cursor was given up
    assert _holds(r, {r1: 0}) == {r1: 384}  # a ring no longer read
    ev = feed(r, end(6))
    assert delivered(ev) == [5] and the_end(ev).complete and _holds(r, floors) == {}


def test_a_whole_record_of_decode_steps_is_held_by_its_own_cursor():
    """The direct way (a record of whole tensors, daemon/reassembly: _on_data) holds its span by the
    record's cursor too, and a record never read from a ring here (cursor -1) holds nothing."""
    from vllm_tap.ring_records import RequestRef, Section

    def whole(step: int, pos: int, cursor: int) -> DataRecord:
        x = vals("logits", [pos], 0, V)
        return DataRecord(step, 0, "rank-00000.ring", 0, [RequestRef(RID, "", 4, 1, 1, -1, 0, "client")],
                          np.asarray([pos], np.int32), np.asarray([pos + 1000], np.int32), [(0, None)],
                          [Section.whole_of(LOGITS, rf.DType.FLOAT32, x)], True, cursor=cursor)

    r = Reassembler()
    floors = {("rank-00000.ring", 0): 0}
    feed(r, begin(), data(0, [0, 1, 2, 3]))
    ev = feed(r, whole(1, 4, 512))
    assert delivered(ev) == [] and r.stats["direct"] == 1
    assert _holds(r, floors) == {("rank-00000.ring", 0): 512}
    ev = feed(r, whole(2, 5, -1))
    assert delivered(ev) == [4] and _holds(r, floors) == {}


def test_records_read_again_after_a_restart_count_only_for_captures_in_flight():
    """Below where the earlier daemon had read (resumed_ring's replay_until) records of captures it
    finished (not in flight here) are skipped, BEGINs too; a capture in flight takes what it lacks
    and skips what it has; past that point every record counts as ever."""
    r = plain()
    r.resumed_ring("rank-00000.ring", replay_until=1000)
    r.resumed_ring(ENGINE, replay_until=1000)
    feed(r, _at(begin("live"), 2000), _at(data(0, [0, 1, 2, 3], rid="live"), 2064))
    ev = feed(r, _at(begin("done"), 10), _at(data(0, [0, 1, 2, 3], rid="done"), 500), _at(end(4, rid="done"), 20))
    assert ev == [] and r.stats["replayed_records"] == 3 and r.in_flight() == 1
    ev = feed(r, _at(data(0, [0, 1, 2, 3], rid="live"), 600), _at(data(1, [4], rid="live"), 700))
    assert delivered(ev) == [4] and r.stats["duplicate_records"] == 1  # what it has, then what it lacked
    ev = feed(r, _at(data(0, [0, 1, 2, 3], rid="new"), 1000))
    assert [type(e).__name__ for e in ev] == ["Begin", "Tokens"] and delivered(ev) == [0, 1, 2, 3]
    r.ring_closed("rank-00000.ring", 0.0)  # a new file under the name starts counting from its start
    ev = feed(r, _at(data(0, [0, 1, 2, 3], rid="other"), 10))
    assert delivered(ev) == [0, 1, 2, 3]


def test_a_capture_an_earlier_run_finished_is_not_started_again_by_its_records_but_a_new_begin_starts_one():
    r = plain()
    r.finished_before("done", (ENGINE, 0, 128))  # its BEGIN record: ring, epoch, cursor
    ev = feed(r, _at(begin("done"), 128), data(0, [0, 1, 2, 3], rid="done"), end(4, rid="done"))
    assert ev == [] and r.in_flight() == 0 and r.stats["replayed_records"] == 1 and r.stats["late_records"] == 1
    b = _at(begin("done"), 128)
    b.epoch = 4  # the same place in another file (the engine restarted): a new request of that id
    ev = feed(r, b, data(0, [0, 1, 2, 3], rid="done"))
    assert [type(e).__name__ for e in ev] == ["Begin", "Tokens"] and delivered(ev) == [0, 1, 2, 3]
    assert ev[0].origin == (ENGINE, 4, 128)  # what the journal keeps of it
