"""Reducer files as their users write them (a probe's safetensors; SAELens's and sparsify's SAE
directories), and numpy float32 references of what a reducer outputs for given hidden-state rows.

The references compute each SAE the way its own library does (SAELens: (x - b_dec) @ W_enc + b_enc,
then relu / jumprelu / relu of the top k; sparsify: relu(encoder(x - b_dec)), top k), not the way
the server folds it, so a test comparing the two checks the folding too.
"""

from __future__ import annotations

import json
import os

import numpy as np

ACTS = {"relu": lambda h: np.maximum(h, 0), "tanh": np.tanh, "sigmoid": lambda h: 1 / (1 + np.exp(-h)),
        "silu": lambda h: h / (1 + np.exp(-h))}


def _save(path: str, tensors: dict) -> str:
    import torch
    from safetensors.torch import save_file

    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}, path)
    return path


def linear_probe(path: str, hidden: int, k: int, seed: int = 0, torch_layout: bool = False) -> dict:
    g = np.random.default_rng(seed)
    w = g.standard_normal((hidden, k)).astype(np.float32) / np.sqrt(hidden)
    b = g.standard_normal(k).astype(np.float32)
    _save(path, {"weight": w.T.copy(), "bias": b} if torch_layout else {"W": w, "b": b})
    return {"kind": "linear", "W": w, "b": b}


def mlp_probe(path: str, hidden: int, widths: tuple[int, ...], seed: int = 0, activation: str = "relu") -> dict:
    g = np.random.default_rng(seed)
    layers, tensors, d = [], {}, hidden
    for i, w_out in enumerate(widths, 1):
        w = g.standard_normal((d, w_out)).astype(np.float32) / np.sqrt(d)
        b = g.standard_normal(w_out).astype(np.float32) * 0.1
        tensors[f"W{i}"], tensors[f"b{i}"] = w, b
        layers.append((w, b))
        d = w_out
    _save(path, tensors)
    return {"kind": "mlp", "layers": layers, "activation": activation}


def saelens_sae(path: str, hidden: int, d_sae: int, architecture: str = "standard", seed: int = 0, k: int = 8,
                apply_b_dec_to_input: bool = True) -> dict:
    """A SAELens inference directory (cfg.json + sae_weights.safetensors) of random weights."""
    g = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    w_enc = g.standard_normal((hidden, d_sae)).astype(np.float32) / np.sqrt(hidden)
    t = {"W_enc": w_enc, "b_enc": (g.standard_normal(d_sae) * 0.5).astype(np.float32),
         "W_dec": g.standard_normal((d_sae, hidden)).astype(np.float32), "b_dec": (g.standard_normal(hidden) * 0.3).astype(np.float32)}
    cfg = {"architecture": architecture, "d_in": hidden, "d_sae": d_sae, "dtype": "float32", "device": "cpu",
           "apply_b_dec_to_input": apply_b_dec_to_input, "normalize_activations": "none",
           "reshape_activations": "none", "metadata": {"hook_name": "blocks.1.hook_resid_post"}}
    if architecture == "jumprelu":
        t["threshold"] = np.abs(g.standard_normal(d_sae) * 0.5).astype(np.float32)
    if architecture == "topk":
        cfg["k"] = k
        cfg["rescale_acts_by_decoder_norm"] = False
    _save(os.path.join(path, "sae_weights.safetensors"), t)
    with open(os.path.join(path, "cfg.json"), "w") as f:
        json.dump(cfg, f)
    return {"kind": "saelens", "cfg": cfg, **t}


