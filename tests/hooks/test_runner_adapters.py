"""The V1 and V2 runner adapters (hooks/runner_v1.py, hooks/runner_v2.py) patched onto stand-in runner
classes that hold the same fields and call the same methods in the same order as vLLM 0.33's, driven
through one scheduler script; both must write the same rows as the model computed them.

No GPU and no triton-cpu here, so vLLM's V2 runner cannot run on this machine: these stand-ins are
what exercises the V2 adapter. What each mirrors (vLLM 0.33.0, paths under vllm/):

V2, v1/worker/gpu/model_runner.py:
- `_remove_request(req_id)` (:1170) frees the request's slot in `req_states` (states.py:
  `req_id_to_index`, `prompt_len.np`, `num_computed_tokens_np`);
- `finish_requests` (:1188) removes finished and preempted ids, sorted;
- `add_requests` (:1215) re-adds each of `scheduled_new_reqs` (new and, under V2, resumed requests:
  v1/core/sched/scheduler.py:1642-1653) after removing it, storing prompt_len and num_computed_tokens;
- `update_requests` (:1270) sets num_computed_tokens_np from `scheduled_cached_reqs`;
- `execute_model` (:1764) runs those four, orders the batch decode-first (`sort_batch_req_ids`,
  :2507), builds an `InputBatch` (input_batch.py: req_ids, num_reqs, query_start_loc_np,
  num_computed_tokens_np, input_ids, logits_indices, num_tokens) and stores `ExecuteModelState`
  (:2475: input_batch, hidden_states, aux_hidden_states, finished_req_ids), with no logits;
- `sample_tokens` (:2149) reads and clears execute_model_state, calls `sample()` (:1633), which calls
  `self.model.compute_logits(hidden[logits_indices])` (:1656) and then applies the grammar bitmask to
  that tensor in place (:1661-1668); then the prompt-logprobs worker calls compute_logits again
  (:2214), which the tap must not take for the step's logits.
V1, v1/worker/gpu_model_runner.py: `_update_states(scheduler_output)` at the top of execute_model
(admits `scheduled_new_reqs` into `requests`, drops `finished_req_ids`); a persistent batch in
admission order (`input_batch.req_ids`, `req_id_to_index`, `num_computed_tokens_cpu`, `num_prompt_tokens`), `query_start_loc.np`, `input_ids.gpu`,
`requests[rid].sampling_params`, and `ExecuteModelState` (:459-472) carrying scheduler_output and the
logits computed in execute_model; sample_tokens applies the grammar mask to those logits in place.

The model is a tiny torch module whose hidden state at a row depends only on (token, position), so
the expected value of every captured row is known exactly; its aux outputs follow EAGLE-3's
`set_aux_hidden_state_layers` (layer 0 = embeddings, i = after layer i).
"""

from __future__ import annotations

import collections
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_tap.hooks import runner_v1, runner_v2
from vllm_tap.hooks.capture_core import CaptureCore, RankPlace
from vllm_tap.hooks.publisher import Publisher
from vllm_tap.hooks.settings import SPEC_EXTRA_ARG
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_writer import RingWriter
from vllm_tap.ring_format import RecordKind
from vllm_tap.ring_records import per_tensor
from vllm_tap.spec import CaptureSpec, LogitsMode, PositionsMode

VOCAB, HIDDEN, N_LAYERS, LAYERS = 40, 32, 3, (0, 2)


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.randn(VOCAB, HIDDEN, generator=g)
        self.pos = torch.randn(64, HIDDEN, generator=g)
        self.ws = [torch.randn(HIDDEN, HIDDEN, generator=g) * 0.3 for _ in range(N_LAYERS)]
        self.head = torch.randn(VOCAB, HIDDEN, generator=g)
        self.aux_layers: tuple[int, ...] = ()
        self.lm_calls = 0

    def set_aux_hidden_state_layers(self, layers):
        self.aux_layers = tuple(layers)

    def forward(self, ids, positions):
        h = self.emb[ids] + self.pos[positions]
        aux = [h] if 0 in self.aux_layers else []
        for i, w in enumerate(self.ws):
            h = torch.tanh(h @ w)
            if i + 1 in self.aux_layers:
                aux.append(h)
        return h, aux

    def compute_logits(self, h):
        self.lm_calls += 1
        return h @ self.head.T


# -- the scheduler script both runners see --------------------------------------------------------

