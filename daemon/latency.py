"""Delivery latency (from a record's read off its ring to its send to a subscriber) in fixed buckets,
kept by the subscriber hub and reported by the status view and the Prometheus exporter."""

from __future__ import annotations

import bisect
from typing import Any

# Seconds; fixed so scrapes can be compared over time.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)


class Histogram:
    """Delivery latency in fixed buckets (LATENCY_BUCKETS)."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def to_dict(self) -> dict[str, Any]:
        """Cumulative counts keyed by upper bound, like a Prometheus histogram."""
        buckets: dict[str, int] = {}
        acc = 0
        for le, c in zip(self.bounds, self.counts):
            acc += c
            buckets[format(le, "g")] = acc
        buckets["+Inf"] = self.count
        return {"buckets": buckets, "sum": self.sum, "count": self.count}