def sparsify_sae(path: str, hidden: int, d_sae: int, k: int, seed: int = 0) -> dict:
    """An EleutherAI sparsify directory (cfg.json + sae.safetensors) of random weights."""
    g = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    t = {"encoder.weight": (g.standard_normal((d_sae, hidden)) / np.sqrt(hidden)).astype(np.float32),
         "encoder.bias": (g.standard_normal(d_sae) * 0.5).astype(np.float32),
         "W_dec": g.standard_normal((d_sae, hidden)).astype(np.float32),
         "b_dec": (g.standard_normal(hidden) * 0.3).astype(np.float32)}
    _save(os.path.join(path, "sae.safetensors"), t)
    with open(os.path.join(path, "cfg.json"), "w") as f:
        json.dump({"expansion_factor": d_sae // hidden, "normalize_decoder": True, "num_latents": d_sae, "k": k,
                   "multi_topk": False, "skip_connection": False, "transcode": False, "activation": "topk",
                   "d_in": hidden}, f)
    return {"kind": "sparsify", "k": k, **t}


def probe_scores(ref: dict, x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    if ref["kind"] == "linear":
        return x @ ref["W"] + ref["b"]
    h = x
    for i, (w, b) in enumerate(ref["layers"]):
        h = h @ w + b
        if i < len(ref["layers"]) - 1:
            h = ACTS[ref["activation"]](h)
    return h.astype(np.float32)


def sae_activations(ref: dict, x: np.ndarray) -> np.ndarray:
    """Every latent's activation [n, d_sae], as the SAE's library computes it."""
    x = x.astype(np.float32)
    if ref["kind"] == "sparsify":
        pre = np.maximum((x - ref["b_dec"]) @ ref["encoder.weight"].T + ref["encoder.bias"], 0)
        return _keep_top(pre, ref["k"])
    cfg = ref["cfg"]
    sae_in = x - ref["b_dec"] if cfg.get("apply_b_dec_to_input", True) else x
    pre = sae_in @ ref["W_enc"] + ref["b_enc"]
    if cfg["architecture"] == "jumprelu":
        return np.maximum(pre, 0) * (pre > ref["threshold"])
    if cfg["architecture"] == "topk":
        return _keep_top(np.maximum(pre, 0), cfg["k"])
    return np.maximum(pre, 0)


def _keep_top(acts: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(acts)
    idx = np.argsort(-acts, axis=1, kind="stable")[:, :k]
    np.put_along_axis(out, idx, np.take_along_axis(acts, idx, 1), 1)
    return out


def assert_latents_match(ids: np.ndarray, values: np.ndarray, acts: np.ndarray, k: int, threshold: float = 0.0,
                         atol: float = 1e-4) -> None:
    """ids/values [n, k] (a reducer's output) against every latent's activation `acts` [n, d_sae]:
    the same values, most active first; the same ids wherever the reference has no near tie; -1 and
    0 exactly in the slots whose latent is not above the threshold."""
    assert ids.shape == values.shape == (len(acts), k), (ids.shape, values.shape, acts.shape, k)
    order = np.argsort(-acts, axis=1, kind="stable")[:, :k]
    want = np.take_along_axis(acts, order, 1)
    active = want > threshold
    want_ids = np.where(active, order, -1)
    want = np.where(active, want, 0)
    np.testing.assert_allclose(values, want, rtol=0, atol=atol)
    for i in range(len(acts)):
        got_active = ids[i] >= 0
        # A latent within atol of the threshold may fall either side.
        near = np.abs(want[i] - threshold) <= atol
        assert ((got_active == active[i]) | near).all(), (i, ids[i], want_ids[i])
        for j in np.flatnonzero(got_active):
            assert abs(acts[i, ids[i, j]] - values[i, j]) <= atol, (i, j, ids[i, j])
            # Ids differ only where the reference's activations tie (within atol) with a neighbour.
            if ids[i, j] != want_ids[i, j]:
                assert np.isclose(acts[i, ids[i, j]], want[i, j], rtol=0, atol=atol), (i, j, ids[i], want_ids[i])
        assert (values[i][~got_active] == 0).all()
        assert len(set(ids[i][got_active].tolist())) == int(got_active.sum()), "each latent once"
