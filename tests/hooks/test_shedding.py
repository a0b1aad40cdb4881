"""Shedding whole captures when the daemon falls behind: the real capture core, the real staged
(CUDA-path) publisher with the host backend, real rings, and a real daemon process that is stopped
(SIGSTOP) so its worker ring fills, then resumed.

What must hold: a capture that starts while the worker's ring is more than half full comes back
with exactly one gap, reason `overloaded`, covering its expected positions and nothing else, and it
is counted (the ring header, the daemon's status, the worker's log line); captures admitted before
keep going and come back complete; once the daemon has caught up, new captures are admitted and
complete again. Without admission, a capture started under overload was taken on and, when the
ring ran full, its rows and those of every capture in flight were dropped.
"""

from __future__ import annotations

import logging
import os
import signal

import numpy as np
import torch

from vllm_tap import ring_format as rf
from vllm_tap.cli.commands import _status_text
from vllm_tap.status_format import from_map
from vllm_tap.hooks.capture_core import CaptureCore, RankPlace, StepView
from vllm_tap.hooks.publisher import HostBackend, StagedPublisher, staging_bytes
from vllm_tap.hooks.settings import SPEC_EXTRA_ARG
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_writer import RingWriter
from vllm_tap.spec import CaptureSpec, LogitsMode
from vllm_tap.ring_schema import BeginMeta, EndMeta, spec_field
from waiting import wait_until

HIDDEN, VOCAB, LAYERS = 32, 1024, (1, 3)
PROMPT = 8
SPEC = CaptureSpec(logits=LogitsMode.FULL, layers=LAYERS)
RING_BYTES = 2 << 20


def _read_up(d) -> bool:
    """The daemon has read everything its rings hold: its own cursors (a ring file's stays below
    records whose data the daemon still holds unfiled, the newest step of a decode)."""
    rings = d.status()["rings"]
    return bool(rings) and all(r["pending_bytes"] == 0 for r in rings)


def _unread(writer: RingWriter) -> int:
    """Bytes the writer committed that the daemon has not read (straight from the ring header)."""
    mm = writer.buffer
    w = int.from_bytes(mm[rf.WRITE_CURSOR_OFFSET : rf.WRITE_CURSOR_OFFSET + 8], "little")
    r = int.from_bytes(mm[rf.READ_CURSOR_OFFSET : rf.READ_CURSOR_OFFSET + 8], "little")
    return w - r


class _Worker:
    """The engine ring (BEGIN/END as the engine-core hook writes them) and the workers of one engine
    (a CaptureCore + StagedPublisher into its ring per tensor-parallel rank, each with its shed_at)
    stepping a batch: prompts in one prefill chunk, then one position per decode step."""

    def __init__(self, shm_dir: str, shed_at: tuple[float, ...] = (0.5,)):
        self.engine = RingWriter(ring_path(shm_dir, "default", rf.ENGINE_RANK), 4 << 20, rank=rf.ENGINE_RANK)
        tp = len(shed_at)
        self.writers = [RingWriter(ring_path(shm_dir, "default", i), RING_BYTES, rank=i, world_size=tp)
                        for i in range(tp)]
        self.writer = self.writers[0]
        self.cores = [CaptureCore(w, RankPlace(i, tp, stage_layers=(LAYERS,)),
                                  StagedPublisher(w, HostBackend(), staging_bytes(RING_BYTES)),
                                  model_dtype=torch.float32, shed_at=at)
                      for i, (w, at) in enumerate(zip(self.writers, shed_at))]
        self.core = self.cores[0]
        self.weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1))
        self.gen = torch.Generator().manual_seed(2)
        self.running: list[dict] = []

    def unread(self) -> int:
        return max(_unread(w) for w in self.writers)

    def begin(self, rid: str, gen_len: int) -> None:
        for core in self.cores:
            core.learn(rid, {SPEC_EXTRA_ARG: SPEC.to_meta()}, PROMPT)
        self.engine.write_control(rid, BeginMeta(
            spec=spec_field(SPEC), source=SPEC.source, num_prompt_tokens=PROMPT,
            prompt_token_ids=list(range(PROMPT)), model="m"))
        self.running.append({"id": rid, "done": 0, "gen": gen_len})

    def step(self) -> None:
        scheduled = [PROMPT if r["done"] == 0 else 1 for r in self.running]
        qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
        n_rows = int(qsl[-1])
        hidden = torch.randn(n_rows, HIDDEN, generator=self.gen)
        aux = [torch.randn(n_rows, HIDDEN, generator=self.gen) for _ in LAYERS]
        view = StepView(req_ids=[r["id"] for r in self.running], query_start=qsl,
                        computed=np.array([r["done"] for r in self.running], np.int32),
                        token_ids=torch.randint(0, VOCAB, (n_rows,), dtype=torch.int32, generator=self.gen),
                        hidden=hidden, aux=aux, logits=None, compute_logits=lambda h: h @ self.weight.T)
        for core in self.cores:  # every rank sees the same batch and shards it
            step = core.begin(view)
            if step is not None:
                step.write_states()
                step.write_logits(hidden[qsl[1:] - 1] @ self.weight.T)
                core.end(step)
            core.publisher.drain()
        for r, n in zip(self.running, scheduled):
            r["done"] += n
        for r in [r for r in self.running if r["done"] >= PROMPT + r["gen"] - 1]:
            for core in self.cores:
                core.forget(r["id"])
            self.engine.write_control(r["id"], EndMeta(
                reason="length", num_prompt_tokens=PROMPT, num_output_tokens=r["gen"],
                output_token_ids=list(range(r["gen"])), end_position=PROMPT + r["gen"] - 1,
                spec=spec_field(SPEC), source=SPEC.source))
            self.running.remove(r)

    def close(self) -> None:
        for core, w in zip(self.cores, self.writers):
            core.close()
            w.close(unlink=True)
        self.engine.close(unlink=True)


