"""The hook inside offline `vllm.LLM` (eager), checked at the ring level against vLLM and transformers.

One engine for the module. Rings are read directly with RingReader, so a failure here points at
the hook rather than the daemon. `--logprobs-mode raw_logits` makes vLLM's own logprobs the raw
logits, so captured logits compare to them directly.
"""

from __future__ import annotations

import collections
import glob
import os
import shutil
import uuid

import numpy as np
import pytest

from reference import hf_forward, shutdown_llm, tiny_model, vllm_logprob_rows
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_format import RecordKind
from vllm_tap.ring_records import per_tensor
from vllm_tap.tools.tiny_model import TinyLlamaSpec, prompt_text

pytestmark = pytest.mark.vllm

TOL = 1e-5
SPEC = TinyLlamaSpec()
N_LAYERS = SPEC.num_layers


class Captures:
    """Accumulates everything the rings of one instance carried, per internal request id."""

    def __init__(self, shm: str, instance: str):
        self.dir = os.path.join(shm, instance)
        self.readers: dict[str, RingReader] = {}
        self.begin: dict[str, dict] = {}
        self.end: dict[str, dict] = {}
        self.rows: dict[str, dict[str, dict[int, np.ndarray]]] = collections.defaultdict(lambda: collections.defaultdict(dict))
        self.tokens: dict[str, dict[int, int]] = collections.defaultdict(dict)
        self.records: dict[str, int] = collections.Counter()

    def poll(self) -> None:
        for path in sorted(glob.glob(os.path.join(self.dir, "*.ring"))):
            if path not in self.readers:
                self.readers[path] = RingReader(path)
            for rec in per_tensor(self.readers[path].poll()):
                rid = rec.request_id
                if rec.kind == RecordKind.BEGIN:
                    self.begin[rid] = rec.meta
                elif rec.kind == RecordKind.END:
                    self.end[rid] = rec.meta
                elif rec.kind == RecordKind.DATA:
                    self.records[rid] += 1
                    assert rec.slice_start == 0 and rec.slice_stop == rec.full_dim  # tp=1
                    for j, p in enumerate(rec.positions.tolist()):
                        self.rows[rid][rec.tensor.name][p] = rec.data[j]
                        self.tokens[rid][p] = int(rec.token_ids[j])

    def internal_id(self, offline_id: str) -> str:
        self.poll()
        ids = [r for r in self.begin if r.rsplit("-", 1)[0] == offline_id]
        assert len(ids) == 1, (offline_id, list(self.begin))
        return ids[0]

    def stacked(self, rid: str, name: str) -> tuple[list[int], np.ndarray]:
        rows = self.rows[rid][name]
        pos = sorted(rows)
        return pos, np.stack([rows[p] for p in pos])


@pytest.fixture(scope="module")
def engine():
    from vllm import LLM

    shm = f"/dev/shm/vllm-tap-test-{uuid.uuid4().hex[:8]}"
    llm = LLM(
        tiny_model(SPEC), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=512,
        max_num_batched_tokens=32, block_size=32, max_logprobs=-1, logprobs_mode="raw_logits",
        additional_config={"vllm_tap": {"shm_dir": shm, "instance": "offline", "ring_bytes": 32 << 20}},
    )
    yield llm, Captures(shm, "offline")
    shutdown_llm(llm)
    shutil.rmtree(shm, ignore_errors=True)


def _sp(**kw):
    from vllm import SamplingParams

    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


