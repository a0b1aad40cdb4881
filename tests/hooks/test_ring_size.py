"""Worker rings sized from what the server can capture when the operator leaves ring_bytes out
(hooks/ring_size.py): requests that may opt in can ask for full logits and every exposed layer on
every sequence; a policy that alone captures needs its share of the sequences (with a margin) at
its own spec. The size follows vocab, hidden size, dtype, tensor parallelism, max_num_seqs and the
declared step rate, has a floor, is bounded by the free shm space, is said in one start-up line,
and the API process writes it into the tap's settings so that every other process opens rings of
that size. The configurations are stand-ins with the attribute names of vLLM's VllmConfig
(model_config.get_vocab_size / get_hidden_size / dtype, scheduler_config.max_num_seqs,
parallel_config)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from vllm_tap.hooks import preflight, ring_size
from vllm_tap.spec import CaptureOptionError, ServerCaptureConfig

GiB = 1 << 30
MiB = 1 << 20
LLAMA_8B = ring_size.Model(vocab=128256, hidden=4096, dtype_bytes=2, tp=1, max_num_seqs=256)


def cfg(**settings) -> ServerCaptureConfig:
    c = ServerCaptureConfig.from_additional_config({"vllm_tap": settings}, num_layers=32, vocab_size=128256)
    assert c is not None
    return c


def size(c: ServerCaptureConfig, m: ring_size.Model = LLAMA_8B, **kw) -> tuple[int, str]:
    args = dict(steps_per_s=c.steps_per_s, free_shm=64 * GiB, rings=1)
    args.update(kw)
    return ring_size.ring_bytes(ring_size.demand(c, m), **args)


def test_requests_that_may_opt_in_size_for_full_logits_and_every_exposed_layer_on_every_sequence():
    d = ring_size.demand(cfg(layers=[16]), LLAMA_8B)
    assert d.seqs == 256 and d.position_bytes == 8 + (128256 + 4096) * 2
    got, why = size(cfg(layers=[16]))
    assert why == "sized" and got == int(256 * d.position_bytes * 100 * 0.5) // MiB * MiB  # 3.1 GiB
    # more exposed layers, more bytes; a policy that lets requests opt in changes nothing
    assert size(cfg(layers="all"))[0] > got
    assert size(cfg(layers=[16], policy={"share": 0.05, "layers": [16], "logits": "none"}))[0] == got
    assert size(cfg(layers=[16], policy={"share": 0.05, "layers": [16], "logits": "none", "client": "loses"}))[0] == got


def test_a_policy_that_alone_captures_sizes_for_its_share_and_its_spec():
    """The operator's case: layer 16 of 5 % of the traffic, on an 8 B model at max_num_seqs 256."""
    c = cfg(layers=[16], policy={"share": 0.05, "layers": [16], "logits": "none", "client": "refused"})
    d = ring_size.demand(c, LLAMA_8B)
    assert d.seqs == math.ceil(256 * 0.05 + 3 * math.sqrt(256 * 0.05 * 0.95)) == 24
    assert d.position_bytes == 8 + 4096 * 2
    assert d.per_step() * 100 * 0.5 < 10 * MiB  # megabytes: the floor stands
    assert size(c) == (ring_size.MIN_RING_BYTES, "minimum")
    # the policy's own spec sets the width: top-20 adds ids, values and a logsumexp; float32 doubles bf16
    top = cfg(layers=[16], policy={"share": 0.05, "layers": [16], "logits": "topk", "topk": 20, "client": "refused"})
    assert ring_size.demand(top, LLAMA_8B).position_bytes == 8 + 20 * (4 + 2) + 4 + 4096 * 2
    f32 = cfg(layers=[16], policy={"share": 0.05, "layers": [16], "logits": "none", "dtype": "float32",
                                   "client": "refused"})
    assert ring_size.demand(f32, LLAMA_8B).position_bytes == 8 + 4096 * 4
    # all of the traffic: every sequence; none of it: only the floor
    full = cfg(layers=[16], policy={"share": 1.0, "logits": "full", "layers": [16], "client": "refused"})
    assert ring_size.demand(full, LLAMA_8B).seqs == 256
    assert ring_size.demand(cfg(policy={"share": 0.0, "client": "refused"}), LLAMA_8B).seqs == 0


def test_the_size_follows_the_model_and_the_step_rate():
    c = cfg(layers="none")
    base, why = size(c)
    assert why == "sized"
    assert size(cfg(layers="none", steps_per_s=200))[0] == pytest.approx(2 * base, rel=1e-3)
    half = ring_size.Model(128256, 4096, 2, 2, 256)
    assert size(c, half)[0] == pytest.approx(base / 2, rel=1e-2)
    fewer = ring_size.Model(128256, 4096, 2, 1, 64)
    assert size(c, fewer)[0] == pytest.approx(base / 4, rel=1e-2)


