"""Test helper: a fake engine that writes capture records like the hook does, with data a test can
recompute.

`SyntheticEngine` owns the engine ring (BEGIN/END) and one ring per rank, and runs requests step
by step: prefill in chunks, then one position per decode step, every rank writing its part of
every tensor by the record contract (tensor-parallel slices of the last dimension, pipeline stages
owning different layers, the last stage owning the logits). Every value is a function of
(scenario, request, tensor, position, column), so `expected()` knows exactly what a subscriber
must get back.

Run as a script to write a scenario from a separate process:
    python tests/support/synthetic_writer.py SHM_DIR '{"tp": 2, "n_requests": 4}' [--step-sleep S]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field

import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap.ring_records import RequestRef, RequestTable, TensorId
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_schema import BeginMeta, EndMeta, LiveMeta, spec_field
from vllm_tap.ring_writer import RingWriter
from vllm_tap.spec import CaptureSpec, LogitsMode

DTYPE_CODES = {"float32": rf.DType.FLOAT32, "float16": rf.DType.FLOAT16, "bfloat16": rf.DType.BFLOAT16}


@dataclass(frozen=True)
class Scenario:
    instance: str = "default"
    n_requests: int = 3
    prompt_len: int = 6
    gen_len: int = 4
    tp: int = 2  # ranks splitting the last dimension of every big tensor
    pp: int = 1  # pipeline stages: each owns a share of the layers, the last one the logits
    vocab: int = 64
    hidden: int = 16
    layers: tuple[int, ...] = (0, 2)
    dtype: str = "float32"
    topk: int = 0  # >0: also top-k ids/values, written whole by the last stage's first rank
    chunk: int = 4  # prefill positions per step
    ring_bytes: int = 1 << 20
    prefix: str = "req"
    seed: int = 0
    skip_rank: int | None = None  # a rank that never writes (its slices go missing)
    source: str = "client"  # the capture's source ("client" or "policy"), in the spec of the BEGIN
    model: str = "synthetic"
    tap_key: str = ""  # "" = none; else request i gets tap_key f"{tap_key}{i}"

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def end_position(self) -> int:
        return self.prompt_len + self.gen_len - 1  # the last generated token is never fed back

    def request_id(self, i: int) -> str:
        return f"{self.prefix}-{i}"

    def key(self, i: int) -> str:
        return f"{self.tap_key}{i}" if self.tap_key else ""

    def spec(self) -> CaptureSpec:
        if self.topk:
            return CaptureSpec(logits=LogitsMode.TOPK, topk=self.topk, layers=self.layers, source=self.source)
        return CaptureSpec(layers=self.layers, source=self.source)

    @classmethod
    def from_json(cls, s: str) -> "Scenario":
        d = json.loads(s)
        if "layers" in d:
            d["layers"] = tuple(d["layers"])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


# -- deterministic data --


def token_id(sc: Scenario, i: int, pos: int) -> int:
    return (sc.seed * 11 + i * 37 + pos * 13 + 5) % sc.vocab


def values(sc: Scenario, i: int, name: str, positions: np.ndarray, full_dim: int) -> np.ndarray:
    """float32 [n, full_dim]; multiples of 1/16 in [-60, 65], so exact in float16 too."""
    h = zlib.crc32(name.encode()) % 997
    p = np.asarray(positions, np.int64)[:, None]
    c = np.arange(full_dim, dtype=np.int64)[None, :]
    return ((sc.seed * 7919 + i * 104729 + h * 1009 + p * 31 + c * 7) % 2003).astype(np.float32) / 16.0 - 60.0


def topk_ids(sc: Scenario, i: int, positions: np.ndarray) -> np.ndarray:
    p = np.asarray(positions, np.int64)[:, None]
    return ((p * 17 + i * 3 + np.arange(sc.topk)[None, :] * 5) % sc.vocab).astype(np.int32)


def storage(sc: Scenario, a: np.ndarray) -> np.ndarray:
    """What goes into the ring for dtype sc.dtype (bfloat16 as raw uint16, truncated)."""
    if sc.dtype == "float16":
        return a.astype(np.float16)
    if sc.dtype == "bfloat16":
        return (a.view(np.uint32) >> 16).astype(np.uint16)
    return a


def client_view(sc: Scenario, a: np.ndarray) -> np.ndarray:
    """What a client must get back for float data written as sc.dtype."""
    if sc.dtype == "bfloat16":
        return (storage(sc, a).astype(np.uint32) << 16).view(np.float32)
    return storage(sc, a)


def tensor_names(sc: Scenario) -> list[tuple[str, TensorId, int]]:
    """(name, tensor id, full width) of everything captured per position."""
    out = [(f"hidden.{l}", TensorId(rf.TensorKind.HIDDEN, l), sc.hidden) for l in sc.layers]
    if sc.topk:
        out += [("topk_ids", TensorId(rf.TensorKind.TOPK_IDS), sc.topk), ("topk_values", TensorId(rf.TensorKind.TOPK_VALUES), sc.topk)]
    else:
        out.append(("logits", TensorId(rf.TensorKind.LOGITS), sc.vocab))
    return out


def plan(sc: Scenario) -> dict[int, list[tuple[str, TensorId, int, int, int]]]:
    """rank -> [(name, tensor, slice_start, slice_stop, full_dim)] it writes every step."""
    out: dict[int, list] = {r: [] for r in range(sc.world)}
    stage_layers = np.array_split(np.array(sc.layers, dtype=int), sc.pp) if sc.layers else [[]] * sc.pp
    for name, tid, full in tensor_names(sc):
        if tid.kind == rf.TensorKind.HIDDEN:
            stage = next(s for s, ls in enumerate(stage_layers) if tid.layer in list(ls))
        else:
            stage = sc.pp - 1
        if tid.kind in (rf.TensorKind.TOPK_IDS, rf.TensorKind.TOPK_VALUES):
            out[stage * sc.tp].append((name, tid, 0, full, full))  # small: written whole by one rank
            continue
        bounds = np.linspace(0, full, sc.tp + 1).astype(int)
        for t in range(sc.tp):
            out[stage * sc.tp + t].append((name, tid, int(bounds[t]), int(bounds[t + 1]), full))
    return out


def expected(sc: Scenario, i: int) -> dict[str, np.ndarray]:
    """Everything a subscriber must get for request i, in client dtypes."""
    pos = np.arange(sc.end_position, dtype=np.int32)
    out = {"positions": pos, "token_ids": np.array([token_id(sc, i, int(p)) for p in pos], np.int32)}
    for name, tid, full in tensor_names(sc):
        if name == "topk_ids":
            out[name] = topk_ids(sc, i, pos)
        else:
            out[name] = client_view(sc, values(sc, i, name, pos, full))
    return out


def output_token_ids(sc: Scenario, i: int) -> list[int]:
    return [token_id(sc, i, p) for p in range(sc.prompt_len, sc.prompt_len + sc.gen_len)]


def capture_arrays(cap) -> dict[str, np.ndarray]:
    """A client Capture flattened to the names `expected` uses."""
    return {k: v for k, v in cap.arrays().items()}


def assert_capture(sc: Scenario, i: int, arrays: dict[str, np.ndarray]) -> None:
    exp = expected(sc, i)
    assert sorted(arrays) == sorted(exp), (sorted(arrays), sorted(exp))
    for k, v in exp.items():
        got = arrays[k]
        assert got.dtype == v.dtype, (k, got.dtype, v.dtype)
        assert got.shape == v.shape, (k, got.shape, v.shape)
        assert got.tobytes() == v.tobytes(), f"{k} differs for request {i}"


# -- the fake engine --


@dataclass
class _Req:
    i: int
    done: int = 0  # positions computed so far
    ended: bool = False


@dataclass
class SyntheticEngine:
    sc: Scenario
    shm_dir: str
    block_timeout: float = 0.0
    engine_ring_bytes: int = 1 << 20
    group: str | None = None  # rings 0660 in this group, as the hook makes them with its "group" setting
    step: int = 0
    dropped: int = 0
    write_times: list[float] = field(default_factory=list)
    # request id -> positions whose records some rank had to drop (what the daemon must report)
    dropped_positions: dict[str, set[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sc = self.sc
        access = {"group": self.group, "mode": 0o660 if self.group else 0o600}
        self.engine = RingWriter(ring_path(self.shm_dir, sc.instance, rf.ENGINE_RANK), self.engine_ring_bytes,
                                 rank=rf.ENGINE_RANK, world_size=sc.world, **access)
        self.ranks = [RingWriter(ring_path(self.shm_dir, sc.instance, r), sc.ring_bytes, rank=r, world_size=sc.world,
                                 block_timeout=self.block_timeout, **access) for r in range(sc.world)]
        self.plan = plan(sc)
        self.reqs = [_Req(i) for i in range(sc.n_requests)]
        self.dtype_code = DTYPE_CODES[sc.dtype]

    def begin(self, which: list[int] | None = None) -> None:
        sc = self.sc
        for i in which if which is not None else range(sc.n_requests):
            meta = BeginMeta(spec=spec_field(sc.spec()), num_prompt_tokens=sc.prompt_len,
                             prompt_token_ids=[token_id(sc, i, p) for p in range(sc.prompt_len)], model=sc.model)
            self.engine.write_control(sc.request_id(i), meta, tap_key=sc.key(i))

    def run_step(self) -> bool:
        """One engine step over every unfinished request; False once all have ended."""
        sc = self.sc
        active = [r for r in self.reqs if not r.ended]
        for req in active:
            n = min(sc.chunk, sc.prompt_len - req.done) if req.done < sc.prompt_len else 1
            n = min(n, sc.end_position - req.done)
            if n > 0:
                pos = np.arange(req.done, req.done + n, dtype=np.int32)
                self.write_positions(req.i, pos)
                req.done += n
        for req in active:
            if req.done >= sc.end_position:
                self.end(req.i)
                req.ended = True
        self.step += 1
        return any(not r.ended for r in self.reqs)

    def table(self, i: int, rank_parts: int) -> RequestTable:
        """Request i's table entry, as the hook writes it: start, tail and source included."""
        sc = self.sc
        spec = sc.spec()
        return RequestTable([RequestRef(
            sc.request_id(i), sc.key(i), sc.prompt_len, len([r for r in self.plan if self.plan[r]]), rank_parts,
            start=-1 if spec.tail else spec.first_position(sc.prompt_len), tail=spec.tail, source=spec.source)])

    def write_positions(self, i: int, pos: np.ndarray, ranks: list[int] | None = None, step: int | None = None) -> None:
        sc = self.sc
        ids = np.array([token_id(sc, i, int(p)) for p in pos], np.int32)
        step = self.step if step is None else step
        rows = np.zeros((3, len(pos)), np.int32)
        rows[1] = pos
        rows[2] = ids
        for rank, parts in self.plan.items():
            if rank == sc.skip_rank or (ranks is not None and rank not in ranks):
                continue
            table = self.table(i, len(parts))
            for name, tid, s0, s1, full in parts:
                if name == "topk_ids":
                    data, code = topk_ids(sc, i, pos), rf.DType.INT32
                else:
                    data, code = storage(sc, values(sc, i, name, pos, full)[:, s0:s1]), self.dtype_code
                t = time.perf_counter()
                res = self.ranks[rank].reserve_rows(table, rows, tid, dtype=code, width=s1 - s0, slice_=(s0, s1),
                                                    full_dim=full, step=step)
                if res is not None:
                    res.payload[:] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
                    self.ranks[rank].commit(res)
                self.write_times.append(time.perf_counter() - t)
                self.dropped += res is None
                if res is None:
                    self.dropped_positions.setdefault(sc.request_id(i), set()).update(pos.tolist())

    def end(self, i: int) -> None:
        sc = self.sc
        self.engine.write_control(sc.request_id(i), EndMeta(
            reason="length", num_prompt_tokens=sc.prompt_len, num_output_tokens=sc.gen_len,
            output_token_ids=output_token_ids(sc, i), end_position=sc.end_position,
            spec=spec_field(sc.spec()), source=sc.spec().source,
        ), tap_key=sc.key(i))

    def live(self, which: list[int] | None = None) -> None:
        """A LIVE record: the requests still capturing (default: those not ended)."""
        idx = which if which is not None else [r.i for r in self.reqs if not r.ended]
        self.engine.write_control("", LiveMeta([self.sc.request_id(i) for i in idx]))

    def start_live(self, every_s: float = 1.0) -> None:
        """LIVE records from a timer, whatever the steps do (idle included), as the engine-core hook
        writes them: the requests begun and not ended."""
        self._live_stop = threading.Event()

        def tick() -> None:
            while not self._live_stop.wait(every_s):
                idx = [r.i for r in self.reqs if not r.ended]
                self.engine.write_control_if_room("", LiveMeta([self.sc.request_id(i) for i in idx]))

        self._live_thread = threading.Thread(target=tick, daemon=True)
        self._live_thread.start()

    def stop_live(self) -> None:
        if getattr(self, "_live_thread", None) is not None:
            self._live_stop.set()
            self._live_thread.join()
            self._live_thread = None

    def run(self, step_sleep: float = 0.0) -> None:
        self.begin()
        while self.run_step():
            if step_sleep:
                time.sleep(step_sleep)

    def flush(self, timeout: float = 10.0) -> bool:
        """Push queued control records (BEGIN/END/DROP) as the reader frees room."""
        deadline = time.monotonic() + timeout
        while True:
            if all(w.flush() for w in [self.engine, *self.ranks]):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def close(self, unlink: bool = False) -> None:
        self.stop_live()
        for w in [self.engine, *self.ranks]:
            w.close(unlink=unlink)