SEQ = {  # every request's tokens: prompt, then outputs
    "a": [3, 5, 7, 11, 13, 17, 19, 23, 29],  # prompt 6 (two chunks), then decodes
    "b": [2, 4, 6, 8, 10, 12, 14],  # prompt 3; preempted after step 3, resumed by recompute
    "c": [1, 1, 2, 3, 5, 8],  # prompt 2; never captures
    "d": [9, 8, 7, 6, 5, 4],  # prompt 3, top-k of output positions; finished at step 3, computed once more
}
PROMPT = {"a": 6, "b": 3, "c": 2, "d": 3}
SPECS = {"a": CaptureSpec(layers=LAYERS), "b": CaptureSpec(layers=(2,)), "c": None,
         "d": CaptureSpec(logits=LogitsMode.TOPK, topk=3, layers=(), positions=PositionsMode.OUTPUT)}
# Per step: new requests (rid, num_computed), scheduled tokens per request, finished, preempted.
STEPS = [
    dict(new=[("a", 0), ("b", 0), ("c", 0), ("d", 0)], sched={"a": 4, "b": 3, "c": 2, "d": 3}),
    dict(sched={"a": 2, "b": 1, "c": 1, "d": 1}),
    # d finished here (its END says end_position 5); async scheduling still computes it in step 4
    dict(sched={"a": 1, "b": 1, "c": 1, "d": 1}, grammar=True),
    dict(sched={"a": 1, "c": 1, "d": 1}, preempted={"b"}),
    dict(new=[("b", 0)], sched={"a": 1, "b": 6}, finished={"d"}),  # b resumed: recomputes 0..5
]


def _sampling(rid):
    spec = SPECS[rid]
    return SimpleNamespace(extra_args=None if spec is None else {SPEC_EXTRA_ARG: spec.to_meta()}, max_tokens=8)


def scheduler_outputs():
    computed: dict[str, int] = {}
    for st in STEPS:
        new = []
        for rid, c in st.get("new", []):
            computed[rid] = c
            new.append(SimpleNamespace(req_id=rid, prompt_token_ids=SEQ[rid][: PROMPT[rid]], prompt_len=PROMPT[rid],
                                       prefill_token_ids=SEQ[rid][: max(PROMPT[rid], c)],
                                       sampling_params=_sampling(rid), num_computed_tokens=c))
        new_ids = {n.req_id for n in new}
        cached = [r for r in st["sched"] if r not in new_ids]
        yield SimpleNamespace(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=SimpleNamespace(req_ids=cached, num_computed_tokens=[computed[r] for r in cached]),
            num_scheduled_tokens=dict(st["sched"]), total_num_scheduled_tokens=sum(st["sched"].values()),
            finished_req_ids=set(st.get("finished", ())), preempted_req_ids=set(st.get("preempted", ())),
            grammar=st.get("grammar", False), computed_before=dict(computed),
        )
        for rid, n in st["sched"].items():
            computed[rid] += n


def grammar_mask(logits):
    """What the grammar bitmask does: in place, on the tensor the runner computed."""
    logits[:, ::2] = float("-inf")


# -- V2 stand-in (see the module docstring for the 0.33 lines) ------------------------------------

