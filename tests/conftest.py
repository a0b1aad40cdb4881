"""Shared fixtures: a private shm directory, a short ipc socket path, and a real daemon process.

Other test files may use them:
    def test_x(daemon_proc):            # a daemon on a fresh shm dir, default settings
        Client(daemon_proc.endpoint).status()
    def test_y(daemon_factory):         # custom settings: any DaemonConfig field the CLI exposes
        d = daemon_factory(end_grace_s=0.5, retain_bytes=1 << 20)
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# The helpers every test directory imports (synthetic_writer, server_stack, ...) live in tests/support.
SUPPORT_DIR = os.path.join(TESTS_DIR, "support")
if SUPPORT_DIR not in sys.path:
    sys.path.insert(0, SUPPORT_DIR)


_TAP_LOG = logging.getLogger("vllm_tap")
# As this process found it, before any test ran: a vLLM engine made by a module's fixture changes it
# before a test's own fixtures could note what it was.
_TAP_LOG_AS_FOUND = (list(_TAP_LOG.handlers), _TAP_LOG.level, _TAP_LOG.propagate)


@pytest.fixture(autouse=True)
def _tap_logger_as_found():
    """Undo what a vLLM engine run in this process does to the tap's logger.

    The plugin hands the `vllm_tap` logger vLLM's handlers and stops it propagating (so its lines go
    where vLLM's go); left so, every later test's caplog sees none of the tap's lines.
    """
    yield
    handlers, level, propagate = _TAP_LOG_AS_FOUND
    _TAP_LOG.handlers[:] = handlers
    _TAP_LOG.setLevel(level)
    _TAP_LOG.propagate = propagate


@pytest.fixture
def shm_dir():
    d = tempfile.mkdtemp(prefix="vllm-tap-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(d + ".arena", ignore_errors=True)  # the daemon's arena directory (arena_dir), if a killed one left it


@pytest.fixture
def shm(tmp_path):
    """A /dev/shm path nothing has made yet (the code under test makes it, with its own mode),
    removed afterwards with whatever it holds."""
    d = f"/dev/shm/vllm-tap-test-{tmp_path.name}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sock_dir():
    # ipc paths are limited to ~107 bytes, so not under pytest's long tmp_path.
    d = tempfile.mkdtemp(prefix="vt-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@dataclass
class DaemonProcess:
    """`vllm-tap daemon` in a child process (its log goes to `log_path`)."""

    shm_dir: str
    endpoint: str
    log_path: str
    settings: dict = field(default_factory=dict)
    rlimits: dict = field(default_factory=dict)  # resource name ("RLIMIT_NOFILE") -> soft limit or (soft, hard)
    proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "vllm_tap.cli", "daemon", "--shm-dir", self.shm_dir, "--endpoint", self.endpoint]
        from vllm_tap.daemon.config_load import flag_name

        for k, v in self.settings.items():
            if isinstance(v, bool):  # a switch
                argv.append(flag_name(k) if v else f"--no-{flag_name(k)[2:]}")
            else:
                argv += [flag_name(k), str(v)]
        return argv

    def start(self, wait: bool = True) -> "DaemonProcess":
        import ctypes
        import resource

        log = open(self.log_path, "ab")
        limits = {getattr(resource, k): v for k, v in self.rlimits.items()}
        libc = ctypes.CDLL(None, use_errno=True)

        def preexec() -> None:
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no daemon outlives a killed test run
            for which, value in limits.items():  # a soft limit alone keeps the hard one, as under systemd
                resource.setrlimit(which, value if isinstance(value, tuple) else (value, resource.getrlimit(which)[1]))

        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=log, preexec_fn=preexec)
        log.close()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 15.0) -> None:
        from vllm_tap.client import Client, DaemonUnavailable

        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                Client(self.endpoint).status(timeout=0.2)
                return
            except DaemonUnavailable:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"daemon not ready after {timeout} s:\n{self.log()}")

    def client(self):
        from vllm_tap.client import Client

        return Client(self.endpoint)

    def status(self) -> dict:
        return self.client().status(timeout=5.0)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill(self) -> None:
        """SIGKILL: no goodbye, no cleanup."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture
def daemon_factory(shm_dir, sock_dir):
    """Start daemons on this test's shm dir: daemon_factory(**DaemonConfig fields) -> DaemonProcess."""
    made: list[DaemonProcess] = []

    def make(*, start: bool = True, endpoint: str | None = None, rlimits: dict | None = None, **settings) -> DaemonProcess:
        settings.setdefault("log_level", "INFO")
        # Its own sequence state (kept across restarts of this DaemonProcess), never the user's default.
        settings.setdefault("state_dir", os.path.join(sock_dir, f"state{len(made)}"))
        d = DaemonProcess(shm_dir, endpoint or f"ipc://{sock_dir}/d{len(made)}.sock",
                          os.path.join(sock_dir, f"daemon{len(made)}.log"), settings, dict(rlimits or {}))
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        if d.alive():
            d.stop()


@pytest.fixture
def daemon_proc(daemon_factory) -> DaemonProcess:
    """A running daemon on a fresh shm dir (end grace shortened so incomplete requests end quickly)."""
    return daemon_factory(end_grace_s=1.0)


@pytest.fixture(scope="session")
def other_users_python():
    """An interpreter other local accounts can execute, with the project and its run-time
    dependencies (tests/support/other_users_python.py); made once per session, removed after."""
    from other_users_python import CannotRun, build

    try:
        py = build()
    except CannotRun as e:
        pytest.skip(f"no interpreter other accounts can run: {e}")
    yield py
    shutil.rmtree(py.root, ignore_errors=True)
