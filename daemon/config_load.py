"""Build a DaemonConfig from one TOML file, then the environment, then command-line flags.

Later sources win. Every problem becomes a ConfigError whose message is one line naming the key
and where the bad value came from, because the operator reads it in `journalctl` or a terminal and
should not have to decode a traceback to find the typo.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import sys
import typing
from typing import Any, Mapping

from vllm_tap.safe_paths import gid_of, uid_of

from .config import DaemonConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project targets 3.11; tomli is the same parser for 3.10
    import tomli as tomllib

DEFAULT_CONFIG_PATH = "/etc/vllm-tap/config.toml"
ENV_PREFIX = "VLLM_TAP_"
RUNTIME_SOCKET = "tap.sock"

# One line per key; the configuration table in docs/operate.md is generated from this (see markdown_table).
DOCS: dict[str, str] = {
    "shm_dir": "Directory the vLLM hook writes rings into (one sub-directory per vLLM instance).",
    "endpoint": "ZeroMQ endpoint subscribers connect to, `ipc://PATH` or `tcp://HOST:PORT`; empty = "
    "`ipc://$RUNTIME_DIRECTORY/tap.sock` under systemd (`/run/vllm-tap/tap.sock` with the shipped unit), "
    "else `ipc:///run/vllm-tap/tap.sock` as root, else under `$XDG_RUNTIME_DIR`.",
    "poll_interval_s": ("Sleep between ring scans when every ring is empty and writers cannot wake the daemon "
                        "(seconds, > 0). Normally writers wake it through its doorbell, `<shm_dir>/.doorbell` "
                        "(`status` shows it), and it then reads the rings at once, and at least every 50 ms."),
    "retain_bytes": "Finished requests kept for late subscribers, evicted oldest first beyond this size "
    "(bytes; `512MiB`, `1GiB` accepted).",
    "retain_ttl_s": "Longest a finished request is kept for late subscribers (seconds; `10m` accepted).",
    "end_grace_s": "How long after a capture's END records committed for it are still waited for (a GPU worker "
    "may commit a step's records just after the engine ends the request). A capture still missing positions ends "
    "once the daemon has read every worker ring up to where that ring stood this long after the END was read, "
    "however far behind the daemon is; a capture whose END was lost (the engine no longer lists it) waits the same "
    "way, then ends `end lost` (seconds).",
    "subscriber_queue": "Messages queued per subscriber before it is cut off as too slow (>= 1).",
    "inflight_bytes": "Memory for captures that have not ended yet (their histories and what reassembly holds); "
    "beyond it the biggest capture is cut: its remaining positions become gaps saying `over budget`. Raise it "
    "for long full-logit captures (bytes; `4GiB` accepted).",
    "arena_bytes": "Shared memory (a file `.arena-<id>` in `arena_dir`, mode 0640) holding the arrays the daemon "
    "delivers and retains; subscribers on the same host (`ipc://`) map it read-only and receive descriptors instead "
    "of payloads. tmpfs pages are reserved as it fills; arrays that do not fit are delivered as frames. 0 = off "
    "(bytes; `2GiB` accepted).",
    "arena_dir": "Directory of the arena file: the daemon's own, mode 0750 in `socket_group` (0700 without), so "
    "subscribers may map the arena and nobody else may look; an existing one owned by someone else, a link, or "
    "looser than that stops start-up (one line). Empty = `<shm_dir>.arena` (`/dev/shm/vllm-tap.arena`).",
    "arena_linger_s": "After the last message of a capture went to a subscriber through the arena, how long its "
    "arrays are kept for that subscriber to copy them even if retention dropped the capture (seconds); a subscriber "
    "slower than this gets a gap saying `overwritten`. Pins go with the subscriber's connection and never exceed "
    "half of `arena_bytes` in all.",
    "ring_copier": "Copy ring payloads of 2 MiB and more into the arena from a child process that maps the rings "
    "(about 0.14 CPU s/GB against pread's 0.22; the child, not the daemon, dies if a ring is truncated under it, and "
    "pread takes over). `false`: every record is read with pread.",
    "max_connections": "Connections to the subscriber socket at once; more are refused (the client says so). "
    "Also kept below the descriptor limit.",
    "max_connections_per_peer": "Connections at once from one peer: one process over `ipc://`, one address over "
    "`tcp://` (the client opens one per subscription).",
    "max_subscriptions": "Subscriptions at once, waiting or streaming; more are refused with an error.",
    "max_subscriptions_per_connection": "Subscriptions at once on one connection; more are refused with an error.",
    "metrics_addr": "`HOST:PORT` (or `:PORT`) for the Prometheus endpoint; empty = no endpoint.",
    "state_dir": "Directory of the persisted capture sequence counter (`sequence.json`, locked by one daemon) "
    "and of what a graceful stop hands to the next daemon (`handover.msgpack`); "
    "empty = `$STATE_DIRECTORY` under systemd (`/var/lib/vllm-tap` with the shipped unit), else "
    "`/var/lib/vllm-tap` as root, else `$XDG_STATE_HOME/vllm-tap` (`~/.local/state/vllm-tap`).",
    "log_level": "`DEBUG`, `INFO`, `WARNING`, `ERROR` or `CRITICAL`.",
    "ring_group": "Group the shm directory, the instance directories and the rings must belong to: the writers' "
    "(vLLM's) and the daemon's group, never the subscribers'. Anything else is refused (one line, counted in "
    "`status`); empty = not checked. The shipped units use `vllm-tap-rings`.",
    "ring_owners": "Users who may own instance directories and rings (comma-separated names; the daemon's user and "
    "root always may); empty = any user the directory's group and mode let in.",
    "ring_mode": "The loosest mode a ring may have (octal, `\"0660\"`); a ring with any other permission bit is "
    "refused. Directories may have the same plus search and setgid (`2770`).",
    "socket_group": "Group given the `ipc://` socket (mode 0660) and its directory (0750): the subscribers' group. "
    "Empty = the socket is 0600, for the daemon's own user only. The shipped units use `vllm-tap-readers`.",
    "curve_key": "The daemon's CURVE secret certificate (`vllm-tap keygen DIR --name server` writes "
    "`server.key_secret`): subscribers must then authenticate and the traffic is encrypted. Empty = no CURVE.",
    "curve_clients": "Directory of the public certificates (`*.key`) of the clients allowed to connect when "
    "`curve_key` is set; re-read when it changes.",
    "insecure": "Allow a `tcp://` endpoint that is not loopback without CURVE (anyone who reaches the port reads "
    "every capture). The flag is `--insecure`.",
    "federation_key": "This daemon's CURVE secret certificate for federation (`vllm-tap keygen DIR --name NAME`): "
    "a peer's identity towards its home, the home's server key towards its peers.",
    "home": "On a host of a multi-host engine that is not its home: `tcp://HOST:PORT` of the home daemon's "
    "`federation_endpoint`. This daemon then streams its rings' records there, and serves the captures its own "
    "rings' records suffice for (the home sends it the engine's BEGIN, END and LIVE records).",
    "home_key": "The home daemon's public certificate (its `federation_key`'s `.key` file); needed with `home`.",
    "federation_endpoint": "On the engine's home host: `tcp://HOST:PORT` where peer daemons connect (CURVE only); "
    "empty = none.",
    "peer_keys": "Directory of the peer daemons' public certificates (`*.key`) allowed to connect to "
    "`federation_endpoint`.",
}

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0}
_NUMBER_WITH_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A configuration problem, already phrased as the one line the operator will see."""


