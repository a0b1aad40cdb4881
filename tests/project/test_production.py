"""docs/production.md, followed: the recorder unit's command line with the page's environment file
records a real daemon's captures into S3 (moto's S3 server, reached as the page says to reach MinIO),
and the page's Prometheus alert rules name only metrics a real daemon exports, with a rule that fires
when the daemon is not there to be scraped at all."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import yaml

from project_layout import REPO
from synthetic_writer import Scenario, SyntheticEngine, expected
from waiting import wait_until

PAGE = os.path.join(REPO, "docs", "production.md")
UNIT = os.path.join(REPO, "systemd", "vllm-tap-record@.service")


def _page() -> str:
    with open(PAGE, encoding="utf-8") as f:
        return f.read()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", _page(), re.S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the recording --


def env_file() -> dict[str, str]:
    """The page's /etc/vllm-tap/record-prod.env, as systemd reads it."""
    m = re.search(r"record-prod\.env <<'EOF'\n(.*?)\nEOF\n", _page(), re.S)
    assert m, "no environment file for vllm-tap-record@prod in docs/production.md"
    return dict(line.split("=", 1) for line in m.group(1).splitlines() if line and not line.startswith("#"))


def unit_command(env: dict[str, str], instance: str, host: str, state: str) -> tuple[list[str], dict[str, str]]:
    """The unit's ExecStart= for `instance` as systemd expands it (specifiers, ${VAR} as one word,
    $VAR split into words), with the CLI run from this checkout and /var/lib under `state`; and the
    unit's Environment=."""
    settings: dict[str, list[str]] = {}
    with open(UNIT, encoding="utf-8") as f:
        for line in f:
            if "=" in line and not line.startswith("#"):
                k, v = line.rstrip("\n").split("=", 1)
                settings.setdefault(k, []).append(v)

    def spec(s: str) -> str:
        return s.replace("%i", instance).replace("%H", host).replace("/var/lib/vllm-tap-record", state)

    argv: list[str] = []
    for word in shlex.split(settings["ExecStart"][-1]):
        m = re.fullmatch(r"\$\{(\w+)\}", word) or re.fullmatch(r"\$(\w+)", word)
        if m and word.startswith("${"):
            argv.append(env.get(m.group(1), ""))
        elif m:
            argv += env.get(m.group(1), "").split()
        else:
            argv.append(spec(word))
    assert argv[0] == "/usr/local/bin/vllm-tap"
    unit_env = dict(kv.split("=", 1) for v in settings["Environment"] for kv in shlex.split(spec(v)))
    return [sys.executable, "-m", "vllm_tap.cli", *argv[1:]], unit_env


def test_the_recorder_unit_with_the_pages_settings_records_the_policys_captures_to_s3(daemon_factory, shm_dir,
                                                                                        tmp_path, monkeypatch):
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        _record_to_s3(daemon_factory, shm_dir, tmp_path, f"http://127.0.0.1:{port}", s3fs, monkeypatch)
    finally:
        server.stop()


