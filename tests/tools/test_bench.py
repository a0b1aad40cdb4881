"""Smoke test of `vllm-tap bench` (no vLLM server): the transport, hook and ingest parts run --quick as
subprocesses and leave results that parse. Not a timed test: nothing here asserts a number."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest


def _bench(tmp_path, part: str, *args: str) -> dict:
    out = tmp_path / part
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_tap.cli", "bench", part, "--quick", "--into", str(out), "--no-latest", *args],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for name in ("results.md", "results.json"):
        assert (out / name).is_file(), f"{name} missing; output:\n{proc.stdout[-2000:]}"
    with open(out / "results.json") as f:
        results = json.load(f)
    md = (out / "results.md").read_text()
    assert "## Targets" in md
    pngs = [p for p in os.listdir(out) if p.endswith(".png")]
    try:
        import matplotlib  # noqa: F401

        assert pngs, "matplotlib is installed but no plot was written"
    except ImportError:
        assert "PNG plots skipped" in md
    return results


@pytest.mark.timeout(150)
def test_bench_transport_quick(tmp_path):
    r = _bench(tmp_path, "transport")["transport"]
    assert r["summary"] and r["trials"]
    for row in r["summary"]:
        assert row["complete"], row  # every record reached every subscriber
        assert row["p50_ms"] > 0 and row["gbps_per_sub"] > 0
    assert {row["subscribers"] for row in r["summary"]} == set(r["params"]["subscribers"])
    # Watch against one subscription per capture, 1 and 4 consumers, in the same run.
    rows = r["watch_summary"]
    assert {(row["mode"], row["consumers"]) for row in rows} == {(m, n) for m in ("watch", "subscribe")
                                                                  for n in r["params"]["subscribers"]}
    for row in rows:
        assert row["complete"], row  # every capture reached every consumer
        assert row["captures_per_s"] > 0 and row["gbps"] > 0


@pytest.mark.timeout(150)
def test_bench_ingest_quick(tmp_path):
    r = _bench(tmp_path, "ingest")["ingest"]
    assert set(r["summary"]) == {"logits", "logits-dma", "topk", "topk, 16 captures"}
    for shape, row in r["summary"].items():
        assert row["dropped"] == 0 and row["sections"], row  # the writer waits for room: nothing lost
        assert row["complete"] and row["missing_positions"] == row["late_records"] == 0, row
        assert row["steps_per_s"] > 0 and row["copy_gbps"] > 0 and row["daemon_cpu_s_warm"] >= 0, row
        # status was asked while the daemon read behind its ring, and answered (how fast is the bench's to say)
        assert row["status_unanswered"] == 0 and math.isfinite(row["status_p99_ms"]), row
    assert {(t["shape"], t["requests"]) for t in r["trials"]} == {
        ("logits", 64), ("logits-dma", 64), ("topk", 64), ("topk", 16)}
    # The captures sweep: the daemon's CPU per step against a step's rows, fitted through 16 and 64.
    fit = r["captures_fit"]
    assert fit["captures"] == [16, 64] and all(math.isfinite(fit[k]) for k in ("us_per_step", "us_per_capture"))


@pytest.mark.timeout(200)
def test_bench_hook_quick(tmp_path):
    """The real sizes, and the host-only scenario measured for this checkout and, before/after in
    the same run, for a git revision of it (HEAD here) in a worktree of its own."""
    results = _bench(tmp_path, "hook", "--against", "HEAD")
    r = results["hook"]
    rows = {row["scenario"]: row for row in r["summary"]}
    assert rows["decode-8-none"]["captured_bytes"] == 0
    full = rows["decode-8"]
    assert full["captured_bytes"] > 0 and full["hook_us"] > 0 and full["memcpy_us"] > 0
    assert full["dropped_records"] == 0
    assert rows["prefill-128"]["lm_head_us"] > 0  # the extra lm-head pass is timed apart from the hook
    host = results["hook_host"]
    assert len(host["versions"]) == 2
    got = {(row["version"], row["spec"], row["batch"]) for row in host["summary"]}
    assert got == {(v, s, b) for v in host["versions"] for s in host["params"]["specs"] for b in host["params"]["batches"]}
    for row in host["summary"]:
        assert row["host_us"] > 0 and row["step_ops"] > 0 and row["dropped"] == 0, row
        assert row["copies"] == 1 or row["spec"] == "full+2 layers", row  # one record a step (two before the steady step)
        assert (row["topk_us"] > 0) == (row["spec"] == "top-20"), row
    assert "host-only scenario" in (tmp_path / "hook" / "results.md").read_text()


# -- the serving part's accounting (no vLLM server: the serving bench itself takes minutes, so it
# is not in the suite; `vllm-tap bench serving --model small --quick` is its smoke run) --

_CHILD = """
import sys, time, setproctitle
setproctitle.setproctitle(sys.argv[1])
t = time.process_time()
while time.process_time() - t < float(sys.argv[2]):
    pass
