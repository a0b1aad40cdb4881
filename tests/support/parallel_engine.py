"""Test helper: run offline vLLM with the tap at a given tensor/pipeline-parallel size.

    python parallel_engine.py MODEL SHM INSTANCE --tp 2 [--pp 1] [--eager] [--reducers JSON]

Generates greedily for the PROMPTS below with tap_key "<INSTANCE>-<i>" (full logits, every layer, and
every reducer of --reducers, the settings' "reducers" object), and for POLICY_PROMPTS with no
tap option at all (the server's capture policy, POLICY, picks half of them by their request ids
"3" … "10"), and prints one JSON line with each request's id, prompt and output token ids. Run as its own process: one vLLM engine per
parallel layout, and the distributed environment does not survive being torn down in-process.
"""

from __future__ import annotations

import argparse
import json
import os

PROMPTS = [[(13 * i + 5 * k) % 500 + 3 for k in range(n)] for i, n in enumerate((6, 45, 19))]
POLICY_PROMPTS = [[(17 * i + 3 * k) % 500 + 3 for k in range(5 + 3 * i)] for i in range(8)]
POLICY = {"share": 0.5, "positions": "output", "layers": [1, 4]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("shm")
    ap.add_argument("instance")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--reducers", default=None)
    a = ap.parse_args()
    reducers = json.loads(a.reducers) if a.reducers else {}
    if a.tp * a.pp > 1:  # two ranks on this 2-core machine (see the shared notes)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM, SamplingParams

    from vllm_tap.tools.tiny_model import prompt_text

    llm = LLM(
        a.model, dtype="float32", tensor_parallel_size=a.tp, pipeline_parallel_size=a.pp, enforce_eager=a.eager,
        gpu_memory_utilization=0.1, max_model_len=512, max_num_batched_tokens=32, block_size=32,
        additional_config={"vllm_tap": {"shm_dir": a.shm, "instance": a.instance, "ring_bytes": 16 << 20,
                                        "policy": POLICY, **({"reducers": reducers} if reducers else {})}},
    )
    own = {"tap_reducers": sorted(reducers), "tap_logits": "full", "tap_layers": "all"} if reducers else {}
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                             extra_args={"tap": 1, "tap_key": f"{a.instance}-{i}", **own}) for i in range(len(PROMPTS))]
    params += [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)] * len(POLICY_PROMPTS)
    outs = llm.generate([prompt_text(p) for p in PROMPTS + POLICY_PROMPTS], params)
    print("RESULT " + json.dumps([{"id": o.request_id, "prompt": list(o.prompt_token_ids),
                                   "output": list(o.outputs[0].token_ids)} for o in outs]), flush=True)


if __name__ == "__main__":
    main()
