"""The daemon's settings. Loading (TOML file, then environment, then flags) lives in config_load."""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_tap.defaults import DEFAULT_SHM_DIR, default_endpoint


def default_state_dir() -> str:
    """Where the sequence counter lives (systemd's StateDirectory= is set by config_load): root
    /var/lib/vllm-tap, else $XDG_STATE_HOME/vllm-tap (~/.local/state/vllm-tap)."""
    if os.geteuid() == 0:
        return "/var/lib/vllm-tap"
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "vllm-tap")


@dataclass
class DaemonConfig:
    shm_dir: str = DEFAULT_SHM_DIR  # where rings are discovered (one sub-directory per instance)
    endpoint: str = ""  # ZeroMQ endpoint subscribers connect to; "" = default_endpoint()
    poll_interval_s: float = 0.0005  # sleep when every ring is empty
    retain_bytes: int = 1 << 30  # finished requests kept for late subscribers, LRU beyond this
    retain_ttl_s: float = 600.0  # ... and for at most this long
    end_grace_s: float = 5.0  # records committed this long after a capture's END still count (config_load)
    subscriber_queue: int = 10000  # messages queued per subscriber before it is cut off as too slow
    inflight_bytes: int = 4 << 30  # held for captures not ended yet; beyond, the biggest is cut (gaps)
    arena_bytes: int = 2 << 30  # shared memory for delivered arrays (same-host subscribers map it); 0 = off
    arena_dir: str = ""  # the arena's directory, readable by socket_group; "" = resolved_arena_dir()
    arena_linger_s: float = 10.0  # a capture fully sent to an arena subscriber stays this long for it to copy
    ring_copier: bool = True  # large ring payloads copied into the arena by a child that maps the rings
    max_connections: int = 4096  # connections to the socket in all; more are refused
    max_connections_per_peer: int = 1024  # per process (ipc://) or address (tcp://)
    max_subscriptions: int = 65536  # subscriptions in all; more are refused with an error
    max_subscriptions_per_connection: int = 1024
    metrics_addr: str = ""  # host:port for Prometheus metrics; "" = off
    state_dir: str = ""  # the persisted capture sequence counter; "" = default_state_dir()
    log_level: str = "INFO"
    # Who may do what (docs/operate.md, "Access model"); daemon/access.py turns these into checks.
    ring_group: str = ""  # group of the shm dir, instance dirs and rings (writers + daemon); "" = not checked
    ring_owners: str = ""  # users who may own instance dirs and rings (comma-separated); "" = any
    ring_mode: int = 0o660  # loosest mode of a ring file (directories: the same plus search, setgid)
    socket_group: str = ""  # group given the ipc socket and its directory (subscribers); "" = none
    curve_key: str = ""  # the daemon's CURVE secret certificate (`vllm-tap keygen`); "" = no CURVE
    curve_clients: str = ""  # directory of allowed clients' public certificates (*.key)
    insecure: bool = False  # allow a non-loopback tcp:// endpoint without CURVE
    # Engines across hosts (daemon/peer_link.py): a peer daemon dials its home; the home takes peers.
    federation_key: str = ""  # this daemon's CURVE secret certificate towards peers or home
    home: str = ""  # tcp://HOST:PORT of the home daemon's federation_endpoint; "" = not a peer
    home_key: str = ""  # the home daemon's public certificate (.key)
    federation_endpoint: str = ""  # tcp://HOST:PORT where this (home) daemon takes peer daemons; "" = none
    peer_keys: str = ""  # directory of the peer daemons' public certificates (*.key) allowed to connect

    def resolved_endpoint(self) -> str:
        return self.endpoint or default_endpoint()

    def resolved_state_dir(self) -> str:
        return self.state_dir or default_state_dir()

    def resolved_arena_dir(self) -> str:
        """`<shm_dir>.arena`: beside the ring directory (readers may not enter that one), on the same
        file system (/dev/shm: its size is already planned for shared memory; /run is often small)."""
        return self.arena_dir or self.shm_dir.rstrip("/") + ".arena"