class V2Runner:
    batch_ids = list  # how the batch's request ids are held (a counting list in one test)

    def __init__(self, model):
        self.model = model
        self.device = torch.device("cpu")
        self.execute_model_state = None
        self.req_states = SimpleNamespace(req_id_to_index={}, prompt_len=SimpleNamespace(np=np.zeros(8, np.int32)),
                                          num_computed_tokens_np=np.zeros(8, np.int32), free=list(range(8)),
                                          tokens={})
        self.use_aux_hidden_state_outputs = False
        self.prompt_logprob_calls = 0

    def get_model(self):
        return self.model

    def load_model(self):
        pass

    def _remove_request(self, req_id):
        idx = self.req_states.req_id_to_index.pop(req_id, None)
        if idx is None:
            return False
        self.req_states.free.append(idx)
        return True

    def finish_requests(self, so):
        for rid in sorted(so.finished_req_ids | so.preempted_req_ids):
            self._remove_request(rid)

    def add_requests(self, so):
        rs = self.req_states
        for new in so.scheduled_new_reqs:
            self._remove_request(new.req_id)
            idx = rs.free.pop()
            rs.req_id_to_index[new.req_id] = idx
            rs.prompt_len.np[idx] = new.prompt_len
            rs.num_computed_tokens_np[idx] = new.num_computed_tokens

    def update_requests(self, so):
        rs = self.req_states
        for rid, c in zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens):
            rs.num_computed_tokens_np[rs.req_id_to_index[rid]] = c

    def execute_model(self, so, intermediate_tensors=None, dummy_run=False):
        self.finish_requests(so)
        self.add_requests(so)
        self.update_requests(so)
        sched = so.num_scheduled_tokens
        req_ids = sorted(sched, key=lambda r: (sched[r] != 1, sched[r]))  # decode first, as sort_batch_req_ids
        idx = np.array([self.req_states.req_id_to_index[r] for r in req_ids])
        n_sched = np.array([sched[r] for r in req_ids], np.int32)
        qsl = np.zeros(len(req_ids) + 3, np.int32)  # padded, as query_start_loc_np is for FULL graphs
        np.cumsum(n_sched, out=qsl[1 : len(req_ids) + 1])
        qsl[len(req_ids) + 1 :] = qsl[len(req_ids)]
        computed = self.req_states.num_computed_tokens_np[idx]
        positions = np.concatenate([np.arange(c, c + n) for c, n in zip(computed, n_sched)])
        rows = np.concatenate([np.repeat(k, n) for k, n in enumerate(n_sched)])
        ids = torch.tensor([SEQ[req_ids[k]][p] for k, p in zip(rows, positions)], dtype=torch.int32)
        num_tokens = len(positions)
        pad = 2  # CUDA-graph padding rows after the real ones
        ids_buf = torch.cat([ids, torch.zeros(pad, dtype=torch.int32)])
        hidden, aux = self.model(ids_buf.long(), torch.from_numpy(np.concatenate([positions, [0] * pad])))
        ib = SimpleNamespace(req_ids=self.batch_ids(req_ids), num_reqs=len(req_ids), query_start_loc_np=qsl,
                             idx_mapping_np=idx,
                             num_computed_tokens_np=computed, input_ids=ids_buf, num_tokens=num_tokens,
                             logits_indices=torch.from_numpy(qsl[1 : len(req_ids) + 1] - 1).long())
        self.execute_model_state = SimpleNamespace(
            input_batch=ib, hidden_states=hidden, aux_hidden_states=aux if self.use_aux_hidden_state_outputs else None,
            finished_req_ids=so.finished_req_ids)
        self._grammar = so.grammar
        return None

    def sample(self, hidden_states, input_batch, grammar_output):
        logits = self.model.compute_logits(hidden_states[input_batch.logits_indices])
        if grammar_output is not None:
            grammar_mask(logits)
        return logits.argmax(-1), None, None

    def sample_tokens(self, grammar_output):
        state = self.execute_model_state
        self.execute_model_state = None
        out = self.sample(state.hidden_states, state.input_batch, grammar_output)
        # The prompt-logprobs worker gets compute_logits too (:2214): not the tap's step logits.
        self.model.compute_logits(state.hidden_states[:1])
        return out


# -- V1 stand-in ----------------------------------------------------------------------------------

class V1Runner:
    batch_ids = list
    batch_index = dict

    def __init__(self, model):
        self.model = model
        self.device = "cpu"
        self.execute_model_state = None
        self.requests: dict = {}
        self.order: list[str] = []  # the persistent batch, in admission order
        self.prompt: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.use_aux_hidden_state_outputs = False

    def get_model(self):
        return self.model

    def load_model(self):
        pass

    def _update_states(self, so):
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in so.finished_req_ids | so.preempted_req_ids:
            if rid in self.order:
                self.order.remove(rid)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = SimpleNamespace(sampling_params=new.sampling_params,
                                                        num_prompt_tokens=new.prompt_len)
            self.prompt[new.req_id] = new.prompt_len
            self.computed[new.req_id] = new.num_computed_tokens
            if new.req_id not in self.order:
                self.order.append(new.req_id)
        for rid, c in zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens):
            self.computed[rid] = c

    def execute_model(self, so, intermediate_tensors=None):
        self._update_states(so)
        req_ids = [r for r in self.order if r in so.num_scheduled_tokens]
        n_sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], np.int32)
        qsl = np.zeros(len(req_ids) + 1, np.int32)
        np.cumsum(n_sched, out=qsl[1:])
        computed = np.array([self.computed[r] for r in req_ids], np.int32)
        positions = np.concatenate([np.arange(c, c + n) for c, n in zip(computed, n_sched)])
        rows = np.concatenate([np.repeat(k, n) for k, n in enumerate(n_sched)])
        ids = torch.tensor([SEQ[req_ids[k]][p] for k, p in zip(rows, positions)], dtype=torch.int32)
        self.input_batch = SimpleNamespace(req_ids=self.batch_ids(req_ids), num_computed_tokens_cpu=computed,
                                           req_id_to_index=self.batch_index((r, i) for i, r in enumerate(req_ids)),
                                           num_prompt_tokens=np.array([self.prompt[r] for r in req_ids], np.int32))
        self.query_start_loc = SimpleNamespace(np=qsl)
        self.input_ids = SimpleNamespace(gpu=ids)
        hidden, aux = self.model(ids.long(), torch.from_numpy(positions))
        logits = self.model.compute_logits(hidden[torch.from_numpy(qsl[1:] - 1).long()])
        self.execute_model_state = SimpleNamespace(scheduler_output=so, logits=logits, hidden_states=hidden,
                                                   aux_hidden_states=aux if self.use_aux_hidden_state_outputs else None)
        self._grammar = so.grammar
        return None

    def sample_tokens(self, grammar_output):
        state = self.execute_model_state
        self.execute_model_state = None
        if grammar_output is not None:
            grammar_mask(state.logits)
        return state.logits.argmax(-1)


