"""API-process start-up: check the tap's settings before vLLM starts any engine process.

`EngineArgs.create_engine_config` runs first thing in the process that parses vLLM's arguments,
so a bad setting fails here in seconds, not after the model has loaded in every worker. For the
OpenAI server (AsyncEngineArgs) the failure is one line on stderr and a non-zero exit; offline
`LLM(...)` raises, as Python callers expect.
"""

from __future__ import annotations

import functools
import logging
import os

from vllm_tap.hooks import preflight
from vllm_tap.hooks.settings import TapConfigError, server_config
from vllm_tap.spec import SERVER_CONFIG_KEY

log = logging.getLogger("vllm_tap.hooks")
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def patch_module(module) -> None:
    cls = module.EngineArgs
    orig = cls.create_engine_config

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        wants_tap = SERVER_CONFIG_KEY in (getattr(self, "additional_config", None) or {})
        if wants_tap and V2_RUNNER_ENV not in os.environ:
            # The hook supports the V1 runner; child processes inherit the choice.
            os.environ[V2_RUNNER_ENV] = "0"
            log.info("vllm-tap: using vLLM's V1 model runner (%s=0)", V2_RUNNER_ENV)
        config = orig(self, *args, **kwargs)
        if wants_tap:
            try:
                preflight.check(config, server_config(config))
                if config.speculative_config is not None:
                    raise TapConfigError("vllm-tap: speculative decoding is not supported with the tap enabled")
            except TapConfigError as e:
                if type(self).__name__ == "AsyncEngineArgs":
                    raise SystemExit(f"error: {e}") from None
                raise
        return config

    cls.create_engine_config = create_engine_config
