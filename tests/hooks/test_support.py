"""What the tap runs on (hooks/support.py) and how start-up failures read: supported vLLM versions
with the override, the features refused per runner, and a ring that cannot be made, each as one line.
The configurations are stand-ins with the attribute names of vLLM's VllmConfig / ParallelConfig
(identical in 0.26, 0.32 and 0.33: `use_v2_model_runner` property, `enable_batch_sharded_sampling`,
`prefill_context_parallel_size`, `decode_context_parallel_size`, `enable_dbo`, `ubatch_size`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_tap.hooks import support
from vllm_tap.hooks.capture_core import RankPlace
from vllm_tap.hooks.runner_patch import open_ring
from vllm_tap.hooks.settings import TapConfigError
from vllm_tap.spec import ServerCaptureConfig


def config(v2=False, spec=None, **parallel):
    pc = dict(pipeline_parallel_size=1, prefill_context_parallel_size=1, decode_context_parallel_size=1,
              enable_dbo=False, ubatch_size=1, enable_batch_sharded_sampling=None, data_parallel_size=1)
    pc.update(parallel)
    return SimpleNamespace(use_v2_model_runner=v2, speculative_config=spec, parallel_config=SimpleNamespace(**pc))


@pytest.mark.parametrize("version", ["0.26.0", "0.32.0", "0.32.0+cpu", "0.33.0", "0.33.1+cu130"])
def test_supported_versions_pass(version):
    support.check_version(version, env={})


@pytest.mark.parametrize("version", ["0.25.1", "0.31.0", "0.34.0", "1.0.0", "unknown"])
def test_other_versions_are_refused_in_one_line_unless_overridden(version):
    with pytest.raises(TapConfigError) as e:
        support.check_version(version, env={})
    msg = str(e.value)
    assert "\n" not in msg and version in msg and "0.26, 0.32, 0.33" in msg and support.ALLOW_ENV in msg
    support.check_version(version, env={support.ALLOW_ENV: "1"})
    with pytest.raises(TapConfigError):
        support.check_version(version, env={support.ALLOW_ENV: "0"})


@pytest.mark.parametrize("cfg,layers,version,phrase", [
    (config(spec=object()), (), "0.33.0", "speculative decoding"),
    (config(v2=True, enable_batch_sharded_sampling=True), (), "0.33.0", "batch-sharded sampling"),
    (config(v2=True, prefill_context_parallel_size=2), (), "0.33.0", "context parallelism"),
    (config(decode_context_parallel_size=2), (), "0.33.0", "context parallelism"),
    (config(v2=True, enable_dbo=True), (), "0.33.0", "dual batch overlap"),
    (config(pipeline_parallel_size=2), (1, 2), "0.26.0", "pipeline parallelism on vLLM 0.26"),
])
def test_unsupported_features_stop_start_up_naming_them(cfg, layers, version, phrase):
    with pytest.raises(TapConfigError) as e:
        support.check_config(cfg, layers, version=version)
    assert phrase in str(e.value) and "\n" not in str(e.value)
    assert ("V2" if cfg.use_v2_model_runner else "V1") in str(e.value)


@pytest.mark.parametrize("cfg,layers,version", [
    (config(v2=True), (1, 2), "0.33.0"),
    (config(), (1, 2), "0.32.0"),
    (config(pipeline_parallel_size=2), (1, 2), "0.33.0"),
    (config(pipeline_parallel_size=2), (), "0.26.0"),  # logits only: fine on 0.26 with PP
    (config(enable_batch_sharded_sampling=True), (), "0.33.0"),  # a V2 option; V1 ignores it
])
def test_supported_configurations_pass(cfg, layers, version):
    support.check_config(cfg, layers, version=version)


def test_a_ring_that_cannot_be_made_stops_start_up_in_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = ServerCaptureConfig(shm_dir=str(blocker), ring_bytes=1 << 20)  # a file where a directory must be
    with pytest.raises(TapConfigError) as e:
        open_ring(cfg, config(), RankPlace())
    assert "cannot create the ring" in str(e.value) and "\n" not in str(e.value)


def test_a_squatted_shm_directory_stops_start_up_in_the_api_process(tmp_path):
    """Before any engine starts (hooks/preflight.py): an shm directory open to everyone, or a link,
    is refused in one line naming it; a missing one is made private."""
    from vllm_tap.hooks import preflight

    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    (tmp_path / "link").symlink_to(loose)
    for path in (loose, tmp_path / "link"):
        with pytest.raises(TapConfigError) as e:
            preflight.check_shm_dir(ServerCaptureConfig(shm_dir=str(path), ring_bytes=1 << 20))
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    fresh = tmp_path / "fresh" / "vllm-tap"
    preflight.check_shm_dir(ServerCaptureConfig(shm_dir=str(fresh), ring_bytes=1 << 20))
    assert fresh.is_dir() and fresh.stat().st_mode & 0o777 == 0o700