def _field_types() -> dict[str, type]:
    hints = typing.get_type_hints(DaemonConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(DaemonConfig)}


def env_var(key: str) -> str:
    return ENV_PREFIX + key.upper()


def flag_name(key: str) -> str:
    """retain_ttl_s -> --retain-ttl: flags drop the unit suffix the CLI has always used."""
    return "--" + key.removesuffix("_s").replace("_", "-")


def _parse_size(text: str) -> int:
    m = _NUMBER_WITH_UNIT.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"expected a byte count like 1073741824 or 1GiB, got {text!r}")
    value = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def _parse_duration(text: str) -> float:
    m = _NUMBER_WITH_UNIT.match(text)
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"expected seconds like 0.5 or a duration like 500ms / 10m, got {text!r}")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _parse_mode(value: Any) -> int:
    """Permission bits: a string read as octal ("0660", "660", "0o660") or a TOML integer (0o660)."""
    if isinstance(value, int):
        out = value
    elif isinstance(value, str):
        try:
            out = int(value.strip().lower().removeprefix("0o"), 8)
        except ValueError:
            raise ValueError(f"expected an octal mode like \"0660\", got {value!r}") from None
    else:
        raise ValueError(f"expected an octal mode like \"0660\", got {type(value).__name__} {value!r}")
    if not 0 <= out <= 0o777:
        raise ValueError(f"expected permission bits between 0000 and 0777, got {value!r}")
    return out


