"""Serving overhead: the same request set against vLLM OpenAI servers with and without the tap.

Configurations (one request set, streamed, `ignore_eos` so every request makes exactly
`output_len` tokens):
  a  plugin not enabled
  b  plugin enabled, no request opts in
  c  every request captures full logits + 2 layers at every prompt and output position, and a
     subscriber process drains every capture from the daemon (and counts every position)
  d  no tap: vLLM returns full-vocabulary logprobs in the JSON (raw logits, `logprobs=-1`)
  e  no tap: top-20 logprobs in the JSON
  f  as (c), but output positions only: no prompt rows, so no extra lm-head pass over the prompt
     (vLLM computes logits only for sampled rows; (c)'s prompt logits are compute the user asks for)
  t  top-20 logits at the output positions (10 kB per request at 64 outputs), drained
  h  2 layers at every prompt and output position, no logits, drained
  l  full logits at the output positions, no layers, drained

  o  plugin enabled with no hidden-state layers exposed, no request opts in: (b) against (o) is what
     the auxiliary hidden-state outputs of the exposed layers cost the forward

Presets (`--model`): `default` (8 layers x 1024 hidden, vocabularies 32000 and 128256, configs
a-f, 3 repeats: what the tap costs at scale), `small` (8 layers x 512 hidden, vocabulary 32000,
configs a b t h l e, 7 repeats: a model small enough that the tap's fixed costs per step, per
request and per record show) and `gpu` (`--gpu`: a ~1.1 B bf16 Llama, vocabulary 128256, hidden
2048, 12 layers, compiled with CUDA graphs, configs a b o t h l e, 64 requests x (256 + 128) at
concurrency 32). On a GPU the servers share the card (each is measured alone); they are started one
after the other, since vLLM sizes its KV cache from what the card has free while it profiles and
servers starting together take each other's memory (it refused to start: "No available memory for
the cache blocks"). The worker's own count of the hook's host time per capturing step
(hooks/cost.py, logged every few seconds during the bench) is collected from each tap server's log.

Servers: one with the plugin off (a, d, e) and one with it on (b, c); both get the same flags
otherwise (`--max-logprobs -1 --logprobs-mode raw_logits`, which change nothing for requests that
ask for no logprobs), so (a) and (b) differ only in `--additional-config`. Each runs alone while it
is measured (vLLM's CPU worker binds a core; the other idles). Within each repeat the
configurations run in turn (A B C D E, order rotated per repeat), and ratios to (a) are taken within
a repeat, then the median over repeats is reported.

Metrics per run: output tokens/s over the run's wall time, TTFT and inter-token latency (the gaps
between streamed events, as vLLM's own benchmark counts them) p50/p99, response bytes per request,
and the CPU seconds (utime+stime from /proc, deltas over the measured window) of every process:
the measured server's API process, engine core and each worker, the daemon, the subscriber, this
load generator, the other (idle) server, and what the rest of the machine used (all busy CPU time
in /proc/stat minus ours): on a shared machine that last column says how loaded it was.
"""

from __future__ import annotations

import asyncio
import json
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

from vllm_tap.tools.bench import group_pids, loadavg, median, percentile, proc_cpu_seconds, spread

log = logging.getLogger(__name__)

CONFIGS: dict[str, str] = {
    "a": "plugin not enabled",
    "b": "plugin enabled, no request opts in",
    "c": "full logits + 2 layers, every position, drained",
    "d": "no tap, full-vocab logprobs JSON",
    "e": "no tap, top-20 logprobs JSON",
    "f": "full logits + 2 layers, output positions only, drained",
    "t": "top-20 logits, output positions, drained",
    "h": "2 layers, every position, drained",
    "l": "full logits, output positions, drained",
    "o": "plugin enabled, no layers exposed, no request opts in",
}
SERVER_OF = {"a": "plain", "b": "tap", "c": "tap", "d": "plain", "e": "plain", "f": "tap", "t": "tap", "h": "tap",
             "l": "tap", "o": "tap-no-layers"}
SERVER_KINDS = ("plain", "tap", "tap-no-layers")
CAPTURING = ("c", "f", "t", "h", "l")
# What each capturing configuration asks for: logits mode, whether it takes the bench's layers,
# and which positions.
TAP_SPECS: dict[str, dict[str, Any]] = {
    "c": {"logits": "full", "layers": True, "positions": "all"},
    "f": {"logits": "full", "layers": True, "positions": "output"},
    "t": {"logits": "topk", "layers": False, "positions": "output"},
    "h": {"logits": "none", "layers": True, "positions": "all"},
    "l": {"logits": "full", "layers": False, "positions": "output"},
}
PRESETS = ("default", "small", "gpu")
INSTANCE = "bench"
TARGET_TPUT = 0.99  # (b), (c) output tok/s >= 0.99 x (a)
TARGET_ITL_P99 = 1.02  # (b), (c) ITL p99 <= 1.02 x (a)
TARGET_C_OVER_D = 20.0  # (c) output tok/s >= 20 x (d)
# small preset: output tok/s ratio to (a) per configuration
TARGET_SMALL_TPUT = {"b": 0.99, "t": 0.98, "h": 0.95, "l": 0.95}


