"""Engine-core side: tell the daemon when a capturing request begins and how it ended.

Only the scheduler knows a request's finish reason and its final output token ids (the last
sampled token is never fed through the model, so no worker sees it as an input). Workers learn that
a request finished only when the next batch is scheduled, which may never come on an idle server,
so BEGIN and END come from here, through this engine's own ring (`engine.ring`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading

from vllm_tap import ring_format as rf
from vllm_tap.hooks.settings import SPEC_EXTRA_ARG, instance_name, server_config
from vllm_tap.identity import N_EXTRA_ARG
from vllm_tap.ring import RingWriter, ring_path

log = logging.getLogger("vllm_tap.hooks")

# Control records are tiny; this ring only needs room for a burst of BEGIN/ENDs with token lists.
ENGINE_RING_BYTES = 16 << 20


class EngineEvents:
    def __init__(self, vllm_config):
        cfg = server_config(vllm_config)
        assert cfg is not None
        self.model = str(vllm_config.model_config.served_model_name or vllm_config.model_config.model)
        path = ring_path(cfg.shm_dir, instance_name(cfg, vllm_config), rf.ENGINE_RANK)
        self.writer = RingWriter(
            path, ENGINE_RING_BYTES, rank=rf.ENGINE_RANK, world_size=1,
            mode=0o660 if cfg.group else 0o600, group=cfg.group,
        )
        self.capturing: set[str] = set()
        self._lock = threading.Lock()
        log.info("vllm-tap engine ring %s (pid %d)", path, os.getpid())

    def begin(self, request) -> None:
        sp = request.sampling_params
        extra = getattr(sp, "extra_args", None) if sp is not None else None
        if not extra or SPEC_EXTRA_ARG not in extra:
            return
        spec = extra[SPEC_EXTRA_ARG]
        with self._lock:
            self.capturing.add(request.request_id)
            self.writer.write_control(
                rf.RecordKind.BEGIN, request.request_id,
                {
                    "spec": spec, "num_prompt_tokens": int(request.num_prompt_tokens),
                    "prompt_token_ids": list(request.prompt_token_ids or ()),
                    "n": int(extra.get(N_EXTRA_ARG, 1)), "model": self.model,
                },
                tap_key=spec.get("key", ""),
            )

    def end(self, request) -> None:
        rid = request.request_id
        if rid not in self.capturing:
            return
        reason = request.get_finished_reason()
        out = list(request.output_token_ids)
        n_prompt = int(request.num_prompt_tokens)
        # The model has computed every position but the last sampled token's.
        end_position = n_prompt + len(out) - 1 if out else int(request.num_computed_tokens)
        with self._lock:
            self.capturing.discard(rid)
            self.writer.write_control(
                rf.RecordKind.END, rid,
                {
                    "reason": reason.name.lower() if reason is not None else "finished",
                    "num_prompt_tokens": n_prompt, "num_output_tokens": len(out),
                    "output_token_ids": out, "end_position": end_position,
                },
                tap_key=request.sampling_params.extra_args[SPEC_EXTRA_ARG].get("key", ""),
            )


def patch_module(module) -> None:
    cls = module.Scheduler
    orig_init = cls.__init__
    orig_add = cls.add_request
    orig_free = cls._free_request

    @functools.wraps(orig_init)
    def __init__(self, vllm_config, *args, **kwargs):
        orig_init(self, vllm_config, *args, **kwargs)
        self._vllm_tap = EngineEvents(vllm_config) if server_config(vllm_config) is not None else None

    @functools.wraps(orig_add)
    def add_request(self, request):
        tap = self._vllm_tap
        if tap is not None and request.request_id not in self.requests:
            tap.begin(request)
        return orig_add(self, request)

    @functools.wraps(orig_free)
    def _free_request(self, request, *args, **kwargs):
        tap = self._vllm_tap
        if tap is not None:
            tap.end(request)
        return orig_free(self, request, *args, **kwargs)

    cls.__init__ = __init__
    cls.add_request = add_request
    cls._free_request = _free_request
