"""References the captures are checked against: a transformers fp32 forward and vLLM's logprobs.

Test helper only (imports torch and transformers).
"""

from __future__ import annotations

import functools
import os

import numpy as np

from vllm_tap.tools.tiny_model import TinyLlamaSpec, make_tiny_llama

MODEL_CACHE = os.environ.get("VLLM_TAP_TEST_MODELS", "/tmp/vllm-tap-test-models")


def tiny_model(spec: TinyLlamaSpec = TinyLlamaSpec()) -> str:
    name = f"tiny-v{spec.vocab_size}-h{spec.hidden_size}-l{spec.num_layers}-s{spec.seed}"
    return make_tiny_llama(os.path.join(MODEL_CACHE, name), spec)


@functools.lru_cache(maxsize=4)
def _hf_model(path: str):
    import torch
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    m.eval()
    return m


def hf_forward(path: str, token_ids: list[int]) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """fp32 logits [T, V] and hidden states {layer: [T, H]} in vllm-tap's numbering.

    transformers' output_hidden_states[i] is the output of decoder layer i for i < n, but its last
    entry has the final norm applied; vllm-tap's layer n is the residual stream before that norm,
    so layer n is taken from the last decoder layer's own output.
    """
    import torch

    m = _hf_model(path)
    seen = {}
    h = m.model.layers[-1].register_forward_hook(
        lambda mod, i, o: seen.__setitem__("last", o[0] if isinstance(o, tuple) else o)
    )
    try:
        with torch.no_grad():
            out = m(torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        h.remove()
    n = m.config.num_hidden_layers
    hidden = {i: out.hidden_states[i][0].numpy() for i in range(n)}
    hidden[n] = seen["last"][0].numpy()
    return out.logits[0].numpy(), hidden


def shutdown_llm(llm) -> None:
    """Stop an offline engine now rather than at interpreter exit, where vLLM's shutdown logging
    would write into streams pytest has already closed."""
    llm.llm_engine.engine_core.shutdown()


def vllm_logprob_rows(logprobs, vocab: int) -> np.ndarray:
    """vLLM's per-token {token_id: Logprob} dicts (full vocabulary) as a dense [T, V] array."""
    rows = np.full((len(logprobs), vocab), np.nan, dtype=np.float64)
    for t, d in enumerate(logprobs):
        for tok, lp in d.items():
            rows[t, tok] = lp.logprob if hasattr(lp, "logprob") else lp
    return rows


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
