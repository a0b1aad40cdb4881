"""Deterministic captures for the dataset tests: capture `seq` is a function of seq alone, so a
test can re-create what any recorder run should have written (values, positions, gaps)."""

from __future__ import annotations

import numpy as np

from vllm_tap.client.records import Capture, CaptureBegin

HIDDEN = 16
VOCAB = 48
LAYERS = (0, 2)


def make_capture(seq: int, *, layers=LAYERS, hidden: int = HIDDEN, vocab: int = VOCAB, logits: str = "full",
                 topk: int = 5, n_prompt: int | None = None, n_out: int | None = None, missing=(),
                 dtype=np.float32, model: str = "tiny", source: str = "policy",
                 logsumexp: bool = False) -> tuple[CaptureBegin, Capture]:
    rng = np.random.default_rng(1000 + seq)
    P = n_prompt if n_prompt is not None else int(rng.integers(3, 12))
    G = n_out if n_out is not None else int(rng.integers(1, 8))
    prompt = [int(t) for t in rng.integers(0, vocab, P)]
    out = [int(t) for t in rng.integers(0, vocab, G)]
    full = prompt + out
    computed = P + G - 1
    positions = np.array([p for p in range(computed) if p not in set(missing)], np.int32)
    T = len(positions)
    hid = {l: rng.standard_normal((T, hidden)).astype(dtype) for l in layers}
    lg = rng.standard_normal((T, vocab)).astype(dtype) * 3
    kw = {}
    spec = {"logits": logits, "layers": list(layers), "positions": "all", "dtype": "auto", "key": f"k{seq}",
            "source": source, "topk": 0, "indices": []}
    if logits == "full":
        kw["logits"] = lg
    elif logits == "topk":
        ids = np.argsort(-lg, axis=1)[:, :topk].astype(np.int32)
        kw["topk_ids"] = ids
        kw["topk_values"] = np.take_along_axis(lg, ids, 1)
        spec["topk"] = topk
    rid = f"req-{seq}"
    begin = CaptureBegin(rid, "default", f"k{seq}", (rid,), f"cmpl-{seq}", 0, P, prompt, 1, model, spec, 0, False, source)
    cap = Capture(rid, "default", f"cmpl-{seq}", 0, P, prompt, positions, np.array([full[p] for p in positions], np.int32),
                  kw.get("logits"), hid, kw.get("topk_ids"), kw.get("topk_values"), None, "length", G, out,
                  sorted(set(missing)), (0, computed), source)
    if logsumexp and logits != "full":  # what the hook sends beside top-k and chosen logits
        lg64 = lg.astype(np.float64)
        m = lg64.max(1)
        cap.logsumexp = (m + np.log(np.exp(lg64 - m[:, None]).sum(1))).astype(np.float32)
    return begin, cap
