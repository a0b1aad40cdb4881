"""Per-step capture inside a model-runner worker: pick the opted-in rows and copy them out.

Called at the top of `sample_tokens`, when the step's raw logits, final hidden states and the
auxiliary per-layer hidden states all exist and nothing (grammar masks, logits processors,
penalties) has touched the logits yet. The work per step is one dict lookup per scheduled request,
then, per capturing request, a handful of tensor slices and copies: no per-token Python, no device
sync. Under tensor parallelism every rank holds the full logits and residual stream; each rank
copies only its 1/tp share of the last dimension, so the copy volume is split and no collective
is added. The one collective we may add is the extra lm-head pass for prompt positions, which
every rank runs identically, as vLLM's own compute_logits requires.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from vllm_tap import ring_format as rf
from vllm_tap.hooks.publisher import make_publisher
from vllm_tap.hooks.settings import SPEC_EXTRA_ARG, instance_name
from vllm_tap.records import TensorId
from vllm_tap.ring import RingWriter, ring_path
from vllm_tap.spec import CaptureSpec, DTypeMode, LogitsMode, ServerCaptureConfig

log = logging.getLogger("vllm_tap.hooks")

_UNSEEN = object()
_STORAGE = {torch.float32: rf.DType.FLOAT32, torch.float16: rf.DType.FLOAT16,
            torch.bfloat16: rf.DType.BFLOAT16, torch.int32: rf.DType.INT32}


_LOGITS_ID = TensorId(rf.TensorKind.LOGITS)
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
    request_id: str
    spec: CaptureSpec
    first: int  # first captured position
    row_lo: int  # rows of the step's flattened tokens
    row_hi: int
    num_prompt: int
    sampled: bool  # whether the request's sampled row (last scheduled token) is among them
    extra_at: int  # offset of its rows in the extra lm-head pass output


class StepCapture:
    def __init__(self, runner, cfg: ServerCaptureConfig):
        from vllm.distributed import parallel_state as ps

        vc = runner.vllm_config
        tp, pp = ps.get_tp_group(), ps.get_pp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.rank = pp.rank_in_group * self.tp_size + self.tp_rank
        self.is_last_stage = pp.is_last_rank
        n_layers = vc.model_config.hf_text_config.num_hidden_layers
        # Under pipeline parallelism each stage writes the layers it computes, the last also logits.
        self.stage_layers = [stage_layers(cfg.layers, n_layers, s, pp.world_size) for s in range(pp.world_size)]
        self.layers = self.stage_layers[pp.rank_in_group]
        self.aux_index = {layer: i for i, layer in enumerate(self.layers)}
        self._contributors: dict[CaptureSpec, int] = {}
        path = ring_path(cfg.shm_dir, instance_name(cfg, vc), self.rank)
        self.writer = RingWriter(
            path, cfg.ring_bytes, rank=self.rank, world_size=self.tp_size * pp.world_size,
            mode=0o660 if cfg.group else 0o600, group=cfg.group, block_timeout=cfg.block_timeout_s,
        )
        self.publisher = make_publisher(self.writer, torch.device(runner.device))
        self.specs: dict[str, CaptureSpec | None] = {}
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}
        self.step = 0
        self.device = torch.device(runner.device)
        log.info("vllm-tap ring %s (tp rank %d/%d)", path, self.tp_rank, self.tp_size)

    def _spec_of(self, req_state) -> CaptureSpec | None:
        extra = getattr(getattr(req_state, "sampling_params", None), "extra_args", None)
        if not extra or SPEC_EXTRA_ARG not in extra:
            return None
        return CaptureSpec.from_meta(extra[SPEC_EXTRA_ARG])

    def _plan(self, runner) -> tuple[list[_Plan], list[np.ndarray]]:
        ib = runner.input_batch
        req_ids = ib.req_ids
        specs = self.specs
        chosen = []
        for i, rid in enumerate(req_ids):
            s = specs.get(rid, _UNSEEN)
            if s is _UNSEEN:
                s = specs[rid] = self._spec_of(runner.requests.get(rid))
            if s is not None:
                chosen.append(i)
        if not chosen:
            return [], []
        qsl = runner.query_start_loc.np
        computed = ib.num_computed_tokens_cpu
        n_prompt = ib.num_prompt_tokens
        plans, extra_rows, extra_n = [], [], 0
        for i in chosen:
            rid = req_ids[i]
            spec = specs[rid]
            r0, r1, c, p = int(qsl[i]), int(qsl[i + 1]), int(computed[i]), int(n_prompt[i])
            a, b = spec.live_range(p)
            lo, hi = max(a, c), min(b, c + r1 - r0)
            if lo >= hi:
                continue
            row_lo, row_hi = r0 + lo - c, r0 + hi - c
            sampled = row_hi == r1
            plan = _Plan(i, rid, spec, lo, row_lo, row_hi, p, sampled, extra_n)
            if spec.logits != LogitsMode.NONE and self.is_last_stage:
                # Rows other than the sampled one have no logits yet: one extra lm-head pass.
                k = row_hi - row_lo - int(sampled)
                if k:
                    extra_rows.append(np.arange(row_lo, row_lo + k))
                    extra_n += k
            plans.append(plan)
        return plans, extra_rows

    def capture(self, runner, state) -> None:
        self.step += 1
        finished = getattr(state.scheduler_output, "finished_req_ids", None)
        if finished:
            for rid in finished:
                self.specs.pop(rid, None)
        plans, extra_rows = self._plan(runner)
        if not plans:
            return
        extra = None
        if extra_rows:
            idx = torch.from_numpy(np.concatenate(extra_rows)).to(self.device, non_blocking=True)
            extra = runner.model.compute_logits(state.hidden_states[idx])
        token_src = runner.input_ids.gpu
        if self.device.type == "cpu":
            token_src = token_src.numpy()  # host ids: sliced per request as numpy, stored by the writer
        for plan in plans:
            self._write_plan(plan, state, extra, token_src[plan.row_lo : plan.row_hi])
        self.publisher.end_step()
        self.writer.flush()

    def _logit_parts(self, plan: _Plan, state, extra) -> list[torch.Tensor]:
        """The plan's logit rows in position order: rows of the extra pass, then the sampled row."""
        parts = []
        k = plan.row_hi - plan.row_lo - int(plan.sampled)
        if k:
            parts.append(extra[plan.extra_at : plan.extra_at + k])
        if plan.sampled:
            parts.append(state.logits[plan.row : plan.row + 1])
        return parts

    def _logit_rows(self, plan: _Plan, state, extra) -> torch.Tensor:
        parts = self._logit_parts(plan, state, extra)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _indices_tensor(self, indices: tuple[int, ...]) -> torch.Tensor:
        t = self._indices.get(indices)
        if t is None:
            t = self._indices[indices] = torch.tensor(indices, dtype=torch.long, device=self.device)
        return t

    def _tensors(self, plan: _Plan, state, extra) -> list[tuple[TensorId, torch.Tensor | list[torch.Tensor], bool]]:
        """(tensor id, source rows [n, full_dim] or row blocks of them, whether to shard across tp ranks)."""
        spec = plan.spec
        out: list[tuple[TensorId, torch.Tensor | list[torch.Tensor], bool]] = []
        if spec.logits != LogitsMode.NONE and self.is_last_stage:
            if spec.logits == LogitsMode.FULL:
                # Full rows go to the ring block by block: concatenating them first would be one more
                # copy of the largest thing captured, into freshly allocated memory.
                parts = self._logit_parts(plan, state, extra)
                out.append((_LOGITS_ID, parts[0] if len(parts) == 1 else parts, True))
            elif self.tp_rank == 0:
                logits = self._logit_rows(plan, state, extra)
                # Small, and needs the whole row: rank 0 writes it whole.
                if spec.logits == LogitsMode.TOPK:
                    values, ids = torch.topk(logits, spec.topk, dim=-1, sorted=True)
                    out.append((TensorId(rf.TensorKind.TOPK_IDS), ids.to(torch.int32), False))
                    out.append((TensorId(rf.TensorKind.TOPK_VALUES), values, False))
                else:
                    out.append((TensorId(rf.TensorKind.CHOSEN), logits[:, self._indices_tensor(spec.indices)], False))
        aux = state.aux_hidden_states
        for layer in spec.layers:
            if layer not in self.aux_index:
                continue  # another pipeline stage computes it
            src = aux[self.aux_index[layer]][plan.row_lo : plan.row_hi]
            out.append((_hidden_id(layer), src, True))
        return out

    def _write_plan(self, plan: _Plan, state, extra, token_ids: torch.Tensor | np.ndarray) -> None:
        tensors = self._tensors(plan, state, extra)
        if not tensors:
            return
        expected = self.contributors(plan.spec)
        positions = np.arange(plan.first, plan.first + plan.row_hi - plan.row_lo, dtype=np.int32)
        # Token ids already on the host go into the ring with the record header (a byte store);
        # ids on an accelerator are copied by the publisher, behind the step's other copies.
        host = isinstance(token_ids, np.ndarray)
        host_ids = token_ids if host else None
        dev_ids = None if host else token_ids
        sharding = self.tp_size > 1
        to_f32 = plan.spec.dtype == DTypeMode.FLOAT32
        srcs, parts = [], []
        for tid, src, sharded in tensors:
            if isinstance(src, list):  # row blocks (full logits of a prefill chunk), stacked in the ring
                if to_f32:
                    src = [p.float() if p.is_floating_point() and p.dtype != torch.float32 else p for p in src]
                first = src[0]
            else:
                if to_f32 and src.is_floating_point() and src.dtype != torch.float32:
                    src = src.float()
                first = src
            full = first.shape[-1]
            s0, s1 = shard(full, self.tp_rank, self.tp_size) if sharded and sharding else (0, full)
            # Unsharded (tp=1): the whole row, without the cost of a no-op slice per tensor.
            if s1 - s0 != full:
                src = [p[:, s0:s1] for p in src] if isinstance(src, list) else src[:, s0:s1]
            srcs.append(src)
            parts.append((tid, _STORAGE[first.dtype], s1 - s0, (s0, s1), full))
        # One reservation call for the request's tensors: the same records as one reserve() each.
        reservations = self.writer.reserve_many(
            plan.request_id, positions, host_ids, parts, step=self.step, tap_key=plan.spec.key,
            num_prompt_tokens=plan.num_prompt, expected_ranks=expected, rank_parts=len(tensors),
        )
        for res, src in zip(reservations, srcs):
            if res is not None:
                self.publisher.copy(res, src, dev_ids)

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