@dataclass
class ModelSpec:
    vocab_size: int = 32000
    hidden_size: int = 1024
    num_layers: int = 8
    num_heads: int = 16  # head_dim 64
    num_kv_heads: int = 4
    intermediate_size: int = 2816

    def name(self) -> str:
        return (f"llama-v{self.vocab_size}-h{self.hidden_size}-l{self.num_layers}-a{self.num_heads}"
                f"-kv{self.num_kv_heads}-i{self.intermediate_size}")

    def params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = h // self.num_heads * self.num_kv_heads
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
        return self.num_layers * per_layer + 2 * v * h


@dataclass
class ServingParams:
    model: ModelSpec = field(default_factory=ModelSpec)
    vocab_sizes: list[int] = field(default_factory=lambda: [32000, 128256])
    configs: list[str] = field(default_factory=lambda: list("abcdef"))
    # configurations run at the vocabulary points after the first (the big-vocab point); (d) there
    # streams ~4 MB of JSON per token, minutes per run on a CPU machine
    extra_point_configs: list[str] = field(default_factory=lambda: list("abcf"))
    # 32 requests keep a full run (both points, 3 repeats) near 20 minutes on the 2-core CPU
    # machine this was developed on; 64 doubles that.
    num_requests: int = 32
    prompt_len: int = 128
    output_len: int = 64
    concurrency: int = 8
    repeats: int = 3
    tap_layers: list[int] = field(default_factory=lambda: [2, 5])
    # (d) streams ~1 MB of JSON per token at a 32000 vocabulary (~3 tok/s here), so it gets fewer
    # requests (throughput is per token, so the ratio stays comparable); 0 = as many as the others.
    d_requests: int = 4
    ring_mb: int = 512  # at least; more when a burst of prefills needs it (see ring_bytes_for)
    kv_cache_gib: int = 1
    max_model_len: int = 1024
    server_timeout_s: float = 600.0
    topk: int = 20  # k of (t)
    warmup_rounds: int = 0  # unmeasured rounds of every configuration before the measured repeats
    preset: str = "default"
    device: str = "cpu"  # "cuda": bf16, compiled with CUDA graphs, servers started together
    gpu_memory_utilization: float = 0.25  # per server on a GPU (three share one card)
    models_dir: str = field(default_factory=lambda: os.environ.get("VLLM_TAP_BENCH_MODELS", "/tmp/vllm-tap-bench-models"))

    @classmethod
    def quick(cls) -> "ServingParams":
        return cls(model=ModelSpec(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                   intermediate_size=512),
                   vocab_sizes=[2048], num_requests=8, prompt_len=32, output_len=16, concurrency=4, repeats=1,
                   tap_layers=[1, 3], d_requests=4, ring_mb=64, max_model_len=512)

    @classmethod
    def small(cls) -> "ServingParams":
        """The small preset's model: small enough that fixed costs per step, request and record dominate."""
        return cls(model=ModelSpec(vocab_size=32000, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                                   intermediate_size=1408),
                   vocab_sizes=[32000], configs=list("abthle"), extra_point_configs=[], num_requests=32,
                   prompt_len=128, output_len=64, concurrency=8, repeats=7, tap_layers=[2, 5], preset="small",
                   warmup_rounds=1)

    @classmethod
    def small_quick(cls) -> "ServingParams":
        """The small preset's configurations on a smaller load: a smoke check of the harness."""
        p = cls.small()
        p.model = ModelSpec(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                            intermediate_size=512)
        p.vocab_sizes, p.tap_layers, p.ring_mb, p.max_model_len = [2048], [1, 3], 64, 512
        p.num_requests, p.prompt_len, p.output_len, p.concurrency, p.repeats, p.warmup_rounds = 8, 32, 16, 4, 2, 0
        return p

    @classmethod
    def gpu(cls) -> "ServingParams":
        """One GPU: the ~1.1 B Llama the first GPU run measured, vLLM's defaults (compiled, CUDA graphs,
        async scheduling, whichever model runner it picks), bf16."""
        return cls(model=ModelSpec(vocab_size=128256, hidden_size=2048, num_layers=12, num_heads=16, num_kv_heads=8,
                                   intermediate_size=5632),
                   vocab_sizes=[128256], configs=list("abothle"), extra_point_configs=[], num_requests=64,
                   prompt_len=256, output_len=128, concurrency=32, repeats=3, tap_layers=[4, 8], preset="gpu",
                   warmup_rounds=1, ring_mb=1024, max_model_len=1024, device="cuda", server_timeout_s=900.0)

    @classmethod
    def gpu_quick(cls) -> "ServingParams":
        p = cls.gpu()
        p.num_requests, p.repeats, p.warmup_rounds = 32, 1, 0
        return p

    @classmethod
    def preset_params(cls, name: str, quick: bool) -> "ServingParams":
        if name == "small":
            return cls.small_quick() if quick else cls.small()
        if name == "gpu":
            return cls.gpu_quick() if quick else cls.gpu()
        return cls.quick() if quick else cls()

    def ring_bytes_for(self, vocab: int) -> int:
        """Room for two steps' worth of prefill captures of every concurrent request (on a GPU:
        ring_mb, since that would be gigabytes of shared memory and a quarter of it on the card)."""
        if self.device == "cuda":
            return self.ring_mb << 20
        row = (vocab + self.model.hidden_size * len(self.tap_layers)) * 4
        need = 2 * self.concurrency * self.prompt_len * row
        return max(self.ring_mb << 20, -(-need // (64 << 20)) * (64 << 20))

    def requests_for(self, config: str) -> int:
        if config == "d" and self.d_requests:
            return min(self.d_requests, self.num_requests)
        return self.num_requests


# -- the request set --


def prompts(p: ServingParams, vocab: int, seed: int, n: int | None = None) -> list[str]:
    """A request set of random prompts, exactly prompt_len tokens each (ids >= 3 are plain words of
    the generated tokenizer). Every run gets its own seed: vLLM's prefix cache would otherwise serve
    a repeated prompt from the KV cache, so later runs would skip their prefill (and a capture of
    prompt positions bypasses the cache, so it would be compared against runs doing less work)."""
    from vllm_tap.tools.tiny_model import prompt_text

    rng = np.random.default_rng(seed)
    return [prompt_text(rng.integers(3, vocab, p.prompt_len).tolist()) for _ in range(n or p.num_requests)]


def request_body(model: str, text: str, p: ServingParams, config: str, key: str, vocab: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "prompt": text, "max_tokens": p.output_len, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if config in CAPTURING:
        t = TAP_SPECS[config]
        xargs: dict[str, Any] = {"tap": 1, "tap_logits": t["logits"],
                                 "tap_layers": list(p.tap_layers) if t["layers"] else "none",
                                 "tap_positions": t["positions"], "tap_key": key}
        if t["logits"] == "topk":
            xargs["tap_topk"] = p.topk
        body["vllm_xargs"] = xargs
    elif config == "d":
        body["logprobs"] = -1
    elif config == "e":
        body["logprobs"] = 20
    return body


# -- the load generator --


@dataclass
class _Result:
    ok: bool
    start: float
    end: float
    events: list[float]
    output_tokens: int
    nbytes: int
    error: str = ""


async def _one(session, url: str, body: dict[str, Any]) -> _Result:
    t0 = time.perf_counter()
    events: list[float] = []
    nbytes = 0
    usage_tokens = 0
    buf = bytearray()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.read())[:300].decode(errors="replace")
                return _Result(False, t0, time.perf_counter(), [], 0, 0, f"HTTP {resp.status}: {text}")
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                nbytes += len(data)
                scan = max(len(buf) - 1, 0)
                buf += data
                while True:
                    i = buf.find(b"\n\n", scan)
                    if i < 0:
                        break
                    ev = bytes(buf[:i]) if i < 4096 else None
                    head = bytes(buf[: min(i, 64)])
                    tail = bytes(buf[max(0, i - 256) : i])
                    del buf[: i + 2]
                    scan = 0
                    if head.startswith(b"data: [DONE]"):
                        continue
                    if b'"completion_tokens"' in tail and ev is not None and b'"choices":[]' in ev:
                        usage_tokens = int(json.loads(ev[6:])["usage"]["completion_tokens"])
                        continue
                    if head.startswith(b"data:"):
                        events.append(now)
    except Exception as e:  # reported per request
        return _Result(False, t0, time.perf_counter(), events, 0, nbytes, f"{type(e).__name__}: {e}")
    return _Result(True, t0, time.perf_counter(), events, usage_tokens, nbytes)


async def _load(base_url: str, bodies: list[dict[str, Any]], concurrency: int, on_send=None) -> tuple[list[_Result], float, float]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    url = base_url + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def go(i: int, body: dict[str, Any]) -> _Result:
            async with sem:
                if on_send is not None:
                    on_send(i)
                return await _one(session, url, body)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(go(i, b) for i, b in enumerate(bodies)))
        t1 = time.perf_counter()
    return list(results), t0, t1


# -- the subscriber that drains (c) --


def expected_positions(config: str, p: ServingParams) -> int:
    """Positions a capture of this configuration holds: every computed position (the last token is
    never fed back) for 'all'; output positions start at P-1."""
    return p.prompt_len + p.output_len - 1 if TAP_SPECS[config]["positions"] == "all" else p.output_len


def expected_arrays(config: str, p: ServingParams, vocab: int) -> dict[str, Any]:
    t = TAP_SPECS[config]
    return {"logits": t["logits"], "vocab": vocab, "topk": p.topk,
            "layers": sorted(p.tap_layers) if t["layers"] else []}


def _chunk_ok(item: Any, want: dict[str, Any]) -> bool:
    n = len(item)
    if sorted(item.hidden) != want["layers"]:
        return False
    if want["logits"] == "full":
        return item.logits is not None and item.logits.shape == (n, want["vocab"])
    if want["logits"] == "topk":
        return (item.topk_ids is not None and item.topk_ids.shape == (n, want["topk"])
                and item.topk_values is not None and item.topk_values.shape == (n, want["topk"]))
    return item.logits is None and item.topk_ids is None


def _chunk_bytes(item: Any) -> int:
    arrays = [item.logits, item.topk_ids, item.topk_values, *item.hidden.values()]
    return sum(a.nbytes for a in arrays if a is not None)


def _drainer_main(endpoint: str, threads: int, want: dict[str, Any], keys: Any, results: Any) -> None:
    """Subscribe by tap_key to every capture named on `keys`, count what arrives, report each."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm_tap.client import Chunk, Client

    client = Client(endpoint)

    def drain(key: str, expected: int) -> None:
        got = nbytes = gaps = 0
        next_pos = None
        in_order = shape_ok = True
        err = ""
        missing = -1
        try:
            sub = client.subscribe(key, timeout=600)
            for item in sub.chunks():
                if isinstance(item, Chunk):
                    in_order &= next_pos is None or item.start == next_pos
                    next_pos = item.stop
                    got += len(item)
                    shape_ok &= _chunk_ok(item, want)
                    nbytes += _chunk_bytes(item)
                else:
                    gaps += len(item.positions)
                    next_pos = item.positions.stop
            missing = len(sub.end.missing_positions) if sub.end is not None else -1
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        results.put({"key": key, "positions": got, "expected": expected, "gaps": gaps, "missing": missing,
                     "in_order": in_order, "shape_ok": shape_ok, "bytes": nbytes, "done": time.time(),
                     "error": err})

    cpu0 = time.process_time()
    results.put({"ready": os.getpid()})
    with ThreadPoolExecutor(threads) as pool:
        while True:
            msg = keys.get()
            if msg is None:
                break
            pool.submit(drain, *msg)
    results.put({"cpu_s": time.process_time() - cpu0})
    results.put(None)


class Drainer:
    def __init__(self, endpoint: str, threads: int, want: dict[str, Any]):
        ctx = mp.get_context("spawn")
        self.keys, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_drainer_main, args=(endpoint, threads, want, self.keys, self.results),
                                daemon=True)
        self.proc.start()
        msg = self.results.get(timeout=120)
        self.pid = msg["ready"]
        self.cpu_s = 0.0

    def add(self, key: str, expected: int) -> None:
        self.keys.put((key, expected))

    def finish(self, timeout: float) -> list[dict[str, Any]]:
        """Every capture's report (waits for the last to drain); self.cpu_s is the drainer's CPU time."""
        self.keys.put(None)
        out = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if msg is None:
                break
            if "cpu_s" in msg:
                self.cpu_s = msg["cpu_s"]
            else:
                out.append(msg)
        self.stop()
        return out

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# -- servers --


@dataclass
class _Server:
    kind: str  # "plain" or "tap"
    handle: Any
    daemon: Any = None
    endpoint: str = ""


def _logprob_flags() -> list[str]:
    return ["--max-logprobs", "-1", "--logprobs-mode", "raw_logits"]


COST_LOG_EVERY_S = 5  # the worker's hook-cost line during a bench (hooks/cost.py; 60 s by default)


def _server_args(kind: str, p: ServingParams, vocab: int, shm: str) -> list[str]:
    from vllm_tap.tools.launch import cpu_server_args, gpu_server_args, tap_server_args

    if p.device == "cuda":
        args = gpu_server_args(max_model_len=p.max_model_len, gpu_memory_utilization=p.gpu_memory_utilization)
    else:
        args = cpu_server_args(eager=True, max_model_len=p.max_model_len)
    args += _logprob_flags()
    if kind != "plain":
        layers = list(p.tap_layers) if kind == "tap" else "none"
        args += tap_server_args(shm, f"{INSTANCE}-{kind}", layers=layers, ring_bytes=p.ring_bytes_for(vocab))
    return args


def _start_servers(kinds: list[str], model_path: str, p: ServingParams, vocab: int, workdir: str, shm: str, sock: str,
                   started: list[Any], echo) -> dict[str, _Server]:
    """Start the servers (and, for the tap, one daemon they share). Every process is put on `started`
    before it is waited for, so the caller stops it whatever happens (an error, a timeout, SIGTERM).
    One after the other: on a CPU vLLM's worker binds cores, and on a GPU each server sizes its KV
    cache from what the card has free while it starts."""
    from vllm_tap.tools.launch import DaemonHandle, ServerHandle, free_port

    daemon, endpoint = None, ""
    if any(k != "plain" for k in kinds):
        endpoint = f"ipc://{sock}/tap.sock"
        daemon = DaemonHandle(shm, endpoint, os.path.join(workdir, "daemon.log"))
        started.append(daemon)
        daemon.start(extra=["--log-level", "WARNING"])
    env = {"VLLM_CPU_KVCACHE_SPACE": str(p.kv_cache_gib), "VLLM_TAP_COST_LOG_S": str(COST_LOG_EVERY_S)}
    servers: dict[str, _Server] = {}
    for kind in kinds:
        for attempt in range(3):  # free_port can race with other processes on a shared machine
            handle = ServerHandle(model_path, free_port(), os.path.join(workdir, f"server-{kind}.log"),
                                  _server_args(kind, p, vocab, shm), env)
            started.append(handle)
            t = time.monotonic()
            try:
                handle.start(p.server_timeout_s)
                break
            except RuntimeError as e:
                handle.stop()
                if "Address already in use" not in str(e) or attempt == 2:
                    raise RuntimeError(f"could not start the {kind} server: {e}") from None
        echo(f"  server {kind} up in {time.monotonic() - t:.0f} s (pid {handle.proc.pid})")
        servers[kind] = _Server(kind, handle, daemon if kind != "plain" else None, endpoint if kind != "plain" else "")
    return servers


def hook_cost_lines(log_path: str) -> list[str]:
    """The worker's hook-cost lines (hooks/cost.py) in a server's log."""
    try:
        with open(log_path, errors="replace") as f:
            return [line.strip() for line in f if "hook host time" in line]
    except OSError:
        return []


# -- one run --


def _title(pid: int) -> str:
    """The process title (vLLM sets `VLLM::EngineCore`, `VLLM::Worker_TP0`, ... with setproctitle)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def server_roles(leader: int) -> dict[int, str]:
    """Every process of a vLLM server's process group by its role: `api` (the group leader, the
    OpenAI server), `engine` (the engine core), `worker0`, `worker1`, ... (by title, which names the
    rank: `VLLM::Worker_TP1`), `other`."""
    roles: dict[int, str] = {}
    workers: list[tuple[str, int]] = []
    for pid in sorted(group_pids(leader)):
        title = _title(pid)
        if pid == leader:
            roles[pid] = "api"
        elif "EngineCore" in title:
            roles[pid] = "engine"
        elif "Worker" in title:
            workers.append((title, pid))
        else:
            roles[pid] = "other"
    for i, (_, pid) in enumerate(sorted(workers)):
        roles[pid] = f"worker{i}"
    return roles


def system_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all CPUs, everything but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds of named processes over a window: `start()`, then `stop()` gives the deltas by
    role (roles with several pids add up). Also the machine's busy CPU seconds over the window."""

    def __init__(self, roles: dict[int, str]):
        self.roles = roles
        self._before: dict[int, float] = {}
        self._busy0 = self._t0 = 0.0

    def start(self) -> None:
        self._before = {pid: proc_cpu_seconds(pid) for pid in self.roles}
        self._busy0 = system_busy_seconds()
        self._t0 = time.monotonic()

    def stop(self) -> tuple[dict[str, float], float, float]:
        """(CPU seconds by role, machine busy seconds, window seconds)."""
        out: dict[str, float] = {}
        for pid, role in self.roles.items():
            out[role] = out.get(role, 0.0) + max(0.0, proc_cpu_seconds(pid) - self._before[pid])
        return out, system_busy_seconds() - self._busy0, time.monotonic() - self._t0


def _run_config(server: _Server, config: str, model_path: str, p: ServingParams, vocab: int, seed: int,
                run_id: str, others: list[_Server] = ()) -> dict[str, Any]:
    n = p.requests_for(config)
    texts = prompts(p, vocab, seed, n)
    keys = [f"{run_id}-{i}" for i in range(n)]
    bodies = [request_body(model_path, texts[i], p, config, keys[i], vocab) for i in range(n)]
    expected = expected_positions(config, p) if config in CAPTURING else 0
    drainer = None
    # The measured server's processes by role; the daemon counts as the tap's when the tap server
    # is measured and as background otherwise, like the idle server.
    roles = server_roles(server.handle.proc.pid)
    for other in others:
        roles.update({pid: "background" for pid in group_pids(other.handle.proc.pid)})
    for s in (server, *others):
        if s.daemon is not None and s.daemon.proc is not None:
            roles[s.daemon.proc.pid] = "daemon" if s is server else "background"
    meter = CpuMeter(roles)
    if config in CAPTURING:
        drainer = Drainer(server.endpoint, threads=2 * p.concurrency + 4, want=expected_arrays(config, p, vocab))
    drops0 = _drops(server)
    load0 = loadavg()[0]
    wall0 = time.time()
    on_send = (lambda i: drainer.add(keys[i], expected)) if drainer is not None else None
    meter.start()
    client_cpu0 = time.process_time()
    try:
        results, t0, t1 = asyncio.run(_load(server.handle.base_url, bodies, p.concurrency, on_send))
        t_http_end = time.time()
        drained: list[dict[str, Any]] = []
        drainer_cpu = 0.0
        if drainer is not None:
            drained = drainer.finish(timeout=300)
            drainer_cpu = drainer.cpu_s
            drainer = None
    finally:
        if drainer is not None:
            drainer.stop()
    client_cpu = time.process_time() - client_cpu0
    by_role, busy, window = meter.stop()
    vllm_roles = [r for r in by_role if r in ("api", "engine", "other") or r.startswith("worker")]
    cpu = {"server": sum(by_role[r] for r in vllm_roles), "daemon": by_role.get("daemon", 0.0), "client": client_cpu}
    procs = {r: v for r, v in by_role.items() if r != "background"}
    procs["subscriber"] = drainer_cpu
    ours = sum(by_role.values()) + drainer_cpu + client_cpu
    out = _metrics(results, t0, t1, p)
    out.update(config=config, requests=n, cpu_s=cpu, proc_cpu_s=procs, background_cpu_s=by_role.get("background", 0.0),
               client_cpu_s=client_cpu, foreign_cpu_s=max(0.0, busy - ours), window_s=window, cpus=os.cpu_count(),
               loadavg1=load0, loadavg1_end=loadavg()[0], started=wall0)
    if config in CAPTURING:
        out["drain"] = _drain_summary(drained, n, expected, t_http_end)
        out["cpu_s"]["drainer"] = drainer_cpu
        out["ring_drops"] = _drops(server) - drops0
    return out


def _drops(server: _Server) -> int:
    if server.daemon is None:
        return 0
    from vllm_tap.client import Client

    try:
        return int(Client(server.endpoint).status(timeout=10)["drops"]["records"])
    except Exception:
        return -1


def _metrics(results: list[_Result], t0: float, t1: float, p: ServingParams) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.events[0] - r.start for r in ok if r.events]
    itl = [b - a for r in ok for a, b in zip(r.events, r.events[1:])]
    tpot = [(r.events[-1] - r.events[0]) / (r.output_tokens - 1) for r in ok if r.events and r.output_tokens > 1]
    tokens = sum(r.output_tokens for r in ok)
    wall = t1 - t0
    return {
        "ok": len(ok), "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:3],
        "output_tokens": tokens, "tokens_per_request_ok": all(r.output_tokens == p.output_len for r in ok),
        "wall_s": wall, "tok_s": tokens / wall if wall > 0 else float("nan"),
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
        "tpot_ms": 1e3 * median(tpot), "events_per_request": median(len(r.events) for r in ok),
        "bytes_per_request": median(r.nbytes for r in ok), "bytes_per_token": (
            sum(r.nbytes for r in ok) / tokens if tokens else float("nan")),
    }


