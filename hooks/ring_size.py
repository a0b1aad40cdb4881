"""The worker rings' size when the operator does not set `ring_bytes`: from what the server can capture.

A ring absorbs the daemon's lag: while it is more than `shed_at` unread, new captures are shed
(hooks/admission.py), so what a ring must hold is the captures already admitted for as long as the
daemon takes to catch up. Sized for the most the server can be made to capture at once:

- requests may opt in (no policy, or a policy whose `client` is "wins" or "loses"): every sequence
  the scheduler may run (max_num_seqs) with the widest capture a request can ask for, full logits
  and every exposed layer;
- only the policy captures (`"client": "refused"`): the sequences the policy's share picks, with a
  three-sigma margin (min(n, ceil(n·s + 3·sqrt(n·s·(1-s)))) of n = max_num_seqs at share s), each with
  the policy's own spec (its logits form and layers).

A position of a capture takes, in the ring, its values at the model's dtype (float32 where the
spec asks for it): vocab (full logits), k × (4 + value) + 4 (top-k ids, values, logsumexp),
indices × value + 4 (chosen logits), hidden × value per layer, plus 8 bytes of position and token
id, this rank's 1/tp share. For RING_SECONDS at the decode step rate the operator declares
(vllm_tap.steps_per_s, spec.DEFAULT_STEPS_PER_S otherwise):

    ring = sequences × bytes a position × steps_per_s × RING_SECONDS

at least MIN_RING_BYTES (the floor: a prefill step writes many positions at once, which this
decode-step estimate leaves out), at most MAX_RING_BYTES, and at most SHM_SHARE of the shm file system's free space split over every ring started here. The
API process sizes the rings once, before any engine starts, logs the size and why, and writes it
into the tap's settings in vLLM's config, so the engine and every worker (which read those
settings) open rings of the same size, and the shm check (preflight) checks that size. Each worker
logs the size of the ring it opened (runner_patch).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from vllm_tap import ring_format as rf
from vllm_tap.spec import SERVER_CONFIG_KEY, CaptureSpec, DTypeMode, LogitsMode, ServerCaptureConfig

log = logging.getLogger("vllm_tap.hooks")

RING_SECONDS = 0.5  # of the most the server can capture a ring holds
MIN_RING_BYTES = 64 << 20
MAX_RING_BYTES = 8 << 30
SHM_SHARE = 0.5  # of the free shm space all rings together may take
MARGIN_SIGMAS = 3.0  # the policy's sequences at once: its share of max_num_seqs plus this many standard deviations
ROW_KEY_BYTES = 8  # a position's own position and token id (int32 each)
_ROUND = 1 << 20
_WHY = {"sized": "sized from what the server can capture", "minimum": "the minimum", "maximum": "the maximum",
        "free shm": "bounded by free shm"}


@dataclass(frozen=True)
class Model:
    """What sizing needs of the model and the server."""

    vocab: int
    hidden: int
    dtype_bytes: int
    tp: int
    max_num_seqs: int


@dataclass(frozen=True)
class Demand:
    """The most the server can capture at once, on one worker rank: `seqs` sequences, each taking
    `position_bytes` of this rank's ring a position; `what` says so in words (the start-up line)."""

    seqs: int
    position_bytes: int
    what: str

    def per_step(self) -> int:
        return self.seqs * self.position_bytes


def position_bytes(spec: CaptureSpec, m: Model) -> int:
    """Bytes a position of a capture with `spec` takes in one rank's ring."""
    value = 4 if spec.dtype == DTypeMode.FLOAT32 else m.dtype_bytes
    logits = {LogitsMode.FULL: m.vocab * value, LogitsMode.TOPK: spec.topk * (4 + value) + 4,
              LogitsMode.INDICES: len(spec.indices) * value + 4, LogitsMode.NONE: 0}[spec.logits]
    return ROW_KEY_BYTES + (logits + len(spec.layers) * m.hidden * value) // max(m.tp, 1)


def policy_seqs(share: float, max_num_seqs: int) -> int:
    """Sequences a policy of `share` captures at once, at most (with a MARGIN_SIGMAS margin)."""
    n, s = max_num_seqs, min(max(share, 0.0), 1.0)
    return min(n, math.ceil(n * s + MARGIN_SIGMAS * math.sqrt(n * s * (1 - s))))


