"""The worker rings' size when the operator does not set `ring_bytes`: from the model and the step rate.

A ring absorbs the daemon's lag: while it is more than `shed_at` unread, new captures are shed
(hooks/admission.py), so what a ring must hold is the captures already admitted for as long as the
daemon takes to catch up. Sized for the worst of them: every sequence the scheduler may run
(max_num_seqs) capturing everything the server exposes (full logits and every exposed layer's hidden
state, at the model's dtype, this rank's 1/tp share), for RING_SECONDS at the decode step rate the
operator declares (vllm_tap.steps_per_s, spec.DEFAULT_STEPS_PER_S otherwise):

    ring = max_num_seqs × (vocab + layers × hidden) × dtype bytes / tp × steps_per_s × RING_SECONDS

bounded to [MIN_RING_BYTES, MAX_RING_BYTES] and to SHM_SHARE of the shm file system's free space
split over every ring started here. The API process sizes the rings once, before any engine starts,
and writes the size into the tap's settings in vLLM's config, so the engine and every worker (which
read those settings) open rings of the same size, and the shm check (preflight) checks that size.
Each worker logs the size of the ring it opened (runner_patch).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm_tap import ring_format as rf
from vllm_tap.spec import SERVER_CONFIG_KEY, ServerCaptureConfig

log = logging.getLogger("vllm_tap.hooks")

RING_SECONDS = 0.5  # of the worst capture rate a ring holds
MIN_RING_BYTES = 64 << 20
MAX_RING_BYTES = 8 << 30
SHM_SHARE = 0.5  # of the free shm space all rings together may take
_ROUND = 1 << 20


def ring_bytes(*, vocab: int, hidden: int, layers: int, dtype_bytes: int, tp: int, max_num_seqs: int,
               steps_per_s: float, free_shm: int, rings: int) -> tuple[int, str]:
    """(bytes of one worker ring, what set it: "model", "minimum", "maximum" or "free shm")."""
    per_step = max_num_seqs * (vocab + layers * hidden) * dtype_bytes // max(tp, 1)
    want = int(per_step * steps_per_s * RING_SECONDS)
    shm_cap = int(free_shm * SHM_SHARE) // max(rings, 1)
    size, why = want, "model"
    if size < MIN_RING_BYTES:
        size, why = MIN_RING_BYTES, "minimum"
    if size > MAX_RING_BYTES:
        size, why = MAX_RING_BYTES, "maximum"
    if size > shm_cap:
        size, why = shm_cap, "free shm"
    size -= size % _ROUND if size >= _ROUND else size % rf.ALIGN
    return max(size, 1 << 16), why


def apply(vllm_config: Any, cfg: ServerCaptureConfig, free_shm: int, rings: int) -> ServerCaptureConfig:
    """The settings with ring_bytes sized (when the operator left it out), written back into vLLM's
    config for the other processes."""
    if not cfg.ring_auto:
        return cfg
    if not isinstance(getattr(vllm_config, "additional_config", None), dict):
        return cfg  # nowhere to tell the other processes: they would open rings of the default size
    mc = vllm_config.model_config
    try:
        vocab = int(mc.get_vocab_size())
        hidden = int(mc.get_hidden_size())
        dtype_bytes = int(getattr(mc.dtype, "itemsize", 2))
    except Exception as e:  # a config without these: the fixed default stands
        log.warning("vllm-tap: cannot size the rings from the model (%s); %d MiB each", e, cfg.ring_bytes >> 20)
        return cfg
    size, why = ring_bytes(
        vocab=vocab, hidden=hidden, layers=len(cfg.layers), dtype_bytes=dtype_bytes,
        tp=vllm_config.parallel_config.tensor_parallel_size, max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs),
        steps_per_s=cfg.steps_per_s, free_shm=free_shm, rings=rings)
    log.info("vllm-tap: worker rings of %d MiB (%s; vocab %d, hidden %d, %d layers exposed, %g steps/s)",
             size >> 20, {"model": "sized from the model", "minimum": "the minimum", "maximum": "the maximum",
                          "free shm": "bounded by free shm"}[why], vocab, hidden, len(cfg.layers), cfg.steps_per_s)
    settings = vllm_config.additional_config.get(SERVER_CONFIG_KEY)
    settings = dict(settings) if isinstance(settings, dict) else {}
    settings["ring_bytes"] = size
    vllm_config.additional_config[SERVER_CONFIG_KEY] = settings
    return dataclasses.replace(cfg, ring_bytes=size, ring_auto=False)