# -- driving both ---------------------------------------------------------------------------------

class Counting:
    """What the tap touches per request while `on`: batch request ids read one by one, and
    lookups by request id (the batch index, V2's slots, V1's requests with their sampling params)."""

    def __init__(self):
        self.on = False
        self.seen: collections.Counter = collections.Counter()
        counter = self

        class Ids(list):
            def __getitem__(self, k):
                if isinstance(k, slice):
                    return Ids(super().__getitem__(k))  # a copy of the batch's ids is still them
                if counter.on:
                    counter.seen["batch ids read"] += 1
                return super().__getitem__(k)

            def __iter__(self):
                if counter.on:
                    counter.seen["batch ids walked"] += 1
                return super().__iter__()

        class ById(dict):
            def get(self, k, default=None):
                if counter.on:
                    counter.seen[k] += 1
                return super().get(k, default)

            def __getitem__(self, k):
                if counter.on:
                    counter.seen[k] += 1
                return super().__getitem__(k)

            def __contains__(self, k):
                if counter.on:
                    counter.seen[k] += 1
                return super().__contains__(k)

        self.Ids, self.ById = Ids, ById


def run(kind, shm, counting: Counting | None = None):
    cls = V1Runner if kind == "v1" else V2Runner
    extra = {} if counting is None else {"batch_ids": counting.Ids, "batch_index": counting.ById}
    cls = type(cls.__name__, (cls,), extra)  # a fresh class to patch
    if kind == "v1":
        runner_v1.patch_gpu_module(SimpleNamespace(GPUModelRunner=cls))
    else:
        runner_v2.patch_v2_module(SimpleNamespace(GPUModelRunner=cls))
    model = TinyModel()
    runner = cls(model)
    if counting is not None:
        runner.requests = counting.ById()
        if kind == "v2":
            runner.req_states.req_id_to_index = counting.ById()
    writer = RingWriter(f"{shm}/{kind}/rank-00000.ring", 1 << 20, wake_daemon=False)
    core = CaptureCore(writer, RankPlace(stage_layers=(LAYERS,)), Publisher(writer), model_dtype=torch.float32)
    # What runner_patch.setup does after load_model, without a vLLM config.
    model.set_aux_hidden_state_layers(LAYERS)
    runner.use_aux_hidden_state_outputs = True
    runner._vllm_tap_loaded, runner._vllm_tap = True, core
    for so in scheduler_outputs():
        runner.execute_model(so)
        if counting is not None:
            counting.on = True  # the step's hook: sample_tokens (V1 and V2) and sample (V2)
        try:
            runner.sample_tokens(object() if so.grammar else None)
        finally:
            if counting is not None:
                counting.on = False
    reader = RingReader(writer.path)
    got = collections.defaultdict(list)
    for rec in per_tensor(reader.poll()):
        assert rec.kind == RecordKind.DATA
        for j, p in enumerate(rec.positions.tolist()):
            got[(rec.request_id, rec.tensor.name)].append((p, int(rec.token_ids[j]), rec.data[j].copy()))
    reader.close()
    writer.close(unlink=True)
    core.close()
    return got, model


