"""`vllm-tap record` end to end with real processes: a real daemon fed by the synthetic engine
(tests/support/synthetic_writer.py), the recorder as a subprocess, SIGKILL at chosen points of the commit
protocol (VLLM_TAP_RECORD_FAILPOINT) and at random times, a full disk (a small tmpfs), and an
S3-protocol server (moto's standalone server) reached through s3fs. Every check reads the dataset
back and compares it with what the synthetic engine wrote and with the daemon's own fetch."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pytest

from synthetic_writer import Scenario, SyntheticEngine, expected, output_token_ids
from vllm_tap import dataset_format as df
from vllm_tap.client.datasets import open_dataset
from project_layout import SUPPORT



def scenario(prefix: str, n: int = 10, **kw) -> Scenario:
    kw.setdefault("ring_bytes", 16 << 20)
    kw.setdefault("tp", 1)
    return Scenario(n_requests=n, prefix=prefix, **kw)


def write(shm_dir: str, sc: Scenario, step_sleep: float = 0.0) -> None:
    eng = SyntheticEngine(sc, shm_dir)
    eng.run(step_sleep)
    assert eng.flush()
    eng.close()


def start_recorder(dest: str, endpoint: str, *args: str, writer: str = "hostA", failpoint: str | None = None,
                   log_path: str | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("VLLM_TAP_RECORD_FAILPOINT", None)
    if failpoint:
        env["VLLM_TAP_RECORD_FAILPOINT"] = failpoint
    out = open(log_path, "ab") if log_path else subprocess.PIPE
    return subprocess.Popen([sys.executable, "-m", "vllm_tap.cli", "record", dest, "--endpoint", endpoint,
                             "--writer", writer, "--quiet", "--shard-age", "1s", *args], stdout=out, stderr=out if log_path else subprocess.PIPE,
                            env=env)


def manifest(dest: str, writer: str = "hostA", storage_options=None) -> df.Manifest | None:
    from vllm_tap.client.datasets.store import DatasetStore

    raw = DatasetStore(dest, storage_options).read_bytes(df.manifest_path(writer))
    return df.decode_manifest(raw) if raw else None


def wait_for(pred, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def committed(dest: str, daemon, captures: int, writer: str = "hostA", storage_options=None) -> bool:
    """The daemon numbered `captures` captures and the writer's manifest has committed them all
    (recorders in these tests run with --shard-age 1s, so a shard commits within about a second)."""
    s = daemon.status()
    nxt = s["sequence"]["next"]
    first = s["sequence"].get("first_retained")
    if first is None or nxt - first < captures or s["requests_in_flight"]:
        return False
    m = manifest(dest, writer, storage_options)
    return m is not None and m.committed_seq >= nxt - 1


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout)


def check_dataset(dest: str, scenarios: list[Scenario], storage_options=None, writers=None) -> pa.Table:
    """Every (request, position) of every scenario exactly once, with the engine's values."""
    ds = open_dataset(dest, storage_options)
    assert ds.verify() == []
    t = ds.to_pyarrow().to_table()
    keys = list(zip(t.column("writer").to_pylist(), t.column("request_id").to_pylist(), t.column("position").to_pylist()))
    assert len(keys) == len(set(keys)), "a (request, position) was written twice"
    rid = np.array(t.column("request_id").to_pylist())
    for sc in scenarios:
        for i in range(sc.n_requests):
            sel = np.nonzero(rid == sc.request_id(i))[0]
            part = t.take(pa.array(sel))
            order = np.argsort(part.column("position").to_numpy())
            part = part.take(pa.array(order))
            exp = expected(sc, i)
            assert part.column("position").to_numpy().tolist() == exp["positions"].tolist(), sc.request_id(i)
            assert part.column("token_id").to_numpy().tolist() == exp["token_ids"].tolist()
            for layer in sc.layers:
                got = np.stack(part.column(df.hook_name(layer)).to_numpy(zero_copy_only=False))
                assert np.array_equal(got, exp[f"hidden.{layer}"]), (sc.request_id(i), layer)
            got = np.stack(part.column("logits").to_numpy(zero_copy_only=False))
            assert np.array_equal(got, exp["logits"])
            full = [*(expected(sc, i)["token_ids"][:sc.prompt_len].tolist()), *output_token_ids(sc, i)]
            assert part.column("next_token_id").to_numpy().tolist() == full[1:]
    assert t.num_rows == sum(sc.n_requests * sc.end_position for sc in scenarios)
    return t


