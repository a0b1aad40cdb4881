"""StepCapture's batching, at the ring level: one record per captured tensor per step, shared by
every request that captured it, read back per request exactly as the model's tensors hold it.

The end-to-end tests (offline engine, server, TP/PP) prove the values against vLLM and transformers;
this one drives StepCapture in-process with a stand-in for the model runner's step (real torch
tensors, a real ring in /dev/shm, the real reader) so it can build batches vLLM's scheduler makes
only under load: prefill chunks beside decodes, requests with different specs in one step, records
too big to share. The stand-in is the same shape as the one `vllm-tap bench hook` drives.
"""

from __future__ import annotations

import collections
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

from vllm_tap.hooks.settings import SPEC_EXTRA_ARG
from vllm_tap.ring import RingReader
from vllm_tap.ring_format import RecordKind
from vllm_tap.spec import CaptureSpec, DTypeMode, LogitsMode, PositionsMode, ServerCaptureConfig

HIDDEN, VOCAB, LAYERS = 32, 50, (2, 5)


class _Group:
    rank_in_group, world_size, is_first_rank, is_last_rank = 0, 1, True, True


def _step(specs, scheduled, computed, prompt, seed=0):
    """A step of len(specs) requests: request i has `scheduled[i]` tokens, `computed[i]` done before."""
    g = torch.Generator().manual_seed(seed)
    n_rows = sum(scheduled)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    hidden = torch.randn(n_rows, HIDDEN, generator=g)
    qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    req_ids = [f"r{i}" for i in range(len(specs))]
    model = SimpleNamespace(compute_logits=lambda h: h @ weight.T)
    runner = SimpleNamespace(
        vllm_config=SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_size=1),
            model_config=SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=8), dtype=torch.float32),
        ),
        device="cpu",
        input_batch=SimpleNamespace(req_ids=req_ids, num_computed_tokens_cpu=np.array(computed, np.int32),
                                    num_prompt_tokens=np.array(prompt, np.int32)),
        requests={rid: SimpleNamespace(sampling_params=SimpleNamespace(
            extra_args=None if s is None else {SPEC_EXTRA_ARG: s.to_meta()})) for rid, s in zip(req_ids, specs)},
        query_start_loc=SimpleNamespace(np=qsl),
        input_ids=SimpleNamespace(gpu=torch.randint(0, VOCAB, (n_rows,), dtype=torch.int32, generator=g)),
        model=model,
    )
    aux = [torch.randn(n_rows, HIDDEN, generator=g) for _ in LAYERS]
    state = SimpleNamespace(
        scheduler_output=SimpleNamespace(finished_req_ids=set()),
        hidden_states=hidden,
        logits=model.compute_logits(hidden[qsl[1:] - 1]),  # one row per request: its last scheduled token
        aux_hidden_states=aux,
    )
    return runner, state


def _expected(runner, state, specs):
    """What each request should get this step, straight from the step's tensors: {rid: {tensor: {pos: row}}}."""
    ib, qsl = runner.input_batch, runner.query_start_loc.np
    all_logits = runner.model.compute_logits(state.hidden_states)
    out: dict[str, dict] = {}
    for i, (rid, spec) in enumerate(zip(ib.req_ids, specs)):
        if spec is None:
            continue
        c, r0, r1 = int(ib.num_computed_tokens_cpu[i]), int(qsl[i]), int(qsl[i + 1])
        a, b = spec.live_range(int(ib.num_prompt_tokens[i]))
        got = collections.defaultdict(dict)
        for row in range(r0, r1):
            p = c + row - r0
            if not a <= p < b:
                continue
            got["token"][p] = int(runner.input_ids.gpu[row])
            lg = all_logits[row]
            if spec.logits == LogitsMode.FULL:
                got["logits"][p] = lg.numpy()
            elif spec.logits == LogitsMode.TOPK:
                got["topk_ids"][p] = torch.topk(lg, spec.topk).indices.numpy()
            elif spec.logits == LogitsMode.INDICES:
                got["chosen"][p] = lg[list(spec.indices)].numpy()
            for layer in spec.layers:
                got[f"hidden.{layer}"][p] = state.aux_hidden_states[LAYERS.index(layer)][row].numpy()
        out[rid] = got
    return out


def _read(path):
    """Per request: {tensor: {pos: row}} plus token ids, and how many ring records carried them."""
    reader = RingReader(path)
    n_records = reader.info().stats["records_written"]
    got = collections.defaultdict(lambda: collections.defaultdict(dict))
    parts = {}
    for rec in reader.poll():
        assert rec.kind == RecordKind.DATA
        parts[rec.request_id] = rec.rank_parts
        assert list(rec.positions) == sorted(rec.positions), "a request's rows come out in position order"
        for j, p in enumerate(rec.positions.tolist()):
            assert p not in got[rec.request_id][rec.tensor.name], "each position once"
            got[rec.request_id][rec.tensor.name][p] = rec.data[j]
            got[rec.request_id]["token"][p] = int(rec.token_ids[j])
    reader.close()
    return got, parts, n_records


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


@pytest.mark.parametrize("max_record_bytes", [None, 256], ids=["shared-records", "split-per-request"])
def test_a_mixed_step_is_read_back_per_request_exactly(tmp_path, max_record_bytes):
    from vllm.distributed import parallel_state as ps

    from vllm_tap.hooks.step_capture import StepCapture

    shm = "/dev/shm/vllm-tap-test-" + tmp_path.name
    runner, state = _step(SPECS, SCHEDULED, COMPUTED, PROMPT)
    cfg = ServerCaptureConfig(layers=LAYERS, instance="unit", shm_dir=shm, ring_bytes=1 << 20)
    with mock.patch.object(ps, "get_tp_group", return_value=_Group()), \
            mock.patch.object(ps, "get_pp_group", return_value=_Group()):
        cap = StepCapture(runner, cfg)
    if max_record_bytes:
        cap.max_record_bytes = max_record_bytes
    try:
        cap.capture(runner, state)
        got, parts, n_records = _read(cap.writer.path)
    finally:
        cap.close()
        cap.writer.close(unlink=True)
    want = _expected(runner, state, SPECS)
    assert set(got) == set(want) == {"r0", "r2", "r3", "r4", "r5", "r6"}
    for rid, tensors in want.items():
        assert set(got[rid]) - {"topk_values"} == set(tensors), rid
        for name, rows in tensors.items():
            assert sorted(got[rid][name]) == sorted(rows), (rid, name)
            for p, row in rows.items():
                np.testing.assert_allclose(got[rid][name][p], row, rtol=0, atol=1e-5, err_msg=f"{rid} {name} {p}")
    # r2's top-k values are its logits at its top-k ids, largest first.
    (p2,) = want["r2"]["topk_ids"]
    full = runner.model.compute_logits(state.hidden_states[runner.query_start_loc.np[3] - 1])
    np.testing.assert_allclose(got["r2"]["topk_values"][p2], full[torch.topk(full, 3).indices].numpy(), atol=1e-5)
    assert parts == {"r0": 3, "r2": 2, "r3": 2, "r4": 2, "r5": 3, "r6": 3}
    if max_record_bytes is None:
        # One record per tensor for the whole step: logits, hidden.2, hidden.5, top-k ids + values, chosen.
        assert n_records == 6
    else:
        assert n_records > 6
