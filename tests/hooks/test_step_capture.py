"""The capture core (hooks/capture_core.py) at the ring level, with torch alone: one record per
captured tensor per step, shared by every request that captured it, read back per request exactly as
the model's tensors hold it; and the publishers that move the rows.

The end-to-end tests (offline engine, server, TP/PP) prove the values against vLLM and transformers;
these drive the core in-process with a runner-neutral StepView (real torch tensors, a real ring in
/dev/shm, the real reader) so they can build batches vLLM's scheduler makes only under load: prefill
chunks beside decodes, requests with different specs in one step, records too big to share, a
request computed one step past its end as async scheduling does. The same view is what
`vllm-tap bench hook` drives. No vLLM is imported by the core: one test checks that in a fresh
interpreter.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from vllm_tap.hooks.capture_core import CaptureCore, RankPlace, StepView
from vllm_tap.hooks.reductions import topk_rows
from vllm_tap.hooks.publisher import HostBackend, Publisher, StagedPublisher, StagingRing
from vllm_tap.hooks.settings import SPEC_EXTRA_ARG
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_format import RecordKind
from vllm_tap.ring_records import per_tensor
from vllm_tap.spec import CaptureSpec, DTypeMode, LogitsMode, PositionsMode

HIDDEN, VOCAB, LAYERS = 32, 50, (2, 5)


class Step:
    """A step of len(specs) requests: request i has `scheduled[i]` rows, `computed[i]` done before."""

    def __init__(self, specs, scheduled, computed, prompt, seed=0, ids_on_device=False):
        g = torch.Generator().manual_seed(seed)
        n_rows = sum(scheduled)
        self.weight = torch.randn(VOCAB, HIDDEN, generator=g)
        self.hidden = torch.randn(n_rows, HIDDEN, generator=g)
        self.qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
        self.req_ids = [f"r{i}" for i in range(len(specs))]
        self.specs = specs
        self.computed = np.array(computed, np.int32)
        self.prompt = np.array(prompt, np.int32)
        self.ids = torch.randint(0, VOCAB, (n_rows,), dtype=torch.int32, generator=g)
        self.aux = [torch.randn(n_rows, HIDDEN, generator=g) for _ in LAYERS]
        self.lm_calls = 0
        self.logits = self.compute_logits(self.hidden[self.qsl[1:] - 1])  # one row per request: its last row
        self.lm_calls = 0
        self.ids_on_device = ids_on_device

    def compute_logits(self, h):
        self.lm_calls += 1
        return h @ self.weight.T

    def extra(self, i):
        s = self.specs[i]
        return None if s is None else {SPEC_EXTRA_ARG: s.to_meta()}

    def learn(self, core, extra=None):
        """Admit the step's requests to the core, as a runner adapter does (extra: override of
        request i's extra_args)."""
        for i, rid in enumerate(self.req_ids):
            core.learn(rid, self.extra(i) if extra is None else extra(i), int(self.prompt[i]))
        return core

    def view(self, **kw) -> StepView:
        args = dict(req_ids=self.req_ids, query_start=self.qsl, computed=self.computed,
                    token_ids=self.ids if self.ids_on_device else self.ids.numpy(), hidden=self.hidden,
                    aux=self.aux, logits=self.logits, compute_logits=self.compute_logits)
        args.update(kw)
        return StepView(**args)

    def expected(self):
        """What each request should get this step, from the step's tensors: {rid: {tensor: {pos: row}}}."""
        all_logits = self.hidden @ self.weight.T
        out: dict[str, dict] = {}
        for i, (rid, spec) in enumerate(zip(self.req_ids, self.specs)):
            if spec is None:
                continue
            c, r0, r1 = int(self.computed[i]), int(self.qsl[i]), int(self.qsl[i + 1])
            a, b = spec.live_range(int(self.prompt[i]))
            got = collections.defaultdict(dict)
            for row in range(r0, r1):
                p = c + row - r0
                if not a <= p < b:
                    continue
                got["token"][p] = int(self.ids[row])
                lg = all_logits[row]
                if spec.logits == LogitsMode.FULL:
                    got["logits"][p] = lg.numpy()
                elif spec.logits == LogitsMode.TOPK:
                    got["topk_ids"][p] = torch.topk(lg, spec.topk).indices.numpy()
                    got["logsumexp"][p] = torch.logsumexp(lg, -1, keepdim=True).numpy()
                elif spec.logits == LogitsMode.INDICES:
                    got["chosen"][p] = lg[list(spec.indices)].numpy()
                    got["logsumexp"][p] = torch.logsumexp(lg, -1, keepdim=True).numpy()
                for layer in spec.layers:
                    got[f"hidden.{layer}"][p] = self.aux[LAYERS.index(layer)][row].numpy()
            out[rid] = got
        return out


