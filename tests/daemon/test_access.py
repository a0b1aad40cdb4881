"""Who may read captures, tried with real local users.

Two tenants, A and B, each set up as the shipped template unit sets one up: a daemon account in the
tenant's ring group and reader group, a vLLM (writer) account in the ring group only, a reader
account in the reader group only; plus an outsider in no group. Every process runs as its account
(tests/support/as_user.py): the kernel, not the test, decides what each may open.

Needs root (to add and remove the accounts); skipped otherwise.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from synthetic_writer import Scenario, assert_capture
from vllm_tap.client import Client, DaemonUnavailable, Refused

from other_users_python import OtherUsersPython

P = "vtt"  # every account and group this test makes starts with it

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test adds and removes local users and groups"),
    pytest.mark.skipif(shutil.which("useradd") is None, reason="no useradd here"),
]

GROUPS = [f"{P}-a-rings", f"{P}-a-readers", f"{P}-b-rings", f"{P}-b-readers"]
USERS = {  # account -> supplementary groups
    f"{P}-a-tap": [f"{P}-a-rings", f"{P}-a-readers"],
    f"{P}-a-vllm": [f"{P}-a-rings"],
    f"{P}-a-reader": [f"{P}-a-readers"],
    f"{P}-b-tap": [f"{P}-b-rings", f"{P}-b-readers"],
    f"{P}-b-vllm": [f"{P}-b-rings"],
    f"{P}-b-reader": [f"{P}-b-readers"],
    f"{P}-outsider": [],
}


# The interpreter the accounts run (other_users_python.py), set by the `world` fixture for the module.
OTHER: OtherUsersPython | None = None


def _drop_accounts() -> None:
    for u in USERS:
        subprocess.run(["userdel", u], capture_output=True)
    for g in GROUPS + list(USERS):
        subprocess.run(["groupdel", g], capture_output=True)


def _as(user: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    assert OTHER is not None, "the world fixture sets the interpreter"
    return subprocess.run(OTHER.as_user(user, *args), capture_output=True, text=True,
                          timeout=timeout)


def _try_open(user: str, path: str, how: str) -> str:
    """'ok' or the error's name, from `user` opening `path` (how: r, w, list)."""
    code = ("import os, sys\npath, how = sys.argv[1], sys.argv[2]\ntry:\n"
            "    os.listdir(path) if how == 'list' else os.close(os.open(path, os.O_RDWR if how == 'w' else os.O_RDONLY))\n"
            "    print('ok')\nexcept OSError as e:\n    print(type(e).__name__)\n")
    r = _as(user, "-c", code, path, how)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


class Tenant:
    def __init__(self, name: str, base: str):
        self.name = name
        self.tap, self.vllm, self.reader = f"{P}-{name}-tap", f"{P}-{name}-vllm", f"{P}-{name}-reader"
        self.rings, self.readers = f"{P}-{name}-rings", f"{P}-{name}-readers"
        self.shm = f"/dev/shm/{os.path.basename(base)}-{name}"
        self.run_dir = os.path.join(base, f"run-{name}")
        self.endpoint = f"ipc://{self.run_dir}/tap.sock"
        self.state = os.path.join(base, f"state-{name}")
        self.log = os.path.join(base, f"daemon-{name}.log")
        self.proc: subprocess.Popen | None = None
        uid = pwd.getpwnam(self.tap).pw_uid
        for d in (self.run_dir, self.state):  # what systemd's RuntimeDirectory= / StateDirectory= make
            os.mkdir(d, 0o700)
            os.chown(d, uid, pwd.getpwnam(self.tap).pw_gid)

    def start(self, *extra: str, endpoint: str | None = None) -> None:
        assert OTHER is not None, "the world fixture sets the interpreter"
        argv = [*OTHER.as_user(self.tap, "-m", "vllm_tap.cli", "daemon"), "--shm-dir", self.shm,
                "--endpoint", endpoint or self.endpoint, "--state-dir", self.state, "--ring-group", self.rings,
                "--ring-owners", self.vllm, "--socket-group", self.readers, "--end-grace", "1", *extra]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon {self.name} exited {self.proc.returncode}:\n{self.log_text()}")
            try:
                if endpoint is None:
                    Client(self.endpoint).status(timeout=0.3)  # as root: only to know it is up
                    return
                if f"serving {endpoint}" in self.log_text():
                    return
            except DaemonUnavailable:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"daemon {self.name} not ready:\n{self.log_text()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(15)

    def log_text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def write(self, sc: Scenario) -> None:
        r = _as(self.vllm, os.path.join(OTHER.tests, "synthetic_writer.py"), self.shm, sc.to_json(), "--group", self.rings)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.splitlines()[-1])["dropped"] == 0


