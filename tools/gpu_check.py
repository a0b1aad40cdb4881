"""The capture core and the CUDA publisher on a GPU with torch alone (no vLLM): are the bytes right,
what does the hook cost, and does the compute stream wait for the copies?

    python -m vllm_tap.tools.gpu_check [--quick] [--out results.json]
    python -m vllm_tap.tools.gpu_check --device cpu --quick     # the same logic on the CPU (a smoke run)

For each vocabulary (32000, 128256) and scenario (decode of 1/8/32/128 requests, a 256-row prefill
chunk), all in bfloat16 with every request capturing full logits and two hidden layers, it builds a
runner-neutral step view of device tensors (token ids on the device too, as under async scheduling)
and drives the real CaptureCore with the real StagedPublisher (staging → event → copy stream → ring
page-locked with cudaHostRegister → publisher thread commits) into a real ring, then:

1. correctness: reads the ring back with the daemon's reader and compares every row bitwise with the
   device tensors (copied to the host after the fact), token ids included;
2. hook time per step: host time inside `core.capture` (the step thread's cost; nothing in it waits
   for the GPU), median over steps;
3. compute-stream time the hook adds: CUDA events around `core.capture` on the compute stream (the
   gathers into staging), and the step time of a stand-in forward (a bf16 matmul chain) with and
   without the capture between forwards: the difference is what serving would feel;
4. device→host bandwidth measured in the same run (a copy stream into a registered host buffer), and
   the captured bytes at that bandwidth, which the copy stream spends off the compute stream.

Prints a table and, with --out, writes the numbers as JSON. Exits non-zero when a byte differs.
docs/benchmarks.md gives the figures measured on a GPU, with the card and the commit.
"""

from __future__ import annotations

import argparse
import json
import mmap
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm_tap.hooks.capture_core import CaptureCore, RankPlace, StepView
from vllm_tap.hooks.publisher import CudaBackend, HostBackend, StagedPublisher, staging_bytes
from vllm_tap.hooks.settings import SPEC_EXTRA_ARG
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_records import per_tensor
from vllm_tap.ring_writer import RingWriter
from vllm_tap.spec import CaptureSpec

LAYERS = (2, 5)


@dataclass(frozen=True)
class Scenario:
    name: str
    batch: int
    rows_per_request: int  # 1: decode; > 1: a prefill chunk


SCENARIOS = (Scenario("decode-1", 1, 1), Scenario("decode-8", 8, 1), Scenario("decode-32", 32, 1),
             Scenario("decode-128", 128, 1), Scenario("prefill-256", 1, 256))


class _Forward:
    """A stand-in forward on the compute stream: a chain of bf16 matmuls of a few milliseconds."""

    def __init__(self, device, hidden: int, n: int = 8):
        g = torch.Generator(device="cpu").manual_seed(1)
        self.w = (torch.randn(hidden, hidden, generator=g) * 0.02).to(device, torch.bfloat16)
        self.x = torch.randn(256, hidden, generator=g).to(device, torch.bfloat16)
        self.n = n

    def __call__(self):
        x = self.x
        for _ in range(self.n):
            x = x @ self.w
        return x