def test_the_size_is_bounded_by_free_shm_and_the_limits():
    got, why = size(cfg(layers="all"), free_shm=2 * GiB, rings=4)
    assert why == "free shm" and got <= 2 * GiB * ring_size.SHM_SHARE / 4
    tiny = ring_size.Model(1000, 64, 2, 1, 1)
    assert size(cfg(layers="all"), tiny) == (ring_size.MIN_RING_BYTES, "minimum")
    assert size(cfg(layers="all"), ring_size.Model(128256, 8192, 4, 1, 1024), free_shm=1 << 40) == \
        (ring_size.MAX_RING_BYTES, "maximum")


def _vllm_config(shm_dir: str, settings: dict, tp: int = 1):
    mc = SimpleNamespace(get_vocab_size=lambda: 128256, get_hidden_size=lambda: 4096, dtype=torch.bfloat16)
    pc = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=1,
                         data_parallel_size_local=1)
    return SimpleNamespace(model_config=mc, parallel_config=pc, scheduler_config=SimpleNamespace(max_num_seqs=64),
                           additional_config={"vllm_tap": dict({"layers": "none"}, shm_dir=shm_dir, **settings)})


def test_the_api_process_sizes_the_rings_once_says_why_and_every_process_reads_that_size(shm_dir, monkeypatch, caplog):
    monkeypatch.setattr(preflight, "free_bytes", lambda path: 64 * GiB)  # this box's /dev/shm is small
    vc = _vllm_config(shm_dir, {"steps_per_s": 50}, tp=2)
    monkeypatch.setattr(preflight, "check_shm_space", lambda vllm_config, cfg: None)
    with caplog.at_level(logging.INFO, logger="vllm_tap.hooks"):
        preflight.check(vc, ServerCaptureConfig.from_additional_config(vc.additional_config))
    c = ServerCaptureConfig.from_additional_config(vc.additional_config)  # what the engine and workers parse
    want, _ = ring_size.ring_bytes(ring_size.demand(c, ring_size.Model(128256, 4096, 2, 2, 64)), steps_per_s=50.0,
                                   free_shm=64 * GiB, rings=2)
    assert vc.additional_config["vllm_tap"]["ring_bytes"] == want
    assert c.ring_bytes == want and not c.ring_auto
    lines = [r.getMessage() for r in caplog.records if "worker rings of" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert f"worker rings of {want >> 20} MiB" in lines[0] and "requests may opt in" in lines[0]
    assert "64 sequences" in lines[0] and "tp 2" in lines[0] and "50 steps/s" in lines[0]


def test_a_policy_only_server_logs_the_floor_and_its_reason(shm_dir, monkeypatch, caplog):
    monkeypatch.setattr(preflight, "free_bytes", lambda path: 64 * GiB)
    monkeypatch.setattr(preflight, "check_shm_space", lambda vllm_config, cfg: None)
    monkeypatch.setattr(preflight, "check_model", lambda vllm_config, cfg: None)
    vc = _vllm_config(shm_dir, {"layers": [16], "policy": {"share": 0.05, "layers": [16], "logits": "none",
                                                           "client": "refused"}})
    with caplog.at_level(logging.INFO, logger="vllm_tap.hooks"):
        preflight.check(vc, ServerCaptureConfig.from_additional_config(vc.additional_config, 32, 128256))
    assert vc.additional_config["vllm_tap"]["ring_bytes"] == ring_size.MIN_RING_BYTES
    line = next(r.getMessage() for r in caplog.records if "worker rings of" in r.getMessage())
    assert "64 MiB, the minimum" in line and "only the policy captures" in line and "layer 16" in line, line


def test_a_ring_size_the_operator_sets_stands(shm_dir):
    vc = _vllm_config(shm_dir, {"ring_bytes": 32 << 20})
    preflight.check(vc, ServerCaptureConfig.from_additional_config(vc.additional_config))
    assert vc.additional_config["vllm_tap"]["ring_bytes"] == 32 << 20


@pytest.mark.parametrize("setting,value", [("steps_per_s", 0), ("steps_per_s", "fast"), ("shed_at", 0),
                                           ("shed_at", 1.5), ("shed_at", True)])
def test_bad_sizing_settings_are_refused_in_one_line_naming_them(setting, value):
    with pytest.raises(CaptureOptionError) as e:
        ServerCaptureConfig.from_additional_config({"vllm_tap": {setting: value}})
    assert f"vllm_tap.{setting}" in str(e.value) and "\n" not in str(e.value)