def _coerce(key: str, typ: type, value: Any) -> Any:
    """Turn a TOML value or a string (environment, flags) into the field's type; ValueError if it cannot."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"expected true or false, got {value!r}")
    if isinstance(value, bool):  # bool is an int subclass; `retain_bytes = true` is a mistake, not 1
        raise ValueError(f"expected {typ.__name__}, got a boolean")
    if key.endswith("_mode"):
        return _parse_mode(value)
    if typ is str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {type(value).__name__} {value!r}")
        return value
    if typ is int:
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            if key.endswith("_bytes"):
                return _parse_size(value)
            try:
                return int(value.strip())
            except ValueError:
                raise ValueError(f"expected an integer, got {value!r}") from None
        raise ValueError(f"expected an integer, got {type(value).__name__} {value!r}")
    if typ is float:
        if isinstance(value, (int, float)):
            out = float(value)
        elif isinstance(value, str):
            out = _parse_duration(value) if key.endswith("_s") else float(value)
        else:
            raise ValueError(f"expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(out):
            raise ValueError(f"expected a finite number, got {value!r}")
        return out
    raise TypeError(f"DaemonConfig.{key} has type {typ!r}, which config_load cannot parse")  # a bug, not input


def _check_metrics_addr(addr: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT or :PORT, got {addr!r}")


def _validate(cfg: DaemonConfig) -> list[tuple[str, str]]:
    """(key, reason) for every value that parses but makes no sense."""
    bad: list[tuple[str, str]] = []
    if not cfg.shm_dir:
        bad.append(("shm_dir", "must not be empty"))
    if cfg.endpoint and (not cfg.endpoint.startswith(("ipc://", "tcp://")) or cfg.endpoint in ("ipc://", "tcp://")):
        bad.append(("endpoint", f"unsupported endpoint {cfg.endpoint!r}: use ipc://PATH or tcp://HOST:PORT"))
    if cfg.poll_interval_s <= 0:
        bad.append(("poll_interval_s", f"must be > 0, got {cfg.poll_interval_s}"))
    for key in ("retain_bytes", "retain_ttl_s", "end_grace_s", "arena_bytes", "arena_linger_s"):
        if getattr(cfg, key) < 0:
            bad.append((key, f"must be >= 0, got {getattr(cfg, key)}"))
    for key in ("subscriber_queue", "inflight_bytes", "max_connections", "max_connections_per_peer",
                "max_subscriptions", "max_subscriptions_per_connection"):
        if getattr(cfg, key) < 1:
            bad.append((key, f"must be >= 1, got {getattr(cfg, key)}"))
    if cfg.metrics_addr:
        try:
            _check_metrics_addr(cfg.metrics_addr)
        except ValueError as e:
            bad.append(("metrics_addr", str(e)))
    if cfg.log_level.upper() not in _LOG_LEVELS:
        bad.append(("log_level", f"must be one of {', '.join(_LOG_LEVELS)}, got {cfg.log_level!r}"))
    bad += _validate_access(cfg)
    bad += _validate_federation(cfg)
    return bad


def _tcp_endpoint(value: str) -> bool:
    host, sep, port = value[len("tcp://"):].rpartition(":")
    return value.startswith("tcp://") and bool(host) and bool(sep) and port.isdigit() and 0 < int(port) < 65536


def _validate_federation(cfg: DaemonConfig) -> list[tuple[str, str]]:
    """A daemon is a peer (home), a home (federation_endpoint), or alone; each with its keys."""
    bad: list[tuple[str, str]] = []
    if cfg.home and cfg.federation_endpoint:
        bad.append(("home", "a daemon is either a peer (home) or a home (federation_endpoint), not both"))
    for key in ("home", "federation_endpoint"):
        value = getattr(cfg, key)
        if value and not _tcp_endpoint(value):
            bad.append((key, f"expected tcp://HOST:PORT, got {value!r}"))
    if (cfg.home or cfg.federation_endpoint) and not cfg.federation_key:
        bad.append(("federation_key", "must name this daemon's CURVE secret certificate (`vllm-tap keygen`) "
                                      "when home or federation_endpoint is set"))
    if cfg.home and not cfg.home_key:
        bad.append(("home_key", "must name the home daemon's public certificate when home is set"))
    if cfg.federation_endpoint and not cfg.peer_keys:
        bad.append(("peer_keys", "must name the directory of allowed peer keys when federation_endpoint is set"))
    for key in ("federation_key", "home_key"):
        path = getattr(cfg, key)
        if path and (cfg.home or cfg.federation_endpoint) and not os.path.isfile(path):
            bad.append((key, f"{path} is not a file"))
    return bad


def tcp_host(endpoint: str) -> str:
    """The host part of tcp://HOST:PORT, without IPv6 brackets."""
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(endpoint: str) -> bool:
    """Whether a tcp:// endpoint binds only the loopback interface (a name is trusted only as localhost/lo)."""
    host = tcp_host(endpoint)
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # *, an interface, a host name: reachable from elsewhere as far as we know


