"""Ingest: how fast a real `vllm-tap daemon` takes in what a GPU worker writes, against the box's
tmpfs→tmpfs copy rate measured in the same run.

A writer process writes steps shaped like a GPU worker's into its rank ring (`block_timeout`: it
waits for room instead of dropping, so once the ring is full the writer runs at the daemon's pace),
with BEGIN and END records for every capture in the engine ring, as the hook and the engine core
write them:
  logits   64 decoding requests capturing full logits at vocabulary 128256, bf16 (16.4 MB a step)
  logits-dma  the same, its payloads left unwritten by the writer: a GPU worker's copy into the ring
           is the GPU's DMA and takes no core, while this box's two cores are shared by the writer
           and the daemon (the daemon still reads every byte)
  topk     64 decoding requests capturing top-20 (ids, values and the row's logsumexp: 8 kB a step)
Each step is one record of one section per tensor (ring format 5), or, with a writer without
sections (ring format 4, the code before 2026-11-26), one record per tensor: the same bench runs
against either, so the two are compared on one box. Nobody subscribes: the daemon reads, checks,
reassembles and retains (evicting the oldest), which is its work for every capture whoever reads it.

Reported per shape and repeat: steps/s and GB/s of payload from the first measured step committed
to the daemon having read the last one (the ring drained: the daemon's pace, which bounds the
writer's too), the daemon's CPU seconds per GB and per 1000 steps (utime+stime from /proc, its child
processes' included (the ring copier), from the
first measured step to the ring drained: sustained, after the warm-up steps in which the delivery
arena grows to its working size; the warm-up's CPU is reported apart), and the tmpfs copy rate (a numpy copy of 256 MiB
between two /dev/shm files, before every trial). Also reported: the share of what the daemon read that went into its delivery arena (the rest stayed
on its heap because the arena was full; the arena costs the daemon a region per record, or, before
2026-11-26, per request and tensor, so a full arena can make a daemon faster). And the cores the daemon and the writer used over the measured window (their CPU seconds per second): on
a small box the two share the cores, while a GPU worker's copies are the GPU's DMA. A trial counts only if every capture arrived whole:
the daemon's status before and after it must show no position missing and no record that came after
its capture had ended (a daemon far behind its rings ends captures at their END's grace and then
drops their late data: fast, and no ingest). Targets: logits ingest ≥ 50 % of the copy rate;
topk ≥ 5,000 steps/s (a fast GPU decodes ~200–1,000 steps/s).

Also measured in every trial: how fast the daemon answers `status` while it reads at full pace (the
writer waits for room, so the ring is behind all along): a client asks every 20 ms over the measured
window, each question on a new connection as a launcher asks; the p99 of its answers is reported
against the target of 100 ms (the daemon reads a bounded turn, then serves its clients).

The captures sweep: top-k also with `sweep` other numbers of captures decoding at once (16 and 256
by default), so the daemon's CPU per step can be read against a step's rows: what a record costs
whatever its rows is the intercept, what each capture adds the slope (`captures_fit`).
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import numpy as np

from vllm_tap.tools.bench import loadavg, median, proc_cpu_seconds, spread, tree_cpu_seconds

INSTANCE = "ingest"
MiB = 1 << 20
SHAPES = ("logits", "logits-dma", "topk")  # logits-dma: full logits, the writer leaves each payload unwritten
TARGET_COPY_SHARE = 0.5
TARGET_TOPK_STEPS = 5000.0
TARGET_STATUS_P99_S = 0.1
STATUS_EVERY_S = 0.02


class StatusProbe:
    """Asks `status` every STATUS_EVERY_S from a thread of its own and keeps how long each answer took."""

    def __init__(self, status: Callable[[], dict[str, Any]]):
        import threading

        self._status = status
        self._stop = threading.Event()
        self.seconds: list[float] = []
        self.unanswered = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "StatusProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(STATUS_EVERY_S):
            t = time.perf_counter()
            try:
                self._status()
            except Exception:  # noqa: BLE001 - an unanswered question is what this counts
                self.unanswered += 1
                continue
            self.seconds.append(time.perf_counter() - t)

    def p99_ms(self) -> float:
        return float(np.percentile(self.seconds, 99)) * 1e3 if self.seconds else float("nan")


@dataclass
class IngestParams:
    requests: int = 64
    vocab: int = 128256
    topk: int = 20
    steps: dict[str, int] = field(default_factory=lambda: {"logits": 400, "topk": 20000})
    # Unmeasured steps first: the daemon's delivery arena grows to what retention and the captures in
    # flight hold (~1.3 GB of full logits here), reserving and faulting its pages once in its life.
    warm_steps: dict[str, int] = field(default_factory=lambda: {"logits": 160, "topk": 2000})
    # Steps per capture: the requests end and new ones begin every `wave` steps, so what the daemon
    # holds in flight stays bounded (64 x 16 steps of full logits: 262 MB).
    wave: dict[str, int] = field(default_factory=lambda: {"logits": 16, "topk": 1000})
    ring_bytes: int = 256 * MiB
    repeats: int = 3
    copy_bytes: int = 256 * MiB
    sweep: tuple[int, ...] = (16, 256)  # top-k trials with these many captures a step as well

    @classmethod
    def quick(cls) -> "IngestParams":
        return cls(steps={"logits": 48, "topk": 2000}, warm_steps={"logits": 16, "topk": 400}, ring_bytes=64 * MiB,
                   repeats=1, copy_bytes=64 * MiB, sweep=(16,))


def tmpfs_copy_rate(nbytes: int, reps: int = 5) -> float:
    """Bytes/s of a numpy copy from one /dev/shm file's mapping into another's (pages touched first)."""
    d = tempfile.mkdtemp(prefix="vllm-tap-ingest-copy-", dir="/dev/shm")
    maps = []
    try:
        for name in ("a", "b"):
            fd = os.open(os.path.join(d, name), os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, nbytes)
            maps.append(mmap.mmap(fd, nbytes))
            os.close(fd)
        src, dst = (np.frombuffer(m, np.uint8) for m in maps)
        src[:] = 7
        dst[:] = 0
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t)
        del src, dst
        return nbytes / median(times)
    finally:
        for m in maps:
            m.close()
        shutil.rmtree(d, ignore_errors=True)


def _base(shape: str) -> str:
    """The capture a shape writes: logits-dma writes full logits as logits does."""
    return shape.removesuffix("-dma")


def _sections(shape: str, p: IngestParams) -> list[tuple]:
    from vllm_tap import ring_format as rf
    from vllm_tap.ring_records import TensorId

    if _base(shape) == "logits":
        return [(TensorId(rf.TensorKind.LOGITS), rf.DType.BFLOAT16, p.vocab, (0, p.vocab), p.vocab)]
    k = p.topk
    return [(TensorId(rf.TensorKind.TOPK_IDS), rf.DType.INT32, k, (0, k), k),
            (TensorId(rf.TensorKind.TOPK_VALUES), rf.DType.BFLOAT16, k, (0, k), k),
            (TensorId(rf.TensorKind.LOGSUMEXP), rf.DType.FLOAT32, 1, (0, 1), 1)]


def _writer_main(shm: str, shape: str, p_dict: dict, prefix: str, results: Any, close: Any) -> None:
    """Waves of `requests` captures (BEGIN, `wave` decode steps, END) for `warm + steps` steps, as fast as
    the ring allows."""
    from vllm_tap import ring_format as rf
    from vllm_tap.ring_records import RequestRef, RequestTable
    from vllm_tap.ring_files import ring_path
    from vllm_tap.ring_schema import BeginMeta, EndMeta, spec_field
    from vllm_tap.ring_writer import RingWriter
    from vllm_tap.spec import CaptureSpec, LogitsMode, PositionsMode

    p = IngestParams(**p_dict)
    n, prompt, wave = p.requests, 16, p.wave[_base(shape)]
    spec = (CaptureSpec(layers=(), positions=PositionsMode.OUTPUT) if _base(shape) == "logits" else
            CaptureSpec(logits=LogitsMode.TOPK, topk=p.topk, layers=(), positions=PositionsMode.OUTPUT))
    meta = spec_field(spec)
    sections = _sections(shape, p)
    eng = RingWriter(ring_path(shm, INSTANCE, rf.ENGINE_RANK), 16 * MiB, rank=rf.ENGINE_RANK)
    w = RingWriter(ring_path(shm, INSTANCE, 0), p.ring_bytes, block_timeout=60.0)
    rows = np.zeros((3, n), np.int32)
    rows[0] = np.arange(n)
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 1 << 15, (n, sec[2]), dtype=np.int32).astype(rf.storage_dtype(sec[1]))
                for sec in sections]
    sectioned = hasattr(w, "reserve_sections")
    warm, steps = p.warm_steps[_base(shape)], p.steps[_base(shape)]
    # A GPU worker's copy into the ring is the GPU's DMA and costs no core: logits-dma commits each
    # step without writing its payload (the daemon still reads every byte), so the daemon has the
    # cores a writer's copy takes on this box.
    copies = not shape.endswith("-dma")
    stamps = []
    nbytes = sum(x.nbytes for x in payloads)

    def control(rids, meta):
        for rid in rids:
            eng.write_control(rid, meta)
        while not eng.flush():
            time.sleep(0.0005)

    try:
        for k in range(warm + steps):
            j = k % wave
            if j == 0:
                rids = [f"{prefix}-{k // wave}-{i}" for i in range(n)]
                control(rids, BeginMeta(spec=meta, source="client", num_prompt_tokens=prompt,
                                        prompt_token_ids=list(range(3, 3 + prompt)), n=1, model="bench",
                                        async_scheduling=False))
                table = RequestTable([RequestRef(rid, "", prompt, 1, len(sections), prompt - 1, 0, "client")
                                      for rid in rids])
            rows[1] = prompt - 1 + j
            rows[2] = 3 + j
            if sectioned:
                res = w.reserve_sections(table, rows, tuple(sections), step=k + 1)
                if res is not None:
                    buf = np.frombuffer(w.buffer, np.uint8)
                    for (at, nb), x in zip(res.sections, payloads):
                        if copies:
                            buf[at : at + nb] = x.reshape(-1).view(np.uint8)
                    w.commit(res)
            else:  # one record per tensor, as the hook wrote them before sections
                for sec, x in zip(sections, payloads):
                    res = w.reserve_rows(table, rows, sec[0], dtype=sec[1], width=sec[2], slice_=sec[3],
                                         full_dim=sec[4], step=k + 1)
                    if res is not None:
                        res.payload[:] = x.reshape(-1).view(np.uint8)
                        w.commit(res)
            if k == warm:
                results.put({"warm": True})  # the measured steps begin: the parent reads the daemon's CPU
            if k >= warm:
                stamps.append(time.perf_counter())
            if j == wave - 1 or k == warm + steps - 1:
                control(rids, EndMeta(reason="length", num_prompt_tokens=prompt, num_output_tokens=j + 2,
                                      end_position=prompt + j, spec=meta, source="client"))
        results.put({"steps": steps, "t_first": stamps[0], "t_last": stamps[-1], "bytes": nbytes * steps,
                     "dropped": w.stats()["records_dropped"], "sections": sectioned, "ring": w.path})
        close.get(timeout=900)  # alive until the daemon has read it all (a gone writer ends its captures)
    finally:
        w.close()
        eng.close()


def _losses(status: dict[str, Any]) -> dict[str, int]:
    """What the daemon did not deliver whole: positions missing from captures, records that came
    after their capture had ended (a daemon too far behind its rings ends captures at their END's
    grace and then throws their data away, which is fast and is no ingest)."""
    r = status.get("reassembly") or {}
    return {"missing_positions": int(r.get("missing_positions", 0)), "late_records": int(r.get("late_records", 0))}


def _arena(status: dict[str, Any]) -> tuple[int, int]:
    """(regions handed out, arrays kept on the heap because the arena was full or off)."""
    a = status.get("arena") or {}
    return int(a.get("allocations", 0)), int(a.get("fallbacks", 0))


def _trial(shape: str, p: IngestParams, daemon_pid: int, shm: str, tag: str,
           status: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One writer run; the daemon's pace is the measured steps over the time from the first of them
    committed to the daemon having read the last (the ring drained: it bounds the writer's pace
    too, since the writer waits for room)."""
    from vllm_tap.ring_reader import read_info

    ctx = mp.get_context("spawn")
    results, close = ctx.Queue(), ctx.Queue()
    st0 = status()
    lost0, arena0 = _losses(st0), _arena(st0)
    cpu_all = tree_cpu_seconds(daemon_pid)
    proc = ctx.Process(target=_writer_main, args=(shm, shape, asdict(p), tag, results, close))
    proc.start()
    try:
        assert results.get(timeout=900) == {"warm": True}
        cpu0, wcpu0 = tree_cpu_seconds(daemon_pid), proc_cpu_seconds(proc.pid)
        with StatusProbe(lambda: status(timeout=5.0)) as probe:
            got = results.get(timeout=900)
            deadline = time.monotonic() + 600
            while read_info(got["ring"]).backlog_bytes and time.monotonic() < deadline:
                time.sleep(0.001)
        t_end = time.perf_counter()  # CLOCK_MONOTONIC, as the writer's stamps
        cpu = tree_cpu_seconds(daemon_pid) - cpu0
        wcpu = proc_cpu_seconds(proc.pid) - wcpu0  # it waits for `close` once it has written all
    finally:
        close.put(None)
        proc.join(60)
    st1 = status()
    lost = {k: v - lost0[k] for k, v in _losses(st1).items()}
    allocs, fallbacks = (x - y for x, y in zip(_arena(st1), arena0))
    secs = t_end - got["t_first"]
    return {"shape": shape, "steps_per_s": got["steps"] / secs, "gbps": got["bytes"] / secs / 1e9,
            "writer_steps_per_s": got["steps"] / max(got["t_last"] - got["t_first"], 1e-9),
            "daemon_cpu_s_per_gb": cpu / (got["bytes"] / 1e9) if got["bytes"] else float("nan"),
            "daemon_cpu_s_per_kstep": cpu / got["steps"] * 1e3, "dropped": got["dropped"],
            "daemon_cpu_s_warm": cpu0 - cpu_all, **lost,
            # Both processes' CPU over the measured window, in cores: how much of the box they used.
            "daemon_cores": cpu / secs, "writer_cores": wcpu / secs,
            "complete": not any(lost.values()),
            # Where the daemon put what it read: its delivery arena, or the heap when the arena was full.
            "arena_share": allocs / (allocs + fallbacks) if allocs + fallbacks else float("nan"),
            "sections": got["sections"],
            # How long `status` took to answer while the daemon read behind its ring.
            "status_p99_ms": probe.p99_ms(), "status_asked": len(probe.seconds) + probe.unanswered,
            "status_unanswered": probe.unanswered}


