"""What a subscriber gets: per-token records, gaps, and whole captures stacked into arrays."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Union

import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap.positions import PositionRanges

LIST_MISSING_UP_TO = 1 << 20  # saved captures list missing positions one by one only up to this many


def _ranges(missing) -> list[tuple[int, int]]:
    return (missing if isinstance(missing, PositionRanges) else PositionRanges.of(missing)).ranges


def widen(code: int, arr: np.ndarray) -> np.ndarray:
    """Storage dtype to a numpy dtype: bfloat16 (carried as uint16) becomes float32, exactly."""
    if code == rf.DType.BFLOAT16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def phase_of(position: int, num_prompt_tokens: int) -> str:
    return "prompt" if position < num_prompt_tokens else "output"


@dataclass(frozen=True)
class Latents:
    """An SAE encoder's most active latents (a reducer, vllm_tap.reducers): for each position its k
    slots, most active first. A slot that holds no active latent has id -1 and value 0."""

    ids: np.ndarray  # int32 [..., k]
    values: np.ndarray  # float32 [..., k]: the latents' activations

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: Any) -> "Latents":
        return Latents(self.ids[i], self.values[i])

    def active(self, i: int) -> dict[int, float]:
        """Position row i's active latents: {id: activation}."""
        keep = self.ids[i] >= 0
        return dict(zip(self.ids[i][keep].tolist(), self.values[i][keep].tolist()))


# What a reducer delivers per capture: a probe's scores (float32 [T, k]) or an SAE's Latents.
Reduced = Union[np.ndarray, Latents]
_REDUCED = {rf.TENSOR_NAMES[k] for k in rf.REDUCER_KINDS}


def reducer_names(spec: dict[str, Any] | None) -> tuple[str, ...]:
    """The reducers of a capture's spec (CaptureBegin.spec), in the order that numbers their tensors."""
    names = (spec or {}).get("reducers") or ()
    return tuple(n for n in names if isinstance(n, str))


def _reducer_key(i: int, names: tuple[str, ...]) -> str:
    # A capture whose spec the daemon never saw (it restarted mid-capture and the END did not come)
    # still delivers its reducers' outputs, under their index.
    return names[i] if 0 <= i < len(names) else f"#{i}"


def _reduced(parts: dict[tuple[str, int], np.ndarray], names: tuple[str, ...]) -> dict[str, Reduced]:
    out: dict[str, Reduced] = {}
    for i in sorted({i for _, i in parts}):
        probe, ids, values = (parts.get((b, i)) for b in ("probe", "latent_ids", "latent_values"))
        if probe is not None:
            out[_reducer_key(i, names)] = probe
        elif ids is not None or values is not None:
            like = ids if ids is not None else values
            out[_reducer_key(i, names)] = Latents(
                ids if ids is not None else np.full(like.shape, -1, np.int32),
                values if values is not None else np.zeros(like.shape, np.float32))
    return out


def renamed(reduced: dict[str, Reduced], names: tuple[str, ...]) -> dict[str, Reduced]:
    """Outputs keyed by index ("#i", their spec unknown when they arrived) under their names."""
    if not names or not any(k.startswith("#") for k in reduced):
        return reduced
    return {(_reducer_key(int(k[1:]), names) if k.startswith("#") and k[1:].isdigit() else k): v
            for k, v in reduced.items()}


@dataclass(frozen=True)
class TokenRecord:
    """One captured position. The logits at p give the distribution of token p+1."""

    position: int
    phase: str  # 'prompt' or 'output'
    token_id: int  # the token at this position
    logits: np.ndarray | None
    hidden: dict[int, np.ndarray]  # layer (0 = embeddings, i = output of decoder layer i) -> [H]
    topk_ids: np.ndarray | None = None
    topk_values: np.ndarray | None = None
    chosen: np.ndarray | None = None
    request_id: str = ""
    logsumexp: float | None = None  # of the whole logit row (top-k and chosen captures): logprob = logit - it
    reduced: dict[str, Any] = field(default_factory=dict)  # reducer name -> probe scores [k] or Latents of [k]
    missing: ClassVar[bool] = False


