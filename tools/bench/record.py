"""`vllm-tap bench record`: the recorder's sustained write rate against the raw sequential write
bandwidth of the same disk, measured in the same run.

1. Raw disk: `raw_mib` MiB written sequentially in 8 MiB blocks to a file in DIR, fsynced.
2. Recorder: a Recorder (the real one: core, writer threads, Parquet or Arrow IPC, sha256, fsync,
   rename, manifest) on DIR, fed in-process with prepared captures (no daemon, so this is the
   recorder's own ceiling), for a hidden-state-only and a full-logit capture shape and for each
   configuration in `configs`: "format/codec/N" = file format, codec of the float tensor columns
   (Parquet; key columns zstd) or of every buffer (Arrow IPC), and shards encoded at once
   (--parallel-shards); the time includes the final commit. Values are bf16 widened to float32 (what
   a bf16 model's capture holds), random otherwise. Every repeat runs every (case, configuration) in
   an order rotated per repeat, so that the machine's load falls on all of them alike, each right
   after a raw-disk measurement: on a shared (virtual) disk the raw rate swings by up to 2x from one
   minute to the next (200-580 MB/s in one run), so the disk's rate is the median of all those
   measurements of the run, one per recorder run.
Reported: row MB/s (uncompressed tensor bytes taken in and committed), disk MB/s (file bytes out),
rows/s, and row MB/s / the run's raw MB/s against the 70 % target (the recorder's sustained rate as
a share of what the disk takes raw; compression makes the bytes on disk fewer than the rows taken
in); medians over repeats, with the share also as min-max over repeats, and the ratio to the default
configuration within each repeat.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np


@dataclass
class RecordParams:
    dir: str | None = None  # default: a temporary directory under the current one (the disk under test)
    raw_mib: int = 1024
    data_mib: int = 1024  # row data fed per case
    rows_per_capture: int = 256
    hidden: int = 4096
    layers: tuple[int, ...] = (8, 16)
    vocab: int = 32000
    compression: str = "zstd"
    # format/codec/shards at once; the first is the recorder's default
    configs: tuple[str, ...] = ("parquet/zstd/2", "parquet/zstd/1", "parquet/lz4/2", "parquet/none/2", "arrow/zstd/2",
                                "arrow/none/2")
    repeats: int = 3
    cases: list[str] = field(default_factory=lambda: ["hidden", "logits"])
    e2e: bool = True  # also daemon -> watch -> recorder against a watch that only reads

    @classmethod
    def quick(cls) -> "RecordParams":
        return cls(raw_mib=64, data_mib=64, hidden=1024, vocab=8000, repeats=1)


def raw_write_mb_s(path: str, mib: int) -> float:
    block = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, mib // 8)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.unlink(path)
    return max(1, mib // 8) * len(block) / dt / 1e6


def _captures(p: RecordParams, case: str, n: int) -> list[Any]:
    from vllm_tap.client.records import Capture, CaptureBegin

    rng = np.random.default_rng(1)
    T = p.rows_per_capture

    def bf16(shape: tuple[int, ...]) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32)
        return ((x.view(np.uint32) >> 16) << 16).view(np.float32)

    out = []
    pool_h = [bf16((T, p.hidden)) for _ in range(3)]
    pool_l = [bf16((T, p.vocab)) for _ in range(2)] if case == "logits" else []
    for s in range(n):
        hid = {l: pool_h[(s + j) % 3] for j, l in enumerate(p.layers)} if case == "hidden" else {p.layers[-1]: pool_h[s % 3]}
        logits = pool_l[s % 2] if case == "logits" else None
        prompt = [int(t) for t in rng.integers(0, 1000, T // 2)]
        outp = [int(t) for t in rng.integers(0, 1000, T - T // 2 + 1)]
        spec = {"logits": "full" if logits is not None else "none", "layers": list(p.layers), "source": "policy"}
        b = CaptureBegin(f"r{s}", "default", "", (f"r{s}",), f"c{s}", 0, T // 2, prompt, 1, "bench", spec, 0, False)
        c = Capture(f"r{s}", "default", f"c{s}", 0, T // 2, prompt, np.arange(T, dtype=np.int32),
                    np.asarray((prompt + outp)[:T], np.int32), logits, hid, None, None, None, "length", len(outp), outp, [],
                    (0, T))
        out.append((b, c))
    return out


def parse_config(config: str) -> tuple[str, str, int]:
    fmt, codec, n = config.split("/")
    return fmt, codec, int(n)


def run_case(p: RecordParams, case: str, root: str, config: str | None = None) -> dict[str, Any]:
    from vllm_tap.client.datasets.recorder import Recorder, RecordOptions

    caps = _captures(p, case, 8)
    per_cap = caps[0][1].positions.size * (sum(a.shape[1] for a in caps[0][1].hidden.values())
                                           + (p.vocab if case == "logits" else 0)) * 4
    n = max(1, (p.data_mib << 20) // per_cap)
    dest = tempfile.mkdtemp(prefix=f"rec-{case}-", dir=root)
    config = config or p.configs[0]
    fmt, tc, lanes = parse_config(config)
    rec = Recorder(dest, RecordOptions(writer="bench", compression=p.compression if fmt == "parquet" else tc,
                                       tensor_compression=tc, file_format=fmt, parallel_shards=lanes)).open()
    t0 = time.perf_counter()
    for s in range(n):
        b, c = caps[s % len(caps)]
        rec.feed_capture(s, b, c)
    rec.close()
    dt = time.perf_counter() - t0
    assert rec.core is not None
    st = rec.core.stats
    m = rec.core.manifest
    disk = sum(s.bytes + s.captures_bytes for s in m.shards)
    shutil.rmtree(dest, ignore_errors=True)
    return {"case": case, "config": config, "captures": n, "rows": st.rows, "row_bytes": st.tensor_bytes, "file_bytes": disk,
            "seconds": dt, "row_mb_s": st.tensor_bytes / dt / 1e6, "disk_mb_s": disk / dt / 1e6, "rows_s": st.rows / dt,
            "shards": len(m.shards)}


def run(p: RecordParams, echo: Callable[[str], None]) -> dict[str, Any]:
    import pyarrow as pa

    pa.array(np.zeros(1))  # pyarrow imports pandas on its first array (~1 s): not the recorder's rate
    root = p.dir or os.getcwd()
    work = tempfile.mkdtemp(prefix="vllm-tap-bench-record-", dir=root)
    rows: list[dict[str, Any]] = []
    combos = [(case, c) for case in p.cases for c in p.configs]
    try:
        for rep in range(p.repeats):
            k = rep % len(combos)
            for case, cfg in combos[k:] + combos[:k]:
                raw = raw_write_mb_s(os.path.join(work, "raw.bin"), p.raw_mib)
                r = run_case(p, case, work, cfg)
                r["raw_before_mb_s"] = raw
                r["repeat"] = rep
                r["load"] = os.getloadavg()[0]
                rows.append(r)
                echo(f"{case:>7} {cfg:>14}: {r['row_mb_s']:.0f} MB/s of rows in ({r['rows_s']:.0f} rows/s), "
                     f"{r['disk_mb_s']:.0f} MB/s to disk; raw disk just before: {raw:.0f} MB/s; "
                     f"load average {r['load']:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    raw_run = float(np.median([r["raw_before_mb_s"] for r in rows]))
    e2e = None
    if p.e2e:
        work = tempfile.mkdtemp(prefix="vllm-tap-bench-record-", dir=root)
        try:
            e2e = run_e2e(p, work, echo, raw_run)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    for r in rows:
        r["raw_mb_s"] = raw_run
        r["share_of_raw"] = r["row_mb_s"] / raw_run
    echo(f"raw sequential write, median of {len(rows)} measurements: {raw_run:.0f} MB/s "
         f"({min(r['raw_before_mb_s'] for r in rows):.0f}-{max(r['raw_before_mb_s'] for r in rows):.0f})")
    summary = {}
    for case, cfg in combos:
        rs = [r for r in rows if r["case"] == case and r["config"] == cfg]
        base = {r["repeat"]: r["row_mb_s"] for r in rows if r["case"] == case and r["config"] == p.configs[0]}
        summary[f"{case}/{cfg}"] = {k: float(np.median([r[k] for r in rs])) for k in
                                    ("row_mb_s", "disk_mb_s", "rows_s", "raw_mb_s", "share_of_raw", "load")}
        summary[f"{case}/{cfg}"].update(case=case, config=cfg, share_min=min(r["share_of_raw"] for r in rs),
                                        share_max=max(r["share_of_raw"] for r in rs),
                                        file_ratio=float(np.median([r["file_bytes"] / r["row_bytes"] for r in rs])),
                                        to_default=float(np.median([r["row_mb_s"] / base[r["repeat"]] for r in rs])))
    return {"params": {k: v for k, v in vars(p).items()}, "runs": rows, "summary": summary, "target_share_of_raw": 0.7,
            "raw_mb_s": raw_run, "raw_min_mb_s": min(r["raw_before_mb_s"] for r in rows),
            "raw_max_mb_s": max(r["raw_before_mb_s"] for r in rows), "e2e": e2e}


def table(res: dict[str, Any]) -> str:
    lines = [f"Raw sequential write of the disk: {res['raw_mb_s']:.0f} MB/s (median of {len(res['runs'])} "
             f"measurements in this run, {res['raw_min_mb_s']:.0f}-{res['raw_max_mb_s']:.0f}).", "",
             "| capture | format / codec / shards at once | rows in MB/s | rows/s | to disk MB/s | file / rows "
             "| rows in / raw (target >= 70 %), min-max | to the default | load avg |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in res["summary"].values():
        lines.append(f"| {s['case']} | {s['config']} | {s['row_mb_s']:.0f} | {s['rows_s']:.0f} "
                     f"| {s['disk_mb_s']:.0f} | {s['file_ratio']:.2f} "
                     f"| {100 * s['share_of_raw']:.0f} % ({100 * s['share_min']:.0f}-{100 * s['share_max']:.0f} %) "
                     f"| {s['to_default']:.2f}x | {s['load']:.1f} |")
    e = res.get("e2e")
    if e:
        lines += ["", f"End to end (writer process -> daemon -> watch, {e['captures']} full-logit captures of "
                  f"{e['rows_per_capture']} x {e['vocab']}):", "",
                  "| consumer | writer | MB/s of rows | captures | lost | done after the writer, s |",
                  "|---|---|---|---|---|---|"]
        for mode in E2E_MODES:
            m = e.get(mode)
            if m is None:
                continue
            writer = f"paced at {m['writer_mb_s']:.0f} MB/s" if m.get("writer_mb_s") else "flat out"
            lag = f"{m['lag_s']:.2f}" if m.get("lag_s") is not None else "-"
            lines.append(f"| {mode} | {writer} | {m['mb_s']:.0f} | {m['captures']} | {m['lost']} | {lag} |")
    return "\n".join(lines)


# -- end to end: a writer process -> daemon -> watch -> recorder, against a watch that only reads --

PACED_MODE = "recorder (default), writer paced"

# consumer -> the recorder's configuration, format/codec/shards at once (None: a watch that only reads)
E2E_MODES: dict[str, str | None] = {"watch only": None, "recorder (default)": "parquet/zstd/2",
                                    "recorder, one shard at once": "parquet/zstd/1", "recorder, Arrow IPC": "arrow/none/2",
                                    PACED_MODE: "parquet/zstd/2"}
# Flat out, the writer and the daemon deliver more than this disk takes (so no recorder could keep
# up); paced at a share of the run's raw disk rate, the question is whether the recorder keeps up
# with a daemon that delivers less than the disk's bandwidth: its rate equals the writer's, nothing
# lost, and it finishes right after the writer (lag).
PACE_SHARE_OF_RAW = 0.3


def _e2e_writer(shm: str, n_caps: int, rows: int, width: int, start: Any, done: Any,
                pace_mb_s: float | None = None, finished_at: Any = None) -> None:
    """Full-logit captures of `rows` positions, written as fast as the ring takes them (it waits), or
    at `pace_mb_s` MB/s of rows."""
    from vllm_tap import ring_format as rf
    from vllm_tap.ring_records import TensorId
    from vllm_tap.ring_files import ring_path
    from vllm_tap.ring_schema import BeginMeta, EndMeta, spec_field
    from vllm_tap.ring_writer import RingWriter
    from vllm_tap.spec import CaptureSpec

    logits = TensorId(rf.TensorKind.LOGITS)
    eng = RingWriter(ring_path(shm, "bench", rf.ENGINE_RANK), 4 << 20, rank=rf.ENGINE_RANK)
    w = RingWriter(ring_path(shm, "bench", 0), 256 << 20, block_timeout=120.0)
    x = np.random.default_rng(2).standard_normal((rows, width), dtype=np.float32)
    x = ((x.view(np.uint32) >> 16) << 16).view(np.float32)  # bf16 values, as most models compute
    spec = spec_field(CaptureSpec())
    start.wait()
    t0 = time.perf_counter()
    for c in range(n_caps):
        if pace_mb_s:
            ahead = c * rows * width * 4 / (pace_mb_s * 1e6) - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
        name = f"e2e-{os.getpid()}-{c}"
        eng.write_control(name, BeginMeta(spec=spec, num_prompt_tokens=rows // 2, n=1, model="bench",
                                          prompt_token_ids=list(range(rows // 2))))
        for k in range(0, rows, 64):  # chunks of 64 positions, like prefill steps
            pos = np.arange(k, min(k + 64, rows), dtype=np.int32)
            w.write(name, logits, pos, pos % 1000, x[pos], step=c * 1000 + k // 64 + 1, num_prompt_tokens=rows // 2)
        eng.write_control(name, EndMeta(reason="length", num_prompt_tokens=rows // 2,
                                        num_output_tokens=rows - rows // 2 + 1,
                                        output_token_ids=list(range(rows - rows // 2 + 1)), end_position=rows))
    while not eng.flush():
        time.sleep(0.001)
    if finished_at is not None:
        finished_at.value = time.time()
    done.set()
    time.sleep(1.0)
    w.close()
    eng.close()


def run_e2e(p: RecordParams, root: str, echo: Callable[[str], None], raw_mb_s: float | None = None) -> dict[str, Any]:
    import multiprocessing as mp

    from vllm_tap.client import Client, LostCaptures, WatchedCapture
    from vllm_tap.client.datasets.recorder import Recorder, RecordOptions
    from vllm_tap.tools.launch import DaemonHandle

    rows, width = p.rows_per_capture, p.vocab
    n_caps = max(4, (p.data_mib << 20) // (rows * width * 4))
    pace = PACE_SHARE_OF_RAW * raw_mb_s if raw_mb_s else None
    out: dict[str, Any] = {"captures": n_caps, "rows_per_capture": rows, "vocab": width, "pace_mb_s": pace}
    for mode in E2E_MODES:
        if mode == PACED_MODE and not pace:
            continue
        shm = tempfile.mkdtemp(prefix="vt-bench-rec-", dir="/dev/shm")
        tmp = tempfile.mkdtemp(prefix="vt-")  # short: ipc socket paths are limited to ~107 bytes
        daemon = DaemonHandle(shm, f"ipc://{tmp}/d.sock", os.path.join(tmp, "daemon.log"),
                              state_dir=os.path.join(tmp, "state")).start(extra=["--retain-bytes", str(1 << 30)])
        ctx = mp.get_context("spawn")
        start, done, finished_at = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
        proc = ctx.Process(target=_e2e_writer, args=(shm, n_caps, rows, width, start, done,
                                                     pace if mode == PACED_MODE else None, finished_at))
        proc.start()
        client = Client(daemon.endpoint)
        # from the newest seq now: a watch is sent on its first read, after the writer has started
        since = max(0, int(client.status(timeout=5.0)["sequence"]["next"]) - 1)
        watch = client.watch(since, whole=True, watermarks=True, timeout=120.0)
        rec = None
        if E2E_MODES[mode]:
            fmt, tc, lanes = parse_config(E2E_MODES[mode])  # type: ignore[arg-type]
            rec = Recorder(tempfile.mkdtemp(prefix="ds-", dir=root), RecordOptions(
                writer="bench", file_format=fmt, compression=p.compression if fmt == "parquet" else tc,
                tensor_compression=tc, parallel_shards=lanes)).open()
        got = lost = nbytes = 0
        t0 = None
        try:
            time.sleep(0.5)
            start.set()
            for item in watch:
                if isinstance(item, LostCaptures):
                    lost += len(item)
                    if rec is not None:
                        rec.feed_lost(item.first, item.last, item.reason)
                elif isinstance(item, WatchedCapture):
                    t0 = t0 or time.perf_counter()
                    got += 1
                    nbytes += item.capture.logits.nbytes
                    if rec is not None:
                        rec.feed_capture(item.seq, item.begin, item.capture)
                if got + lost >= n_caps:
                    break
            if rec is not None:
                rec.close()
            closed_at = time.time()
            dt = time.perf_counter() - (t0 or time.perf_counter())
        finally:
            watch.close()
            proc.join(60)
            daemon.stop()
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(shm.rstrip("/") + ".arena", ignore_errors=True)  # the daemon's arena, kept for a next run
            shutil.rmtree(tmp, ignore_errors=True)
        # lag: from the writer's last commit to the recorder's last manifest (or the watch's last capture)
        lag = closed_at - finished_at.value if finished_at.value else None
        out[mode] = {"mb_s": nbytes / max(dt, 1e-9) / 1e6, "captures": got, "lost": lost, "lag_s": lag,
                     "writer_mb_s": pace if mode == PACED_MODE else None}
        echo(f"end to end, {mode}: {out[mode]['mb_s']:.0f} MB/s of rows, {got} captures, {lost} lost, "
             f"done {lag if lag is not None else float('nan'):.2f} s after the writer"
             + (f" (writer paced at {pace:.0f} MB/s)" if mode == PACED_MODE else ""))
    return out