def listed_files_only(dest: str, writer: str = "hostA") -> None:
    m = manifest(dest, writer)
    names = {s.name for s in m.shards}
    for sub in ("rows", "captures"):
        d = os.path.join(dest, "writers", writer, sub)
        assert set(os.listdir(d)) == names, f"{sub}: files no manifest lists"


# -- a real daemon, values equal to its fetch --


def test_record_values_equal_daemon_fetch(daemon_factory, shm_dir, tmp_path) -> None:
    d = daemon_factory()
    dest = str(tmp_path / "ds")
    rec = start_recorder(dest, d.endpoint, "--shard-size", "10KB")
    wait_for(lambda: manifest(dest) is not None, what="the recorder's first manifest")
    sc = scenario("a", n=6)
    write(shm_dir, sc)
    wait_for(lambda: committed(dest, d, 6), what="the recorder to commit")
    assert stop(rec) == 0, rec.stderr.read().decode()
    t = check_dataset(dest, [sc])
    listed_files_only(dest)
    client = d.client()
    for i in range(sc.n_requests):
        cap = client.fetch(sc.request_id(i))
        part = t.filter(pa.compute.equal(t.column("request_id"), sc.request_id(i)))
        part = part.take(pa.compute.sort_indices(part, [("position", "ascending")]))
        assert np.array_equal(np.stack(part.column("logits").to_numpy(zero_copy_only=False)), cap.logits)
        for layer, h in cap.hidden.items():
            assert np.array_equal(np.stack(part.column(df.hook_name(layer)).to_numpy(zero_copy_only=False)), h)
    m = manifest(dest)
    assert m.metadata["models"] == ["synthetic"] and m.layout.logits.kind == "full"
    assert len(m.shards) >= 2 and all(s.bytes <= 10_000 + 8_000 for s in m.shards)
    hf = open_dataset(dest).to_hf(cache_dir=str(tmp_path / "hf"))
    assert hf.num_rows == t.num_rows


def test_missing_positions_keep_the_daemons_reason(daemon_factory, shm_dir, tmp_path) -> None:
    """A capture whose positions never arrived (one tensor-parallel rank never wrote) is in the
    manifest's gaps with the reason the daemon gave for each range, not a bare "missing"."""
    d = daemon_factory(end_grace_s=2.0)
    dest = str(tmp_path / "ds")
    rec = start_recorder(dest, d.endpoint)
    wait_for(lambda: manifest(dest) is not None, what="the recorder's first manifest")
    ok, broken = scenario("a", n=2), scenario("b", n=1, tp=2, skip_rank=1)
    write(shm_dir, ok)
    # Both scenarios write the same instance's ring files: the second replaces the first's, so the
    # daemon must have numbered the first's captures before (else it never sees them).
    wait_for(lambda: d.status()["sequence"]["next"] >= 3, what="the daemon to see the first captures")
    write(shm_dir, broken)
    wait_for(lambda: committed(dest, d, 3), what="the recorder to commit")
    assert stop(rec) == 0, rec.stderr.read().decode()
    sub = d.client().subscribe(broken.request_id(0), timeout=10)
    want: list[list] = []  # the daemon's gap ranges, adjacent ones with the same reason joined
    for g in sub.chunks():
        if g.missing:
            if want and want[-1][1] == g.positions.start and want[-1][2] == g.reason:
                want[-1][1] = g.positions.stop
            else:
                want.append([g.positions.start, g.positions.stop, g.reason])
    assert sum(b - a for a, b, _ in want) == broken.end_position
    assert all(r in ("incomplete", "timeout") for _, _, r in want), want
    ds = open_dataset(dest)
    got = [[g.start, g.stop, g.reason] for g in ds.gaps if g.request_id == broken.request_id(0)]
    assert got == want


