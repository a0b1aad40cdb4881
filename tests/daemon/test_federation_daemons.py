"""Two real daemons, each with its own shared-memory directory (two hosts' /dev/shm), linked over
loopback tcp:// with CURVE keys from `vllm-tap keygen`: the home daemon reads the engine ring and the
first pipeline stage's ring, the peer daemon the second stage's ring, which it streams to the home.
Synthetic writers (vLLM 0.32's CPU backend cannot run pipeline parallel across hosts: its second
stage's worker fails an assertion, docs/operate.md). A capture through the home daemon is whole;
the peer SIGKILLed mid-capture: exactly the positions it had not sent are gaps, `peer gone`, and the
captures end soon after; the peer restarted: later captures are whole again."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import zmq

from synthetic_writer import Scenario, SyntheticEngine, assert_capture, capture_arrays, expected, plan
from vllm_tap import placement
from vllm_tap import ring_format as rf
from vllm_tap.client.watch import WatchedCapture
from vllm_tap.daemon.federation import PEER_GONE
from vllm_tap.daemon.peer_link import HOME_GONE
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_writer import RingWriter
from waiting import wait_until

from conftest import DaemonProcess

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

PEER_RANK = 1


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(directory: str, name: str) -> tuple[str, str]:
    r = subprocess.run([sys.executable, "-m", "vllm_tap.cli", "keygen", directory, "--name", name],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret")


@pytest.fixture
def hosts(tmp_path, shm_dir, sock_dir):
    """(home daemon, peer daemon factory, peer shm dir): started, linked, and stopped after."""
    peer_shm = tempfile.mkdtemp(prefix="vllm-tap-test-peer-", dir="/dev/shm")
    keys = str(tmp_path / "keys")
    home_pub, home_sec = _keygen(keys, "home")
    peer_pub, peer_sec = _keygen(keys, "peer")
    peers = tmp_path / "peers"
    peers.mkdir(mode=0o755)
    shutil.copy(peer_pub, peers / "peer.key")
    port = _port()
    home = DaemonProcess(shm_dir, f"ipc://{sock_dir}/home.sock", os.path.join(sock_dir, "home.log"), {
        "federation_endpoint": f"tcp://127.0.0.1:{port}", "federation_key": home_sec, "peer_keys": str(peers),
        "state_dir": os.path.join(sock_dir, "home-state")})
    made = [home]

    def peer() -> DaemonProcess:
        d = DaemonProcess(peer_shm, f"ipc://{sock_dir}/peer.sock", os.path.join(sock_dir, "peer.log"), {
            "home": f"tcp://127.0.0.1:{port}", "home_key": home_pub, "federation_key": peer_sec,
            "state_dir": os.path.join(sock_dir, "peer-state")})
        made.append(d)
        return d.start()

    home.start()
    try:
        yield home, peer, peer_shm
    finally:
        for d in made:
            if d.alive():
                d.stop()
        shutil.rmtree(peer_shm, ignore_errors=True)
        shutil.rmtree(peer_shm + ".arena", ignore_errors=True)


def two_host_engine(sc: Scenario, home_shm: str, peer_shm: str) -> SyntheticEngine:
    """The synthetic engine with its second stage's ring in the peer host's shared memory."""
    eng = SyntheticEngine(sc, home_shm)
    eng.ranks[PEER_RANK].close(unlink=True)
    where = placement.Placement(host="peer-host", address="127.0.0.2", node_rank=1, nnodes=2, instance=sc.instance,
                                home="127.0.0.1:29500", world_size=sc.world, pp_rank=1, pp_size=2, settings="s1")
    eng.ranks[PEER_RANK] = RingWriter(ring_path(peer_shm, sc.instance, PEER_RANK), sc.ring_bytes, rank=PEER_RANK,
                                      world_size=sc.world, mode=0o600, placement=placement.encode(where))
    return eng


def _recorder(d: DaemonProcess, tmp_path, writer: str, n: int) -> tuple[subprocess.Popen, str, str]:
    """`vllm-tap record` of daemon `d` for n captures, once its watch is taken: (the process, its
    dataset's directory, its log)."""
    dest, log_path = str(tmp_path / f"{writer}-ds"), str(tmp_path / f"{writer}-record.log")
    rec = subprocess.Popen([sys.executable, "-m", "vllm_tap.cli", "record", dest, "--endpoint", d.endpoint,
                            "--writer", writer, "--quiet", "--max-captures", str(n)],
                           stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)
    wait_until(lambda: d.status()["watchers"] or rec.poll() is not None, 30, "the recorder's watch")
    return rec, dest, log_path


def _recorded(dest: str, columns: list[str]):
    """A recorder's dataset, without gaps: (its rows' `columns`, their request ids, their positions)."""
    import numpy as np

    from vllm_tap.client.datasets import open_dataset

    ds = open_dataset(dest)
    assert not list(ds.gaps)
    t = ds.to_pyarrow().to_table(columns=columns)
    return t, np.array(t.column("request_id").to_pylist()), t.column("position").to_numpy()


def peers_of(home: DaemonProcess) -> list[dict]:
    return home.status().get("federation", {}).get("peers", [])


def test_a_capture_across_two_daemons_is_whole_and_a_killed_peer_is_gaps_then_a_restarted_one_whole(hosts):
    home, start_peer, peer_shm = hosts
    peer = start_peer()
    wait_until(lambda: len(peers_of(home)) == 1, 15, "the peer daemon's session at the home")
    assert home.status()["federation"]["role"] == "home"
    assert peer.status()["federation"]["state"] == "streaming"

    # 1. Whole through the home daemon, values exact.
    sc = Scenario(n_requests=2, prompt_len=6, gen_len=3, tp=1, pp=2, layers=(0, 1), chunk=3, prefix="whole",
                  instance="first")
    eng = two_host_engine(sc, home.shm_dir, peer_shm)
    try:
        eng.run()
        assert eng.flush() and eng.dropped == 0
        client = home.client()
        for i in range(sc.n_requests):
            cap = client.fetch(sc.request_id(i), timeout=20)
            assert not cap.missing_positions, cap.missing_positions
            assert_capture(sc, i, capture_arrays(cap))
        # A watch of the home daemon gets the same whole captures.
        watched = []
        for item in client.watch(since=0, instance=sc.instance):
            if isinstance(item, WatchedCapture):
                watched.append(item)
                assert not item.gaps and not item.capture.missing_positions
                assert_capture(sc, int(item.request_id.rsplit("-", 1)[1]),
                               capture_arrays(item.capture))
            if len(watched) == sc.n_requests:
                break
        # The peer's ring's placement came with its records: the home knows where rank 1 runs.
        wait_until(lambda: home.status()["engines"], 10, "the engine check")  # about once a second
        [engine] = home.status()["engines"]
        assert engine["world_size"] == 2 and engine["ranks_reporting"] == [1] and engine["hosts"] == ["peer-host"]
    finally:
        eng.close()

    # 2. The peer SIGKILLed after the prefill: the decode positions its stage wrote afterwards are
    # gaps saying why, and every capture ends soon after.
    sc = Scenario(n_requests=2, prompt_len=6, gen_len=3, tp=1, pp=2, layers=(0, 1), chunk=3, prefix="killed",
                  instance="second")
    eng = two_host_engine(sc, home.shm_dir, peer_shm)
    try:
        before = sum(p["records_in"] for p in peers_of(home))
        eng.begin()
        eng.run_step()
        eng.run_step()  # positions 0..5 of every request, on both stages
        sent = len(plan(sc)[PEER_RANK]) * sc.n_requests * 2
        wait_until(lambda: sum(p["records_in"] for p in peers_of(home)) >= before + sent, 15, "the prefill at the home")
        peer.kill()
        killed = time.monotonic()
        while eng.run_step():  # positions 6 and 7: the home stage and the ENDs reach the home, stage two not
            pass
        assert eng.flush()
        last_record = time.monotonic()  # the ENDs: the last records these captures can still get
        client = home.client()
        for i in range(sc.n_requests):
            sub = client.subscribe(sc.request_id(i), timeout=20)
            items = list(sub.chunks())
            ended = time.monotonic()
            gaps = [(list(g.positions), g.reason) for g in items if getattr(g, "missing", False)]
            assert [p for ps, _ in gaps for p in ps] == [6, 7] and {r for _, r in gaps} == {PEER_GONE}, gaps
            assert sub.end is not None and list(sub.end.missing_positions) == [6, 7]
            # The rule is 1 s after the last record a capture can still get; 1 s more for a loaded machine.
            assert ended - last_record < 2.0, f"ended {ended - last_record:.2f} s after its last record"
            print(f"{sc.request_id(i)}: ended {ended - killed:.2f} s after the kill, "
                  f"{ended - last_record:.2f} s after its END was written")
        assert home.status()["federation"]["sessions_ended"] == {PEER_GONE: 1}
    finally:
        eng.close()

    # 3. The peer restarted: it dials the home again, and later captures are whole.
    peer = start_peer()
    wait_until(lambda: len(peers_of(home)) == 1, 15, "the restarted peer's session")
    sc = Scenario(n_requests=2, prompt_len=6, gen_len=3, tp=1, pp=2, layers=(0, 1), chunk=3, prefix="again",
                  instance="third")
    eng = two_host_engine(sc, home.shm_dir, peer_shm)
    try:
        eng.run()
        assert eng.flush()
        client = home.client()
        for i in range(sc.n_requests):
            cap = client.fetch(sc.request_id(i), timeout=20)
            assert not cap.missing_positions, cap.missing_positions
            assert_capture(sc, i, capture_arrays(cap))
    finally:
        eng.close()
    assert rf.ENGINE_RANK == -1 and not os.path.exists(ring_path(peer_shm, sc.instance, rf.ENGINE_RANK))


def test_a_peer_without_its_keys_or_with_a_bad_home_does_not_start(tmp_path, shm_dir, sock_dir):
    keys = str(tmp_path / "keys")
    home_pub, _ = _keygen(keys, "home")
    _, peer_sec = _keygen(keys, "peer")
    loose = os.path.join(keys, "loose.key_secret")
    shutil.copy(peer_sec, loose)
    os.chmod(loose, 0o644)
    base = [sys.executable, "-m", "vllm_tap.cli", "daemon", "--shm-dir", shm_dir, "--endpoint",
            f"ipc://{sock_dir}/p.sock", "--state-dir", os.path.join(sock_dir, "s")]
    cases = [(["--home", "tcp://127.0.0.1:1", "--home-key", home_pub], "federation_key"),
             (["--home", "127.0.0.1:1", "--home-key", home_pub, "--federation-key", peer_sec], "tcp://HOST:PORT"),
             (["--home", "tcp://127.0.0.1:1", "--federation-key", peer_sec], "home_key"),
             (["--home", "tcp://127.0.0.1:1", "--home-key", home_pub, "--federation-key", home_pub], "secret"),
             (["--home", "tcp://127.0.0.1:1", "--home-key", home_pub, "--federation-key", loose], "chmod 600")]
    for args, says in cases:
        r = subprocess.run(base + args, capture_output=True, text=True, timeout=30)
        assert r.returncode != 0, (args, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert says in last, (args, r.stderr)


def test_the_peer_dials_a_restarted_home_again_and_captures_go_on_across_the_restart(hosts):
    home, start_peer, peer_shm = hosts
    peer = start_peer()
    wait_until(lambda: len(peers_of(home)) == 1, 15, "the peer daemon's session at the home")
    first = peer.status()["federation"]["sessions"]
    sc = Scenario(n_requests=2, prompt_len=6, gen_len=3, tp=1, pp=2, layers=(0, 1), chunk=3, prefix="across",
                  instance="across")
    eng = two_host_engine(sc, home.shm_dir, peer_shm)
    try:
        eng.begin()
        eng.run_step()
        eng.run_step()  # the prefill, both stages, read by the home ...
        sent = len(plan(sc)[PEER_RANK]) * sc.n_requests * 2
        wait_until(lambda: sum(p["records_in"] for p in peers_of(home)) >= sent, 15, "the prefill at the home")
        home.stop()  # ... which hands what it holds over to the next home daemon
        home.start()
        wait_until(lambda: len(peers_of(home)) == 1, 15, "the peer's new session at the restarted home")
        assert peer.status()["federation"]["sessions"] > first  # dialled again, its ring announced again
        # The peer's own captures in flight (of a layer on the home host too: `incomplete` there) end
        # with the session that would have brought their END.
        cap = peer.client().fetch(sc.request_id(0), timeout=20)
        assert cap.finish_reason == HOME_GONE and not cap.complete, cap.finish_reason
        for d, says in ((home, "home of 1 peer daemons"), (peer, "peer of the home daemon tcp://127.0.0.1:")):
            r = subprocess.run([sys.executable, "-m", "vllm_tap.cli", "status", "--endpoint", d.endpoint],
                               capture_output=True, text=True, timeout=30)
            assert r.returncode == 0 and says in r.stdout, r.stdout + r.stderr
        while eng.run_step():
            pass
        assert eng.flush()
        client = home.client()
        for i in range(sc.n_requests):
            # What the previous home daemon had already delivered of the head may have gone with it (as
            # after any daemon restart, a fetch now says so); everything else is here, exact.
            cap = client.fetch(sc.request_id(i), timeout=20)
            missing = set(cap.missing_positions)
            assert missing <= {0, 1, 2, 3, 4, 5}, cap.missing_positions
            want, got = expected(sc, i), capture_arrays(cap)
            here = [p for p in range(sc.end_position) if p not in missing]
            assert got["positions"].tolist() == here and {6, 7} <= set(here)
            for name in ("logits", "hidden.0", "hidden.1", "token_ids"):
                assert got[name].tobytes() == want[name][here].tobytes(), name
    finally:
        eng.close()


def test_a_recorder_of_the_home_daemon_records_two_host_captures_whole(hosts, tmp_path):
    """`vllm-tap record` pointed at the home daemon stores captures whose second stage ran on the
    peer host exactly as one host's: every position, every layer, the engine's values."""
    import numpy as np
    import pyarrow as pa

    from vllm_tap import dataset_format as df

    home, start_peer, peer_shm = hosts
    start_peer()
    wait_until(lambda: len(peers_of(home)) == 1, 15, "the peer daemon's session at the home")
    sc = Scenario(n_requests=3, prompt_len=6, gen_len=4, tp=1, pp=2, layers=(0, 1), chunk=3, prefix="rec",
                  instance="recorded")
    eng = two_host_engine(sc, home.shm_dir, peer_shm)
    rec, dest, log_path = _recorder(home, tmp_path, "home-host", sc.n_requests)
    try:
        eng.run()
        assert eng.flush() and eng.dropped == 0
        assert rec.wait(120) == 0, open(log_path).read()[-2000:]
    finally:
        eng.close()
        if rec.poll() is None:
            rec.kill()
    t, rid, pos = _recorded(dest, ["request_id", "position", "token_id", "logits", df.hook_name(0),
                                   df.hook_name(1)])
    for i in range(sc.n_requests):
        sel = np.nonzero(rid == sc.request_id(i))[0]
        part = t.take(pa.array(sel[np.argsort(pos[sel])]))
        want = expected(sc, i)
        assert part.column("position").to_numpy().tolist() == list(range(sc.end_position))
        assert part.column("token_id").to_numpy().tolist() == want["token_ids"].tolist()
        for col, name in (("logits", "logits"), (df.hook_name(0), "hidden.0"), (df.hook_name(1), "hidden.1")):
            got = np.stack(part.column(col).to_numpy(zero_copy_only=False))
            assert got.tobytes() == want[name].tobytes(), (sc.request_id(i), col)


def test_a_peer_daemon_delivers_and_records_the_captures_its_own_ranks_suffice_for(hosts, tmp_path):
    """The last stage runs on the peer host, and a capture of the logits alone needs only its ranks:
    the peer daemon, which the home sends its engine ring's BEGIN, END and LIVE records, delivers it
    whole too, through fetch, watch and `vllm-tap record` on the peer host, as the home does."""
    import numpy as np

    home, start_peer, peer_shm = hosts
    peer = start_peer()
    wait_until(lambda: len(peers_of(home)) == 1, 15, "the peer daemon's session at the home")
    sc = Scenario(n_requests=3, prompt_len=6, gen_len=4, tp=1, pp=2, layers=(), chunk=3, prefix="local",
                  instance="local")
    assert plan(sc)[0] == [] and plan(sc)[PEER_RANK]  # only the peer host's rank writes
    eng = two_host_engine(sc, home.shm_dir, peer_shm)
    rec, dest, log_path = _recorder(peer, tmp_path, "peer-host", sc.n_requests)
    try:
        eng.run()
        assert eng.flush() and eng.dropped == 0
        for d in (peer, home):
            client = d.client()
            for i in range(sc.n_requests):
                cap = client.fetch(sc.request_id(i), timeout=20)
                assert cap.complete and not cap.missing_positions, (d.endpoint, cap.missing_positions)
                assert_capture(sc, i, capture_arrays(cap))
        watched = {}
        for item in peer.client().watch(since=0, instance=sc.instance):
            if isinstance(item, WatchedCapture):
                assert not item.gaps
                watched[item.request_id] = item
            if len(watched) == sc.n_requests:
                break
        assert sorted(watched) == sorted(sc.request_id(i) for i in range(sc.n_requests))
        assert rec.wait(120) == 0, open(log_path).read()[-2000:]
        st = peer.status()["federation"]
        assert st["controls_in"] >= 2 * sc.n_requests and st["records_rejected"] == 0, st
    finally:
        eng.close()
        if rec.poll() is None:
            rec.kill()
    t, rid, pos = _recorded(dest, ["request_id", "position", "logits"])
    for i in range(sc.n_requests):
        sel = np.nonzero(rid == sc.request_id(i))[0]
        order = sel[np.argsort(pos[sel])]
        assert pos[order].tolist() == list(range(sc.end_position))
        got = np.stack(t.column("logits").to_numpy(zero_copy_only=False)[order])
        assert got.tobytes() == expected(sc, i)["logits"].tobytes(), sc.request_id(i)
