"""The hook's host cost per capturing decode step, with tensors so small that kernels cost almost
nothing: what is left is the step thread's Python and torch dispatch, which on a GPU is throughput
lost (a decode step there lasts 2-6 ms; no CPU serving benchmark can show it).

`CaptureCore.capture` is driven as on a GPU worker: the staged publisher (gathers into staging,
one device-to-host copy and one event per record; the HostBackend's publisher thread stands in for
the copy stream), the real RingWriter, token ids as a tensor (as they live on the device), bf16,
vocabulary 64, hidden 32, every request capturing, decode steps of an unchanged batch of 8, 32 and
128 requests, for three specs: full logits + 2 layers, top-20, and 2 layers only. A RingReader
drains the ring every 20 steps, outside the timing. Per spec and batch:

- host µs: the median wall time inside `capture` over the measured steps;
- top-k µs (top-20): the median time spent inside torch.topk in those steps (timed around the
  call the hook makes), its own kernel, which the target allows beside the hook's 30 µs;
- torch calls: the aten ops the step thread issues in one steady step (a TorchDispatchMode; what
  the targets count), and beside them the record's device-to-host copies (here the publisher
  thread runs them; a CUDA step thread issues each as one more call);
- the publisher thread's CPU per step.

Before/after in one run: `--against REV` also measures the code of a git revision of this checkout
(a temporary worktree), each version in its own interpreter, interleaved repeat by repeat.
Targets: host ≤ 30 µs (top-20: ≤ 30 µs + its top-k), step-thread torch calls ≤ 6 (full + 2 layers,
layers only) and ≤ 8 (top-20), the same at every batch size.

This file also runs as a script (the child a version is measured in): it imports only what every
version of the hook has, so an older checkout's package can stand behind it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

TARGET_US = 30.0
TARGET_CALLS = {"full+2 layers": 6, "top-20": 8, "layers only": 6}
SPECS = tuple(TARGET_CALLS)
VOCAB, HIDDEN, LAYERS, TOPK = 64, 32, (2, 5), 20


@dataclass
class HostParams:
    batches: list[int] = field(default_factory=lambda: [8, 32, 128])
    specs: list[str] = field(default_factory=lambda: list(SPECS))
    steps: int = 300
    warmup: int = 80  # past the first lap of a steady record's staging blocks
    repeats: int = 3
    against: list[str] = field(default_factory=list)  # git revisions measured beside this checkout

    @classmethod
    def quick(cls) -> "HostParams":
        return cls(batches=[8, 32], steps=60, warmup=70, repeats=1)


# -- the child: one version, every spec and batch --------------------------------------------------


def _spec(name: str):
    from vllm_tap.spec import CaptureSpec, LogitsMode, PositionsMode

    return {"full+2 layers": CaptureSpec(layers=LAYERS),
            "top-20": CaptureSpec(logits=LogitsMode.TOPK, topk=TOPK, layers=(), positions=PositionsMode.OUTPUT),
            "layers only": CaptureSpec(logits=LogitsMode.NONE, layers=LAYERS)}[name]


def measure(spec_name: str, batch: int, steps: int, warmup: int, shm: str) -> dict[str, Any]:
    import numpy as np
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_tap.hooks.capture_core import CaptureCore, RankPlace, StepView
    from vllm_tap.hooks.publisher import HostBackend, StagedPublisher, staging_bytes
    from vllm_tap.hooks.settings import SPEC_EXTRA_ARG
    from vllm_tap.ring_reader import RingReader
    from vllm_tap.ring_writer import RingWriter

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    class Copies(HostBackend):
        n = 0

        def copy_after_compute(self, pairs):
            Copies.n += len(pairs)
            return super().copy_after_compute(pairs)

    g = torch.Generator().manual_seed(batch)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).bfloat16()
    hidden = torch.randn(batch, HIDDEN, generator=g).bfloat16()
    aux = [torch.randn(batch, HIDDEN, generator=g).bfloat16() for _ in LAYERS]
    logits = hidden @ weight.T
    ids = torch.randint(3, VOCAB, (batch,), dtype=torch.int32, generator=g)
    qsl = np.arange(batch + 1, dtype=np.int32)
    ring_bytes = 64 << 20
    writer = RingWriter(os.path.join(shm, f"{spec_name.replace(' ', '_')}-{batch}", "rank-00000.ring"), ring_bytes,
                        wake_daemon=False)
    backend = Copies()
    pub = StagedPublisher(writer, backend, staging_bytes(ring_bytes))
    core = CaptureCore(writer, RankPlace(stage_layers=(LAYERS,)), pub, model_dtype=torch.bfloat16)
    rids = [f"req-{i:04d}" for i in range(batch)]
    extra = {SPEC_EXTRA_ARG: _spec(spec_name).to_meta()}
    for rid in rids:
        core.learn(rid, extra, 4096)
    computed = np.full(batch, 4096, np.int32)
    view = StepView(rids, qsl, computed, ids, hidden, aux, logits, lambda h: h @ weight.T,
                    row_of={r: i for i, r in enumerate(rids)})
    reader = RingReader(writer.path)
    host, topk = [], []
    perf = time.perf_counter_ns
    inside = [0]
    real_topk = torch.topk

    def timed_topk(*a, **kw):
        t = perf()
        try:
            return real_topk(*a, **kw)
        finally:
            inside[0] += perf() - t

    if spec_name == "top-20":
        torch.topk = timed_topk
    try:
        for k in range(warmup + steps):
            inside[0] = 0
            t0 = perf()
            core.capture(view)
            host.append(perf() - t0)
            topk.append(inside[0])
            computed += 1
            if k % 20 == 19:
                pub.drain()
                while reader.poll():
                    pass
        torch.topk = real_topk
        thread_ns0, copies0 = getattr(pub, "thread_ns", 0), Copies.n
        with Ops() as ops:
            core.capture(view)
        copies = Copies.n - copies0
        pub.drain()
        dropped = writer.stats()["records_dropped"] + getattr(pub, "staging_drops", 0)
        thread_us = (getattr(pub, "thread_ns", 0) - thread_ns0) / 1e3
    finally:
        torch.topk = real_topk
        reader.close()
        core.close()
        writer.close(unlink=True)
    host, topk = host[warmup:], topk[warmup:]
    return {"spec": spec_name, "batch": batch, "host_us": _median(host) / 1e3, "host_p90_us": _pct(host, 90) / 1e3,
            "topk_us": _median(topk) / 1e3, "step_ops": ops.n, "copies": copies,
            "calls": ops.n + copies, "dropped": dropped, "thread_us_last": thread_us,
            "thread_us_per_step": getattr(pub, "thread_ns", 0) / 1e3 / (warmup + steps + 1)}


def _median(xs: list[int]) -> float:
    s = sorted(xs)
    return float(s[len(s) // 2]) if s else float("nan")


def _pct(xs: list[int], q: float) -> float:
    s = sorted(xs)
    return float(s[min(len(s) - 1, int(len(s) * q / 100))]) if s else float("nan")


def _child(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    p = json.loads(argv[0])
    shm = tempfile.mkdtemp(prefix="vllm-tap-bench-host-", dir="/dev/shm")
    try:
        rows = []
        specs = p["specs"][p["rotate"] % len(p["specs"]):] + p["specs"][: p["rotate"] % len(p["specs"])]
        for name in specs:
            for b in p["batches"]:
                rows.append(measure(name, b, p["steps"], p["warmup"], shm))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    json.dump(rows, sys.stdout)


# -- the parent: versions, repeats, summary ------------------------------------------------------


def run(params: HostParams, echo=print) -> dict[str, Any]:
    from vllm_tap.tools.bench.versions import Versions

    t_start = time.time()
    trials: list[dict[str, Any]] = []
    with Versions(params.against) as versions:
        for r in range(params.repeats):
            for label, path in versions.rotated(r):
                arg = json.dumps({**asdict(params), "rotate": r})
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", arg],
                                     env=Versions.env(path), cwd=tempfile.gettempdir(), capture_output=True, text=True,
                                     timeout=1800)
                if out.returncode != 0:
                    raise RuntimeError(f"the host-only hook scenario of {label} failed:\n{out.stderr[-3000:]}")
                for row in json.loads(out.stdout):
                    trials.append({**row, "version": label, "repeat": r})
            echo(f"  host-only r{r}: " + ", ".join(
                f"{t['version']} {t['spec']}@{t['batch']} {t['host_us']:.0f} us/{t['calls']} calls"
                for t in trials if t["repeat"] == r and t["batch"] == params.batches[0]))
        labels = [v for v, _ in versions.items]
    return {"params": asdict(params), "versions": labels, "trials": trials,
            "summary": summarise(trials, params, labels), "seconds": time.time() - t_start}


def summarise(trials: list[dict[str, Any]], params: HostParams, versions: list[str]) -> list[dict[str, Any]]:
    from vllm_tap.tools.bench import median, spread

    rows = []
    for v in versions:
        for spec in params.specs:
            calls_by_batch = set()
            for b in params.batches:
                ts = [t for t in trials if t["version"] == v and t["spec"] == spec and t["batch"] == b]
                if not ts:
                    continue
                host, topk = median(t["host_us"] for t in ts), median(t["topk_us"] for t in ts)
                calls = max(t["calls"] for t in ts)
                calls_by_batch.add(calls)
                rows.append({"version": v, "spec": spec, "batch": b, "host_us": host,
                             "host_range_us": spread(t["host_us"] for t in ts), "topk_us": topk,
                             "host_less_topk_us": host - topk, "calls": calls,
                             "step_ops": max(t["step_ops"] for t in ts), "copies": max(t["copies"] for t in ts),
                             "thread_us_per_step": median(t["thread_us_per_step"] for t in ts),
                             "dropped": max(t["dropped"] for t in ts),
                             "met_us": host - topk <= TARGET_US,
                             "met_calls": max(t["step_ops"] for t in ts) <= TARGET_CALLS[spec]})
            for row in rows:
                if row["version"] == v and row["spec"] == spec:
                    row["calls_constant"] = len(calls_by_batch) == 1
    return rows


def table(res: dict[str, Any]) -> list[str]:
    versions = res["versions"]
    lines = ["## Hook host cost per decode step (host-only scenario)", "",
             "Tiny tensors (vocabulary 64, hidden 32, bf16), so kernels cost almost nothing: what is measured is the step "
             "thread's Python and torch dispatch. Staged publisher (the GPU path, its copy stream played by the publisher "
             "thread), token ids as a tensor, every request capturing, decode steps of an unchanged batch. Medians over "
             f"{res['params']['steps']} steps × {res['params']['repeats']} repeats (range over repeats); each version in "
             "its own interpreter, interleaved. torch calls: aten ops on the step thread (what the targets count) + the "
             "record's device-to-host copies (run by the publisher thread here; a CUDA step thread issues each as one "
             "more call). Targets: host (less top-20's own top-k) ≤ 30 µs; step-thread calls ≤ 6 (≤ 8 top-20), the same "
             "at every batch.",
             "", "| version | spec | batch | host µs (range) | top-k µs | host − top-k µs | torch calls (step ops + copies) "
             "| publisher thread µs/step | target |", "|---|---|--:|--:|--:|--:|--:|--:|---|"]
    for row in res["summary"]:
        lo, hi = row["host_range_us"]
        ok = row["met_us"] and row["met_calls"] and row.get("calls_constant", True)
        lines.append(f"| {row['version']} | {row['spec']} | {row['batch']} | {row['host_us']:.0f} ({lo:.0f}–{hi:.0f}) "
                     f"| {row['topk_us']:.0f} | {row['host_less_topk_us']:.0f} | {row['calls']} "
                     f"({row['step_ops']} + {row['copies']}) | {row['thread_us_per_step']:.1f} "
                     f"| {'met' if ok else 'missed'} |")
    if len(versions) > 1:
        lines += ["", "Ratio of host µs, " + " ÷ ".join(versions[1:]) + " over " + versions[0] + ":", ""]
        for row in res["summary"]:
            if row["version"] != versions[0]:
                continue
            others = [o for o in res["summary"] if o["spec"] == row["spec"] and o["batch"] == row["batch"]
                      and o["version"] != versions[0]]
            lines.append(f"- {row['spec']} @ {row['batch']}: " + ", ".join(
                f"{o['version']} {o['host_us']:.0f} µs → {row['host_us']:.0f} µs ({row['host_us'] / o['host_us']:.2f}×); "
                f"calls {o['calls']} → {row['calls']}" for o in others))
    return lines + [""]


def plot(plt: Any, res: dict[str, Any], outdir: str) -> str | None:
    rows = res["summary"]
    if not rows:
        return None
    versions, specs, batches = res["versions"], res["params"]["specs"], res["params"]["batches"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [f"{s}\n@{b}" for s in specs for b in batches]
    width = 0.8 / len(versions)
    for i, v in enumerate(versions):
        got = {(r["spec"], r["batch"]): r for r in rows if r["version"] == v}
        xs = [j + i * width for j in range(len(labels))]
        host = [got.get((s, b), {}).get("host_us", 0) for s in specs for b in batches]
        topk = [got.get((s, b), {}).get("topk_us", 0) for s in specs for b in batches]
        axes[0].bar(xs, [h - t for h, t in zip(host, topk)], width, label=f"{v}: hook")
        axes[0].bar(xs, topk, width, bottom=[h - t for h, t in zip(host, topk)], alpha=0.4, label=f"{v}: its top-k kernel")
        axes[1].bar(xs, [got.get((s, b), {}).get("calls", 0) for s in specs for b in batches], width, label=v)
    for ax, title, target in ((axes[0], "host µs per capturing decode step", TARGET_US),
                              (axes[1], "torch calls per step (ops + copies)", None)):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_title(title)
        if target:
            ax.axhline(target, color="red", ls="--", lw=1, label=f"target {target:.0f} µs")
        ax.legend(fontsize=7)
    from vllm_tap.tools.bench import save_figure

    return save_figure(plt, fig, outdir, "hook_host.png")


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--child":
    _child(sys.argv[2:])
