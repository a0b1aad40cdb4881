"""The daemon's status: its counters, the delivery latency histogram, and the snapshot that
`vllm-tap status` and the Prometheus exporter (daemon/metrics.py) read.

Methods of the Daemon (daemon/server.py), which owns the state they read; `snapshot()` takes the
Daemon's lock, so another thread may call it.
"""

from __future__ import annotations

import bisect
import os
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_tap import wire_format as wf
from vllm_tap.ring_reader import RingBroken

from .reassembly import GAP_REASONS, OTHER

# Delivery latency (ring read to send), seconds; fixed so scrapes can be compared over time.
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


@dataclass
class Counters:
    """The daemon's running totals, reported by `snapshot()`."""

    records_in: int = 0
    payload_bytes_in: int = 0
    steps_joined: int = 0  # decode steps of the same captures read in one round, handled as one (step_runs)
    delivered_messages: int = 0
    delivered_bytes: int = 0
    arena_messages: int = 0  # tokens messages sent as arena descriptors (their payload bytes below)
    arena_bytes: int = 0
    subscribers_total: int = 0
    subscribers_too_slow: int = 0
    subscriptions_refused: int = 0
    subscriptions_dropped_peer_gone: int = 0
    bad_requests: int = 0
    doorbell_wakeups: int = 0
    rings_refused: int = 0
    rings_broken: int = 0
    rejected_records: int = 0  # also counts those of rings no longer read
    corrupt_records: int = 0
    writers_exited: int = 0
    reassembly_errors: int = 0
    captures_cut: int = 0
    by_type: dict[str, int] = field(default_factory=dict)


class StatusSide:
    """The status side of the Daemon (mixed into it)."""

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        rings = []
        dropped_records = dropped_bytes = 0
        rejected, corrupt = self._closed_ring_counts
        now = time.monotonic()
        for ring in self._order:
            try:
                info = ring.reader.info()
            except (RingBroken, OSError):
                continue  # dropped at its next poll
            dropped_records += info.stats["records_dropped"]
            dropped_bytes += info.stats["bytes_dropped"]
            rejected += ring.reader.rejected
            corrupt += ring.reader.corrupt
            rings.append({
                "path": ring.path, "instance": ring.instance, "name": ring.reader.name, "rank": info.rank,
                "world_size": info.world_size, "writer_pid": info.writer_pid, "alive": ring.alive,
                "writer_watch": "pidfd" if ring.pidfd is not None else "poll",
                "epoch": info.epoch, "capacity": info.capacity, "pending_bytes": info.backlog_bytes,
                # How long the oldest unread byte has waited (an upper bound): the daemon's lag in time.
                "pending_s": round(ring.lag.seconds(info.read_cursor, now), 3),
                "read_cursor": info.read_cursor, "write_cursor": info.write_cursor, "corrupt": ring.reader.corrupt,
                "rejected": ring.reader.rejected, "writer": dict(info.stats),
                # Large records whose copy started while the one before was handled, and were used.
                "read_ahead": ring.reader.read_aheads, "read_ahead_taken": ring.reader.read_aheads_taken,
            })
        reasm_stats: dict[str, int] = {}
        gap_positions = dict.fromkeys((*GAP_REASONS, OTHER), 0)  # every reason from 0, so a rate has a start
        requests: list[dict[str, Any]] = []
        for r in self._reasm.values():
            for k, v in r.stats.items():
                reasm_stats[k] = reasm_stats.get(k, 0) + v
            for k, v in r.gap_positions.items():
                gap_positions[k] = gap_positions.get(k, 0) + v
            requests.extend(r.requests())
        c = self.counters
        p = self._peers
        return {
            "pid": os.getpid(),
            "wire_version": wf.WIRE_VERSION,
            "uptime_s": time.time() - self._started_at,
            "endpoint": self.endpoint,
            "shm_dir": self.config.shm_dir,
            # Writers wake the daemon through it; null: it polls the rings on a timer.
            "doorbell": self._doorbell.path if self._doorbell is not None else None,
            "doorbell_wakeups": c.doorbell_wakeups,
            # Shared memory the delivered arrays live in (null: off, or shm_dir not there yet).
            "arena": dict(self.arena.snapshot(), pinned_bytes=self._pinned_bytes,
                          pinned_captures=sum(len(v) for v in self._pins.values())) if self.arena is not None else None,
            # The child that copies large ring payloads into the arena (null: none, no arena or turned off).
            "copier": self.copier.snapshot() if self.copier is not None else None,
            "discovery": "inotify" if self._dir.watching else "scan",
            "rings": rings,
            # How far behind the daemon is: unread bytes of all rings, and the longest any has waited.
            "pending_bytes": sum(r["pending_bytes"] for r in rings),
            "pending_s": max((r["pending_s"] for r in rings), default=0.0),
            "rings_refused": c.rings_refused,
            "dirs_refused": self._dir.dirs_refused,  # instance directories (or the shm dir) failing the access rules
            "rings_broken": c.rings_broken,
            "broken_rings": list(self._broken[-10:]),
            "rejected_records": rejected,
            "corrupt_records": corrupt,
            "writers_exited": c.writers_exited,
            "requests_in_flight": sum(r.in_flight() for r in self._reasm.values()),
            # Of those, captures that end once the daemon has read their rings up to where they stood
            # end_grace_s after the END (or after the END was declared lost).
            "requests_waiting_for_rings": sum(r.waiting_for_rings() for r in self._reasm.values()),
            "requests": requests[:100],
            "inflight_bytes": self.inflight_bytes(),
            "inflight_budget": self.config.inflight_bytes,
            "captures_cut": c.captures_cut,
            "retained_requests": self.store.retained,
            "retained_bytes": self.store.retained_bytes,
            "evicted_requests": self.store.evictions,
            "records_in": c.records_in,
            "bytes_in": c.payload_bytes_in,
            "steps_joined": c.steps_joined,
            "drops": {"records": dropped_records, "bytes": dropped_bytes,
                      "missing_positions": reasm_stats.get("missing_positions", 0),
                      "captures_shed": reasm_stats.get("captures_shed", 0)},
            # Positions delivered as gaps, by reason (daemon/reassembly.py GAP_REASONS, "other").
            "gap_positions": gap_positions,
            "reassembly": reasm_stats,
            "reassembly_errors": c.reassembly_errors,
            "subscribers": len(self._subs),
            "subscribers_waiting": self._n_pending,
            "subscribers_total": c.subscribers_total,
            "subscribers_too_slow": c.subscribers_too_slow,
            "subscriptions_refused": c.subscriptions_refused,
            "subscriptions_dropped_peer_gone": c.subscriptions_dropped_peer_gone,
            "connections": {"open": p.total if p else 0, "accepted": p.accepted if p else 0,
                            "refused": p.refused if p else 0, "peers": p.peers if p else 0,
                            "refused_key": p.refused_key if p else 0,
                            "curve": bool(p and p.curve is not None),
                            "accept_paused": bool(p and p.paused), "descriptor_limit": self.nofile},
            "delivered_messages": c.delivered_messages,
            "delivered_bytes": c.delivered_bytes,
            # Of those, through the arena (descriptors; watchers included): messages, payload bytes described.
            "arena_messages": c.arena_messages + self.watch.arena_messages,
            "arena_bytes": c.arena_bytes + self.watch.arena_bytes,
            "bad_requests": c.bad_requests,
            "delivery_latency_s": self._latency.to_dict(),
            # watch: "sequence" (numbers given, retained range, state file) and "watchers"
            **self.watch.snapshot(time.monotonic()),
        }
