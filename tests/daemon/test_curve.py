"""tcp with ZeroMQ CURVE: a real daemon on a non-loopback tcp endpoint, real keys
from `vllm-tap keygen`, real clients with and without them.

- a non-loopback tcp endpoint without keys does not start (exit 2, one line) unless --insecure;
- with keys: a client without keys, with an unknown key, or with the wrong server key gets nothing
  and is told why; an allowed key fetches exact values; a key added to curve_clients works
  without a restart; the connection limits still hold under CURVE;
- unusable key files stop start-up with one line.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import zmq

from synthetic_writer import Scenario, assert_capture, capture_arrays, write_scenario
from vllm_tap.client import Client, DaemonUnavailable, KeyFileError, Refused

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_tap.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _keygen(directory: str, name: str) -> tuple[str, str]:
    r = _cli("keygen", directory, "--name", name)
    assert r.returncode == 0, r.stderr
    return os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret")


@pytest.fixture
def keys(tmp_path):
    """server pair, an allowed client ("alice", its public key in clients/), an unknown one ("mallory")."""
    k = tmp_path / "keys"
    server_pub, server_sec = _keygen(str(k), "server")
    alice_pub, alice_sec = _keygen(str(k), "alice")
    _, mallory_sec = _keygen(str(k), "mallory")
    clients = tmp_path / "clients"
    clients.mkdir(mode=0o755)
    shutil.copy(alice_pub, clients / "alice.key")
    return {"server_pub": server_pub, "server_sec": server_sec, "alice": alice_sec, "mallory": mallory_sec,
            "mallory_pub": mallory_sec.removesuffix("_secret"), "clients": str(clients)}


def test_keygen_writes_a_private_secret_and_never_overwrites(tmp_path):
    pub, sec = _keygen(str(tmp_path / "k"), "server")
    assert oct(os.stat(sec).st_mode & 0o777) == "0o600" and oct(os.stat(tmp_path / "k").st_mode & 0o777) == "0o700"
    public, secret = zmq.auth.load_certificate(sec)
    assert secret and zmq.auth.load_certificate(pub) == (public, None)
    again = _cli("keygen", str(tmp_path / "k"), "--name", "server")
    assert again.returncode != 0 and again.stderr.count("\n") == 1 and "exists" in again.stderr
    assert zmq.auth.load_certificate(sec) == (public, secret)


@pytest.mark.parametrize("host", ["0.0.0.0", "*"])
def test_a_non_loopback_tcp_endpoint_without_curve_does_not_start_unless_insecure(shm_dir, tmp_path, host):
    port = _port()
    args = ["daemon", "--shm-dir", shm_dir, "--endpoint", f"tcp://{host}:{port}", "--state-dir", str(tmp_path / "s")]
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "--insecure" in r.stderr and "curve_key" in r.stderr, r.stderr
    # The same through the environment and the config file's key.
    cfg = tmp_path / "c.toml"
    cfg.write_text("insecure = false\n")
    assert _cli(*args, "--config", str(cfg)).returncode == 2
    # --insecure: it starts (and says in its log that anyone who reaches it reads every capture).
    p = subprocess.Popen([sys.executable, "-m", "vllm_tap.cli", *args, "--insecure"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        _wait_status(Client(f"tcp://127.0.0.1:{port}"))
    finally:
        p.terminate()
        out = p.communicate(timeout=15)[0]
    assert p.returncode == 0 and "anyone who reaches it" in out, out


def _wait_status(c: Client, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return c.status(timeout=0.5)
        except DaemonUnavailable:
            if time.monotonic() > deadline:
                raise


def test_curve_refuses_clients_without_an_allowed_key_and_serves_those_with_one(daemon_factory, shm_dir, keys):
    port = _port()
    d = daemon_factory(endpoint=f"tcp://0.0.0.0:{port}", curve_key=keys["server_sec"], curve_clients=keys["clients"],
                       end_grace_s=1.0, max_connections_per_peer=3, start=False)
    d.start(wait=False)
    at = f"tcp://127.0.0.1:{port}"
    alice = Client(at, server_key=keys["server_pub"], client_key=keys["alice"])
    _wait_status(alice)
    sc = Scenario(n_requests=2, tp=2, prefix="cv")
    write_scenario(shm_dir, sc)
    for i in range(sc.n_requests):
        assert_capture(sc, i, capture_arrays(alice.fetch(sc.request_id(i), timeout=10)))

    # No keys: the mechanisms differ, and the client says so instead of waiting out its timeout.
    with pytest.raises(Refused, match="disagree on CURVE"):
        Client(at).status(timeout=3)
    with pytest.raises(Refused, match="disagree on CURVE"):
        Client(at).fetch(sc.request_id(0), timeout=3)
    # A key pair the daemon does not know.
    mallory = Client(at, server_key=keys["server_pub"], client_key=keys["mallory"])
    with pytest.raises(Refused, match="not among its allowed client keys"):
        mallory.status(timeout=3)
    with pytest.raises(Refused, match="not among its allowed client keys"):
        mallory.fetch(sc.request_id(0), timeout=3)
    # The right client key but another server's public key: the handshake cannot even start.
    with pytest.raises(DaemonUnavailable, match="is --server-key the daemon's public key"):
        Client(at, server_key=keys["mallory_pub"], client_key=keys["alice"]).status(timeout=2)
    s = alice.status()
    assert s["connections"]["curve"] and s["connections"]["refused_key"] >= 2, s["connections"]

    # A key added to curve_clients is allowed from then on, without a restart.
    shutil.copy(keys["mallory_pub"], os.path.join(keys["clients"], "mallory.key"))
    time.sleep(1.5)  # the directory is looked at again at most once a second
    assert_capture(sc, 1, capture_arrays(mallory.fetch(sc.request_id(1), timeout=10)))

    # The connection limits still hold under CURVE (max_connections_per_peer=3 from this address).
    subs = [alice.subscribe(f"never-{k}", timeout=30) for k in range(3)]
    its = [s.chunks() for s in subs]
    import threading

    errors: list[BaseException] = []

    def run(it):
        try:
            for _ in it:
                pass
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=run, args=(it,), daemon=True) for it in its]
    for t in threads:
        t.start()
    time.sleep(1.0)
    with pytest.raises(Refused, match="refused the connection"):  # at once: a refusal does not wait out the timeout
        alice.status(timeout=30)
    for s in subs:
        s.close()
    assert "refused: client key" in d.log() and "max_connections_per_peer" in d.log()


def test_unusable_keys_stop_start_up_with_one_line(shm_dir, tmp_path, keys):
    port = _port()
    base = ["daemon", "--shm-dir", shm_dir, "--endpoint", f"tcp://0.0.0.0:{port}", "--state-dir", str(tmp_path / "s")]
    half = _cli(*base, "--curve-key", keys["server_sec"])
    assert half.returncode == 2 and half.stderr.count("\n") == 1 and "curve_clients" in half.stderr, half.stderr
    os.chmod(keys["server_sec"], 0o644)
    loose = _cli(*base, "--curve-key", keys["server_sec"], "--curve-clients", keys["clients"])
    assert loose.returncode == 2 and "nobody else may read it" in loose.stderr, loose.stderr
    assert len([ln for ln in loose.stderr.splitlines() if "ERROR" in ln]) == 1, loose.stderr
    os.chmod(keys["server_sec"], 0o600)
    public = _cli(*base, "--curve-key", keys["server_pub"], "--curve-clients", keys["clients"])
    assert public.returncode == 2 and "holds no secret key" in public.stderr, public.stderr
    os.chmod(keys["clients"], 0o777)
    open_dir = _cli(*base, "--curve-key", keys["server_sec"], "--curve-clients", keys["clients"])
    assert open_dir.returncode == 2 and "nobody else may write it" in open_dir.stderr, open_dir.stderr


def test_client_key_options_are_checked_before_anything_is_sent(keys):
    with pytest.raises(KeyFileError, match="both"):
        Client("tcp://127.0.0.1:1", server_key=keys["server_pub"])
    with pytest.raises(KeyFileError, match="no secret key"):
        Client("tcp://127.0.0.1:1", server_key=keys["server_pub"], client_key=keys["server_pub"])
    r = _cli("status", "--endpoint", "tcp://127.0.0.1:1", "--server-key", keys["server_pub"])
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "client_key" in r.stderr, r.stderr
    # The environment works as the options do.
    env = {"VLLM_TAP_SERVER_KEY": keys["server_pub"], "VLLM_TAP_CLIENT_KEY": keys["alice"]}
    r = _cli("status", "--endpoint", f"tcp://127.0.0.1:{_port()}", "--timeout", "0.5", env=env)
    assert r.returncode != 0 and "is --server-key the daemon's public key" in r.stderr, r.stderr
