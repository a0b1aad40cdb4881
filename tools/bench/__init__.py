"""`vllm-tap bench`: serving overhead, hook cost against memcpy, and transport latency/throughput.

A benchmark, not a test: it measures, writes `results.md`, `results.json` and PNG plots to a
results folder, and says which targets were met. Every part interleaves its configurations
(A B C A B C ...) over several repeats and reports medians, and ratios within a repeat, because the
machines it runs on are shared and noisy. Only the parts that need torch or vLLM import them
(serving starts vLLM as subprocesses; the hook-cost part imports torch in-process).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from typing import Any, Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    k = (len(xs) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


def median(values: Iterable[float]) -> float:
    xs = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(statistics.median(xs)) if xs else math.nan


def spread(values: Iterable[float]) -> tuple[float, float]:
    xs = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return (min(xs), max(xs)) if xs else (math.nan, math.nan)


def save_figure(plt: Any, fig: Any, outdir: str, name: str) -> str:
    """Lay out, write <outdir>/<name> and close a matplotlib figure; its path."""
    fig.tight_layout()
    path = os.path.join(outdir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def loadavg() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (math.nan, math.nan, math.nan)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on, including how busy the machine was."""
    info: dict[str, Any] = {
        "host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "cpus": os.cpu_count(), "loadavg_start": loadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    info["mem_gib"] = round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    gpu = _gpu_name()
    if gpu:
        info["gpu"] = gpu
    return info


def _gpu_name() -> str:
    """The first NVIDIA card's name (nvidia-smi), "" without one: no torch import for it."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return ""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""


def _cpu_ticks(pid: int, fields: slice) -> int:
    """Sum of the clock ticks in /proc/<pid>/stat fields (after the command name): 11:13 its own
    user+system, 11:15 with its waited-for children's. OSError, IndexError or ValueError when gone."""
    with open(f"/proc/{pid}/stat") as f:
        return sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[fields])


def proc_cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of one process (0 if it is gone)."""
    try:
        return _cpu_ticks(pid, slice(11, 13)) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def tree_cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of a process, its children that ended (waited for) and its live
    descendants: a daemon's work includes what its helper processes do."""
    total = 0.0
    try:
        total = _cpu_ticks(pid, slice(11, 15)) / os.sysconf("SC_CLK_TCK")
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                total += sum(tree_cpu_seconds(int(c)) for c in f.read().split())
    except (OSError, IndexError, ValueError):
        pass
    return total


def group_pids(pgid: int) -> list[int]:
    """Pids of the processes in process group pgid (a vLLM server and its engine/workers)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                out.append(int(name))
        except (OSError, IndexError, ValueError):
            continue
    return out
