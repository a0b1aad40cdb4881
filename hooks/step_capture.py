"""Per-step capture inside a model-runner worker: pick the opted-in rows and copy them out.

Called at the top of `sample_tokens`, when the step's raw logits, final hidden states and the
auxiliary per-layer hidden states all exist and nothing (grammar masks, logits processors,
penalties) has touched the logits yet. The work per step is one dict lookup and a few integer
operations per scheduled request, then one ring record per captured tensor for the whole batch:
its rows are gathered from the model's tensor by one copy (or two, for logits: prompt rows from the
extra lm-head pass, sampled rows from the step's logits), whatever the number of requests. No
per-token Python, no device sync. Under tensor parallelism every rank holds the full logits and residual stream; each rank
copies only its 1/tp share of the last dimension, so the copy volume is split and no collective
is added. The one collective we may add is the extra lm-head pass for prompt positions, which
every rank runs identically, as vLLM's own compute_logits requires.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from vllm_tap import ring_format as rf
from vllm_tap.hooks.publisher import gather_rows, make_publisher
from vllm_tap.hooks.settings import SPEC_EXTRA_ARG, instance_name
from vllm_tap.records import RequestRef, RequestTable, TensorId
from vllm_tap.ring import RingWriter, ring_path
from vllm_tap.spec import CaptureSpec, DTypeMode, LogitsMode, ServerCaptureConfig

log = logging.getLogger("vllm_tap.hooks")

_UNSEEN = object()
_NO_ROWS = np.zeros(0, np.int64)
_STORAGE = {torch.float32: rf.DType.FLOAT32, torch.float16: rf.DType.FLOAT16,
            torch.bfloat16: rf.DType.BFLOAT16, torch.int32: rf.DType.INT32}


_LOGITS_ID = TensorId(rf.TensorKind.LOGITS)
_TOPK_IDS_ID = TensorId(rf.TensorKind.TOPK_IDS)
_TOPK_VALUES_ID = TensorId(rf.TensorKind.TOPK_VALUES)
_CHOSEN_ID = TensorId(rf.TensorKind.CHOSEN)
_HIDDEN_IDS: dict[int, TensorId] = {}


def _hidden_id(layer: int) -> TensorId:
    tid = _HIDDEN_IDS.get(layer)
    if tid is None:
        tid = _HIDDEN_IDS[layer] = TensorId(rf.TensorKind.HIDDEN, layer)
    return tid


def shard(dim: int, rank: int, size: int) -> tuple[int, int]:
    """This rank's [start, stop) of a last dimension split as evenly as possible."""
    per = -(-dim // size)
    return min(rank * per, dim), min((rank + 1) * per, dim)


def stage_layers(layers: tuple[int, ...], num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, ...]:
    """The captured layers a pipeline stage computes: 0 (embeddings) on the first stage, and
    layer i (output of decoder layer i) on the stage that runs decoder layer i."""
    from vllm.distributed.utils import get_pp_indices

    start, end = get_pp_indices(num_layers, pp_rank, pp_size)
    return tuple(x for x in layers if start < x <= end or (x == 0 and pp_rank == 0))


@dataclass
class StageOutput:
    """What a non-last pipeline stage has to capture from: its own layers' aux outputs only."""

    scheduler_output: object
    aux_hidden_states: list
    logits: None = None
    hidden_states: None = None


@dataclass
class _Plan:
    """What one request contributes in one step."""

    row: int  # index of the request in the batch (and of its sampled logits row)
    req: _Request
    first: int  # first captured position
    row_lo: int  # rows of the step's flattened tokens
    row_hi: int
    sampled: bool  # whether the request's sampled row (last scheduled token) is among them
    extra_at: int  # offset of its rows in the extra lm-head pass output


class _Part(NamedTuple):
    """One record kind a spec asks of this rank each step; requests with equal parts share a record.
    (A tuple: it is a dict key on the hot path, and tuples hash in C.)"""

    what: str  # "logits" | "topk" | "chosen" | "hidden"
    to_f32: bool = False
    layer: int = -1
    topk: int = 0
    indices: tuple[int, ...] = ()


@dataclass
class _Request:
    """What the hook keeps per capturing request, worked out once, at its first step."""

    spec: CaptureSpec
    parts: tuple[_Part, ...]
    live: tuple[int, int]  # [first, stop) of the positions it captures
    ref: RequestRef  # its entry in the records' request tables, and that entry packed
    packed: bytes


class _StepRows:
    """The step's plans as arrays, and the row tables of any subset of them (vectorised).

    A row table is what reserve_rows takes: int32 [3, n] of (request slot, position, token id),
    plus the rows' indices into the step's flattened tokens (`flat`) for gathering."""

    def __init__(self, plans: list[_Plan], token_ids: np.ndarray | None, single: bool):
        cols = np.array([(p.row, p.first, p.row_lo, p.row_hi - p.row_lo, p.sampled, p.extra_at) for p in plans],
                        dtype=np.int64).reshape(len(plans), 6).T
        self.row, self.first, self.lo, self.len, sampled, self.extra_at = cols
        self.sampled = sampled.astype(bool)
        # Decode: one row per request, the sampled one: every kind of row table is the same.
        self.single = single
        self.token_ids = token_ids  # host ids of the flattened tokens, when on the host
        self._cache: dict[bytes, tuple] = {}

    def _table(self, slots, flat, pos) -> tuple[np.ndarray, np.ndarray]:
        block = np.empty((3, len(flat)), np.int32)
        block[0], block[1] = slots, pos
        if self.token_ids is not None:
            block[2] = self.token_ids[flat]
        return block, flat

    @staticmethod
    def _expand(slots, flat0, pos0, length, src0):
        """Rows of segments [start, start + length) per plan: (slots, flat rows, positions, source rows)."""
        if len(length) == int(length.sum()):  # one row each: nothing to expand
            return slots, flat0, pos0, src0
        rep = np.repeat(np.arange(len(length)), length)
        off = np.arange(len(rep)) - np.repeat(np.cumsum(length) - length, length)
        return slots[rep], flat0[rep] + off, pos0[rep] + off, src0[rep] + off

    def rows(self, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """All captured rows of the plans in `sel`, in batch order: (row table, flat rows)."""
        key = b"r" + sel.tobytes()
        got = self._cache.get(key)
        if got is None:
            lo = self.lo[sel]
            slots, flat, pos, _ = self._expand(sel, lo, self.first[sel], self.len[sel], lo)
            got = self._cache[key] = self._table(slots, flat, pos)
        return got

    def logit_rows(self, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Logit rows of the plans in `sel`: first those of the extra lm-head pass, then the sampled
        rows. (row table, flat rows, extra-pass rows, sampled logits rows)."""
        if self.single:
            return (*self.rows(sel), _NO_ROWS, self.row[sel])
        key = b"l" + sel.tobytes()
        got = self._cache.get(key)
        if got is None:
            k = self.len[sel] - self.sampled[sel]
            e = sel[k > 0]
            es, ef, ep, ex = self._expand(e, self.lo[e], self.first[e], k[k > 0], self.extra_at[e])
            s = sel[self.sampled[sel]]
            last = self.len[s] - 1
            block, flat = self._table(np.concatenate((es, s)), np.concatenate((ef, self.lo[s] + last)),
                                      np.concatenate((ep, self.first[s] + last)))
            got = self._cache[key] = (block, flat, ex, self.row[s])
        return got


class StepCapture:
    def __init__(self, runner, cfg: ServerCaptureConfig):
        from vllm.distributed import parallel_state as ps

        vc = runner.vllm_config
        tp, pp = ps.get_tp_group(), ps.get_pp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.rank = pp.rank_in_group * self.tp_size + self.tp_rank
        self.is_last_stage = pp.is_last_rank
        n_layers = vc.model_config.hf_text_config.num_hidden_layers
        self.model_dtype = getattr(vc.model_config, "dtype", None)
        # Under pipeline parallelism each stage writes the layers it computes, the last also logits.
        self.stage_layers = [stage_layers(cfg.layers, n_layers, s, pp.world_size) for s in range(pp.world_size)]
        self.layers = self.stage_layers[pp.rank_in_group]
        self.aux_index = {layer: i for i, layer in enumerate(self.layers)}
        self._contributors: dict[CaptureSpec, int] = {}
        self._parts: dict[CaptureSpec, tuple[_Part, ...]] = {}
        path = ring_path(cfg.shm_dir, instance_name(cfg, vc), self.rank)
        self.writer = RingWriter(
            path, cfg.ring_bytes, rank=self.rank, world_size=self.tp_size * pp.world_size,
            mode=0o660 if cfg.group else 0o600, group=cfg.group, block_timeout=cfg.block_timeout_s,
        )
        # A step's rows of one tensor share a record up to this size; beyond it they are split by
        # request, so one huge batch (many prefill chunks of full logits) cannot outgrow the ring.
        self.max_record_bytes = max(cfg.ring_bytes // 8, 1 << 16)
        self.publisher = make_publisher(self.writer, torch.device(runner.device))
        self.requests: dict[str, _Request | None] = {}  # by request id; None: not capturing
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}
        self.step = 0
        self.device = torch.device(runner.device)
        log.info("vllm-tap ring %s (tp rank %d/%d)", path, self.tp_rank, self.tp_size)

    def _spec_of(self, req_state) -> CaptureSpec | None:
        extra = getattr(getattr(req_state, "sampling_params", None), "extra_args", None)
        if not extra or SPEC_EXTRA_ARG not in extra:
            return None
        return CaptureSpec.from_meta(extra[SPEC_EXTRA_ARG])

    def parts(self, spec: CaptureSpec) -> tuple[_Part, ...]:
        """The records this rank writes for a request with this spec each step it captures."""
        got = self._parts.get(spec)
        if got is None:
            # A float32 model's tensors already are float32: such requests share records with the rest.
            to_f32 = spec.dtype == DTypeMode.FLOAT32 and self.model_dtype != torch.float32
            out = []
            if self.is_last_stage and spec.logits == LogitsMode.FULL:
                out.append(_Part("logits", to_f32))
            elif self.is_last_stage and self.tp_rank == 0:
                # Small, and needs the whole row: rank 0 writes it whole.
                if spec.logits == LogitsMode.TOPK:
                    out.append(_Part("topk", to_f32, topk=spec.topk))
                elif spec.logits == LogitsMode.INDICES:
                    out.append(_Part("chosen", to_f32, indices=tuple(spec.indices)))
            out.extend(_Part("hidden", to_f32, layer=x) for x in spec.layers if x in self.aux_index)
            got = self._parts[spec] = tuple(out)
        return got

    def _request(self, rid: str, req_state, num_prompt: int) -> _Request | None:
        spec = self._spec_of(req_state)
        if spec is None:
            return None
        parts = self.parts(spec)
        first = spec.first_position(num_prompt)
        ref = RequestRef(rid, spec.key, num_prompt, self.contributors(spec),
                         sum(2 if x.what == "topk" else 1 for x in parts), -1 if first is None else first,
                         spec.tail, spec.source)
        return _Request(spec, parts, spec.live_range(num_prompt), ref, ref.packed())

    def _plan(self, runner) -> tuple[list[_Plan], list[np.ndarray], bool]:
        """The step's capturing requests, the rows of the extra lm-head pass, and whether every
        plan is one sampled row (a decode step)."""
        ib = runner.input_batch
        req_ids = ib.req_ids
        seen = self.requests
        n_prompt = ib.num_prompt_tokens
        chosen = []
        for i, rid in enumerate(req_ids):
            r = seen.get(rid, _UNSEEN)
            if r is _UNSEEN:
                r = seen[rid] = self._request(rid, runner.requests.get(rid), int(n_prompt[i]))
            if r is not None:
                chosen.append(i)
        if not chosen:
            return [], [], True
        qsl = runner.query_start_loc.np
        computed = ib.num_computed_tokens_cpu
        plans, extra_rows, extra_n, single = [], [], 0, True
        logits_here = self.is_last_stage
        for i in chosen:
            rid = req_ids[i]
            req = seen[rid]
            r0, r1, c = int(qsl[i]), int(qsl[i + 1]), int(computed[i])
            a, b = req.live
            lo, hi = max(a, c), min(b, c + r1 - r0)
            if lo >= hi or not req.parts:
                continue
            row_lo, row_hi = r0 + lo - c, r0 + hi - c
            sampled = row_hi == r1
            single = single and sampled and row_hi - row_lo == 1
            plans.append(_Plan(i, req, lo, row_lo, row_hi, sampled, extra_n))
            if logits_here and req.spec.logits != LogitsMode.NONE:
                # Rows other than the sampled one have no logits yet: one extra lm-head pass.
                k = row_hi - row_lo - int(sampled)
                if k:
                    extra_rows.append(np.arange(row_lo, row_lo + k))
                    extra_n += k
        return plans, extra_rows, single

    def capture(self, runner, state) -> None:
        self.step += 1
        finished = getattr(state.scheduler_output, "finished_req_ids", None)
        if finished:
            for rid in finished:
                self.requests.pop(rid, None)
        plans, extra_rows, single = self._plan(runner)
        if not plans:
            return
        extra = None
        if extra_rows:
            idx = torch.from_numpy(np.concatenate(extra_rows)).to(self.device, non_blocking=True)
            extra = runner.model.compute_logits(state.hidden_states[idx])
        token_src = runner.input_ids.gpu
        # Host ids (CPU) go into the ring with the row table; device ids are gathered by the publisher.
        host_ids = token_src.numpy() if self.device.type == "cpu" else None
        table = RequestTable([p.req.ref for p in plans], [p.req.packed for p in plans])
        rows = _StepRows(plans, host_ids, single)
        # Requests asking for the same part (the usual case: all of them) share its record.
        by_part: dict[_Part, list[int]] = {}
        for j, plan in enumerate(plans):
            for part in plan.req.parts:
                got = by_part.get(part)
                if got is None:
                    by_part[part] = [j]
                else:
                    got.append(j)
        everyone = np.arange(len(plans))
        for part, js in by_part.items():
            sel = everyone if len(js) == len(plans) else np.array(js, dtype=np.int64)
            self._write_part(part, sel, rows, table, state, extra, None if host_ids is not None else token_src)
        self.publisher.end_step()
        self.writer.flush()

    def _shard(self, src: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int], int]:
        full = src.shape[-1]
        if self.tp_size == 1:
            return src, (0, full), full
        s0, s1 = shard(full, self.tp_rank, self.tp_size)
        return src[:, s0:s1], (s0, s1), full

    def _indices_tensor(self, indices: tuple[int, ...]) -> torch.Tensor:
        t = self._indices.get(indices)
        if t is None:
            t = self._indices[indices] = torch.tensor(indices, dtype=torch.long, device=self.device)
        return t

    def _write_part(self, part: _Part, sel: np.ndarray, rows: _StepRows, table: RequestTable, state, extra,
                    device_ids: torch.Tensor | None) -> None:
        """One record (two for top-k) holding this part's rows of the requests in `sel`."""
        if part.what == "hidden":
            block, flat = rows.rows(sel)
            src, sl, full = self._shard(state.aux_hidden_states[self.aux_index[part.layer]])
            records = [(_hidden_id(part.layer), [(src, flat)], sl, full, part.to_f32)]
        else:
            block, flat, extra_idx, sampled_idx = rows.logit_rows(sel)
            segments = []
            if len(extra_idx):
                segments.append((extra, extra_idx))
            if len(sampled_idx):
                segments.append((state.logits, sampled_idx))
            if part.what == "logits":
                segments = [(self._shard(t)[0], i) for t, i in segments]
                _, sl, full = self._shard(state.logits)
                records = [(_LOGITS_ID, segments, sl, full, part.to_f32)]
            else:
                blocks = [gather_rows(t, i) for t, i in segments]
                logits = blocks[0] if len(blocks) == 1 else torch.cat(blocks)  # cat would copy even one
                if part.what == "topk":
                    values, ids = torch.topk(logits, part.topk, dim=-1, sorted=True)
                    k = part.topk
                    records = [(_TOPK_IDS_ID, [(ids.to(torch.int32), None)], (0, k), k, False),
                               (_TOPK_VALUES_ID, [(values, None)], (0, k), k, part.to_f32)]
                else:
                    chosen = logits[:, self._indices_tensor(part.indices)]
                    k = chosen.shape[-1]
                    records = [(_CHOSEN_ID, [(chosen, None)], (0, k), k, part.to_f32)]
        n = block.shape[1]
        for tid, segments, sl, full, to_f32 in records:
            dtype = segments[0][0].dtype
            if to_f32 and dtype.is_floating_point and dtype != torch.float32:
                dtype = torch.float32
            width = sl[1] - sl[0]
            if n > 1 and n * width * dtype.itemsize > self.max_record_bytes:
                # Too big to share a record (many prefill chunks of full logits): one per request.
                self._write_split(tid, segments, sl, full, dtype, block, flat, table, device_ids)
                continue
            res = self.writer.reserve_rows(table, block, tid, dtype=_STORAGE[dtype], width=width, slice_=sl,
                                           full_dim=full, step=self.step)
            if res is not None:
                self.publisher.fill(res, dtype, width, n, segments, None if device_ids is None else (device_ids, flat))

    def _write_split(self, tid, segments, sl, full, dtype, block, flat, table, device_ids) -> None:
        """A record's rows written as one record per request (its rows picked out of each segment)."""
        seg_of_row = np.concatenate([np.full(len(i) if i is not None else t.shape[0], k)
                                     for k, (t, i) in enumerate(segments)])
        seg_start = np.cumsum([0] + [len(i) if i is not None else t.shape[0] for t, i in segments])
        for slot in np.unique(block[0]).tolist():
            mine = np.flatnonzero(block[0] == slot)
            sub_segments = []
            for k, (t, i) in enumerate(segments):
                at = mine[seg_of_row[mine] == k] - seg_start[k]
                if len(at):
                    sub_segments.append((t, at if i is None else i[at]))
            sub = np.ascontiguousarray(block[:, mine])
            res = self.writer.reserve_rows(table, sub, tid, dtype=_STORAGE[dtype], width=sl[1] - sl[0], slice_=sl,
                                           full_dim=full, step=self.step)
            if res is not None:
                self.publisher.fill(res, dtype, sl[1] - sl[0], len(mine), sub_segments,
                                    None if device_ids is None else (device_ids, flat[mine]))

    def contributors(self, spec: CaptureSpec) -> int:
        """How many ranks write records for one of this request's steps (the same on every rank).

        A stage whose part is sharded (full logits, hidden states) has all its tp ranks write;
        a stage with only whole small tensors (top-k, chosen indices) has just its rank 0.
        """
        n = self._contributors.get(spec)
        if n is None:
            n = 0
            last = len(self.stage_layers) - 1
            for s, layers in enumerate(self.stage_layers):
                sharded = any(x in layers for x in spec.layers) or (s == last and spec.logits == LogitsMode.FULL)
                whole = s == last and spec.logits in (LogitsMode.TOPK, LogitsMode.INDICES)
                n += self.tp_size if sharded else int(whole)
            self._contributors[spec] = n
        return n

    def close(self) -> None:
        self.publisher.close()
