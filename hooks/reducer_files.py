"""Reading a reducer's weights from the files its users already have, checked against the model.

    kind      files                                   what is read
    linear    one .safetensors                        W [H, k], b [k]   (or torch's weight [k, H], bias [k])
    mlp       one .safetensors                        W1 [H, d1], b1 [d1], W2 [d1, d2], b2, ... Wn [., k], bn
    saelens   DIR/cfg.json, DIR/sae_weights.safetensors   W_enc [H, d_sae], b_enc, b_dec [H]; threshold
                                                      (jumprelu; log_threshold in older files); W_dec for a
                                                      top-k SAE that rescales by the decoder's norms
    sparsify  DIR/cfg.json, DIR/sae.safetensors       encoder.weight [d_sae, H], encoder.bias, b_dec [H]

Every SAE here encodes as one affine map and a selection, which is what the server runs:

    pre  = x @ W + c        W = W_enc [H, d_sae]; c = b_enc - b_dec @ W_enc when the SAE subtracts b_dec
                            from its input (SAELens's apply_b_dec_to_input; sparsify unless it transcodes)
    acts = relu(pre)                      standard;  top-k (SAELens topk, sparsify): relu of the k largest
         = relu(pre) * (pre > threshold)  jumprelu
    out  = the `k` largest acts, most active first; those not above the reducer's threshold (>= 0) -> id -1

so the k largest of `pre` (of `pre * (pre > threshold)` for jumprelu) are the k largest activations,
and a top-k SAE's own k bounds the reducer's. A top-k SAE that rescales its pre-activations by its
decoder's row norms has them folded into W and c here. Input normalisations that depend on each row
(SAELens's layer_norm, constant_norm_rescale, covariance_whitening, hook_z reshaping) and other
architectures are refused at start-up.

Every failure is a TapConfigError of one line that names the setting (vllm_tap.reducers.NAME.path)
and says what is wrong. `describe` checks shapes only (the API process, before any engine starts:
safetensors headers, no tensor data); `load` reads the tensors too (each worker that runs it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from vllm_tap.hooks.settings import TapConfigError
from vllm_tap.reducers import MAX_K, ReducerDecl
from vllm_tap.spec import SERVER_CONFIG_KEY

SAELENS_CFG, SAELENS_WEIGHTS = "cfg.json", "sae_weights.safetensors"
SPARSIFY_CFG, SPARSIFY_WEIGHTS = "cfg.json", "sae.safetensors"
SAELENS_ARCHITECTURES = ("standard", "jumprelu", "topk")
# Normalisations that leave the encoder's input as it is at inference (SAELens folds or ignores them).
SAELENS_PLAIN_NORMS = ("none", "expected_average_only_in")
MAX_CFG_BYTES = 1 << 20


@dataclass
class ReducerWeights:
    """A reducer's math as the device runs it (tensors on the CPU in float32 until placed)."""

    decl: ReducerDecl
    width: int  # k: probe scores, or latent slots per token
    layers: list = field(default_factory=list)  # probes: [(W [in, out], b [out])]; SAEs: [(W [H, d_sae], c)]
    threshold: Any = None  # jumprelu: [d_sae] per-latent thresholds
    d_sae: int = 0  # SAEs: latents

    @property
    def name(self) -> str:
        return self.decl.name


class _Refused(Exception):
    """What is wrong, to be prefixed by the setting's key."""


def _key(decl: ReducerDecl, setting: str = "path") -> str:
    return f"{SERVER_CONFIG_KEY}.reducers.{decl.name}.{setting}"


class _Tensors:
    """A safetensors file: its tensors' shapes (header only) and, when loading, their values in float32."""

    def __init__(self, path: str, load: bool):
        from safetensors import safe_open

        if not os.path.isfile(path):
            raise _Refused(f"{path}: no such file")
        try:
            with safe_open(path, framework="pt") as f:
                self.shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
                self.values = {k: f.get_tensor(k).float() for k in f.keys()} if load else {}
        except _Refused:
            raise
        except Exception as e:  # noqa: BLE001 - whatever safetensors says of a file that is not one
            raise _Refused(f"{path}: not a readable safetensors file ({str(e).splitlines()[0][:200]})") from None
        self.path = path

    def need(self, name: str, shape: tuple) -> Any:
        """The tensor `name`, of `shape` (None: any extent there); its value when loading."""
        got = self.shapes.get(name)
        if got is None:
            raise _Refused(f"{self.path}: no tensor {name!r} (it has {', '.join(sorted(self.shapes)[:8]) or 'none'})")
        if len(got) != len(shape) or any(want is not None and g != want for g, want in zip(got, shape)):
            raise _Refused(f"{self.path}: {name} has shape {list(got)}, expected {_shown(shape)}")
        return self.values.get(name)

    def finite(self, *tensors) -> None:
        import torch

        for t in tensors:
            if t is not None and not bool(torch.isfinite(t).all()):
                raise _Refused(f"{self.path}: holds NaN or infinite weights")


