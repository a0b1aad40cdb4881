"""Transport: ring commit -> subscriber holding a numpy array, through a real `vllm-tap daemon`.

A writer process owns an engine ring and a rank ring and writes captures the way the hook does
(BEGIN, one DATA record of one position per step, END); N subscriber processes each subscribe to
every capture by name through the daemon. The first 8 bytes of every record's payload hold
time.time_ns() taken just before the record is committed, so a subscriber's latency is measured
from commit to the moment it holds the array (same host, same clock).

Two delivery paths run side by side, interleaved, against the same daemon:
- "frames": the payload goes to each subscriber as ZeroMQ frames (the path before the arena, and
  the one tcp:// subscribers take): the subscriber sets VLLM_TAP_ARENA=0;
- "arena": the subscriber maps the daemon's arena and gets descriptors; it copies each array once.
The memcpy bandwidth of one core is measured in the same run (a 64 MiB numpy copy, before and after
each round), so delivery is reported as a share of it. The daemon's CPU seconds per GB delivered
come from /proc/<pid>/stat around each throughput trial.

Per (record size, subscribers, path) and repeat, two phases:
- latency: records paced (one per `pace`, well below saturation), p50/p99 of commit -> array;
- throughput: records written as fast as the ring lets the writer (it waits for room, never
  drops); GB/s per subscriber from the first commit to the last record received.
Configurations are interleaved within each repeat, medians reported over repeats.

Watch, against the daemon with the default poll interval: the writer writes many
captures one after another (BEGIN, `records` DATA records of `size` bytes, END), as fast as the
ring allows; 1 and 4 consumer processes receive every capture whole, either through one watch each
(`Client.watch`, whole mode) or, for comparison, through one subscription per capture (`fetch` of
every name in turn, the per-request API). Captures/s and GB/s per consumer from the first commit to
the consumer's last capture; the writer's own rate is reported beside them (it bounds both).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from vllm_tap.tools.bench import loadavg, median, percentile, proc_cpu_seconds, spread

log = logging.getLogger(__name__)

INSTANCE = "bench"
KiB, MiB = 1 << 10, 1 << 20
P99_TARGET_MS = 1.0
P99_TARGET_UP_TO = 1 * MiB
GBPS_TARGET = 1.0  # the frames path's target before the arena, kept for comparison
# For the arena path, as shares of one core's memcpy bandwidth measured in the same run:
SHARE_1_TARGET = 0.5  # one subscriber, records >= SHARE_FROM
SHARE_ALL_TARGET = 0.75  # all subscribers together (4), records >= SHARE_FROM
SHARE_FROM = 256 * KiB
CPU_RATIO_TARGET = 0.5  # the daemon's CPU s/GB on the arena path against the frames path
PATHS = ("frames", "arena")


def size_label(n: int) -> str:
    return f"{n // MiB} MB" if n >= MiB else f"{n // KiB} KB"


@dataclass
class TransportParams:
    sizes: list[int] = field(default_factory=lambda: [4 * KiB, 64 * KiB, 256 * KiB, 1 * MiB])
    subscribers: list[int] = field(default_factory=lambda: [1, 4])
    paths: list[str] = field(default_factory=lambda: list(PATHS))
    memcpy_bytes: int = 64 * MiB
    repeats: int = 3
    latency_records: int = 300
    min_pace_s: float = 0.002  # at least this long between paced records ...
    pace_bandwidth: float = 200e6  # ... and no faster than this many bytes/s
    throughput_bytes: int = 256 * MiB  # per throughput trial (records capped below)
    min_records: int = 64
    # Below the daemon's subscriber queue (10000 messages): the writer never waits for subscribers,
    # so a longer burst of small records would have the subscriber cut off as too slow, by design.
    max_records: int = 8000
    ring_bytes: int = 256 * MiB
    # The daemon keeps finished captures for late subscribers up to this many bytes. Before the
    # measured trials it is filled once, so its copies land in memory it reuses, as in a daemon that
    # has been up for a while (a fresh daemon's first retain_bytes go to newly faulted pages).
    retain_bytes: int = 256 * MiB
    # Daemon poll intervals compared (its --poll-interval: how long it sleeps when every ring is
    # empty): the default, and a low-latency setting that spends more CPU polling.
    # (With the doorbell the poll interval matters little; the paths are what is compared now.)
    poll_intervals: list[float] = field(default_factory=lambda: [0.0005])
    trickle_records: int = 200  # at 100/s: the daemon's CPU cost of polling while a capture streams
    # watch: (records per capture, record bytes) shapes; captures per trial from a byte budget
    watch_shapes: list[tuple[int, int]] = field(default_factory=lambda: [(4, 4 * KiB), (4, 256 * KiB)])
    watch_bytes: int = 256 * MiB
    watch_min_captures: int = 64
    watch_max_captures: int = 4000

    @classmethod
    def quick(cls) -> "TransportParams":
        return cls(sizes=[4 * KiB, 256 * KiB, 1 * MiB], subscribers=[1, 4], repeats=1, latency_records=60,
                   throughput_bytes=16 * MiB, min_records=32, max_records=2000, ring_bytes=64 * MiB,
                   retain_bytes=32 * MiB, trickle_records=50, watch_bytes=8 * MiB, watch_min_captures=16,
                   watch_max_captures=300, watch_shapes=[(4, 256 * KiB)], memcpy_bytes=16 * MiB)

    def pace(self, size: int) -> float:
        return max(self.min_pace_s, size / self.pace_bandwidth)

    def throughput_records(self, size: int) -> int:
        return int(min(self.max_records, max(self.min_records, self.throughput_bytes // size)))

    def watch_captures(self, records: int, size: int) -> int:
        return int(min(self.watch_max_captures, max(self.watch_min_captures, self.watch_bytes // (records * size))))


# -- the writer process --


def _writer_main(shm: str, ring_bytes: int, cmds: Any, results: Any) -> None:
    from vllm_tap import ring_format as rf
    from vllm_tap.ring_records import TensorId
    from vllm_tap.ring_files import ring_path
    from vllm_tap.ring_schema import BeginMeta, EndMeta, spec_field
    from vllm_tap.ring_writer import RingWriter
    from vllm_tap.spec import CaptureSpec

    logits = TensorId(rf.TensorKind.LOGITS)
    eng = RingWriter(ring_path(shm, INSTANCE, rf.ENGINE_RANK), 4 * MiB, rank=rf.ENGINE_RANK)
    w = RingWriter(ring_path(shm, INSTANCE, 0), ring_bytes, block_timeout=60.0)
    spec = spec_field(CaptureSpec())
    results.put(("ready", os.getpid()))
    try:
        while True:
            cmd = cmds.get()
            if cmd is None:
                return
            if cmd[0] == "many":
                results.put(("done", _write_many(eng, w, logits, spec, *cmd[1:])))
                continue
            name, size, n, pace = cmd
            width = size // 4
            src = np.random.default_rng(0).standard_normal(width, dtype=np.float32).view(np.uint8)
            # A writer without a scheduler never computes past an end: it says so, and the daemon
            # delivers each record at once instead of holding the newest back (assembly.HOLD_NEWEST).
            eng.write_control(name, BeginMeta(spec=spec, num_prompt_tokens=1, n=1, async_scheduling=False))
            dropped = 0
            first = last = 0
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            for k in range(n):
                if pace:
                    delay = t0 + k * pace - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                res = w.reserve(name, logits, [k], [k], dtype=rf.DType.FLOAT32, width=width, step=k + 1,
                                num_prompt_tokens=1)
                if res is None:
                    dropped += 1
                    continue
                res.payload[:] = src  # the copy into the ring, as the hook's memcpy
                stamp = time.time_ns()
                res.payload[:8].view("<i8")[0] = stamp
                w.commit(res)
                first = first or stamp
                last = stamp
            eng.write_control(name, EndMeta(reason="length", num_prompt_tokens=1, num_output_tokens=n,
                                            end_position=n))
            results.put(("done", {"name": name, "first_commit_ns": first, "last_commit_ns": last, "dropped": dropped,
                                  "writer_cpu_s": time.process_time() - cpu0}))
    finally:
        w.close()
        eng.close()


def _write_many(eng: Any, w: Any, logits: Any, spec: Any, prefix: str, n_caps: int, records: int,
                size: int) -> dict[str, Any]:
    """Captures one after another, each whole (BEGIN, records, END), as fast as the ring allows."""
    from vllm_tap import ring_format as rf
    from vllm_tap.ring_schema import BeginMeta, EndMeta

    width = size // 4
    src = np.random.default_rng(1).standard_normal(width, dtype=np.float32).view(np.uint8)
    dropped = 0
    first = 0
    cpu0 = time.process_time()
    for c in range(n_caps):
        name = f"{prefix}-{c}"
        eng.write_control(name, BeginMeta(spec=spec, num_prompt_tokens=1, n=1, model="bench",
                                          async_scheduling=False))
        for k in range(records):
            res = w.reserve(name, logits, [k], [k], dtype=rf.DType.FLOAT32, width=width, step=k + 1,
                            num_prompt_tokens=1)
            if res is None:
                dropped += 1
                continue
            res.payload[:] = src
            w.commit(res)
            first = first or time.time_ns()
        eng.write_control(name, EndMeta(reason="length", num_prompt_tokens=1, num_output_tokens=records,
                                        end_position=records))
    last = time.time_ns()
    while not eng.flush():  # control records the engine ring had no room for yet
        time.sleep(0.001)
    return {"name": prefix, "first_commit_ns": first, "last_commit_ns": last, "dropped": dropped,
            "writer_cpu_s": time.process_time() - cpu0}


def _consume_many(client: Any, cmd: tuple) -> dict[str, Any]:
    """("watch", since, n): one watch, every capture whole; ("fetch", prefix, n): one fetch per capture."""
    from vllm_tap.client import LostCaptures, WatchedCapture

    kind, arg, n = cmd
    got = nbytes = lost = 0
    first = last = 0
    cpu0 = time.process_time()
    err = ""
    try:
        if kind == "watch":
            w = client.watch(arg, timeout=120.0)
            for item in w:
                if isinstance(item, WatchedCapture):
                    got += 1
                    nbytes += item.capture.logits.nbytes
                    last = time.time_ns()
                    first = first or last
                elif isinstance(item, LostCaptures):
                    lost += len(item)
                if got + lost >= n:
                    break
            w.close()
        else:
            for c in range(n):
                cap = client.fetch(f"{arg}-{c}", timeout=120)
                got += 1
                nbytes += cap.logits.nbytes
                last = time.time_ns()
                first = first or last
    except Exception as e:  # reported, not raised: the orchestrator decides
        err = f"{type(e).__name__}: {e}"
    return {"name": f"{kind}-{arg}", "captures": got, "bytes": nbytes, "lost": lost, "first_ns": first,
            "last_ns": last, "cpu_s": time.process_time() - cpu0, "error": err}


# -- a subscriber process --


def _subscriber_main(index: int, endpoint: str, cmds: Any, results: Any) -> None:
    from vllm_tap.client import Chunk, Client

    client = Client(endpoint)
    results.put(("ready", index, os.getpid()))
    while True:
        name = cmds.get()
        if name is None:
            return
        if isinstance(name, tuple):
            results.put(("done", index, _consume_many(client, name)))
            continue
        name, path = name.split("|", 1) if "|" in name else (name, "arena")
        os.environ["VLLM_TAP_ARENA"] = "1" if path == "arena" else "0"  # read at each subscribe
        lat: list[int] = []
        got = nbytes = gaps = 0
        first = last = 0
        cpu0 = time.process_time()
        err = ""
        try:
            sub = client.subscribe(name, timeout=120)
            for item in sub.chunks():
                now = time.time_ns()
                if isinstance(item, Chunk):
                    a = item.logits
                    stamps = a.view("<i8")[:, 0]
                    lat.extend((now - stamps).tolist())
                    got += len(item)
                    nbytes += a.nbytes
                    first = first or now
                    last = now
                else:
                    gaps += len(item.positions)
            missing = len(sub.end.missing_positions) if sub.end is not None else -1
        except Exception as e:  # reported, not raised: the orchestrator decides
            err = f"{type(e).__name__}: {e}"
            missing = -1
        results.put(("done", index, {"name": name, "latencies_ns": lat, "records": got, "bytes": nbytes, "gaps": gaps,
                                     "missing": missing, "first_ns": first, "last_ns": last,
                                     "cpu_s": time.process_time() - cpu0, "error": err}))


# -- orchestration --


@dataclass
class _Procs:
    writer: Any
    writer_cmds: Any
    writer_results: Any
    subs: list[Any]
    sub_cmds: list[Any]
    sub_results: Any

    def stop(self) -> None:
        self.writer_cmds.put(None)
        for q in self.sub_cmds:
            q.put(None)
        for p in [self.writer, *self.subs]:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


def _get(q: Any, timeout: float, what: str) -> Any:
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"transport bench: no {what} within {timeout:.0f} s") from None


def _wait_waiting(endpoint: str, n: int, timeout: float = 30.0) -> None:
    from vllm_tap.client import Client

    deadline = time.monotonic() + timeout
    c = Client(endpoint)
    while c.status(timeout=5.0)["subscribers_waiting"] < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"transport bench: {n} subscribers did not attach within {timeout:.0f} s")
        time.sleep(0.005)


def _trial(procs: _Procs, endpoint: str, name: str, size: int, n: int, pace: float, nsub: int,
           path: str = "arena", daemon_pid: int | None = None) -> dict[str, Any]:
    for i in range(nsub):
        procs.sub_cmds[i].put(f"{name}|{path}")
    _wait_waiting(endpoint, nsub)
    cpu0 = proc_cpu_seconds(daemon_pid) if daemon_pid else 0.0
    procs.writer_cmds.put((name, size, n, pace))
    timeout = 60 + n * max(pace, 0.001) * 2
    kind, wres = _get(procs.writer_results, timeout, "writer result")
    subs = []
    for _ in range(nsub):
        kind, _i, sres = _get(procs.sub_results, timeout, "subscriber result")
        subs.append(sres)
    daemon_cpu = proc_cpu_seconds(daemon_pid) - cpu0 if daemon_pid else float("nan")
    return {"writer": wres, "subs": subs, "daemon_cpu_s": daemon_cpu}


def _summarise(kind: str, size: int, n: int, nsub: int, repeat: int, raw: dict[str, Any],
               path: str = "arena") -> dict[str, Any]:
    w, subs = raw["writer"], raw["subs"]
    lat_ms = [x / 1e6 for s in subs for x in s["latencies_ns"]]
    complete = all(s["records"] == n and s["missing"] == 0 and not s["error"] for s in subs) and w["dropped"] == 0
    out: dict[str, Any] = {
        "phase": kind, "path": path, "size": size, "subscribers": nsub, "repeat": repeat, "records": n,
        "complete": complete,
        "errors": [s["error"] for s in subs if s["error"]], "writer_dropped": w["dropped"],
        "received": [s["records"] for s in subs],
    }
    if kind == "latency":
        out.update(p50_ms=percentile(lat_ms, 50), p99_ms=percentile(lat_ms, 99), max_ms=max(lat_ms, default=float("nan")))
    else:
        # Sustained: bytes each subscriber got over [first commit, its last record received].
        per_sub = []
        for s in subs:
            dt = (s["last_ns"] - w["first_commit_ns"]) / 1e9
            per_sub.append(s["bytes"] / dt / 1e9 if dt > 0 else float("nan"))
        delivered = sum(s["bytes"] for s in subs)
        dcpu = raw.get("daemon_cpu_s", float("nan"))
        out.update(gbps_per_sub=median(per_sub), gbps_min_sub=min(per_sub, default=float("nan")),
                   gbps_total=sum(per_sub), writer_cpu_s=w["writer_cpu_s"],
                   sub_cpu_s=[s["cpu_s"] for s in subs], daemon_cpu_s=dcpu,
                   daemon_cpu_s_per_gb=dcpu / (delivered / 1e9) if delivered else float("nan"),
                   p50_ms=percentile(lat_ms, 50), p99_ms=percentile(lat_ms, 99))
    return out


def sched_probe(n: int = 400, sleep_s: float = 0.0005) -> dict[str, float]:
    """How late a thread wakes from a short sleep on this machine right now: the floor under any
    latency that needs a process to wake (here at least three: daemon, its zmq I/O thread, subscriber)."""
    over = []
    cpu0 = time.process_time()
    for _ in range(n):
        t = time.perf_counter()
        time.sleep(sleep_s)
        over.append((time.perf_counter() - t - sleep_s) * 1e3)
    return {"sleep_ms": sleep_s * 1e3, "oversleep_p50_ms": percentile(over, 50), "oversleep_p99_ms": percentile(over, 99),
            "oversleep_max_ms": max(over), "cpu_per_sleep_us": (time.process_time() - cpu0) / n * 1e6}


def memcpy_bandwidth(nbytes: int, reps: int = 7) -> float:
    """One core's memcpy bandwidth, bytes/s: the median of `reps` numpy copies of nbytes (far beyond
    the caches), destination pages already touched."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / median(times)


