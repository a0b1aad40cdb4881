"""The daemon as a service: configuration, sd_notify and watchdog, metrics, SIGTERM, unit files.

The daemon runs as a real child process (`python -m vllm_tap.daemon.service`) reading a real ring
in a private directory under /dev/shm; the test plays systemd by binding the NOTIFY_SOCKET
datagram socket itself, so no systemd as PID 1 is needed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from vllm_tap import ring_format as rf
from vllm_tap import wire_format as wf
from vllm_tap.daemon import config_load
from vllm_tap.daemon.config import DaemonConfig
from vllm_tap.daemon.config_load import DOCS, ConfigError, load_config, markdown_table
from vllm_tap.daemon.metrics import DaemonCollector, start_metrics_server
from vllm_tap.daemon.sdnotify import Notifier
from vllm_tap.daemon.service import MainLoopSnapshots, _OneLineFormatter
from vllm_tap.ring_records import TensorId
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_reader import read_info
from vllm_tap.ring_writer import RingWriter
from vllm_tap.ring_schema import BeginMeta, EndMeta

REPO = Path(__file__).resolve().parent.parent.parent
SYSTEMD = REPO / "systemd"
HAVE_DAEMON = importlib.util.find_spec("vllm_tap.daemon.server") is not None
needs_daemon = pytest.mark.skipif(not HAVE_DAEMON, reason="vllm_tap.daemon.server (the daemon core) is not there yet")


# --- configuration -----------------------------------------------------------------------------


def _toml(tmp_path: Path, text: str) -> str:
    p = tmp_path / "config.toml"
    p.write_text(text)
    return str(p)


def test_precedence_file_then_env_then_flags(tmp_path):
    path = _toml(tmp_path, 'log_level = "debug"\nretain_bytes = "512MiB"\nsubscriber_queue = 5\nend_grace_s = 1\n')
    env = {"VLLM_TAP_SUBSCRIBER_QUEUE": "7", "VLLM_TAP_RETAIN_TTL_S": "10m", "VLLM_TAP_UNRELATED": "x"}
    flags = {"subscriber_queue": "9", "metrics_addr": None, "poll_interval_s": "0.01"}
    cfg = load_config(path, env, flags)
    assert cfg.log_level == "DEBUG"  # file
    assert cfg.retain_bytes == 512 << 20  # file, human size
    assert cfg.end_grace_s == 1.0 and isinstance(cfg.end_grace_s, float)  # TOML int for a float
    assert cfg.retain_ttl_s == 600.0  # env, duration
    assert cfg.subscriber_queue == 9  # flag beats env beats file
    assert cfg.poll_interval_s == 0.01
    assert cfg.metrics_addr == ""  # None = flag not given
    assert load_config(path, env, {}).subscriber_queue == 7


@pytest.mark.parametrize(
    "toml, env, flags, names",
    [
        ('retain_byte = 5\n', {}, {}, ["retain_byte", "config.toml", "unknown key"]),
        ('retain_bytes = -1\n', {}, {}, ["retain_bytes", "config.toml", ">= 0"]),
        ('retain_bytes = "lots"\n', {}, {}, ["retain_bytes", "config.toml"]),
        ('subscriber_queue = true\n', {}, {}, ["subscriber_queue", "boolean"]),
        ('subscriber_queue = 0\n', {}, {}, ["subscriber_queue", ">= 1"]),
        ('endpoint = "http://x:1"\n', {}, {}, ["endpoint", "unsupported endpoint", "ipc://"]),
        ('endpoint = "ipc://"\n', {}, {}, ["endpoint", "unsupported endpoint"]),
        ('log_level = "LOUD"\n', {}, {}, ["log_level", "LOUD"]),
        ('metrics_addr = "9464x"\n', {}, {}, ["metrics_addr"]),
        ('[daemon]\nlog_level = "INFO"\n', {}, {}, ["daemon", "unknown key"]),
        ('log_level = \n', {}, {}, ["invalid TOML", "config.toml"]),
        ("", {"VLLM_TAP_POLL_INTERVAL_S": "fast"}, {}, ["VLLM_TAP_POLL_INTERVAL_S", "poll_interval_s"]),
        ("", {"VLLM_TAP_POLL_INTERVAL_S": "0"}, {}, ["VLLM_TAP_POLL_INTERVAL_S", "> 0"]),
        ("", {}, {"end_grace_s": "-2"}, ["--end-grace", "end_grace_s"]),
        ("", {}, {"bogus": "1"}, ["--bogus"]),
    ],
)
def test_bad_config_is_one_line_naming_the_key(tmp_path, toml, env, flags, names):
    with pytest.raises(ConfigError) as e:
        load_config(_toml(tmp_path, toml), env, flags)
    msg = str(e.value)
    assert "\n" not in msg
    for name in names:
        assert name in msg, msg


def test_config_file_lookup(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.toml"), {}, {})
    # The default path is optional, but a broken one must not be skipped silently.
    monkeypatch.setattr(config_load, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.toml"))
    assert load_config(None, {}, {}) == DaemonConfig()
    monkeypatch.setattr(config_load, "DEFAULT_CONFIG_PATH", _toml(tmp_path, "nope = 1\n"))
    with pytest.raises(ConfigError, match="nope"):
        load_config(None, {}, {})


def test_endpoint_defaults_to_the_units_runtime_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(config_load, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.toml"))
    assert load_config(None, {"RUNTIME_DIRECTORY": "/run/vllm-tap"}, {}).endpoint == "ipc:///run/vllm-tap/tap.sock"
    assert load_config(None, {"RUNTIME_DIRECTORY": "/run/x", "VLLM_TAP_ENDPOINT": "tcp://127.0.0.1:5"}, {}).endpoint == (
        "tcp://127.0.0.1:5"
    )


def test_every_key_is_documented_and_in_the_example_config():
    keys = [f.name for f in dataclasses.fields(DaemonConfig)]
    assert sorted(DOCS) == sorted(keys)
    assert all(DOCS[k] and "\n" not in DOCS[k] for k in keys)
    assert markdown_table() in (REPO / "docs" / "operate.md").read_text(), (
        "regenerate the table: python -m vllm_tap.daemon.config_load"
    )
    example = (SYSTEMD / "config.toml").read_text()
    # Uncommenting every setting of the example must give a valid config (and the defaults).
    uncommented = re.sub(r"(?m)^#(\w+ = )", r"\1", example)
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(uncommented)
        f.flush()
        cfg = load_config(f.name, {}, {})
    for key in keys:
        assert re.search(rf"(?m)^#?{key} = ", example), f"{key} missing from systemd/config.toml"
    assert cfg == DaemonConfig()  # the example says its values are the defaults


def test_click_options_feed_load_config(tmp_path):
    import click
    from click.testing import CliRunner

    from vllm_tap.daemon.cli_options import config_options

    @click.command()
    @config_options
    def daemon(config_path, **flags):
        cfg = load_config(config_path, {"VLLM_TAP_LOG_LEVEL": "ERROR", "VLLM_TAP_SUBSCRIBER_QUEUE": "3"}, flags)
        click.echo(f"{cfg.log_level} {cfg.subscriber_queue} {cfg.retain_bytes}")

    path = _toml(tmp_path, 'retain_bytes = "2MiB"\nsubscriber_queue = 2\n')
    result = CliRunner().invoke(daemon, ["--config", path, "--log-level", "debug"])
    assert result.exit_code == 0, result.output
    assert result.output.split() == ["DEBUG", "3", str(2 << 20)]
    assert "--retain-bytes" in CliRunner().invoke(daemon, ["--help"]).output


def test_config_error_from_a_process_is_one_line(tmp_path):
    bad = _toml(tmp_path, 'retain_bytes = -5\n')
    commands = [[sys.executable, "-m", "vllm_tap.daemon.service", "--config", bad]]
    vllm_tap = shutil.which("vllm-tap")
    if vllm_tap:
        helptext = subprocess.run([vllm_tap, "daemon", "--help"], capture_output=True, text=True, timeout=30).stdout
        if "--config" in helptext:
            commands.append([vllm_tap, "daemon", "--config", bad])
    for cmd in commands:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=_clean_env())
        assert p.returncode != 0, cmd
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "retain_bytes" in lines[0] and bad in lines[0], (cmd, p.stderr)
        assert "Traceback" not in p.stderr


# --- sd_notify ---------------------------------------------------------------------------------


@pytest.fixture
def notify_path() -> Iterator[tuple[socket.socket, str]]:
    d = tempfile.mkdtemp(prefix="vt-notify-")  # short: AF_UNIX paths are limited to 108 bytes
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = os.path.join(d, "notify")
    sock.bind(path)
    sock.settimeout(2)
    yield sock, path
    sock.close()
    shutil.rmtree(d, ignore_errors=True)


def test_notifier_messages_and_watchdog_rate(notify_path):
    sock, path = notify_path
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
    assert n.watchdog_interval == pytest.approx(0.1)
    assert n.ready("up\nand running")
    assert sock.recv(4096) == b"READY=1\nSTATUS=up and running"
    assert n.watchdog(now=100.0) and not n.watchdog(now=100.05) and n.watchdog(now=100.11)
    n.stopping()
    assert [sock.recv(4096) for _ in range(3)] == [b"WATCHDOG=1", b"WATCHDOG=1", b"STOPPING=1"]
    n.close()


def test_notifier_abstract_socket_and_noop_cases():
    name = f"vllm-tap-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(2)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).status("hi")
        assert sock.recv(100) == b"STATUS=hi"
    assert not Notifier({}).ready("x") and not Notifier({}).watchdog()
    # WATCHDOG_PID names another process: its pings are not ours to send.
    other = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "1000", "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_interval is None and not other.watchdog()


# --- metrics and logging, in-process -------------------------------------------------------------


def _metrics(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@needs_daemon
def test_metrics_endpoint_serves_a_daemon_snapshot(shm_dir, sock_dir):
    from vllm_tap.daemon.metrics import _buckets
    from vllm_tap.daemon.server import Daemon
    from vllm_tap.daemon.latency import Histogram

    idle = Daemon(DaemonConfig(shm_dir=shm_dir, endpoint=f"ipc://{sock_dir}/unused.sock"))  # never run
    server, _ = start_metrics_server("127.0.0.1:0", idle)
    try:
        port = server.server_address[1]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    m = _metrics(text)
    assert m["vllm_tap_up"] == 1 and m["vllm_tap_rings"] == 0 and m["vllm_tap_subscribers"] == 0
    assert m["vllm_tap_delivery_latency_seconds_count"] == 0 and m["vllm_tap_dropped_records_total"] == 0
    assert "python_gc_objects_collected_total" not in m  # private registry: only our metrics

    h = Histogram()
    for v in (0.0003, 0.02, 60.0):
        h.observe(v)
    buckets = dict(_buckets(h.to_dict()))
    assert (buckets["0.0005"], buckets["0.025"], buckets["10.0"], buckets["+Inf"]) == (1, 2, 2, 3)


def test_failed_or_hung_snapshot_reads_as_down():
    class Broken:
        def snapshot(self):
            raise RuntimeError("boom")

    logging.getLogger("vllm_tap.daemon.metrics").disabled = True
    try:
        fams = list(DaemonCollector(Broken()).collect())
        assert [f.name for f in fams] == ["vllm_tap_up"] and fams[0].samples[0].value == 0
        hung = MainLoopSnapshots(lambda: {}, wait_s=0.05)  # nobody calls serve(): a stuck main loop
        fams = list(DaemonCollector(hung).collect())
        assert fams[0].samples[0].value == 0
    finally:
        logging.getLogger("vllm_tap.daemon.metrics").disabled = False


def test_log_lines_are_single_lines_with_journal_priority():
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        rec = logging.LogRecord("x", logging.WARNING, __file__, 1, "it failed", None, sys.exc_info())
    line = _OneLineFormatter("%(levelname)s %(name)s: %(message)s", journal=True).format(rec)
    assert "\n" not in line and line.startswith("<4>WARNING x: it failed | Traceback")


# --- the daemon as a process ---------------------------------------------------------------------


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_TAP_", "NOTIFY_", "WATCHDOG_", "JOURNAL_"))}
    env.update(extra)
    return env


def _write_request(writer: RingWriter, rid: str, steps: int = 2) -> None:
    writer.write_control(rid, BeginMeta(num_prompt_tokens=1))
    for step in range(steps):
        data = np.arange(8, dtype=np.float32).reshape(1, 8)
        assert writer.write(rid, TensorId(rf.TensorKind.LOGITS), [step], [step], data, step=step)
    writer.write_control(rid, EndMeta(reason="stop"))


class _Systemd:
    """The parts of PID 1 the daemon talks to: the notify socket, and a journal stream for stderr."""

    def __init__(self, sock_dir: str):
        self.name = f"vllm-tap-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name)  # abstract, announced as '@name' like systemd does
        self.log_path = os.path.join(sock_dir, "journal.log")
        self.messages: list[dict[str, str]] = []

    def start(self, config_path: str, watchdog_usec: int = 200000) -> subprocess.Popen:
        log = open(self.log_path, "ab")
        st = os.fstat(log.fileno())
        # STATE_DIRECTORY as systemd sets it for StateDirectory=: the daemon keeps its sequence state there.
        env = _clean_env(NOTIFY_SOCKET="@" + self.name, WATCHDOG_USEC=str(watchdog_usec),
                         JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}",
                         STATE_DIRECTORY=os.path.join(os.path.dirname(self.log_path), "state"))
        proc = subprocess.Popen([sys.executable, "-m", "vllm_tap.daemon.service", "--config", config_path],
                                env=env, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        return proc

    def wait_for(self, key: str, timeout: float, proc: subprocess.Popen | None = None) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, min(0.5, deadline - time.monotonic())))
            try:
                raw = self.sock.recv(4096).decode()
            except socket.timeout:
                if proc is not None and proc.poll() is not None:
                    break
                continue
            msg = dict(line.split("=", 1) for line in raw.split("\n"))
            self.messages.append(msg)
            if key in msg:
                return msg
        raise AssertionError(f"no {key} within {timeout}s; got {self.messages}; log: {self.log()}")

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def close(self) -> None:
        self.sock.close()


def _scrape(url: str) -> dict[str, float]:
    return _metrics(urllib.request.urlopen(url, timeout=5).read().decode())


def _stop(proc: subprocess.Popen, systemd: _Systemd) -> None:
    proc.send_signal(signal.SIGTERM)
    systemd.wait_for("STOPPING", 5, proc)
    assert proc.wait(timeout=5) == 0, systemd.log()


@needs_daemon
def test_service_notifies_watchdogs_serves_metrics_and_stops_on_sigterm(shm_dir, sock_dir):
    path = ring_path(shm_dir, "inst", 0)
    writer = RingWriter(path, 1 << 16)
    _write_request(writer, "req-1")
    config = _toml(Path(sock_dir), f'shm_dir = "{shm_dir}"\nendpoint = "ipc://{sock_dir}/tap.sock"\n'
                                   'metrics_addr = "127.0.0.1:0"\npoll_interval_s = 0.001\n')
    systemd = _Systemd(sock_dir)
    ctx = zmq.Context()
    proc = systemd.start(config)
    try:
        ready = systemd.wait_for("READY", 20, proc)
        assert ready["READY"] == "1" and shm_dir in ready["STATUS"], ready
        url = re.search(r"metrics on (\S+)", ready["STATUS"]).group(1)

        # WATCHDOG_USEC=200ms: the daemon must ping every 100 ms from its loop.
        t0 = time.monotonic()
        for _ in range(4):
            systemd.wait_for("WATCHDOG", 1.0, proc)
        assert time.monotonic() - t0 < 1.0

        deadline = time.monotonic() + 10
        while True:
            m = _scrape(url)
            if m.get("vllm_tap_records_total", 0) >= 4 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert m["vllm_tap_up"] == 1
        assert m["vllm_tap_records_total"] == 4  # BEGIN, 2 x DATA, END
        assert m["vllm_tap_bytes_total"] > 0
        assert m["vllm_tap_rings"] == 1 and m["vllm_tap_writers"] == 1  # this test process is the writer
        ring = "{instance=inst,rank=0,ring=%s}" % os.path.basename(path)
        assert m["vllm_tap_ring_capacity_bytes" + ring] == 1 << 16
        assert m["vllm_tap_ring_pending_bytes" + ring] == 0
        assert m["vllm_tap_ring_records_written_total" + ring] == 2  # the writer counts DATA records
        assert m["vllm_tap_ring_records_dropped_total" + ring] == 0
        assert m["vllm_tap_subscribers"] == 0 and "vllm_tap_delivery_latency_seconds_count" in m
        exposed = {k.split("{")[0] for k in m}
        exposed |= {n.removesuffix("_count") for n in exposed if n.endswith("_count")}
        documented = set(re.findall(r"`(vllm_tap_\w+)`", (REPO / "docs" / "operate.md").read_text()))
        assert documented and documented <= exposed, documented - exposed
        undocumented = {n for n in exposed - documented if not n.endswith(("_bucket", "_sum", "_count"))}
        assert not undocumented, undocumented

        # A subscriber waiting for a capture that never comes must hear why its stream ends.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"ipc://{sock_dir}/tap.sock")
        dealer.send_multipart(wf.Subscribe(1, "never-comes", timeout=60).frames())
        dealer.send_multipart(wf.StatusRequest(2).frames())  # answered after the subscribe was taken
        assert dealer.poll(10000), "no status reply"
        assert wf.unpack_header(dealer.recv_multipart()[0])[wf.K_TYPE] == wf.STATUS

        _stop(proc, systemd)
        assert dealer.poll(1000), "subscriber got no end-of-stream message"
        end = wf.unpack_header(dealer.recv_multipart()[0])
        assert (end[wf.K_TYPE], end[wf.K_ID], end["code"]) == (wf.ERROR, 1, wf.E_STOPPING), end
        assert "daemon stopping" in end["message"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        systemd.close()
        writer.close()
        ctx.destroy(linger=0)
    assert read_info(path).backlog_bytes == 0  # the read cursor lives on in the ring
    lines = systemd.log().splitlines()
    assert any("ready" in line for line in lines)
    # Journal stream: syslog priority prefix, no timestamps (journald adds its own), one line each.
    assert lines and all(re.match(r"<[0-7]>[A-Z]+ \S+: ", line) for line in lines), lines
    assert not any(re.search(r"\d\d:\d\d:\d\d", line) for line in lines), lines


@needs_daemon
def test_restart_resumes_from_the_rings(shm_dir, sock_dir):
    path = ring_path(shm_dir, "inst", 0)
    writer = RingWriter(path, 1 << 16)
    config = _toml(Path(sock_dir), f'shm_dir = "{shm_dir}"\nendpoint = "ipc://{sock_dir}/tap.sock"\n'
                                   'poll_interval_s = 0.001\n')
    systemd = _Systemd(sock_dir)
    try:
        for rid in ("before", "while-down"):
            _write_request(writer, rid)  # the second one lands while no daemon runs
            assert read_info(path).backlog_bytes > 0
            proc = systemd.start(config, watchdog_usec=0)
            try:
                systemd.wait_for("READY", 20, proc)
                deadline = time.monotonic() + 10
                while read_info(path).backlog_bytes and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert read_info(path).backlog_bytes == 0
                _stop(proc, systemd)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert not [m for m in systemd.messages if "WATCHDOG" in m]  # watchdog off: no pings
    finally:
        systemd.close()
        writer.close()


# --- unit files ----------------------------------------------------------------------------------

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
UNITS = ["vllm-tap.service", "vllm-tap@.service"]


def _installed_cli() -> str:
    """An executable for ExecStart=: verify insists that it exists."""
    beside = Path(sys.executable).with_name("vllm-tap")
    return str(beside) if beside.exists() else shutil.which("vllm-tap") or sys.executable


@pytest.fixture
def unit_dir(tmp_path) -> Path:
    """The units as installed, with ExecStart= pointing at this environment's CLI."""
    cli = _installed_cli()
    for name in UNITS:
        (tmp_path / name).write_text((SYSTEMD / name).read_text().replace("/usr/local/bin/vllm-tap", cli))
    # The drop-in needs a unit to drop into, and a `vllm` that exists.
    (tmp_path / "vllm.service").write_text("[Unit]\nDescription=vLLM\n[Service]\nExecStart=/bin/true\n")
    (tmp_path / "vllm.service.d").mkdir()
    dropin = (SYSTEMD / "vllm-serve-with-tap.conf").read_text()
    assert "/usr/local/bin/vllm serve" in dropin
    (tmp_path / "vllm.service.d" / "vllm-tap.conf").write_text(dropin.replace("/usr/local/bin/vllm serve", "/bin/echo serve"))
    (tmp_path / RECORDER).write_text((SYSTEMD / RECORDER).read_text().replace("/usr/local/bin/vllm-tap", cli))
    return tmp_path


