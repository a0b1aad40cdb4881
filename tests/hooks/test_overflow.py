"""A burst of drops, as a GPU server makes when its captures outrun the daemon: the real staged
(CUDA-path) publisher with the host backend, a synthetic load shaped like vLLM's V2 runner (64
requests decoding at once, some starting every step, top-k, hidden layers and full logits, the
token ids gathered on the "device"), a small ring, and a reader that stops for a while and then
catches up. Real rings, the real ring reader and the daemon's reassembler, no vLLM.

What must hold: a capture hit by the burst carries exactly its dropped positions as gaps `dropped`
(every other position delivered, with the values written), a capture that starts while the ring is
over half unread is shed whole (one gap `overloaded`, hooks/admission.py), and captures that start
after the reader is back are complete again. Before the staged publisher gave back the staging of records
the ring refused, one burst left its staging buffer full for good and every later capture came
with no positions at all.
"""

from __future__ import annotations

import collections
import time

import numpy as np
import pytest
import torch

from vllm_tap import ring_format as rf
from vllm_tap.daemon.events import DROPPED, OVERLOADED, End, Gap, Tokens
from vllm_tap.daemon.reassembly import Reassembler
from vllm_tap.hooks.capture_core import CaptureCore, RankPlace, StepView
from vllm_tap.hooks.publisher import HostBackend, StagedPublisher, staging_bytes
from vllm_tap.hooks.settings import SPEC_EXTRA_ARG
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_writer import RingWriter
from vllm_tap.spec import CaptureSpec, LogitsMode, PositionsMode
from vllm_tap.ring_schema import BeginMeta, EndMeta, spec_field

HIDDEN, VOCAB, LAYERS = 32, 1024, (1, 3)
PROMPT, GEN, CONCURRENCY = 8, 12, 64
SPECS = [CaptureSpec(logits=LogitsMode.TOPK, topk=20, positions=PositionsMode.OUTPUT),
         CaptureSpec(layers=LAYERS),
         CaptureSpec(logits=LogitsMode.FULL, positions=PositionsMode.OUTPUT)]


class _Load:
    """The engine (BEGIN/END in the engine ring, as the engine-core hook writes them) and one worker
    (CaptureCore + StagedPublisher into its ring), stepping a V2-shaped batch: a finished request
    is replaced at once by a new one, whose prompt is one prefill chunk in the same step."""

    def __init__(self, shm_dir: str, ring_bytes: int):
        self.engine = RingWriter(ring_path(shm_dir, "default", rf.ENGINE_RANK), 4 << 20, rank=rf.ENGINE_RANK,
                                 wake_daemon=False)
        self.writer = RingWriter(ring_path(shm_dir, "default", 0), ring_bytes, rank=0, wake_daemon=False)
        self.publisher = StagedPublisher(self.writer, HostBackend(), staging_bytes(ring_bytes))
        self.core = CaptureCore(self.writer, RankPlace(stage_layers=(LAYERS,)), self.publisher,
                                model_dtype=torch.float32)
        self.weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1))
        self.gen = torch.Generator().manual_seed(2)
        self.running: list[dict] = []
        self.started: dict[str, int] = {}  # request id -> step it started at
        self.specs: dict[str, CaptureSpec] = {}
        self.written: dict[tuple[str, str, int], np.ndarray] = {}  # (request, tensor, position) -> row
        self.n = 0
        self.step = 0

    def _begin(self) -> None:
        rid, spec = f"q{self.n}", SPECS[self.n % len(SPECS)]
        gen_len = GEN + (self.n * 7) % 13  # requests end at different steps, as they do under load
        self.n += 1
        self.core.learn(rid, {SPEC_EXTRA_ARG: spec.to_meta()}, PROMPT)
        self.engine.write_control(rid, BeginMeta(
            spec=spec_field(spec), source=spec.source, num_prompt_tokens=PROMPT,
            prompt_token_ids=list(range(PROMPT)), model="m"))
        self.running.append({"id": rid, "spec": spec, "done": 0, "gen": gen_len})
        self.started[rid] = self.step
        self.specs[rid] = spec

    def _end(self, r: dict) -> None:
        self.core.forget(r["id"])
        self.engine.write_control(r["id"], EndMeta(
            reason="length", num_prompt_tokens=PROMPT, num_output_tokens=r["gen"],
            output_token_ids=list(range(r["gen"])), end_position=PROMPT + r["gen"] - 1,
            spec=spec_field(r["spec"]), source=r["spec"].source))

    def run_step(self, admit: bool) -> None:
        while admit and len(self.running) < CONCURRENCY:
            self._begin()
        scheduled = [PROMPT if r["done"] == 0 else 1 for r in self.running]
        qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
        n_rows = int(qsl[-1])
        hidden = torch.randn(n_rows, HIDDEN, generator=self.gen)
        aux = [torch.randn(n_rows, HIDDEN, generator=self.gen) for _ in LAYERS]
        sampled = hidden[qsl[1:] - 1] @ self.weight.T
        for i, r in enumerate(self.running):  # what each request's capture must read back
            for row in range(int(qsl[i]), int(qsl[i + 1])):
                p = r["done"] + row - int(qsl[i])
                if r["spec"].layers:
                    for k, layer in enumerate(LAYERS):
                        self.written[(r["id"], f"hidden.{layer}", p)] = aux[k][row].numpy()
                if r["spec"].logits == LogitsMode.FULL and row == int(qsl[i + 1]) - 1:
                    self.written[(r["id"], "logits", p)] = sampled[i].numpy()
        view = StepView(req_ids=[r["id"] for r in self.running], query_start=qsl,
                        computed=np.array([r["done"] for r in self.running], np.int32),
                        token_ids=torch.randint(0, VOCAB, (n_rows,), dtype=torch.int32, generator=self.gen),
                        hidden=hidden, aux=aux, logits=None, compute_logits=lambda h: h @ self.weight.T)
        step = self.core.begin(view)
        if step is not None:  # V2: hidden states first, the logits when sample() has them
            step.write_states()
            step.write_logits(sampled)
            self.core.end(step)
        self.publisher.drain()  # the "DMA" of this step is done before the next step (a GPU's pace)
        for r, n in zip(self.running, scheduled):
            r["done"] += n
        for r in [r for r in self.running if r["done"] >= PROMPT + r["gen"] - 1]:
            self._end(r)
            self.running.remove(r)
        self.step += 1

    def close(self) -> None:
        self.core.close()
        self.engine.close(unlink=True)
        self.writer.close(unlink=True)


