"""API-process start-up: check the tap's settings before vLLM starts any engine process.

`EngineArgs.create_engine_config` runs first thing in the process that parses vLLM's arguments,
so a bad setting fails here in seconds, not after the model has loaded in every worker. For the
OpenAI server (AsyncEngineArgs) the failure is one line on stderr and a non-zero exit; offline
`LLM(...)` raises, as Python callers expect.

The model runner is vLLM's choice (V2 by default on GPU since 0.29, V1 on the CPU wheel); the tap
hooks both. What it cannot capture under the chosen runner, or an unsupported vLLM version, stops
start-up here (hooks/support.py).
"""

from __future__ import annotations

import functools
import logging

from vllm_tap.spec import SERVER_CONFIG_KEY

from . import preflight, support
from .settings import TapConfigError, server_config
from .vllm_logging import log_like_vllm

log = logging.getLogger("vllm_tap.hooks")


def patch_module(module) -> None:
    cls = module.EngineArgs
    orig = cls.create_engine_config

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        wants_tap = SERVER_CONFIG_KEY in (getattr(self, "additional_config", None) or {})
        if wants_tap:
            try:
                support.check_version(support.vllm_version())
            except TapConfigError as e:
                if type(self).__name__ == "AsyncEngineArgs":
                    raise SystemExit(f"error: {e}") from None
                raise
        config = orig(self, *args, **kwargs)
        if wants_tap:
            log_like_vllm()  # the API server configures vLLM's logging after the plugin loaded
            try:
                cfg = server_config(config)
                if cfg is not None:
                    support.check_config(config, cfg.aux_layers)
                    preflight.check(config, cfg)
                    log.info("vllm-tap: %s model runner", "V2" if support.uses_v2_runner(config) else "V1")
            except TapConfigError as e:
                if type(self).__name__ == "AsyncEngineArgs":
                    raise SystemExit(f"error: {e}") from None
                raise
        return config

    cls.create_engine_config = create_engine_config
