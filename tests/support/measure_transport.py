"""Measure the transport (not a test): writer cost per record, daemon -> subscriber throughput.

    python tests/support/measure_transport.py [--records 1000] [--json]

1. Writer: median wall time of one RingWriter.write() call (reserve, copy in, commit) for 128 KiB
   and for small (256 B) records, into an empty ring and into a full one (the record is dropped).
2. Throughput: 128 KiB records (one position of 32768 float32 logits each) go through a real
   `vllm-tap daemon` process to a subscriber in this process, (a) draining a ring filled before the
   daemon started, (b) live, with a writer process running at the same time, (c) paced at one
   record per 5 ms, for the latency from write() to the subscriber's hands.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_tap import ring_format as rf  # noqa: E402
from vllm_tap.client import Chunk, Client, DaemonUnavailable  # noqa: E402
from vllm_tap.ring_records import TensorId  # noqa: E402
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_schema import BeginMeta, EndMeta, spec_field  # noqa: E402
from vllm_tap.ring_writer import RingWriter  # noqa: E402

LOGITS = TensorId(rf.TensorKind.LOGITS)
BIG = 32768  # float32 columns: 128 KiB per record
SMALL = 64  # 256 B


def writer_cost(shm: str, width: int, n: int) -> dict[str, float]:
    """Median write() time: steady state (the ring's pages already mapped, a reader keeping up),
    the first pass over a fresh ring (page faults), and a full ring (every write a counted drop)."""
    data = np.random.default_rng(0).standard_normal((1, width), dtype=np.float32)
    path = ring_path(shm, "w", 0)
    per = rf.align_up(data.nbytes + 256)
    w = RingWriter(path, per * 64)
    r = RingReader(path)
    first, steady = [], []
    for k in range(n + 64):
        t = time.perf_counter()
        assert w.write("r", LOGITS, [k], [k], data)
        (first if k < 64 else steady).append(time.perf_counter() - t)
        if k % 32 == 31:
            r.poll()  # untimed: the daemon's side
    r.poll()
    r.close()
    while w.write("r", LOGITS, [0], [0], data):  # nobody reads any more: fill the ring up
        pass
    full = []
    for k in range(n):
        t = time.perf_counter()
        assert not w.write("r", LOGITS, [k], [k], data)
        full.append(time.perf_counter() - t)
    w.close(unlink=True)
    med = lambda ts: statistics.median(ts) * 1e6  # noqa: E731
    return {"steady_us": med(steady), "first_touch_us": med(first), "full_us": med(full)}


def _write_request(shm: str, n: int, block: bool, pace_s: float = 0.0, width: int = BIG) -> None:
    """One request of n decode positions, 128 KiB of logits each (block: wait for room, never drop).
    The first 8 bytes of every record hold its write time, for end-to-end latency."""
    from vllm_tap.spec import CaptureSpec

    eng = RingWriter(ring_path(shm, "t", rf.ENGINE_RANK), 1 << 20, rank=rf.ENGINE_RANK)
    w = RingWriter(ring_path(shm, "t", 0), 256 << 20, block_timeout=30.0 if block else 0.0)
    data = np.ones((1, width), np.float32)
    if pace_s:
        time.sleep(0.5)  # let the daemon discover the new rings (it rescans every 0.25 s)
    # A writer without a scheduler never computes past an end: say so, nothing is held back.
    eng.write_control("bench", BeginMeta(spec=spec_field(CaptureSpec()), num_prompt_tokens=1, async_scheduling=False))
    for k in range(n):
        data.view(np.float64)[0, 0] = time.time()
        assert w.write("bench", LOGITS, [k], [k], data, step=k, num_prompt_tokens=1)
        if pace_s:
            time.sleep(pace_s)
    eng.write_control("bench", EndMeta(reason="length", num_prompt_tokens=1, num_output_tokens=n, end_position=n))
    w.close()
    eng.close()


def _daemon(shm: str, endpoint: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "vllm_tap.cli", "daemon", "--shm-dir", shm, "--endpoint", endpoint,
                          "--log-level", "WARNING", "--retain-bytes", str(4 << 30)])
    deadline = time.monotonic() + 15
    while True:
        try:
            Client(endpoint).status(timeout=0.2)
            return p
        except DaemonUnavailable:
            if time.monotonic() > deadline:
                raise


def _receive(endpoint: str, n: int) -> dict[str, float]:
    got = nbytes = 0
    t0 = None
    e2e = []
    for item in Client(endpoint).subscribe("bench", timeout=60).chunks():
        if isinstance(item, Chunk):
            now = time.time()
            if t0 is None:
                t0 = time.perf_counter()
            got += len(item)
            nbytes += item.logits.nbytes
            e2e.extend(now - item.logits.view(np.float64)[:, 0])
    dt = time.perf_counter() - (t0 or time.perf_counter())
    assert got == n, (got, n)
    return {"records_per_s": (got - 1) / dt, "MB_per_s": nbytes * (got - 1) / got / dt / 1e6, "seconds": dt,
            "e2e_p50_ms": 1000 * float(np.percentile(e2e, 50)), "e2e_p99_ms": 1000 * float(np.percentile(e2e, 99))}


def throughput(shm: str, sock: str, n: int, live: bool, pace_s: float = 0.0, width: int = BIG) -> dict[str, float]:
    endpoint = f"ipc://{sock}/bench-{'live' if live else 'drain'}{'-paced' if pace_s else ''}-{width}.sock"
    inst = os.path.join(shm, "t")
    shutil.rmtree(inst, ignore_errors=True)
    writer = None
    if not live:
        _write_request(shm, n, False, 0.0, width)  # fill the ring first; the daemon only drains
    d = _daemon(shm, endpoint)
    try:
        if live:  # subscribe first, so every record is live (not a replay)
            results: list[dict[str, float]] = []
            rx = threading.Thread(target=lambda: results.append(_receive(endpoint, n)))
            rx.start()
            while Client(endpoint).status()["subscribers_waiting"] < 1:
                time.sleep(0.01)
            writer = mp.get_context("fork").Process(target=_write_request, args=(shm, n, True, pace_s, width))
            writer.start()
            rx.join()
            res = results[0]
        else:
            res = _receive(endpoint, n)
        lat = Client(endpoint).status()["delivery_latency_s"]
        res["mean_delivery_latency_ms"] = 1000 * lat["sum"] / max(lat["count"], 1)
        return res
    finally:
        if writer is not None:
            writer.join(60)
        d.terminate()
        d.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1000, help="128 KiB records per throughput run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    shm = tempfile.mkdtemp(prefix="vllm-tap-measure-", dir="/dev/shm")
    sock = tempfile.mkdtemp(prefix="vt-measure-")
    try:
        out = {
            "cpus": os.cpu_count(),
            "writer_128KiB": writer_cost(shm, BIG, 400),
            "writer_256B": writer_cost(shm, SMALL, 5000),
            "drain_128KiB": throughput(shm, sock, args.records, live=False),
            "live_128KiB": throughput(shm, sock, args.records, live=True),
            "paced_128KiB": throughput(shm, sock, 200, live=True, pace_s=0.005),
            "drain_1KiB": throughput(shm, sock, 20000, live=False, width=256),
        }
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(shm.rstrip("/") + ".arena", ignore_errors=True)  # the daemon's arena, kept for a next run
        shutil.rmtree(sock, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k in ("writer_128KiB", "writer_256B"):
            v = out[k]
            print(f"{k:<14} write() median {v['steady_us']:7.1f} us   (fresh ring pages: {v['first_touch_us']:.1f} us; "
                  f"full ring, dropped: {v['full_us']:.1f} us)")
        v = out["drain_128KiB"]
        print(f"{'drain_128KiB':<14} {v['MB_per_s']:8.0f} MB/s  {v['records_per_s']:8.0f} records/s  (ring filled first)")
        v = out["live_128KiB"]
        print(f"{'live_128KiB':<14} {v['MB_per_s']:8.0f} MB/s  {v['records_per_s']:8.0f} records/s  "
              f"(writer running; saturated, so mean ring-read-to-send is {v['mean_delivery_latency_ms']:.1f} ms of queueing)")
        v = out["drain_1KiB"]
        print(f"{'drain_1KiB':<14} {v['MB_per_s']:8.1f} MB/s  {v['records_per_s']:8.0f} records/s  (per-record cost bound)")
        v = out["paced_128KiB"]
        print(f"{'paced_128KiB':<14} 200 records at 5 ms: write-to-subscriber p50 {v['e2e_p50_ms']:.2f} ms, "
              f"p99 {v['e2e_p99_ms']:.2f} ms; ring-read-to-send mean {v['mean_delivery_latency_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
