"""Model-runner side, common to both runners: set the tap up once the model is loaded.

Hidden states come from the auxiliary hidden-state outputs vLLM built for EAGLE-3: the model
returns the residual stream after the chosen layers as extra outputs of its (compiled, possibly
CUDA-graphed) forward. Enabling them right after load_model, before compilation, memory profiling
and graph capture, makes them ordinary graph outputs, so capture needs no eager mode and no forward
hooks. The V1 and V2 runners both read `use_aux_hidden_state_outputs` after load_model (V1 at
execute time, V2 when it captures graphs and at execute time), and neither uses the aux outputs for
anything else when there is no speculator (which the tap refuses).

The per-runner parts (which methods are wrapped, how a step's view is built) are in runner_v1.py
and runner_v2.py; the capture itself is the runner-neutral hooks/capture_core.py.
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm_tap.ring_files import ring_path
from vllm_tap.ring_writer import RingWriter

from . import support
from .capture_core import CaptureCore, RankPlace
from .publisher import make_publisher
from .settings import TapConfigError, instance_name, server_config

log = logging.getLogger("vllm_tap.hooks")


def stage_layers(layers: tuple[int, ...], num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, ...]:
    """The captured layers a pipeline stage computes: 0 (embeddings) on the first stage, and
    layer i (output of decoder layer i) on the stage that runs decoder layer i."""
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(num_layers, pp_rank, pp_size)
    return tuple(x for x in layers if start < x <= end or (x == 0 and pp_rank == 0))


def rank_place(layers: tuple[int, ...], vllm_config) -> RankPlace:
    from vllm.distributed import parallel_state as ps

    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    n_layers = vllm_config.model_config.hf_text_config.num_hidden_layers
    return RankPlace(tp.rank_in_group, tp.world_size, pp.rank_in_group,
                     tuple(stage_layers(layers, n_layers, s, pp.world_size) for s in range(pp.world_size)))


def open_ring(cfg, vllm_config, place: RankPlace) -> RingWriter:
    """This rank's ring; any failure to make it (no room in /dev/shm, permissions) stops start-up."""
    path = ring_path(cfg.shm_dir, instance_name(cfg, vllm_config), place.rank)
    try:
        return RingWriter(path, cfg.ring_bytes, rank=place.rank, world_size=place.world_size,
                          mode=0o660 if cfg.group else 0o600, group=cfg.group, block_timeout=cfg.block_timeout_s)
    except TapConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever it is, it is a start-up failure, in one line
        raise TapConfigError(f"vllm-tap: cannot create the ring {path}: {e}".replace("\n", " ")) from None


def setup(runner, *, v2: bool) -> CaptureCore | None:
    """After load_model: the worker's capture core (None when the tap is off), aux outputs turned on."""
    vc = runner.vllm_config
    cfg = server_config(vc)
    if cfg is None:
        return None
    bad = support.unsupported_features(vc, cfg.layers, support.vllm_version())
    if v2 and getattr(runner, "batch_sharder", None) is not None:
        bad.append("batch-sharded sampling")
    if v2 and getattr(runner, "pcp_manager", None) is not None:
        bad.append("prefill context parallelism")
    if bad:
        raise TapConfigError(f"vllm-tap: not supported with the tap enabled ({'V2' if v2 else 'V1'} model "
                             f"runner): {bad[0]}")
    model = runner.get_model()
    if cfg.layers:
        from vllm.model_executor.models.interfaces import supports_eagle3

        if not supports_eagle3(model):
            raise TapConfigError(
                f"vllm-tap: {type(model).__name__} has no auxiliary hidden-state outputs (the EAGLE-3 "
                "interface), so its hidden states cannot be captured; set \"layers\": \"none\" for logits only"
            )
    place = rank_place(cfg.layers, vc)
    writer = open_ring(cfg, vc, place)
    device = torch.device(runner.device)
    try:
        publisher = make_publisher(writer, device, cfg.ring_bytes)
    except Exception as e:  # noqa: BLE001
        writer.close(unlink=True)
        raise TapConfigError(f"vllm-tap: cannot set up copies into the ring: {e}".replace("\n", " ")) from None
    core = CaptureCore(writer, place, publisher, model_dtype=getattr(vc.model_config, "dtype", None), device=device,
                       shed_at=cfg.shed_at)
    if cfg.layers:
        # Each pipeline stage emits only the layers it computes. The runner unpacks aux outputs on
        # the last stage once the flag is set; earlier stages return theirs inside
        # IntermediateTensors, where the execute_model wrapper takes them out.
        model.set_aux_hidden_state_layers(place.layers)
        runner.use_aux_hidden_state_outputs = place.is_last_stage and bool(place.layers)
    log.info("vllm-tap ring %s of %d MiB (tp rank %d/%d, pp stage %d/%d, %s runner; new captures shed while over "
             "%.0f%% unread)", writer.path, writer.capacity >> 20, place.tp_rank, place.tp_size, place.pp_rank,
             place.pp_size, "V2" if v2 else "V1", 100 * cfg.shed_at)
    return core


def wrap_load(cls, *, v2: bool) -> None:
    orig = cls.load_model

    @functools.wraps(orig)
    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if not getattr(self, "_vllm_tap_loaded", False):
            self._vllm_tap_loaded = True
            self._vllm_tap = None
            self._vllm_tap = setup(self, v2=v2)  # start-up failures raise TapConfigError: they must
        return out

    cls.load_model = load_model


def pop_stage_aux(model, out) -> list[torch.Tensor]:
    """A non-last pipeline stage's aux outputs, taken out of its IntermediateTensors so they never
    travel to the next stage, in layer order."""
    prefix = getattr(model, "AUX_HIDDEN_STATE_KEY", "aux_hidden_states_")
    keys = sorted((k for k in out.tensors if k.startswith(prefix)), key=lambda k: int(k[len(prefix):]))
    return [out.tensors.pop(k) for k in keys]