def test_logits_and_hidden_match_vllm_and_transformers(engine):
    llm, caps = engine
    lengths = (5, 13, 37)  # 37 > max_num_batched_tokens: chunked prefill across steps
    prompts = [prompt_text([(7 * n + 3 * i) % 500 + 3 for i in range(n)]) for n in lengths]
    outs = llm.generate(prompts, [_sp(max_tokens=5, logprobs=-1, prompt_logprobs=-1, extra_args={"tap": 1})] * 3)
    path = tiny_model(SPEC)
    for out in outs:
        rid = caps.internal_id(out.request_id)
        P, gen = len(out.prompt_token_ids), list(out.outputs[0].token_ids)
        seq = list(out.prompt_token_ids) + gen
        end = P + len(gen) - 1
        assert caps.end[rid]["reason"] == "length" and caps.end[rid]["output_token_ids"] == gen
        assert caps.end[rid]["end_position"] == end
        pos, logits = caps.stacked(rid, "logits")
        assert pos == list(range(end)), "every computed position captured once"
        assert [caps.tokens[rid][p] for p in pos] == seq[:end]
        # vLLM's raw-logit "logprobs": prompt row j is computed at position j-1; output row k at P-1+k.
        ref = np.concatenate([vllm_logprob_rows(out.prompt_logprobs[1:], SPEC.vocab_size),
                              vllm_logprob_rows(out.outputs[0].logprobs, SPEC.vocab_size)])[:end]
        assert not np.isnan(ref).any()
        assert np.abs(logits - ref).max() <= TOL
        # The sampled tokens are the argmax of the captured logits (greedy).
        assert [int(np.argmax(logits[p])) for p in range(P - 1, end)] == gen
        hf_logits, hf_hidden = hf_forward(path, seq[:end])
        assert np.abs(logits - hf_logits).max() <= TOL
        for layer in range(N_LAYERS + 1):
            hp, hidden = caps.stacked(rid, f"hidden.{layer}")
            assert hp == pos
            assert np.abs(hidden - hf_hidden[layer]).max() <= TOL, f"layer {layer}"


def test_repeated_prompt_is_captured_whole_despite_prefix_cache(engine):
    llm, caps = engine
    prompt = prompt_text([(11 * i) % 400 + 5 for i in range(70)])  # > 2 KV blocks of 32
    first = llm.generate([prompt], [_sp(max_tokens=2, extra_args={"tap": 1})])[0]
    plain = llm.generate([prompt], [_sp(max_tokens=2)])[0]
    second = llm.generate([prompt], [_sp(max_tokens=2, extra_args={"tap": 1, "tap_layers": [2]})])[0]
    assert plain.num_cached_tokens >= 64, "the prompt is in the prefix cache"
    a, b = caps.internal_id(first.request_id), caps.internal_id(second.request_id)
    pa, la = caps.stacked(a, "hidden.2")
    pb, lb = caps.stacked(b, "hidden.2")
    assert pa == pb == list(range(71))
    assert np.abs(la - lb).max() <= TOL
    assert plain.request_id not in {r.rsplit("-", 1)[0] for r in caps.begin}


def test_request_that_does_not_opt_in_writes_nothing(engine):
    llm, caps = engine
    before = dict(caps.records)
    out = llm.generate([prompt_text([9, 8, 7])], [_sp(max_tokens=3)])[0]
    caps.poll()
    assert all(r.rsplit("-", 1)[0] != out.request_id for r in caps.begin)
    assert caps.records == before


