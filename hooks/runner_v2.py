"""Adapter for vLLM's V2 model runner (`v1/worker/gpu/model_runner.py`, the GPU default since 0.29,
and its CPU subclass `v1/worker/cpu/model_runner.py`, which overrides none of the methods below).

Where V2 keeps what the tap needs (0.33 line numbers; 0.26 has the same names and fields):
- requests: V2 keeps no per-request sampling params. It sees a request's params only in
  `add_requests(scheduler_output)` (:1215), from `scheduled_new_reqs`, into which the scheduler also
  folds resumed (preempted) requests under V2 (`v1/core/sched/scheduler.py:1642-1653`); it drops a
  request in `_remove_request(req_id)` (:1170), called for finished and preempted ids
  (`finish_requests`, :1188) and before a streaming-input re-add. We learn the spec after the
  original add_requests (the prompt length from `req_states.prompt_len`, where V2 just put it) and
  forget in _remove_request.
- the step: `execute_model` stores `execute_model_state` (:2475: input_batch, hidden_states,
  aux_hidden_states, …; no logits) and `sample_tokens` (:2149) reads and clears it first thing. The
  batch is `input_batch` (`input_batch.py`): req_ids, query_start_loc_np, num_computed_tokens_np
  (exact without speculative decoding, which the tap refuses), input_ids (a device view; decode
  rows' ids are written there on the device from `req_states.last_sampled_tokens`, so they are
  gathered on the device).
- raw logits exist only inside `sample()` (:1633): `self.model.compute_logits(hidden[logits_indices])`
  (:1656), one row per request in batch order, then the grammar bitmask is applied to that tensor in
  place (:1661-1668) and the sampler copies it (to float32) before anything else changes it. So
  while sample() runs (and only then: `_dummy_sampler_run` and the prompt-logprobs worker call
  compute_logits too) the model's compute_logits is wrapped, and its first result is copied at once,
  before the mask kernel is queued behind it.
- pipeline parallelism: a non-last stage returns IntermediateTensors from execute_model (through
  `pp_handler.relay_aux_hidden_states`, a no-op without relay keys): its aux outputs are captured
  and taken out there, as with V1. sample_tokens then only receives the sampled tokens.

So per step: sample_tokens (top) plans the step and writes the hidden states; sample() writes the
logits; sample_tokens (after the original) ends the step. Every wrapped method runs the tap's part
under guard.run: an error there costs that step's capture, never the server.
"""

from __future__ import annotations

import functools
from time import perf_counter_ns

import numpy as np

from . import guard
from .capture_core import CaptureCore, CaptureStep, StepView, host_ids
from .runner_patch import pop_stage_aux, wrap_load


class SlotRows:
    """request id -> batch row under V2, without walking the batch in Python: the request's slot in
    `req_states` (`req_id_to_index`) through the inverse of `input_batch.idx_mapping_np` (batch row
    -> slot), built by numpy once per step and only when some request captures."""

    __slots__ = ("_slots", "_mapping", "_inverse")

    def __init__(self, slots, mapping):
        self._slots = slots
        self._mapping = mapping
        self._inverse = None

    def _inv(self) -> np.ndarray:
        inv = self._inverse
        if inv is None:
            m = self._mapping
            inv = np.full(int(m.max()) + 1 if len(m) else 0, -1, np.int64)
            inv[m] = np.arange(len(m))
            self._inverse = inv
        return inv

    def get(self, rid, default=None):
        slot = self._slots.get(rid)
        if slot is None:
            return default
        inv = self._inv()
        if slot >= len(inv) or inv[slot] < 0:
            return default
        return int(inv[slot])

    def many(self, rids) -> list:
        """The batch row of each of `rids` (None: not in this step): one dict lookup each, the rest
        one numpy pass."""
        get = self._slots.get
        slots = np.array([get(r, -1) for r in rids], np.int64)
        inv = self._inv()
        ok = (slots >= 0) & (slots < len(inv))
        rows = np.full(len(slots), -1, np.int64)
        rows[ok] = inv[slots[ok]]
        return [None if r < 0 else r for r in rows.tolist()]


def step_view(runner, state, *, aux=None, stage: bool = False) -> StepView:
    """The step as V2 holds it in `execute_model_state` (logits come later, inside sample())."""
    ib = state.input_batch
    n = ib.num_reqs
    mapping = getattr(ib, "idx_mapping_np", None)
    return StepView(
        req_ids=ib.req_ids[:n],
        row_of=None if mapping is None else SlotRows(runner.req_states.req_id_to_index, mapping[:n]),
        query_start=ib.query_start_loc_np,
        computed=ib.num_computed_tokens_np,
        token_ids=host_ids(ib.input_ids[: ib.num_tokens]),
        hidden=None if stage else state.hidden_states,
        aux=aux if stage else state.aux_hidden_states,
        logits=None,
        compute_logits=runner.model.compute_logits,
    )