def test_limits_stop_cleanly(daemon_factory, shm_dir, tmp_path) -> None:
    d = daemon_factory()
    dest = str(tmp_path / "ds")
    rec = start_recorder(dest, d.endpoint, "--duration", "3s")
    assert rec.wait(60) == 0
    assert "--duration 3 s reached" in rec.stderr.read().decode()
    rec = start_recorder(dest, d.endpoint, "--max-bytes", "5KB")
    wait_for(lambda: manifest(dest).generation >= 1, what="the manifest")
    write(shm_dir, scenario("a", n=6))
    assert rec.wait(60) == 0
    err = rec.stderr.read().decode()
    assert "--max-bytes 5000 reached" in err
    m = manifest(dest)
    assert 1 <= m.rows < 6 * 9 and m.rows % 9 == 0  # stopped after whole captures, all committed


# -- SIGKILL at each step of the commit protocol, then a restart --


def _restart_then_four_more(dest, d, shm_dir, log, *args):
    """Restart the recorder after a kill: it commits the first scenario's 10 captures, then 4 more."""
    rec = start_recorder(dest, d.endpoint, "--shard-size", "20KB", *args, log_path=log)
    sc2 = scenario("b", n=4, seed=1)
    wait_for(lambda: committed(dest, d, 10), what="the restarted recorder to commit")
    write(shm_dir, sc2)
    wait_for(lambda: committed(dest, d, 14), what="the restarted recorder to commit")
    assert stop(rec) == 0, open(log).read()
    return sc2, manifest(dest)


@pytest.mark.parametrize("point", ["mid-shard:4", "before-upload:2", "after-rows-upload:2", "after-upload:2",
                                   "mid-manifest:3", "after-manifest:3"])
def test_sigkill_then_restart_every_row_once(point, daemon_factory, shm_dir, tmp_path) -> None:
    d = daemon_factory()
    dest = str(tmp_path / "ds")
    log = str(tmp_path / "rec.log")
    rec = start_recorder(dest, d.endpoint, "--shard-size", "20KB", failpoint=point, log_path=log)
    wait_for(lambda: manifest(dest) is not None or rec.poll() is not None, what="the first manifest")
    sc = scenario("a", n=10)
    write(shm_dir, sc)
    assert rec.wait(60) == -signal.SIGKILL, open(log).read()
    before = manifest(dest)
    sc2, after = _restart_then_four_more(dest, d, shm_dir, log)
    if before is not None:  # nothing committed before the crash was lost or changed
        assert after.shards[:len(before.shards)] == before.shards
    check_dataset(dest, [sc, sc2])
    listed_files_only(dest)
    assert "removing" in open(log).read() or point.startswith(("mid-shard", "before-upload", "after-manifest", "mid-manifest"))


@pytest.mark.parametrize("point", ["mid-shard:6", "after-upload:1", "after-rows-upload:2"])
def test_sigkill_with_two_shards_in_flight_then_every_row_once(point, daemon_factory, shm_dir, tmp_path) -> None:
    """--parallel-shards 2: two shards are encoded at once and committed by one manifest. Killed while
    both are staged (mid-shard), after the first is published and before the second is, or with both
    rows files published but not the second captures file (rows files no manifest lists are visible),
    a restart still writes every (request, position) once."""
    d = daemon_factory()
    dest = str(tmp_path / "ds")
    log = str(tmp_path / "rec.log")
    staging = os.path.join(dest, "writers", "hostA", ".staging")
    # 20 KB shards hold 4 captures of this scenario: the first group (2 shards) seals at the 9th
    rec = start_recorder(dest, d.endpoint, "--shard-size", "20KB", "--parallel-shards", "2", "--shard-age", "1h",
                         failpoint=point, log_path=log)
    wait_for(lambda: manifest(dest) is not None or rec.poll() is not None, what="the first manifest")
    sc = scenario("a", n=10)
    write(shm_dir, sc)
    assert rec.wait(60) == -signal.SIGKILL, open(log).read()
    before = manifest(dest)
    assert before is not None and before.shards == []
    staged = sorted(n for n in os.listdir(staging) if n.startswith("rows-"))
    rows_dir = os.path.join(dest, "writers", "hostA", "rows")
    published = sorted(os.listdir(rows_dir)) if os.path.isdir(rows_dir) else []
    if point.startswith("mid-shard"):
        assert staged == ["rows-000000", "rows-000001"] and published == [], (staged, published)
    elif point.startswith("after-upload"):  # the first shard of the group is visible but unlisted
        assert staged == ["rows-000001"] and published == ["hostA-000000.parquet"], (staged, published)
    else:  # both rows files visible, unlisted
        assert staged == [] and published == ["hostA-000000.parquet", "hostA-000001.parquet"], (staged, published)
    sc2, after = _restart_then_four_more(dest, d, shm_dir, log, "--parallel-shards", "2")
    assert len(after.shards) >= 2
    seqs = [(s.seq_first, s.seq_last) for s in after.shards]
    assert any(a[1] > b[0] for a, b in zip(seqs, seqs[1:])), f"no two shards were filled at once: {seqs}"
    check_dataset(dest, [sc, sc2])
    listed_files_only(dest)
    assert point.startswith("mid-shard") or "removing rows/hostA-000000.parquet" in open(log).read()


