"""A dependency-free sd_notify(3) client: readiness, status, watchdog keep-alives, stopping.

Everything is a no-op without $NOTIFY_SOCKET, so the daemon runs the same under systemd, in a
terminal and in tests. A failed send is logged once and otherwise ignored: losing a status line
must never take the daemon down (a lost WATCHDOG=1 is what the watchdog is for).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Mapping

log = logging.getLogger(__name__)


def _address(raw: str) -> str | bytes | None:
    if raw.startswith("@"):  # abstract namespace: systemd writes '@', the kernel wants a NUL
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    return None  # vsock and friends: not used on the hosts this runs on


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Half of WATCHDOG_USEC (what sd_watchdog_enabled() advises), or None when the watchdog is off."""
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    # WATCHDOG_PID tells which process systemd expects pings from; a child that inherited the
    # environment must stay quiet, or a hung parent would be kept alive by it.
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        self._addr = _address(env.get("NOTIFY_SOCKET", ""))
        self._sock: socket.socket | None = None
        if self._addr is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.watchdog_interval = _watchdog_interval(env) if self._sock else None
        self._last_ping = float("-inf")
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *assignments: str) -> bool:
        """Send KEY=VALUE lines in one datagram (so READY=1 and its STATUS= arrive together)."""
        if self._sock is None:
            return False
        # A newline inside a value would end the assignment early and inject another one.
        msg = "\n".join(a.replace("\n", " ") for a in assignments)
        try:
            self._sock.sendto(msg.encode(), self._addr)  # type: ignore[arg-type]
            return True
        except OSError as e:
            if not self._warned:
                log.warning("sd_notify to %s failed: %s (further failures not logged)", self._addr, e)
                self._warned = True
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self, now: float | None = None) -> bool:
        """Ping, at most every WATCHDOG_USEC/2; cheap enough to call from every loop iteration."""
        if self.watchdog_interval is None:
            return False
        now = time.monotonic() if now is None else now
        if now - self._last_ping < self.watchdog_interval:
            return False
        self._last_ping = now
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
