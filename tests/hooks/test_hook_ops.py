"""What the step hook asks of torch per step, counted op by op on the CPU (CI has no GPU).

On a GPU a decode step lasts a few milliseconds and vLLM's step thread is on the critical path under
async scheduling: every torch op the hook issues costs host time, and some ops stall the step thread
until the device catches up. Here the real capture core, the staged publisher (the CUDA path's
logic, with the publisher thread standing in for the copy stream) and the V1 and V2 adapters run
over stand-in steps under a TorchDispatchMode that records every op the step thread issues:
- none of the ops that synchronise a CUDA device when their tensors live there (reading a scalar,
  nonzero, masked_select, boolean tests, pinned allocations, ...);
- nobody capturing: no op at all, whatever the batch;
- capturing: the same ops for 8 and 64 requests (decode, and a step with prefill chunks), a fixed
  number more per extra tensor kind (one gather), and one device-to-host copy per record, not per
  tensor;
- a steady decode step (hooks/steady_step.py: the batch unchanged, every capturing request one row)
  is one record of a few ops, the same at 8, 32 and 128 requests: full logits + 2 layers at most 6,
  top-20 at most 8, and one device-to-host copy.
"""

from __future__ import annotations

import collections
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_runner_adapters import TinyModel, V1Runner, V2Runner, scheduler_outputs
from vllm_tap.hooks import runner_v1, runner_v2
from vllm_tap.hooks.capture_core import CaptureCore, RankPlace, StepView
from vllm_tap.hooks.publisher import FIXED_BLOCKS, HostBackend, StagedPublisher
from vllm_tap.hooks.settings import SPEC_EXTRA_ARG
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_writer import RingWriter
from vllm_tap.spec import CaptureSpec, LogitsMode, PositionsMode

# Ops that make the host wait for a CUDA device (or allocate page-locked memory) when the tensors
# involved live on it.
SYNCING = {"_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "_unique2",
           "unique_consecutive", "_pin_memory", "pin_memory", "tolist", "masked_scatter", "repeat_interleave"}
VOCAB, HIDDEN, LAYERS = 64, 32, (1, 2, 3)