def read(path):
    """Per request: {tensor: {pos: row}} plus token ids; the records' rank parts; DROP positions;
    how many DATA records the ring carried."""
    reader = RingReader(path)
    got = collections.defaultdict(lambda: collections.defaultdict(dict))
    parts, drops, data_records = {}, collections.defaultdict(set), 0
    for rec in per_tensor(reader.poll()):
        if rec.kind == RecordKind.DROP:
            drops[rec.request_id] |= set(rec.meta["positions"])
            continue
        assert rec.kind == RecordKind.DATA
        parts[rec.request_id] = rec.rank_parts
        assert list(rec.positions) == sorted(rec.positions), "a request's rows come out in position order"
        for j, p in enumerate(rec.positions.tolist()):
            assert p not in got[rec.request_id][rec.tensor.name], "each position once"
            got[rec.request_id][rec.tensor.name][p] = rec.data[j]
            got[rec.request_id]["token"][p] = int(rec.token_ids[j])
    data_records = reader.info().stats["records_written"]
    reader.close()
    return got, parts, dict(drops), data_records


def assert_matches(got, want):
    for rid, tensors in want.items():
        assert set(got[rid]) - {"topk_values"} == set(tensors), rid
        for name, rows in tensors.items():
            assert sorted(got[rid][name]) == sorted(rows), (rid, name)
            for p, row in rows.items():
                np.testing.assert_allclose(got[rid][name][p], row, rtol=0, atol=1e-5, err_msg=f"{rid} {name} {p}")


def make_core(writer, staged=False, place=RankPlace(stage_layers=(LAYERS,)), staging=1 << 20,
              model_dtype=torch.float32, **kw):
    pub = StagedPublisher(writer, HostBackend(), staging) if staged else Publisher(writer)
    return CaptureCore(writer, place, pub, model_dtype=model_dtype, **kw)


def finish(core):
    if isinstance(core.publisher, StagedPublisher):
        core.publisher.drain()


SPECS = [
    CaptureSpec(layers=LAYERS),  # prefill chunk: extra lm-head rows, then its sampled row
    None,  # not capturing, between capturing requests
    CaptureSpec(logits=LogitsMode.TOPK, topk=3),
    CaptureSpec(layers=(5,), positions=PositionsMode.OUTPUT),
    CaptureSpec(logits=LogitsMode.INDICES, indices=(1, 7, 49), layers=(2,), dtype=DTypeMode.FLOAT32),
    CaptureSpec(layers=LAYERS),  # a second prefill chunk, whose rows interleave with the first's in the logits record
    CaptureSpec(layers=LAYERS, positions=PositionsMode.PROMPT),  # its chunk runs past the prompt: rows cut short
]
SCHEDULED = [6, 1, 1, 1, 1, 4, 5]
COMPUTED = [0, 12, 20, 9, 30, 3, 8]
PROMPT = [10, 5, 8, 6, 12, 30, 10]


