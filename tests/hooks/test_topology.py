"""An engine across hosts (hooks/topology.py): which tp ranks of each stage write, and what the
capture core then writes on each rank. A stage whose tp group spans hosts writes from its ranks on
the engine's home alone, each a larger share, so nothing captured crosses to the home; a stage with
no rank on the home writes from all its ranks. The daemon learns how many ranks write a step from
the records (expected ranks), so a capture is whole from the home's rings alone."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from test_step_capture import LAYERS, Step, make_core
from vllm_tap.hooks.capture_core import RankPlace
from vllm_tap.hooks.topology import home_writers
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_records import per_tensor
from vllm_tap.ring_writer import RingWriter
from vllm_tap.spec import CaptureSpec, LogitsMode


@pytest.mark.parametrize("tp, pp, nodes, want", [
    (2, 1, 1, ((0, 1),)),  # one host: every rank
    (2, 1, 2, ((0,),)),  # tp across two hosts: the home's rank alone
    (4, 1, 2, ((0, 1),)),
    (2, 2, 2, ((0, 1), (0, 1))),  # a stage a host: stage 1 is not on the home and writes as on one host
    (4, 2, 4, ((0, 1), (0, 1, 2, 3))),  # stage 0 spans the home and node 1; stage 1 is off the home
    (1, 2, 2, ((0,), (0,))),
])
def test_the_writers_of_each_stage(tp, pp, nodes, want):
    assert home_writers(tp, pp, tp * pp // nodes) == want


@pytest.mark.parametrize("spec", [CaptureSpec(layers=LAYERS), CaptureSpec(logits=LogitsMode.TOPK, topk=3, layers=(2,))],
                         ids=["full-logits+layers", "top-k+layer"])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "steady-decode"])
def test_tp_across_hosts_the_home_rank_writes_whole_rows_and_the_other_nothing(shm, spec, decode):
    """TP=2 over two hosts: rank 0 (home) writes every column of every tensor, as a single-rank engine
    would, and says one rank writes a step; rank 1 writes no DATA record at all."""
    writers = home_writers(2, 1, 1)
    got = {}
    for tp_rank in (0, 1):
        w = RingWriter(f"{shm}/inst/rank-{tp_rank:05d}.ring", 1 << 20, wake_daemon=False)
        core = make_core(w, staged=True, place=RankPlace(tp_rank=tp_rank, tp_size=2, stage_layers=(LAYERS,),
                                                         writers=writers))
        steps = ([Step([spec] * 3, [4, 3, 5], [0, 0, 0], [6, 6, 6])] if not decode else
                 [Step([spec] * 3, [1] * 3, [9 + k] * 3, [5] * 3, seed=k) for k in range(3)])
        steps[0].learn(core)
        reader = RingReader(w.path)
        recs = []
        try:
            for st in steps:
                core.capture(st.view(row_of={r: i for i, r in enumerate(st.req_ids)}))
                core.publisher.drain()
                recs += [(st, r) for r in per_tensor(reader.poll())]
            if decode:
                assert core.steady_steps == 3 if tp_rank == 0 else core.steady_steps == 0
        finally:
            reader.close()
            core.close()
            w.close(unlink=True)
        got[tp_rank] = recs
    assert got[1] == []
    seen = collections.Counter()
    for st, r in got[0]:
        assert (r.slice_start, r.slice_stop) == (0, r.full_dim) and r.expected_ranks == 1
        want = st.expected()[r.request_id]
        for j, p in enumerate(r.positions.tolist()):
            if r.tensor.name in want:
                np.testing.assert_allclose(r.data[j], want[r.tensor.name][p], atol=1e-5)
            seen[r.tensor.name] += 1
    names = {"hidden.2", "hidden.5", "logits"} if spec.logits == LogitsMode.FULL else {
        "hidden.2", "topk_ids", "topk_values", "logsumexp"}
    assert set(seen) == names


def test_every_rank_still_runs_the_extra_lm_head_pass_when_it_writes_nothing(shm):
    """The extra lm-head pass of prompt rows is a collective: a rank that writes nothing runs it."""
    w = RingWriter(f"{shm}/inst/rank-00001.ring", 1 << 20, wake_daemon=False)
    core = make_core(w, place=RankPlace(tp_rank=1, tp_size=2, stage_layers=(LAYERS,), writers=((0,),)))
    st = Step([CaptureSpec(layers=LAYERS)], [4], [0], [8])
    st.learn(core)
    try:
        core.capture(st.view())
        assert st.lm_calls == 1
        reader = RingReader(w.path)
        assert reader.poll() == []  # and wrote nothing
        reader.close()
    finally:
        core.close()
        w.close(unlink=True)
