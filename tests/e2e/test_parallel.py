"""Tensor- and pipeline-parallel capture through real engines, rings, daemon and client.

Each layout runs as its own offline vLLM process (tests/support/parallel_engine.py) feeding one daemon;
instances are kept apart by name. TP=2 and PP=2 captures must equal the TP=1 capture and a
transformers fp32 forward; each TP rank's ring must carry only its share of the bytes. The same
requests run two reducers (a probe on layer 2, in the first pipeline stage; an SAE on layer 3, in the
second), which one rank of their stage computes: their outputs equal TP=1's and the reference.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import reducer_reference as rr
from reference import hf_forward, tiny_model
from parallel_engine import POLICY, PROMPTS
from vllm_tap.client import CaptureNotFound, Client
from vllm_tap.policy import selects
from vllm_tap.tools.launch import DaemonHandle
from vllm_tap.ring_reader import read_info
from project_layout import SUPPORT

pytestmark = pytest.mark.vllm

TOL = 1e-5
# name -> (tp, pp, eager). vLLM 0.32's CPU runner allocates the pipeline's receive buffers only in
# the compile warm-up, so eager PP fails inside vLLM itself: PP runs compiled.
LAYOUTS = {"tp1": (1, 1, True), "tp2": (2, 1, True), "pp2": (1, 2, False)}


@pytest.fixture(scope="module")
def runs():
    shm = tempfile.mkdtemp(prefix="vt-par-", dir="/dev/shm")
    tmp = tempfile.mkdtemp(prefix="vt-")
    daemon = DaemonHandle(shm, f"ipc://{tmp}/tap.sock", os.path.join(tmp, "daemon.log")).start()
    model = tiny_model()
    refs = {"probe": rr.linear_probe(f"{tmp}/probe.safetensors", 128, 2), "sae": rr.saelens_sae(f"{tmp}/sae", 128, 256)}
    reducers = {"probe": {"kind": "linear", "layer": 2, "path": f"{tmp}/probe.safetensors"},
                "sae": {"kind": "saelens", "layer": 3, "path": f"{tmp}/sae", "k": 8}}
    results = {}
    try:
        for name, (tp, pp, eager) in LAYOUTS.items():
            argv = [sys.executable, os.path.join(SUPPORT, "parallel_engine.py"), model, shm, name, "--tp", str(tp), "--pp",
                    str(pp), "--reducers", json.dumps(reducers)]
            proc = subprocess.run(argv + (["--eager"] if eager else []), capture_output=True, text=True, timeout=420,
                                  stdin=subprocess.DEVNULL)
            assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-4000:]}"
            results[name] = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
        with Client(daemon.endpoint) as c:
            caps = {(name, i): c.fetch(f"{name}-{i}", instance=name, timeout=60)
                    for name in LAYOUTS for i in range(len(PROMPTS))}
            for name in LAYOUTS:  # the policy's captures, named by their offline request ids
                for req in results[name][len(PROMPTS):]:
                    if selects(req["id"], POLICY["share"]):
                        caps[(name, req["id"])] = c.fetch(req["id"], instance=name, timeout=60)
                    else:
                        with pytest.raises(CaptureNotFound):
                            c.fetch(req["id"], instance=name, timeout=0.5)
        rings = {name: {os.path.basename(p): read_info(p) for p in glob.glob(os.path.join(shm, name, "rank-*.ring"))}
                 for name in LAYOUTS}
        yield results, caps, rings, model, refs
    finally:
        daemon.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(shm.rstrip("/") + ".arena", ignore_errors=True)  # the daemon's arena, kept for a next run
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_parallel_capture_equals_tp1_and_transformers(runs, layout):
    results, caps, _, model, refs = runs
    for i, req in enumerate(results[layout][: len(PROMPTS)]):
        assert req == results["tp1"][i], "same greedy tokens"
        cap, ref = caps[(layout, i)], caps[("tp1", i)]
        seq = req["prompt"] + req["output"]
        end = len(seq) - 1
        assert list(cap.positions) == list(range(end)) and not list(cap.missing_positions)
        assert list(cap.token_ids) == seq[:end]
        assert np.abs(cap.logits - ref.logits).max() <= TOL
        hf_logits, hf_hidden = hf_forward(model, seq[:end])
        assert np.abs(cap.logits - hf_logits).max() <= TOL
        assert sorted(cap.hidden) == sorted(ref.hidden) == list(range(5))
        for layer in cap.hidden:
            assert np.abs(cap.hidden[layer] - ref.hidden[layer]).max() <= TOL
            assert np.abs(cap.hidden[layer] - hf_hidden[layer]).max() <= TOL
        # The reducers, computed by one rank of their stage, against TP=1's and the reference.
        assert sorted(cap.reduced) == sorted(ref.reduced) == ["probe", "sae"]
        np.testing.assert_allclose(cap.reduced["probe"], rr.probe_scores(refs["probe"], cap.hidden[2]), atol=1e-4, rtol=0)
        np.testing.assert_allclose(cap.reduced["probe"], ref.reduced["probe"], atol=1e-4, rtol=0)
        rr.assert_latents_match(cap.reduced["sae"].ids, cap.reduced["sae"].values,
                                rr.sae_activations(refs["sae"], cap.hidden[3]), 8)


def test_the_policy_selects_the_same_requests_at_every_parallel_layout(runs):
    """The policy is decided in the API process (here the offline LLM's) from the request id and
    stamped into the request, so every rank of every layout captures the same requests."""
    results, caps, _, _, _ = runs
    ids = [req["id"] for req in results["tp1"][len(PROMPTS):]]
    chosen = [rid for rid in ids if selects(rid, POLICY["share"])]
    assert 0 < len(chosen) < len(ids)
    for layout in LAYOUTS:
        assert [req["id"] for req in results[layout][len(PROMPTS):]] == ids
        assert sorted(rid for (name, rid) in caps if name == layout and isinstance(rid, str)) == sorted(chosen)
    for rid in chosen:
        ref = caps[("tp1", rid)]
        P = ref.num_prompt_tokens
        assert list(ref.positions) == list(range(P - 1, P + 4)) and sorted(ref.hidden) == [1, 4]
        for layout in ("tp2", "pp2"):
            cap = caps[(layout, rid)]
            assert list(cap.positions) == list(ref.positions) and not list(cap.missing_positions)
            assert np.abs(cap.logits - ref.logits).max() <= TOL
            for layer in (1, 4):
                assert np.abs(cap.hidden[layer] - ref.hidden[layer]).max() <= TOL


def test_each_tensor_parallel_rank_carries_its_share(runs):
    _, _, rings, _, _ = runs
    one = rings["tp1"]["rank-00000.ring"].stats["bytes_written"]
    per_rank = [info.stats["bytes_written"] for info in rings["tp2"].values()]
    assert len(per_rank) == 2
    # Payloads split exactly in half; record headers and token ids are per rank, hence the slack.
    for b in per_rank:
        assert 0.45 * one <= b <= 0.6 * one, (b, one)


def test_pipeline_stages_write_their_own_layers(runs):
    _, _, rings, _, _ = runs
    stage = rings["pp2"]
    assert sorted(stage) == ["rank-00000.ring", "rank-00001.ring"]
    # Stage 0 runs decoder layers 1-2 (and the embeddings), stage 1 layers 3-4 and the lm head.
    first, last = stage["rank-00000.ring"].stats["bytes_written"], stage["rank-00001.ring"].stats["bytes_written"]
    assert first > 0 and last > first, (first, last)
