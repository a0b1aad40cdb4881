"""API-process side: decide each request's capture before it reaches the engine.

`InputProcessor.process_inputs` runs in the API process for the OpenAI server and offline `LLM`
alike, with the request id vLLM chose (before its random suffix) and the tokenised prompt; a
`VLLMValidationError` raised there becomes an HTTP 400 naming the problem. Here:
  - keys in the tap's reserved namespace (`vllm_tap*`) that a request brings itself are refused:
    only this module writes them, so the engine and workers can trust what they find there;
  - the request's tap* options are checked (HTTP 400 naming the option) and combined with the
    server's capture policy (vllm_tap.policy) into one normalised spec, or none;
  - that spec is stamped into the engine request's own copy of the params (never the caller's
    object, which may be shared by several prompts or requests), with the request's n;
  - a spec that reads prompt positions a prefix-cache hit would skip makes the request bypass the
    cache (cached tokens are never recomputed, so could never be captured); others keep it.
Nothing here may break a request that does not capture: a fault in the tap's own code is logged
and answered with an HTTP 400 naming vllm_xargs, never an exception vLLM does not expect.
"""

from __future__ import annotations

import functools
import logging

from vllm_tap.identity import N_EXTRA_ARG
from vllm_tap.policy import choose_spec
from vllm_tap.spec import CaptureOptionError, CaptureSpec, is_reserved_key, wants_capture
from vllm_tap.windows import shown

from .settings import SPEC_EXTRA_ARG, server_config

log = logging.getLogger("vllm_tap.hooks")


def patch_module(module) -> None:
    cls = module.InputProcessor
    orig_init = cls.__init__
    orig_process = cls.process_inputs

    @functools.wraps(orig_init)
    def __init__(self, vllm_config, *args, **kwargs):
        orig_init(self, vllm_config, *args, **kwargs)
        self._vllm_tap = server_config(vllm_config)
        if self._vllm_tap is not None:
            self._vllm_tap_vocab = vllm_config.model_config.get_vocab_size()
            p = self._vllm_tap.policy
            log.info("vllm-tap enabled: layers %s, instance %r%s%s", list(self._vllm_tap.layers), self._vllm_tap.instance,
                     f", reducers {list(self._vllm_tap.reducer_names)}" if self._vllm_tap.reducers else "",
                     f", policy: {p.share:.2%} of requests, {p.spec.to_meta()}, client options {p.client}" if p else "")

    @functools.wraps(orig_process)
    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        spec = _decide(self, request_id, params)
        request = orig_process(self, request_id, prompt, params, *args, **kwargs)
        if spec is not None:
            _stamp(request, spec)
        return request

    cls.__init__ = __init__
    cls.process_inputs = process_inputs


def _reject(message: str):
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message, parameter="vllm_xargs")


def _decide(proc, request_id: str, params) -> CaptureSpec | None:
    """The spec the engine request gets, None for no capture; VLLMValidationError (HTTP 400)."""
    from vllm.sampling_params import SamplingParams

    server = getattr(proc, "_vllm_tap", None)
    extra = getattr(params, "extra_args", None)
    if server is None:
        if extra and wants_capture(extra):
            # Silently ignoring a capture request would lose data the user asked for.
            raise _reject("capture options (tap*) were given but vllm-tap is not enabled on this server "
                          "(start it with --additional-config '{\"vllm_tap\": {}}')")
        return None  # the tap is off: reserved keys mean nothing to anyone
    if extra:
        reserved = sorted(k for k in extra if is_reserved_key(k))
        if reserved:
            raise _reject(f"{shown(reserved[0])[1:-1]}: reserved for vllm-tap's own use; capture options are the tap* keys")
    if not isinstance(params, SamplingParams):
        if extra and wants_capture(extra):
            raise _reject("capture options (tap*) apply to generation requests only")
        return None
    try:
        return choose_spec(str(request_id), extra, server, getattr(proc, "_vllm_tap_vocab", None))
    except CaptureOptionError as e:
        raise _reject(str(e)) from None
    except Exception:
        log.exception("vllm-tap: could not read the capture options of request %s", request_id)
        raise _reject("vllm-tap could not read this request's capture options (an error in vllm-tap; "
                      "see the server log)") from None


def _stamp(request, spec: CaptureSpec) -> None:
    """Write the spec into the engine request's own copy of the params (process_inputs cloned them)."""
    sp = request.sampling_params
    if request.prompt_token_ids is not None:
        prompt_len = len(request.prompt_token_ids)
    elif getattr(request, "prompt_embeds", None) is not None:
        prompt_len = len(request.prompt_embeds)
    else:
        prompt_len = None
    if spec.reads_prompt(prompt_len) if prompt_len is not None else spec.wants_prompt_rows:
        sp.skip_reading_prefix_cache = True
    # A new dict: the clone may share the caller's dict (vLLM clones shallowly in some paths).
    sp.extra_args = {**(sp.extra_args or {}), SPEC_EXTRA_ARG: spec.to_meta(), N_EXTRA_ARG: int(sp.n or 1)}
