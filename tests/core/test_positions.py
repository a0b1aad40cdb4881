"""PositionRanges: missing positions as ranges that still read like the list of ints they stand for."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_tap.positions import PositionRanges


def test_reads_like_a_sorted_list():
    p = PositionRanges([(5, 8), (0, 2), (7, 10)])
    assert p.ranges == [(0, 2), (5, 10)] and len(p) == 7
    assert p == [0, 1, 5, 6, 7, 8, 9] and list(p) == [0, 1, 5, 6, 7, 8, 9] and p != [0, 1]
    assert p[0] == 0 and p[2] == 5 and p[-1] == 9 and p[1:3] == [1, 5]
    assert 6 in p and 3 not in p and np.int64(9) in p
    assert np.asarray(p).tolist() == list(p) and set(p) == {0, 1, 5, 6, 7, 8, 9}
    assert json.loads(json.dumps(list(p))) == list(p)
    assert not PositionRanges() and PositionRanges() == [] and repr(PositionRanges([(0, 3)])) == "[0, 1, 2]"


def test_a_huge_gap_costs_one_range():
    p = PositionRanges([(1, 1 << 31)])
    assert len(p) == (1 << 31) - 1 and p[-1] == (1 << 31) - 1 and (1 << 30) in p
    assert "PositionRanges(1..2147483647)" == repr(p)
    assert p.union([(0, 1)]).ranges == [(0, 1 << 31)] and p.clip(10, 20).ranges == [(10, 20)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 200), max_size=60))
def test_of_positions_round_trips(ps):
    p = PositionRanges.of(ps)
    assert list(p) == sorted(set(ps)) and p == sorted(set(ps)) and len(p) == len(set(ps))
    assert all(b > a for a, b in p.ranges) and all(p.ranges[i][1] < p.ranges[i + 1][0] for i in range(len(p.ranges) - 1))
