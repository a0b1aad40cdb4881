"""API-process checks of what the tap needs from the model and the machine, before any engine starts.

Run from startup.py once vLLM has built its config, so a server that cannot capture fails in
seconds with one line (and offline `LLM(...)` raises TapConfigError) instead of after every
worker has loaded the model:
  - hidden-state layers (captured, or read by a reducer) need the model's auxiliary hidden-state
    outputs (the EAGLE-3 interface): the model class is resolved through vLLM's model registry,
    which imports its module but loads no weights;
  - every declared reducer's files are read as far as their headers and checked against the
    model's hidden size (hooks/reducer_files.py): a missing or malformed file, or a shape that does
    not fit, stops start-up with one line naming the reducer's setting;
  - the shm directory is made, or checked when it exists, by the rings' rules (not a link, not
    someone else's, not open to others): a squatted directory stops start-up here;
  - the rings are reserved whole when created (RingWriter), so the shm directory's file system
    must have room for all of them: one ring of `ring_bytes` per worker rank of every engine
    started here, plus each engine's control ring. When ring_bytes is not set, it is sized here
    first, from what the server can capture and bounded by the free space (hooks/ring_size.py).
"""

from __future__ import annotations

import logging

from vllm_tap import ring_format as rf
from vllm_tap.ring_files import ensure_shm_dir, free_bytes
from vllm_tap.safe_paths import UnsafePath
from vllm_tap.spec import ServerCaptureConfig

from . import ring_size
from .engine_events import ENGINE_RING_BYTES
from .settings import TapConfigError

log = logging.getLogger("vllm_tap.hooks")


def check(vllm_config, cfg: ServerCaptureConfig | None) -> None:
    """TapConfigError (one line) when this vLLM cannot run with these tap settings."""
    if cfg is None:
        return
    check_model(vllm_config, cfg)
    check_reducers(vllm_config, cfg)
    check_shm_dir(cfg)
    if cfg.ring_auto:
        pc = vllm_config.parallel_config
        engines = max(1, pc.data_parallel_size_local if pc.data_parallel_size > 1 else 1)
        rings = engines * pc.tensor_parallel_size * pc.pipeline_parallel_size
        cfg = ring_size.apply(vllm_config, cfg, free_bytes(cfg.shm_dir), rings)
    check_shm_space(vllm_config, cfg)


def check_shm_dir(cfg: ServerCaptureConfig) -> None:
    """The shm directory made or found safe here, in seconds, rather than by each engine after start-up."""
    try:
        ensure_shm_dir(cfg.shm_dir, cfg.group)
    except UnsafePath as e:
        raise TapConfigError(f"vllm-tap: {e}") from None
    except OSError as e:
        raise TapConfigError(f"vllm-tap: cannot make the shm directory {cfg.shm_dir}: {e}") from None


def check_reducers(vllm_config, cfg: ServerCaptureConfig) -> None:
    if not cfg.reducers:
        return
    from vllm_tap.hooks import reducer_files

    hidden = int(vllm_config.model_config.get_hidden_size())
    for r in reducer_files.check_all(cfg.reducers, hidden):
        log.info("vllm-tap: reducer %r (%s) on layer %d writes %d %s per token", r.name, r.decl.kind, r.decl.layer,
                 r.width, "latents (id, value)" if r.decl.writes_latents else "scores")


def check_model(vllm_config, cfg: ServerCaptureConfig) -> None:
    if not cfg.aux_layers:
        return
    try:
        from vllm.model_executor.model_loader.utils import get_model_architecture
        from vllm.model_executor.models.interfaces import supports_eagle3

        model_cls, arch = get_model_architecture(vllm_config.model_config)
    except Exception as e:  # vLLM resolves it again when it loads the model, and says what is wrong then
        log.warning("vllm-tap: could not resolve the model class before start-up (%s); the workers check it", e)
        return
    if not supports_eagle3(model_cls):
        raise TapConfigError(
            f"vllm-tap: {arch} has no auxiliary hidden-state outputs (vLLM's EAGLE-3 interface), so its hidden "
            "states cannot be captured; set \"layers\": \"none\" in the vllm_tap settings for logits only"
        )


def rings_bytes(vllm_config, cfg: ServerCaptureConfig) -> tuple[int, int, int]:
    """(bytes the rings started here need, worker ranks per engine, engines)."""
    pc = vllm_config.parallel_config
    ranks = pc.tensor_parallel_size * pc.pipeline_parallel_size
    engines = max(1, pc.data_parallel_size_local if pc.data_parallel_size > 1 else 1)
    per_engine = ranks * (rf.HEADER_SIZE + cfg.ring_bytes) + rf.HEADER_SIZE + ENGINE_RING_BYTES
    return engines * per_engine, ranks, engines


def check_shm_space(vllm_config, cfg: ServerCaptureConfig) -> None:
    needed, ranks, engines = rings_bytes(vllm_config, cfg)
    free = free_bytes(cfg.shm_dir)
    if free < needed:
        mib = lambda n: f"{n / (1 << 20):.1f} MiB"  # noqa: E731
        what = f"{ranks} worker ring{'s' if ranks > 1 else ''} of {mib(cfg.ring_bytes)} + the engine's {mib(ENGINE_RING_BYTES)}"
        if engines > 1:
            what = f"{engines} engines × ({what})"
        raise TapConfigError(
            f"vllm-tap: {cfg.shm_dir} has {mib(free)} free but the rings need {mib(needed)} ({what}): give that "
            "file system more room (containers: --shm-size) or lower vllm_tap.ring_bytes"
        )
