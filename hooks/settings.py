"""The server-wide tap settings as seen from inside a vLLM process."""

from __future__ import annotations

from typing import Any

from vllm_tap.spec import CaptureOptionError, ServerCaptureConfig

# Keys the API process adds to a capturing request's extra_args, read by the engine and workers.
SPEC_EXTRA_ARG = "vllm_tap_spec"


class TapConfigError(RuntimeError):
    """Bad server settings: vLLM must not start. The message is one line naming the setting."""


def num_layers(vllm_config: Any) -> int:
    return int(vllm_config.model_config.hf_text_config.num_hidden_layers)


def server_config(vllm_config: Any) -> ServerCaptureConfig | None:
    """The tap's settings, or None when it is not enabled (the plugin then does nothing)."""
    try:
        return ServerCaptureConfig.from_additional_config(
            getattr(vllm_config, "additional_config", None), num_layers(vllm_config)
        )
    except CaptureOptionError as e:
        raise TapConfigError(f"vllm-tap: {e}") from None


def instance_name(cfg: ServerCaptureConfig, vllm_config: Any) -> str:
    """Each data-parallel engine gets its own instance directory; its rank ids restart at 0."""
    pc = vllm_config.parallel_config
    if pc.data_parallel_size > 1:
        return f"{cfg.instance}-dp{pc.data_parallel_rank}"
    return cfg.instance