def run(p: IngestParams, workdir: str, echo=print) -> dict[str, Any]:
    """Every trial against a daemon of its own, started fresh (what an earlier trial left in the
    daemon, its arena full of retained captures above all, changes what the next one measures)."""
    from vllm_tap.tools.launch import DaemonHandle

    trials: list[dict[str, Any]] = []
    t0, load0 = time.time(), loadavg()
    configs = [(shape, p.requests) for shape in SHAPES] + [("topk", n) for n in p.sweep if n != p.requests]
    for r in range(p.repeats):
        for shape, n in (configs if r % 2 == 0 else configs[::-1]):
            copy = tmpfs_copy_rate(p.copy_bytes)
            shm = tempfile.mkdtemp(prefix="vllm-tap-bench-ingest-", dir="/dev/shm")
            sock = tempfile.mkdtemp(prefix="vti-")
            daemon = DaemonHandle(shm, f"ipc://{sock}/tap.sock", os.path.join(workdir, "ingest-daemon.log"))
            try:
                daemon.start(extra=["--log-level", "WARNING"])
                row = _trial(shape, replace(p, requests=n), daemon.proc.pid, shm, f"r{r}-{shape}-{n}", daemon.status)
            finally:
                daemon.stop()
                shutil.rmtree(shm, ignore_errors=True)
                shutil.rmtree(shm.rstrip("/") + ".arena", ignore_errors=True)  # the daemon's arena, kept for a next run
                shutil.rmtree(sock, ignore_errors=True)
                if daemon.state_dir:
                    shutil.rmtree(daemon.state_dir, ignore_errors=True)
            row.update(repeat=r, copy_gbps=copy / 1e9, share_of_copy=row["gbps"] / (copy / 1e9), requests=n,
                       label=_label(shape, n, p))
            trials.append(row)
            echo(f"  ingest r{r} {row['label']}: {row['steps_per_s']:.0f} steps/s, {row['gbps']:.3f} GB/s "
                 f"({100 * row['share_of_copy']:.0f} % of tmpfs copy {copy / 1e9:.2f} GB/s), daemon "
                 f"{row['daemon_cpu_s_per_gb']:.2f} CPU s/GB (warm-up {row['daemon_cpu_s_warm']:.2f} s), "
                 f"{row['dropped']} dropped, {row['missing_positions']} positions missing, {row['late_records']} late "
                 f"records, {100 * row['arena_share']:.0f} % into the arena, cores used: daemon {row['daemon_cores']:.2f}, writer "
                 f"{row['writer_cores']:.2f} of {os.cpu_count()}; status answered in {row['status_p99_ms']:.1f} ms p99 "
                 f"({row['status_unanswered']} of {row['status_asked']} unanswered)")
    summary = summarise(trials)
    return {"params": asdict(p), "trials": trials, "summary": summary, "captures_fit": captures_fit(summary),
            "loadavg_start": load0, "loadavg_end": loadavg(), "seconds": time.time() - t0}


