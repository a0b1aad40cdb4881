"""Reducers the operator declares in the tap's settings: what runs on a layer's rows inside the server
and what it writes instead of the rows themselves.

    "vllm_tap": {"reducers": {
        "toxicity": {"kind": "linear", "layer": 12, "path": "/srv/probes/toxicity.safetensors"},
        "topics":   {"kind": "mlp", "layer": 12, "path": "/srv/probes/topics.safetensors", "activation": "gelu"},
        "sae12":    {"kind": "saelens", "layer": 12, "path": "/srv/saes/layer12", "k": 64},
        "sae12all": {"kind": "saelens", "layer": 12, "path": "/srv/saes/layer12", "threshold": 0.0, "k": 256},
        "eleuther": {"kind": "sparsify", "layer": 12, "path": "/srv/saes/layers.11"}
    }}

A probe (linear, mlp) writes its scores, float32 [k] per token. An SAE encoder (saelens, sparsify)
writes its most active latents per token: `k` slots of (int32 id, float32 activation), most active
first; a slot whose latent is not active (its activation at or below `threshold`, 0 by default) holds
id -1 and value 0. So "the top 64 latents" is `k: 64`, and "every latent above 0.5, at most 256 of
them" is `threshold: 0.5, k: 256`: the output has a fixed size either way, which the server writes
without waiting for the device.

This module only reads the settings (names, kinds, layers, paths, options); the weight files are read
and checked against the model by the plugin (hooks/reducer_files.py), at start-up. A request names
the reducers it wants (`tap_reducers`), and its spec keeps them sorted: reducer i of a capture's
spec is the one whose output travels as that capture's tensors of index i (ring_format.TensorKind).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from vllm_tap.windows import shown

KINDS = {
    "linear": "a linear probe: safetensors with W [hidden, k] and b [k] (or torch's weight [k, hidden], bias [k])",
    "mlp": "an MLP probe: safetensors with W1 [hidden, d1], b1, W2 [d1, d2], b2, ... (the last layer's width is k)",
    "saelens": "a SAELens SAE directory: cfg.json and sae_weights.safetensors (standard, jumprelu or topk)",
    "sparsify": "an EleutherAI sparsify SAE directory: cfg.json and sae.safetensors (top-k activation)",
}
PROBE_KINDS = ("linear", "mlp")
SAE_KINDS = ("saelens", "sparsify")
ACTIVATIONS = ("relu", "gelu", "tanh", "silu", "sigmoid")  # between an MLP probe's layers
MAX_REDUCERS = 32  # declared by one server; a capture's records carry each one's tensors
MAX_NAME_CHARS = 64
MAX_K = 1024  # latents (or probe scores) per token
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_COMMON = ("kind", "layer", "path")
_OPTIONS = {"linear": (), "mlp": ("activation",), "saelens": ("k", "threshold"), "sparsify": ("k", "threshold")}


class ReducerSettingError(ValueError):
    """A reducer setting is invalid; the message starts with the setting's key."""


@dataclass(frozen=True)
class ReducerDecl:
    """One declared reducer, as the settings give it (files not read yet)."""

    name: str
    kind: str
    layer: int
    path: str
    k: int = 0  # SAEs: latents per token (0: the SAE's own k, for top-k SAEs)
    threshold: float = 0.0  # SAEs: a latent is reported when its activation is above it
    activation: str = "relu"  # MLP probes

    @property
    def writes_latents(self) -> bool:
        return self.kind in SAE_KINDS


def check_name(name: Any) -> bool:
    return isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS and bool(_NAME.match(name))


def parse_reducers(raw: Any, where: str, num_layers: int | None) -> tuple[ReducerDecl, ...]:
    """The declarations of `raw` (the settings' "reducers" object), by name; ReducerSettingError
    naming the key (`where`.name.setting) otherwise."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise ReducerSettingError(f"{where}: expected an object of reducers by name, got {shown(raw)}")
    if len(raw) > MAX_REDUCERS:
        raise ReducerSettingError(f"{where}: {len(raw)} reducers; at most {MAX_REDUCERS}")
    out = []
    for name, body in raw.items():
        if not check_name(name):
            raise ReducerSettingError(f"{where}: reducer name {shown(name)}: use 1-{MAX_NAME_CHARS} characters from "
                                      "A-Z a-z 0-9 _ - (not starting with _ or -)")
        out.append(_parse_one(name, body, f"{where}.{name}", num_layers))
    return tuple(out)


def _parse_one(name: str, body: Any, where: str, num_layers: int | None) -> ReducerDecl:
    if not isinstance(body, Mapping):
        raise ReducerSettingError(f"{where}: expected an object (kind, layer, path, ...), got {shown(body)}")
    kind = body.get("kind")
    if kind not in KINDS:
        raise ReducerSettingError(f"{where}.kind: got {shown(kind)}; allowed: {', '.join(repr(k) for k in KINDS)}")
    known = _COMMON + _OPTIONS[kind]
    unknown = sorted((k for k in body if k not in known), key=str)
    if unknown:
        raise ReducerSettingError(f"{where}: unknown setting {shown(unknown[0])} for kind {kind!r}; "
                                  f"allowed: {', '.join(known)}")
    layer = body.get("layer")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0 or (
            num_layers is not None and layer > num_layers):
        hi = f"0..{num_layers}" if num_layers is not None else ">= 0"
        raise ReducerSettingError(f"{where}.layer: got {shown(layer)}; expected a layer of the model, {hi} "
                                  "(0 = embeddings, i = output of decoder layer i)")
    path = body.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ReducerSettingError(f"{where}.path: expected an absolute path, got {shown(path)}")
    k = body.get("k", 0)
    if "k" in body and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K):
        raise ReducerSettingError(f"{where}.k: expected latents per token, 1..{MAX_K}, got {shown(k)}")
    threshold = body.get("threshold", 0.0)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) \
            or threshold < 0:
        raise ReducerSettingError(f"{where}.threshold: expected an activation >= 0, got {shown(threshold)}")
    activation = body.get("activation", "relu")
    if activation not in ACTIVATIONS:
        raise ReducerSettingError(f"{where}.activation: got {shown(activation)}; allowed: "
                                  f"{', '.join(repr(a) for a in ACTIVATIONS)}")
    return ReducerDecl(name, kind, layer, path, k, float(threshold), activation)
