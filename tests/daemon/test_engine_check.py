"""The start-up check of engines across hosts (daemon/engine_check.py), pure: placements and time in,
one line per problem out, and the status and metrics that say it."""

from __future__ import annotations

import logging

from vllm_tap.daemon.engine_check import RANKS_GRACE_S, EngineCheck, writing_ranks
from vllm_tap.daemon.metrics import _engine_families
from vllm_tap.status_format import DaemonStatus
from vllm_tap.placement import Placement


def place(host: str, rank: int | None, *, tp=1, pp=2, nnodes=2, settings="aaaa", node=0) -> Placement:
    common = dict(host=host, address=host, instance="e", home="home:29500", world_size=tp * pp, tp_size=tp,
                  pp_size=pp, nnodes=nnodes, node_rank=node, settings=settings)
    if rank is None:
        return Placement(engine=True, **common)
    return Placement(pp_rank=rank // tp, tp_rank=rank % tp, **common)


def test_writing_ranks_follow_the_home_under_tensor_parallel_across_hosts():
    assert writing_ranks(place("h", None, tp=1, pp=2)) == {0, 1}  # a stage per host: each writes
    assert writing_ranks(place("h", None, tp=2, pp=1)) == {0}  # tp across hosts: the home's rank alone
    assert writing_ranks(place("h", None, tp=4, pp=2, nnodes=2)) == set(range(8))  # a whole stage per host


def test_a_rank_that_never_reports_is_said_once_after_the_grace(caplog):
    check = EngineCheck()
    seen = [("e", -1, place("home", None)), ("e", 0, place("home", 0))]
    assert check.observe(seen, 0.0) == []
    assert check.status(1.0)[0]["ranks_missing"] == []  # workers still starting
    with caplog.at_level(logging.ERROR, "vllm_tap.daemon.engine_check"):
        new = check.observe(seen, RANKS_GRACE_S)
        assert check.observe(seen, RANKS_GRACE_S + 1) == []  # said once
    assert len(new) == 1 and "ranks [1]" in new[0] and "never reported" in new[0]
    assert [r.getMessage() for r in caplog.records] == new
    st = check.status(RANKS_GRACE_S)[0]
    assert st["world_size"] == 2 and st["ranks_missing"] == [1] and st["ranks_reporting"] == [0]
    [missing, _] = list(_engine_families(DaemonStatus(engines=[st])))
    assert [s.value for s in missing.samples] == [1.0]
    # The rank comes (the peer daemon started late): nothing missing any more.
    check.observe(seen + [("e", 1, place("peer", 1, node=1))], RANKS_GRACE_S + 2)
    assert check.status(RANKS_GRACE_S + 2)[0]["ranks_missing"] == []


def test_a_host_with_other_tap_settings_is_said_at_once():
    check = EngineCheck()
    new = check.observe([("e", -1, place("home", None)), ("e", 0, place("home", 0)),
                         ("e", 1, place("peer", 1, settings="bbbb", node=1))], 0.0)
    assert len(new) == 1 and "['peer']" in new[0] and "other settings" in new[0]
    st = check.status(0.0)[0]
    assert st["settings_differ"] == ["peer"] and st["hosts"] == ["home", "peer"]
    [_, differ] = list(_engine_families(DaemonStatus(engines=[st])))
    assert [s.value for s in differ.samples] == [1.0]
