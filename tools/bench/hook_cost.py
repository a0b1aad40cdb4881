"""Hook cost against the physical limit: time inside `CaptureCore.capture` per step, against the time
to memcpy the bytes it captured at the memcpy bandwidth measured in the same run.

This drives the real capture core (hooks/capture_core.py), the CPU publisher and the real RingWriter
in-process with torch alone (no vLLM), on a runner-neutral step view built from real torch tensors
of the bench model's sizes, as the V1 adapter builds it (requests learned at admission): it is a
micro-benchmark of our code, not a test of vLLM. The CUDA path has its own check, tools/gpu_check.py. The ring is
consumed between steps (its read cursor set to the write cursor, as an instantly draining daemon
would), outside the timed region.

The hook's time excludes the extra lm-head pass it asks the model for when a request captures the
logits of prompt positions (vLLM computes logits only for sampled rows): that is model compute the
user asked for, timed and reported separately, not overhead. Decode steps have no such pass.

Target: hook time per step <= 2 x (captured bytes / memcpy bandwidth) + 50 us. The `small` preset
(`vllm-tap bench hook --model small`) runs the decode steps of `bench serving --model small`'s
configurations (8 requests, vocabulary 32000, hidden 512: nobody captures, top-20, layers 2 and 5,
full logits) against the small model's target: hook time per decode step <= 30 us + the memcpy time of its
bytes. Top-k and its logsumexp are O(vocabulary) compute per row on the step thread of a CPU
server, not copying: on an accelerator they are kernels on the compute stream.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from vllm_tap.tools.bench import loadavg, median, spread

TARGET_FACTOR = 2.0
TARGET_SLACK_US = 50.0
SMALL_TARGET_SLACK_US = 30.0  # small preset: <= 30 us + memcpy time, per decode step


@dataclass(frozen=True)
class Scenario:
    name: str
    batch: int  # requests in the step
    capturing: int  # how many of them opted in
    rows_per_request: int  # scheduled tokens per request (1 = decode, >1 = a prefill chunk)
    prompt_len: int = 128
    capture: str = "all"  # all: full logits + layers; topk: top-20 logits; layers: layers only; logits: full logits

    def describe(self) -> str:
        kind = "decode" if self.rows_per_request == 1 else f"prefill chunk of {self.rows_per_request}"
        what = {"all": "", "topk": " top-20", "layers": " layers", "logits": " full logits"}[self.capture]
        return f"{kind}, {self.capturing}/{self.batch} requests capturing{what}"


DEFAULT_SCENARIOS = (
    Scenario("decode-8-none", 8, 0, 1),
    Scenario("decode-1", 1, 1, 1),
    Scenario("decode-8", 8, 8, 1),
    Scenario("decode-8-1of8", 8, 1, 1),
    Scenario("decode-32", 32, 32, 1),
    Scenario("prefill-128", 1, 1, 128),
)
EXTRA_SCENARIOS = (Scenario("decode-128", 128, 128, 1),)
# The decode steps of `bench serving --model small`'s configurations b, t, h, l.
SMALL_SCENARIOS = (
    Scenario("small-b", 8, 0, 1),
    Scenario("small-t", 8, 8, 1, capture="topk"),
    Scenario("small-h", 8, 8, 1, capture="layers"),
    Scenario("small-l", 8, 8, 1, capture="logits"),
)
TOPK = 20


@dataclass
class HookParams:
    vocab_sizes: list[int] = field(default_factory=lambda: [32000, 128256])
    hidden_size: int = 1024
    num_layers: int = 8
    layers: list[int] = field(default_factory=lambda: [2, 5])  # captured (the server exposes these)
    scenarios: list[str] = field(default_factory=lambda: [s.name for s in DEFAULT_SCENARIOS])
    repeats: int = 5
    steps: int = 40  # timed steps per scenario and repeat
    warmup: int = 5
    threads: int = 1  # torch threads: vLLM's CPU worker here runs one OpenMP thread per core it owns
    ring_bytes: int = 256 << 20
    memcpy_bytes: int = 64 << 20
    slack_us: float = TARGET_SLACK_US
    factor: float = TARGET_FACTOR

    @classmethod
    def small(cls) -> "HookParams":
        """The target on the small serving model's decode steps: ≤ 30 µs + the memcpy time of their bytes."""
        return cls(vocab_sizes=[32000], hidden_size=512, scenarios=[s.name for s in SMALL_SCENARIOS], repeats=5,
                   steps=100, warmup=10, slack_us=SMALL_TARGET_SLACK_US, factor=1.0)

    @classmethod
    def quick(cls) -> "HookParams":
        return cls(vocab_sizes=[32000], scenarios=["decode-8-none", "decode-8", "prefill-128"], repeats=2, steps=10,
                   warmup=2, ring_bytes=128 << 20, memcpy_bytes=16 << 20)