def test_capture_options_against_the_full_capture(engine):
    llm, caps = engine
    prompt = prompt_text([(5 * i) % 300 + 3 for i in range(20)])
    variants = {
        "full": {"tap": 1},
        "topk": {"tap_logits": "topk", "tap_topk": 7, "tap_layers": "none"},
        "indices": {"tap_logits": "indices", "tap_indices": [3, 17, 200], "tap_layers": [1, 3]},
        "output": {"tap_positions": "output"},
        "prompt": {"tap_positions": "prompt", "tap_logits": "none", "tap_layers": [0]},
        "last_prompt": {"tap_positions": "last_prompt"},
        "f32": {"tap_dtype": "float32", "tap_key": "k-" + uuid.uuid4().hex[:6]},
    }
    outs = llm.generate([prompt] * len(variants), [_sp(max_tokens=4, extra_args=v) for v in variants.values()])
    rid = {name: caps.internal_id(o.request_id) for name, o in zip(variants, outs)}
    P, end = 20, 23
    pos, full = caps.stacked(rid["full"], "logits")
    assert pos == list(range(end))
    _, ids = caps.stacked(rid["topk"], "topk_ids")
    _, vals = caps.stacked(rid["topk"], "topk_values")
    assert ids.shape == (end, 7) and sorted(caps.rows[rid["topk"]]) == ["logsumexp", "topk_ids", "topk_values"]
    np.testing.assert_array_equal(ids, np.argsort(-full, axis=1, kind="stable")[:, :7])
    np.testing.assert_allclose(vals, np.take_along_axis(full, ids.astype(np.int64), 1), atol=TOL)
    assert np.all(np.diff(vals, axis=1) <= 0)
    _, chosen = caps.stacked(rid["indices"], "chosen")
    np.testing.assert_allclose(chosen, full[:, [3, 17, 200]], atol=TOL)
    assert sorted(caps.rows[rid["indices"]]) == ["chosen", "hidden.1", "hidden.3", "logsumexp"]
    # Beside top-k and chosen logits, each row's logsumexp: logit - logsumexp is log_softmax of the
    # whole row (computed here from the full capture, which equals vLLM's raw logits).
    logp = full.astype(np.float64) - np.log(np.exp(full.astype(np.float64) - full.max(1, keepdims=True)).sum(1,
                                              keepdims=True)) - full.max(1, keepdims=True)
    _, lse = caps.stacked(rid["topk"], "logsumexp")
    assert lse.shape == (end, 1)
    np.testing.assert_allclose(vals - lse, np.take_along_axis(logp, ids.astype(np.int64), 1), atol=TOL)
    _, lse_i = caps.stacked(rid["indices"], "logsumexp")
    np.testing.assert_allclose(chosen - lse_i, logp[:, [3, 17, 200]], atol=TOL)
    p_out, out_logits = caps.stacked(rid["output"], "logits")
    assert p_out == list(range(P - 1, end))
    np.testing.assert_allclose(out_logits, full[P - 1 :], atol=TOL)
    assert sorted(caps.rows[rid["prompt"]]) == ["hidden.0"]
    assert sorted(caps.rows[rid["prompt"]]["hidden.0"]) == list(range(P))
    assert sorted(caps.rows[rid["last_prompt"]]["logits"]) == [P - 1]
    assert caps.begin[rid["f32"]]["spec"]["key"] == variants["f32"]["tap_key"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"tap_logits": "everything"}, "tap_logits"),
        ({"tap_topk": 5}, "tap_topk"),
        ({"tap_logits": "topk", "tap_topk": 100000}, "tap_topk"),
        ({"tap_logits": "indices", "tap_indices": [1, 99999]}, "tap_indices"),
        ({"tap_layers": [99]}, "tap_layers"),
        ({"tap_positions": "middle"}, "tap_positions"),
        ({"tap_colour": "red"}, "tap_colour"),
        ({"tap_key": 5}, "tap_key"),
        ({"tapkey": "k"}, "tapkey"),
        ({"tap_layers": []}, "tap_layers"),
        ({"tap_layers": True}, "tap_layers"),
        ({"tap_positions": "output[:-1]"}, "tap_positions"),
        ({"vllm_tap_spec": "x"}, "vllm_tap_spec"),
    ],
)
def test_invalid_options_raise_validation_error(engine, extra, needle):
    from vllm.exceptions import VLLMValidationError

    llm, _ = engine
    with pytest.raises(VLLMValidationError, match=needle):
        llm.generate(["w5 w6"], [_sp(max_tokens=1, extra_args=extra)])


# Windows at the ring level: what the workers write. Tail windows (output[-N:], all[-N:]) write the
# whole segment from its start; the daemon keeps the last N (test_server_policy checks that end).
WINDOWS = ["prompt[-16:]", "output[:3]", "output[2:4]", "all[5:9]", [5, 9], "all[72:]", "prompt[:-68]",
           "last_prompt", "output[-2:]", "all[-3:]"]


