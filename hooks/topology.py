"""An engine's parallel layout as the tap sees it: which tp ranks of a stage write what it captures,
and where each ring's writer runs (vllm_tap/placement.py), from vLLM's own configuration: no
collective, nothing asked of the other ranks.

vLLM's multiprocessing executor runs an engine across nodes with `--nnodes`, `--node-rank` and
`--master-addr` (the other nodes `--headless`); node k holds the consecutive world ranks
[k × L, (k + 1) × L) of L = world size ÷ nodes, tp ranks innermost, and node 0, the engine's home,
holds world rank 0 and the engine core. Every tp rank holds the whole logits and hidden states, so
a stage whose tp group spans nodes writes from its ranks on the home alone and nothing captured
crosses between hosts; a stage with no rank on the home writes from all its ranks, on its own
host, as on one host.
"""

from __future__ import annotations

import socket

from vllm_tap.hooks.settings import instance_name
from vllm_tap.hooks.step_view import RankPlace
from vllm_tap.placement import Placement, settings_hash
from vllm_tap.spec import SERVER_CONFIG_KEY


def home_writers(tp_size: int, pp_size: int, local_world_size: int) -> tuple[tuple[int, ...], ...]:
    """The tp ranks of each stage that write, for an engine whose nodes hold `local_world_size`
    consecutive ranks each (vLLM's multiprocessing executor across nodes: node k holds ranks
    [k × L, (k + 1) × L), tp ranks innermost; the home, node 0, holds world rank 0). A stage with
    ranks on the home writes from those alone; any other stage from all its ranks."""
    out = []
    for s in range(pp_size):
        home = tuple(t for t in range(tp_size) if s * tp_size + t < local_world_size)
        out.append(home or tuple(range(tp_size)))
    return tuple(out)


def placement_of(cfg, vllm_config, place: RankPlace | None) -> Placement:
    """Where this process's ring is written from (vllm_tap/placement.py); `place` None: the engine
    core's ring."""
    pc = vllm_config.parallel_config
    try:
        from vllm.utils.network_utils import get_ip

        address = get_ip()
    except Exception:  # noqa: BLE001 - only a label: the host name still tells hosts apart
        address = ""

    def setting(name: str, default):
        value = getattr(pc, name, default)
        return default if value is None else value

    tp, pp = int(setting("tensor_parallel_size", 1)), int(setting("pipeline_parallel_size", 1))
    settings = (getattr(vllm_config, "additional_config", None) or {}).get(SERVER_CONFIG_KEY)
    common = dict(host=socket.gethostname()[:256], address=address[:256],
                  node_rank=int(setting("node_rank_within_dp", 0)), nnodes=int(setting("nnodes_within_dp", 1)),
                  instance=instance_name(cfg, vllm_config),
                  home=f"{setting('master_addr', '')}:{setting('master_port', 0)}"[:256], world_size=tp * pp,
                  dp_rank=int(setting("data_parallel_rank", 0)), dp_size=int(setting("data_parallel_size", 1)),
                  tp_size=tp, pp_size=pp, settings=settings_hash(settings))
    if place is None:
        return Placement(engine=True, **common)
    return Placement(tp_rank=place.tp_rank, pp_rank=place.pp_rank, stage_layers=[list(x) for x in place.stage_layers],
                     writers=list(place.stage_writers(place.pp_rank)), **common)