def expected_rows(model, rid, pos):
    tok = SEQ[rid][pos]
    h, aux = model(torch.tensor([tok]), torch.tensor([pos]))
    return model.compute_logits(h)[0], {layer: aux[LAYERS.index(layer)][0] for layer in LAYERS}


def test_v2_adapter_writes_what_v1_writes_for_the_same_rows(shm):
    v1, model = run("v1", shm)
    v2, _ = run("v2", shm)
    assert set(v1) == set(v2)
    for key in v1:
        a = sorted(v1[key], key=lambda x: (x[0], x[1]))
        b = sorted(v2[key], key=lambda x: (x[0], x[1]))
        assert [x[:2] for x in a] == [x[:2] for x in b], key
        for (p, _, ra), (_, _, rb) in zip(a, b):
            np.testing.assert_allclose(ra, rb, rtol=0, atol=1e-5, err_msg=f"{key} {p}")


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_each_adapter_captures_the_raw_rows_the_model_computed(shm, kind):
    got, model = run(kind, shm)
    # a: every position it computed (0..5 prompt in two chunks, then 6, 7, 8), once each.
    assert [p for p, _, _ in sorted(got[("a", "logits")], key=lambda x: x[0])] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    for rid, name in got:
        for p, tok, row in got[(rid, name)]:
            assert tok == SEQ[rid][p], (rid, name, p)
            logits, aux = expected_rows(model, rid, p)
            if name == "logits":
                # Raw: the grammar mask of step 3 (in place, after compute_logits) is not in it.
                assert np.isfinite(row).all()
                np.testing.assert_allclose(row, logits.numpy(), atol=1e-5, err_msg=f"{rid} {p}")
            elif name == "topk_ids":
                np.testing.assert_array_equal(row, torch.topk(logits, 3).indices.numpy())
            elif name.startswith("hidden."):
                np.testing.assert_allclose(row, aux[int(name.split(".")[1])].numpy(), atol=1e-5)
    # b was preempted after step 3 and recomputed from 0: its positions come twice (the daemon keeps one).
    b_pos = sorted(p for p, _, _ in got[("b", "hidden.2")])
    assert b_pos == sorted([0, 1, 2, 3, 4] + [0, 1, 2, 3, 4, 5])
    assert not any(r == "c" for r, _ in got)  # c never opted in
    # d: output positions from P-1 = 2; step 4 computed it once past its end (position 5, END's
    # end_position): written at that position, with the token fed there.
    assert sorted(p for p, _, _ in got[("d", "topk_ids")]) == [2, 3, 4, 5]


@pytest.mark.parametrize("nobody", [False, True], ids=["some-capture", "nobody-captures"])
@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_requests_that_do_not_capture_cost_the_step_hook_nothing(shm, kind, nobody, monkeypatch):
    """A step's hook does Python work only for the requests that capture. It never walks the
    batch's request ids, looks up the batch row of capturing requests only (c never), and reads no
    spec (those are read once, when the runner admits a request). With nobody capturing it touches
    no request at all. Counted, not timed: a per-request loop would show as reads of c."""
    if nobody:
        monkeypatch.setitem(SPECS, "a", None)
        monkeypatch.setitem(SPECS, "b", None)
        monkeypatch.setitem(SPECS, "d", None)
    parsed = collections.Counter()
    orig = CaptureCore._request

    def counted(self, rid, *a):
        parsed[rid] += 1
        return orig(self, rid, *a)

    monkeypatch.setattr(CaptureCore, "_request", counted)
    counting = Counting()
    got, _ = run(kind, shm, counting)
    seen = counting.seen
    assert seen["batch ids walked"] == 0 and seen["batch ids read"] == 0
    assert seen["c"] == 0, "a request that does not capture was looked up in a step"
    if nobody:
        assert not got and sum(seen.values()) == 0
        return
    assert set(seen) <= {"a", "b", "d"}
    # At most one lookup per capturing request per step it is known in (5 steps; b is admitted twice).
    assert seen["a"] <= len(STEPS) and seen["d"] <= len(STEPS) and seen["b"] <= len(STEPS)
    # Specs are parsed at admission only: a, b, d once each, b again when it is resumed (V2 re-adds it).
    assert parsed["c"] == 0 and parsed["a"] == 1 and parsed["d"] == 1 and parsed["b"] <= 2
    assert got  # and it still captured


