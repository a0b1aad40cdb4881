"""What a capture asks of one rank each step, in the words of its ring records.

A `Part` is one kind of record content a request's spec asks this rank for (full logits, top-k,
chosen logits, one layer's hidden states, one reducer's output); requests with equal parts share
records. A part is
written as one or more sections (tensors) of a DATA record: `tensor_ids(part)` names them, and
`section(...)` describes one as the publisher and the ring writer take it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_tap import ring_format as rf
from vllm_tap.ring_records import TensorId

from .publisher import STORAGE, RecordSection


class Part(NamedTuple):
    """One kind of content a spec asks of this rank each step. (A tuple: it is a dict key when a
    step is planned, and tuples hash in C.)"""

    what: str  # "logits" | "topk" | "chosen" | "hidden" | "probe" | "latents" (the last two: a reducer's)
    to_f32: bool = False
    layer: int = -1  # hidden states: the layer; a reducer: the layer it reads
    topk: int = 0
    indices: tuple[int, ...] = ()
    reducer: str = ""  # a reducer's name (vllm_tap.reducers) ...
    slot: int = -1  # ... and its index in the request's spec, which numbers its tensors


# Parts written from the layers' rows (the step's states phase), and from the logits.
STATE_PARTS = frozenset({"hidden", "probe", "latents"})
LOGIT_PARTS = frozenset({"logits", "topk", "chosen"})


LOGITS_ID = TensorId(rf.TensorKind.LOGITS)
TOPK_IDS_ID = TensorId(rf.TensorKind.TOPK_IDS)
TOPK_VALUES_ID = TensorId(rf.TensorKind.TOPK_VALUES)
CHOSEN_ID = TensorId(rf.TensorKind.CHOSEN)
LSE_ID = TensorId(rf.TensorKind.LOGSUMEXP)
_HIDDEN_IDS: dict[int, TensorId] = {}
# The sections of each logits part: top-k is ids + values + the row's logsumexp, chosen is values +
# logsumexp (a record that carries several of them holds the logsumexp once).
_LOGIT_TENSORS = {"logits": (LOGITS_ID,), "topk": (TOPK_IDS_ID, TOPK_VALUES_ID, LSE_ID), "chosen": (CHOSEN_ID, LSE_ID)}


def hidden_id(layer: int) -> TensorId:
    tid = _HIDDEN_IDS.get(layer)
    if tid is None:
        tid = _HIDDEN_IDS[layer] = TensorId(rf.TensorKind.HIDDEN, layer)
    return tid


def reducer_ids(part: Part) -> tuple[TensorId, ...]:
    """A reducer part's tensors: an SAE's latent ids and values, or a probe's scores."""
    if part.what == "latents":
        return (TensorId(rf.TensorKind.LATENT_IDS, part.slot), TensorId(rf.TensorKind.LATENT_VALUES, part.slot))
    return (TensorId(rf.TensorKind.PROBE, part.slot),)


def tensor_ids(part: Part) -> tuple[TensorId, ...]:
    """The tensors (record sections) a part is written as."""
    if part.what == "hidden":
        return (hidden_id(part.layer),)
    if part.what in LOGIT_PARTS:
        return _LOGIT_TENSORS[part.what]
    return reducer_ids(part)


def tensors_per_step(parts: tuple[Part, ...]) -> int:
    """How many tensors a rank writes for a request with these parts each step it captures."""
    return sum(len(tensor_ids(p)) for p in parts)


def section(tid: TensorId, dtype: torch.dtype, sl: tuple[int, int], full: int) -> RecordSection:
    """A record section of columns `sl` of a tensor `full` wide, stored as `dtype`."""
    return RecordSection(tid, STORAGE[dtype], sl[1] - sl[0], sl, full, dtype)


def stored_dtype(t: "torch.Tensor | torch.dtype", to_f32: bool) -> torch.dtype:
    """The dtype a tensor's rows are stored in: its own, or float32 when the spec asks for it."""
    dtype = t if isinstance(t, torch.dtype) else t.dtype
    return torch.float32 if to_f32 and dtype.is_floating_point else dtype