def _label(shape: str, n: int, p: IngestParams) -> str:
    """A configuration's name: its shape, or for the captures sweep the shape and its captures."""
    return shape if n == p.requests else f"{shape}, {n} captures"


def summarise(trials: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for label in dict.fromkeys(t["label"] for t in trials):
        ts = [t for t in trials if t["label"] == label]
        out[label] = {k: median(t[k] for t in ts) for k in
                      ("steps_per_s", "gbps", "share_of_copy", "copy_gbps", "daemon_cpu_s_per_gb", "daemon_cpu_s_per_kstep",
                       "daemon_cpu_s_warm", "arena_share", "daemon_cores", "writer_cores")}
        out[label]["status_p99_ms"] = max(t.get("status_p99_ms", float("nan")) for t in ts)
        out[label]["status_unanswered"] = sum(t.get("status_unanswered", 0) for t in ts)
        out[label]["steps_range"] = spread(t["steps_per_s"] for t in ts)
        out[label]["dropped"] = sum(t["dropped"] for t in ts)
        out[label]["missing_positions"] = sum(t["missing_positions"] for t in ts)
        out[label]["late_records"] = sum(t["late_records"] for t in ts)
        out[label]["complete"] = all(t["complete"] for t in ts)
        out[label]["sections"] = ts[0]["sections"]
        out[label]["shape"] = ts[0]["shape"]
        out[label]["requests"] = ts[0]["requests"]
    return out


def captures_fit(summary: dict[str, Any]) -> dict[str, float] | None:
    """The daemon's CPU per top-k step against the captures in it, a line through the fewest and
    the most: µs a step whatever its rows (intercept) and µs each capture adds (slope)."""
    pts = sorted((row["requests"], row["daemon_cpu_s_per_kstep"] * 1e3) for row in summary.values()
                 if row["shape"] == "topk")
    if len(pts) < 2 or pts[0][0] == pts[-1][0]:
        return None
    (n0, us0), (n1, us1) = pts[0], pts[-1]
    slope = (us1 - us0) / (n1 - n0)
    return {"us_per_step": us0 - slope * n0, "us_per_capture": slope, "captures": [n for n, _ in pts]}


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of this bench, for the report's table of targets."""
    out = []
    for label, row in res["summary"].items():
        shape = row.get("shape", label)
        if row.get("requests", 64) != res["params"]["requests"]:
            continue  # the captures sweep: no target of its own
        if _base(shape) == "logits":
            who = "" if shape == "logits" else ", the writer's copy left to DMA"
            out.append({"part": "ingest", "target": f"full logits{who}: ≥ {TARGET_COPY_SHARE:.0%} of the tmpfs copy rate",
                        "measured": f"{row['gbps']:.2f} GB/s = {row['share_of_copy']:.0%} of {row['copy_gbps']:.2f}",
                        "met": row["complete"] and row["share_of_copy"] >= TARGET_COPY_SHARE})
        else:
            out.append({"part": "ingest", "target": f"{row.get('requests', 64)} × top-{res['params']['topk']}: ≥ {TARGET_TOPK_STEPS:,.0f} steps/s",
                        "measured": f"{row['steps_per_s']:,.0f} steps/s",
                        "met": row["complete"] and row["steps_per_s"] >= TARGET_TOPK_STEPS})
        out.append({"part": "ingest", "target": f"{label}: status answered within {TARGET_STATUS_P99_S * 1e3:.0f} ms "
                                                "(p99) while the daemon reads behind its ring",
                    "measured": f"{row['status_p99_ms']:.1f} ms p99, {row['status_unanswered']} unanswered",
                    "met": row["status_unanswered"] == 0 and row["status_p99_ms"] <= TARGET_STATUS_P99_S * 1e3})
    return out


def table(res: dict[str, Any]) -> str:
    s = res["summary"]
    lines = ["| shape | records a step | steps/s | GB/s | % of tmpfs copy | daemon CPU s/GB | daemon CPU ms / 1000 steps "
             "| warm-up daemon CPU s | into the arena | cores used: daemon + writer | every capture whole | target | met |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|---|---|"]
    for label, row in s.items():
        shape = row.get("shape", label)
        logits = _base(shape) == "logits"
        swept = row.get("requests", 64) != res["params"]["requests"]
        target = f"≥ {TARGET_COPY_SHARE:.0%} of copy" if logits else f"≥ {TARGET_TOPK_STEPS:.0f} steps/s"
        met = row["complete"] and (row["share_of_copy"] >= TARGET_COPY_SHARE if logits
                                   else row["steps_per_s"] >= TARGET_TOPK_STEPS)
        if swept:
            target = "–"
        whole = ("yes" if row["complete"] else
                 f"**no**: {row['missing_positions']} positions missing, {row['late_records']} late records")
        per_step = "1 (sections)" if row["sections"] else f"{1 if logits else 3} (one per tensor)"
        lo, hi = row["steps_range"]
        lines.append(f"| {label} | {per_step} | {row['steps_per_s']:.0f} ({lo:.0f}–{hi:.0f}) | {row['gbps']:.3f} "
                     f"| {100 * row['share_of_copy']:.0f} % | {row['daemon_cpu_s_per_gb']:.2f} "
                     f"| {row['daemon_cpu_s_per_kstep'] * 1e3:.0f} | {row['daemon_cpu_s_warm']:.2f} | {100 * row['arena_share']:.0f} % | {row['daemon_cores']:.2f} + {row['writer_cores']:.2f} | {whole} | {target} | {'–' if swept else 'met' if met else '**missed**'} |")
    fit = res.get("captures_fit")
    if fit:
        lines += ["", f"The daemon's CPU per top-k step against its captures ({', '.join(map(str, fit['captures']))}): "
                      f"{fit['us_per_step']:.0f} µs a step whatever its rows, and {fit['us_per_capture']:.2f} µs "
                      f"each capture adds."]
    return "\n".join(lines)
