"""The `vllm.general_plugins` entry point.

vLLM calls `register()` once in every process it starts (API server, engine core, each worker),
before any model exists. We patch vLLM classes when (and only when) their modules are imported, so
a process that never imports the model runner (the API server) never pays for importing it. Each
patched method checks whether the tap is enabled in the process's VllmConfig and otherwise calls
straight through: with the tap off, vLLM behaves exactly as without the plugin.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from typing import Callable

from .vllm_logging import log_like_vllm

log = logging.getLogger("vllm_tap.hooks")

# Module name -> function applied to the module right after it has executed.
_PATCHES: dict[str, Callable] = {}
_done: set[str] = set()


def _patch_targets() -> dict[str, Callable]:
    from . import engine_events, runner_v1, runner_v2, startup, validation

    return {
        "vllm.engine.arg_utils": startup.patch_module,
        "vllm.v1.engine.input_processor": validation.patch_module,
        "vllm.v1.core.sched.scheduler": engine_events.patch_module,
        "vllm.v1.worker.gpu_model_runner": runner_v1.patch_gpu_module,  # V1 (and the base of V1 CPU)
        "vllm.v1.worker.cpu_model_runner": runner_v1.patch_cpu_module,
        "vllm.v1.worker.gpu.model_runner": runner_v2.patch_v2_module,  # V2 (and the base of V2 CPU)
    }


def _apply(name: str, module) -> None:
    if name in _done:
        return
    _done.add(name)
    try:
        _PATCHES[name](module)
    except Exception:
        # A patch that cannot apply (a vLLM version we do not know) must say so loudly, but an
        # unrelated process (say, a worker of a model with the tap disabled) must keep running.
        log.exception("vllm-tap: could not patch %s", name)
        raise


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str):
        self._inner = inner
        self._name = name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        _apply(self._name, module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _PATCHES or fullname in _done:
            return None
        # Let the normal machinery find it, then wrap its loader.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


def register() -> None:
    if _PATCHES:
        return
    log_like_vllm()
    _PATCHES.update(_patch_targets())
    for name in list(_PATCHES):
        mod = sys.modules.get(name)
        if mod is not None:
            _apply(name, mod)
    sys.meta_path.insert(0, _Finder())
