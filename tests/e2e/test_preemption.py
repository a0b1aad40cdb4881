"""Preemption and recompute inside vLLM: no duplicate or shifted positions reach a subscriber.

A KV cache of 8 blocks cannot hold four growing requests, so vLLM preempts some and later
recomputes them from the start: their rows are written to the ring twice. The records the rings
really carried go through the daemon's reassembler (the pure state machine the daemon drives),
which must deliver each position once, with the values of a transformers fp32 forward.
"""

from __future__ import annotations

import collections
import glob
import os
import shutil
import tempfile

import numpy as np
import pytest

from reference import hf_forward, shutdown_llm, tiny_model
from vllm_tap.daemon.events import End, Tokens
from vllm_tap.daemon.reassembly import Reassembler
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_format import RecordKind
from vllm_tap.ring_records import per_tensor
from vllm_tap.tools.tiny_model import prompt_text

pytestmark = pytest.mark.vllm

TOL = 1e-5
KV_BLOCK_BYTES = 2 * 4 * 2 * 32 * 4 * 32  # (k, v) × layers × kv heads × head dim × fp32 × block size


def test_recomputed_positions_are_delivered_once_and_right():
    from vllm import LLM, SamplingParams

    shm = tempfile.mkdtemp(prefix="vt-pre-", dir="/dev/shm")
    try:
        llm = LLM(
            tiny_model(), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=128,
            block_size=32, kv_cache_memory_bytes=8 * KV_BLOCK_BYTES, max_num_batched_tokens=64,
            additional_config={"vllm_tap": {"shm_dir": shm, "instance": "pre", "ring_bytes": 32 << 20, "layers": [2]}},
        )
        prompts = [[(17 * i + 3 * k) % 500 + 3 for k in range(40)] for i in range(4)]
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True, extra_args={"tap": 1})
        outs = llm.generate([prompt_text(p) for p in prompts], params)
        control, data = [], []
        shutdown_llm(llm)
        for path in sorted(glob.glob(os.path.join(shm, "pre", "*.ring"))):
            for rec in RingReader(path).poll():
                (data if rec.kind == RecordKind.DATA else control).append(rec)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(shm.rstrip("/") + ".arena", ignore_errors=True)  # the daemon's arena, kept for a next run

    written = collections.Counter((r.request_id, p) for r in per_tensor(data) if r.tensor.name == "logits"
                                  for p in r.positions.tolist())
    assert max(written.values()) > 1, "vLLM preempted and recomputed (else this test proves nothing)"

    reasm = Reassembler("pre", end_grace_s=1.0)
    events = []
    for rec in [r for r in control if r.kind == RecordKind.BEGIN] + data + [r for r in control if r.kind == RecordKind.END]:
        events += reasm.feed(rec, now=0.0)
    events += reasm.tick(now=5.0)
    delivered = collections.defaultdict(list)
    logits = collections.defaultdict(list)
    ends = {}
    for ev in events:
        if isinstance(ev, Tokens):
            delivered[ev.request_id] += ev.positions.tolist()
            logits[ev.request_id].append(ev.tensors["logits"])
        elif isinstance(ev, End):
            ends[ev.request_id] = ev
    assert len(ends) == 4
    for out in outs:
        rid = next(r for r in ends if r.rsplit("-", 1)[0] == out.request_id)
        seq = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        end = len(seq) - 1
        assert delivered[rid] == list(range(end)), "each position once, in order"
        assert not ends[rid].missing_positions
        hf_logits, _ = hf_forward(tiny_model(), seq[:end])
        assert np.abs(np.concatenate(logits[rid]) - hf_logits).max() <= TOL