def test_sigkill_at_random_times(daemon_factory, shm_dir, tmp_path) -> None:
    d = daemon_factory()
    dest = str(tmp_path / "ds")
    log = str(tmp_path / "rec.log")
    rng = random.Random(7)
    scs = [scenario(f"r{k}", n=6, seed=k) for k in range(3)]
    rec = start_recorder(dest, d.endpoint, "--shard-size", "15KB", log_path=log)
    wait_for(lambda: manifest(dest) is not None, what="the first manifest")
    for sc in scs:
        writer = subprocess.Popen([sys.executable, os.path.join(SUPPORT, "synthetic_writer.py"), shm_dir,
                                   json.dumps({**json.loads(sc.to_json())}), "--step-sleep", "0.02"],
                                  stdout=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.1, 0.6))
        rec.send_signal(signal.SIGKILL)
        rec.wait()
        assert writer.wait(60) == 0
        rec = start_recorder(dest, d.endpoint, "--shard-size", "15KB", log_path=log)
        done = 6 * (scs.index(sc) + 1)
        wait_for(lambda: committed(dest, d, done), what="commit")
    assert stop(rec) == 0, open(log).read()
    check_dataset(dest, scs)
    listed_files_only(dest)


# -- a full disk --


@pytest.fixture
def small_tmpfs():
    d = tempfile.mkdtemp(prefix="vt-full-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", d], capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs (needs root): {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", d])
    os.rmdir(d)


def test_disk_full_stops_with_one_line_and_keeps_what_was_committed(daemon_factory, shm_dir, small_tmpfs) -> None:
    d = daemon_factory()
    dest = os.path.join(small_tmpfs, "ds")
    # uncompressed, so that the synthetic values (which compress well) fill the disk
    rec = start_recorder(dest, d.endpoint, "--shard-size", "200KB", "--compression", "none", "--tensor-compression", "none")
    wait_for(lambda: manifest(dest) is not None, what="the first manifest")
    sc = scenario("big", n=20, hidden=1024, vocab=4096, gen_len=8)  # ~6 MB: more than fits
    write(shm_dir, sc)
    try:
        rc = rec.wait(120)
    finally:
        if rec.poll() is None:
            rec.kill()
    err = rec.stderr.read().decode().strip().splitlines()
    assert rc != 0
    assert "no space left on device" in err[-1] and "Traceback" not in "\n".join(err), err[-5:]
    ds = open_dataset(dest)
    assert ds.verify() == [] and ds.num_rows > 0
    t = ds.to_pyarrow().to_table()
    keys = list(zip(t.column("request_id").to_pylist(), t.column("position").to_pylist()))
    assert len(keys) == len(set(keys))
    m = manifest(dest)
    seq_of = dict(zip(t.column("request_id").to_pylist(), t.column("seq").to_pylist()))
    by_req: dict[str, list[int]] = {}
    for r, p in keys:
        by_req.setdefault(r, []).append(p)
    for r, ps in by_req.items():
        i = int(r.rsplit("-", 1)[1])
        got = t.filter(pa.compute.equal(t.column("request_id"), r))
        got = got.take(pa.compute.sort_indices(got, [("position", "ascending")]))
        exp = expected(sc, i)
        # whole captures, except the one cut between shards: its rows below resume_position
        n = m.resume_position if seq_of[r] == m.resume_seq else sc.end_position
        assert sorted(ps) == exp["positions"].tolist()[:n]
        assert np.array_equal(np.stack(got.column("logits").to_numpy(zero_copy_only=False)), exp["logits"][:n])
    assert max(seq_of.values()) <= max(m.committed_seq, m.resume_seq)
    # the daemon is untouched and serves everyone else
    assert d.alive()
    assert d.client().fetch(sc.request_id(0)).logits.shape == (sc.end_position, sc.vocab)


# -- object storage: moto's S3 server through s3fs --


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_server(monkeypatch):
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    endpoint = f"http://127.0.0.1:{port}"
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    if not fs.exists("tap-bucket"):  # moto keeps its state in this process across servers
        fs.mkdir("tap-bucket")
    yield endpoint, server
    try:
        server.stop()
    except Exception:
        pass


def test_s3_two_writers_and_a_kill_mid_upload(daemon_factory, shm_dir, s3_server, tmp_path) -> None:
    endpoint, _ = s3_server
    so = {"client_kwargs": {"endpoint_url": endpoint}}
    args = ["--storage-option", f"endpoint_url={endpoint}", "--staging", str(tmp_path / "staging")]
    d = daemon_factory()
    dest = "s3://tap-bucket/run1"
    log = str(tmp_path / "rec.log")
    # hostA's shards are ~20 MB: uploaded in 8 MiB parts; it dies after the first part
    # it seals its one shard (~24 MB, uncompressed: a multipart upload) when it has its 10 captures,
    # uploads it, and dies after the first part (one shard at once: two would be ~12 MB each)
    a = start_recorder(dest, d.endpoint, *args, "--instance", "hostA", "--shard-size", "40MB", "--shard-age", "1h", "--compression", "none", "--tensor-compression", "none", "--parallel-shards", "1",
                       "--max-captures", "10", writer="hostA", failpoint="mid-upload:1", log_path=log)
    b = start_recorder(dest, d.endpoint, *args, "--instance", "hostB", "--shard-size", "100KB", writer="hostB",
                       log_path=log)
    wait_for(lambda: manifest(dest, "hostA", so) is not None and manifest(dest, "hostB", so) is not None,
             what="both manifests")
    sc_a = scenario("a", n=10, instance="hostA", vocab=1 << 16, ring_bytes=64 << 20)
    sc_b = scenario("b", n=6, instance="hostB", seed=3, vocab=1 << 16, ring_bytes=64 << 20)
    write(shm_dir, sc_b)
    wait_for(lambda: committed(dest, d, 6, "hostB", so), what="hostB")
    write(shm_dir, sc_a)
    assert a.wait(120) == -signal.SIGKILL, open(log).read()
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
    assert not fs.exists("tap-bucket/run1/writers/hostA/rows/hostA-000000.parquet"), "a partial upload is visible"
    a = start_recorder(dest, d.endpoint, *args, "--instance", "hostA", "--shard-size", "40MB", writer="hostA",
                       log_path=log)
    wait_for(lambda: committed(dest, d, 16, "hostA", so), what="hostA after its restart")
    assert stop(a) == 0 and stop(b) == 0, open(log).read()
    t = check_dataset(dest, [sc_a, sc_b], storage_options=so)
    assert sorted(set(t.column("writer").to_pylist())) == ["hostA", "hostB"]
    ds = open_dataset(dest, so)
    hf = ds.to_hf(cache_dir=str(tmp_path / "hf"), columns=["writer", "seq", "position", "token_id"])
    assert hf.num_rows == t.num_rows


def test_unreachable_bucket_fails_with_one_line(daemon_factory, shm_dir, s3_server, tmp_path) -> None:
    endpoint, server = s3_server
    d = daemon_factory()
    dest = "s3://tap-bucket/run2"
    rec = start_recorder(dest, d.endpoint, "--storage-option", f"endpoint_url={endpoint}", "--staging",
                         str(tmp_path / "staging"), "--shard-size", "20KB")
    so = {"client_kwargs": {"endpoint_url": endpoint}}
    wait_for(lambda: manifest(dest, "hostA", so) is not None, what="the first manifest")
    committed = manifest(dest, "hostA", so)
    server.stop()
    write(shm_dir, scenario("a", n=6))
    rc = rec.wait(300)
    err = rec.stderr.read().decode().strip().splitlines()
    assert rc != 0 and err and err[-1].startswith("Error: cannot ") and "Traceback" not in "\n".join(err), err[-5:]
    assert d.alive() and d.status()["sequence"]["next"] > committed.committed_seq