@dataclass(frozen=True)
class Gap:
    """Positions that will not arrive (yielded in order, in place of their records)."""

    positions: range
    reason: str
    request_id: str = ""
    missing: ClassVar[bool] = True


@dataclass(frozen=True)
class Chunk:
    """Consecutive positions as they travel: one array per tensor, rows in position order."""

    request_id: str
    start: int
    token_ids: np.ndarray  # int32 [n]
    num_prompt_tokens: int
    logits: np.ndarray | None = None
    hidden: dict[int, np.ndarray] = field(default_factory=dict)
    topk_ids: np.ndarray | None = None
    topk_values: np.ndarray | None = None
    chosen: np.ndarray | None = None
    logsumexp: np.ndarray | None = None  # float32 [n]
    reduced: dict[str, Reduced] = field(default_factory=dict)  # reducer name -> scores [n, k] or Latents
    missing: ClassVar[bool] = False

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def stop(self) -> int:
        return self.start + len(self)

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.start, self.stop, dtype=np.int32)

    @classmethod
    def from_tensors(cls, request_id: str, start: int, token_ids: np.ndarray, num_prompt_tokens: int,
                     tensors: dict[str, np.ndarray], reducers: tuple[str, ...] = ()) -> "Chunk":
        """`reducers`: the capture spec's reducer names (reducer_names), which name its reducer tensors."""
        kw: dict[str, Any] = {"hidden": {}}
        parts: dict[tuple[str, int], np.ndarray] = {}
        for name, arr in tensors.items():
            base, _, layer = name.partition(".")
            if base == rf.TENSOR_NAMES[rf.TensorKind.HIDDEN] and layer:
                kw["hidden"][int(layer)] = arr
            elif base in ("logits", "topk_ids", "topk_values", "chosen"):
                kw[base] = arr
            elif base == "logsumexp":
                kw[base] = arr.reshape(-1)  # [n, 1] on the wire
            elif base in _REDUCED and layer.isdigit():
                parts[(base, int(layer))] = arr
        if parts:
            kw["reduced"] = _reduced(parts, reducers)
        return cls(request_id, start, token_ids, num_prompt_tokens, **kw)

    def cut(self, from_position: int) -> "Chunk":
        k = max(0, from_position - self.start)
        if k == 0:
            return self

        def c(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[k:]

        return Chunk(self.request_id, self.start + k, self.token_ids[k:], self.num_prompt_tokens, c(self.logits),
                     {l: a[k:] for l, a in self.hidden.items()}, c(self.topk_ids), c(self.topk_values), c(self.chosen),
                     c(self.logsumexp), {name: r[k:] for name, r in self.reduced.items()})

    def rows(self) -> Iterator[TokenRecord]:
        for i in range(len(self)):
            p = self.start + i
            yield TokenRecord(
                p, phase_of(p, self.num_prompt_tokens), int(self.token_ids[i]),
                None if self.logits is None else self.logits[i], {l: a[i] for l, a in self.hidden.items()},
                None if self.topk_ids is None else self.topk_ids[i],
                None if self.topk_values is None else self.topk_values[i],
                None if self.chosen is None else self.chosen[i], self.request_id,
                None if self.logsumexp is None else float(self.logsumexp[i]),
                {name: r[i] for name, r in self.reduced.items()},
            )


Item = Union[TokenRecord, Gap]


@dataclass(frozen=True)
class CaptureBegin:
    request_id: str
    instance: str
    tap_key: str
    names: tuple[str, ...]
    response_id: str
    choice_index: int
    num_prompt_tokens: int
    prompt_token_ids: list[int] | None
    n: int
    model: str
    spec: dict[str, Any] | None
    start_position: int | None
    lazy: bool  # the daemon never saw this capture's start (it restarted): metadata may be partial
    source: str = "client"  # "client": the request opted in; "policy": the server's capture policy chose it


@dataclass(frozen=True)
class CaptureEnd:
    request_id: str
    instance: str
    reason: str  # the finish reason ('stop', 'length', 'abort', ...) or 'writer gone'
    num_prompt_tokens: int
    num_output_tokens: int
    output_token_ids: list[int]
    end_position: int | None  # None: the daemon never saw the END (writer gone, END lost, malformed record)
    expected: tuple[int, int] | None  # [start, stop) of positions that should have been captured
    # Expected positions that did not arrive (daemon- and client-detected): a sorted sequence of ints
    # kept as ranges (`.ranges`), so a huge gap costs nothing.
    missing_positions: PositionRanges
    response_id: str
    choice_index: int
    source: str = "client"

    @property
    def complete(self) -> bool:
        """The request's END was seen and every expected position arrived."""
        return self.end_position is not None and not self.missing_positions

    @property
    def end_known(self) -> bool:
        """Whether the END was read. Without it (`end lost`, `writer gone`, a malformed record) the
        expected range stops where capture got to: positions the engine computed past it are not
        in missing_positions, which accounts for everything from the start up to there."""
        return self.end_position is not None


@dataclass
class Capture:
    """A whole capture, stacked: row i of every array is position positions[i]."""

    request_id: str
    instance: str
    response_id: str
    choice_index: int
    num_prompt_tokens: int
    prompt_token_ids: list[int] | None
    positions: np.ndarray  # int32 [T]
    token_ids: np.ndarray  # int32 [T]
    logits: np.ndarray | None  # [T, V]
    hidden: dict[int, np.ndarray]  # layer -> [T, H]
    topk_ids: np.ndarray | None
    topk_values: np.ndarray | None
    chosen: np.ndarray | None
    finish_reason: str
    num_output_tokens: int
    output_token_ids: list[int]
    missing_positions: PositionRanges  # a sorted sequence of ints kept as ranges (`.ranges`)
    expected: tuple[int, int] | None = None
    source: str = "client"
    end_position: int | None = None
    logsumexp: np.ndarray | None = None  # float32 [T], top-k and chosen captures: logprob = logit - logsumexp
    # The reducers' outputs by reducer name: a probe's scores (float32 [T, k]) or an SAE's Latents
    # (ids int32 [T, k], -1 where a slot holds none; values float32 [T, k]).
    reduced: dict[str, Reduced] = field(default_factory=dict)

    @property
    def phases(self) -> np.ndarray:
        return np.where(self.positions < self.num_prompt_tokens, "prompt", "output")

    @property
    def complete(self) -> bool:
        """The request's END was seen and every expected position arrived."""
        return self.end_position is not None and not self.missing_positions

    @property
    def end_known(self) -> bool:
        """Whether the END was read. Without it (`end lost`, `writer gone`, a malformed record) the
        expected range stops where capture got to: positions the engine computed past it are not
        in missing_positions, which accounts for everything from the start up to there."""
        return self.end_position is not None

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array by a flat name (as saved): positions, token_ids, logits, hidden.L, ..."""
        out = {"positions": self.positions, "token_ids": self.token_ids}
        for name in ("logits", "topk_ids", "topk_values", "chosen", "logsumexp"):
            a = getattr(self, name)
            if a is not None:
                out[name] = a
        for layer, a in sorted(self.hidden.items()):
            out[f"hidden.{layer}"] = a
        for name, r in sorted(self.reduced.items()):
            if isinstance(r, Latents):
                out[f"reduced.{name}.ids"], out[f"reduced.{name}.values"] = r.ids, r.values
            else:
                out[f"reduced.{name}"] = r
        return out

    def meta(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "instance": self.instance, "response_id": self.response_id,
            "choice_index": self.choice_index, "num_prompt_tokens": self.num_prompt_tokens,
            "prompt_token_ids": self.prompt_token_ids, "finish_reason": self.finish_reason,
            "num_output_tokens": self.num_output_tokens, "output_token_ids": self.output_token_ids,
            # The positions themselves only while they are few; the ranges always.
            "missing_positions": list(self.missing_positions) if len(self.missing_positions) <= LIST_MISSING_UP_TO else None,
            "missing_ranges": [list(r) for r in _ranges(self.missing_positions)],
            "expected": list(self.expected) if self.expected else None, "source": self.source,
            "end_position": self.end_position,
        }

    def save(self, path: str) -> None:
        """.npz or .safetensors. npz: the arrays() names with '.' as '_' (hidden_3), missing_ranges
        ([k, 2] start/stop), missing_positions (up to LIST_MISSING_UP_TO of them), and the metadata
        as JSON in 'meta'; safetensors: the arrays() names, metadata in the header."""
        arrays = {k: np.ascontiguousarray(v) for k, v in self.arrays().items()}
        meta = json.dumps(self.meta())
        if path.endswith(".safetensors"):
            from safetensors.numpy import save_file

            save_file(arrays, path, metadata={"vllm_tap": meta})
        else:
            extra = {"missing_ranges": np.asarray(_ranges(self.missing_positions), np.int64).reshape(-1, 2)}
            if len(self.missing_positions) <= LIST_MISSING_UP_TO:
                extra["missing_positions"] = np.asarray(self.missing_positions, np.int64)
            np.savez(path, meta=np.array(meta), **extra,
                     **{k.replace(".", "_"): v for k, v in arrays.items()})


def stack_rows(cs: list[Chunk], get) -> np.ndarray | None:
    """A one-value-per-row array of every chunk, stacked (NaN for a chunk without it)."""
    parts = [get(c) for c in cs]
    if all(p is None for p in parts):
        return None
    return np.concatenate([p if p is not None else np.full(len(c), np.nan, np.float32) for p, c in zip(parts, cs)])


def _stacked(parts: list, cs: list[Chunk]) -> np.ndarray | None:
    """One array of every chunk's part, in order; a chunk without it (it should not happen within one
    capture) gets fill rows (NaN, or -1 for integers), never shifted rows."""
    have = [p for p in parts if p is not None]
    if not have:
        return None
    if len(have) == len(parts):
        return np.concatenate(have)
    fill = np.nan if have[0].dtype.kind == "f" else -1
    return np.concatenate([p if p is not None else np.full((len(c), have[0].shape[1]), fill, have[0].dtype)
                           for p, c in zip(parts, cs)])


class CaptureBuilder:
    """Collects chunks and gaps, then stacks them with one concatenation per array."""

    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        self.gaps: list[Gap] = []  # kept for their reasons (the END lists the positions, not why)

    def add(self, item: Chunk | Gap) -> None:
        if isinstance(item, Chunk):
            self.chunks.append(item)
        else:
            self.gaps.append(item)

    def build(self, begin: CaptureBegin | None, end: CaptureEnd) -> Capture:
        cs = self.chunks
        positions = np.concatenate([c.positions for c in cs]) if cs else np.zeros(0, np.int32)
        token_ids = np.concatenate([c.token_ids for c in cs]).astype(np.int32) if cs else np.zeros(0, np.int32)

        def stack(get) -> np.ndarray | None:
            return _stacked([get(c) for c in cs], cs)

        layers = sorted({l for c in cs for l in c.hidden})
        hidden = {l: stack(lambda c, l=l: c.hidden.get(l)) for l in layers}
        names = reducer_names(begin.spec if begin is not None else None)
        per_chunk = [renamed(c.reduced, names) for c in cs]
        reduced: dict[str, Reduced] = {}
        for name in sorted({n for r in per_chunk for n in r}):
            got = [r.get(name) for r in per_chunk]
            if any(isinstance(g, Latents) for g in got):
                ids = _stacked([g.ids if isinstance(g, Latents) else None for g in got], cs)
                values = _stacked([g.values if isinstance(g, Latents) else None for g in got], cs)
                reduced[name] = Latents(ids, values)  # type: ignore[arg-type]
            else:
                reduced[name] = _stacked(got, cs)  # type: ignore[assignment]
        return Capture(
            end.request_id, end.instance, end.response_id, end.choice_index,
            end.num_prompt_tokens or (begin.num_prompt_tokens if begin else 0),
            begin.prompt_token_ids if begin else None, positions, token_ids,
            stack(lambda c: c.logits), hidden,  # type: ignore[arg-type]
            stack(lambda c: c.topk_ids), stack(lambda c: c.topk_values), stack(lambda c: c.chosen),
            end.reason, end.num_output_tokens, list(end.output_token_ids), PositionRanges(end.missing_positions.ranges)
            if isinstance(end.missing_positions, PositionRanges) else PositionRanges.of(end.missing_positions),
            end.expected, end.source, end.end_position, stack_rows(cs, lambda c: c.logsumexp), reduced,
        )