def _round(params: TransportParams, poll_s: float, r: int, workdir: str | None, echo) -> dict[str, Any]:
    """One daemon (polling every poll_s), one writer, the subscribers: every configuration once."""
    from vllm_tap.tools.launch import DaemonHandle

    shm = tempfile.mkdtemp(prefix="vllm-tap-bench-", dir="/dev/shm")
    sock = tempfile.mkdtemp(prefix="vtb-")
    endpoint = f"ipc://{sock}/d.sock"
    log_path = os.path.join(workdir or sock, "transport-daemon.log")
    retain = params.retain_bytes
    daemon = DaemonHandle(shm, endpoint, log_path)
    ctx = mp.get_context("spawn")
    procs: _Procs | None = None
    trials: list[dict[str, Any]] = []
    tag = f"poll {poll_s * 1e3:g} ms"
    try:
        daemon.start(extra=["--log-level", "WARNING", "--retain-bytes", str(retain), "--poll-interval", repr(poll_s)])
        assert daemon.proc is not None
        wc, wr = ctx.Queue(), ctx.Queue()
        writer = ctx.Process(target=_writer_main, args=(shm, params.ring_bytes, wc, wr), daemon=True)
        writer.start()
        nmax = max(params.subscribers)
        sr = ctx.Queue()
        scs = [ctx.Queue() for _ in range(nmax)]
        subs = [ctx.Process(target=_subscriber_main, args=(i, endpoint, scs[i], sr), daemon=True) for i in range(nmax)]
        for p in subs:
            p.start()
        procs = _Procs(writer, wc, wr, subs, scs, sr)
        _get(wr, 60, "writer start")
        for _ in subs:
            _get(sr, 60, "subscriber start")
        time.sleep(0.6)  # the daemon rescans the shm directory every 0.25 s: let it open the rings
        probe = sched_probe()
        memcpy = [memcpy_bandwidth(params.memcpy_bytes)]
        echo(f"  transport r{r}: memcpy {memcpy[0] / 1e9:.2f} GB/s (one core)")
        # Warm-up: what a daemon that has been up a while has touched: its retention full (see
        # retain_bytes) and, beside it, the largest capture a trial streams. Fresh tmpfs pages of
        # the arena (reserved, zeroed, faulted on first use) cost more than the copy into them, and
        # a long-running daemon pays that once. Reported as the cold rate.
        big = max(params.sizes)
        n_keep = max(1, retain // big - 1)  # retained after it ends
        _trial(procs, endpoint, f"warmup-keep-{r}", big, n_keep, 0.0, 1)
        n_warm = max(params.min_records, params.latency_records, params.throughput_records(big))
        warm = _summarise("throughput", big, n_warm, 1, r, _trial(procs, endpoint, f"warmup-{r}", big, n_warm, 0.0, 1))
        configs = [(size, nsub, path) for size in params.sizes for nsub in params.subscribers for path in params.paths]
        # Rotate the order each repeat so no configuration always runs first (or last); the paths
        # of one (size, subscribers) run back to back, so their ratio is taken under the same load.
        order = configs[r % len(configs):] + configs[: r % len(configs)]
        for size, nsub, path in order:
            for kind in ("latency", "throughput"):
                n = params.latency_records if kind == "latency" else params.throughput_records(size)
                pace = params.pace(size) if kind == "latency" else 0.0
                raw = _trial(procs, endpoint, f"{kind}-{size}-{nsub}-{path}-{r}", size, n, pace, nsub, path,
                             daemon.proc.pid)
                t = _summarise(kind, size, n, nsub, r, raw, path)
                t["poll_s"] = poll_s
                trials.append(t)
                if kind == "latency":
                    echo(f"  transport r{r} {path:<6} {size_label(size):>6} x{nsub} latency p50 {t['p50_ms']:.3f} ms "
                         f"p99 {t['p99_ms']:.3f} ms{'' if t['complete'] else '  INCOMPLETE'}")
                else:
                    echo(f"  transport r{r} {path:<6} {size_label(size):>6} x{nsub} {t['gbps_per_sub']:.2f} GB/s per "
                         f"subscriber, {t['gbps_total']:.2f} in all, daemon {t['daemon_cpu_s_per_gb']:.2f} CPU s/GB"
                         f"{'' if t['complete'] else '  INCOMPLETE ' + str(t['errors'])}")
        memcpy.append(memcpy_bandwidth(params.memcpy_bytes))
        # What polling costs: the daemon's CPU while one capture trickles in (100 small records/s),
        # the state it is in whenever a server streams a capture.
        cpu0, t0 = proc_cpu_seconds(daemon.proc.pid), time.monotonic()
        _trial(procs, endpoint, f"trickle-{r}", 4 * KiB, params.trickle_records, 0.01, 1)
        trickle_cpu = (proc_cpu_seconds(daemon.proc.pid) - cpu0) / (time.monotonic() - t0)
        echo(f"  transport r{r} {tag}: warm-up {warm['gbps_per_sub']:.2f} GB/s into a fresh daemon; daemon CPU at "
             f"100 records/s {100 * trickle_cpu:.1f}% of a core; wake-up p99 {probe['oversleep_p99_ms']:.3f} ms")
        watch = _watch_trials(procs, endpoint, params, r, echo) if poll_s == params.poll_intervals[0] else []
        for t in trials:
            t["memcpy_gbps"] = median(memcpy) / 1e9
        return {"trials": trials, "warmup": warm, "sched_probe": probe, "trickle_cpu": trickle_cpu, "poll_s": poll_s,
                "watch": watch, "memcpy_gbps": [m / 1e9 for m in memcpy]}
    finally:
        if procs is not None:
            procs.stop()
        daemon.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(shm + ".arena", ignore_errors=True)  # the daemon removes it at a clean stop
        shutil.rmtree(sock, ignore_errors=True)


def run(params: TransportParams, workdir: str | None = None, echo=print) -> dict[str, Any]:
    load0 = loadavg()
    t_start = time.time()
    rounds = []
    for r in range(params.repeats):
        polls = params.poll_intervals[r % len(params.poll_intervals):] + params.poll_intervals[: r % len(params.poll_intervals)]
        for poll_s in polls:
            rounds.append(_round(params, poll_s, r, workdir, echo))
    trials = [t for rd in rounds for t in rd["trials"]]
    per_poll = {}
    for poll_s in params.poll_intervals:
        rs = [rd for rd in rounds if rd["poll_s"] == poll_s]
        per_poll[repr(poll_s)] = {
            "warmup_gbps": median(rd["warmup"]["gbps_per_sub"] for rd in rs),
            "trickle_cpu": median(rd["trickle_cpu"] for rd in rs),
            "oversleep_p50_ms": median(rd["sched_probe"]["oversleep_p50_ms"] for rd in rs),
            "oversleep_p99_ms": median(rd["sched_probe"]["oversleep_p99_ms"] for rd in rs),
            "cpu_per_sleep_us": median(rd["sched_probe"]["cpu_per_sleep_us"] for rd in rs),
        }
    watch = [t for rd in rounds for t in rd.get("watch", [])]
    memcpy = [m for rd in rounds for m in rd["memcpy_gbps"]]
    return {"params": asdict(params), "trials": trials, "summary": summarise(trials, params), "per_poll": per_poll,
            "memcpy_gbps": median(memcpy), "memcpy_gbps_range": spread(memcpy),
            "path_summary": summarise_paths(trials, params),
            "watch_trials": watch, "watch_summary": summarise_watch(watch, params),
            "loadavg_start": load0, "loadavg_end": loadavg(), "seconds": time.time() - t_start}


def summarise(trials: list[dict[str, Any]], params: TransportParams) -> list[dict[str, Any]]:
    rows = []
    for poll_s in params.poll_intervals:
        for size in params.sizes:
            for nsub in params.subscribers:
                for path in params.paths:
                    sel = [t for t in trials if t["size"] == size and t["subscribers"] == nsub
                           and t["poll_s"] == poll_s and t.get("path", "arena") == path]
                    lat = [t for t in sel if t["phase"] == "latency"]
                    thr = [t for t in sel if t["phase"] == "throughput"]
                    p99 = median(t["p99_ms"] for t in lat)
                    gbps = median(t["gbps_per_sub"] for t in thr)
                    memcpy = median(t.get("memcpy_gbps", float("nan")) for t in thr)
                    rows.append({
                        "poll_s": poll_s, "path": path, "size": size, "subscribers": nsub,
                        "p50_ms": median(t["p50_ms"] for t in lat), "p99_ms": p99,
                        "p99_ms_range": spread(t["p99_ms"] for t in lat),
                        "gbps_per_sub": gbps, "gbps_range": spread(t["gbps_per_sub"] for t in thr),
                        "gbps_total": median(t["gbps_total"] for t in thr),
                        "memcpy_gbps": memcpy,
                        # Shares of memcpy from each trial's own round, then the median.
                        "share_per_sub": median(t["gbps_per_sub"] / t["memcpy_gbps"] for t in thr if t.get("memcpy_gbps")),
                        "share_total": median(t["gbps_total"] / t["memcpy_gbps"] for t in thr if t.get("memcpy_gbps")),
                        "daemon_cpu_s_per_gb": median(t.get("daemon_cpu_s_per_gb", float("nan")) for t in thr),
                        "complete": all(t["complete"] for t in lat + thr),
                        "p99_target": (p99 <= P99_TARGET_MS) if size <= P99_TARGET_UP_TO else None,
                    })
    return rows


def summarise_paths(trials: list[dict[str, Any]], params: TransportParams) -> list[dict[str, Any]]:
    """Arena against frames per (size, subscribers): ratios within each repeat (same load), medians."""
    if not {"arena", "frames"} <= set(params.paths):
        return []
    rows = []
    for size in params.sizes:
        for nsub in params.subscribers:
            gb, cpu, p99 = [], [], []
            for r in range(params.repeats):
                def one(path: str, phase: str) -> dict[str, Any] | None:
                    sel = [t for t in trials if (t["size"], t["subscribers"], t["repeat"], t.get("path"), t["phase"])
                           == (size, nsub, r, path, phase)]
                    return sel[0] if sel else None
                a, f = one("arena", "throughput"), one("frames", "throughput")
                if a and f and f["gbps_total"] > 0:
                    gb.append(a["gbps_total"] / f["gbps_total"])
                    cpu.append(a["daemon_cpu_s_per_gb"] / f["daemon_cpu_s_per_gb"])
                la, lf = one("arena", "latency"), one("frames", "latency")
                if la and lf and lf["p99_ms"] > 0:
                    p99.append(la["p99_ms"] / lf["p99_ms"])
            rows.append({"size": size, "subscribers": nsub, "gbps_ratio": median(gb), "cpu_per_gb_ratio": median(cpu),
                         "p99_ratio": median(p99), "cpu_target": (median(cpu) <= CPU_RATIO_TARGET)
                         if size >= SHARE_FROM else None})
    return rows


# -- watch: every capture through one watch, against one subscription per capture --


def _wait_watchers(endpoint: str, n: int, timeout: float = 30.0) -> None:
    from vllm_tap.client import Client

    deadline = time.monotonic() + timeout
    c = Client(endpoint)
    while len(c.status(timeout=5.0).get("watchers", ())) != n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"transport bench: {n} watchers did not attach within {timeout:.0f} s")
        time.sleep(0.005)


