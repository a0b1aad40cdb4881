"""Adapter for vLLM's V1 model runner (`v1/worker/gpu_model_runner.py`, and the CPU runner that
subclasses it): patches and the step view.

V1 computes the step's logits in execute_model and keeps everything in `execute_model_state` until
sample_tokens, so one hook at the top of sample_tokens sees the raw logits (before the grammar mask,
which sample_tokens applies in place), the final and auxiliary hidden states, and the batch
(`input_batch`, `query_start_loc`, `requests`). Hook points, identical in 0.26, 0.32 and 0.33:
- `load_model` (the CPU runner overrides it without calling the GPU runner's: both are wrapped);
- `_update_states(scheduler_output)`, at the top of every execute_model: after it, the requests it
  added (`scheduled_new_reqs`, now in `runner.requests` with their sampling params and prompt
  length) are learned and `finished_req_ids` forgotten. (A preempted request keeps its cached state
  under V1 and comes back through `scheduled_cached_reqs`: it stays learned.)
- `sample_tokens(grammar_output)`: capture, then the original;
- `execute_model` on a non-last pipeline stage: capture its layers' aux outputs and take them out
  of the IntermediateTensors it returns.
So a step never walks the batch to find its capturing requests: the view gives the core
`input_batch.req_id_to_index` and the core looks up only the requests it captures for.
"""

from __future__ import annotations

import functools
from time import perf_counter_ns

from . import guard
from .capture_core import StepView, host_ids
from .runner_patch import pop_stage_aux, wrap_load


def step_view(runner, state, *, aux=None, stage: bool = False) -> StepView:
    """The step as V1 holds it at the top of sample_tokens (or, for a non-last pipeline stage, right
    after execute_model: then `aux` is what the stage returned and there are no logits)."""
    ib = runner.input_batch
    return StepView(
        req_ids=ib.req_ids,
        row_of=ib.req_id_to_index,
        query_start=runner.query_start_loc.np,
        computed=ib.num_computed_tokens_cpu,
        # V1's device ids: under async scheduling decode rows' ids are written there from the
        # previous step's sampled tokens, which the host may not have yet.
        token_ids=host_ids(runner.input_ids.gpu),
        hidden=None if stage else state.hidden_states,
        aux=aux if stage else state.aux_hidden_states,
        logits=None if stage else state.logits,
        compute_logits=runner.model.compute_logits,
    )


def learn_and_forget(runner, core, scheduler_output) -> None:
    """After _update_states: the requests it admitted and the ones it dropped for good."""
    for rid in scheduler_output.finished_req_ids:
        core.forget(rid)
    requests = runner.requests
    for new in scheduler_output.scheduled_new_reqs:
        rid = new.req_id
        r = requests.get(rid)
        extra = getattr(getattr(r, "sampling_params", None), "extra_args", None)
        if not extra:
            core.forget(rid)
            continue
        core.learn(rid, extra, int(r.num_prompt_tokens))


def patch_gpu_module(module) -> None:
    cls = module.GPUModelRunner
    wrap_load(cls, v2=False)

    orig_update = cls._update_states

    @functools.wraps(orig_update)
    def _update_states(self, scheduler_output, *args, **kwargs):
        out = orig_update(self, scheduler_output, *args, **kwargs)
        core = getattr(self, "_vllm_tap", None)
        if core is not None and (scheduler_output.scheduled_new_reqs or scheduler_output.finished_req_ids):
            guard.run("learning requests (V1 _update_states)", learn_and_forget, self, core, scheduler_output)
        return out

    cls._update_states = _update_states
    orig_sample = cls.sample_tokens

    @functools.wraps(orig_sample)
    def sample_tokens(self, grammar_output, *args, **kwargs):
        core = getattr(self, "_vllm_tap", None)
        # Nobody capturing (the usual step): one attribute read and one truth test, nothing built.
        if core is not None and core.requests and self.execute_model_state is not None:
            t0 = perf_counter_ns()
            guard.run("capture (V1 sample_tokens)", lambda: core.capture(step_view(self, self.execute_model_state)))
            core.cost.add(perf_counter_ns() - t0)
        return orig_sample(self, grammar_output, *args, **kwargs)

    cls.sample_tokens = sample_tokens

    orig_execute = cls.execute_model

    @functools.wraps(orig_execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        out = orig_execute(self, scheduler_output, *args, **kwargs)
        core = getattr(self, "_vllm_tap", None)
        if core is not None and not core.is_last_stage and hasattr(out, "tensors"):
            aux = guard.run("taking aux outputs off a pipeline stage", pop_stage_aux, self.get_model(), out)
            if aux is not None and core.requests:
                guard.run("capture (V1 pipeline stage)",
                          lambda: core.capture(step_view(self, scheduler_output, aux=aux, stage=True)))
        return out

    cls.execute_model = execute_model


def patch_cpu_module(module) -> None:
    # CPUModelRunner overrides load_model without calling the GPU runner's.
    if "load_model" in module.CPUModelRunner.__dict__:
        wrap_load(module.CPUModelRunner, v2=False)