class _Model:
    """compute_logits as the model does it (lm_head matmul), timed so it can be taken out."""

    def __init__(self, weight):
        import torch

        self.weight = weight
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self._linear = torch.nn.functional.linear

    def compute_logits(self, hidden):
        t, c = time.perf_counter(), time.thread_time()
        out = self._linear(hidden, self.weight)
        self.cpu_seconds += time.thread_time() - c
        self.seconds += time.perf_counter() - t
        return out


class _Step:
    """One scenario's step view, advancing positions each step like a running batch."""

    def __init__(self, sc: Scenario, vocab: int, hidden: int, layers: list[int], model: _Model, num_layers: int):
        import torch

        from vllm_tap.hooks.capture_core import StepView
        from vllm_tap.hooks.settings import SPEC_EXTRA_ARG
        from vllm_tap.spec import CaptureSpec

        self.sc = sc
        n_rows = sc.batch * sc.rows_per_request
        g = torch.Generator().manual_seed(0)
        self.req_ids = [f"{sc.name}-{i}" for i in range(sc.batch)]
        from vllm_tap.spec import LogitsMode, PositionsMode

        cs = {"all": CaptureSpec(layers=tuple(layers)),
              "topk": CaptureSpec(logits=LogitsMode.TOPK, topk=TOPK, layers=(), positions=PositionsMode.OUTPUT),
              "layers": CaptureSpec(logits=LogitsMode.NONE, layers=tuple(layers)),
              "logits": CaptureSpec(layers=(), positions=PositionsMode.OUTPUT)}[sc.capture]
        spec = {SPEC_EXTRA_ARG: cs.to_meta()}
        qsl = np.arange(0, n_rows + 1, sc.rows_per_request, dtype=np.int32)
        self.computed = np.zeros(sc.batch, dtype=np.int32)
        hidden_states = torch.randn(n_rows, hidden, generator=g)
        self.view = StepView(
            req_ids=self.req_ids, query_start=qsl, computed=self.computed,
            token_ids=torch.randint(3, vocab, (n_rows,), dtype=torch.int32, generator=g).numpy(),
            hidden=hidden_states, aux=[torch.randn(n_rows, hidden, generator=g) for _ in layers],
            logits=torch.randn(sc.batch, vocab, generator=g), compute_logits=model.compute_logits,
            row_of={rid: i for i, rid in enumerate(self.req_ids)},  # V1's input_batch.req_id_to_index
        )
        self.spec = spec
        row_bytes = {"all": (vocab + hidden * len(layers)) * 4, "topk": TOPK * 8 + 4, "layers": hidden * len(layers) * 4,
                     "logits": vocab * 4}[sc.capture]  # top-k: ids + values + the row's logsumexp
        self.captured_bytes = sc.capturing * sc.rows_per_request * row_bytes
        self.extra_rows = sc.capturing * (sc.rows_per_request - 1)
        self._reset()

    def _reset(self) -> None:
        # Prefill chunks start at position 0; decode steps at the first output position.
        start = 0 if self.sc.rows_per_request > 1 else self.sc.prompt_len
        self.computed[:] = start

    def advance(self) -> None:
        self.computed += self.sc.rows_per_request
        if int(self.computed[0]) + self.sc.rows_per_request > 1 << 20:
            self._reset()


class _Consumer:
    """Sets the ring's read cursor to its write cursor: an instantly draining daemon."""

    def __init__(self, path: str):
        from vllm_tap import ring_format as rf

        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, rf.HEADER_SIZE)
        finally:
            os.close(fd)
        hdr = np.frombuffer(self._mm, np.uint8)
        self._w = hdr[rf.WRITE_CURSOR_OFFSET : rf.WRITE_CURSOR_OFFSET + 8].view("<u8")
        self._r = hdr[rf.READ_CURSOR_OFFSET : rf.READ_CURSOR_OFFSET + 8].view("<u8")

    def drain(self) -> None:
        self._r[0] = self._w[0]

    def close(self) -> None:
        self._w = self._r = None  # type: ignore[assignment]
        self._mm.close()


