"""Smoke test of `vllm-tap bench` (no vLLM server): the transport and hook parts run --quick as
subprocesses and leave results that parse. Not a timed test: nothing here asserts a number."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _bench(tmp_path, part: str) -> dict:
    out = tmp_path / part
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_tap.cli", "bench", part, "--quick", "--into", str(out), "--no-latest"],
        capture_output=True, text=True, timeout=120,
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
def test_bench_hook_quick(tmp_path):
    r = _bench(tmp_path, "hook")["hook"]
    rows = {row["scenario"]: row for row in r["summary"]}
    assert rows["decode-8-none"]["captured_bytes"] == 0
    full = rows["decode-8"]
    assert full["captured_bytes"] > 0 and full["hook_us"] > 0 and full["memcpy_us"] > 0
    assert full["dropped_records"] == 0
    assert rows["prefill-128"]["lm_head_us"] > 0  # the extra lm-head pass is timed apart from the hook