@pytest.fixture(scope="module")
def world(other_users_python):
    global OTHER
    OTHER = other_users_python
    _drop_accounts()
    try:
        for g in GROUPS:
            subprocess.run(["groupadd", g], check=True, capture_output=True)
        for u, groups in USERS.items():
            cmd = ["useradd", "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin", "-U"]
            subprocess.run(cmd + (["-G", ",".join(groups)] if groups else []) + [u], check=True, capture_output=True)
    except subprocess.CalledProcessError as e:
        _drop_accounts()
        pytest.skip(f"cannot add local accounts here: {e.stderr.decode().strip()}")
    base = tempfile.mkdtemp(prefix=f"{P}-")
    os.chmod(base, 0o755)
    a, b = Tenant("a", base), Tenant("b", base)
    # B's shm directory made as the shipped unit's ExecStartPre makes it; A's by A's daemon itself.
    subprocess.run(["install", "-d", "-m", "2770", "-o", b.tap, "-g", b.rings, b.shm], check=True)
    try:
        a.start()
        b.start()
        a.write(Scenario(instance="ia", prefix="a", n_requests=1, tp=2))
        b.write(Scenario(instance="ib", prefix="b", n_requests=1, tp=2))
        yield {"a": a, "b": b, "base": base}
    finally:
        for t in (a, b):
            t.stop()
            shutil.rmtree(t.shm, ignore_errors=True)
            shutil.rmtree(t.shm + ".arena", ignore_errors=True)  # kept by a stop with captures held
        shutil.rmtree(base, ignore_errors=True)
        _drop_accounts()


def _fetch_as(user: str, t: Tenant, name: str, base: str, *extra: str) -> subprocess.CompletedProcess:
    out = os.path.join(base, f"out-{user}")
    if not os.path.isdir(out):
        os.mkdir(out, 0o700)
        os.chown(out, pwd.getpwnam(user).pw_uid, -1)
    return _as(user, "-m", "vllm_tap.cli", "subscribe", name, "--endpoint", t.endpoint, "--timeout", "3", "--quiet",
               "--out", os.path.join(out, f"{name}.npz"), *extra)


def _saved(base: str, user: str, name: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(base, f"out-{user}", f"{name}.npz")) as z:
        return {k.replace("hidden_", "hidden."): z[k] for k in z.files if k not in ("meta", "missing_ranges",
                                                                                    "missing_positions")}


def _ring(t: Tenant, instance: str) -> str:
    return os.path.join(t.shm, instance, "rank-00000.ring")


def test_a_reader_fetches_over_the_socket_and_cannot_touch_a_ring(world):
    a, base = world["a"], world["base"]
    r = _fetch_as(a.reader, a, "a-0", base)
    assert r.returncode == 0, r.stderr
    assert_capture(Scenario(instance="ia", prefix="a", n_requests=1, tp=2), 0, _saved(base, a.reader, "a-0"))
    # Readers never touch rings: not readable, not writable (no truncating or forging), not even listed.
    ring = _ring(a, "ia")
    assert _try_open(a.reader, ring, "r") == "PermissionError"
    assert _try_open(a.reader, ring, "w") == "PermissionError"
    assert _try_open(a.reader, a.shm, "list") == "PermissionError"
    # The writer may (that is its job), and is not a reader: it cannot connect to the socket.
    assert _try_open(a.vllm, ring, "w") == "ok"
    r = _as(a.vllm, "-m", "vllm_tap.cli", "status", "--endpoint", a.endpoint, "--timeout", "1")
    assert r.returncode != 0 and "may not" in r.stderr, r.stderr
    # What the files say, as the docs' table says.
    st = os.stat(ring)
    assert stat.S_IMODE(st.st_mode) == 0o660 and grp.getgrgid(st.st_gid).gr_name == a.rings
    st = os.stat(a.shm)  # made by A's daemon
    assert stat.S_IMODE(st.st_mode) == 0o2770 and grp.getgrgid(st.st_gid).gr_name == a.rings
    assert pwd.getpwuid(st.st_uid).pw_name == a.tap
    sock, run = os.stat(a.endpoint[len("ipc://"):]), os.stat(a.run_dir)
    assert stat.S_IMODE(sock.st_mode) == 0o660 and grp.getgrgid(sock.st_gid).gr_name == a.readers
    assert stat.S_IMODE(run.st_mode) == 0o750 and grp.getgrgid(run.st_gid).gr_name == a.readers


