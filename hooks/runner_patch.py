"""Model-runner side, common to both runners: set the tap up once the model is loaded.

Hidden states come from the auxiliary hidden-state outputs vLLM built for EAGLE-3: the model
returns the residual stream after the chosen layers as extra outputs of its (compiled, possibly
CUDA-graphed) forward. Enabling them right after load_model, before compilation, memory profiling
and graph capture, makes them ordinary graph outputs, so capture needs no eager mode and no forward
hooks. The V1 and V2 runners both read `use_aux_hidden_state_outputs` after load_model (V1 at
execute time, V2 when it captures graphs and at execute time), and neither uses the aux outputs for
anything else when there is no speculator (which the tap refuses).

The layers made aux outputs are those requests may capture and those the declared reducers read.
Tensor-parallel rank 0 of the stage holding a reducer's layer loads it (hidden states are replicated
across the ranks of a stage, so one rank's rows are everyone's) here too, inside load_model, like
the staging buffer: vLLM profiles the device's memory after load_model returns, so what is
allocated here is counted as taken before it sizes the KV cache (hooks/reducer_ops.py).

The per-runner parts (which methods are wrapped, how a step's view is built) are in runner_v1.py
and runner_v2.py; the capture itself is the runner-neutral hooks/capture_core.py.
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm_tap.placement import encode as encode_placement
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_writer import RingWriter
from vllm_tap.spec import SERVER_CONFIG_KEY

from . import support
from .capture_core import CaptureCore, RankPlace
from .publisher import make_publisher
from .reducer_ops import DeviceReducer
from .settings import TapConfigError, instance_name, server_config
from .topology import home_writers, placement_of

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
    pc = vllm_config.parallel_config
    nodes = int(getattr(pc, "nnodes_within_dp", 1) or 1)
    writers = None
    if nodes > 1:  # an engine across hosts
        writers = home_writers(tp.world_size, pp.world_size, (tp.world_size * pp.world_size) // nodes)
    return RankPlace(tp.rank_in_group, tp.world_size, pp.rank_in_group,
                     tuple(stage_layers(layers, n_layers, s, pp.world_size) for s in range(pp.world_size)), writers)


def open_ring(cfg, vllm_config, place: RankPlace) -> RingWriter:
    """This rank's ring; any failure to make it (no room in /dev/shm, permissions) stops start-up."""
    path = ring_path(cfg.shm_dir, instance_name(cfg, vllm_config), place.rank)
    try:
        return RingWriter(path, cfg.ring_bytes, rank=place.rank, world_size=place.world_size,
                          mode=0o660 if cfg.group else 0o600, group=cfg.group, block_timeout=cfg.block_timeout_s,
                          placement=encode_placement(placement_of(cfg, vllm_config, place)))
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
    aux_layers = cfg.aux_layers
    bad = support.unsupported_features(vc, aux_layers, support.vllm_version())
    if v2 and getattr(runner, "batch_sharder", None) is not None:
        bad.append("batch-sharded sampling")
    if v2 and getattr(runner, "pcp_manager", None) is not None:
        bad.append("prefill context parallelism")
    if bad:
        raise TapConfigError(f"vllm-tap: not supported with the tap enabled ({'V2' if v2 else 'V1'} model "
                             f"runner): {bad[0]}")
    model = runner.get_model()
    if aux_layers:
        from vllm.model_executor.models.interfaces import supports_eagle3

        if not supports_eagle3(model):
            raise TapConfigError(
                f"vllm-tap: {type(model).__name__} has no auxiliary hidden-state outputs (the EAGLE-3 "
                "interface), so its hidden states cannot be captured or reduced; set \"layers\": \"none\" and "
                "declare no reducers for logits only"
            )
    place = rank_place(aux_layers, vc)
    device = torch.device(runner.device)
    reducers = load_reducers(cfg, vc, place, device)
    writer = open_ring(cfg, vc, place)
    try:
        publisher = make_publisher(writer, device, cfg.ring_bytes)
    except Exception as e:  # noqa: BLE001
        writer.close(unlink=True)
        raise TapConfigError(f"vllm-tap: cannot set up copies into the ring: {e}".replace("\n", " ")) from None
    core = CaptureCore(writer, place, publisher, model_dtype=getattr(vc.model_config, "dtype", None), device=device,
                       shed_at=cfg.shed_at, reducers=reducers,
                       reducer_layers={r.name: r.layer for r in cfg.reducers})
    if aux_layers:
        # Each pipeline stage emits only the layers it computes. The runner unpacks aux outputs on
        # the last stage once the flag is set; earlier stages return theirs inside
        # IntermediateTensors, where the execute_model wrapper takes them out.
        model.set_aux_hidden_state_layers(place.layers)
        runner.use_aux_hidden_state_outputs = place.is_last_stage and bool(place.layers)
    log.info("vllm-tap ring %s of %d MiB (tp rank %d/%d, pp stage %d/%d, %s, %s runner; new captures shed while "
             "over %.0f%% unread)", writer.path, writer.capacity >> 20, place.tp_rank, place.tp_size, place.pp_rank,
             place.pp_size, f"writes share {place.share + 1} of {place.shares}" if place.share is not None
             else "writes nothing: its stage's ranks on the engine's home host do", "V2" if v2 else "V1",
             100 * cfg.shed_at)
    return core


def load_reducers(cfg, vllm_config, place: RankPlace, device: torch.device) -> dict[str, DeviceReducer]:
    """The reducers this rank runs, on its device: those whose layer its stage computes, on its
    stage's first writer (tensor-parallel rank 0, on the engine's home host when the stage spans
    hosts). Start-up stops (TapConfigError, one line) on a file that cannot be used."""
    if not cfg.reducers or place.share != 0:
        return {}
    from vllm_tap.hooks import reducer_files

    hidden = int(vllm_config.model_config.get_hidden_size())
    rows = int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 8192)
    out = {}
    for decl in cfg.reducers:
        if decl.layer not in place.layers:
            continue
        weights = reducer_files.load(decl, hidden)
        try:
            red = out[decl.name] = DeviceReducer(weights, device, rows)
        except Exception as e:  # noqa: BLE001 - out of device memory, say: a start-up failure, in one line
            raise TapConfigError(f"vllm-tap: {SERVER_CONFIG_KEY}.reducers.{decl.name}: cannot place it on {device}: "
                                 f"{e}".replace("\n", " ")) from None
        log.info("vllm-tap: reducer %r (%s, layer %d, %d %s per token) on %s: %.1f MiB of weights and buffers, "
                 "passes of up to %d rows", decl.name, decl.kind, decl.layer, red.width,
                 "latents" if red.latents else "scores", device, red.nbytes / (1 << 20), red.rows)
    return out


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