def _drain_summary(drained: list[dict[str, Any]], n: int, expected: int, t_http_end: float) -> dict[str, Any]:
    complete = [d for d in drained if d["positions"] == expected and d["missing"] == 0 and d["gaps"] == 0
                and d["in_order"] and d["shape_ok"] and not d["error"]]
    return {
        "captures": len(drained), "complete": len(complete), "expected_captures": n,
        "positions": sum(d["positions"] for d in drained), "expected_positions": n * expected,
        "missing": sum(max(d["missing"], 0) + d["gaps"] for d in drained),
        "bytes": sum(d["bytes"] for d in drained),
        "lag_s": max((d["done"] for d in drained), default=t_http_end) - t_http_end,
        "errors": sorted({d["error"] for d in drained if d["error"]})[:3],
    }


# -- the whole bench --


def _model_path(p: ServingParams, vocab: int) -> tuple[str, ModelSpec]:
    from vllm_tap.tools.tiny_model import TinyLlamaSpec, make_tiny_llama

    spec = ModelSpec(**{**asdict(p.model), "vocab_size": vocab})
    path = os.path.join(p.models_dir, spec.name())
    make_tiny_llama(path, TinyLlamaSpec(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_layers=spec.num_layers, num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads, intermediate_size=spec.intermediate_size,
        max_position_embeddings=max(2048, p.max_model_len)))
    return path, spec