def _d2h_bandwidth(device, nbytes: int, reps: int = 5) -> float:
    """Bytes/s of a device→host copy on a side stream into registered (page-locked) host memory."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    mm = mmap.mmap(-1, nbytes)
    dst = torch.frombuffer(mm, dtype=torch.uint8)
    dst.fill_(0)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(dst.data_ptr(), nbytes, 0)) == 0
    s = torch.cuda.Stream(device)
    times = []
    try:
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                a.record(s)
                dst.copy_(src, non_blocking=True)
                b.record(s)
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    finally:
        cudart.cudaHostUnregister(dst.data_ptr())
        del dst
        mm.close()
    return nbytes / statistics.median(times[1:])


def _build(sc: Scenario, vocab: int, hidden: int, device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    n_rows = sc.batch * sc.rows_per_request
    weight = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, torch.bfloat16)
    hid = torch.randn(n_rows, hidden, generator=g).to(device, torch.bfloat16)
    aux = [torch.randn(n_rows, hidden, generator=g).to(device, torch.bfloat16) for _ in LAYERS]
    qsl = np.arange(0, n_rows + 1, sc.rows_per_request, dtype=np.int32)
    logits = hid[torch.from_numpy(qsl[1:] - 1).long().to(device)] @ weight.T
    ids = torch.randint(3, vocab, (n_rows,), dtype=torch.int32, generator=g).to(device)
    return weight, hid, aux, qsl, logits, ids


def run_scenario(sc: Scenario, vocab: int, hidden: int, device, shm: str, ring_bytes: int, steps: int,
                 forward: _Forward) -> dict:
    weight, hid, aux, qsl, logits, ids = _build(sc, vocab, hidden, device, seed=vocab + sc.batch)
    lm_head = (lambda h: h @ weight.T)
    backend = CudaBackend(device) if device.type == "cuda" else HostBackend()
    writer = RingWriter(ring_path(shm, f"{sc.name}-{vocab}", 0), ring_bytes)
    np.frombuffer(writer.buffer, np.uint8)[4096:].fill(0)  # fault the ring in, as a lapped ring is
    pub = StagedPublisher(writer, backend, staging_bytes(ring_bytes))
    core = CaptureCore(writer, RankPlace(stage_layers=(LAYERS,)), pub, model_dtype=torch.bfloat16, device=device)
    spec = {SPEC_EXTRA_ARG: CaptureSpec(layers=LAYERS).to_meta()}
    prompt = 4096 if sc.rows_per_request == 1 else sc.rows_per_request
    computed = np.full(sc.batch, prompt if sc.rows_per_request == 1 else 0, np.int32)
    req_ids = [f"{sc.name}-{i}" for i in range(sc.batch)]
    for rid in req_ids:
        core.learn(rid, spec, prompt)
    view = StepView(req_ids, qsl, computed, ids, hid, aux, logits, lm_head)
    reader = RingReader(writer.path)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    host_us, stream_us, with_us, without_us = [], [], [], []
    mismatches = 0
    captured_bytes = 0
    try:
        for k in range(steps + 2):
            # Step time of forward + capture + forward against forward + forward.
            sync()
            t0 = time.perf_counter()
            forward()
            forward()
            sync()
            t1 = time.perf_counter()
            forward()
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            th = time.perf_counter()
            core.capture(view)
            th = time.perf_counter() - th
            if cuda:
                b.record()
            forward()
            sync()
            t2 = time.perf_counter()
            pub.drain()
            recs = per_tensor(reader.poll())
            if k == 0:
                mismatches += _check(recs, view, sc, aux, logits, ids, qsl)
                captured_bytes = sum(r.data.nbytes for r in recs)
            if k >= 2:
                host_us.append(th * 1e6)
                without_us.append((t1 - t0) * 1e6)
                with_us.append((t2 - t1) * 1e6)
                if cuda:
                    stream_us.append(a.elapsed_time(b) * 1e3)
            computed += sc.rows_per_request if sc.rows_per_request == 1 else 0
            if sc.rows_per_request > 1:  # the same chunk again: admitted afresh
                for rid in req_ids:
                    core.learn(rid, spec, prompt)
    finally:
        reader.close()
        core.close()
        writer.close(unlink=True)
    med = statistics.median
    return {"scenario": sc.name, "vocab": vocab, "captured_bytes": captured_bytes, "mismatches": mismatches,
            "staging_drops": pub.staging_drops, "hook_host_us": med(host_us),
            "hook_compute_stream_us": med(stream_us) if stream_us else float("nan"),
            "step_without_us": med(without_us), "step_with_us": med(with_us),
            "step_delay_us": med(with_us) - med(without_us)}


def _check(recs, view, sc, aux, logits, ids, qsl) -> int:
    """Rows whose bytes differ from the device tensors (token ids included)."""
    bad = 0
    aux_h = [a.view(torch.int16).cpu().numpy() for a in aux]
    logits_h = logits.view(torch.int16).cpu().numpy()
    ids_h = ids.cpu().numpy()
    seen = 0
    for r in recs:
        if r.tensor is None:
            continue
        i = view.req_ids.index(r.request_id)
        for j, p in enumerate(r.positions.tolist()):
            row = int(qsl[i]) + p - int(view.computed[i])
            if r.tensor.name == "logits":
                if row != int(qsl[i + 1]) - 1:
                    continue  # prompt rows come from the extra pass; checked via the sampled row only
                want = logits_h[i]
            else:
                want = aux_h[LAYERS.index(r.tensor.layer)][row]
            got = r.data[j].view(np.int16)
            bad += int(not np.array_equal(got, want)) + int(int(r.token_ids[j]) != int(ids_h[row]))
            seen += 1
    if seen == 0:
        bad += 1
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="vocab 32000, decode-8 and prefill-256, 5 steps")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ring-bytes", type=int, default=1 << 30)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # torch.cuda.set_device needs an index: "cuda" means the current device
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    vocabs = [32000] if args.quick else [32000, 128256]
    scenarios = [s for s in SCENARIOS if not args.quick or s.name in ("decode-8", "prefill-256")]
    hidden = 256 if args.quick and device.type == "cpu" else args.hidden
    steps = 5 if args.quick else args.steps
    ring_bytes = (64 << 20) if args.quick and device.type == "cpu" else args.ring_bytes
    shm = tempfile.mkdtemp(prefix="vllm-tap-gpu-check-", dir="/dev/shm")
    forward = _Forward(device, hidden)
    bw = _d2h_bandwidth(device, 256 << 20)
    rows = []
    try:
        for vocab in vocabs:
            for sc in scenarios:
                row = run_scenario(sc, vocab, hidden, device, shm, ring_bytes, steps, forward)
                row["d2h_gbps"] = bw / 1e9
                row["d2h_us"] = row["captured_bytes"] / bw * 1e6 if bw == bw else float("nan")
                rows.append(row)
                print(f"{vocab:>6} {sc.name:<12} {row['captured_bytes'] / 1e6:8.2f} MB  hook {row['hook_host_us']:8.1f} us"
                      f"  compute-stream {row['hook_compute_stream_us']:8.1f} us  D2H {row['d2h_us']:8.1f} us"
                      f"  step delay {row['step_delay_us']:8.1f} us  mismatches {row['mismatches']}"
                      f"  staging drops {row['staging_drops']}")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(shm.rstrip("/") + ".arena", ignore_errors=True)  # the daemon's arena, kept for a next run
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "d2h_gbps": bw / 1e9, "hidden": hidden, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if any(r["mismatches"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
