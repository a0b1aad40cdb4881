"""The status view: what `vllm-tap status` and the Prometheus exporter (daemon/metrics.py) read,
made from the daemon's parts (ring poller, instances, subscriber hub, store, watch) by what each
shows of itself. It holds no state of its own.
"""

from __future__ import annotations

import os
import time
from typing import Any

from vllm_tap import wire_format as wf
from vllm_tap.ring_reader import RingBroken
from vllm_tap.status_format import Connections, DaemonStatus, Drops

from .instances import Instances
from .events import GAP_REASONS, OTHER
from .ring_poller import RingPoller
from .store import Store
from .subscribers import SubscriberHub
from .watch import WatchHub


class StatusView:
    """The daemon's status, read off its parts."""

    def __init__(self, endpoint: str, shm_dir: str, poller: RingPoller, instances: Instances, hub: SubscriberHub,
                 store: Store, watch: WatchHub):
        self.endpoint = endpoint
        self.shm_dir = shm_dir
        self.started_at = time.time()
        self._poller = poller
        self._instances = instances
        self._hub = hub
        self._store = store
        self._watch = watch

    def snapshot(self, *, arena: Any = None, copier: Any = None, peers: Any = None, nofile: int = 0) -> DaemonStatus:
        """The status now; `arena`, `copier`, `peers`: the daemon's, while it runs."""
        poller, instances, hub, store = self._poller, self._instances, self._hub, self._store
        rings = []
        dropped_records = dropped_bytes = 0
        pc = poller.counters
        rejected, corrupt = pc.rejected_closed, pc.corrupt_closed
        now = time.monotonic()
        for ring in poller.rings:
            try:
                info = ring.reader.info()
            except (RingBroken, OSError):
                continue  # dropped at its next poll
            read = max(ring.reader.read_cursor, info.read_cursor)
            dropped_records += info.stats["records_dropped"]
            dropped_bytes += info.stats["bytes_dropped"]
            rejected += ring.reader.rejected
            corrupt += ring.reader.corrupt
            rings.append({
                "path": ring.path, "instance": ring.instance, "name": ring.reader.name, "rank": info.rank,
                "world_size": info.world_size, "writer_pid": info.writer_pid, "alive": ring.alive,
                "writer_watch": "pidfd" if ring.pidfd is not None else "poll",
                "epoch": info.epoch, "capacity": info.capacity, "pending_bytes": info.write_cursor - read,
                # How long the oldest unread byte has waited (an upper bound): the daemon's lag in time.
                "pending_s": round(ring.lag.seconds(read, now), 3),
                "read_cursor": read, "write_cursor": info.write_cursor, "corrupt": ring.reader.corrupt,
                # Read, and kept from the writer: the file's cursor stays below records whose data the
                # daemon holds unfiled (and below what its journal does not have yet).
                "kept_bytes": read - info.read_cursor,
                "rejected": ring.reader.rejected, "writer": dict(info.stats),
                # Large records whose copy started while the one before was handled, and were used.
                "read_ahead": ring.reader.read_aheads, "read_ahead_taken": ring.reader.read_aheads_taken,
            })
        reasm_stats: dict[str, int] = {}
        gap_positions = dict.fromkeys((*GAP_REASONS, OTHER), 0)  # every reason from 0, so a rate has a start
        requests: list[dict[str, Any]] = []
        for r in instances.all():
            for k, v in r.stats.items():
                reasm_stats[k] = reasm_stats.get(k, 0) + v
            for k, v in r.gap_positions.items():
                gap_positions[k] = gap_positions.get(k, 0) + v
            requests.extend(r.requests())
        c = hub.counters
        p = peers
        pins = hub.pins
        return DaemonStatus(
            pid=os.getpid(),
            wire_version=wf.WIRE_VERSION,
            uptime_s=time.time() - self.started_at,
            endpoint=self.endpoint,
            shm_dir=self.shm_dir,
            doorbell=poller.doorbell.path if poller.doorbell is not None else None,
            doorbell_wakeups=pc.doorbell_wakeups,
            arena=dict(arena.snapshot(), pinned_bytes=pins.pinned_bytes,
                       pinned_captures=pins.captures) if arena is not None else None,
            copier=copier.snapshot() if copier is not None else None,
            discovery=poller.discovery,
            rings=rings,
            pending_bytes=sum(r["pending_bytes"] for r in rings),
            pending_s=max((r["pending_s"] for r in rings), default=0.0),
            rings_refused=pc.rings_refused,
            dirs_refused=poller.dirs_refused,
            rings_broken=pc.rings_broken,
            broken_rings=list(poller.broken[-10:]),
            rejected_records=rejected,
            corrupt_records=corrupt,
            writers_exited=pc.writers_exited,
            requests_in_flight=sum(r.in_flight() for r in instances.all()),
            requests_waiting_for_rings=sum(r.waiting_for_rings() for r in instances.all()),
            requests=requests[:100],
            inflight_bytes=instances.inflight_bytes(),
            inflight_budget=instances.inflight_budget,
            captures_cut=instances.captures_cut,
            retained_requests=store.retained,
            retained_bytes=store.retained_bytes,
            evicted_requests=store.evictions,
            records_in=pc.records_in,
            bytes_in=pc.payload_bytes_in,
            steps_joined=pc.steps_joined,
            drops=Drops(records=dropped_records, bytes=dropped_bytes,
                        missing_positions=reasm_stats.get("missing_positions", 0),
                        captures_shed=reasm_stats.get("captures_shed", 0)),
            gap_positions=gap_positions,
            reassembly=reasm_stats,
            reassembly_errors=instances.reassembly_errors,
            subscribers=hub.subscriptions,
            subscribers_waiting=hub.waiting,
            subscribers_total=c.subscribers_total,
            subscribers_too_slow=c.subscribers_too_slow,
            subscriptions_refused=c.subscriptions_refused,
            subscriptions_dropped_peer_gone=c.subscriptions_dropped_peer_gone,
            connections=Connections(open=p.total if p else 0, accepted=p.accepted if p else 0,
                                    refused=p.refused if p else 0, peers=p.peers if p else 0,
                                    refused_key=p.refused_key if p else 0, curve=bool(p and p.curve is not None),
                                    accept_paused=bool(p and p.paused), descriptor_limit=nofile),
            delivered_messages=c.delivered_messages,
            delivered_bytes=c.delivered_bytes,
            arena_messages=c.arena_messages + self._watch.arena_messages,
            arena_bytes=c.arena_bytes + self._watch.arena_bytes,
            bad_requests=c.bad_requests,
            delivery_latency_s=hub.latency.to_dict(),
            **self._watch.snapshot(time.monotonic()),
        )
