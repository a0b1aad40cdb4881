"""Worker rings sized from the model when the operator leaves ring_bytes out (hooks/ring_size.py):
the size follows vocab, hidden size, exposed layers, tensor parallelism, max_num_seqs and the
declared step rate, is bounded by the free shm space, and the API process writes it into the tap's
settings so that every other process opens rings of that size. The configurations are stand-ins
with the attribute names of vLLM's VllmConfig (model_config.get_vocab_size / get_hidden_size /
dtype, scheduler_config.max_num_seqs, parallel_config)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_tap.hooks import preflight, ring_size
from vllm_tap.spec import CaptureOptionError, ServerCaptureConfig

GiB = 1 << 30


def size(**kw) -> tuple[int, str]:
    args = dict(vocab=128256, hidden=4096, layers=0, dtype_bytes=2, tp=1, max_num_seqs=64, steps_per_s=100.0,
                free_shm=64 * GiB, rings=1)
    args.update(kw)
    return ring_size.ring_bytes(**args)


def test_the_size_follows_the_model_and_the_step_rate():
    base, why = size()
    assert why == "model"
    # 64 rows of full bf16 logits at vocab 128,256, 100 steps/s, RING_SECONDS of it, whole MiB
    assert base == int(64 * 128256 * 2 * 100 * ring_size.RING_SECONDS) // (1 << 20) * (1 << 20)
    assert size(steps_per_s=200.0)[0] == pytest.approx(2 * base, rel=1e-3)
    assert size(tp=2)[0] == pytest.approx(base / 2, rel=1e-3)
    assert size(layers=4)[0] > base
    assert size(max_num_seqs=8)[0] < base


def test_the_size_is_bounded_by_free_shm_and_the_limits():
    got, why = size(free_shm=2 * GiB, rings=4)
    assert why == "free shm" and got <= 2 * GiB * ring_size.SHM_SHARE / 4
    assert size(vocab=1000, hidden=64, max_num_seqs=1) == (ring_size.MIN_RING_BYTES, "minimum")
    assert size(layers=80, max_num_seqs=1024, free_shm=1 << 40) == (ring_size.MAX_RING_BYTES, "maximum")


def _vllm_config(shm_dir: str, settings: dict, tp: int = 1):
    mc = SimpleNamespace(get_vocab_size=lambda: 128256, get_hidden_size=lambda: 4096, dtype=torch.bfloat16)
    pc = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=1,
                         data_parallel_size_local=1)
    return SimpleNamespace(model_config=mc, parallel_config=pc, scheduler_config=SimpleNamespace(max_num_seqs=64),
                           additional_config={"vllm_tap": dict(settings, shm_dir=shm_dir, layers="none")})


def test_the_api_process_sizes_the_rings_once_and_every_process_reads_that_size(shm_dir, monkeypatch):
    monkeypatch.setattr(preflight, "free_bytes", lambda path: 64 * GiB)  # this box's /dev/shm is small
    vc = _vllm_config(shm_dir, {"steps_per_s": 50}, tp=2)
    monkeypatch.setattr(preflight, "check_shm_space", lambda vllm_config, cfg: None)
    preflight.check(vc, ServerCaptureConfig.from_additional_config(vc.additional_config))
    want, _ = size(steps_per_s=50.0, tp=2, rings=2)
    assert vc.additional_config["vllm_tap"]["ring_bytes"] == want
    cfg = ServerCaptureConfig.from_additional_config(vc.additional_config)  # what the engine and workers parse
    assert cfg.ring_bytes == want and not cfg.ring_auto


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