time.sleep(60)
"""

_LEADER = """
import subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", sys.argv[1], title, burn])
        for title, burn in (("VLLM::EngineCore", "0"), ("VLLM::Worker_TP0", "0.5"))]
time.sleep(60)
"""


def test_server_roles_and_cpu_meter_follow_a_real_process_group():
    """The serving bench finds a server's processes by their vLLM titles and charges each its own
    CPU time: a worker that burns 0.5 CPU-seconds inside the window shows them, the others do not."""
    import time

    from vllm_tap.tools.bench.serving import CpuMeter, server_roles

    leader = subprocess.Popen([sys.executable, "-c", _LEADER, _CHILD], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        roles: dict = {}
        while time.monotonic() < deadline:
            roles = server_roles(leader.pid)
            if sorted(roles.values()) == ["api", "engine", "worker0"]:
                break
            time.sleep(0.05)
        assert sorted(roles.values()) == ["api", "engine", "worker0"], roles
        assert roles[leader.pid] == "api"
        meter = CpuMeter(roles)
        meter.start()
        time.sleep(2.0)  # the worker burns its 0.5 s of CPU in here (it started just before)
        by_role, busy, window = meter.stop()
        # the worker may have burnt part of its 0.5 s before start(); it cannot burn more after
        assert 0.0 < by_role["worker0"] <= 0.6, by_role
        assert by_role["engine"] < 0.1 and by_role["api"] < 0.1, by_role
        assert window >= 2.0 and busy >= by_role["worker0"] - 0.02
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()


def _run(config: str, repeat: int, tok_s: float, cpu: dict) -> dict:
    return {"config": config, "repeat": repeat, "requests": 10, "tok_s": tok_s, "ttft_p50_ms": 100.0,
            "ttft_p99_ms": 120.0, "itl_p50_ms": 10.0, "itl_p99_ms": 20.0, "tpot_ms": 10.0, "bytes_per_request": 5e3,
            "bytes_per_token": 80.0, "failed": 0, "cpu_s": {"server": sum(cpu.values())}, "proc_cpu_s": dict(cpu),
            "background_cpu_s": 0.1, "foreign_cpu_s": 0.5, "window_s": 10.0, "cpus": 2, "loadavg1": 1.5,
            "wall_s": 10.0}


def test_small_summary_ratios_within_repeat_and_cpu_per_request():
    """Ratios and CPU differences are taken against (a) of the same repeat; CPU is per request."""
    from vllm_tap.tools.bench import report, serving

    runs = []
    for r, (a_tok, b_tok) in enumerate(((100.0, 99.0), (50.0, 51.0), (80.0, 76.0))):
        runs.append(_run("a", r, a_tok, {"api": 1.0, "engine": 2.0, "worker0": 3.0, "subscriber": 0.0}))
        runs.append(_run("b", r, b_tok, {"api": 1.0, "engine": 2.0, "worker0": 3.0 + 0.01 * r, "daemon": 0.2,
                                         "subscriber": 0.0}))
    s = serving.summarise(runs, ["a", "b"], 3)
    q = s["b"]["ratio_to_a"]["tok_s"]
    assert q["median"] == 0.99 and q["range"] == (0.95, 1.02)  # 99/100, 51/50, 76/80: within each repeat
    cpu = s["b"]["cpu_ms_per_request"]
    assert cpu["worker0"]["median"] == pytest.approx(301.0) and cpu["worker0"]["range"] == pytest.approx((300.0, 302.0))
    assert cpu["daemon"]["median"] == 20.0 and cpu["tap"]["median"] == 20.0
    extra = s["b"]["cpu_extra_ms_per_request"]
    assert extra["vllm"]["median"] == pytest.approx(1.0) and extra["vllm"]["range"] == pytest.approx((0.0, 2.0))
    assert extra["total"]["median"] == pytest.approx(21.0)
    results = {"machine": {"cpus": 2}, "serving": {
        "params": serving._params_dict(serving.ServingParams.small()),
        "points": [{"vocab": 32000, "model_params": 5.6e7, "configs": ["a", "b", "t"], "runs": runs, "summary": s}],
    }}
    # the small view is chosen when a capture configuration of the small preset is there
    s["t"] = {**s["b"], "drain": {"complete_captures": 3, "captures": 3, "positions": 3, "expected_positions": 3,
                                  "missing": 0, "gb": 1e-5, "lag_s": 0.0, "ring_drops": 0}}
    md = report.markdown(results)
    assert "CPU milliseconds per request" in md
    assert "| (b) | 100.00 (100.00 – 100.00) | 200.00 (200.00 – 200.00) | 301.00 (300.00 – 302.00) |" in md

    def b_cpu_target(results):
        return [t for t in report.targets(results) if "(b) adds no measurable CPU" in t["target"]
                and "vLLM processes" in t["target"]][0]["met"]

    assert b_cpu_target(results) is True  # differences of 0, +1, +2 ms of 600: not measurable
    for run in runs:  # the same +5 ms in every repeat: measurable
        if run["config"] == "b":
            run["proc_cpu_s"]["worker0"] = 3.05
    s2 = serving.summarise(runs, ["a", "b"], 3)
    results["serving"]["points"][0]["summary"] = {**s2, "t": s["t"]}
    assert b_cpu_target(results) is False
    for run in runs:  # differences spread over more than 10 % of (a): not judged either way
        if run["config"] == "b":
            run["proc_cpu_s"]["worker0"] = 3.0 + 0.5 * run["repeat"] - 0.5
    s3 = serving.summarise(runs, ["a", "b"], 3)
    results["serving"]["points"][0]["summary"] = {**s3, "t": s["t"]}
    assert b_cpu_target(results) is None


@pytest.mark.timeout(150)
def test_bench_reducer_quick(tmp_path):
    r = _bench(tmp_path, "reducer")["reducer"]
    s = r["summary"]
    assert set(s["bytes_per_token"]) == {"layer", "sae"} and 0 < s["bytes_ratio"] < 1
    assert {(row["what"], row["batch"]) for row in s["host"]} == {(w, b) for w in ("layer", "sae")
                                                                  for b in r["params"]["batches"]}
    for row in s["host"]:
        assert row["steady"] and row["dropped"] == 0 and row["host_us"] > 0, row
        assert row["calls_constant"], row


def test_version_tables_give_medians_and_after_over_before():
    """`--against` for ingest and transport: each metric's median over a version's runs, and this
    checkout's over the other's."""
    from vllm_tap.tools.bench import versions

    runs = [{"version": v, "repeat": r, "summary": {"topk": {"steps_per_s": s, "daemon_cpu_s_per_kstep": c}}}
            for v, r, s, c in (("new", 0, 100.0, 0.1), ("old", 0, 50.0, 0.2), ("new", 1, 300.0, 0.3),
                               ("old", 1, 150.0, 0.2), ("new", 2, 200.0, 0.2), ("old", 2, 100.0, 0.4))]
    rows = versions.lines({"part": "ingest", "versions": ["new", "old"], "runs": runs})
    assert rows[0] == "| metric | new | old | new / old |"
    assert rows[2] == "| topk: steps/s | 200 | 100 | 2.00 |"
    assert rows[3] == "| topk: daemon CPU s / 1000 steps | 0.2 | 0.2 | 1.00 |"
