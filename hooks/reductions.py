"""Reductions of logit rows the capture writes instead of whole rows: top-k and the row's logsumexp.

Both run where the logits are (on an accelerator: kernels on the compute stream, no sync) and are
shared by the general and the steady capture paths (hooks/capture_core.py, hooks/steady_step.py).
"""

from __future__ import annotations

import torch

# Top-k on the CPU through group maxima: the vocabulary is split into G groups of STRIPES elements
# (group g holds g, g + G, g + 2G, ...); every one of the k largest elements lies in one of the k
# groups with the largest maxima (a group holding one has a maximum at least the k-th value, and at
# most k groups can), so an exact top-k needs one max pass over the row, a top-k over G group maxima
# and one over k * STRIPES candidates: 4-5x less than torch.topk over 32000 (measured here). Equal
# values may come out in another order of their ids than torch.topk gives; the values are the same.
_STRIPES = 32


_STRIDES: dict[tuple[int, int], torch.Tensor] = {}


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the k largest of each row of x [n, V], largest first."""
    n, v = x.shape
    groups = v // _STRIPES
    if x.device.type != "cpu" or groups < 2 * k or not x.is_contiguous():
        return torch.topk(x, k, dim=-1, sorted=True)  # one kernel on an accelerator
    gmax = x.as_strided((n, _STRIPES, groups), (v, groups, 1)).amax(1)
    gi = torch.topk(gmax, k, dim=-1, sorted=False).indices
    stripes = _STRIDES.get((v, groups))
    if stripes is None:
        stripes = _STRIDES[(v, groups)] = torch.arange(0, _STRIPES * groups, groups).view(1, _STRIPES, 1)
    cand = (gi.unsqueeze(1) + stripes).view(n, -1)
    if _STRIPES * groups < v:  # the tail beyond the last whole stripe: always a candidate
        cand = torch.cat([cand, torch.arange(_STRIPES * groups, v).expand(n, -1)], 1)
    values, j = torch.topk(torch.gather(x, 1, cand), k, dim=-1, sorted=True)
    return values, torch.gather(cand, 1, j)


def logsumexp_rows(x: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] log-sum-exp of each row of x [n, V], given each row's largest element's id
    (column 0 of `top_ids`, from the top-k).

    Through log_softmax in float32, which is what vLLM computes its logprobs with: one fused pass
    (torch.logsumexp makes several, with temporaries: ~0.65x its time on the CPU, and 5 kernel
    launches against 7 on a GPU, where each launch is host time), read at the row's largest
    element, where x - log_softmax(x) = max + log(sum(exp(x - max))) up to one rounding (x - max is
    0 there: no cancellation). So value - logsumexp is vLLM's logprob to the rounding."""
    at = top_ids[:, :1]
    return x.gather(1, at).float() - torch.log_softmax(x, -1, dtype=torch.float32).gather(1, at)


def topk_into(x: torch.Tensor, k: int, values: torch.Tensor, ids: torch.Tensor) -> None:
    """The k largest of each row of x into values [n, k] (x's dtype) and ids [n, k] (int64), largest
    first: one torch.topk with out= (one kernel on an accelerator), or on the CPU, where the group
    maxima are faster for a large vocabulary, topk_rows and two copies."""
    if x.device.type == "cpu" and x.shape[-1] // _STRIPES >= 2 * k:
        v, i = topk_rows(x, k)
        values.copy_(v)
        ids.copy_(i)
    else:
        torch.topk(x, k, dim=-1, sorted=True, out=(values, ids))


def log_softmax_f32(x: torch.Tensor) -> torch.Tensor:
    """log_softmax of each row of x in float32, as vLLM computes its logprobs. On CUDA a float16 x
    is converted inside the one kernel (`half_to_float`, as autocast calls it): one launch, not a
    conversion and then the softmax. PyTorch's kernel takes float16 only for that (bfloat16 and the
    CPU convert first)."""
    if x.is_cuda and x.dtype == torch.float16:
        return torch._log_softmax(x, -1, True)
    return torch.log_softmax(x, -1, dtype=torch.float32)
