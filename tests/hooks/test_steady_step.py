"""The steady decode step (hooks/steady_step.py) at the ring level: while the batch stays and every
capturing request decodes one row, each step is one record laid out when the batch last changed,
and it reads back exactly as the model's tensors hold it, whatever the spec, the publisher, where
the token ids live, the rows the requests sit at, the tensors' padding, or the tensor-parallel rank.
A step that cannot be completed is reported, never published half written.

The steps are driven through the capture core with a runner-neutral StepView (real tensors, a real
ring in /dev/shm, the daemon's reader), as in test_step_capture.py, whose helpers these reuse.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from test_step_capture import LAYERS, Step, assert_matches, finish, make_core, read
from vllm_tap.hooks.capture_core import CaptureCore, RankPlace
from vllm_tap.hooks.publisher import HostBackend, Publisher, StagedPublisher
from vllm_tap.hooks.steady_step import SteadyStep
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_records import per_tensor
from vllm_tap.ring_writer import RingWriter
from vllm_tap.spec import CaptureSpec, DTypeMode, LogitsMode, PositionsMode

UNIFORM = {
    "full-logits+layers": CaptureSpec(layers=LAYERS),
    "top-k+layer": CaptureSpec(logits=LogitsMode.TOPK, topk=3, layers=(5,)),
    "top-k-as-float32": CaptureSpec(logits=LogitsMode.TOPK, topk=4, layers=(), dtype=DTypeMode.FLOAT32),
    "chosen-as-float32+layer": CaptureSpec(logits=LogitsMode.INDICES, indices=(1, 7, 49), layers=(2,),
                                           dtype=DTypeMode.FLOAT32),
    "layers-only": CaptureSpec(logits=LogitsMode.NONE, layers=LAYERS, positions=PositionsMode.OUTPUT),
}
# The batch: every request capturing (rows 0..n-1: whole tensors), or one that does not between them
# (a gather of rows 0, 2, 3); then, the batch unchanged, the non-capturing one runs a prefill chunk
# of 3 rows, which moves the capturing requests' token rows but not their batch rows.
BATCHES = {"all-capturing": [True] * 4, "one-not-capturing": [False, True, True, True]}


def _steps(spec, capturing, k, ids_on_device, chunk=1, dtype=torch.float32):
    specs = [spec if c else None for c in capturing]
    scheduled = [chunk if not c else 1 for c in capturing]
    st = Step(specs, scheduled, [9 + k] * len(specs), [5] * len(specs), seed=k, ids_on_device=ids_on_device)
    if dtype != torch.float32:
        st.weight, st.hidden = st.weight.to(dtype), st.hidden.to(dtype)
        st.aux = [a.to(dtype) for a in st.aux]
        st.logits = st.logits.to(dtype)
    return st


def _run(core, writer, st, **kw):
    """One step through the core; what it wrote, checked against the step's tensors; its DATA records."""
    before = RingReader(writer.path)
    written = before.info().stats["records_written"]
    before.close()
    core.capture(st.view(row_of={rid: i for i, rid in enumerate(st.req_ids)}, **kw))
    finish(core)
    got, _, drops, total = read(writer.path)
    assert not drops
    assert_matches(got, st.expected())
    return total - written


