"""The daemon's status: what `status` answers, what `vllm-tap status` shows and what the Prometheus
exporter (daemon/metrics.py) reads, as one Struct the daemon writes (daemon/status.py) and its
readers read by attribute.

On the wire it travels as a map (wire_format.StatusReply) and the client hands its users that map,
so their code keeps working; `vllm-tap status` converts it back (`from_map`). Every field has the
default a daemon that does not report it means, so the status of an earlier daemon reads too.
One field per line: parts that report more add a line each.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Drops(msgspec.Struct, forbid_unknown_fields=False):
    """What writers dropped (ring full) and what captures miss for it."""

    records: int = 0
    bytes: int = 0
    missing_positions: int = 0
    captures_shed: int = 0


class Connections(msgspec.Struct, forbid_unknown_fields=False):
    """The subscriber socket's connections (daemon/peers.py)."""

    open: int = 0
    accepted: int = 0
    refused: int = 0
    peers: int = 0
    refused_key: int = 0
    curve: bool = False
    accept_paused: bool = False
    descriptor_limit: int = 0


class DaemonStatus(msgspec.Struct, forbid_unknown_fields=False):
    pid: int = 0
    wire_version: int = 0
    uptime_s: float = 0.0
    endpoint: str = ""
    shm_dir: str = ""
    # Writers wake the daemon through it; None: it polls the rings on a timer.
    doorbell: str | None = None
    doorbell_wakeups: int = 0
    # Shared memory the delivered arrays live in (None: off, or shm_dir not there yet).
    arena: dict[str, Any] | None = None
    # The child that copies large ring payloads into the arena (None: none, no arena or turned off).
    copier: dict[str, Any] | None = None
    discovery: str = ""
    rings: list[dict[str, Any]] = []
    # How far behind the daemon is: unread bytes of all rings, and the longest any has waited.
    pending_bytes: int = 0
    pending_s: float = 0.0
    rings_refused: int = 0
    # Instance directories (or the shm dir) failing the access rules.
    dirs_refused: int = 0
    rings_broken: int = 0
    broken_rings: list[dict[str, Any]] = []
    rejected_records: int = 0
    corrupt_records: int = 0
    writers_exited: int = 0
    requests_in_flight: int = 0
    # Of those, captures that end once the daemon has read their rings up to where they stood
    # end_grace_s after the END (or after the END was declared lost).
    requests_waiting_for_rings: int = 0
    requests: list[dict[str, Any]] = []
    inflight_bytes: int = 0
    inflight_budget: int = 0
    captures_cut: int = 0
    retained_requests: int = 0
    retained_bytes: int = 0
    evicted_requests: int = 0
    records_in: int = 0
    bytes_in: int = 0
    steps_joined: int = 0
    drops: Drops = msgspec.field(default_factory=Drops)
    # Positions delivered as gaps, by reason (daemon/events.py GAP_REASONS, "other").
    gap_positions: dict[str, int] = {}
    reassembly: dict[str, int] = {}
    reassembly_errors: int = 0
    subscribers: int = 0
    subscribers_waiting: int = 0
    subscribers_total: int = 0
    subscribers_too_slow: int = 0
    subscriptions_refused: int = 0
    subscriptions_dropped_peer_gone: int = 0
    # None: a daemon from before connections were counted.
    connections: Connections | None = None
    delivered_messages: int = 0
    delivered_bytes: int = 0
    # Of those, through the arena (descriptors; watchers included): messages, payload bytes described.
    arena_messages: int = 0
    arena_bytes: int = 0
    bad_requests: int = 0
    delivery_latency_s: dict[str, Any] = {}
    # watch (daemon/watch.py): the sequence numbers given, retained range and state file (None: a
    # daemon without watch), and the watchers.
    sequence: dict[str, Any] | None = None
    watchers: list[dict[str, Any]] = []
    watchers_total: int = 0
    watches_refused: int = 0
    watch_delivered: int = 0
    watch_lost: dict[str, int] = {}
    # Engines across hosts: this daemon's role (a peer of a home, or the home of peers; None: neither).
    federation: dict[str, Any] | None = None
    # Each engine's ranks from the placements of its rings: world size, those never reporting, hosts
    # whose tap settings differ from the home's.
    engines: list[dict[str, Any]] = []


def from_map(status: dict[str, Any]) -> DaemonStatus:
    """A status as the client hands it out (a map) back as the Struct; ValueError if it is not one."""
    return msgspec.convert(status, DaemonStatus, strict=False)


def to_map(status: DaemonStatus) -> dict[str, Any]:
    return msgspec.to_builtins(status)
