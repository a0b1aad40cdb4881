"""API-process side: validate each request's capture options before it reaches the engine.

`InputProcessor._validate_params` runs in the API process for the OpenAI server and offline
`LLM` alike, before the params are cloned into the engine request, and a `VLLMValidationError`
raised there becomes an HTTP 400 naming the problem. We also normalise the options once here
(the spec the engine and workers read) and make prompt captures bypass the prefix cache, because
cached prompt tokens are never recomputed and so could never be captured.
"""

from __future__ import annotations

import functools
import logging

from vllm_tap.hooks.settings import SPEC_EXTRA_ARG, server_config
from vllm_tap.identity import N_EXTRA_ARG
from vllm_tap.spec import CaptureOptionError, parse_capture_spec, wants_capture

log = logging.getLogger("vllm_tap.hooks")


def patch_module(module) -> None:
    cls = module.InputProcessor
    orig_init = cls.__init__
    orig_validate = cls._validate_params

    @functools.wraps(orig_init)
    def __init__(self, vllm_config, *args, **kwargs):
        orig_init(self, vllm_config, *args, **kwargs)
        self._vllm_tap = server_config(vllm_config)
        if self._vllm_tap is not None:
            log.info("vllm-tap enabled: layers %s, instance %r", list(self._vllm_tap.layers), self._vllm_tap.instance)

    @functools.wraps(orig_validate)
    def _validate_params(self, params, *args, **kwargs):
        result = orig_validate(self, params, *args, **kwargs)
        extra = getattr(params, "extra_args", None)
        if extra and wants_capture(extra):
            _apply_capture_options(self, params, extra)
        return result

    cls.__init__ = __init__
    cls._validate_params = _validate_params


def _apply_capture_options(proc, params, extra: dict) -> None:
    from vllm.exceptions import VLLMValidationError

    server = getattr(proc, "_vllm_tap", None)
    if server is None:
        # Silently ignoring a capture request would lose data the user asked for.
        raise VLLMValidationError(
            "capture options (tap*) were given but vllm-tap is not enabled on this server "
            "(start it with --additional-config '{\"vllm_tap\": {}}')",
            parameter="vllm_xargs",
        )
    vocab = proc.model_config.get_vocab_size()
    try:
        spec = parse_capture_spec(extra, server, vocab)
    except CaptureOptionError as e:
        raise VLLMValidationError(str(e), parameter="vllm_xargs") from None
    if spec is None:
        return
    if spec.wants_prompt_rows:
        params.skip_reading_prefix_cache = True
    # A new dict rather than an update: the caller's dict may be shared with other requests.
    params.extra_args = {**extra, SPEC_EXTRA_ARG: spec.to_meta(), N_EXTRA_ARG: int(getattr(params, "n", 1) or 1)}