@pytest.mark.parametrize("what", list(UNIFORM))
@pytest.mark.parametrize("staged", [False, True], ids=["cpu-publisher", "staged-publisher"])
@pytest.mark.parametrize("ids_on_device", [False, True], ids=["host-ids", "device-ids"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_steady_decode_steps_are_one_record_each_and_read_back_exactly(ring, what, staged, ids_on_device, batch):
    writer = ring(4 << 20)
    spec, capturing = UNIFORM[what], BATCHES[batch]
    core = _steps(spec, capturing, 0, ids_on_device).learn(make_core(writer, staged=staged))
    try:
        laid_out = []
        for k in range(4):
            assert _run(core, writer, _steps(spec, capturing, k, ids_on_device)) == 1, "one record a step"
            laid_out.append(core._decode.steady)
        assert laid_out[0] is not None and all(r is laid_out[0] for r in laid_out), "laid out once"
        if not capturing[0]:
            # The non-capturing request's prefill chunk shares the step: same batch rows, other token rows.
            assert _run(core, writer, _steps(spec, capturing, 4, ids_on_device, chunk=3)) == 1
            assert core._decode.steady is laid_out[0]
    finally:
        core.close()


def _bf16(a: np.ndarray) -> np.ndarray:
    """Rows as the ring stores them (bfloat16 arrives as uint16) in float32."""
    if a.dtype == np.uint16:
        return torch.from_numpy(a.astype(np.int16)).view(torch.bfloat16).float().numpy()
    return a


@pytest.mark.parametrize("staged", [False, True], ids=["cpu-publisher", "staged-publisher"])
def test_padded_tensors_and_bfloat16_read_back_exactly(ring, staged):
    """Under CUDA graphs a runner's hidden states and ids have padding rows past the step's tokens;
    a bfloat16 model's rows are stored as they are (or as float32 when asked), bit for bit."""
    writer = ring(4 << 20)
    for spec in (CaptureSpec(layers=LAYERS), CaptureSpec(layers=LAYERS, dtype=DTypeMode.FLOAT32),
                 CaptureSpec(logits=LogitsMode.TOPK, topk=5, layers=(2,))):
        core = _steps(spec, [True] * 3, 0, True).learn(make_core(writer, staged=staged, model_dtype=torch.bfloat16))
        try:
            for k in range(3):
                st = _steps(spec, [True] * 3, k, True, dtype=torch.bfloat16)
                pad = [torch.cat([a, torch.full((5, a.shape[1]), 7.0, dtype=a.dtype)]) for a in st.aux]
                ids = torch.cat([st.ids, torch.full((5,), 3, dtype=st.ids.dtype)])
                core.capture(st.view(aux=pad, token_ids=ids, row_of={r: i for i, r in enumerate(st.req_ids)}))
                finish(core)
                got, _, drops, _ = read(writer.path)
                assert not drops
                for i, rid in enumerate(st.req_ids):
                    p = 9 + k
                    assert got[rid]["token"] == {p: int(st.ids[i])}
                    for layer in spec.layers:
                        np.testing.assert_array_equal(_bf16(got[rid][f"hidden.{layer}"][p]),
                                                      st.aux[LAYERS.index(layer)][i].float().numpy())
                    row = st.logits[i].float()
                    if spec.logits == LogitsMode.FULL:
                        np.testing.assert_array_equal(_bf16(got[rid]["logits"][p]), row.numpy())
                    if spec.logits == LogitsMode.TOPK:
                        values, top = _bf16(got[rid]["topk_values"][p]), got[rid]["topk_ids"][p]
                        np.testing.assert_array_equal(values, torch.topk(row, 5).values.numpy())
                        np.testing.assert_array_equal(values, row[torch.from_numpy(top).long()].numpy())
                        np.testing.assert_allclose(got[rid]["logsumexp"][p], [torch.logsumexp(row, -1)], rtol=1e-6)
            assert core._decode.steady is not None
        finally:
            core.close()


@pytest.mark.parametrize("logits", ["top-k", "full"])
def test_each_tensor_parallel_rank_writes_its_share_and_rank_0_the_top_k(shm, logits):
    """Under TP=2 both ranks write their half of the last dimension of the hidden states and of full
    logits; top-k (whole rows) is rank 0's alone: rank 1's steady record then holds the layer only."""
    spec = (CaptureSpec(logits=LogitsMode.TOPK, topk=3, layers=(2,)) if logits == "top-k"
            else CaptureSpec(layers=(2,)))
    got = {}
    for tp_rank in (0, 1):
        writer = RingWriter(f"{shm}/inst/rank-{tp_rank:05d}.ring", 1 << 20, wake_daemon=False)
        place = RankPlace(tp_rank=tp_rank, tp_size=2, stage_layers=(LAYERS,))
        core = CaptureCore(writer, place, StagedPublisher(writer, HostBackend(), 1 << 18), model_dtype=torch.float32)
        steps = [_steps(spec, [True] * 3, k, True) for k in range(3)]
        steps[0].learn(core)
        reader = RingReader(writer.path)
        try:
            for st in steps:
                core.capture(st.view(row_of={r: i for i, r in enumerate(st.req_ids)}))
                core.publisher.drain()
                recs = per_tensor(reader.poll())
                got[tp_rank] = sorted({(r.tensor.name, r.slice_start, r.slice_stop) for r in recs})
                for r in recs:
                    i = st.req_ids.index(r.request_id)
                    full = {"hidden.2": st.aux[0], "logits": st.logits}.get(r.tensor.name)
                    if full is not None:
                        np.testing.assert_array_equal(r.data[0], full[i, r.slice_start:r.slice_stop].numpy())
            assert core._decode.steady is not None
        finally:
            reader.close()
            core.close()
            writer.close(unlink=True)
    half, vhalf = 32 // 2, 50 // 2
    if logits == "top-k":
        assert got[0] == [("hidden.2", 0, half), ("logsumexp", 0, 1), ("topk_ids", 0, 3), ("topk_values", 0, 3)]
        assert got[1] == [("hidden.2", half, 32)]
    else:
        assert got[0] == [("hidden.2", 0, half), ("logits", 0, vhalf)]
        assert got[1] == [("hidden.2", half, 32), ("logits", vhalf, 50)]


def test_states_now_logits_later_once_the_logits_width_is_known(ring):
    """V2's order: the step is laid out before its logits exist. The first steps (a prefill, then a
    decode of a new batch) teach the core the logits' width; from then on the steady record takes
    the states at the top of the step and the logits when they appear."""
    writer = ring()
    spec = CaptureSpec(logits=LogitsMode.TOPK, topk=3, layers=LAYERS)
    core = make_core(writer, staged=True)
    prefill = Step([spec] * 2, [4, 3], [0, 0], [6, 6])
    prefill.learn(core)
    kinds = []
    try:
        for k, st in enumerate([prefill] + [_steps(spec, [True] * 2, k, True) for k in range(4)]):
            step = core.begin(st.view(logits=None, row_of={r: i for i, r in enumerate(st.req_ids)}))
            kinds.append(type(step).__name__)
            step.write_states()
            step.write_logits(st.logits)
            core.end(step)
            finish(core)
            got, _, drops, _ = read(writer.path)
            assert not drops
            assert_matches(got, st.expected())
    finally:
        core.close()
    assert kinds[0] == "CaptureStep" and kinds[-3:] == ["SteadyStep"] * 3, kinds


def test_a_steady_step_whose_logits_never_come_is_reported_whole(ring):
    """A record cannot go out with its logits section unwritten: the step's states are given up with
    it, and every position is reported dropped (the general path writes the states and reports the
    logits; both say what is missing)."""
    writer = ring()
    spec = CaptureSpec(layers=LAYERS)
    core = _steps(spec, [True] * 2, 0, False).learn(make_core(writer, staged=True))
    try:
        _run(core, writer, _steps(spec, [True] * 2, 0, False))
        st = _steps(spec, [True] * 2, 1, False)
        step = core.begin(st.view(logits=None, row_of={r: i for i, r in enumerate(st.req_ids)}))
        assert isinstance(step, SteadyStep)
        step.write_states()
        core.end(step)  # the runner never called sample()
        finish(core)
        got, _, drops, _ = read(writer.path)
        assert not got and drops == {"r0": {10}, "r1": {10}}
        _run(core, writer, _steps(spec, [True] * 2, 2, False))  # the next step is whole
    finally:
        core.close()


def test_logits_of_another_width_give_the_step_up_and_the_batch_takes_the_general_way(ring):
    writer = ring()
    spec = CaptureSpec(layers=(2,))
    core = _steps(spec, [True] * 2, 0, False).learn(make_core(writer, staged=True))
    try:
        _run(core, writer, _steps(spec, [True] * 2, 0, False))
        st = _steps(spec, [True] * 2, 1, False)
        step = core.begin(st.view(logits=None, row_of={r: i for i, r in enumerate(st.req_ids)}))
        step.write_states()
        step.write_logits(torch.cat([st.logits, st.logits], 1))  # twice the vocabulary laid out
        core.end(step)
        finish(core)
        got, _, drops, _ = read(writer.path)
        assert not got and drops == {"r0": {10}, "r1": {10}}
        assert core._decode.steady is None
        _run(core, writer, _steps(spec, [True] * 2, 2, False))
    finally:
        core.close()


def test_a_steady_record_that_finds_no_free_staging_block_is_dropped_and_reported(ring):
    """The copies of earlier steps still pending (a slow "DMA"), the blocks run out: the step's record
    is dropped and every one of its positions reported, never waited for; once the copies are done
    the blocks come back."""
    writer = ring(4 << 20)
    spec = CaptureSpec(layers=LAYERS)
    gate = threading.Event()

    class SlowBackend(HostBackend):
        def wait_all(self, dones):
            gate.wait(10)
            super().wait_all(dones)

    # 3 rows x (vocab 50 + 2 x hidden 32) x 4 bytes = 1368 bytes a record: blocks of 1536 bytes, 2 in 4 KiB.
    core = CaptureCore(writer, RankPlace(stage_layers=(LAYERS,)), StagedPublisher(writer, SlowBackend(), 4096),
                       model_dtype=torch.float32)
    steps = [_steps(spec, [True] * 3, k, False) for k in range(4)]
    steps[0].learn(core)
    try:
        for st in steps[:3]:
            core.capture(st.view(row_of={r: i for i, r in enumerate(st.req_ids)}))
        assert core._decode.steady.fixed.count == 2
        assert core.publisher.staging_drops == 1
        gate.set()
        core.publisher.drain()
        got, _, drops, _ = read(writer.path)
        assert drops == {rid: {11} for rid in ("r0", "r1", "r2")}
        for rid in ("r0", "r1", "r2"):
            assert sorted(got[rid]["logits"]) == sorted(got[rid]["hidden.5"]) == [9, 10]
        _run(core, writer, steps[3])
    finally:
        gate.set()
        core.close()


def test_mixed_specs_and_a_changing_batch_take_the_general_way_and_come_back(ring):
    """Requests asking different tensors need several records: no steady record. A batch that
    changes is laid out afresh, and a uniform one steadies again."""
    writer = ring()
    a, b = CaptureSpec(layers=LAYERS), CaptureSpec(logits=LogitsMode.TOPK, topk=2, layers=())
    core = make_core(writer, staged=True)
    st = Step([a, b, a], [1] * 3, [9] * 3, [5] * 3)
    st.learn(core)
    try:
        assert _run(core, writer, st) == 3  # a's states, a's logits, b's top-k
        assert core._decode is not None and core._decode.steady is None
        core.forget("r1")
        for k in range(2):
            st = Step([a, a], [1, 1], [10 + k] * 2, [5] * 2, seed=k)
            st.req_ids = ["r0", "r2"]
            assert _run(core, writer, st) == 1
        assert core._decode.steady is not None
    finally:
        core.close()


# -- through the runner adapters (the stand-in V1 and V2 runners of test_runner_adapters.py) --------

ADAPTER_SEQ = {"e": [3, 5, 7, 11, 13, 17, 19, 23, 29], "f": [2, 4, 6, 8, 10, 12, 14, 16], "g": [1, 9, 2, 8, 3, 7, 4]}
ADAPTER_PROMPT = {"e": 4, "f": 3, "g": 2}
ADAPTER_STEPS = [dict(new=[("e", 0), ("f", 0), ("g", 0)], sched={"e": 4, "f": 3, "g": 2})] + [
    dict(sched={"e": 1, "f": 1, "g": 1}, grammar=k == 2) for k in range(4)]


@pytest.mark.parametrize("spec", [CaptureSpec(layers=(0, 2)), CaptureSpec(logits=LogitsMode.TOPK, topk=3, layers=(2,))],
                         ids=["full-logits+layers", "top-k+layer"])
@pytest.mark.parametrize("staged", [False, True], ids=["cpu-publisher", "staged-publisher"])
@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_the_adapters_decode_steps_go_the_steady_way_and_capture_the_raw_rows(shm, monkeypatch, kind, staged, spec):
    """A prefill, then decode steps of the same three requests (one with the grammar mask, which
    modifies the logits in place after they are taken): V1 (all at once) and V2 (states, then the
    logits inside sample()) write the decode steps as steady records, and every row is the model's."""
    import test_runner_adapters as ra
    from types import SimpleNamespace

    from vllm_tap.hooks import runner_v1, runner_v2

    monkeypatch.setattr(ra, "SEQ", ADAPTER_SEQ)
    monkeypatch.setattr(ra, "PROMPT", ADAPTER_PROMPT)
    monkeypatch.setattr(ra, "STEPS", ADAPTER_STEPS)
    monkeypatch.setattr(ra, "SPECS", {rid: spec for rid in ADAPTER_SEQ})
    cls = type("R", (ra.V1Runner if kind == "v1" else ra.V2Runner,), {})
    (runner_v1.patch_gpu_module if kind == "v1" else runner_v2.patch_v2_module)(SimpleNamespace(GPUModelRunner=cls))
    model = ra.TinyModel()
    runner = cls(model)
    writer = RingWriter(f"{shm}/{kind}/rank-00000.ring", 1 << 20, wake_daemon=False)
    pub = StagedPublisher(writer, HostBackend(), 1 << 18) if staged else Publisher(writer)
    core = CaptureCore(writer, RankPlace(stage_layers=(ra.LAYERS,)), pub, model_dtype=torch.float32)
    model.set_aux_hidden_state_layers(ra.LAYERS)
    runner.use_aux_hidden_state_outputs = True
    runner._vllm_tap_loaded, runner._vllm_tap = True, core
    try:
        for so in ra.scheduler_outputs():
            runner.execute_model(so)
            runner.sample_tokens(object() if so.grammar else None)
        finish(core)
        assert core.steady_steps >= 3, core.steady_steps
        reader = RingReader(writer.path)
        seen = {}
        for rec in per_tensor(reader.poll()):
            for j, p in enumerate(rec.positions.tolist()):
                rid, name = rec.request_id, rec.tensor.name
                assert (rid, name, p) not in seen
                seen[(rid, name, p)] = True
                assert int(rec.token_ids[j]) == ADAPTER_SEQ[rid][p]
                logits, aux = ra.expected_rows(model, rid, p)
                if name == "logits":
                    np.testing.assert_allclose(rec.data[j], logits.numpy(), atol=1e-5)
                elif name == "topk_ids":
                    np.testing.assert_array_equal(rec.data[j], torch.topk(logits, 3).indices.numpy())
                elif name.startswith("hidden."):
                    np.testing.assert_allclose(rec.data[j], aux[int(name.split(".")[1])].numpy(), atol=1e-5)
        reader.close()
        # every position of every request, each tensor once
        for rid, seq in ADAPTER_SEQ.items():
            computed = ADAPTER_PROMPT[rid] + 4
            assert {p for (r, n, p) in seen if r == rid and n == "hidden.2"} == set(range(computed))
    finally:
        core.close()
        writer.close(unlink=True)