def _warmup(server: _Server, model_path: str, p: ServingParams, vocab: int, echo, brief: bool = False,
            configs: list[str] = ()) -> None:
    """Unmeasured requests. At start-up: one wave of full requests and a short request of each of
    `configs` this server runs (captures, logprobs), so no measured run pays first-request costs.
    Brief (before every run): one wave of short requests, because a server that sat idle while the
    other one was measured runs its first requests slowly (seconds on this machine) and that would
    land on whichever configuration comes first."""
    texts = prompts(p, vocab, seed=10**6 + time.time_ns() % 10**6, n=p.concurrency)
    short = ServingParams(**{**asdict(p), "model": p.model, "output_len": 4})
    bodies = [request_body(model_path, texts[i], short if brief else p, "a", "", vocab) for i in range(p.concurrency)]
    if not brief:
        bodies += [request_body(model_path, texts[0], short, c, f"warmup-{c}-{time.time_ns()}", vocab)
                   for c in configs if c != "a" and SERVER_OF[c] == server.kind]
    results, _, _ = asyncio.run(_load(server.handle.base_url, bodies, p.concurrency))
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up requests failed: {bad[0]}")


def run_point(p: ServingParams, vocab: int, configs: list[str], workdir: str, echo=print) -> dict[str, Any]:
    model_path, spec = _model_path(p, vocab)
    kinds = [k for k in SERVER_KINDS if any(SERVER_OF[c] == k for c in configs)]
    shm = tempfile.mkdtemp(prefix="vllm-tap-bench-srv-", dir="/dev/shm")
    sock = tempfile.mkdtemp(prefix="vtb-")
    servers: dict[str, _Server] = {}
    started: list[Any] = []  # every server and daemon process, stopped in `finally` (servers first)
    runs: list[dict[str, Any]] = []
    t_start = time.time()
    load0 = loadavg()
    try:
        servers.update(_start_servers(kinds, model_path, p, vocab, workdir, shm, sock, started, echo))
        for kind in kinds:
            _warmup(servers[kind], model_path, p, vocab, echo, configs=configs)
        for r in range(-p.warmup_rounds, p.repeats):
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            if r < 0:
                # a whole round, unmeasured: the first runs after start-up are slow for a while
                # (caches, allocator, the other server's start-up settling) whatever the configuration
                t = time.monotonic()
                for config in order:
                    _warmup(servers[SERVER_OF[config]], model_path, p, vocab, echo, brief=True)
                    _run_config(servers[SERVER_OF[config]], config, model_path, p, vocab, 10**5 * (1 - r) + list(CONFIGS).index(config),
                                f"v{vocab}-w{-r}-{config}", [s for k, s in servers.items() if k != SERVER_OF[config]])
                echo(f"  warm-up round {-r} (unmeasured) in {time.monotonic() - t:.0f} s")
                continue
            for config in order:
                seed = 1000 * r + list(CONFIGS).index(config)  # a fresh request set per run
                _warmup(servers[SERVER_OF[config]], model_path, p, vocab, echo, brief=True)
                run = _run_config(servers[SERVER_OF[config]], config, model_path, p, vocab, seed, f"v{vocab}-r{r}-{config}",
                                  [s for k, s in servers.items() if k != SERVER_OF[config]])
                run["repeat"] = r
                runs.append(run)
                extra = ""
                if config in CAPTURING:
                    d = run["drain"]
                    extra = (f"  drained {d['complete']}/{d['expected_captures']} captures, "
                             f"{d['positions']}/{d['expected_positions']} positions, {d['bytes'] / 1e9:.2f} GB, "
                             f"lag {d['lag_s']:.2f} s")
                echo(f"  v{vocab} r{r} ({config}) {run['tok_s']:.1f} tok/s  TTFT p50 {run['ttft_p50_ms']:.0f} ms  "
                     f"ITL p50/p99 {run['itl_p50_ms']:.1f}/{run['itl_p99_ms']:.1f} ms  "
                     f"{run['bytes_per_request'] / 1e3:.0f} kB/request{extra}"
                     f"{'  FAILED ' + str(run['errors']) if run['failed'] else ''}")
                cpr = cpu_per_request(run)
                echo("      CPU ms/request: " + "  ".join(
                    f"{k} {cpr[k]:.1f}" for k in ("api", "engine", "workers", "daemon", "subscriber") if k in cpr)
                    + f"  | load {run['loadavg1']:.2f}, other jobs {100 * run['foreign_cpu_s'] / (run['window_s'] * run['cpus']):.0f}% of the CPUs")
    finally:
        from vllm_tap.tools.launch import DaemonHandle

        for h in sorted(started, key=lambda h: isinstance(h, DaemonHandle)):
            try:
                h.stop()
            except Exception:
                log.exception("stopping %s", h)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(sock, ignore_errors=True)
    hook_cost = {k: hook_cost_lines(os.path.join(workdir, f"server-{k}.log")) for k in kinds if k != "plain"}
    return {"vocab": vocab, "model": asdict(spec), "model_params": spec.params(), "model_path": model_path,
            "configs": configs, "runs": runs, "summary": summarise(runs, configs, p.repeats), "hook_cost_log": hook_cost,
            "loadavg_start": load0, "loadavg_end": loadavg(), "seconds": time.time() - t_start}