def test_an_outsider_cannot_read_rings_connect_or_fetch(world):
    a, base = world["a"], world["base"]
    out = f"{P}-outsider"
    assert _try_open(out, _ring(a, "ia"), "r") == "PermissionError"
    assert _try_open(out, a.shm, "list") == "PermissionError"
    r = _as(out, "-m", "vllm_tap.cli", "status", "--endpoint", a.endpoint, "--timeout", "1")
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "may not reach" in r.stderr, r.stderr
    r = _fetch_as(out, a, "a-0", base)
    assert r.returncode != 0 and not os.path.exists(os.path.join(base, f"out-{out}", "a-0.npz")), r.stderr


def test_tenants_are_kept_apart_over_ipc_and_tcp(world):
    a, b, base = world["a"], world["b"], world["base"]
    from pathlib import Path

    tmp_path = Path(base) / "tcp"  # under the test's base: other accounts can enter it, not pytest's tmp_path
    tmp_path.mkdir(mode=0o755)
    # B's reader gets B's capture; A's reader gets nothing of B's, through B's socket or B's rings.
    r = _fetch_as(b.reader, b, "b-0", base)
    assert r.returncode == 0, r.stderr
    assert_capture(Scenario(instance="ib", prefix="b", n_requests=1, tp=2), 0, _saved(base, b.reader, "b-0"))
    r = _fetch_as(a.reader, b, "b-0", base)
    assert r.returncode != 0 and not os.path.exists(os.path.join(base, f"out-{a.reader}", "b-0.npz")), r.stderr
    assert _try_open(a.reader, _ring(b, "ib"), "r") == "PermissionError"
    assert _try_open(a.vllm, _ring(b, "ib"), "w") == "PermissionError"  # nor can A's vLLM forge B's rings
    # status shows a reader its own tenant only.
    r = _as(a.reader, "-m", "vllm_tap.cli", "status", "--endpoint", a.endpoint, "--json")
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert {x["instance"] for x in seen["rings"]} == {"ia"} and seen["shm_dir"] == a.shm
    assert "b-0" not in r.stdout and "ib" not in {x.get("instance") for x in seen["requests"]}

    # Over tcp: B's daemon with its own CURVE keys; A's reader holds A's key, which B does not allow.
    keys = tmp_path / "keys"
    for name in ("b-server", "a-client", "b-client"):
        assert subprocess.run([sys.executable, "-m", "vllm_tap.cli", "keygen", str(keys), "--name", name],
                              capture_output=True).returncode == 0
    allowed = tmp_path / "b-clients"
    allowed.mkdir()
    shutil.copy(keys / "b-client.key", allowed / "b-client.key")
    os.chmod(tmp_path, 0o755)
    os.chmod(keys, 0o755)
    for name, owner in (("b-server", b.tap), ("a-client", a.reader), ("b-client", b.reader)):
        os.chown(keys / f"{name}.key_secret", pwd.getpwnam(owner).pw_uid, -1)  # each secret readable by its owner only
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b.stop()
    b.start("--curve-key", str(keys / "b-server.key_secret"), "--curve-clients", str(allowed),
            endpoint=f"tcp://0.0.0.0:{port}")
    b.write(Scenario(instance="ib", prefix="b2", n_requests=1, tp=2))
    at = f"tcp://127.0.0.1:{port}"

    def tcp_fetch(user: str, key: str) -> subprocess.CompletedProcess:
        return _as(user, "-m", "vllm_tap.cli", "subscribe", "b2-0", "--endpoint", at, "--timeout", "3", "--quiet",
                   "--server-key", str(keys / "b-server.key"), "--client-key", str(keys / f"{key}.key_secret"))

    r = tcp_fetch(b.reader, "b-client")
    assert r.returncode == 0 and "missing=0" in r.stdout, r.stderr
    r = tcp_fetch(a.reader, "a-client")
    assert r.returncode != 0 and "not among its allowed client keys" in r.stderr, r.stderr
    # Nor with B's key file, which A's reader cannot read.
    r = tcp_fetch(a.reader, "b-client")
    assert r.returncode != 0 and "Permission denied" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    # Nor without keys at all.
    r = _as(a.reader, "-m", "vllm_tap.cli", "subscribe", "b2-0", "--endpoint", at, "--timeout", "3", "--quiet")
    assert r.returncode != 0 and "disagree on CURVE" in r.stderr, r.stderr
    b.stop()
    b.start()  # back on ipc for whatever runs next


