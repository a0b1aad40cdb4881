"""A reducer on a worker's device: its weights, its buffers, and the math it runs on a step's rows.

Everything it holds is allocated when the model is loaded (hooks/runner_patch.py's load_model
wrapper), before vLLM profiles the device's memory, so vLLM counts it as its own and sizes the KV
cache around it: the weights in float32, and buffers for up to `rows` rows at once (the row inputs in
float32, an SAE's pre-activations, an MLP's hidden layers, the selection's ids and masks; at most
WORKSPACE_BYTES a reducer). A step then allocates nothing on the steady path and only its outputs on
the general path; more rows than `rows` are done in passes.

Per pass, every call writes into a buffer or into the record (out=, in place), and none waits for
the device:

    linear   addmm into the record's scores
    mlp      per hidden layer an addmm and an in-place activation; the last addmm into the scores
    SAE      addmm into pre [n, d_sae]; jumprelu: gt, mul_ (pre * (pre > threshold)); top-k into the
             record's values and an int64 buffer; le (the slots not above the threshold); masked_fill_
             of the values (0) and of the ids (-1); the ids' copy into the record's int32

plus, when the rows are not already float32 rows of their own tensor, one gather (and a conversion)
into the input buffer. hooks/reducer_files.py says why top-k over `pre` is the SAE's top-k.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from vllm_tap.hooks.reducer_files import ReducerWeights
from vllm_tap.hooks.reductions import topk_into

WORKSPACE_BYTES = 64 << 20  # a reducer's buffers, at most (they bound the rows of one pass)


def _activation(name: str) -> Callable[[torch.Tensor], Any]:
    return {"relu": torch.relu_, "tanh": torch.tanh_, "sigmoid": torch.sigmoid_,
            "silu": lambda h: torch.nn.functional.silu(h, inplace=True), "gelu": torch.ops.aten.gelu_}[name]


class _Views:
    """A reducer's buffers cut to n rows (made once per row count)."""

    __slots__ = ("x", "hidden", "pre", "jump", "ids", "mask")

    def __init__(self, r: "DeviceReducer", n: int):
        self.x = r._x[:n]
        self.hidden = [h[:n] for h in r._hidden]
        self.pre = r._pre[:n] if r._pre is not None else None
        self.jump = r._jump[:n] if r._jump is not None else None
        self.ids = r._ids[:n] if r._ids is not None else None
        self.mask = r._mask[:n] if r._mask is not None else None


class DeviceReducer:
    """One reducer's weights and buffers on `device`, for passes of up to `rows` rows (at most max_rows)."""

    def __init__(self, weights: ReducerWeights, device: torch.device | str, max_rows: int):
        device = torch.device(device)
        decl = weights.decl
        self.name = decl.name
        self.layer = decl.layer
        self.width = weights.width
        self.latents = decl.writes_latents
        self.threshold = float(decl.threshold)
        self._layers = [(w.to(device).contiguous(), b.to(device).contiguous()) for w, b in weights.layers]
        self._jumps = weights.threshold.to(device) if weights.threshold is not None else None
        self._act = _activation(decl.activation)
        hidden = self._layers[0][0].shape[0]
        self.hidden_size = hidden
        inner = [w.shape[1] for w, _ in self._layers[:-1]]  # an MLP's hidden widths
        d_sae = weights.d_sae if self.latents else 0
        per_row = 4 * (hidden + sum(inner) + d_sae) + (9 * self.width if self.latents else 0) \
            + (d_sae if self._jumps is not None else 0)
        self.rows = max(1, min(max_rows, WORKSPACE_BYTES // per_row))
        rows = self.rows
        self._x = torch.empty((rows, hidden), dtype=torch.float32, device=device)
        self._hidden = [torch.empty((rows, w), dtype=torch.float32, device=device) for w in inner]
        self._pre = torch.empty((rows, d_sae), dtype=torch.float32, device=device) if self.latents else None
        self._jump = torch.empty((rows, d_sae), dtype=torch.bool, device=device) if self._jumps is not None else None
        self._ids = torch.empty((rows, self.width), dtype=torch.long, device=device) if self.latents else None
        self._mask = torch.empty((rows, self.width), dtype=torch.bool, device=device) if self.latents else None
        self._views: dict[int, _Views] = {}

    @property
    def out_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes of its outputs, in the record's order: SAE ids then values, or a probe's scores."""
        return (torch.int32, torch.float32) if self.latents else (torch.float32,)

    @property
    def nbytes(self) -> int:
        """Device bytes it holds: weights and buffers."""
        ts = [t for pair in self._layers for t in pair] + [self._jumps, self._x, *self._hidden, self._pre,
                                                           self._jump, self._ids, self._mask]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def _at(self, n: int) -> _Views:
        v = self._views.get(n)
        if v is None:
            v = self._views[n] = _Views(self, n)
        return v

    # -- running --

    def run_rows(self, src: torch.Tensor, index: torch.Tensor | None, outs: list[torch.Tensor]) -> None:
        """outs (its outputs, [n, width] each) <- the reducer of src's rows `index` (None: rows 0..n-1)."""
        n = outs[0].shape[0]
        step = self.rows
        if n <= step:
            v = self._at(n)
            self._pass(self._input(src, index, v.x), outs, v)
            return
        for a in range(0, n, step):
            b = min(n, a + step)
            v = self._at(b - a)
            x = self._input(src[a:b] if index is None else src, None if index is None else index[a:b], v.x)
            self._pass(x, [o[a:b] for o in outs], v)

    def new_outputs(self, n: int, device: torch.device) -> list[torch.Tensor]:
        return [torch.empty((n, self.width), dtype=dt, device=device) for dt in self.out_dtypes]

    @staticmethod
    def _input(src: torch.Tensor, index: torch.Tensor | None, buf: torch.Tensor) -> torch.Tensor:
        """The rows as float32: src itself when it is exactly them, else gathered (and converted) into buf."""
        n = buf.shape[0]
        if index is None:
            if src.shape[0] == n and src.dtype == torch.float32:
                return src
            buf.copy_(src if src.shape[0] == n else src[:n])
        elif src.dtype == torch.float32:
            torch.index_select(src, 0, index, out=buf)
        else:
            buf.copy_(torch.index_select(src, 0, index))
        return buf

    def _pass(self, x: torch.Tensor, outs: list[torch.Tensor], v: _Views) -> None:
        layers = self._layers
        if not self.latents:
            h = x
            for (w, b), buf in zip(layers[:-1], v.hidden):
                torch.addmm(b, h, w, out=buf)
                self._act(buf)
                h = buf
            w, b = layers[-1]
            torch.addmm(b, h, w, out=outs[0])
            return
        ids_out, values = outs
        w, c = layers[0]
        pre = v.pre
        torch.addmm(c, x, w, out=pre)
        if self._jumps is not None:  # jumprelu: a latent below its own threshold is not active
            torch.gt(pre, self._jumps, out=v.jump)
            pre.mul_(v.jump)
        topk_into(pre, self.width, values, v.ids)
        torch.le(values, self.threshold, out=v.mask)
        values.masked_fill_(v.mask, 0.0)
        v.ids.masked_fill_(v.mask, -1)
        ids_out.copy_(v.ids)
