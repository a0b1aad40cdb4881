"""Prometheus exposition of the daemon's state, computed from Daemon.snapshot() at scrape time.

A custom collector rather than Counter/Gauge objects updated in the read loop: the hot path stays
free of metric bookkeeping, and a scrape costs one snapshot. The registry is private so importing
this module (or prometheus_client's default process metrics) never changes what is exposed.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from vllm_tap.status_format import Connections, DaemonStatus

log = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    def snapshot(self) -> DaemonStatus: ...


def _le(key: str) -> float:
    return math.inf if key.strip().lower() in ("+inf", "inf") else float(key)


def _buckets(hist: dict[str, Any]) -> list[tuple[str, float]]:
    """Daemon histogram ({"buckets": {le: cumulative count}, "count": n}) -> Prometheus buckets."""
    pairs = sorted((_le(str(k)), float(v)) for k, v in (hist.get("buckets") or {}).items())
    out = [(floatToGoString(le), v) for le, v in pairs if not math.isinf(le)]
    out.append(("+Inf", float(hist.get("count", 0))))
    return out


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], float(value))
    return g


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)  # exposed as NAME_total
    c.add_metric([], float(value))
    return c


# Per ring: (metric, help, kind, how to read it from a snapshot's ring entry).
_RING_METRICS: list[tuple[str, str, str, Callable[[dict[str, Any]], float]]] = [
    ("vllm_tap_ring_writer_alive", "1 while the ring's writer (a vLLM worker) is alive.", "gauge", lambda r: bool(r["alive"])),
    ("vllm_tap_ring_capacity_bytes", "Size of the ring's data area.", "gauge", lambda r: r["capacity"]),
    ("vllm_tap_ring_pending_bytes", "Written but not yet read: how far the daemon lags this writer.", "gauge",
     lambda r: r["pending_bytes"]),
    ("vllm_tap_ring_pending_seconds", "How long the oldest unread byte has waited (an upper bound): how far the "
     "daemon lags this writer, in time.", "gauge", lambda r: r.get("pending_s", 0.0)),
    ("vllm_tap_ring_records_written", "Records the writer committed.", "counter", lambda r: r["writer"]["records_written"]),
    ("vllm_tap_ring_bytes_written", "Bytes the writer committed.", "counter", lambda r: r["writer"]["bytes_written"]),
    ("vllm_tap_ring_records_dropped", "Records the writer dropped because the ring was full.", "counter",
     lambda r: r["writer"]["records_dropped"]),
    ("vllm_tap_ring_bytes_dropped", "Bytes the writer dropped because the ring was full.", "counter",
     lambda r: r["writer"]["bytes_dropped"]),
    ("vllm_tap_ring_captures_shed", "Captures the writer did not admit because the daemon was behind (ring over "
     "the shed threshold).", "counter", lambda r: r["writer"].get("captures_shed", 0)),
    ("vllm_tap_ring_corrupt", "Times the daemon found the ring corrupt and skipped ahead.", "counter", lambda r: r["corrupt"]),
    ("vllm_tap_ring_rejected_records", "Records of the ring that did not fit the record schema (skipped; their "
     "captures ended).", "counter", lambda r: r.get("rejected", 0)),
]
RING_LABELS = ["instance", "ring", "rank"]


class DaemonCollector(Collector):
    def __init__(self, source: SnapshotSource):
        self._source = source

    def collect(self) -> Iterable[Metric]:
        try:
            snap = self._source.snapshot()
        except Exception as e:  # a scrape must not kill the exporter thread; the failure shows as up=0
            log.warning("metrics: no daemon snapshot: %s", e)
            snap = None
        yield _gauge("vllm_tap_up", "1 when the daemon's main loop answered the scrape.", 0.0 if snap is None else 1.0)
        if snap is None:
            return
        try:
            families = list(self._families(snap))
        except (AttributeError, KeyError, TypeError, ValueError) as e:  # a snapshot of another shape: say so, once per scrape
            log.error("metrics: unexpected snapshot layout: %r", e)
            return
        yield from families

    def _families(self, s: DaemonStatus) -> Iterable[Metric]:
        rings = s.rings
        yield _gauge("vllm_tap_rings", "Rings the daemon is reading.", len(rings))
        yield _gauge("vllm_tap_writers", "Rings whose writer is alive.", sum(1 for r in rings if r["alive"]))
        for name, doc, kind, read in _RING_METRICS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=RING_LABELS)
            for r in rings:
                family.add_metric([str(r["instance"]), str(r["name"]), str(r["rank"])], float(read(r)))
            yield family

        drops = s.drops
        yield _gauge("vllm_tap_uptime_seconds", "Seconds since the daemon started.", s.uptime_s)
        yield _gauge("vllm_tap_requests_in_flight", "Requests whose capture has not ended yet.", s.requests_in_flight)
        yield _gauge("vllm_tap_requests_retained", "Finished captures kept for late subscribers.", s.retained_requests)
        yield _gauge("vllm_tap_retained_bytes", "Bytes held by retained captures.", s.retained_bytes)
        yield _counter("vllm_tap_requests_evicted", "Finished captures evicted (retain_bytes / retain_ttl_s).", s.evicted_requests)
        yield _counter("vllm_tap_records", "Records read from all rings.", s.records_in)
        yield _counter("vllm_tap_bytes", "Tensor payload bytes read from all rings.", s.bytes_in)
        yield _counter("vllm_tap_dropped_records", "Records writers dropped because a ring was full (all rings).", drops.records)
        yield _counter("vllm_tap_dropped_bytes", "Bytes writers dropped because a ring was full (all rings).", drops.bytes)
        yield _counter("vllm_tap_missing_positions", "Token positions delivered as gaps (dropped or never written).",
                       drops.missing_positions)
        gaps = CounterMetricFamily("vllm_tap_gap_positions", "Token positions delivered as gaps, by reason.",
                                   labels=["reason"])
        for reason, n in sorted(s.gap_positions.items()):
            gaps.add_metric([str(reason)], float(n))
        yield gaps
        yield _gauge("vllm_tap_captures_waiting_for_rings", "Captures whose END was read that wait for the daemon to "
                     "read their rings up to where they stood end_grace_s after it.",
                     s.requests_waiting_for_rings)
        yield _counter("vllm_tap_captures_shed", "Captures delivered as one gap `overloaded`: a worker shed them "
                       "because the daemon was behind.", drops.captures_shed)
        yield _gauge("vllm_tap_subscribers", "Open subscriptions.", s.subscribers)
        yield _gauge("vllm_tap_subscribers_waiting", "Subscriptions waiting for their capture to appear.", s.subscribers_waiting)
        yield _counter("vllm_tap_subscriptions", "Subscriptions accepted.", s.subscribers_total)
        yield _counter("vllm_tap_subscribers_too_slow", "Subscriptions cut off for falling subscriber_queue messages behind.",
                       s.subscribers_too_slow)
        yield _counter("vllm_tap_delivered_messages", "Messages sent to subscribers.", s.delivered_messages)
        yield _counter("vllm_tap_delivered_bytes", "Bytes sent to subscribers.", s.delivered_bytes)
        arena = s.arena
        if arena:
            yield _gauge("vllm_tap_arena_allocated_bytes", "Bytes of the delivery arena held by arrays.",
                         arena["allocated_bytes"])
            yield _counter("vllm_tap_arena_fallbacks", "Arrays kept on the heap (delivered as frames) because the "
                           "arena or its file system was full.", arena["fallbacks"])
            yield _counter("vllm_tap_arena_messages", "Tokens messages sent as arena descriptors.",
                           s.arena_messages)
        yield _counter("vllm_tap_bad_requests", "Client messages rejected as malformed.", s.bad_requests)
        yield _counter("vllm_tap_rejected_records", "Ring records that did not fit the record schema, all rings "
                       "(including rings no longer read).", s.rejected_records)
        yield _counter("vllm_tap_rings_refused", "Files in the ring directory that are not readable rings "
                       "(other versions, junk, links, sparse files).", s.rings_refused)
        yield _counter("vllm_tap_rings_broken", "Rings dropped because the file changed under the daemon "
                       "(truncated or grown).", s.rings_broken)
        yield _counter("vllm_tap_writers_exited", "Ring writers whose exit the daemon saw (pidfd).",
                       s.writers_exited)
        reasm = s.reassembly
        yield _counter("vllm_tap_ends_lost", "Captures ended because their END never came and the engine stopped "
                       "listing them as capturing.", reasm.get("ends_lost", 0))
        yield _counter("vllm_tap_captures_cut", "Captures cut to stay inside inflight_bytes.", s.captures_cut)
        yield _gauge("vllm_tap_inflight_bytes", "Bytes held for captures not ended yet (histories and reassembly).",
                     s.inflight_bytes)
        conns = s.connections or Connections()
        yield _gauge("vllm_tap_connections", "Connections open to the subscriber socket.", conns.open)
        yield _counter("vllm_tap_connections_refused", "Connections refused (max_connections, max_connections_per_peer).",
                       conns.refused)
        yield _gauge("vllm_tap_accept_paused", "1 while the daemon does not accept connections (near the descriptor "
                     "limit).", 1.0 if conns.accept_paused else 0.0)
        yield _counter("vllm_tap_subscriptions_refused", "Subscriptions refused (max_subscriptions, "
                       "max_subscriptions_per_connection).", s.subscriptions_refused)
        hist = s.delivery_latency_s
        h = HistogramMetricFamily("vllm_tap_delivery_latency_seconds", "From reading a record off its ring to sending it to a subscriber.")
        h.add_metric([], _buckets(hist), sum_value=float(hist["sum"]))
        yield h
        yield from _watch_families(s)
        yield from _engine_families(s)


def _engine_families(s: DaemonStatus) -> Iterable[Metric]:
    """Engines that may span hosts (daemon/engine_check.py); `status` names the instances and ranks."""
    engines = s.engines
    yield _gauge("vllm_tap_engine_ranks_missing", "Ranks of engines that write rings and never reported (here or "
                 "through a peer daemon): their part of every capture is gaps.",
                 sum(len(e["ranks_missing"]) for e in engines))
    yield _gauge("vllm_tap_engine_settings_differ", "Hosts of engines whose tap settings differ from their home's.",
                 sum(len(e["settings_differ"]) for e in engines))


def _watch_families(s: DaemonStatus) -> Iterable[Metric]:
    """The capture stream (daemon/watch.py); absent from a snapshot without it."""
    q = s.sequence
    if not q:
        return
    yield _gauge("vllm_tap_sequence_last", "Sequence number of the newest capture.", q["last"])
    yield _gauge("vllm_tap_sequence_persisted", "1 while the sequence counter's state file is being written "
                 "(0: numbering goes on unpersisted, see the log).", 0.0 if q.get("persist_error") else 1.0)
    yield _gauge("vllm_tap_watchers", "Open watches.", len(s.watchers))
    yield _counter("vllm_tap_watches", "Watches accepted.", s.watchers_total)
    yield _counter("vllm_tap_watch_delivered_captures", "Captures sent to watchers (each watcher counts).",
                   s.watch_delivered)
    lost = CounterMetricFamily("vllm_tap_watch_lost_captures", "Captures reported lost to watchers, by reason.",
                               labels=["reason"])
    for reason, n in sorted(s.watch_lost.items()):
        lost.add_metric([reason], float(n))
    yield lost


def split_addr(addr: str) -> tuple[str, int]:
    """'host:port', ':port' or '[v6]:port' -> (host, port); an empty host listens everywhere."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def start_metrics_server(addr: str, daemon: SnapshotSource):
    """Serve /metrics on `addr` from a daemon thread; returns (server, thread) so callers can stop it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(daemon))
    host, port = split_addr(addr)
    server, thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server, thread