@pytest.mark.parametrize("staged", [False, True], ids=["cpu-publisher", "staged-publisher"])
@pytest.mark.parametrize("ids_on_device", [False, True], ids=["host-ids", "device-ids"])
@pytest.mark.parametrize("max_record_bytes", [None, 256], ids=["shared-records", "split-per-request"])
def test_a_mixed_step_is_read_back_per_request_exactly(ring, staged, ids_on_device, max_record_bytes):
    """Every request gets exactly its rows of the step's tensors whichever publisher moves them and
    wherever the token ids live (a tensor's are gathered like the payload)."""
    writer = ring()
    st = Step(SPECS, SCHEDULED, COMPUTED, PROMPT, ids_on_device=ids_on_device)
    core = st.learn(make_core(writer, staged=staged, max_record_bytes=max_record_bytes))
    try:
        core.capture(st.view())
        finish(core)
        got, parts, drops, n_records = read(writer.path)
    finally:
        core.close()
    want = st.expected()
    assert set(got) == set(want) == {"r0", "r2", "r3", "r4", "r5", "r6"}
    assert not drops
    assert_matches(got, want)
    # r2's top-k values are its logits at its top-k ids, largest first.
    (p2,) = want["r2"]["topk_ids"]
    full = st.compute_logits(st.hidden[st.qsl[3] - 1])
    np.testing.assert_allclose(got["r2"]["topk_values"][p2], full[torch.topk(full, 3).indices].numpy(), atol=1e-5)
    # ... and with the row's logsumexp they are its exact log-probabilities.
    logprobs = torch.log_softmax(full, -1)[torch.topk(full, 3).indices].numpy()
    np.testing.assert_allclose(got["r2"]["topk_values"][p2] - got["r2"]["logsumexp"][p2], logprobs, atol=1e-5)
    assert parts == {"r0": 3, "r2": 3, "r3": 2, "r4": 3, "r5": 3, "r6": 3}
    if max_record_bytes is None:
        # One record per set of requests asking for the same tensors, a section per tensor: hidden.2
        # and hidden.5 (their requests differ), full logits, top-k (ids, values and logsumexp) and
        # chosen (values and logsumexp).
        assert n_records == 5
    else:
        assert n_records > 5


DECODE_SPECS = [
    CaptureSpec(logits=LogitsMode.TOPK, topk=3, layers=()),
    None,
    CaptureSpec(layers=LAYERS),
    CaptureSpec(logits=LogitsMode.INDICES, indices=(1, 7, 49), layers=(2,), dtype=DTypeMode.FLOAT32),
    CaptureSpec(layers=(5,), positions=PositionsMode.OUTPUT),
]


@pytest.mark.parametrize("staged", [False, True], ids=["cpu-publisher", "staged-publisher"])
@pytest.mark.parametrize("ids_on_device", [False, True], ids=["host-ids", "device-ids"])
def test_decode_steps_of_an_unchanged_batch_reuse_one_plan_and_read_back_exactly(ring, staged, ids_on_device):
    """Decode steps of the same batch (the runner's request -> row map given, as V1's is) are planned
    once and the plan reused while the batch stays; a step that is not such a step (a prefill chunk,
    a request past its live range, a request gone or moved) is planned afresh. Each step's rows come
    back exactly, whichever way it was planned."""
    writer = ring()
    prompt = [5, 4, 6, 3, 7]
    st = Step(DECODE_SPECS, [1] * 5, [9, 8, 10, 7, 11], prompt, ids_on_device=ids_on_device)
    core = st.learn(make_core(writer, staged=staged))

    def run(step, **kw):
        core.capture(step.view(row_of={rid: i for i, rid in enumerate(step.req_ids)}, **kw))
        finish(core)
        got, _, drops, _ = read(writer.path)
        assert not drops
        want = step.expected()
        assert set(got) == {rid for rid, w in want.items() if w}
        assert_matches(got, want)
        return got

    try:
        layouts = []
        for k in range(3):  # the same batch, positions advancing: one plan
            step = Step(DECODE_SPECS, [1] * 5, [9 + k, 8 + k, 10 + k, 7 + k, 11 + k], prompt, seed=k,
                        ids_on_device=ids_on_device)
            run(step)
            layouts.append(core._decode)
        assert layouts[0] is not None and all(x is layouts[0] for x in layouts)
        # A prefill chunk in the batch: planned afresh, its extra lm-head rows included.
        step = Step(DECODE_SPECS, [1, 1, 3, 1, 1], [12, 11, 0, 10, 14], [5, 4, 6, 3, 7], seed=5,
                    ids_on_device=ids_on_device)
        got = run(step)
        assert sorted(got["r2"]["logits"]) == [0, 1, 2]
        # r4 captures output positions only: at its last prompt position it captures (its sampled
        # row), before it nothing; a request not live makes the step a general one.
        step = Step(DECODE_SPECS, [1] * 5, [13, 12, 13, 11, 2], prompt, seed=6, ids_on_device=ids_on_device)
        got = run(step)
        assert not got["r4"]
        # r1 gone, r3 moved to its row: a new plan.
        specs = [DECODE_SPECS[0], DECODE_SPECS[3], DECODE_SPECS[2], DECODE_SPECS[4]]
        step = Step(specs, [1] * 4, [14, 12, 14, 15], [5, 3, 6, 7], seed=7, ids_on_device=ids_on_device)
        step.req_ids = ["r0", "r3", "r2", "r4"]
        before = core._decode
        got = run(step, finished={"r1"})
        assert core._decode is not before and set(got) == {"r0", "r2", "r3", "r4"}
    finally:
        core.close()