def _shown(shape: tuple) -> str:
    return "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"


def _cfg(path: str) -> dict:
    if not os.path.isfile(path):
        raise _Refused(f"{path}: no such file")
    if os.path.getsize(path) > MAX_CFG_BYTES:
        raise _Refused(f"{path}: larger than {MAX_CFG_BYTES} bytes")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise _Refused(f"{path}: not a JSON object ({str(e)[:200]})") from None
    if not isinstance(cfg, dict):
        raise _Refused(f"{path}: not a JSON object")
    return cfg


def _int(cfg: dict, key: str, path: str, default: Any = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _Refused(f"{path}: {key} is {v!r}, expected a positive integer")
    return v


def describe(decl: ReducerDecl, hidden_size: int) -> ReducerWeights:
    """The reducer's shapes, checked against the model (no tensor data read). TapConfigError."""
    return _read(decl, hidden_size, load=False)


def load(decl: ReducerDecl, hidden_size: int) -> ReducerWeights:
    """The reducer's weights in float32 on the CPU, checked and folded. TapConfigError."""
    return _read(decl, hidden_size, load=True)


def _read(decl: ReducerDecl, hidden_size: int, load: bool) -> ReducerWeights:
    try:
        if decl.kind == "linear":
            return _linear(decl, hidden_size, load)
        if decl.kind == "mlp":
            return _mlp(decl, hidden_size, load)
        if decl.kind == "saelens":
            return _saelens(decl, hidden_size, load)
        if decl.kind == "sparsify":
            return _sparsify(decl, hidden_size, load)
        raise _Refused(f"unknown kind {decl.kind!r}")
    except _Refused as e:
        raise TapConfigError(f"vllm-tap: {_key(decl)}: {e}".replace("\n", " ")) from None
    except OSError as e:
        raise TapConfigError(f"vllm-tap: {_key(decl)}: {e}".replace("\n", " ")) from None


def _linear(decl: ReducerDecl, hidden: int, load: bool) -> ReducerWeights:
    f = _Tensors(decl.path, load)
    if "W" in f.shapes or "weight" not in f.shapes:
        shape = f.shapes.get("W", ())
        k = shape[1] if len(shape) == 2 else 0
        w = f.need("W", (hidden, None))
        b = f.need("b", (k,)) if "b" in f.shapes else None
    else:  # torch.nn.Linear's state dict: weight [k, H]
        shape = f.shapes["weight"]
        k = shape[0] if len(shape) == 2 else 0
        w = f.need("weight", (None, hidden))
        b = f.need("bias", (k,)) if "bias" in f.shapes else None
        w = w.t().contiguous() if w is not None else None
    _check_width(f.path, k)
    f.finite(w, b)
    if load and b is None:
        import torch

        b = torch.zeros(k)
    return ReducerWeights(decl, k, [(w, b)] if load else [])


def _mlp(decl: ReducerDecl, hidden: int, load: bool) -> ReducerWeights:
    f = _Tensors(decl.path, load)
    n = 0
    while f"W{n + 1}" in f.shapes:
        n += 1
    if n < 1:
        raise _Refused(f"{f.path}: no tensor 'W1' (an MLP probe's layers are W1, b1, W2, b2, ...)")
    extra = sorted(set(f.shapes) - {f"{p}{i}" for p in "Wb" for i in range(1, n + 1)})
    if extra:
        raise _Refused(f"{f.path}: unexpected tensor {extra[0]!r} (an MLP probe's layers are W1, b1, ... W{n}, b{n})")
    layers, width = [], hidden
    for i in range(1, n + 1):
        shape = f.shapes[f"W{i}"]
        out = shape[1] if len(shape) == 2 else 0
        w = f.need(f"W{i}", (width, None))
        b = f.need(f"b{i}", (out,))
        f.finite(w, b)
        layers.append((w, b))
        width = out
    _check_width(f.path, width)
    return ReducerWeights(decl, width, layers if load else [])


def _check_width(path: str, k: int) -> None:
    if not 1 <= k <= MAX_K:
        raise _Refused(f"{path}: {k} outputs; a probe writes 1..{MAX_K} scores per token")


def _latents(decl: ReducerDecl, path: str, d_sae: int, own_k: int | None) -> int:
    """The reducer's latent slots per token: its `k`, bounded by the SAE's own k (top-k SAEs)."""
    k = decl.k or own_k
    if not k:
        raise _Refused(f"{path}: the SAE activates any number of latents; set {_key(decl, 'k')} (latents per token)")
    if k > d_sae:
        raise _Refused(f"{path}: k {k} is more than the SAE's {d_sae} latents")
    if own_k is not None and k > own_k:
        raise _Refused(f"{path}: k {k} is more than the {own_k} latents this top-k SAE activates")
    if k > MAX_K:
        raise _Refused(f"{path}: the SAE activates {k} latents per token; set {_key(decl, 'k')} (at most {MAX_K})")
    return k


def _saelens(decl: ReducerDecl, hidden: int, load: bool) -> ReducerWeights:
    cfg_path = os.path.join(decl.path, SAELENS_CFG)
    if not os.path.isdir(decl.path):
        raise _Refused(f"{decl.path}: no such directory (a SAELens SAE is a directory with {SAELENS_CFG} and "
                       f"{SAELENS_WEIGHTS})")
    cfg = _cfg(cfg_path)
    arch = cfg.get("architecture", "standard")
    if arch not in SAELENS_ARCHITECTURES:
        raise _Refused(f"{cfg_path}: architecture {arch!r} is not supported (supported: "
                       f"{', '.join(SAELENS_ARCHITECTURES)})")
    d_in, d_sae = _int(cfg, "d_in", cfg_path), _int(cfg, "d_sae", cfg_path)
    if d_in != hidden:
        raise _Refused(f"{cfg_path}: d_in {d_in} does not match the model's hidden size {hidden}")
    norm = cfg.get("normalize_activations", "none")
    if norm not in SAELENS_PLAIN_NORMS:
        raise _Refused(f"{cfg_path}: normalize_activations {norm!r} is not supported (supported: "
                       f"{', '.join(SAELENS_PLAIN_NORMS)})")
    if cfg.get("reshape_activations", "none") not in ("none", None):
        raise _Refused(f"{cfg_path}: reshape_activations {cfg.get('reshape_activations')!r} is not supported")
    own_k = _int(cfg, "k", cfg_path, 100) if arch == "topk" else None  # SAELens's TopKSAEConfig default
    k = _latents(decl, cfg_path, d_sae, own_k)
    f = _Tensors(os.path.join(decl.path, SAELENS_WEIGHTS), load)
    w = f.need("W_enc", (hidden, d_sae))
    b_enc = f.need("b_enc", (d_sae,))
    b_dec = f.need("b_dec", (hidden,))
    threshold = None
    if arch == "jumprelu":
        if "threshold" in f.shapes:
            threshold = f.need("threshold", (d_sae,))
        else:
            threshold = f.need("log_threshold", (d_sae,))
            threshold = threshold.exp() if threshold is not None else None
    rescale = arch == "topk" and bool(cfg.get("rescale_acts_by_decoder_norm", False))
    w_dec = f.need("W_dec", (d_sae, hidden)) if rescale else None
    f.finite(w, b_enc, b_dec, threshold, w_dec)
    out = ReducerWeights(decl, k, d_sae=d_sae)
    if load:
        c = b_enc - b_dec @ w if cfg.get("apply_b_dec_to_input", True) else b_enc.clone()
        if rescale:  # pre * |W_dec row|: a positive scale per latent, folded into the affine map
            norms = w_dec.norm(dim=-1).clamp(min=1e-8)
            w, c = w * norms, c * norms
        out.layers = [(w.contiguous(), c.contiguous())]
        out.threshold = threshold
    return out


def _sparsify(decl: ReducerDecl, hidden: int, load: bool) -> ReducerWeights:
    cfg_path = os.path.join(decl.path, SPARSIFY_CFG)
    if not os.path.isdir(decl.path):
        raise _Refused(f"{decl.path}: no such directory (a sparsify SAE is a directory with {SPARSIFY_CFG} and "
                       f"{SPARSIFY_WEIGHTS})")
    cfg = _cfg(cfg_path)
    d_in = _int(cfg, "d_in", cfg_path)
    if d_in != hidden:
        raise _Refused(f"{cfg_path}: d_in {d_in} does not match the model's hidden size {hidden}")
    if cfg.get("activation", "topk") != "topk":
        raise _Refused(f"{cfg_path}: activation {cfg.get('activation')!r} is not supported (only 'topk')")
    own_k = _int(cfg, "k", cfg_path)
    f = _Tensors(os.path.join(decl.path, SPARSIFY_WEIGHTS), load)
    shape = f.shapes.get("encoder.weight", ())
    d_sae = shape[0] if len(shape) == 2 else 0
    w = f.need("encoder.weight", (None, hidden))
    b_enc = f.need("encoder.bias", (d_sae,))
    b_dec = f.need("b_dec", (hidden,))
    k = _latents(decl, cfg_path, d_sae, own_k)
    f.finite(w, b_enc, b_dec)
    out = ReducerWeights(decl, k, d_sae=d_sae)
    if load:
        w = w.t().contiguous()
        c = b_enc.clone() if cfg.get("transcode", False) else b_enc - b_dec @ w
        out.layers = [(w, c.contiguous())]
    return out


def check_all(decls, hidden_size: int) -> list[ReducerWeights]:
    """Every declared reducer described (shapes checked), in order. TapConfigError on the first bad one."""
    return [describe(d, hidden_size) for d in decls]