RECORDER = "vllm-tap-record@.service"


def _settings(text: str) -> dict[str, str]:
    """A unit's settings (the last of each key), comments left out."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed (apt-get install systemd)")
@pytest.mark.parametrize("unit", ["vllm-tap.service", "vllm-tap@demo.service", "vllm.service",
                                  "vllm-tap-record@demo.service"])
def test_systemd_analyze_verify(unit_dir, unit):
    # Units are looked up in unit_dir (drop-ins and templates included); verify exits 0 on mere
    # warnings such as unknown keys, so any complaint about our files fails the test too.
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}:"}
    p = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", unit], cwd=unit_dir, env=env,
                       capture_output=True, text=True, timeout=60)
    ours = [line for line in p.stderr.splitlines() if str(unit_dir) in line or unit.split("@")[0] in line]
    assert p.returncode == 0 and not ours, p.stderr


def test_units_keep_the_rings_and_the_contract():
    for name in UNITS:
        text = (SYSTEMD / name).read_text()
        settings = dict(
            line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#")
        )
        assert settings["Type"] == "notify" and settings["Restart"] == "on-failure"
        assert int(settings["WatchdogSec"]) > 0 and settings["RestartPreventExitStatus"] == "2"
        assert settings["RemoveIPC"] == "no" and "DynamicUser" not in settings  # either would delete the rings
        assert settings["User"].startswith("vllm-tap") and settings["RuntimeDirectory"].startswith("vllm-tap")
        # The access model: the daemon is in the ring group and the readers' group, and says
        # which they are so that it can check rings and hand the socket to the readers.
        user = settings["User"]
        assert settings["SupplementaryGroups"].split() == [f"{user}-rings", f"{user}-readers"]
        assert f"VLLM_TAP_RING_GROUP={user}-rings" in text and f"VLLM_TAP_SOCKET_GROUP={user}-readers" in text
        assert f"-g {user}-rings" in settings["ExecStartPre"] and "test -e" in settings["ExecStartPre"]
        assert settings["StateDirectoryMode"] == "0700" and settings["RuntimeDirectoryMode"] == "0750"
        assert settings["ReadWritePaths"].startswith("/dev/shm/vllm-tap")
        # The arena: its own directory beside the rings, made for the readers' group, writable here.
        shm = settings["ReadWritePaths"].split()[0]
        assert settings["ReadWritePaths"].split() == [shm, f"{shm}.arena"]
        assert f"-m 0750 -o {user} -g {user}-readers {shm}.arena" in settings["ExecStartPre"]
        assert int(settings["LimitNOFILE"]) >= 65536  # libzmq aborts when accept() meets EMFILE
        assert settings["StateDirectory"].startswith("vllm-tap")  # the sequence counter outlives restarts


def test_the_recorder_unit_reads_as_a_reader_after_the_daemon_and_never_gives_up():
    text = (SYSTEMD / RECORDER).read_text()
    s = _settings(text)
    assert s["Restart"] == "always" and s["StartLimitIntervalSec"] == "0"
    assert "vllm-tap.service" in s["After"] and s["Wants"]  # ordered after the daemon
    assert s["SupplementaryGroups"].split() == ["vllm-tap-readers"]  # a reader: never the rings' group
    assert s["User"] == "vllm-tap-record" and "RemoveIPC" not in s
    # SIGTERM commits and uploads the open shards: the stop timeout leaves minutes for it
    assert s["TimeoutStopSec"].endswith("min") and int(s["TimeoutStopSec"][:-3]) >= 10
    # A fixed writer name (host and instance), so a restart resumes its own manifest; the daemon's socket.
    argv = s["ExecStart"].split()
    assert argv[1:3] == ["record", "${DEST}"] and argv[argv.index("--writer") + 1] == "%H-%i"
    assert "VLLM_TAP_ENDPOINT=ipc:///run/vllm-tap/tap.sock" in s["Environment"]
    assert s["EnvironmentFile"] == "/etc/vllm-tap/record-%i.env"
    # the account it runs as exists, in the readers' group only
    users = (SYSTEMD / "sysusers.d" / "vllm-tap.conf").read_text().splitlines()
    assert "u vllm-tap-record - \"vllm-tap recorder\" /var/lib/vllm-tap-record /usr/sbin/nologin" in users
    assert [x for x in users if x.startswith("m vllm-tap-record ")] == ["m vllm-tap-record vllm-tap-readers"]


def test_the_vllm_drop_in_is_a_configuration_vllm_would_start_with():
    """The GPU example's --additional-config parses as tap settings for its model (Llama 3.1 8B: 32
    layers, vocabulary 128256): group, exposed layer, ring size and a policy that alone captures."""
    import json
    import shlex

    from vllm_tap.spec import ServerCaptureConfig

    s = _settings((SYSTEMD / "vllm-serve-with-tap.conf").read_text())
    argv = shlex.split(s["ExecStart"])
    assert argv[:3] == ["/usr/local/bin/vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    additional = json.loads(argv[argv.index("--additional-config") + 1])
    cfg = ServerCaptureConfig.from_additional_config(additional, num_layers=32, vocab_size=128256)
    assert cfg is not None and cfg.group == "vllm-tap-rings" and cfg.layers == (16,)
    assert cfg.ring_bytes == 256 << 20 and not cfg.ring_auto
    assert cfg.policy is not None and cfg.policy.share == 0.05 and cfg.policy.client == "refused"
    assert cfg.policy.spec.layers == (16,) and cfg.policy.spec.logits.value == "none"
    assert s["SupplementaryGroups"] == "vllm-tap-rings" and s["RemoveIPC"] == "no"


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers not installed")
def test_sysusers_and_tmpfiles_apply_to_a_scratch_root(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "dev" / "shm").mkdir(parents=True)
    for tool, conf in (("systemd-sysusers", "sysusers.d"), ("systemd-tmpfiles", "tmpfiles.d")):
        args = [tool, f"--root={tmp_path}"] + (["--create"] if tool == "systemd-tmpfiles" else []) + ["-"]
        p = subprocess.run(args, input=(SYSTEMD / conf / "vllm-tap.conf").read_text(), capture_output=True,
                           text=True, timeout=30)
        assert p.returncode == 0, p.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    group = (tmp_path / "etc" / "group").read_text()
    uid = int(re.search(r"^vllm-tap:x:(\d+):", passwd, re.M).group(1))
    rings = re.search(r"^vllm-tap-rings:x:(\d+):(.*)$", group, re.M)
    readers = re.search(r"^vllm-tap-readers:x:(\d+):(.*)$", group, re.M)
    assert rings.group(2).split(",") == ["vllm-tap"]
    assert sorted(readers.group(2).split(",")) == ["vllm-tap", "vllm-tap-record"]
    st = (tmp_path / "dev" / "shm" / "vllm-tap").stat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o2770, uid, int(rings.group(1)))
    st = (tmp_path / "dev" / "shm" / "vllm-tap.arena").stat()
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o750, uid, int(readers.group(1)))


def test_status_is_one_struct_read_by_attribute_and_a_map_on_the_wire():
    """The status the daemon writes converts to the map the client hands out and back; a map of an
    earlier daemon (fewer keys) reads with the defaults, a newer one's extra keys are ignored."""
    from vllm_tap.status_format import Connections, DaemonStatus, Drops, from_map, to_map

    s = DaemonStatus(pid=7, rings=[{"alive": True}], drops=Drops(records=3, bytes=9),
                     connections=Connections(open=2), watch_lost={"evicted": 1})
    m = to_map(s)
    assert m["drops"]["records"] == 3 and m["connections"]["open"] == 2 and m["pid"] == 7
    assert from_map(m) == s
    old = from_map({"pid": 1, "drops": {"records": 2, "bytes": 4}, "a_newer_key": 5})
    assert old.connections is None and old.drops.records == 2 and old.drops.captures_shed == 0
    with pytest.raises(ValueError):
        from_map({"pid": "one"})