class OpLog(TorchDispatchMode):
    """Every aten op issued on this thread while active (the publisher thread's are not: they
    stand for the copy stream)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class CountingBackend(HostBackend):
    """HostBackend counting the device-to-host copies queued per step."""

    def __init__(self):
        self.copies: list[int] = []

    def copy_after_compute(self, pairs):
        self.copies.append(len(pairs))
        return super().copy_after_compute(pairs)


def _spec(kinds: int) -> dict:
    """A spec asking for `kinds` tensor kinds: full logits, then 1 or 2 hidden layers."""
    spec = CaptureSpec(layers=LAYERS[: kinds - 1]) if kinds > 1 else CaptureSpec(layers=())
    return {SPEC_EXTRA_ARG: spec.to_meta()}


class Batch:
    """n requests: the first `prefill` run a prefill chunk of 4 rows, the rest decode one row."""

    def __init__(self, n: int, prefill: int = 0, seed: int = 0, dtype: torch.dtype = torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.rids = [f"r{i}" for i in range(n)]
        sched = [4] * prefill + [1] * (n - prefill)
        self.qsl = np.zeros(n + 1, np.int32)
        np.cumsum(sched, out=self.qsl[1:])
        rows = int(self.qsl[-1])
        self.computed = np.array([0] * prefill + [20] * (n - prefill), np.int32)
        self.weight = torch.randn(VOCAB, HIDDEN, generator=g).to(dtype)
        self.hidden = torch.randn(rows, HIDDEN, generator=g).to(dtype)
        self.aux = [torch.randn(rows, HIDDEN, generator=g).to(dtype) for _ in LAYERS]
        self.ids = torch.randint(0, VOCAB, (rows,), dtype=torch.int32, generator=g)  # on the "device"
        self.logits = self.hidden[torch.from_numpy(self.qsl[1:] - 1).long()] @ self.weight.T

    def view(self) -> StepView:
        return StepView(self.rids, self.qsl, self.computed, self.ids, self.hidden, self.aux, self.logits,
                        lambda h: h @ self.weight.T, row_of={r: i for i, r in enumerate(self.rids)})


def _ops_per_step(shm, n: int, kinds: int = 3, prefill: int = 0, steps: int = 3, spec: dict | None = None,
                  dtype: torch.dtype = torch.float32):
    """Ops the step thread issued in each capturing step after the first (which plans the batch), and
    the device-to-host copies queued per step."""
    writer = RingWriter(f"{shm}/ops-{n}-{kinds}-{prefill}/rank-00000.ring", 8 << 20, wake_daemon=False)
    backend = CountingBackend()
    pub = StagedPublisher(writer, backend, 2 << 20)
    core = CaptureCore(writer, RankPlace(stage_layers=(LAYERS,)), pub, model_dtype=dtype)
    batch = Batch(n, prefill, dtype=dtype)
    for rid in batch.rids:
        core.learn(rid, spec or _spec(kinds), 10)
    logs = []
    reader = RingReader(writer.path)
    try:
        for k in range(steps):
            with OpLog() as log:
                core.capture(batch.view())
            logs.append(log.ops)
            pub.drain()
            assert reader.poll(), "the step wrote nothing"
            batch.computed += np.diff(batch.qsl)
    finally:
        reader.close()
        core.close()
        writer.close(unlink=True)
    return logs[1:], backend.copies[1:]


def _syncing(ops) -> set[str]:
    return {op for op in ops if op in SYNCING}


@pytest.mark.parametrize("prefill", [0, 2], ids=["decode", "with-prefill-chunks"])
def test_a_capturing_step_issues_the_same_ops_for_8_and_64_requests(shm, prefill):
    small, small_copies = _ops_per_step(shm, 8, prefill=prefill)
    large, large_copies = _ops_per_step(shm, 64, prefill=prefill)
    for ops in small + large:
        assert not _syncing(ops), f"ops that wait for the device: {_syncing(ops)}"
    assert collections.Counter(small[-1]) == collections.Counter(large[-1])
    assert small_copies == large_copies


@pytest.mark.parametrize("prefill", [0, 2], ids=["steady-decode", "with-prefill-chunks"])
def test_each_extra_tensor_kind_costs_one_gather_and_every_record_one_copy(shm, prefill):
    """Full logits, then + one hidden layer, then + two: each layer adds one gather (a steady decode
    step: into its record's staging block, whose views are kept; else also a view of the step's
    staging), and the device-to-host copies stay one per record, not one per tensor: one a steady
    step (its states and logits are one record), two otherwise (the states, the logits)."""
    counts = {}
    for kinds in (1, 2, 3):
        logs, copies = _ops_per_step(shm, 8, kinds=kinds, prefill=prefill, steps=FIXED_BLOCKS + 3)
        counts[kinds] = len(logs[-1])
        assert set(copies) == {1 if kinds == 1 or not prefill else 2}, copies
    if not prefill:
        assert counts[2] - counts[1] == counts[3] - counts[2] == 1
    else:
        # A second record (the states): its ids (a view, a gather), the views its one copy moves
        # between, its one section (a view, a gather).
        assert counts[2] - counts[1] <= 6
        assert counts[3] - counts[2] <= 2  # another section: one view, one gather


STEADY_SPECS = {
    "full-logits+2-layers": (CaptureSpec(layers=LAYERS[:2]), 6),
    "top-20": (CaptureSpec(logits=LogitsMode.TOPK, topk=20, layers=(), positions=PositionsMode.OUTPUT), 8),
    "layers-only": (CaptureSpec(logits=LogitsMode.NONE, layers=LAYERS[:2]), 6),
}


@pytest.mark.parametrize("what", list(STEADY_SPECS))
def test_a_steady_decode_step_is_a_few_torch_calls_whatever_the_batch(shm, what):
    """bfloat16, token ids on the "device", every request capturing, the batch unchanged: the same
    few ops on the step thread at 8, 32 and 128 requests, none syncing, and the record's one
    device-to-host copy a step (which a CUDA step thread issues as one more call)."""
    spec, most = STEADY_SPECS[what]
    per_batch = {}
    for n in (8, 32, 128):
        # Past the first lap of the record's staging blocks, whose views are made on first use.
        logs, copies = _ops_per_step(shm, n, spec={SPEC_EXTRA_ARG: spec.to_meta()}, dtype=torch.bfloat16,
                                     steps=FIXED_BLOCKS + 3)
        for ops in logs:
            assert not _syncing(ops), f"ops that wait for the device: {_syncing(ops)}"
        assert set(copies) == {1}, copies
        per_batch[n] = collections.Counter(logs[-1])
        assert logs[-1] == logs[-2], "every steady step issues the same ops"
    assert per_batch[8] == per_batch[32] == per_batch[128], per_batch
    assert sum(per_batch[8].values()) <= most, per_batch[8]


def _run_adapter(kind: str, shm: str, capture: bool):
    """The V1 or V2 stand-in runner (test_runner_adapters) through its scheduler script, staged
    publisher; the op log of each sample_tokens (the step hook)."""
    cls = type("R", (V1Runner if kind == "v1" else V2Runner,), {})
    (runner_v1.patch_gpu_module if kind == "v1" else runner_v2.patch_v2_module)(SimpleNamespace(GPUModelRunner=cls))
    model = TinyModel()
    runner = cls(model)
    writer = RingWriter(f"{shm}/{kind}-{capture}/rank-00000.ring", 1 << 20, wake_daemon=False)
    pub = StagedPublisher(writer, HostBackend(), 1 << 18)
    core = CaptureCore(writer, RankPlace(stage_layers=((0, 2),)), pub, model_dtype=torch.float32)
    model.set_aux_hidden_state_layers((0, 2))
    runner.use_aux_hidden_state_outputs = True
    runner._vllm_tap_loaded, runner._vllm_tap = True, core
    logs = []
    try:
        for so in scheduler_outputs():
            if not capture:
                for new in so.scheduled_new_reqs:
                    new.sampling_params.extra_args = None
            runner.execute_model(so)
            with OpLog() as log:
                runner.sample_tokens(None)
            logs.append([op for op in log.ops])
    finally:
        core.close()
        writer.close(unlink=True)
    return logs, model


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_with_nobody_capturing_the_step_hook_issues_no_op(shm, kind):
    """The runner's own sample_tokens issues its ops; the hook adds none (V2's once sliced the
    step's input ids on the device every step to build a view it then threw away)."""
    with_tap, _ = _run_adapter(kind, shm, capture=False)
    cls = type("Plain", (V1Runner if kind == "v1" else V2Runner,), {})
    plain = cls(TinyModel())
    plain.model.set_aux_hidden_state_layers((0, 2))
    plain.use_aux_hidden_state_outputs = True
    without = []
    for so in scheduler_outputs():
        for new in so.scheduled_new_reqs:
            new.sampling_params.extra_args = None
        plain.execute_model(so)
        with OpLog() as log:
            plain.sample_tokens(None)
        without.append(log.ops)
    assert with_tap == without


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_the_adapters_issue_no_syncing_op_while_capturing(shm, kind):
    logs, _ = _run_adapter(kind, shm, capture=True)
    for step, ops in enumerate(logs):
        assert not _syncing(ops), f"step {step}: {_syncing(ops)}"


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_the_worker_counts_the_host_time_of_capturing_steps_only(shm, kind, caplog):
    """Its own count is the only measure of the hook's cost on a GPU (no CPU benchmark shows it):
    every capturing step is counted, no step in which nobody captures, and the report is one line."""
    cls = type("R", (V1Runner if kind == "v1" else V2Runner,), {})
    (runner_v1.patch_gpu_module if kind == "v1" else runner_v2.patch_v2_module)(SimpleNamespace(GPUModelRunner=cls))
    for capture, want in ((False, 0), (True, len(list(scheduler_outputs())))):
        model = TinyModel()
        runner = cls(model)
        writer = RingWriter(f"{shm}/cost-{kind}-{capture}/rank-00000.ring", 1 << 20, wake_daemon=False)
        core = CaptureCore(writer, RankPlace(stage_layers=((0, 2),)), StagedPublisher(writer, HostBackend(), 1 << 18),
                           model_dtype=torch.float32)
        model.set_aux_hidden_state_layers((0, 2))
        runner.use_aux_hidden_state_outputs = True
        runner._vllm_tap_loaded, runner._vllm_tap = True, core
        try:
            for so in scheduler_outputs():
                if not capture:
                    for new in so.scheduled_new_reqs:
                        new.sampling_params.extra_args = None
                runner.execute_model(so)
                runner.sample_tokens(None)
            core.publisher.drain()
            summary = core.cost.summary()
            assert summary["steps"] == want
            if capture:
                assert 0 < summary["mean_us"] <= summary["max_us"] and summary["p50_us"] <= summary["p99_us"]
                with caplog.at_level("INFO", logger="vllm_tap.hooks"):
                    core.cost.report()
                (line,) = [r.getMessage() for r in caplog.records if "hook host time" in r.getMessage()]
                assert f"{want} capturing steps" in line and "publisher thread" in line
        finally:
            core.close()
            writer.close(unlink=True)
