"""`vllm-tap bench record`: the recorder's sustained write rate against the raw sequential write
bandwidth of the same disk, measured in the same run.

1. Raw disk: `raw_mib` MiB written sequentially in 8 MiB blocks to a file in DIR, fsynced.
2. Recorder: a Recorder (the real one: core, writer thread, Parquet zstd, sha256, fsync, rename,
   manifest) on DIR, fed in-process with prepared captures (no daemon, so this is the recorder's own
   ceiling), for a hidden-state-only and a full-logit capture shape; the time includes the final
   commit. Values are bf16 widened to float32 (what a bf16 model's capture holds), random otherwise.
Reported: row MB/s (uncompressed tensor bytes taken in and committed), disk MB/s (file bytes out),
rows/s, and row MB/s / raw MB/s against the 70 % target (the recorder's sustained rate as a share
of what the disk takes raw; zstd makes the bytes on disk fewer than the rows taken in).
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
    file_format: str = "parquet"
    repeats: int = 2
    cases: list[str] = field(default_factory=lambda: ["hidden", "logits"])

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


def run_case(p: RecordParams, case: str, root: str) -> dict[str, Any]:
    from vllm_tap.client.record import Recorder, RecordOptions

    caps = _captures(p, case, 8)
    per_cap = caps[0][1].positions.size * (sum(a.shape[1] for a in caps[0][1].hidden.values())
                                           + (p.vocab if case == "logits" else 0)) * 4
    n = max(1, (p.data_mib << 20) // per_cap)
    dest = tempfile.mkdtemp(prefix=f"rec-{case}-", dir=root)
    rec = Recorder(dest, RecordOptions(writer="bench", compression=p.compression, file_format=p.file_format)).open()
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
    return {"case": case, "captures": n, "rows": st.rows, "row_bytes": st.tensor_bytes, "file_bytes": disk,
            "seconds": dt, "row_mb_s": st.tensor_bytes / dt / 1e6, "disk_mb_s": disk / dt / 1e6, "rows_s": st.rows / dt,
            "shards": len(m.shards)}


def run(p: RecordParams, echo: Callable[[str], None]) -> dict[str, Any]:
    root = p.dir or os.getcwd()
    work = tempfile.mkdtemp(prefix="vllm-tap-bench-record-", dir=root)
    rows: list[dict[str, Any]] = []
    try:
        for rep in range(p.repeats):
            raw = raw_write_mb_s(os.path.join(work, "raw.bin"), p.raw_mib)
            echo(f"raw sequential write: {raw:.0f} MB/s")
            for case in p.cases:
                r = run_case(p, case, work)
                r["raw_mb_s"] = raw
                r["share_of_raw"] = r["row_mb_s"] / raw
                r["repeat"] = rep
                rows.append(r)
                echo(f"{case:>7}: {r['row_mb_s']:.0f} MB/s of rows in ({r['rows_s']:.0f} rows/s), "
                     f"{r['disk_mb_s']:.0f} MB/s to disk; rows in = {100 * r['share_of_raw']:.0f} % of raw")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for case in p.cases:
        rs = [r for r in rows if r["case"] == case]
        summary[case] = {k: float(np.median([r[k] for r in rs])) for k in
                         ("row_mb_s", "disk_mb_s", "rows_s", "raw_mb_s", "share_of_raw")}
    return {"params": {k: v for k, v in vars(p).items()}, "runs": rows, "summary": summary, "target_share_of_raw": 0.7}


def table(res: dict[str, Any]) -> str:
    lines = ["| capture | rows in MB/s | rows/s | to disk MB/s | raw disk MB/s | rows in / raw (target >= 70 %) |",
             "|---|---|---|---|---|---|"]
    for case, s in res["summary"].items():
        lines.append(f"| {case} | {s['row_mb_s']:.0f} | {s['rows_s']:.0f} | {s['disk_mb_s']:.0f} | {s['raw_mb_s']:.0f} "
                     f"| {100 * s['share_of_raw']:.0f} % |")
    return "\n".join(lines)
