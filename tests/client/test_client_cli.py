"""The client library (blocking and asyncio) and the `vllm-tap` command line, against a real daemon."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from synthetic_writer import Scenario, SyntheticEngine, assert_capture, capture_arrays, expected
from vllm_tap import client as tap_client
from vllm_tap.client import AsyncClient, CaptureNotFound, Client, DaemonUnavailable, Gap, TokenRecord


def cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_tap.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_daemon_and_client_import_neither_torch_nor_vllm():
    code = ("import sys, vllm_tap.daemon.server, vllm_tap.client, vllm_tap.cli; "
            "bad = [m for m in ('torch', 'vllm') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_status_json_against_a_live_daemon(daemon_proc, shm_dir):
    sc = Scenario(tp=2, n_requests=2)
    SyntheticEngine(sc, shm_dir).run()
    daemon_proc.client().fetch(sc.request_id(1), timeout=10)
    r = cli("status", "--json", "--endpoint", daemon_proc.endpoint)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert sorted((x["instance"], x["rank"]) for x in s["rings"]) == [("default", -1), ("default", 0), ("default", 1)]
    assert all(x["alive"] and x["writer_pid"] == os.getpid() and x["pending_bytes"] == 0 for x in s["rings"])
    assert s["records_in"] > 0 and s["retained_requests"] == 2 and s["requests_in_flight"] == 0
    assert s["drops"]["records"] == 0 and s["delivered_messages"] > 0
    assert set(s["delivery_latency_s"]) == {"buckets", "sum", "count"} and "+Inf" in s["delivery_latency_s"]["buckets"]
    human = cli("status", "--endpoint", daemon_proc.endpoint)
    assert human.returncode == 0 and "default/rank-00001.ring" in human.stdout and "requests in flight: 0" in human.stdout
    assert f"woken by writers at {shm_dir}/.doorbell" in human.stdout


def test_cli_subscribe_prints_a_summary_and_writes_npz(daemon_proc, shm_dir, sock_dir):
    sc = Scenario(tp=2, n_requests=1, dtype="float16", layers=(1,))
    SyntheticEngine(sc, shm_dir).run()
    out = os.path.join(sock_dir, "cap.npz")
    r = cli("subscribe", sc.request_id(0), "--endpoint", daemon_proc.endpoint, "--timeout", "10", "--out", out)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    exp = expected(sc, 0)
    tokens = [l for l in lines if l.split()[0].isdigit()]
    assert len(tokens) == sc.end_position
    first = tokens[0].split()
    assert first[:3] == ["0", "prompt", f"tok={exp['token_ids'][0]}"]
    assert f"argmax={int(exp['logits'][0].astype(np.float32).argmax())}" in tokens[0] and "|h1|=" in tokens[0]
    assert tokens[-1].split()[1] == "output"
    assert any(l.startswith("end reason=length") and "missing=0" in l for l in lines)
    with np.load(out) as z:
        assert z["logits"].tobytes() == exp["logits"].tobytes() and z["logits"].dtype == np.float16
        assert z["hidden_1"].tobytes() == exp["hidden.1"].tobytes()
        assert list(z["positions"]) == list(range(sc.end_position)) and z["missing_positions"].size == 0
        assert z["missing_ranges"].shape == (0, 2)
        assert json.loads(str(z["meta"]))["finish_reason"] == "length"


def test_cli_subscribe_shows_missing_positions(daemon_proc, shm_dir):
    sc = Scenario(tp=2, n_requests=1, skip_rank=0)
    SyntheticEngine(sc, shm_dir).run()
    r = cli("subscribe", sc.request_id(0), "--endpoint", daemon_proc.endpoint, "--timeout", "10")
    assert r.returncode == 0, r.stderr
    assert "MISSING positions" in r.stdout and f"missing={sc.end_position} 0-{sc.end_position - 1}" in r.stdout


def test_cli_errors_are_one_line_without_traceback(sock_dir, shm_dir):
    bad = cli("daemon", "--shm-dir", shm_dir, "--endpoint", "bogus://nowhere")
    assert bad.returncode != 0 and "unsupported endpoint" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    usage = cli("daemon", "--retain-bytes", "-5")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    nobody = cli("status", "--endpoint", f"ipc://{sock_dir}/nobody.sock", "--timeout", "0.3")
    assert nobody.returncode != 0 and "no daemon answered" in nobody.stderr and "Traceback" not in nobody.stderr
    missing = cli("subscribe", "x", "--endpoint", f"ipc://{sock_dir}/nobody.sock", "--timeout", "0.2")
    assert missing.returncode != 0 and "no capture named 'x'" in missing.stderr and "Traceback" not in missing.stderr


def test_cli_daemon_refuses_an_endpoint_another_daemon_serves(daemon_proc, shm_dir):
    r = cli("daemon", "--shm-dir", shm_dir, "--endpoint", daemon_proc.endpoint)
    assert r.returncode != 0 and "already serving" in r.stderr
    assert daemon_proc.status()["pid"] == daemon_proc.proc.pid  # the first one is untouched


def test_cli_daemon_exits_zero_on_sigint(daemon_proc):
    daemon_proc.proc.send_signal(signal.SIGINT)
    assert daemon_proc.proc.wait(10) == 0
    assert "SIGINT" in daemon_proc.log()


def test_iteration_yields_records_per_position_and_gaps_in_order(daemon_proc, shm_dir):
    sc = Scenario(tp=1, n_requests=1, ring_bytes=4096, vocab=128, layers=(0,))
    eng = SyntheticEngine(sc, shm_dir)
    # The daemon is held still while the engine writes, so the small ring overflows for sure (a
    # quick daemon could otherwise drain it between steps): some positions are dropped.
    daemon_proc.proc.send_signal(signal.SIGSTOP)
    try:
        eng.run()
    finally:
        daemon_proc.proc.send_signal(signal.SIGCONT)
    assert eng.dropped and eng.flush(10)
    sub = daemon_proc.client().subscribe(sc.request_id(0), timeout=10)
    items = list(sub)
    covered = []
    exp = expected(sc, 0)
    for it in items:
        if isinstance(it, TokenRecord):
            assert not it.missing and it.phase == ("prompt" if it.position < sc.prompt_len else "output")
            assert it.logits.tobytes() == exp["logits"][it.position].tobytes()
            assert it.hidden[0].tobytes() == exp["hidden.0"][it.position].tobytes()
            covered.append(it.position)
        else:
            assert isinstance(it, Gap) and it.missing and it.reason == "dropped"
            covered.extend(it.positions)
    assert covered == list(range(sc.end_position))  # every position once, in order
    gapped = [p for it in items if isinstance(it, Gap) for p in it.positions]
    assert gapped and sub.end.missing_positions == gapped


def test_unknown_name_waits_for_the_timeout_then_says_so(daemon_proc):
    t = time.monotonic()
    with pytest.raises(CaptureNotFound, match="no capture named 'nope'"):
        daemon_proc.client().fetch("nope", timeout=0.5)
    assert 0.4 < time.monotonic() - t < 3


def test_a_capture_that_appears_while_waiting_is_streamed(daemon_proc, shm_dir):
    import threading

    sc = Scenario(tp=2, n_requests=1, topk=3)
    t = threading.Timer(0.3, lambda: SyntheticEngine(sc, shm_dir).run())
    t.start()
    cap = daemon_proc.client().fetch(sc.request_id(0), timeout=10)
    t.join()
    assert_capture(sc, 0, capture_arrays(cap))
    assert cap.logits is None and cap.topk_ids.shape == (sc.end_position, 3)


def test_module_level_functions_use_the_environment_endpoint(daemon_proc, shm_dir, monkeypatch):
    sc = Scenario(tp=1, n_requests=1)
    SyntheticEngine(sc, shm_dir).run()
    monkeypatch.setenv(tap_client.ENDPOINT_ENV, daemon_proc.endpoint)
    cap = tap_client.fetch(sc.request_id(0), timeout=10)
    assert_capture(sc, 0, capture_arrays(cap))
    assert [r.position for r in tap_client.subscribe(sc.request_id(0), timeout=10)] == list(range(sc.end_position))
    assert tap_client.status()["retained_requests"] == 1


def test_async_client(daemon_proc, shm_dir):
    sc = Scenario(tp=2, n_requests=2, dtype="bfloat16")
    SyntheticEngine(sc, shm_dir).run()

    async def main():
        c = AsyncClient(daemon_proc.endpoint)
        cap = await c.fetch(sc.request_id(0), timeout=10)
        sub = c.subscribe(sc.request_id(1), timeout=10)
        rows = [r async for r in sub]
        status = await c.status()
        with pytest.raises(CaptureNotFound):
            await c.fetch("nope", timeout=0.3)
        return cap, rows, sub.end, status

    cap, rows, end, status = asyncio.run(main())
    assert_capture(sc, 0, capture_arrays(cap))
    exp = expected(sc, 1)
    assert [r.position for r in rows] == list(range(sc.end_position))
    assert np.stack([r.logits for r in rows]).tobytes() == exp["logits"].tobytes()
    assert rows[0].logits.dtype == np.float32  # bfloat16 widened
    assert end.reason == "length" and status["retained_requests"] == 2


def _fetch_both_ways(endpoint: str, name: str, timeout: float, q) -> None:
    """A subscriber process: fetch with the blocking and the asyncio client, report how each ended."""
    import asyncio

    from vllm_tap.client import AsyncClient, Client

    async def fetch_async():
        return await AsyncClient(endpoint).fetch(name, timeout=timeout)

    for fetch in (lambda: Client(endpoint).fetch(name, timeout=timeout), lambda: asyncio.run(fetch_async())):
        try:
            cap = fetch()
            q.put(("returned", cap.positions.tolist(), False))
        except Exception as e:
            q.put((type(e).__name__, str(e), isinstance(e, TimeoutError)))


def test_fetch_timeout_bounds_the_whole_call_when_the_end_never_comes(daemon_proc, shm_dir):
    # BEGIN and the first positions, then nothing: the writer lives on, its END is lost and no
    # LIVE record says the request is gone. Without an overall deadline fetch() waits for ever.
    import multiprocessing as mp

    sc = Scenario(tp=1, n_requests=1, prompt_len=6, gen_len=4)
    eng = SyntheticEngine(sc, shm_dir)
    eng.begin()
    eng.run_step()
    eng.run_step()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_fetch_both_ways, args=(daemon_proc.endpoint, sc.request_id(0), 2.0, q))
    p.start()
    try:
        p.join(60)  # a bound on a hang, many times the deadline: not a measure of speed
        assert not p.is_alive(), "fetch(timeout=2) was still blocked after 60 s"
        results = [q.get(timeout=5) for _ in range(2)]
    finally:
        if p.is_alive():
            p.kill()
        eng.close()
    for kind, message, is_timeout in results:
        assert kind == "CaptureTimeout" and is_timeout, (kind, message)
        assert repr(sc.request_id(0)) in message and "within 2 s" in message and "6 positions" in message, message


def test_status_without_a_daemon_is_a_clear_error(sock_dir):
    with pytest.raises(DaemonUnavailable, match="no daemon answered"):
        Client(f"ipc://{sock_dir}/none.sock").status(timeout=0.2)