def test_squatted_runtime_and_shm_directories_stop_start_up_with_one_line(world):
    a, base = world["a"], world["base"]
    out, uid = f"{P}-outsider", pwd.getpwnam(a.tap).pw_uid
    mine = "import os, sys\nos.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)\n"
    link = "import os, sys\nos.mkdir(sys.argv[1] + '.real', 0o777); os.symlink(sys.argv[1] + '.real', sys.argv[1])\n"

    def daemon(*args: str) -> subprocess.CompletedProcess:
        return _as(a.tap, "-m", "vllm_tap.cli", "daemon", "--state-dir", a.state, "--ring-group", a.rings,
                   "--socket-group", a.readers, *args,
                   timeout=30)

    # The default socket directory of a user without $XDG_RUNTIME_DIR, made first by someone else.
    default_dir = f"/tmp/vllm-tap-{uid}"
    shutil.rmtree(default_dir, ignore_errors=True)
    squats = [default_dir, f"{a.shm}-squat", f"{a.shm}-link"]
    try:
        assert _as(out, "-c", mine, default_dir).returncode == 0
        r = daemon("--shm-dir", f"{a.shm}-other")
        assert r.returncode == 2 and default_dir in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "owned by" in r.stderr, r.stderr
        # A client of that user will not talk to whoever waits there in the daemon's place.
        r = _as(a.tap, "-m", "vllm_tap.cli", "status", timeout=30)
        assert r.returncode != 0 and default_dir in r.stderr and "owned by" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        # The shm directory: someone else's, or a link to one.
        assert _as(out, "-c", mine, f"{a.shm}-squat").returncode == 0
        r = daemon("--shm-dir", f"{a.shm}-squat", "--endpoint", a.endpoint + "-x")
        assert r.returncode == 2 and f"{a.shm}-squat" in r.stderr and "owned by" in r.stderr, r.stderr
        assert _as(out, "-c", link, f"{a.shm}-link").returncode == 0
        r = daemon("--shm-dir", f"{a.shm}-link", "--endpoint", a.endpoint + "-x")
        assert r.returncode == 2 and "symbolic link" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        # The hook's side: vLLM's account will not make rings in a squatted shm directory.
        code = ("import sys\nfrom vllm_tap.ring_files import ring_path\nfrom vllm_tap.ring_writer import RingWriter\nfrom vllm_tap.safe_paths import UnsafePath\n"
                "try:\n    RingWriter(ring_path(sys.argv[1], 'i', 0), 1 << 16, group=sys.argv[2], mode=0o660)\n"
                "except UnsafePath as e:\n    print(e); sys.exit(3)\n")
        r = _as(a.vllm, "-c", code, f"{a.shm}-squat", a.rings)
        assert r.returncode == 3 and f"{a.shm}-squat" in r.stdout and "owned by" in r.stdout, (r.stdout, r.stderr)
        assert not os.path.exists(os.path.join(f"{a.shm}-squat", "i"))
    finally:
        for p in squats:
            if os.path.islink(p):
                os.unlink(p)
            shutil.rmtree(p, ignore_errors=True)
            shutil.rmtree(p + ".real", ignore_errors=True)
        shutil.rmtree(f"{a.shm}-other", ignore_errors=True)


def test_rings_and_directories_looser_than_configured_are_refused_and_counted(world):
    a = world["a"]
    before = Client(a.endpoint).status()
    # A writer that made its instance directory open to everyone, and a ring readable by all.
    code = ("import os, sys\nfrom synthetic_writer import Scenario, SyntheticEngine\n"
            "shm = sys.argv[1]\nos.mkdir(os.path.join(shm, 'open'), 0o777); os.chmod(os.path.join(shm, 'open'), 0o777)\n"
            "eng = SyntheticEngine(Scenario(instance='loose', prefix='l', n_requests=1, tp=1), shm, group=sys.argv[2])\n"
            "os.chmod(eng.ranks[0].path, 0o666); eng.run(); eng.flush(); eng.close()\n")
    r = _as(a.vllm, "-c", code, a.shm, a.rings)
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 10
    while True:
        s = Client(a.endpoint).status()
        if s["rings_refused"] > before["rings_refused"] and s["dirs_refused"] > before["dirs_refused"]:
            break
        assert time.monotonic() < deadline, (s["rings_refused"], s["dirs_refused"], a.log_text()[-3000:])
        time.sleep(0.2)
    assert ("loose", "rank-00000.ring") not in {(x["instance"], x["name"]) for x in s["rings"]}
    human = _as(a.reader, "-m", "vllm_tap.cli", "status", "--endpoint", a.endpoint)
    assert human.returncode == 0, human.stderr
    assert f"rings refused: {s['rings_refused']}" in human.stdout and f"dirs refused: {s['dirs_refused']}" in human.stdout
    log = a.log_text()
    assert log.count("instance directory /dev/shm") == 1 and "open" in log and "looser than" in log
    assert "rank-00000.ring" in log and "mode 0666 is looser than 0660" in log


