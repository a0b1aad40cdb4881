"""What a reducer costs the hook and what it saves: a 16k-latent SAE at top-64 on one layer against
capturing that layer itself.

The real capture core runs in-process with torch alone (no vLLM), driven as a GPU worker drives it:
the staged publisher (its copy stream played by the publisher thread), token ids as a tensor, bf16
layers, every request capturing, decode steps of an unchanged batch (the steady step), one torch
thread. Two scenarios, interleaved repeat by repeat:

    layer   the request captures the layer's hidden states (as the model computes them, bf16)
    sae     the request asks only the SAE (tap_reducers): a standard SAE of `latents` latents on that
            layer, top-`k` latents per token (int32 ids + float32 values)

Measured per scenario:
- bytes per token: what the steps wrote into the ring (records whole: headers, request tables,
  positions, token ids, payloads) over the rows they carried, at a real hidden size (`hidden`,
  4096 by default);
- host µs per step: the median wall time inside `capture`, at hidden 32 as in the host-only hook
  scenario (hook_host.py), so that copies cost almost nothing; for the SAE, beside it, the time
  inside the reducer's math: its matmul over the latents and its top-k are real kernels on this
  CPU (on a GPU they are kernels on the compute stream, which the step thread only launches);
- torch calls on the step thread in one steady step (a TorchDispatchMode), and whether they are
  the same at every batch size;
- records dropped (none expected).

Targets: the SAE's bytes per token at most 1/8 of the layer's; its step-thread calls the same at
every batch; nothing dropped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

BYTES_TARGET = 1 / 8  # the SAE's bytes per token against the layer's, at most
LAYER = 2


@dataclass
class ReducerParams:
    batches: list[int] = field(default_factory=lambda: [8, 32, 128])
    hidden: int = 4096  # for bytes per token
    host_hidden: int = 32  # for host µs (copies cost almost nothing)
    latents: int = 16384
    k: int = 64
    steps: int = 60
    warmup: int = 70  # past the first lap of a steady record's staging blocks
    byte_steps: int = 6
    repeats: int = 3

    @classmethod
    def quick(cls) -> "ReducerParams":
        return cls(batches=[8, 32], latents=4096, steps=10, warmup=66, byte_steps=3, repeats=1)


def _weights(hidden: int, latents: int, k: int):
    """A standard SAE of random weights, as hooks/reducer_files.py loads one (in memory: no file)."""
    import torch

    from vllm_tap.hooks.reducer_files import ReducerWeights
    from vllm_tap.reducers import ReducerDecl

    g = torch.Generator().manual_seed(0)
    w = torch.randn(hidden, latents, generator=g) / hidden ** 0.5
    c = torch.randn(latents, generator=g) * 0.1
    return ReducerWeights(ReducerDecl("sae", "saelens", LAYER, "/bench", k=k), k, [(w, c)], d_sae=latents)


def measure(what: str, batch: int, hidden: int, p: ReducerParams, shm: str, steps: int, warmup: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_tap.hooks.capture_core import CaptureCore, RankPlace, StepView
    from vllm_tap.hooks.publisher import HostBackend, StagedPublisher, staging_bytes
    from vllm_tap.hooks.reducer_ops import DeviceReducer
    from vllm_tap.hooks.settings import SPEC_EXTRA_ARG
    from vllm_tap.ring_reader import RingReader
    from vllm_tap.ring_writer import RingWriter
    from vllm_tap.spec import CaptureSpec, LogitsMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    reducers = {}
    if what == "sae":
        reducers["sae"] = DeviceReducer(_weights(hidden, p.latents, p.k), "cpu", max(p.batches))
        spec = CaptureSpec(logits=LogitsMode.NONE, layers=(), reducers=("sae",))
    else:
        spec = CaptureSpec(logits=LogitsMode.NONE, layers=(LAYER,))
    g = torch.Generator().manual_seed(batch)
    aux = [torch.randn(batch, hidden, generator=g).bfloat16()]
    ids = torch.randint(3, 1000, (batch,), dtype=torch.int32, generator=g)
    qsl = np.arange(batch + 1, dtype=np.int32)
    ring_bytes = 256 << 20
    writer = RingWriter(os.path.join(shm, f"{what}-{batch}-{hidden}", "rank-00000.ring"), ring_bytes, wake_daemon=False)
    pub = StagedPublisher(writer, HostBackend(), staging_bytes(ring_bytes))
    core = CaptureCore(writer, RankPlace(stage_layers=((LAYER,),)), pub, model_dtype=torch.bfloat16, reducers=reducers)
    rids = [f"req-{i:04d}" for i in range(batch)]
    for rid in rids:
        core.learn(rid, {SPEC_EXTRA_ARG: spec.to_meta()}, 4096)
    computed = np.full(batch, 4096, np.int32)
    view = StepView(rids, qsl, computed, ids, aux[0], aux, None, lambda h: h, row_of={r: i for i, r in enumerate(rids)})
    reader = RingReader(writer.path)
    perf = time.perf_counter_ns
    inside = [0]
    red = reducers.get("sae")
    if red is not None:
        real_pass = red._pass

        def timed_pass(*a, **kw):
            t = perf()
            try:
                return real_pass(*a, **kw)
            finally:
                inside[0] += perf() - t

        red._pass = timed_pass  # type: ignore[method-assign]
    host, math = [], []
    try:
        for k in range(warmup + steps):
            if k == warmup:
                pub.drain()
                written0 = writer.stats()["bytes_written"]
            inside[0] = 0
            t0 = perf()
            core.capture(view)
            host.append(perf() - t0)
            math.append(inside[0])
            computed += 1
            if k % 20 == 19:
                pub.drain()
                while reader.poll():
                    pass
        pub.drain()
        written = writer.stats()["bytes_written"] - written0
        with Ops() as ops:
            core.capture(view)
        pub.drain()
        dropped = writer.stats()["records_dropped"] + pub.staging_drops
        steady = core.steady_steps
    finally:
        reader.close()
        core.close()
        writer.close(unlink=True)
    host, math = sorted(host[warmup:]), sorted(math[warmup:])
    return {"what": what, "batch": batch, "hidden": hidden, "host_us": host[len(host) // 2] / 1e3,
            "math_us": math[len(math) // 2] / 1e3, "bytes_per_token": written / (steps * batch), "calls": ops.n,
            "dropped": dropped, "steady": steady >= warmup + steps - 1}


def run(params: ReducerParams, echo=print) -> dict[str, Any]:
    import torch

    t_start = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    shm = tempfile.mkdtemp(prefix="vllm-tap-bench-reducer-", dir="/dev/shm")
    trials: list[dict[str, Any]] = []
    try:
        for r in range(params.repeats):
            order = ("layer", "sae") if r % 2 == 0 else ("sae", "layer")
            for what in order:
                for b in params.batches:
                    row = measure(what, b, params.host_hidden, params, shm, params.steps, params.warmup)
                    trials.append({**row, "repeat": r, "measure": "host"})
            echo(f"  reducer r{r}: " + ", ".join(f"{t['what']}@{t['batch']} {t['host_us']:.0f} us ({t['calls']} calls)"
                                                 for t in trials if t["repeat"] == r))
        for what in ("layer", "sae"):
            # Bytes need no warm-up past the staging blocks' first lap: a step writes the same either way.
            row = measure(what, params.batches[0], params.hidden, params, shm, params.byte_steps, 2)
            trials.append({**row, "repeat": 0, "measure": "bytes"})
            echo(f"  reducer bytes: {what} at hidden {params.hidden}: {row['bytes_per_token']:.0f} B/token")
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(shm, ignore_errors=True)
    return {"params": asdict(params), "trials": trials, "summary": summarise(trials, params),
            "seconds": time.time() - t_start}


def summarise(trials: list[dict[str, Any]], params: ReducerParams) -> dict[str, Any]:
    from vllm_tap.tools.bench import median, spread

    host = []
    for what in ("layer", "sae"):
        calls = set()
        for b in params.batches:
            ts = [t for t in trials if t["measure"] == "host" and t["what"] == what and t["batch"] == b]
            if not ts:
                continue
            calls.add(max(t["calls"] for t in ts))
            host.append({"what": what, "batch": b, "host_us": median(t["host_us"] for t in ts),
                         "host_range_us": spread(t["host_us"] for t in ts), "math_us": median(t["math_us"] for t in ts),
                         "calls": max(t["calls"] for t in ts), "dropped": max(t["dropped"] for t in ts),
                         "steady": all(t["steady"] for t in ts)})
        for row in host:
            if row["what"] == what:
                row["calls_constant"] = len(calls) == 1
    size = {t["what"]: t["bytes_per_token"] for t in trials if t["measure"] == "bytes"}
    ratio = size["sae"] / size["layer"] if size.get("layer") else float("nan")
    return {"host": host, "bytes_per_token": size, "bytes_ratio": ratio, "bytes_met": ratio <= BYTES_TARGET}


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    s, p = res["summary"], res["params"]
    out = [{"part": "reducer", "target": f"SAE {p['latents']} latents top-{p['k']}: bytes per token ≤ 1/8 of its layer's "
                                         f"(hidden {p['hidden']}, bf16)",
            "measured": f"{s['bytes_per_token']['sae']:.0f} B against {s['bytes_per_token']['layer']:.0f} B "
                        f"(× {s['bytes_ratio']:.3f})", "met": s["bytes_met"]}]
    sae = [r for r in s["host"] if r["what"] == "sae"]
    if sae:
        out.append({"part": "reducer", "target": "SAE: the same step-thread calls at every batch, nothing dropped",
                    "measured": f"{sae[0]['calls']} calls; dropped {max(r['dropped'] for r in sae)}",
                    "met": all(r["calls_constant"] and not r["dropped"] for r in sae)})
    return out


def table(res: dict[str, Any]) -> list[str]:
    s, p = res["summary"], res["params"]
    lines = ["## Reducers: an SAE against capturing its layer", "",
             f"A standard SAE of {p['latents']} latents at top-{p['k']} on one layer (tap_reducers alone) against "
             "capturing that layer (bf16), in the capture core as a GPU worker drives it (staged publisher, token ids "
             f"as a tensor, steady decode steps of an unchanged batch, one torch thread). Bytes per token: what the "
             f"steps wrote into the ring over their rows, records whole, at hidden {p['hidden']}. Host µs: median wall "
             f"time inside `capture` over {p['steps']} steps × {p['repeats']} repeats (range over repeats), at hidden "
             f"{p['host_hidden']}; \"its math\" is the time inside the reducer's matmul over the latents and top-k, real "
             "CPU kernels here (kernels on the compute stream on a GPU). Calls: aten ops on the step thread.", "",
             f"| | bytes per token (hidden {p['hidden']}) |", "|---|--:|",
             f"| layer {LAYER} | {s['bytes_per_token'].get('layer', float('nan')):.0f} |",
             f"| SAE top-{p['k']} | {s['bytes_per_token'].get('sae', float('nan')):.0f} (× {s['bytes_ratio']:.3f}) |", "",
             "| capture | batch | host µs (range) | its math µs | host − math µs | step-thread calls | dropped |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    for row in s["host"]:
        lo, hi = row["host_range_us"]
        what = f"layer {LAYER}" if row["what"] == "layer" else f"SAE top-{p['k']}"
        math = row["math_us"] if row["what"] == "sae" else 0.0
        lines.append(f"| {what} | {row['batch']} | {row['host_us']:.0f} ({lo:.0f}–{hi:.0f}) | "
                     f"{math:.0f} | {row['host_us'] - math:.0f} | {row['calls']} | {row['dropped']} |")
    return lines + [""]


def plot(plt: Any, res: dict[str, Any], outdir: str) -> str | None:
    s, p = res["summary"], res["params"]
    if not s["host"]:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    size = s["bytes_per_token"]
    axes[0].bar([f"layer {LAYER}", f"SAE top-{p['k']}"], [size.get("layer", 0), size.get("sae", 0)], 0.6)
    axes[0].set_title(f"ring bytes per token (hidden {p['hidden']})")
    batches = p["batches"]
    xs = range(len(batches))
    for i, what in enumerate(("layer", "sae")):
        got = {r["batch"]: r for r in s["host"] if r["what"] == what}
        host = [got.get(b, {}).get("host_us", 0) for b in batches]
        math = [got.get(b, {}).get("math_us", 0) if what == "sae" else 0 for b in batches]
        at = [x + i * 0.4 for x in xs]
        label = f"layer {LAYER}" if what == "layer" else f"SAE top-{p['k']}"
        axes[1].bar(at, [h - m for h, m in zip(host, math)], 0.4, label=f"{label}: hook")
        if what == "sae":
            axes[1].bar(at, math, 0.4, bottom=[h - m for h, m in zip(host, math)], alpha=0.4,
                        label=f"{label}: its math (CPU kernels)")
    axes[1].set_xticks([x + 0.2 for x in xs])
    axes[1].set_xticklabels([f"batch {b}" for b in batches])
    axes[1].set_yscale("log")
    axes[1].set_title(f"host µs per steady decode step (hidden {p['host_hidden']})")
    axes[1].legend(fontsize=7)
    from vllm_tap.tools.bench import save_figure

    return save_figure(plt, fig, outdir, "reducer.png")