def learn_new_requests(runner, core: CaptureCore, scheduler_output) -> None:
    rs = runner.req_states
    for new in scheduler_output.scheduled_new_reqs:
        rid = new.req_id
        sp = getattr(new, "sampling_params", None)
        extra = getattr(sp, "extra_args", None)
        if not extra:
            core.forget(rid)
            continue
        core.learn(rid, extra, int(rs.prompt_len.np[rs.req_id_to_index[rid]]))


def _begin(runner, core: CaptureCore) -> CaptureStep | None:
    step = core.begin(step_view(runner, runner.execute_model_state))
    if step is not None:
        try:
            step.write_states()
        except BaseException:
            step.abandon()  # records it reserved must not wait in the ring for a commit
            raise
    return step


def _end(core: CaptureCore, step: CaptureStep) -> None:
    core.end(step)


def patch_v2_module(module) -> None:
    cls = module.GPUModelRunner
    wrap_load(cls, v2=True)

    orig_add = cls.add_requests

    @functools.wraps(orig_add)
    def add_requests(self, scheduler_output, *args, **kwargs):
        out = orig_add(self, scheduler_output, *args, **kwargs)
        core = getattr(self, "_vllm_tap", None)
        if core is not None and scheduler_output.scheduled_new_reqs:
            guard.run("learning new requests (V2 add_requests)", learn_new_requests, self, core, scheduler_output)
        return out

    cls.add_requests = add_requests

    orig_remove = cls._remove_request

    @functools.wraps(orig_remove)
    def _remove_request(self, req_id, *args, **kwargs):
        core = getattr(self, "_vllm_tap", None)
        if core is not None:
            guard.run("forgetting a request (V2 _remove_request)", core.forget, req_id)
        return orig_remove(self, req_id, *args, **kwargs)

    cls._remove_request = _remove_request

    orig_sample_tokens = cls.sample_tokens

    @functools.wraps(orig_sample_tokens)
    def sample_tokens(self, grammar_output, *args, **kwargs):
        core = getattr(self, "_vllm_tap", None)
        # Nobody capturing (the usual step): one attribute read and one truth test, nothing built.
        if (core is None or not core.requests or not core.is_last_stage
                or getattr(self, "execute_model_state", None) is None):
            return orig_sample_tokens(self, grammar_output, *args, **kwargs)
        t0 = perf_counter_ns()
        step = guard.run("capture (V2 sample_tokens)", _begin, self, core)
        if step is None:
            core.cost.add(perf_counter_ns() - t0)
            return orig_sample_tokens(self, grammar_output, *args, **kwargs)
        self._vllm_tap_step = step
        spent = perf_counter_ns() - t0
        try:
            return orig_sample_tokens(self, grammar_output, *args, **kwargs)
        finally:
            t1 = perf_counter_ns()
            self._vllm_tap_step = None
            guard.run("capture (V2 end of step)", _end, core, step, on_error=step.abandon)
            core.cost.add(spent + step.logits_ns + perf_counter_ns() - t1)

    cls.sample_tokens = sample_tokens

    orig_sample = cls.sample

    @functools.wraps(orig_sample)
    def sample(self, hidden_states, input_batch, grammar_output, *args, **kwargs):
        step = getattr(self, "_vllm_tap_step", None)
        if step is None or not step.wants_logits or step.logits_done:
            return orig_sample(self, hidden_states, input_batch, grammar_output, *args, **kwargs)
        model = self.model
        shadowed = model.__dict__.get("compute_logits")
        lm_head = model.compute_logits

        def compute_logits(h, *a, **kw):
            logits = lm_head(h, *a, **kw)
            if not step.logits_done:
                # Queued on the stream before the grammar mask, which modifies `logits` in place.
                t0 = perf_counter_ns()
                guard.run("capture (V2 logits)", step.write_logits, logits, on_error=step.abandon)
                step.logits_ns = perf_counter_ns() - t0
            return logits

        model.compute_logits = compute_logits
        try:
            return orig_sample(self, hidden_states, input_batch, grammar_output, *args, **kwargs)
        finally:
            if shadowed is None:
                del model.compute_logits
            else:
                model.compute_logits = shadowed

    cls.sample = sample

    orig_execute = cls.execute_model

    @functools.wraps(orig_execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        out = orig_execute(self, scheduler_output, *args, **kwargs)
        core = getattr(self, "_vllm_tap", None)
        if (core is not None and not core.is_last_stage and hasattr(out, "tensors")
                and not kwargs.get("dummy_run", False)):
            aux = guard.run("taking aux outputs off a pipeline stage", pop_stage_aux, self.get_model(), out)
            state = getattr(self, "execute_model_state", None)
            if aux is not None and state is not None and core.requests:
                guard.run("capture (V2 pipeline stage)",
                          lambda: core.capture(step_view(self, state, aux=aux, stage=True)))
        return out

    cls.execute_model = execute_model