def test_a_reader_maps_the_arena_read_only_and_nobody_else_can_find_it(world):
    """The delivery arena under the shipped access model: it lives in a directory of the daemon's own
    (`<shm_dir>.arena`, 0750 in the readers' group), not in the ring directory readers cannot enter,
    so a reader gets descriptors and copies the arrays out of shared memory; writers and outsiders
    cannot open the file or even list its directory."""
    a, b, base = world["a"], world["b"], world["base"]
    s = Client(a.endpoint).status()
    path = s["arena"]["path"]
    d = os.path.dirname(path)
    assert d == a.shm + ".arena"
    st, dst = os.stat(path), os.stat(d)
    assert stat.S_IMODE(st.st_mode) == 0o640 and grp.getgrgid(st.st_gid).gr_name == a.readers
    assert stat.S_IMODE(dst.st_mode) == 0o750 and grp.getgrgid(dst.st_gid).gr_name == a.readers
    assert pwd.getpwuid(st.st_uid).pw_name == a.tap and pwd.getpwuid(dst.st_uid).pw_name == a.tap
    sc = Scenario(instance="ia", prefix="arena", n_requests=1, tp=2, dtype="bfloat16", vocab=4096, hidden=512)
    a.write(sc)
    payload = sc.end_position * (sc.vocab + sc.hidden * len(sc.layers)) * 2
    before = Client(a.endpoint).status()
    r = _fetch_as(a.reader, a, "arena-0", base)
    assert r.returncode == 0, r.stderr
    assert "frames" not in r.stderr, r.stderr  # the client says so when it falls back
    assert_capture(sc, 0, _saved(base, a.reader, "arena-0"))
    after = Client(a.endpoint).status()
    # Its tokens came as descriptors naming every byte; what went through the socket was headers only.
    assert after["arena_bytes"] - before["arena_bytes"] >= payload
    assert after["delivered_bytes"] - before["delivered_bytes"] < payload // 4, (after["delivered_bytes"], payload)
    assert _try_open(a.reader, path, "r") == "ok"
    assert _try_open(a.reader, path, "w") == "PermissionError"  # read-only: no reader can change what others see
    for user in (a.vllm, f"{P}-outsider", b.reader):
        assert _try_open(user, path, "r") == "PermissionError", user
        assert _try_open(user, d, "list") == "PermissionError", user


def test_a_squatted_or_open_arena_directory_stops_start_up_with_one_line(world):
    a = world["a"]
    out = f"{P}-outsider"
    mine = "import os, sys\nos.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)\n"

    def daemon(shm: str) -> subprocess.CompletedProcess:
        return _as(a.tap, "-m", "vllm_tap.cli", "daemon", "--state-dir", a.state, "--ring-group", a.rings,
                   "--socket-group", a.readers, "--shm-dir", shm, "--endpoint", a.endpoint + "-arena", timeout=30)

    made = []
    try:
        # Someone else's, made first at the predictable path.
        shm = f"{a.shm}-sq"
        made += [shm, shm + ".arena"]
        assert _as(out, "-c", mine, shm + ".arena").returncode == 0
        r = daemon(shm)
        assert r.returncode == 2 and f"{shm}.arena" in r.stderr and "owned by" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        # The daemon's own, but open to everyone.
        shm = f"{a.shm}-open"
        made += [shm, shm + ".arena"]
        assert _as(a.tap, "-c", mine, shm + ".arena").returncode == 0
        r = daemon(shm)
        assert r.returncode == 2 and "looser than" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        # A link to a directory of its own is not followed either.
        shm = f"{a.shm}-ln"
        made += [shm, shm + ".arena", shm + ".real"]
        assert _as(a.tap, "-c", "import os, sys\nos.mkdir(sys.argv[1] + '.real', 0o700); "
                   "os.symlink(sys.argv[1] + '.real', sys.argv[1] + '.arena')\n", shm).returncode == 0
        r = daemon(shm)
        assert r.returncode == 2 and "symbolic link" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        for p in made:
            if os.path.islink(p):
                os.unlink(p)
            shutil.rmtree(p, ignore_errors=True)
