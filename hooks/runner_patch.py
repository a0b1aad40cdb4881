"""Model-runner side: turn on per-layer hidden-state outputs at load, capture each step.

Hidden states come from the auxiliary hidden-state outputs vLLM built for EAGLE-3: the model
returns the residual stream after the chosen layers as extra outputs of its (compiled, possibly
CUDA-graphed) forward. Enabling them right after load_model, before compilation and graph
capture, makes them ordinary graph outputs, so capture needs no eager mode and no forward hooks.
"""

from __future__ import annotations

import functools
import logging

from vllm_tap.hooks.settings import TapConfigError, server_config

log = logging.getLogger("vllm_tap.hooks")


def _after_load(runner) -> None:
    if getattr(runner, "_vllm_tap_loaded", False):
        return
    runner._vllm_tap_loaded = True
    runner._vllm_tap = None
    cfg = server_config(runner.vllm_config)
    if cfg is None:
        return
    if runner.vllm_config.speculative_config is not None:
        raise TapConfigError("vllm-tap: speculative decoding is not supported with the tap enabled")
    from vllm_tap.hooks.step_capture import StepCapture

    tap = StepCapture(runner, cfg)
    if cfg.layers:
        from vllm.model_executor.models.interfaces import supports_eagle3

        model = runner.get_model()
        if not supports_eagle3(model):
            tap.close()
            raise TapConfigError(
                f"vllm-tap: {type(model).__name__} has no auxiliary hidden-state outputs (the EAGLE-3 "
                "interface), so its hidden states cannot be captured; set \"layers\": \"none\" for logits only"
            )
        # Each pipeline stage emits only the layers it computes. The runner unpacks aux outputs on
        # every stage once the flag is set, so only the last stage sets it; earlier stages return
        # theirs inside IntermediateTensors, where execute_model below takes them out.
        model.set_aux_hidden_state_layers(tap.layers)
        runner.use_aux_hidden_state_outputs = tap.is_last_stage and bool(tap.layers)
    runner._vllm_tap = tap


def _wrap_load(cls) -> None:
    orig = cls.load_model

    @functools.wraps(orig)
    def load_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        _after_load(self)
        return out

    cls.load_model = load_model


def patch_gpu_module(module) -> None:
    cls = module.GPUModelRunner
    _wrap_load(cls)
    orig_sample = cls.sample_tokens

    @functools.wraps(orig_sample)
    def sample_tokens(self, grammar_output):
        tap = getattr(self, "_vllm_tap", None)
        if tap is not None and self.execute_model_state is not None:
            tap.capture(self, self.execute_model_state)
        return orig_sample(self, grammar_output)

    cls.sample_tokens = sample_tokens

    orig_execute = cls.execute_model

    @functools.wraps(orig_execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        out = orig_execute(self, scheduler_output, *args, **kwargs)
        tap = getattr(self, "_vllm_tap", None)
        if tap is not None and not tap.is_last_stage and hasattr(out, "tensors"):
            _capture_stage(self, tap, scheduler_output, out)
        return out

    cls.execute_model = execute_model


def _capture_stage(runner, tap, scheduler_output, out) -> None:
    """A non-last pipeline stage: capture its layers and keep them off the pipeline link."""
    from vllm_tap.hooks.step_capture import StageOutput

    prefix = getattr(runner.get_model(), "AUX_HIDDEN_STATE_KEY", "aux_hidden_states_")
    keys = sorted((k for k in out.tensors if k.startswith(prefix)), key=lambda k: int(k[len(prefix):]))
    aux = [out.tensors.pop(k) for k in keys]
    tap.capture(runner, StageOutput(scheduler_output, aux))


def patch_cpu_module(module) -> None:
    # CPUModelRunner overrides load_model without calling the GPU runner's.
    if "load_model" in module.CPUModelRunner.__dict__:
        _wrap_load(module.CPUModelRunner)


def patch_v2_module(module) -> None:
    cls = module.GPUModelRunner
    orig = cls.load_model

    @functools.wraps(orig)
    def load_model(self, *args, **kwargs):
        if server_config(self.vllm_config) is not None:
            raise TapConfigError(
                "vllm-tap: the V2 model runner is not supported yet; start vLLM with VLLM_USE_V2_MODEL_RUNNER=0"
            )
        return orig(self, *args, **kwargs)

    cls.load_model = load_model