def _validate_access(cfg: DaemonConfig) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    for key in ("ring_group", "socket_group"):
        name = getattr(cfg, key)
        if name:
            try:
                gid_of(name)
            except KeyError as e:
                bad.append((key, str(e.args[0])))
    for user in filter(None, (u.strip() for u in cfg.ring_owners.split(","))):
        try:
            uid_of(user)
        except KeyError as e:
            bad.append(("ring_owners", str(e.args[0])))
    arena_dir = os.path.normpath(cfg.resolved_arena_dir())
    shm = os.path.normpath(cfg.shm_dir)
    if cfg.arena_bytes and (arena_dir == shm or arena_dir.startswith(shm + os.sep)):
        bad.append(("arena_dir", f"{arena_dir} is inside shm_dir {shm}, which subscribers may not enter: "
                                 "give the arena a directory of its own"))
    if cfg.curve_key and not cfg.curve_clients:
        bad.append(("curve_clients", "must name the directory of allowed client keys when curve_key is set"))
    if cfg.curve_clients and not cfg.curve_key:
        bad.append(("curve_key", "must name the daemon's secret certificate when curve_clients is set"))
    if (cfg.endpoint.startswith("tcp://") and not cfg.curve_key and not cfg.insecure
            and not is_loopback(cfg.endpoint)):
        bad.append(("endpoint", f"{cfg.endpoint} is reachable from other hosts and has no CURVE keys: anyone who "
                                "reaches it could read every capture; set curve_key and curve_clients "
                                "(`vllm-tap keygen`), bind 127.0.0.1, or pass --insecure"))
    return bad


