"""Engine-core side: tell the daemon when a capturing request begins, that it still runs, and how
it ended.

Only the scheduler knows a request's finish reason and its final output token ids (the last
sampled token is never fed through the model, so no worker sees it as an input). Workers learn that
a request finished only when the next batch is scheduled, which may never come on an idle server,
so BEGIN and END come from here, through this engine's own ring (`engine.ring`):
  - BEGIN: the spec, the prompt, n and the model;
  - END: the finish reason, the output tokens, the last computed position, and the spec and
    source again, so a reader that missed the BEGIN still knows which positions were expected;
  - LIVE: {"requests": [ids of the captures still running]}, about once a second whatever the
    engine does, idle included, so a reader can end a capture whose END it will never see (lost to
    a full backlog, or consumed by a previous reader that was stopped or killed). A timer thread
    writes it, not the scheduler: an idle engine runs no steps, and a reader that restarts while
    vLLM is idle must still learn that nothing it is waiting for runs. The same tick retries
    BEGIN/ENDs that wait in the writer's backlog for room, so an idle engine does not keep its last
    ENDs to itself. A LIVE record is never queued: it is written when the ring has room and nothing
    is waiting ahead of it, else skipped until the next one.

Rules: the spec in a request's extra_args is decoded strictly; a malformed one means "no capture"
with one logged error. No exception from this module reaches vLLM's scheduler: every patched
method calls the original whatever the tap does, and tap faults are logged (rate-limited). The
scheduler's per-step path has no tap work at all. The timer thread holds the GIL for one small
record a second, and one lock, shared with BEGIN and END, orders a LIVE after the records of the
captures it names (a LIVE written between a BEGIN's bookkeeping and its record would disown it).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time

from vllm_tap import ring_format as rf
from vllm_tap.identity import N_EXTRA_ARG
from vllm_tap.placement import encode as encode_placement
from vllm_tap.ring_files import RingSpaceError, ring_path
from vllm_tap.ring_schema import BeginMeta, EndMeta, LiveMeta, spec_field
from vllm_tap.ring_writer import RingWriter
from vllm_tap.safe_paths import UnsafePath
from vllm_tap.spec import CaptureOptionError, CaptureSpec

from .settings import SPEC_EXTRA_ARG, TapConfigError, instance_name, server_config
from .topology import placement_of

log = logging.getLogger("vllm_tap.hooks")

# Control records are tiny; this ring only needs room for a burst of BEGIN/ENDs with token lists.
ENGINE_RING_BYTES = 16 << 20
LIVE_INTERVAL_S = 1.0
_MAX_N = 1 << 16


class _RateLimitedLog:
    """The first occurrence in full, then at most one line a minute saying how many followed."""

    def __init__(self, every_s: float = 60.0):
        self.every_s = every_s
        self.count = 0
        self._skipped = 0
        self._next = 0.0

    def __call__(self, msg: str, *args, exc_info: bool = False) -> None:
        self.count += 1
        now = time.monotonic()
        if now < self._next:
            self._skipped += 1
            return
        if self._skipped:
            msg = f"{msg} ({self._skipped} more since the last report)"
            self._skipped = 0
        self._next = now + self.every_s
        log.error(msg, *args, exc_info=exc_info)


class EngineEvents:
    def __init__(self, vllm_config, cfg):
        self.model = str(vllm_config.model_config.served_model_name or vllm_config.model_config.model)
        path = ring_path(cfg.shm_dir, instance_name(cfg, vllm_config), rf.ENGINE_RANK)
        try:
            self.writer = RingWriter(
                path, ENGINE_RING_BYTES, rank=rf.ENGINE_RANK, world_size=1,
                mode=0o660 if cfg.group else 0o600, group=cfg.group,
                placement=encode_placement(placement_of(cfg, vllm_config, None)),
            )
        except (RingSpaceError, UnsafePath) as e:  # no room, or a squatted directory: stop start-up, one line
            raise TapConfigError(str(e) if isinstance(e, RingSpaceError) else f"vllm-tap: {e}") from None
        self.capturing: dict[str, CaptureSpec] = {}  # request id -> its spec, BEGIN to END
        self._lock = threading.Lock()  # capturing + its records, against the LIVE thread
        self._closed = threading.Event()
        self.bad_spec = _RateLimitedLog()
        self.fault = _RateLimitedLog()
        self._timer = threading.Thread(target=self._tick, name="vllm-tap-live", daemon=True)
        self._timer.start()
        log.info("vllm-tap engine ring %s (pid %d)", path, os.getpid())

    def _tick(self) -> None:
        while not self._closed.wait(LIVE_INTERVAL_S):
            try:
                self.live()
            except Exception:  # the ring closed under it (shutdown), or a bug: never the engine's problem
                if self._closed.is_set():
                    return
                self.fault("vllm-tap: writing a LIVE record failed", exc_info=True)

    def close(self) -> None:
        self._closed.set()
        self._timer.join(timeout=5)
        self.writer.close()

    def begin(self, request) -> None:
        sp = request.sampling_params
        extra = getattr(sp, "extra_args", None) if sp is not None else None
        if not extra or SPEC_EXTRA_ARG not in extra:
            return
        rid = request.request_id
        try:
            spec = CaptureSpec.from_meta(extra[SPEC_EXTRA_ARG])
        except CaptureOptionError as e:
            # Only the API process writes this key and it refuses requests that bring their own;
            # whoever got one past it gets no capture, and serving goes on.
            self.bad_spec("vllm-tap: request %s carries a malformed capture spec; not capturing it (%s)", rid, e)
            return
        n = extra.get(N_EXTRA_ARG, 1)
        n = n if type(n) is int and 1 <= n <= _MAX_N else 1
        meta = BeginMeta(spec=spec_field(spec), source=spec.source, num_prompt_tokens=int(request.num_prompt_tokens),
                         prompt_token_ids=list(request.prompt_token_ids or ()), n=n, model=self.model)
        with self._lock:
            self.capturing[rid] = spec
            self.writer.write_control(rid, meta, tap_key=spec.key)

    def end(self, request) -> None:
        rid = request.request_id
        spec = self.capturing.get(rid)
        if spec is None:
            return
        reason = request.get_finished_reason()
        out = list(request.output_token_ids)
        n_prompt = int(request.num_prompt_tokens)
        # The model has computed every position but the last sampled token's.
        end_position = n_prompt + len(out) - 1 if out else int(request.num_computed_tokens)
        meta = EndMeta(
            reason=reason.name.lower() if reason is not None else "finished",
            num_prompt_tokens=n_prompt, num_output_tokens=len(out),
            output_token_ids=out, end_position=end_position,
            spec=spec_field(spec), source=spec.source,
        )
        with self._lock:
            self.capturing.pop(rid, None)
            self.writer.write_control(rid, meta, tap_key=spec.key)

    def live(self) -> bool:
        """One LIVE record now (the timer's tick); False when the ring is full or control records
        wait ahead of it (retried first; the next tick tries again)."""
        with self._lock:
            return self.writer.write_control_if_room("", LiveMeta(list(self.capturing)))


def patch_module(module) -> None:
    cls = module.Scheduler
    orig_init = cls.__init__
    orig_add = cls.add_request
    orig_free = cls._free_request

    @functools.wraps(orig_init)
    def __init__(self, vllm_config, *args, **kwargs):
        orig_init(self, vllm_config, *args, **kwargs)
        cfg = server_config(vllm_config)
        self._vllm_tap = EngineEvents(vllm_config, cfg) if cfg is not None else None

    @functools.wraps(orig_add)
    def add_request(self, request):
        tap = self._vllm_tap
        if tap is not None and request.request_id not in self.requests:
            try:
                tap.begin(request)
            except Exception:
                tap.fault("vllm-tap: BEGIN of request %s failed; it may be captured incompletely",
                          request.request_id, exc_info=True)
        return orig_add(self, request)

    @functools.wraps(orig_free)
    def _free_request(self, request, *args, **kwargs):
        tap = self._vllm_tap
        if tap is not None:
            try:
                tap.end(request)
            except Exception:
                tap.fault("vllm-tap: END of request %s failed; the daemon ends it when it no longer runs",
                          request.request_id, exc_info=True)
        return orig_free(self, request, *args, **kwargs)

    cls.__init__ = __init__
    cls.add_request = add_request
    cls._free_request = _free_request
