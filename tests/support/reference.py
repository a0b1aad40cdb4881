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


# The tiny tokenizer's first ids (EOS is ignored, so it is sampled too); its other words are w<id>.
TINY_SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2}


def tiny_token_id(word: str) -> int:
    """The id of a word of the tiny tokenizer, as a completion's logprobs.tokens spells it."""
    word = word.strip()
    return TINY_SPECIALS[word] if word in TINY_SPECIALS else int(word[1:])


def logprob_mismatches(rows: dict[int, np.ndarray], response, prompt_len: int,
                       tol: float) -> list[tuple[int, float, float]]:
    """(k, from the logits, vLLM's) for each delivered output position whose logits do not give the
    logprob vLLM reported for the token it chose (a completion with logprobs=1): output token k is
    chosen by the logits at position prompt_len - 1 + k."""
    lp = response.choices[0].logprobs
    bad = []
    for k, (word, want) in enumerate(zip(lp.tokens, lp.token_logprobs)):
        row = rows.get(prompt_len - 1 + k)
        if row is not None:
            got = float(log_softmax(row[None, :])[0, tiny_token_id(word)])
            if not abs(got - want) <= tol:
                bad.append((k, got, want))
    return bad