RATIO_METRICS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_ms")
# CPU ms per request, by process and in sums (derived per run by cpu_per_request)
CPU_GROUPS = ("vllm", "tap", "total")
CPU_RATIO_KEYS = ("api", "engine", "workers", "vllm", "total")


def cpu_per_request(run: dict[str, Any]) -> dict[str, float]:
    """CPU milliseconds per request of one run: each process (api, engine, worker0.., daemon,
    subscriber), `workers` (all workers), `vllm` (every process of the server), `tap` (daemon +
    subscriber) and `total`; empty for results written before per-process times were kept."""
    procs = run.get("proc_cpu_s")
    if not procs or not run.get("requests"):
        return {}
    k = 1e3 / run["requests"]
    out = {role: v * k for role, v in procs.items()}
    out["workers"] = sum(v for role, v in out.items() if role.startswith("worker"))
    out["vllm"] = sum(out.get(r, 0.0) for r in ("api", "engine", "workers", "other"))
    out["tap"] = out.get("daemon", 0.0) + out.get("subscriber", 0.0)
    out["total"] = out["vllm"] + out["tap"]
    return out


def _stat(values: list[float]) -> dict[str, Any]:
    return {"median": median(values), "range": spread(values), "n": len(values)}


def summarise(runs: list[dict[str, Any]], configs: list[str], repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in configs:
        rs = [r for r in runs if r["config"] == c]
        if not rs:
            continue
        row: dict[str, Any] = {m: median(r[m] for r in rs) for m in RATIO_METRICS}
        row["bytes_per_request"] = median(r["bytes_per_request"] for r in rs)
        row["bytes_per_token"] = median(r["bytes_per_token"] for r in rs)
        row["requests"] = rs[0]["requests"]
        row["failed"] = sum(r["failed"] for r in rs)
        row["cpu_s"] = {k: median(r["cpu_s"].get(k, 0.0) for r in rs) for k in rs[0]["cpu_s"]}
        ratios: dict[str, Any] = {}
        for m in RATIO_METRICS:
            per = []
            for r in rs:
                base = [a for a in runs if a["config"] == "a" and a["repeat"] == r["repeat"]]
                if base and base[0][m] > 0:
                    per.append(r[m] / base[0][m])
            ratios[m] = {"median": median(per), "range": spread(per), "n": len(per)}
        row["ratio_to_a"] = ratios
        base_of = {a["repeat"]: a for a in runs if a["config"] == "a"}
        per_run = [(r, cpu_per_request(r)) for r in rs]
        per_run = [(r, d) for r, d in per_run if d]
        if per_run:
            roles = sorted({k for _, d in per_run for k in d})
            row["cpu_ms_per_request"] = {k: _stat([d.get(k, 0.0) for _, d in per_run]) for k in roles}
            cr: dict[str, Any] = {}
            extra: dict[str, Any] = {}
            for k in CPU_RATIO_KEYS:
                ratio, delta = [], []
                for r, d in per_run:
                    b = cpu_per_request(base_of[r["repeat"]]) if r["repeat"] in base_of else {}
                    if b.get(k, 0) > 0:
                        ratio.append(d.get(k, 0.0) / b[k])
                        delta.append(d.get(k, 0.0) - b[k])
                cr[k] = _stat(ratio)
                extra[k] = _stat(delta)
            row["cpu_ratio_to_a"] = cr
            row["cpu_extra_ms_per_request"] = extra  # minus (a)'s in the same repeat
            row["background_ms_per_request"] = _stat([1e3 * r.get("background_cpu_s", 0.0) / r["requests"] for r, _ in per_run])
            row["load"] = {
                "loadavg1": _stat([r["loadavg1"] for r, _ in per_run]),
                # share of the machine's CPUs that other jobs used during the run
                "foreign_share": _stat([r["foreign_cpu_s"] / (r["window_s"] * r["cpus"]) for r, _ in per_run
                                        if r.get("window_s") and r.get("cpus")]),
            }
        if c in CAPTURING:
            ds = [r["drain"] for r in rs]
            row["drain"] = {
                "complete_captures": sum(d["complete"] for d in ds), "captures": sum(d["expected_captures"] for d in ds),
                "positions": sum(d["positions"] for d in ds), "expected_positions": sum(d["expected_positions"] for d in ds),
                "missing": sum(d["missing"] for d in ds), "gb": sum(d["bytes"] for d in ds) / 1e9,
                "lag_s": median(d["lag_s"] for d in ds), "ring_drops": sum(max(r.get("ring_drops", 0), 0) for r in rs),
                "gb_per_s": median(d["bytes"] / r["wall_s"] / 1e9 for d, r in zip(ds, rs)),
            }
        out[c] = row
    if "c" in out and "d" in out:
        per = []
        for r in (x for x in runs if x["config"] == "c"):
            d = [x for x in runs if x["config"] == "d" and x["repeat"] == r["repeat"]]
            if d and d[0]["tok_s"] > 0:
                per.append(r["tok_s"] / d[0]["tok_s"])
        out["c_over_d"] = {"median": median(per), "range": spread(per)}
    if "t" in out and "e" in out:  # small preset: the tap's top-20 at least as fast as vLLM's own
        per = []
        for r in (x for x in runs if x["config"] == "t"):
            e = [x for x in runs if x["config"] == "e" and x["repeat"] == r["repeat"]]
            if e and e[0]["tok_s"] > 0:
                per.append(r["tok_s"] / e[0]["tok_s"])
        out["t_over_e"] = {"median": median(per), "range": spread(per)}
    return out


def run(p: ServingParams, workdir: str, echo=print) -> dict[str, Any]:
    points = []
    t0 = time.time()
    for k, vocab in enumerate(p.vocab_sizes):
        configs = p.configs if k == 0 else [c for c in p.extra_point_configs if c in CONFIGS]
        echo(f"serving: vocab {vocab}, configs {''.join(configs)}, {p.num_requests} requests x "
             f"({p.prompt_len} prompt + {p.output_len} output), concurrency {p.concurrency}, {p.repeats} repeats")
        points.append(run_point(p, vocab, configs, workdir, echo))
    return {"params": _params_dict(p), "points": points, "seconds": time.time() - t0}


def _params_dict(p: ServingParams) -> dict[str, Any]:
    d = asdict(p)
    d["model"] = asdict(p.model)
    return d