def test_every_window_against_the_full_capture_and_the_prefix_cache(engine):
    from vllm_tap.spec import CaptureSpec

    llm, caps = engine
    prompt = prompt_text([(13 * i) % 400 + 7 for i in range(70)])  # 2 full KV blocks of 32 can be cached
    P, G = 70, 6
    end = P + G - 1
    full = llm.generate([prompt], [_sp(max_tokens=G, extra_args={"tap": 1})])[0]
    outs = llm.generate([prompt] * len(WINDOWS), [_sp(max_tokens=G, extra_args={"tap_positions": w}) for w in WINDOWS])
    rid_full = caps.internal_id(full.request_id)
    pos_full, logits_full = caps.stacked(rid_full, "logits")
    assert pos_full == list(range(end))
    for w, out in zip(WINDOWS, outs):
        rid = caps.internal_id(out.request_id)
        spec = CaptureSpec.from_meta(caps.begin[rid]["spec"])
        assert spec == CaptureSpec(positions=w, layers=spec.layers), w
        lo, hi = spec.live_range(P)
        written = list(range(lo, min(hi, end)))  # a tail's workers write the whole segment from its start
        pos, logits = caps.stacked(rid, "logits")
        assert pos == written, w
        np.testing.assert_allclose(logits, logits_full[lo : min(hi, end)], atol=TOL, err_msg=str(w))
        for layer in (0, N_LAYERS):
            hp, hidden = caps.stacked(rid, f"hidden.{layer}")
            _, ref = caps.stacked(rid_full, f"hidden.{layer}")
            assert hp == pos
            np.testing.assert_allclose(hidden, ref[lo : min(hi, end)], atol=TOL)
        assert caps.end[rid]["spec"] == caps.begin[rid]["spec"] and caps.end[rid]["source"] == "client"
        start, stop = spec.position_range(P, caps.end[rid]["end_position"])
        assert set(range(start, stop)) <= set(pos), w
        # Only a window reaching before the last prompt token makes the request skip the prefix cache.
        if spec.reads_prompt(P):
            assert out.num_cached_tokens == 0, w
        else:
            assert out.num_cached_tokens >= 64, (w, out.num_cached_tokens)


@pytest.mark.parametrize("key", ["vllm_tap_spec", "vllm_tap_n", "vllm_tap_x"])
def test_a_reserved_key_is_refused_even_with_a_well_formed_spec(engine, key):
    from vllm.exceptions import VLLMValidationError

    from vllm_tap.spec import CaptureSpec

    llm, caps = engine
    with pytest.raises(VLLMValidationError, match=f"{key}: reserved"):
        llm.generate(["w5 w6"], [_sp(max_tokens=1, extra_args={key: CaptureSpec().to_meta(), "tap": 1})])


def test_params_shared_by_several_prompts_are_not_changed(engine):
    llm, caps = engine
    params = _sp(max_tokens=2, extra_args={"tap": 1, "tap_key": "shared-" + uuid.uuid4().hex[:6]})
    before = dict(params.extra_args)
    outs = llm.generate(["w5 w6", "w7 w8 w9"], params)
    assert params.extra_args == before and not params.skip_reading_prefix_cache
    caps.poll()
    assert len({caps.internal_id(o.request_id) for o in outs}) == 2


def test_a_malformed_spec_that_bypassed_the_api_process_is_no_capture_and_vllm_lives(engine):
    """An engine request built by in-process code (vLLM's deprecated EngineCoreRequest path skips
    process_inputs) carrying a bad internal spec: no capture, one logged error, serving goes on."""
    llm, caps = engine
    eng = llm.llm_engine
    for k, bad in enumerate(["x", {"logits": "full"}, [1, 2]]):
        rid = f"bypass-{uuid.uuid4().hex[:6]}-{k}"
        req = eng.input_processor.process_inputs(rid, {"type": "token", "prompt_token_ids": [5, 6, 7]},
                                                 _sp(max_tokens=3), supported_tasks=("generate",))
        req.sampling_params.extra_args = {"vllm_tap_spec": bad}
        eng.add_request(rid, req, req.sampling_params)
        while eng.has_unfinished_requests():
            eng.step()
        caps.poll()
        assert all(not r.startswith(rid) for r in caps.begin)
    out = llm.generate(["w5 w6"], [_sp(max_tokens=2, extra_args={"tap": 1})])[0]
    assert caps.internal_id(out.request_id)