class _Memcpy:
    """torch copies into a shared-memory mapping laid out like the ring (rotating destination)."""

    def __init__(self, path: str, size: int):
        import torch

        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.dst = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.dst.fill_(0)  # fault the pages in, as the ring's are after its first lap
        self.size = size
        self._at = 0

    def time_copy(self, src) -> tuple[float, float]:
        """(wall, thread CPU) seconds of one copy of src into the next slot of the buffer."""
        n = src.numel()
        if self._at + n > self.size:
            self._at = 0
        dst = self.dst[self._at : self._at + n]
        t, c = time.perf_counter(), time.thread_time()
        dst.copy_(src)
        cpu = time.thread_time() - c
        dt = time.perf_counter() - t
        self._at += (n + 63) // 64 * 64
        return dt, cpu

    def close(self) -> None:
        self.dst = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass


def _measure_bandwidth(mc: _Memcpy, nbytes: int, reps: int = 9) -> tuple[float, float]:
    """memcpy bandwidth in bytes/s: (by wall time, by thread CPU time), medians of `reps` copies."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    mc.time_copy(src)
    times = [mc.time_copy(src) for _ in range(reps)]
    return nbytes / median(t for t, _ in times), nbytes / median(c for _, c in times)


def _count_ops(cap, st: "_Step", consumer: "_Consumer") -> int:
    """Torch ops the step thread issues in one more step of the scenario (each is host time on a
    GPU, where a decode step lasts milliseconds)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.n += 1
            return func(*args, **(kwargs or {}))

    with Ops():
        cap.capture(st.view)
    consumer.drain()
    st.advance()
    return Ops.n


