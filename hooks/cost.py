"""What the tap costs vLLM's step thread, counted where it is spent.

A GPU decode step lasts a few milliseconds and a CPU one a hundred times longer, so no CPU benchmark
can show the hook's cost on a GPU: the worker counts it itself. The runner adapters add the host
time of each capturing step's tap work (planning, gathers, copies queued, ring reservations); steps
in which nobody captures do no tap work and are not counted. Every `LOG_EVERY_S` seconds with
captures, vLLM's log gets one line: steps (and how many of them the steady way,
hooks/steady_step.py), mean, p50/p99 (log2 buckets: a p99 of "≤ 64 µs" means
between 32 and 64), the worst step, what the publisher dropped and the captures admission shed
(hooks/admission.py) since the last line. A shed capture polls the clock too, so a worker that sheds
while nothing it admitted is running still says so, once an interval.

Rules: `add` is O(1) and allocation-free (a few integer operations; the clock is read once every
`CHECK_EVERY` steps); the adapters call it outside their guard, so a fault in the report is caught
here and never reaches vLLM.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("vllm_tap.hooks")

# Benchmarks ask for a shorter interval (VLLM_TAP_COST_LOG_S) to read the cost per run from the log.
LOG_EVERY_S = float(os.environ.get("VLLM_TAP_COST_LOG_S", "60") or 60)
CHECK_EVERY = 64  # steps between clock reads
_BUCKETS = 40  # 2**40 ns: any step


class StepCost:
    """Host nanoseconds of the tap's work per capturing step, bucketed by powers of two."""

    def __init__(self, every_s: float = LOG_EVERY_S, drops=None, thread=None, shed=None, steady=None):
        self.every_s = every_s
        # callable: capturing steps written the steady way (hooks/steady_step.py) so far
        self.steady = steady
        self._steady_before = 0
        self.drops = drops  # callable: records dropped so far (counted by the publisher and ring)
        self.shed = shed  # callable: captures not admitted so far
        # callable: (ns, wakes) the publisher thread spent holding the GIL handling steps, so far
        self.thread = thread
        self._thread_before = (0, 0)
        self.steps = 0
        self.total_ns = 0
        self.max_ns = 0
        self.buckets = [0] * _BUCKETS
        self._since = 0
        self._next = time.monotonic() + every_s
        self._drops_before = 0
        self._shed_before = 0

    def add(self, ns: int) -> None:
        self.steps += 1
        self.total_ns += ns
        if ns > self.max_ns:
            self.max_ns = ns
        self.buckets[min(ns.bit_length(), _BUCKETS - 1)] += 1
        self._since += 1
        if self._since >= CHECK_EVERY:
            self._since = 0
            self.poll()

    def poll(self) -> None:
        """Report now if an interval has passed (one clock read). Callers run outside the adapters'
        guard: nothing from the report may reach vLLM."""
        if time.monotonic() >= self._next:
            try:
                self.report()
            except Exception:  # noqa: BLE001
                self._next = time.monotonic() + self.every_s
                log.exception("vllm-tap: the hook-cost report failed")

    def quantile_ns(self, q: float) -> int:
        """Upper bound of the bucket holding quantile q (0 when nothing was counted)."""
        n = sum(self.buckets)
        if not n:
            return 0
        want, seen = q * n, 0
        for i, c in enumerate(self.buckets):
            seen += c
            if seen >= want:
                return 1 << i
        return 1 << (_BUCKETS - 1)

    def summary(self) -> dict:
        n = self.steps
        return {"steps": n, "mean_us": self.total_ns / n / 1e3 if n else 0.0,
                "p50_us": self.quantile_ns(0.5) / 1e3, "p99_us": self.quantile_ns(0.99) / 1e3,
                "max_us": self.max_ns / 1e3}

    def report(self) -> None:
        self._next = time.monotonic() + self.every_s
        s = self.summary()
        drops = self.drops() if self.drops is not None else 0
        shed = self.shed() if self.shed is not None else 0
        ns, wakes = self.thread() if self.thread is not None else (0, 0)
        steady = self.steady() if self.steady is not None else 0
        d_ns, d_wakes = ns - self._thread_before[0], wakes - self._thread_before[1]
        log.info("vllm-tap: %d capturing steps (%d steady), hook host time mean %.1f us, p50 <= %.0f us, "
                 "p99 <= %.0f us, max %.0f us; publisher thread %.1f us per step in %d wakes; %d records dropped and "
                 "%d captures shed (daemon behind) since the last report",
                 s["steps"], steady - self._steady_before, s["mean_us"], s["p50_us"], s["p99_us"], s["max_us"],
                 d_ns / 1e3 / max(s["steps"], 1), d_wakes, drops - self._drops_before, shed - self._shed_before)
        self._drops_before = drops
        self._shed_before = shed
        self._thread_before = (ns, wakes)
        self._steady_before = steady
        self.steps = self.total_ns = self.max_ns = 0
        self.buckets = [0] * _BUCKETS
