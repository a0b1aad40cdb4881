"""Where the parts meet by default: the shared-memory directory the rings live in and the socket the
daemon serves. One home, at the bottom of the layers, for what the hooks (writing rings), the daemon
(reading rings, serving the socket) and the client (connecting) must agree on. Imports nothing of the
project."""

from __future__ import annotations

import os

DEFAULT_SHM_DIR = "/dev/shm/vllm-tap"


def default_endpoint() -> str:
    """ipc socket under systemd's RuntimeDirectory when root, else under the user's runtime dir."""
    if os.geteuid() == 0:
        return "ipc:///run/vllm-tap/tap.sock"
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/vllm-tap-{os.getuid()}"
    return f"ipc://{base}/vllm-tap.sock"