def _watch_trials(procs: _Procs, endpoint: str, params: TransportParams, r: int, echo) -> list[dict[str, Any]]:
    from vllm_tap.client import Client

    client = Client(endpoint)
    out = []
    configs = [(shape, ncons, mode) for shape in params.watch_shapes for ncons in params.subscribers
               for mode in ("watch", "subscribe")]
    order = configs[r % len(configs):] + configs[: r % len(configs)]
    for (records, size), ncons, mode in order:
        n = params.watch_captures(records, size)
        prefix = f"{mode}-{records}x{size}-{ncons}-{r}"
        _wait_watchers(endpoint, 0)  # the previous trial's watches are gone
        if mode == "watch":
            since = client.status(timeout=5.0)["sequence"]["last"]
            for i in range(ncons):
                procs.sub_cmds[i].put(("watch", since, n))
            _wait_watchers(endpoint, ncons)
        else:
            for i in range(ncons):
                procs.sub_cmds[i].put(("fetch", prefix, n))
            _wait_waiting(endpoint, ncons)
        procs.writer_cmds.put(("many", prefix, n, records, size))
        timeout = 120 + n * 0.05
        _, wres = _get(procs.writer_results, timeout, "writer result")
        subs = [_get(procs.sub_results, timeout, "consumer result")[2] for _ in range(ncons)]
        t0 = wres["first_commit_ns"]
        rates = [(s["captures"] / ((s["last_ns"] - t0) / 1e9), s["bytes"] / ((s["last_ns"] - t0) / 1e9) / 1e9)
                 if s["last_ns"] > t0 else (float("nan"), float("nan")) for s in subs]
        wdt = (wres["last_commit_ns"] - t0) / 1e9
        t = {"mode": mode, "records": records, "size": size, "capture_bytes": records * size, "consumers": ncons,
             "captures": n, "repeat": r,
             "complete": all(s["captures"] == n and not s["lost"] and not s["error"] for s in subs)
             and wres["dropped"] == 0,
             "errors": [s["error"] for s in subs if s["error"]], "lost": [s["lost"] for s in subs],
             "captures_per_s": median(x for x, _ in rates), "captures_per_s_min": min(x for x, _ in rates),
             "gbps": median(y for _, y in rates), "gbps_total": sum(y for _, y in rates),
             "writer_captures_per_s": n / wdt if wdt > 0 else float("nan"),
             "consumer_cpu_s": [s["cpu_s"] for s in subs], "writer_cpu_s": wres["writer_cpu_s"]}
        out.append(t)
        echo(f"  transport r{r} {mode:<9} {size_label(records * size):>6} captures x{ncons}: "
             f"{t['captures_per_s']:.0f} captures/s, {t['gbps']:.3f} GB/s per consumer (writer alone "
             f"{t['writer_captures_per_s']:.0f}/s){'' if t['complete'] else '  INCOMPLETE ' + str(t['errors'] or t['lost'])}")
    return out


def summarise_watch(trials: list[dict[str, Any]], params: TransportParams) -> list[dict[str, Any]]:
    rows = []
    for records, size in params.watch_shapes:
        for ncons in params.subscribers:
            for mode in ("watch", "subscribe"):
                sel = [t for t in trials if (t["records"], t["size"], t["consumers"], t["mode"]) == (records, size, ncons, mode)]
                if not sel:
                    continue
                rows.append({
                    "mode": mode, "records": records, "size": size, "capture_bytes": records * size, "consumers": ncons,
                    "captures_per_s": median(t["captures_per_s"] for t in sel),
                    "captures_per_s_range": spread(t["captures_per_s"] for t in sel),
                    "gbps": median(t["gbps"] for t in sel), "gbps_total": median(t["gbps_total"] for t in sel),
                    "writer_captures_per_s": median(t["writer_captures_per_s"] for t in sel),
                    "complete": all(t["complete"] for t in sel), "repeats": len(sel),
                })
    return rows
