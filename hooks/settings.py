"""The server-wide tap settings as seen from inside a vLLM process."""

from __future__ import annotations

from typing import Any

from vllm_tap.spec import SERVER_CONFIG_KEY, CaptureOptionError, ServerCaptureConfig

# Keys the API process adds to a capturing request's extra_args, read by the engine and workers.
# They are in the reserved namespace (spec.RESERVED_PREFIX): requests may not bring their own.
SPEC_EXTRA_ARG = "vllm_tap_spec"


class TapConfigError(RuntimeError):
    """Bad server settings: vLLM must not start. The message is one line naming the setting."""


def num_layers(vllm_config: Any) -> int:
    return int(vllm_config.model_config.hf_text_config.num_hidden_layers)


def vocab_size(vllm_config: Any) -> int | None:
    try:
        return int(vllm_config.model_config.get_vocab_size())
    except Exception:  # a config without a vocabulary: options are then checked against 2**31
        return None


def server_config(vllm_config: Any) -> ServerCaptureConfig | None:
    """The tap's settings, or None when it is not enabled (the plugin then does nothing)."""
    additional = getattr(vllm_config, "additional_config", None)
    if not additional or SERVER_CONFIG_KEY not in additional:
        return None
    try:
        return ServerCaptureConfig.from_additional_config(additional, num_layers(vllm_config), vocab_size(vllm_config))
    except CaptureOptionError as e:
        raise TapConfigError(f"vllm-tap: {e}") from None


def instance_name(cfg: ServerCaptureConfig, vllm_config: Any) -> str:
    """Each data-parallel engine gets its own instance directory; its rank ids restart at 0."""
    pc = vllm_config.parallel_config
    if pc.data_parallel_size > 1:
        return f"{cfg.instance}-dp{pc.data_parallel_rank}"
    return cfg.instance