class _Daemon:
    """The daemon's reading side in this process: the rings' readers and the reassembler."""

    def __init__(self, shm_dir: str):
        self.paths = [ring_path(shm_dir, "default", rf.ENGINE_RANK), ring_path(shm_dir, "default", 0)]
        self.readers: list[RingReader] = []
        self.reasm = Reassembler("default")
        self.events: dict[str, list] = collections.defaultdict(list)
        self.drop_reports: dict[str, set[int]] = collections.defaultdict(set)

    def poll(self) -> None:
        if not self.readers:
            self.readers = [RingReader(p) for p in self.paths]  # engine ring first, as the daemon reads
        now = time.monotonic()
        for reader in self.readers:
            for rec in reader.poll():
                if rec.kind == rf.RecordKind.DROP:
                    self.drop_reports[rec.request_id].update(rec.control.positions)
                self._file(self.reasm.feed(rec, now))
        self._file(self.reasm.tick(now))

    def _file(self, events) -> None:
        for ev in events:
            self.events[ev.request_id].append(ev)

    def close(self) -> None:
        for r in self.readers:
            r.close()


@pytest.mark.parametrize("burst", [(15, 35)], ids=["reader-away-20-steps"])
def test_after_a_burst_of_drops_later_captures_are_whole_and_hit_ones_carry_exactly_their_drops(shm_dir, burst):
    load = _Load(shm_dir, ring_bytes=2 << 20)
    daemon = _Daemon(shm_dir)
    away_from, back_at = burst
    try:
        for k in range(140):
            load.run_step(admit=k < 110)
            if not away_from <= k < back_at:
                daemon.poll()
        while load.running:  # the last requests run to their END
            load.run_step(admit=False)
            daemon.poll()
        for _ in range(100):
            load.writer.flush()
            daemon.poll()
            if not daemon.reasm.in_flight():
                break
            time.sleep(0.02)
        stats = load.writer.stats()
        assert stats["records_dropped"] > 0, "the burst must overflow the ring"
        assert daemon.reasm.in_flight() == 0
        hit = whole_after = shed = 0
        for rid, started in load.started.items():
            evs = daemon.events[rid]
            (end,) = [e for e in evs if isinstance(e, End)]
            assert end.reason == "length", (rid, end.reason)
            start, stop = end.expected
            delivered: dict[int, dict[str, np.ndarray]] = {}
            for ev in evs:
                if isinstance(ev, Tokens):
                    for j, p in enumerate(ev.positions.tolist()):
                        delivered[p] = {name: a[j] for name, a in ev.tensors.items()}
            gaps = {p: ev.reason for ev in evs if isinstance(ev, Gap) for p in ev.positions}
            assert sorted([*delivered, *gaps]) == list(range(start, stop)), rid  # every position once
            if OVERLOADED in gaps.values():  # learned while the ring was over half unread: shed whole
                assert [(e.positions, e.reason) for e in evs if isinstance(e, (Gap, Tokens))] == \
                    [(range(start, stop), OVERLOADED)], rid
                assert started >= away_from, (rid, started)
                shed += 1
                continue
            # A missing position is one the writer dropped and said so, and the gap says `dropped`.
            assert set(gaps.values()) <= {DROPPED}, (rid, collections.Counter(gaps.values()))
            assert set(gaps) <= daemon.drop_reports[rid], rid
            assert list(end.missing_positions) == sorted(gaps), rid
            for p, tensors in delivered.items():  # and what came is what was written
                for name, row in tensors.items():
                    want = load.written.get((rid, name, p))
                    if want is not None:
                        np.testing.assert_array_equal(row, want, err_msg=f"{rid} {name} {p}")
            if started > back_at:
                assert end.complete, (rid, started, len(gaps), end.delivered)
                whole_after += 1
            hit += bool(gaps)
        assert hit > 0 and whole_after > 100 and shed > 0
    finally:
        daemon.close()
        load.close()