def _one_overloaded_gap(client, rid: str, stop: int) -> None:
    items = list(client.subscribe(rid, timeout=30).chunks())
    assert [(type(i).__name__, getattr(i, "positions", None), getattr(i, "reason", None)) for i in items] == \
        [("Gap", range(0, stop), "overloaded")], (rid, items)
    cap = client.fetch(rid, timeout=30)
    assert not cap.complete and cap.missing_positions.ranges == [(0, stop)], rid
    assert len(cap.positions) == 0


def test_captures_learned_while_the_ring_is_over_half_full_are_shed_whole_and_admission_resumes(
        daemon_factory, shm_dir, caplog):
    d = daemon_factory(end_grace_s=1.0)
    w = _Worker(shm_dir)
    early = [f"early-{i}" for i in range(4)]
    shed = [f"shed-{i}" for i in range(3)]
    late = [f"late-{i}" for i in range(3)]
    try:
        for rid in early:
            w.begin(rid, gen_len=120)
        for _ in range(3):  # at a pace the daemon keeps up with
            w.step()
            wait_until(lambda: _read_up(d), 30, "the daemon to read a step")
        os.kill(d.proc.pid, signal.SIGSTOP)  # the daemon falls behind
        try:
            while _unread(w.writer) < RING_BYTES * 0.6:
                assert w.running, "the early captures must fill the ring"
                w.step()
            for rid in shed:
                w.begin(rid, gen_len=4)
            while any(r["id"] in shed for r in w.running):  # they run to their END, overloaded
                w.step()
            assert w.writer.stats()["records_dropped"] == 0, "the early captures must fit"
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        wait_until(lambda: _read_up(d), 30, "the daemon to catch up")
        for rid in late:
            w.begin(rid, gen_len=6)
        while w.running:
            w.step()
            wait_until(lambda: _read_up(d), 30, "the daemon to read a step")
        client = d.client()
        for rid in early + late:
            cap = client.fetch(rid, timeout=30)
            assert cap.complete, (rid, cap.missing_positions.ranges)
        for rid in shed:
            _one_overloaded_gap(client, rid, PROMPT + 4 - 1)
        st = d.status()
        ring = next(r for r in st["rings"] if r["rank"] == 0)
        assert ring["writer"]["captures_shed"] == 3
        assert st["drops"]["captures_shed"] == 3
        assert st["drops"]["records"] == 0
        assert "3 captures shed" in _status_text(from_map(st))  # what `vllm-tap status` prints
        with caplog.at_level(logging.INFO, logger="vllm_tap.hooks"):
            w.core.cost.report()
        assert "3 captures shed" in caplog.text, caplog.text
    finally:
        w.close()


def test_a_capture_one_tensor_parallel_rank_sheds_and_another_admits_is_one_overloaded_gap(daemon_factory, shm_dir):
    """Ranks decide from their own rings and may disagree: here rank 0 sheds only when its ring is
    full, rank 1 at half. A capture learned while both are over half unread is admitted by rank 0,
    which writes its slices, and shed by rank 1: the daemon delivers one Gap `overloaded`, not a
    run of `incomplete` positions, and the captures both ranks admitted are complete."""
    d = daemon_factory(end_grace_s=1.0)
    w = _Worker(shm_dir, shed_at=(1.0, 0.5))
    try:
        early = [f"early-{i}" for i in range(8)]
        for rid in early:
            w.begin(rid, gen_len=100)
        w.step()
        wait_until(lambda: _read_up(d), 30, "the daemon to read the first step")
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            while w.unread() < RING_BYTES * 0.6:
                assert w.running, "the early captures must fill the rings"
                w.step()
            w.begin("split", gen_len=4)
            assert "split" in w.cores[0].requests and "split" not in w.cores[1].requests
            while any(r["id"] == "split" for r in w.running):
                w.step()
            assert all(wr.stats()["records_dropped"] == 0 for wr in w.writers)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        while w.running:
            w.step()
            wait_until(lambda: _read_up(d), 30, "the daemon to read a step")
        client = d.client()
        _one_overloaded_gap(client, "split", PROMPT + 4 - 1)
        for rid in early:
            assert client.fetch(rid, timeout=30).complete, rid
        st = d.status()
        assert [r["writer"]["captures_shed"] for r in sorted(st["rings"], key=lambda r: r["rank"]) if r["rank"] >= 0] == [0, 1]
        assert st["drops"]["captures_shed"] == 1
    finally:
        w.close()