def test_v2_learns_at_add_requests_and_forgets_at_remove(shm):
    cls = type("V2", (V2Runner,), {})
    runner_v2.patch_v2_module(SimpleNamespace(GPUModelRunner=cls))
    runner = cls(TinyModel())
    writer = RingWriter(f"{shm}/learn/rank-00000.ring", 1 << 20, wake_daemon=False)
    core = CaptureCore(writer, RankPlace(stage_layers=(LAYERS,)), Publisher(writer), model_dtype=torch.float32)
    runner._vllm_tap_loaded, runner._vllm_tap = True, core
    try:
        sos = list(scheduler_outputs())
        runner.execute_model(sos[0])
        # Learned in add_requests, before any step: c carries no capture options.
        assert {r: q.ref.num_prompt_tokens for r, q in core.requests.items()} == {"a": 6, "b": 3, "d": 3}
        runner.sample_tokens(None)
        for so in sos[1:4]:
            runner.execute_model(so)
            runner.sample_tokens(None)
        assert "b" not in core.requests  # preempted in step 4: removed, so forgotten
        runner.execute_model(sos[4])
        assert core.requests["b"] is not None and "d" not in core.requests  # b resumed, d finished
        runner.sample_tokens(None)
    finally:
        writer.close(unlink=True)
        core.close()


def test_an_error_in_the_tap_never_reaches_the_runner(shm):
    """Every patched V2 entry point swallows the tap's exceptions (one logged error) and the runner's
    own work goes on: here the ring is closed under the tap, so every capture fails."""
    cls = type("V2", (V2Runner,), {})
    runner_v2.patch_v2_module(SimpleNamespace(GPUModelRunner=cls))
    runner = cls(TinyModel())
    writer = RingWriter(f"{shm}/err/rank-00000.ring", 1 << 20, wake_daemon=False)
    core = CaptureCore(writer, RankPlace(stage_layers=(LAYERS,)), Publisher(writer), model_dtype=torch.float32)
    runner._vllm_tap_loaded, runner._vllm_tap = True, core
    runner.model.set_aux_hidden_state_layers(LAYERS)
    runner.use_aux_hidden_state_outputs = True
    core.requests = None  # type: ignore[assignment]  - learn, forget, plan: all raise now
    try:
        outs = []
        for so in scheduler_outputs():
            runner.execute_model(so)
            outs.append(runner.sample_tokens(None))
        assert len(outs) == len(STEPS) and all(o is not None for o in outs)
        assert "compute_logits" not in runner.model.__dict__  # the wrapper is never left behind
    finally:
        writer.close(unlink=True)


def test_a_v2_step_failing_half_way_does_not_stall_the_ring(shm):
    """The hidden states of step 2 fail after one record was reserved: that step is given up (its
    reserved records become PAD, its rows are reported dropped) and every later step is delivered."""
    class Broken(V2Runner):
        steps = 0

        def execute_model(self, so, *a, **kw):
            out = super().execute_model(so, *a, **kw)
            Broken.steps += 1
            if Broken.steps == 2:
                self.execute_model_state.aux_hidden_states[1] = None  # hidden.2 of step 2 cannot be read
            return out

    cls = type("V2", (Broken,), {})
    runner_v2.patch_v2_module(SimpleNamespace(GPUModelRunner=cls))
    model = TinyModel()
    runner = cls(model)
    writer = RingWriter(f"{shm}/broken/rank-00000.ring", 1 << 20, wake_daemon=False)
    core = CaptureCore(writer, RankPlace(stage_layers=(LAYERS,)), Publisher(writer), model_dtype=torch.float32)
    model.set_aux_hidden_state_layers(LAYERS)
    runner.use_aux_hidden_state_outputs = True
    runner._vllm_tap_loaded, runner._vllm_tap = True, core
    try:
        for so in scheduler_outputs():
            runner.execute_model(so)
            runner.sample_tokens(None)
        reader = RingReader(writer.path)
        data, drops = collections.defaultdict(set), collections.defaultdict(set)
        for rec in per_tensor(reader.poll()):
            if rec.kind == RecordKind.DROP:
                drops[rec.request_id] |= set(rec.meta["positions"])
            else:
                data[(rec.request_id, rec.tensor.name)] |= set(rec.positions.tolist())
        reader.close()
        assert data[("a", "logits")] == {0, 1, 2, 3, 6, 7, 8}  # step 2 (positions 4, 5) given up
        assert {4, 5} <= drops["a"]
    finally:
        writer.close(unlink=True)
        core.close()