def demand(cfg: ServerCaptureConfig, m: Model) -> Demand:
    """What the rings are sized for: requests' widest capture for every sequence when they may opt
    in, else the policy's spec for the sequences its share picks."""
    policy = cfg.policy
    if policy is None or policy.client != "refused":
        widest = CaptureSpec(LogitsMode.FULL, layers=cfg.layers)
        who = "no policy" if policy is None else f"policy client {policy.client!r}"
        return Demand(m.max_num_seqs, position_bytes(widest, m),
                      f"requests may opt in ({who}): all {m.max_num_seqs} sequences with full logits and "
                      f"{_layers(cfg.layers)}")
    spec = policy.spec
    what = {LogitsMode.FULL: "full logits", LogitsMode.TOPK: f"top-{spec.topk} logits",
            LogitsMode.INDICES: f"{len(spec.indices)} chosen logits", LogitsMode.NONE: "no logits"}[spec.logits]
    return Demand(policy_seqs(policy.share, m.max_num_seqs), position_bytes(spec, m),
                  f"only the policy captures: {policy.share:g} of {m.max_num_seqs} sequences, "
                  f"{policy_seqs(policy.share, m.max_num_seqs)} at once with a margin, with {what} and "
                  f"{_layers(spec.layers)}")


def _layers(layers: tuple[int, ...]) -> str:
    if not layers:
        return "no layers"
    return f"layer {layers[0]}" if len(layers) == 1 else f"{len(layers)} layers"


def ring_bytes(d: Demand, *, steps_per_s: float, free_shm: int, rings: int) -> tuple[int, str]:
    """(bytes of one worker ring, what set it: "sized", "minimum", "maximum" or "free shm")."""
    want = int(d.per_step() * steps_per_s * RING_SECONDS)
    shm_cap = int(free_shm * SHM_SHARE) // max(rings, 1)
    size, why = want, "sized"
    if size < MIN_RING_BYTES:
        size, why = MIN_RING_BYTES, "minimum"
    if size > MAX_RING_BYTES:
        size, why = MAX_RING_BYTES, "maximum"
    if size > shm_cap:
        size, why = shm_cap, "free shm"
    size -= size % _ROUND if size >= _ROUND else size % rf.ALIGN
    return max(size, 1 << 16), why


def model_of(vllm_config: Any) -> Model:
    """The sizes sizing needs from vLLM's config (raises where a config lacks them)."""
    mc = vllm_config.model_config
    return Model(int(mc.get_vocab_size()), int(mc.get_hidden_size()), int(getattr(mc.dtype, "itemsize", 2)),
                 int(vllm_config.parallel_config.tensor_parallel_size), int(vllm_config.scheduler_config.max_num_seqs))


def apply(vllm_config: Any, cfg: ServerCaptureConfig, free_shm: int, rings: int) -> ServerCaptureConfig:
    """The settings with ring_bytes sized (when the operator left it out), written back into vLLM's
    config for the other processes."""
    if not cfg.ring_auto:
        return cfg
    if not isinstance(getattr(vllm_config, "additional_config", None), dict):
        return cfg  # nowhere to tell the other processes: they would open rings of the default size
    try:
        m = model_of(vllm_config)
    except Exception as e:  # a config without these: the fixed default stands
        log.warning("vllm-tap: cannot size the rings from the model (%s); %d MiB each", e, cfg.ring_bytes >> 20)
        return cfg
    d = demand(cfg, m)
    size, why = ring_bytes(d, steps_per_s=cfg.steps_per_s, free_shm=free_shm, rings=rings)
    want = d.per_step() * cfg.steps_per_s * RING_SECONDS
    log.info("vllm-tap: worker rings of %d MiB, %s: %s; %d sequences x %.1f KiB a position (vocab %d, hidden %d, "
             "%d-byte values, tp %d) x %g steps/s x %g s = %.1f MiB; floor %d MiB; set vllm_tap.ring_bytes to choose",
             size >> 20, _WHY[why], d.what, d.seqs, d.position_bytes / 1024, m.vocab, m.hidden, m.dtype_bytes, m.tp,
             cfg.steps_per_s, RING_SECONDS, want / (1 << 20), MIN_RING_BYTES >> 20)
    settings = vllm_config.additional_config.get(SERVER_CONFIG_KEY)
    settings = dict(settings) if isinstance(settings, dict) else {}
    settings["ring_bytes"] = size
    vllm_config.additional_config[SERVER_CONFIG_KEY] = settings
    return dataclasses.replace(cfg, ring_bytes=size, ring_auto=False)
