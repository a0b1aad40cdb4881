"""Run on one of TwoHosts' hosts: what its rings hold, and, given a server and a daemon, the
captures of completions sent through them checked against the server's own logprobs. Prints JSON.

    python across_hosts_probe.py rings SHM_DIR
    python across_hosts_probe.py capture BASE_URL MODEL ENDPOINT N
"""

from __future__ import annotations

import glob
import json
import os
import sys
import urllib.request

import msgspec
import numpy as np

from reference import log_softmax
from vllm_tap.tools.tiny_model import prompt_text
from vllm_tap.ring_reader import RingReader


def rings(shm: str) -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(shm, "*", "*.ring"))):
        r = RingReader(path, writable=False)
        try:
            info = r.info()
            out[os.path.basename(path)] = {"records_written": info.stats["records_written"],
                                           "placement": msgspec.to_builtins(info.placement)}
        finally:
            r.close()
    return out


def capture(base_url: str, model: str, endpoint: str, n: int) -> dict:
    from vllm_tap.client import Client

    out = {"requests": []}
    with Client(endpoint) as client:
        for i in range(n):
            ids = [(i * 13 + 5 * j) % 90 + 3 for j in range(6 + 3 * i)]
            prompt = prompt_text(ids)
            body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                    "logprobs": 5, "vllm_xargs": {"tap": 1}}
            req = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as resp:
                r = json.loads(resp.read())
            cap = client.fetch(r["id"], timeout=60)
            lp = r["choices"][0]["logprobs"]
            gen = [int(t.strip()[1:]) for t in lp["tokens"]]
            n_prompt = len(ids)
            lsm = log_softmax(cap.logits)
            err = 0.0
            for k, tok in enumerate(gen):
                err = max(err, abs(lsm[n_prompt - 1 + k, tok] - lp["token_logprobs"][k]))
                for word, v in lp["top_logprobs"][k].items():
                    err = max(err, abs(lsm[n_prompt - 1 + k, int(word.strip()[1:])] - v))
            out["requests"].append({
                "id": r["id"], "complete": bool(cap.complete), "positions": len(cap.positions),
                "expected": n_prompt + len(gen) - 1, "missing": len(cap.missing_positions),
                "output_ids_equal": list(cap.output_token_ids) == gen, "max_logprob_error": float(err),
                "layers": sorted(int(x) for x in cap.hidden), "token_ids": [int(t) for t in cap.token_ids],
                "prompt_ids": ids,
                "logits": np.asarray(cap.logits, np.float32).tolist(),
                "hidden": {str(k): np.asarray(v, np.float32).tolist() for k, v in cap.hidden.items()},
            })
    return out


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    print(json.dumps(rings(*args) if what == "rings" else capture(args[0], args[1], args[2], int(args[3]))))
