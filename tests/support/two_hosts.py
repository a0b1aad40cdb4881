"""Two "hosts" on one machine, for engines and daemons that span hosts: two network namespaces
joined by a veth pair (10.77.0.1 and 10.77.0.2), each with its own /dev/shm (a tmpfs in a mount
namespace of its own), so vLLM's same-node test sees two nodes and each host's rings are its own.

    with TwoHosts() as hosts:
        hosts.spawn(1, [...], log)           # a process on host 1 (its network, its /dev/shm)
        hosts.run(0, [...])                  # run to completion on host 0, output returned

Each host is a holder process (`unshare -m` with the tmpfs mounted, in the host's network
namespace); every process of a host enters the holder's namespaces with nsenter, so they share that
host's /dev/shm. /tmp stays the machine's: ipc sockets and logs there are reachable from both hosts
and from the test. Needs root, `ip`, `unshare` and `nsenter`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from typing import Sequence

ADDRESSES = ("10.77.0.1", "10.77.0.2")


def available() -> str | None:
    """Why two hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (network and mount namespaces)"
    missing = [t for t in ("ip", "unshare", "nsenter") if shutil.which(t) is None]
    return f"needs {', '.join(missing)}" if missing else None


class TwoHosts:
    def __init__(self, shm_bytes: str = "3g"):
        tag = uuid.uuid4().hex[:6]
        self.netns = [f"vt-{tag}-h0", f"vt-{tag}-h1"]
        self.links = [f"vt{tag}a", f"vt{tag}b"]
        self.shm_bytes = shm_bytes
        self.holders: list[subprocess.Popen] = []
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "TwoHosts":
        try:
            for ns in self.netns:
                _ip("netns", "add", ns)
            _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for i, (ns, link) in enumerate(zip(self.netns, self.links)):
                _ip("link", "set", link, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{ADDRESSES[i]}/24", "dev", link)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", link, "up")
                holder = subprocess.Popen(
                    ["ip", "netns", "exec", ns, "unshare", "-m", "--propagation", "private", "sh", "-c",
                     f"mount -t tmpfs -o size={self.shm_bytes} tmpfs /dev/shm && echo ready && exec sleep infinity"],
                    stdout=subprocess.PIPE, start_new_session=True)
                self.holders.append(holder)
                if holder.stdout.readline().strip() != b"ready":
                    raise RuntimeError(f"host {i}: could not give it a /dev/shm of its own")
        except BaseException:
            self.__exit__()
            raise
        return self

    def interface(self, host: int) -> str:
        return self.links[host]

    def _enter(self, host: int) -> list[str]:
        return ["nsenter", "-t", str(self.holders[host].pid), "-m", "-n", "--"]

    def spawn(self, host: int, argv: Sequence[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
        """A process on `host`, in a process group of its own (stopped with the hosts)."""
        log = open(log_path, "ab")
        try:
            p = subprocess.Popen(self._enter(host) + list(argv), stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})}, start_new_session=True)
        finally:
            log.close()
        self.procs.append(p)
        return p

    def run(self, host: int, argv: Sequence[str], timeout: float = 300, env: dict | None = None
            ) -> subprocess.CompletedProcess:
        return subprocess.run(self._enter(host) + list(argv), capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            _kill_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(p, signal.SIGKILL)
                p.wait(5)
        for h in self.holders:
            _kill_group(h, signal.SIGKILL)
            h.wait(5)
        for ns in self.netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _kill_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