def _exists(path: str) -> bool:
    """Unlike os.path.exists, True when the path cannot even be looked at (EACCES), so that the
    read fails loudly instead of the operator's settings being skipped."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: invalid TOML: {' '.join(str(e).split())}") from None


def load_config(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> DaemonConfig:
    """File (`path`, else DEFAULT_CONFIG_PATH if it exists) < `env` (VLLM_TAP_<KEY>) < `flags`.

    `flags` maps field names to values; None means "not given" so a CLI can pass every option
    through unfiltered. Unknown VLLM_TAP_* variables are ignored: the hook shares that prefix.
    """
    env = os.environ if env is None else env
    types = _field_types()
    values: dict[str, Any] = {}
    source: dict[str, str] = {}

    # The default file may be absent; present but unreadable is an error, not "no settings".
    if path is None and _exists(DEFAULT_CONFIG_PATH):
        path = DEFAULT_CONFIG_PATH
    for key, value in (_read_toml(path) if path is not None else {}).items():
        where = f"config file {path}"
        if key not in types:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(types)})")
        values[key], source[key] = value, where

    for key in types:
        if env_var(key) in env:
            values[key], source[key] = env[env_var(key)], f"environment {env_var(key)}"

    for key, value in (flags or {}).items():
        if key not in types:
            raise ConfigError(f"unknown option {flag_name(key)}")
        if value is not None:
            values[key], source[key] = value, f"option {flag_name(key)}"

    parsed: dict[str, Any] = {}
    for key, value in values.items():
        try:
            parsed[key] = _coerce(key, types[key], value)
        except ValueError as e:
            raise ConfigError(f"{source[key]}: {key}: {e}") from None
    cfg = DaemonConfig(**parsed)
    cfg.log_level = cfg.log_level.upper()
    if not cfg.endpoint and env.get("RUNTIME_DIRECTORY"):
        # Under systemd the unit's RuntimeDirectory= is the one place both the daemon (sandboxed,
        # PrivateTmp) and its subscribers can reach; the user-session default would be neither.
        cfg.endpoint = f"ipc://{env['RUNTIME_DIRECTORY'].split(':')[0]}/{RUNTIME_SOCKET}"

    if not cfg.state_dir and env.get("STATE_DIRECTORY"):
        # The unit's StateDirectory= (persistent, owned by the daemon's user, survives reboots).
        cfg.state_dir = env["STATE_DIRECTORY"].split(":")[0]

    problems = _validate(cfg)
    if problems:
        key, reason = problems[0]  # one line; the operator fixes one thing at a time anyway
        where = source.get(key, "default")
        raise ConfigError(f"{where}: {key}: {reason}")
    return cfg


def _human(key: str, value: Any) -> str:
    """A default as it would be written in config.toml."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if key.endswith("_mode"):
        return f'"{value:04o}"'
    if key.endswith("_bytes") and value:
        for unit in ("TiB", "GiB", "MiB", "KiB"):
            if value % _SIZE_UNITS[unit.lower()] == 0:
                return f'"{value // _SIZE_UNITS[unit.lower()]}{unit}"'
    return repr(value)


def markdown_table() -> str:
    """The configuration table in docs/operate.md, so the documentation cannot drift from the code."""
    defaults = DaemonConfig()
    rows = ["| key | environment | flag | default | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(DaemonConfig):
        default = getattr(defaults, f.name)
        shown = f"`{_human(f.name, default)}`"
        flag = flag_name(f.name)
        flag = f"`{flag}` / `--no-{flag[2:]}`" if f.type in (bool, "bool") else f"`{flag}`"
        rows.append(f"| `{f.name}` | `{env_var(f.name)}` | {flag} | {shown} | {DOCS.get(f.name, '')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    # `python -m vllm_tap.daemon.config_load` prints the table for docs/operate.md.
    sys.stdout.write(markdown_table() + "\n")
