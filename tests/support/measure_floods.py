"""Timings of the daemon under socket floods (a measurement, not a test).

    python tests/support/measure_floods.py pending|junk|death [--json]

pending: captured requests/s (BEGIN to End in the daemon, no subscriber) with no waiting
         subscriptions, with 100,000 waiting from one socket, and after that socket left;
junk:    status round-trip p50/p99 while the daemon meets 100,000 junk `.ring` files;
death:   seconds from SIGKILL of a writer process to its subscriber's End.
The daemon runs from the Python this script runs with, so the same script times another checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import DaemonProcess  # noqa: E402
from ring_forge import RingForge, control, data, entry  # noqa: E402
from vllm_tap import ring_format as rf  # noqa: E402
from vllm_tap import wire_format as wf  # noqa: E402
from vllm_tap.client import Client  # noqa: E402
from vllm_tap.spec import CaptureSpec  # noqa: E402


def _daemon(settings: dict | None = None) -> tuple[DaemonProcess, str, str]:
    shm = tempfile.mkdtemp(prefix="vt-measure-", dir="/dev/shm")
    sd = tempfile.mkdtemp(prefix="vt-")
    d = DaemonProcess(shm, f"ipc://{sd}/d.sock", f"{sd}/log", {"log_level": "WARNING", **(settings or {})})
    return d, shm, sd


def _supports(key: str) -> bool:
    return subprocess.run([sys.executable, "-m", "vllm_tap.cli", "daemon", "--help"], capture_output=True,
                          text=True).stdout.count("--" + key.replace("_", "-")) > 0


def _requests(shm: str, instance: str, n: int) -> None:
    """n short captures (BEGIN, one DATA record, END), written as fast as possible."""
    eng = RingForge(shm, instance, rf.ENGINE_RANK, capacity=64 << 20)
    rank = RingForge(shm, instance, 0, capacity=64 << 20)
    begin = {"spec": CaptureSpec().to_meta(), "num_prompt_tokens": 4}
    payload = np.ones((4, 16), np.float32)
    for i in range(n):
        rid = f"{instance}-{i}"
        eng.append(control(rf.RecordKind.BEGIN, rid, begin))
        rank.append(data([entry(rid, num_prompt_tokens=4)], [0] * 4, [0, 1, 2, 3], [1, 2, 3, 4], payload))
        eng.append(control(rf.RecordKind.END, rid, {"reason": "length", "num_prompt_tokens": 4, "num_output_tokens": 1,
                                                    "output_token_ids": [5], "end_position": 4}))


def _status(d: DaemonProcess) -> dict:
    return Client(d.endpoint).status(timeout=300)  # a daemon stalled by a flood answers late


def _finished(d: DaemonProcess) -> int:
    return _status(d)["reassembly"].get("requests_finished", 0)


def _rate(d: DaemonProcess, shm: str, instance: str, n: int) -> float:
    base = _finished(d)
    t = time.monotonic()
    _requests(shm, instance, n)
    while _finished(d) < base + n:
        time.sleep(0.01)
    return n / (time.monotonic() - t)


def pending(n_sub: int = 100_000, n_req: int = 100) -> dict:
    settings = {}
    if _supports("max_subscriptions_per_connection"):
        settings = {"max_subscriptions_per_connection": n_sub, "max_subscriptions": n_sub + 100}
    d, shm, sd = _daemon(settings)
    d.start()
    out = {}
    try:
        out["captured_per_s_no_waiting"] = _rate(d, shm, "a", n_req)
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(d.endpoint)
        for i in range(n_sub):
            s.send_multipart(wf.Subscribe(i, f"never-{i}", timeout=3600).frames())
        deadline = time.monotonic() + 120
        while _status(d)["subscribers_waiting"] < n_sub and time.monotonic() < deadline:
            time.sleep(0.1)
        out["waiting"] = _status(d)["subscribers_waiting"]
        out["captured_per_s_100k_waiting"] = _rate(d, shm, "b", n_req)
        s.close()
        time.sleep(3)
        out["waiting_3s_after_the_socket_left"] = _status(d)["subscribers_waiting"]
        out["captured_per_s_after_it_left"] = _rate(d, shm, "c", n_req)
    finally:
        d.stop(30)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(shm.rstrip("/") + ".arena", ignore_errors=True)  # the daemon's arena, kept for a next run
        shutil.rmtree(sd, ignore_errors=True)
    return out


def junk(n: int = 100_000, seconds: float = 15.0) -> dict:
    d, shm, sd = _daemon()
    os.makedirs(os.path.join(shm, "junk"), mode=0o700)
    for i in range(n):
        with open(os.path.join(shm, "junk", f"x{i}.ring"), "wb") as f:
            f.write(b"junk")
    d.start()
    c = Client(d.endpoint)
    lat = []
    try:
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            t = time.monotonic()
            c.status(timeout=30)
            lat.append(time.monotonic() - t)
            time.sleep(0.02)
    finally:
        d.stop(30)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(shm.rstrip("/") + ".arena", ignore_errors=True)  # the daemon's arena, kept for a next run
        shutil.rmtree(sd, ignore_errors=True)
    a = np.array(lat)
    return {"status_calls": len(a), "p50_ms": float(np.percentile(a, 50) * 1e3), "p99_ms": float(np.percentile(a, 99) * 1e3),
            "max_ms": float(a.max() * 1e3)}


def death(runs: int = 5) -> dict:
    sc = json.dumps({"tp": 1, "n_requests": 1, "prompt_len": 4, "gen_len": 50, "chunk": 4})
    took = []
    for k in range(runs):
        d, shm, sd = _daemon({"end_grace_s": 5.0})
        d.start()
        w = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "synthetic_writer.py"), shm, sc,
                              "--stop-after", "3"], stdout=subprocess.PIPE, text=True)
        try:
            w.stdout.readline()
            ended = threading.Event()

            def follow() -> None:
                for _ in Client(d.endpoint).subscribe("req-0", timeout=30).chunks():
                    pass
                ended.set()

            t = threading.Thread(target=follow, daemon=True)
            t.start()
            while d.status()["subscribers"] < 1:
                time.sleep(0.01)
            time.sleep(0.2)
            killed = time.monotonic()
            w.kill()
            w.wait()  # reaped at once, as vLLM's parent process does (a zombie still answers kill(pid, 0))
            ended.wait(60)
            took.append(time.monotonic() - killed)
        finally:
            w.kill()
            w.wait()
            d.stop(30)
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(shm.rstrip("/") + ".arena", ignore_errors=True)  # the daemon's arena, kept for a next run
            shutil.rmtree(sd, ignore_errors=True)
    return {"runs": runs, "seconds": [round(x, 3) for x in took], "median_s": float(np.median(took))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["pending", "junk", "death"])
    args = ap.parse_args()
    print(json.dumps({"daemon": sys.executable, args.what: globals()[args.what]()}, indent=1))


if __name__ == "__main__":
    main()