def run(params: HookParams, echo=print) -> dict[str, Any]:
    import torch

    from vllm_tap.hooks.capture_core import CaptureCore, RankPlace
    from vllm_tap.hooks.publisher import Publisher
    from vllm_tap.ring_files import ring_path
    from vllm_tap.ring_writer import RingWriter

    torch.set_num_threads(params.threads)
    by_name = {s.name: s for s in DEFAULT_SCENARIOS + EXTRA_SCENARIOS + SMALL_SCENARIOS}
    scenarios = [by_name[n] for n in params.scenarios]
    shm = tempfile.mkdtemp(prefix="vllm-tap-bench-hook-", dir="/dev/shm")
    load0 = loadavg()
    t_start = time.time()
    trials: list[dict[str, Any]] = []
    bandwidth: list[float] = []
    caps: list[Any] = []
    consumers: list[_Consumer] = []
    mc = None
    try:
        mc = _Memcpy(os.path.join(shm, "memcpy.buf"), max(params.ring_bytes // 2, 2 * params.memcpy_bytes))
        setups = []
        for vocab in params.vocab_sizes:
            weight = torch.randn(vocab, params.hidden_size) * 0.02
            model = _Model(weight)
            steps = [_Step(sc, vocab, params.hidden_size, params.layers, model, params.num_layers) for sc in scenarios]
            writer = RingWriter(ring_path(shm, f"hook-v{vocab}", 0), params.ring_bytes)
            cap = CaptureCore(writer, RankPlace(stage_layers=(tuple(params.layers),)), Publisher(writer))
            for st in steps:  # admitted once, as the runner adapters do (not timed: not per step)
                for i, rid in enumerate(st.req_ids):
                    cap.learn(rid, st.spec if i < st.sc.capturing else None, st.sc.prompt_len)
            caps.append(cap)
            # Fault the ring's pages in: a serving process laps its ring within minutes, so the
            # steady state the hook lives in is a mapped ring (the header is left alone).
            from vllm_tap import ring_format as rf

            np.frombuffer(cap.writer.buffer, np.uint8)[rf.HEADER_SIZE :].fill(0)
            consumer = _Consumer(cap.writer.path)
            consumers.append(consumer)
            setups.append((vocab, cap, consumer, model, steps))
        for r in range(params.repeats):
            bw, bw_cpu = _measure_bandwidth(mc, params.memcpy_bytes)
            bandwidth.append(bw)
            for vocab, cap, consumer, model, steps in setups:
                order = steps[r % len(steps):] + steps[: r % len(steps)]
                for st in order:
                    hook_s, hook_cpu, lm_s, direct_s = [], [], [], []
                    src = torch.empty(max(st.captured_bytes, 1), dtype=torch.uint8)
                    for k in range(params.warmup + params.steps):
                        model.seconds = model.cpu_seconds = 0.0
                        t, c = time.perf_counter(), time.thread_time()
                        cap.capture(st.view)
                        cpu = time.thread_time() - c
                        dt = time.perf_counter() - t
                        consumer.drain()
                        st.advance()
                        if k >= params.warmup:
                            hook_s.append(dt - model.seconds)
                            hook_cpu.append(cpu - model.cpu_seconds)
                            lm_s.append(model.seconds)
                            direct_s.append(mc.time_copy(src)[0])
                    ops = _count_ops(cap, st, consumer)
                    dropped = cap.writer.stats()["records_dropped"]
                    trials.append({
                        "vocab": vocab, "scenario": st.sc.name, "repeat": r, "captured_bytes": st.captured_bytes,
                        "hook_us": median(hook_s) * 1e6, "hook_p90_us": float(np.percentile(hook_s, 90)) * 1e6,
                        "hook_cpu_us": median(hook_cpu) * 1e6,
                        "lm_head_us": median(lm_s) * 1e6, "extra_rows": st.extra_rows,
                        "memcpy_us": st.captured_bytes / bw * 1e6, "memcpy_cpu_us": st.captured_bytes / bw_cpu * 1e6,
                        "direct_memcpy_us": median(direct_s) * 1e6,
                        "bandwidth_gbps": bw / 1e9, "bandwidth_cpu_gbps": bw_cpu / 1e9, "dropped_records": dropped,
                        "torch_ops": ops,
                    })
            echo(f"  hook r{r}: memcpy {bw / 1e9:.2f} GB/s; " + ", ".join(
                f"{t['scenario']}@{t['vocab']} {t['hook_us']:.0f} us" for t in trials if t["repeat"] == r))
    finally:
        for c in consumers:
            c.close()
        for cap in caps:
            try:
                cap.close()
                cap.writer.close(unlink=True)
            except Exception:
                pass
        if mc is not None:
            mc.close()
        shutil.rmtree(shm, ignore_errors=True)
    return {"params": asdict(params), "scenarios": {s.name: s.describe() for s in scenarios}, "trials": trials,
            "bandwidth_gbps": [b / 1e9 for b in bandwidth], "summary": summarise(trials, params),
            "torch": torch.__version__, "loadavg_start": load0, "loadavg_end": loadavg(),
            "seconds": time.time() - t_start}


def summarise(trials: list[dict[str, Any]], params: HookParams) -> list[dict[str, Any]]:
    rows = []
    for vocab in params.vocab_sizes:
        for name in params.scenarios:
            ts = [t for t in trials if t["vocab"] == vocab and t["scenario"] == name]
            if not ts:
                continue
            hook = median(t["hook_us"] for t in ts)
            memcpy = median(t["memcpy_us"] for t in ts)
            hook_cpu = median(t["hook_cpu_us"] for t in ts)
            memcpy_cpu = median(t["memcpy_cpu_us"] for t in ts)
            limit = params.factor * memcpy + params.slack_us
            limit_cpu = params.factor * memcpy_cpu + params.slack_us
            rows.append({
                "vocab": vocab, "scenario": name, "captured_bytes": ts[0]["captured_bytes"],
                "hook_us": hook, "hook_range_us": spread(t["hook_us"] for t in ts),
                "hook_cpu_us": hook_cpu, "hook_cpu_range_us": spread(t["hook_cpu_us"] for t in ts),
                "memcpy_us": memcpy, "memcpy_cpu_us": memcpy_cpu,
                "direct_memcpy_us": median(t["direct_memcpy_us"] for t in ts),
                "lm_head_us": median(t["lm_head_us"] for t in ts), "extra_rows": ts[0]["extra_rows"],
                "bandwidth_gbps": median(t["bandwidth_gbps"] for t in ts),
                "bandwidth_cpu_gbps": median(t["bandwidth_cpu_gbps"] for t in ts),
                "ratio_to_memcpy": hook / memcpy if memcpy > 0 else float("nan"),
                "limit_us": limit, "met_wall": hook <= limit,
                "limit_cpu_us": limit_cpu, "met": hook_cpu <= limit_cpu,
                "dropped_records": max(t["dropped_records"] for t in ts),
                "torch_ops": max(t.get("torch_ops", 0) for t in ts),
            })
    return rows