def _record_to_s3(daemon_factory, shm_dir, tmp_path, s3_endpoint: str, s3fs, monkeypatch) -> None:
    from vllm_tap.client.datasets import open_dataset

    env = env_file()
    assert env["DEST"].startswith("s3://") and env["AWS_ACCESS_KEY_ID"]
    # MinIO, as the page says: the endpoint goes into RECORD_ARGS
    env["RECORD_ARGS"] += f" --storage-option endpoint_url={s3_endpoint}"
    bucket = env["DEST"][len("s3://"):].split("/")[0]
    creds = {k: v for k, v in env.items() if k.startswith("AWS_")}
    so = {"client_kwargs": {"endpoint_url": s3_endpoint, "region_name": env["AWS_DEFAULT_REGION"]},
          "key": creds["AWS_ACCESS_KEY_ID"], "secret": creds["AWS_SECRET_ACCESS_KEY"]}
    fs = s3fs.S3FileSystem(**so)
    fs.mkdir(bucket, region_name=env["AWS_DEFAULT_REGION"])

    d = daemon_factory(end_grace_s=1.0)
    argv, unit_env = unit_command(env, "prod", "testhost", str(tmp_path / "state"))
    assert unit_env["VLLM_TAP_ENDPOINT"] == "ipc:///run/vllm-tap/tap.sock"
    run_env = {**os.environ, **unit_env, **{k: v for k, v in env.items() if k not in ("DEST", "RECORD_ARGS")},
               "VLLM_TAP_ENDPOINT": d.endpoint}  # this test's daemon in place of /run/vllm-tap
    log = str(tmp_path / "rec.log")
    rec = subprocess.Popen(argv, env=run_env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        manifest = f"{env['DEST'][len('s3://'):]}/writers/testhost-prod/manifest.json"
        wait_until(lambda: fs.exists(manifest) or rec.poll() is not None, 60, "the recorder's first manifest")
        assert rec.poll() is None, open(log).read()
        policy = Scenario(n_requests=5, tp=1, prefix="p", source="policy", tap_key="prod", ring_bytes=4 << 20)
        other = Scenario(n_requests=2, tp=1, prefix="c", source="client", tap_key="job", ring_bytes=4 << 20,
                         instance="other")
        for sc in (policy, other):
            eng = SyntheticEngine(sc, shm_dir)
            eng.run()
            assert eng.flush()
            eng.close()
        wait_until(lambda: d.status()["sequence"]["last"] >= 7 and not d.status()["requests_in_flight"], 30,
                   "the daemon's captures")
        time.sleep(2.0)  # the recorder's watch takes them in (it commits at its stop)
    finally:
        rec.send_signal(signal.SIGTERM)  # systemctl stop
    assert rec.wait(120) == 0, open(log).read()

    fs.invalidate_cache()
    for k, v in creds.items():  # a reader of the bucket, with the usual AWS variables
        monkeypatch.setenv(k, v)
    ds = open_dataset(env["DEST"], {"client_kwargs": so["client_kwargs"]})
    assert ds.verify() == []
    t = ds.to_pyarrow().to_table()
    assert set(t.column("writer").to_pylist()) == {"testhost-prod"}
    rid = np.array(t.column("request_id").to_pylist())
    assert sorted(set(rid.tolist())) == [policy.request_id(i) for i in range(5)]  # --source policy, prefix prod
    for i in range(5):
        sel = np.nonzero(rid == policy.request_id(i))[0]
        got = t.take(sel).sort_by("position")
        exp = expected(policy, i)
        assert got.column("position").to_pylist() == exp["positions"].tolist()
        assert np.stack(got.column("logits").to_numpy(zero_copy_only=False)).tobytes() == exp["logits"].tobytes()
    assert ds.lost == [] and ds.gaps == []


# -- the alerts --


def alert_rules() -> list[dict]:
    for block in _blocks("yaml"):
        doc = yaml.safe_load(block)
        if isinstance(doc, dict) and "groups" in doc:
            return [r for g in doc["groups"] for r in g["rules"]]
    raise AssertionError("no Prometheus rule file in docs/production.md")


def scrape_job() -> str:
    for block in _blocks("yaml"):
        doc = yaml.safe_load(block)
        if isinstance(doc, dict) and "scrape_configs" in doc:
            return doc["scrape_configs"][0]["job_name"]
    raise AssertionError("no scrape configuration in docs/production.md")


def test_the_alert_rules_name_only_what_a_daemon_exports_and_fire_on_a_dead_one(daemon_factory, shm_dir):
    from prometheus_client.parser import text_string_to_metric_families

    job = scrape_job()
    rules = alert_rules()
    exprs = {r["alert"]: r["expr"] for r in rules}
    # A dead daemon exports nothing: only Prometheus's own `up` (or its absence) says so.
    down = [e for e in exprs.values() if f'up{{job="{job}"}} == 0' in e and f'absent(up{{job="{job}"}})' in e]
    assert down, exprs
    assert any(re.search(r"vllm_tap_ring_pending_bytes\s*/\s*vllm_tap_ring_capacity_bytes", e) for e in exprs.values())

    port = _free_port()
    d = daemon_factory(metrics_addr=f"127.0.0.1:{port}")
    eng = SyntheticEngine(Scenario(n_requests=1, tp=1), shm_dir)  # a ring, so that ring metrics exist
    try:
        eng.run()
        wait_until(lambda: d.status()["rings"], 10, "the ring")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        eng.close()
    samples = {s.name: s.labels for f in text_string_to_metric_families(text) for s in f.samples}
    named = {n for e in exprs.values() for n in re.findall(r"\bvllm_tap_\w+", e)}
    assert named and sorted(named - set(samples)) == []
    # `by (...)` labels: the ring's own, and its `instance` as Prometheus renames it beside the target's
    ring_labels = set(samples["vllm_tap_ring_pending_bytes"])
    for e in exprs.values():
        for by in re.findall(r"by \(([^)]*)\)", e):
            for label in (x.strip() for x in by.split(",")):
                assert (label in ring_labels) or (label == "exported_instance" and "instance" in ring_labels), label
