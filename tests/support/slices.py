"""DATA records made of single slices, as a ring reader would give a record of one request and one
tensor read the slices' way (reassembly tiles them by step): for tests that feed reassembly records
they build by hand."""

from __future__ import annotations

from vllm_tap.ring_records import DataRecord, RequestRef, Section, Slice


def record_of(s: Slice) -> DataRecord:
    """A DATA record carrying exactly `s` (its rows kept apart, not in a block)."""
    entry = RequestRef(s.request_id, s.tap_key, s.num_prompt_tokens, s.expected_ranks, s.rank_parts, s.start, s.tail,
                       s.source)
    sec = Section(s.tensor, s.dtype, s.slice_start, s.slice_stop, s.full_dim, None, [s.data], [s.whole])
    return DataRecord(s.step, s.rank, s.ring, s.epoch, [entry], s.positions, s.token_ids, [(0, None)], [sec],
                      cursor=s.cursor)
