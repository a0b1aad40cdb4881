"""Make a small random Llama checkpoint with its own tokenizer (no model hub needed).

Random weights are fine for checking a tap: the logits and hidden states are still exactly what
the model computes. The tokenizer is a word-level tokenizer built with `tokenizers` whose
vocabulary matches the model's, so every id vLLM samples detokenizes. Needs transformers and
tokenizers (tests, demo, bench), never imported by the daemon or client.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class TinyLlamaSpec:
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4  # head_dim = 32: vLLM's CPU attention needs >= 32
    num_kv_heads: int = 2  # divisible by 2, so tensor-parallel 2 works
    intermediate_size: int = 256
    max_position_embeddings: int = 2048
    seed: int = 0
    # Default init gives near-uniform logits; a larger lm_head makes argmax and top-k meaningful.
    logit_scale: float = 4.0


def word(i: int) -> str:
    return f"w{i}"


def make_tiny_llama(path: str, spec: TinyLlamaSpec = TinyLlamaSpec()) -> str:
    """Write the checkpoint to `path` (reused when an identical one is already there)."""
    marker = os.path.join(path, "tiny_spec.json")
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == asdict(spec):
                return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(len(specials), spec.vocab_size):
        vocab[word(i)] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(spec.logit_scale)
    model.save_pretrained(path, safe_serialization=True)
    with open(marker, "w") as f:
        json.dump(asdict(spec), f)
    return path


def prompt_text(token_ids: list[int]) -> str:
    return " ".join(word(i) for i in token_ids)