@pytest.mark.parametrize("vocab", [50, 1000, 32000, 32011])
def test_top_k_through_group_maxima_is_torch_topk(vocab):
    """The CPU top-k (group maxima, then candidates) gives torch.topk's values, and its ids where the
    values are distinct; ties, -inf and a vocabulary that is not a multiple of the stripes included."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    x[1] = 0.0  # all tied
    x[2, : vocab // 2] = float("-inf")
    x[3, -5:] = 100.0 + torch.arange(5.0)  # the largest in the tail past the last whole stripe
    x[4] = torch.round(x[4] * 2) / 2  # many ties
    for k in (1, 5, 20):
        values, ids = topk_rows(x, k)
        want = torch.topk(x, k, dim=-1, sorted=True)
        assert torch.equal(values, want.values)
        assert torch.equal(torch.gather(x, 1, ids), values), "each id holds its value"
        assert all(len(set(r.tolist())) == k for r in ids), "ids are distinct"
        distinct = [0, 3, 5, 6, 7, 8]
        assert torch.equal(ids[distinct], want.indices[distinct])
        # Rows sliced out of a larger batch (a view with a storage offset), as a decode step's are.
        assert torch.equal(topk_rows(x[5:8], k)[1], want.indices[5:8])


def test_top_k_requests_with_different_k_share_one_pass_and_get_their_own_rows(ring):
    """Requests asking top-3, top-5 and chosen ids in one step (one gather, one top-k at k=5, one
    logsumexp): each gets exactly its own rows, and logit - logsumexp is log_softmax."""
    writer = ring()
    specs = [CaptureSpec(logits=LogitsMode.TOPK, topk=3, layers=()), None,
             CaptureSpec(logits=LogitsMode.TOPK, topk=5, layers=()),
             CaptureSpec(logits=LogitsMode.INDICES, indices=(4, 9), layers=()),
             CaptureSpec(logits=LogitsMode.TOPK, topk=3, layers=())]
    st = Step(specs, [3, 1, 1, 2, 1], [0, 7, 9, 1, 4], [3, 8, 6, 3, 3])
    core = st.learn(make_core(writer))
    try:
        core.capture(st.view())
        got, _, drops, _ = read(writer.path)
    finally:
        core.close()
    assert not drops
    want = st.expected()
    assert_matches(got, want)
    all_logits = st.hidden @ st.weight.T
    for i, rid in enumerate(st.req_ids):
        if specs[i] is None:
            continue
        for p, lse in got[rid]["logsumexp"].items():
            row = all_logits[int(st.qsl[i]) + p - int(st.computed[i])]
            logp = torch.log_softmax(row, -1)
            if specs[i].logits == LogitsMode.TOPK:
                ids = got[rid]["topk_ids"][p]
                assert len(ids) == specs[i].topk
                np.testing.assert_allclose(got[rid]["topk_values"][p] - lse, logp[ids].numpy(), atol=1e-5)
            else:
                np.testing.assert_allclose(got[rid]["chosen"][p] - lse, logp[[4, 9]].numpy(), atol=1e-5)


def test_the_core_imports_no_vllm():
    """The core runs with torch alone: capture a step in a fresh interpreter, then look."""
    code = (
        "import sys, torch, numpy as np\n"
        "from vllm_tap.hooks.capture_core import CaptureCore, RankPlace, StepView\n"
        "from vllm_tap.hooks.publisher import Publisher\n"
        "from vllm_tap.hooks.settings import SPEC_EXTRA_ARG\n"
        "from vllm_tap.ring_reader import RingReader\nfrom vllm_tap.ring_records import per_tensor\n"
        "from vllm_tap.ring_writer import RingWriter\n"
        "from vllm_tap.spec import CaptureSpec\n"
        "import tempfile, os, shutil\n"
        "d = tempfile.mkdtemp(dir='/dev/shm')\n"
        "w = RingWriter(os.path.join(d, 'i', 'rank-00000.ring'), 1 << 20, wake_daemon=False)\n"
        "core = CaptureCore(w, RankPlace(stage_layers=((1,),)), Publisher(w))\n"
        "core.learn('a', {SPEC_EXTRA_ARG: CaptureSpec(layers=(1,)).to_meta()}, 3)\n"
        "h = torch.randn(3, 8); W = torch.randn(11, 8)\n"
        "core.capture(StepView(['a'], np.array([0, 3]), np.array([0]), np.array([5, 6, 7], np.int32), h, [h * 2],"
        " h[2:] @ W.T, lambda x: x @ W.T))\n"
        "recs = per_tensor(RingReader(w.path).poll())\n"
        "assert sorted(r.tensor.name for r in recs) == ['hidden.1', 'logits'], recs\n"
        "w.close(unlink=True)\n"
        "shutil.rmtree(d)\n"
        "assert 'vllm' not in sys.modules, 'the core imported vllm'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_request_computed_past_its_end_is_written_at_its_true_position(ring):
    """Async scheduling: a request the scheduler finished at step N is already in step N+1, fed its
    last sampled token at position n_prompt + len(out) - 1 (END's end_position); its id exists only
    on the device. The worker writes that row at that position with that id (the daemon drops rows
    at or past end_position); the next step's finished ids make the worker forget it."""
    writer = ring()
    n_prompt, n_out = 6, 4
    end_position = n_prompt + n_out - 1
    specs = [CaptureSpec(layers=LAYERS), CaptureSpec(layers=LAYERS)]
    # Batch of two decodes: r0 finished last step (its row is one past its end), r1 still running.
    st = Step(specs, [1, 1], [end_position, 7], [n_prompt, 5], seed=3, ids_on_device=True)
    core = st.learn(make_core(writer))
    try:
        core.capture(st.view())
        got, _, _, _ = read(writer.path)
        assert sorted(got["r0"]["logits"]) == [end_position]
        assert got["r0"]["token"][end_position] == int(st.ids[0])
        np.testing.assert_allclose(got["r0"]["hidden.5"][end_position], st.aux[1][0].numpy(), atol=0)
        # N+2: the scheduler's finished ids reach the worker; r0 is forgotten, r1 goes on.
        st2 = Step([specs[1]], [1], [8], [5], seed=4, ids_on_device=True)
        st2.req_ids = ["r1"]
        core.capture(st2.view(finished={"r0"}))
        assert "r0" not in core.requests and core.requests["r1"] is not None
        got, _, _, _ = read(writer.path)
        assert set(got) == {"r1"} and sorted(got["r1"]["logits"]) == [8]
    finally:
        core.close()


def test_a_malformed_spec_means_no_capture_for_that_request_only(ring):
    writer = ring()
    st = Step([CaptureSpec(layers=LAYERS), CaptureSpec(layers=LAYERS)], [3, 1], [0, 4], [3, 3])
    bad = {0: {SPEC_EXTRA_ARG: "x"}, 1: {SPEC_EXTRA_ARG: {"logits": "nope"}}}
    for kind in bad.values():
        core = st.learn(make_core(writer), extra=lambda i, kind=kind: kind if i == 0 else st.extra(i))  # no exception
        core.capture(st.view())
        got, _, _, _ = read(writer.path)
        assert "r0" not in core.requests and set(got) == {"r1"}
        core.close()


def test_every_tp_rank_runs_the_extra_lm_head_pass_even_with_nothing_to_write(ring):
    """The extra lm-head pass for prompt rows is a collective (an all-gather of vocab shards): a
    rank that writes nothing for a request (top-k is rank 0's) must still run it, or the ranks hang."""
    writer = ring()
    spec = CaptureSpec(logits=LogitsMode.TOPK, topk=2, layers=())
    st = Step([spec], [4], [0], [8])
    counts = {}
    for tp_rank in (0, 1):
        core = st.learn(make_core(writer, place=RankPlace(tp_rank=tp_rank, tp_size=2, stage_layers=(LAYERS,))))
        st.lm_calls = 0
        core.capture(st.view())
        counts[tp_rank] = st.lm_calls
        core.close()
    assert counts == {0: 1, 1: 1}


def test_states_now_logits_later_is_the_same_as_all_at_once(ring):
    """The V2 order (states at the top of sample_tokens, logits from inside sample()) writes the same
    records as V1's all-at-once capture."""
    st = Step(SPECS, SCHEDULED, COMPUTED, PROMPT)
    results = []
    for split in (False, True):
        writer = ring()
        core = st.learn(make_core(writer))
        if split:
            step = core.begin(st.view(logits=None))
            step.write_states()
            step.write_logits(st.logits)
            core.end(step)
        else:
            core.capture(st.view())
        results.append(read(writer.path)[0])
        core.close()
        writer.close(unlink=True)
    assert_matches(results[1], st.expected())
    assert_matches(results[0], st.expected())


def test_logits_that_never_come_are_reported_as_dropped(ring):
    writer = ring()
    st = Step([CaptureSpec(layers=LAYERS)], [3], [0], [3])
    core = st.learn(make_core(writer))
    step = core.begin(st.view(logits=None))
    step.write_states()
    core.end(step)  # the runner never called sample()
    got, _, drops, _ = read(writer.path)
    assert sorted(got["r0"]["hidden.2"]) == [0, 1, 2] and "logits" not in got["r0"]
    assert drops == {"r0": {0, 1, 2}}
    core.close()


@pytest.mark.parametrize("staged", [False, True], ids=["cpu-publisher", "staged-publisher"])
def test_a_step_failing_half_way_publishes_nothing_and_the_ring_goes_on(ring, staged):
    """An exception in our code after some records were reserved: they become PAD records (the ring
    keeps publishing in order), the step's rows are reported lost, and the next step is whole."""
    writer = ring()
    st = Step(SPECS, SCHEDULED, COMPUTED, PROMPT)
    core = st.learn(make_core(writer, staged=staged))
    boom = st.view(aux=[st.aux[0], None])  # hidden.5 fails after hidden.2 was reserved
    with pytest.raises(Exception):
        core.capture(boom)
    finish(core)
    got, _, drops, _ = read(writer.path)
    assert not got
    assert drops["r0"] == set(range(6)) and drops["r6"] == {8, 9}
    core.capture(st.view())
    finish(core)
    got, _, drops, _ = read(writer.path)
    assert not drops
    assert_matches(got, st.expected())
    core.close()


def test_staging_ring_hands_out_in_order_and_never_wraps_a_block():
    s = StagingRing(1024, align=256)
    assert [s.alloc(100), s.alloc(256), s.alloc(300)] == [0, 256, 512]
    assert s.alloc(300) is None  # 256 left at the end, too small; the start is still busy
    s.free_to(512)  # the first two blocks' copy finished
    assert s.alloc(300) == 0  # the tail is skipped, the block starts at 0
    assert s.alloc(2000) is None  # never fits


def test_staged_publisher_commits_only_after_the_copy_and_drops_when_staging_is_full(ring):
    """The step returns before its copy has run; the records commit once the copy is done; while
    copies are pending, a step whose bytes do not fit in the staging left is dropped (and reported),
    never waited for."""
    writer = ring(4 << 20)
    specs = [CaptureSpec(layers=LAYERS)] * 4
    gate = threading.Event()

    class SlowBackend(HostBackend):
        def wait_all(self, dones):
            gate.wait(10)  # the "DMA" finishes when the test says so
            super().wait_all(dones)

    # 4 decode rows x (vocab 50 + 2 x 32 hidden) x 4 bytes = 1824 bytes; staging of 4096: two steps fit.
    core = CaptureCore(writer, RankPlace(stage_layers=(LAYERS,)), StagedPublisher(writer, SlowBackend(), 4096),
                       model_dtype=torch.float32)
    try:
        steps = [Step(specs, [1] * 4, [10 + k] * 4, [5] * 4, seed=k) for k in range(3)]
        for st in steps:
            st.computed = np.array([10 + steps.index(st)] * 4, np.int32)
            st.learn(core)
            core.capture(st.view())
        assert core.publisher.staging_drops == 1  # the third step's record (hidden 2 and 5, logits)
        gate.set()
        core.publisher.drain()
        got, _, drops, _ = read(writer.path)
        for rid in ("r0", "r1", "r2", "r3"):
            assert sorted(got[rid]["logits"]) == [10, 11], rid
            assert 12 in drops[rid], rid
        assert_matches({r: {k: {p: v for p, v in rows.items() if p == 10} for k, rows in t.items()}
                        for r, t in got.items()}, steps[0].expected())
    finally:
        gate.set()
        core.close()


def test_staged_copies_happen_after_the_step_returns(ring):
    """Nothing is committed until the publisher thread has done the copy: the daemon never sees a
    record whose bytes are still on their way."""
    writer = ring()
    gate = threading.Event()

    class SlowBackend(HostBackend):
        def wait_all(self, dones):
            gate.wait(10)
            super().wait_all(dones)

    core = CaptureCore(writer, RankPlace(stage_layers=(LAYERS,)), StagedPublisher(writer, SlowBackend(), 1 << 20),
                       model_dtype=torch.float32)
    try:
        st = Step([CaptureSpec(layers=LAYERS)], [3], [0], [3])
        st.learn(core).capture(st.view())
        reader = RingReader(writer.path)
        assert reader.poll() == []
        gate.set()
        core.publisher.drain()
        recs = per_tensor(reader.poll())
        assert sorted(r.tensor.name for r in recs) == ["hidden.2", "hidden.5", "logits"]
        reader.close()
    finally:
        gate.set()
        core.close()


@pytest.mark.parametrize("scenario", ["decode-8", "prefill-256"])
def test_gpu_check_script_runs_its_checks_on_the_cpu(tmp_path, scenario):
    """tools/gpu_check.py (for a machine with a GPU) runs the staged publisher and
    its bytewise check; here on the CPU with small sizes, so a broken script is found before then."""
    from vllm_tap.tools import gpu_check

    shm = f"/dev/shm/vllm-tap-test-{tmp_path.name}"
    sc = {s.name: s for s in gpu_check.SCENARIOS}[scenario]
    try:
        row = gpu_check.run_scenario(sc, 300, 64, torch.device("cpu"), shm, 8 << 20, 2,
                                     gpu_check._Forward(torch.device("cpu"), 64, n=1))
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
    rows = sc.batch * sc.rows_per_request
    assert row["mismatches"] == 0 and row["staging_drops"] == 0
    assert row["captured_bytes"] == rows * (300 + 2 * 64) * 2