def write_scenario(shm_dir: str, sc: Scenario) -> None:
    """The whole scenario written by an engine in this process, nothing dropped (a separate writer
    process adds nothing where the test only needs the rings filled)."""
    eng = SyntheticEngine(sc, shm_dir)
    try:
        eng.run()
        assert eng.flush() and eng.dropped == 0
    finally:
        eng.close()


def write_decode_backlog(shm_dir: str, daemon, rids: list[str], spec: dict, prompt: int, steps: int,
                         sections: tuple, fill, ring_bytes: int = 16 << 20, begin_meta=None, rows_each: int = 1) -> None:
    """A backlog for a daemon to catch up on: every request's BEGIN (read before going on), then
    `steps` decode steps of all of them written while the daemon is stopped (SIGSTOP), one record a
    step with `sections`, then their ENDs; the daemon runs again after. fill(i, pos, section) -> the
    row of request i at position pos (its bytes are what the record holds); begin_meta(i) -> more
    BEGIN fields. rows_each > 1: each step holds that many positions of every request, the requests'
    rows interleaved (r0 p, r1 p, r0 p+1, r1 p+1, ...: no capture's rows lie together). Rings as a
    worker (rank 0) and its engine core write them."""
    import signal

    from waiting import wait_until

    n = len(rids)
    eng = RingWriter(ring_path(shm_dir, "default", rf.ENGINE_RANK), 1 << 20, rank=rf.ENGINE_RANK)
    w = RingWriter(ring_path(shm_dir, "default", 0), ring_bytes)
    try:
        for i, rid in enumerate(rids):
            eng.write_control(rid, BeginMeta(
                spec=spec_field(CaptureSpec.from_meta(spec)), source="client", num_prompt_tokens=prompt,
                prompt_token_ids=list(range(prompt)), model="m", **(begin_meta(i) if begin_meta else {})))
        assert eng.flush()

        def ready() -> bool:  # the BEGINs read and the worker ring found: what follows is a backlog on it
            s = daemon.status()
            return s["requests_in_flight"] == n and any(r["rank"] == 0 for r in s["rings"])

        wait_until(ready, what="every BEGIN and the worker ring")
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            table = RequestTable([RequestRef(rid, "", prompt, 1, len(sections), prompt - 1, 0, "client") for rid in rids])
            buf = np.frombuffer(w.buffer, np.uint8)
            for j in range(steps):
                slots = np.tile(np.arange(n), rows_each)
                pos = prompt - 1 + j * rows_each + np.repeat(np.arange(rows_each), n)
                rows = np.ascontiguousarray(np.array([slots, pos, slots + pos], np.int32))
                res = w.reserve_sections(table, rows, sections, step=j + 1)
                assert res is not None
                for k, (at, nb) in enumerate(res.sections):
                    buf[at : at + nb] = np.stack([fill(i, p, k) for i, p in zip(slots, pos)]).reshape(-1).view(np.uint8)
                w.commit(res)
            for rid in rids:
                eng.write_control(rid, EndMeta(
                    reason="length", num_prompt_tokens=prompt, num_output_tokens=steps * rows_each + 1,
                    end_position=prompt - 1 + steps * rows_each, spec=spec_field(CaptureSpec.from_meta(spec)),
                    source="client"))
            assert eng.flush()
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
    finally:
        w.close()
        eng.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shm_dir")
    ap.add_argument("scenario", help="Scenario fields as JSON")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--group", default=None, help="make the rings 0660 in this group (the hook's \"group\")")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="write this many steps, say so on stdout, then wait to be killed")
    args = ap.parse_args(argv)
    eng = SyntheticEngine(Scenario.from_json(args.scenario), args.shm_dir, group=args.group)
    if args.stop_after is not None:
        eng.begin()
        for _ in range(args.stop_after):
            eng.run_step()
        print(json.dumps({"pid": os.getpid(), "steps": args.stop_after}), flush=True)
        while True:
            time.sleep(3600)
    eng.run(args.step_sleep)
    ok = eng.flush()
    eng.close()
    print(json.dumps({"pid": os.getpid(), "dropped": eng.dropped, "flushed": ok}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
