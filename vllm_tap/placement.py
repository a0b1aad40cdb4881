"""Where a ring's writer runs: its host, its engine, and its place in the engine's parallel layout.

An engine may span hosts (vLLM's `--nnodes`, `--node-rank`, `--master-addr`): its ranks' rings then
lie in different hosts' shared memory, read by different daemons. Each ring says where its writer
runs, in its header (ring format 7, ring_format.PLACEMENT_OFFSET):

    PLACEMENT_OFFSET:      u32 length (0: none) | msgpack of `Placement` (length bytes, ≤ PLACEMENT_MAX)

so a daemon can tell one engine's ranks on several hosts apart, find the engine's home (the host of
world rank 0, whose address every worker knows as the master address), see which ranks of the
engine have not reported, and whether a host runs the tap with other settings than the home.

`Placement` is written and read through the same msgspec Struct; a reader decodes it against the
Struct's types and bounds (a ring file is untrusted bytes) and refuses the ring when it does not.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

import msgspec

PLACEMENT_VERSION = 1

_Name = Annotated[str, msgspec.Meta(max_length=256)]
_Count = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_Index = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_Layer = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_Layers = Annotated[list[_Layer], msgspec.Meta(max_length=4096)]

# Settings that may differ between hosts of one engine without changing what is captured: the ring
# size (each host's API process, if any, sizes its own rings).
PER_HOST_SETTINGS = ("ring_bytes",)


class Placement(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """One ring's writer. A model rank has its parallel place; the engine core's ring (rank -1) has
    tp/pp of the engine and rank fields 0."""

    version: _Index = PLACEMENT_VERSION
    host: _Name  # the host's name
    address: _Name  # the address vLLM uses for this host (VLLM_HOST_IP or its own lookup)
    node_rank: _Index = 0  # the node within the engine (0: the home)
    nnodes: _Count = 1
    instance: _Name  # the instance directory's name (one engine, one data-parallel replica)
    home: _Name  # the engine's master address, host:port: where world rank 0 runs
    world_size: _Count = 1  # model ranks of the engine (tensor × pipeline)
    dp_rank: _Index = 0
    dp_size: _Count = 1
    tp_rank: _Index = 0
    tp_size: _Count = 1
    pp_rank: _Index = 0
    pp_size: _Count = 1
    stage_layers: Annotated[list[_Layers], msgspec.Meta(max_length=4096)] = []  # captured layers of each stage
    writers: Annotated[list[_Index], msgspec.Meta(max_length=65535)] = []  # tp ranks of this stage that write
    settings: Annotated[str, msgspec.Meta(max_length=64)] = ""  # settings_hash() of the tap settings
    engine: bool = False  # the engine core's ring (BEGIN/END/LIVE), not a model rank's


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Placement)


def encode(p: Placement) -> bytes:
    return _ENCODER.encode(p)


def decode(raw: bytes) -> Placement:
    """A placement from a ring header; msgspec.ValidationError / DecodeError when the bytes are not one."""
    return _DECODER.decode(raw)


def settings_hash(settings: Any) -> str:
    """A short hash of the tap settings as the operator gave them (`--additional-config`'s object),
    without those that may differ per host: equal on every host of an engine that runs the tap alike."""
    if isinstance(settings, dict):
        settings = {k: v for k, v in settings.items() if k not in PER_HOST_SETTINGS}
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
