"""A DATA record of whole tensors read into one block (the daemon's way) must give exactly the
events its slices give one by one, each fed as a record of its own: the same Tokens (positions, ids, values),
Gaps (reasons), Begins and Ends, the same bytes held and the same counters, whatever the order of
positions, duplicates, recomputes, prefill chunks, ENDs and DROPs. The records are written by the
real ring writer and read back by the real reader, once each way."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_tap import ring_format as rf
from vllm_tap.daemon import step_runs
from vllm_tap.daemon.events import Begin, End, Gap, Tokens
from vllm_tap.daemon.reassembly import ENGINE_SOURCE, Reassembler
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_records import DataRecord, RequestRef, RequestTable, TensorId, per_tensor
from vllm_tap.ring_schema import BeginMeta, DropMeta, EndMeta, control_record, spec_field
from vllm_tap.ring_writer import RingWriter
from vllm_tap.spec import CaptureSpec

from slices import record_of

N_PROMPT = 4
LOGITS = TensorId(rf.TensorKind.LOGITS)
HIDDEN = TensorId(rf.TensorKind.HIDDEN, 1)


def _sections(vocab: int, hidden: int) -> tuple:
    return ((LOGITS, rf.DType.FLOAT32, vocab, (0, vocab), vocab), (HIDDEN, rf.DType.FLOAT32, hidden, (0, hidden), hidden))


def _begin(rid: str, async_scheduling: bool | None) -> object:
    return control_record(BeginMeta(spec=spec_field(CaptureSpec()), num_prompt_tokens=N_PROMPT,
                                    prompt_token_ids=list(range(N_PROMPT)), model="m",
                                    async_scheduling=async_scheduling), rid)


def _end(rid: str, end_position: int) -> object:
    n_out = max(end_position - N_PROMPT + 1, 0)
    return control_record(EndMeta(reason="stop", num_prompt_tokens=N_PROMPT, num_output_tokens=n_out,
                                  output_token_ids=[7] * n_out, end_position=end_position), rid)


def _drop(rid: str, positions: list[int]) -> object:
    return control_record(DropMeta(int(rf.TensorKind.LOGITS), -1, positions), rid, rank=0, ring="rank-00000.ring")


class _Blocks:
    """A destination that hands out heap blocks and keeps them (to check where payloads went)."""

    def __init__(self) -> None:
        self.buffers: list[np.ndarray] = []

    def block(self, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes, np.uint8)
        self.buffers.append(buf)
        return buf

    def columns(self, *args) -> None:
        return None


class _Rings:
    """One rank ring, written by the real writer and read by two readers: one reading whole records
    into blocks (the daemon's way), one whose records are fed one slice (request and tensor) at a time."""

    def __init__(self, vocab: int, hidden: int):
        self.dir = tempfile.mkdtemp(prefix="vllm-tap-batches-", dir="/dev/shm")
        path = ring_path(self.dir, "x", 0)
        self.sections = _sections(vocab, hidden)
        # Nobody moves the read cursor (both readers only look): room for every record of a test.
        self.writer = RingWriter(path, max(8 << 20, 3 * 4 * (vocab + hidden) * 4))
        self.blocks = _Blocks()
        self.buffers = self.blocks.buffers
        self.batched = RingReader(path, writable=False, destination=self.blocks)
        self.single = RingReader(path, writable=False)

    def _alloc(self, nbytes: int) -> np.ndarray:
        return self.blocks.block(nbytes)

    def write(self, step: int, rows: list[tuple[str, int]], split: str = "") -> None:
        """One record: rows of (request id, position), in this order. split "both": the step as two
        records (hidden states, then logits, as a worker writes them), "first": only the first of them."""
        rids = list(dict.fromkeys(rid for rid, _ in rows))
        table = RequestTable([RequestRef(rid, "", N_PROMPT, 1, len(self.sections), 0, 0, "client") for rid in rids])
        arr = np.array([[rids.index(rid) for rid, _ in rows], [p for _, p in rows], [p + 1000 for _, p in rows]],
                       np.int32)
        parts = [self.sections] if not split else [self.sections[1:], self.sections[:1]][: 2 if split == "both" else 1]
        for secs in parts:
            res = self.writer.reserve_sections(table, arr, secs, step=step)
            assert res is not None
            buf = np.frombuffer(self.writer.buffer, np.uint8)
            for (at, nb), sec in zip(res.sections, secs):
                k = self.sections.index(sec)
                vals = (arr[1].astype(np.float32)[:, None] * 100 + np.arange(sec[2], dtype=np.float32)[None, :]
                        + 0.5 * k + 3 * arr[0].astype(np.float32)[:, None])
                buf[at : at + nb] = vals.reshape(-1).view(np.uint8)
            self.writer.commit(res)

    def read(self) -> tuple[list, list]:
        """What each reader reads of what was written since; the batched reader's records joined as
        the daemon joins them (daemon/step_runs: a step's records, then decode steps in runs)."""
        batched = [run[0] if len(run) == 1 else step_runs.join(run, self._alloc)
                   for _start, run in step_runs.runs(self.batched.poll(), ())]
        return batched, [record_of(x) for x in per_tensor(self.single.poll())]

    def close(self) -> None:
        for x in (self.writer, self.batched, self.single):
            x.close()
        for root, _dirs, files in os.walk(self.dir, topdown=False):
            for f in files:
                os.unlink(os.path.join(root, f))
            os.rmdir(root)


def _norm(events: list) -> dict[str, list]:
    """Each capture's events in order (a record's events of different captures may interleave
    either way: single records come tensor by tensor, a batch request by request)."""
    per: dict[str, list] = {}
    for ev in events:
        per.setdefault(ev.request_id, []).extend(_norm_one(ev))
    return per


def _norm_one(ev) -> list:
    if isinstance(ev, Tokens):
        return [("tokens", ev.positions.tolist(), ev.token_ids.tolist(), ev.num_prompt_tokens,
                 {k: a.tolist() for k, a in ev.tensors.items()}, dict(ev.dtypes), list(ev.tensors))]
    if isinstance(ev, Gap):
        return [("gap", ev.positions, ev.reason)]
    if isinstance(ev, Begin):
        return [("begin", ev.start_position, ev.lazy, ev.update, ev.source)]
    if isinstance(ev, End):
        return [("end", ev.reason, ev.expected, list(ev.missing_positions), ev.delivered, ev.complete)]
    raise AssertionError(ev)


def _run(ops: list, hold: int, vocab: int = 8, hidden: int = 4) -> tuple[Reassembler, Reassembler, int]:
    rings = _Rings(vocab, hidden)
    a, b = Reassembler("x", hold_newest=hold), Reassembler("x", hold_newest=hold)
    batches = 0
    try:
        for t, op in enumerate(ops):
            now = float(t)
            if op[0] == "data":
                split = op[2] if len(op) > 2 else ""
                rings.write(t + 1, op[1], split)
                got_a, got_b = rings.read()
                assert len(got_a) == 1 and type(got_a[0]) is DataRecord
                batch = got_a[0]
                batches += 1
                assert len(batch.sections) == (1 if split == "first" else 2)
                if batch.whole:  # the payloads were copied once, into the blocks the reader was given
                    bases = [(b.__array_interface__["data"][0], len(b))
                             for b in rings.buffers[-(2 if split == "both" else 1):]]
                    for sec in batch.sections:
                        at = sec.data.__array_interface__["data"][0]
                        assert any(lo <= at < lo + n for lo, n in bases)
                ev_a = a.feed(batch, now)
                ev_b = [ev for rec in got_b for ev in b.feed(rec, now)]
            else:
                ev_a, ev_b = a.feed(op[1], now), b.feed(op[1], now)
            assert _norm(ev_a) == _norm(ev_b), f"op {t}: {op[0]}"
            assert a.held_bytes == b.held_bytes
        late = float(len(ops) + 100)
        assert _norm(a.tick(late)) == _norm(b.tick(late))
        for r in (a, b):  # what has no END yet ends with its writers
            r.writer_gone(os.path.basename(rings.batched.path), late)
            r.writer_gone(ENGINE_SOURCE, late)
        assert _norm(a.tick(late + 100)) == _norm(b.tick(late + 100))
        assert _but_direct(a.stats) == _but_direct(b.stats) and a.held_bytes == b.held_bytes == 0 and a.in_flight() == b.in_flight() == 0
    finally:
        rings.close()
    return a, b, batches


def _but_direct(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "direct"}


_ACTIONS = ("next", "next", "next", "prefill", "dup", "back", "jump", "skip")


@st.composite
def scenarios(draw):
    n_req = draw(st.integers(1, 3))
    rids = [f"r{i}" for i in range(n_req)]
    ops: list = []
    cur = {rid: 0 for rid in rids}
    last: dict[str, list[int]] = {rid: [] for rid in rids}
    begun = {rid: draw(st.sampled_from(["first", "late", "never"])) for rid in rids}
    ended: set[str] = set()
    async_flag = draw(st.sampled_from([None, True, False]))
    for rid in rids:
        if begun[rid] == "first":
            ops.append(("control", _begin(rid, async_flag)))
    for _ in range(draw(st.integers(2, 9))):
        rows: list[tuple[str, int]] = []
        for rid in rids:
            act = draw(st.sampled_from(_ACTIONS))
            if act == "skip":
                continue
            if act == "prefill":
                ps = list(range(cur[rid], cur[rid] + draw(st.integers(2, 3))))
            elif act == "dup" and last[rid]:
                ps = list(last[rid])
            elif act == "back":
                ps = [max(cur[rid] - 2, 0)]
            elif act == "jump":
                ps = [cur[rid] + 2]
            else:
                ps = [cur[rid]]
            last[rid] = ps
            cur[rid] = max(cur[rid], ps[-1] + 1)
            rows.extend((rid, p) for p in ps)
        if not rows:
            continue
        if draw(st.booleans()):  # requests' rows interleaved in the record, each request's in order
            order = draw(st.permutations(range(len(rows))))
            by_rid: dict[str, list] = {}
            for rid, p in rows:
                by_rid.setdefault(rid, []).append(p)
            shuffled = [rows[i][0] for i in order]
            it = {rid: iter(ps) for rid, ps in by_rid.items()}
            rows = [(rid, next(it[rid])) for rid in shuffled]
        ops.append(("data", rows, draw(st.sampled_from(["", "", "both", "first"]))))
        ops += _controls(draw, rids, begun, ended, cur, async_flag, drop_1_in=6, end_1_in=5, end_back=1)
    return ops + _last_ends(draw, rids, ended, cur)


def _controls(draw, rids: list[str], begun: dict, ended: set, cur: dict, async_flag, *, drop_1_in: int,
              end_1_in: int, end_back: int) -> list:
    """What the engine may write between two reads: a BEGIN that comes late, a DROP, an END before
    or after the last position written."""
    ops: list = []
    for rid in rids:
        if begun[rid] == "late" and draw(st.booleans()):
            ops.append(("control", _begin(rid, async_flag)))
            begun[rid] = "first"
        if rid not in ended and draw(st.integers(0, drop_1_in - 1)) == 0:
            ops.append(("control", _drop(rid, [cur[rid] + 1])))
        if rid not in ended and draw(st.integers(0, end_1_in - 1)) == 0:
            ops.append(("control", _end(rid, max(cur[rid] + draw(st.integers(-end_back, 1)), 0))))
            ended.add(rid)
    return ops


def _last_ends(draw, rids: list[str], ended: set, cur: dict) -> list:
    return [("control", _end(rid, cur[rid])) for rid in rids if rid not in ended and draw(st.booleans())]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([0, 1]))
def test_a_record_read_whole_gives_the_events_of_its_records_one_by_one(ops, hold):
    _run(ops, hold)


@pytest.mark.parametrize("hold", [0, 1])
@pytest.mark.parametrize("split", ["", "both"])
def test_decode_steps_of_many_captures_take_the_direct_way_and_agree(hold, split):
    rids = [f"r{i}" for i in range(16)]
    ops = [("control", _begin(rid, None)) for rid in rids]
    ops.append(("data", [(rid, p) for rid in rids for p in range(N_PROMPT)], split))  # the prefill
    ops += [("data", [(rid, p) for rid in rids], split) for p in range(N_PROMPT, N_PROMPT + 6)]
    ops += [("control", _end(rid, N_PROMPT + 5)) for rid in rids]
    a, b, batches = _run(ops, hold)
    assert batches == 7 and a.stats["requests_finished"] == 16
    assert a.stats["direct"] == 7 * 16 and b.stats["direct"] == 0  # every capture's every record, same events


def test_a_record_too_large_for_the_reading_window_is_read_whole_into_its_buffer_and_agrees():
    rids = [f"r{i}" for i in range(4)]
    ops = [("control", _begin(rid, False)) for rid in rids]
    ops += [("data", [(rid, p) for rid in rids]) for p in range(3)]
    ops += [("control", _end(rid, 2)) for rid in rids]
    _run(ops, 0, vocab=40_000)  # 160 kB a row: past the reader's direct-read threshold


def test_a_payload_read_by_several_threads_agrees():
    rids = [f"r{i}" for i in range(4)]
    ops = [("control", _begin(rid, False)) for rid in rids]
    ops += [("data", [(rid, p) for rid in rids]) for p in range(2)]
    ops += [("control", _end(rid, 1)) for rid in rids]
    _run(ops, 0, vocab=300_000)  # 4.8 MB a record: read in parts at once where the box has the cores


def test_a_tensor_parallel_slice_is_not_batched():
    d = tempfile.mkdtemp(prefix="vllm-tap-batches-", dir="/dev/shm")
    path = ring_path(d, "x", 0)
    w = RingWriter(path, 1 << 20)
    r = RingReader(path, destination=_Blocks())
    try:
        table = RequestTable([RequestRef("r0", "", N_PROMPT, 2, 1, 0, 0, "client")])
        rows = np.array([[0], [0], [1000]], np.int32)
        res = w.reserve_sections(table, rows, ((LOGITS, rf.DType.FLOAT32, 4, (0, 4), 8),), step=1)
        w.commit(res)
        (rec,) = r.poll()
        (sec,) = rec.sections
        assert not rec.whole and sec.data is None and (sec.slice_start, sec.slice_stop, sec.full_dim) == (0, 4, 8)
    finally:
        w.close()
        r.close()
        for f in os.listdir(os.path.join(d, "x")):
            os.unlink(os.path.join(d, "x", f))
        os.rmdir(os.path.join(d, "x"))
        os.rmdir(d)


# -- decode steps read in one round, joined into one batch per run (daemon/step_runs) --


def _content(events: list) -> dict[str, list]:
    """Each capture's events position by position: a run of steps joined gives the same positions,
    ids, values, gaps and ends as its steps one by one, in fewer Tokens."""
    per: dict[str, list] = {}
    for ev in events:
        out = per.setdefault(ev.request_id, [])
        if isinstance(ev, Tokens):
            for j, p in enumerate(ev.positions.tolist()):
                out.append(("pos", p, int(ev.token_ids[j]), ev.num_prompt_tokens, dict(ev.dtypes),
                            {k: a[j].tolist() for k, a in ev.tensors.items()}))
        elif isinstance(ev, Gap):
            out.extend(("gap", p, ev.reason) for p in ev.positions)
        else:
            out.extend(_norm_one(ev))
    return per


def _run_bursts(ops: list, hold: int) -> tuple[Reassembler, Reassembler, int]:
    """ops: ("steps", [rows of each step], split) written together, then read in one round; or
    ("control", record). Returns both reassemblers and the steps that were joined into runs."""
    rings = _Rings(8, 4)
    a, b = Reassembler("x", hold_newest=hold), Reassembler("x", hold_newest=hold)
    ev_a: list = []
    ev_b: list = []
    joined = 0
    step = 0
    try:
        for t, op in enumerate(ops):
            now = float(t)
            if op[0] == "steps":
                for rows in op[1]:
                    step += 1
                    rings.write(step, rows, op[2])
                got_a, got_b = rings.read()
                for item in got_a:
                    joined += len(item.steps) if type(item) is DataRecord and item.steps else 0
                    ev_a += a.feed(item, now)
                ev_b += [ev for rec in got_b for ev in b.feed(rec, now)]
            else:
                ev_a += a.feed(op[1], now)
                ev_b += b.feed(op[1], now)
            assert _content(ev_a) == _content(ev_b), f"op {t}: {op[0]}"
        late = float(len(ops) + 100)
        ev_a += a.tick(late)
        ev_b += b.tick(late)
        for r, evs in ((a, ev_a), (b, ev_b)):
            r.writer_gone(os.path.basename(rings.batched.path), late)
            r.writer_gone(ENGINE_SOURCE, late)
            evs += r.tick(late + 100)
        assert _content(ev_a) == _content(ev_b)
        assert _but_direct(a.stats) == _but_direct(b.stats) and a.held_bytes == b.held_bytes == 0
        assert a.in_flight() == b.in_flight() == 0
    finally:
        rings.close()
    return a, b, joined


@st.composite
def bursts(draw):
    """Captures decoding step after step (mostly), read a few steps at a time: runs join, and what
    breaks them (a duplicate, a recompute, a jump, a skipped step, a prefill chunk, a request that
    comes or goes, a BEGIN, DROP or END between bursts) must cost nothing but the join."""
    n_req = draw(st.integers(1, 4))
    rids = [f"r{i}" for i in range(n_req)]
    ops: list = []
    cur = {rid: N_PROMPT for rid in rids}
    begun = {rid: draw(st.sampled_from(["first", "first", "late", "never"])) for rid in rids}
    ended: set[str] = set()
    async_flag = draw(st.sampled_from([None, True, False]))
    for rid in rids:
        if begun[rid] == "first":
            ops.append(("control", _begin(rid, async_flag)))
    ops.append(("steps", [[(rid, p) for rid in rids for p in range(N_PROMPT)]], ""))  # the prefill
    for _ in range(draw(st.integers(1, 5))):
        steps = []
        for _ in range(draw(st.integers(1, 6))):
            rows: list[tuple[str, int]] = []
            for rid in rids:
                act = draw(st.sampled_from(("next",) * 8 + ("dup", "back", "jump", "skip", "prefill")))
                if act == "skip":
                    continue
                ps = {"dup": [cur[rid] - 1], "back": [max(cur[rid] - 2, 0)], "jump": [cur[rid] + 1],
                      "prefill": [cur[rid], cur[rid] + 1]}.get(act, [cur[rid]])
                cur[rid] = max(cur[rid], ps[-1] + 1)
                rows.extend((rid, p) for p in ps)
            if rows:
                steps.append(rows)
        if steps:
            ops.append(("steps", steps, draw(st.sampled_from(["", "", "both"]))))
        ops += _controls(draw, rids, begun, ended, cur, async_flag, drop_1_in=7, end_1_in=6, end_back=2)
    return ops + _last_ends(draw, rids, ended, cur)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bursts(), st.sampled_from([0, 1]))
def test_decode_steps_read_together_give_what_their_records_give_one_by_one(ops, hold):
    _run_bursts(ops, hold)


@pytest.mark.parametrize("hold", [0, 1])
@pytest.mark.parametrize("split", ["", "both"])
def test_a_backlog_of_decode_steps_is_one_event_per_capture_and_round(hold, split):
    rids = [f"r{i}" for i in range(16)]
    ops: list = [("control", _begin(rid, None)) for rid in rids]
    ops.append(("steps", [[(rid, p) for rid in rids for p in range(N_PROMPT)]], split))
    ops += [("steps", [[(rid, p) for rid in rids] for p in range(q, q + 5)], split) for q in (N_PROMPT, N_PROMPT + 5)]
    ops += [("control", _end(rid, N_PROMPT + 9)) for rid in rids]
    a, b, joined = _run_bursts(ops, hold)
    assert joined == 10 and a.stats["requests_finished"] == 16
    assert a.stats["direct"] == 11 * 16 and b.stats["direct"] == 0  # each capture's every step, directly


def test_steps_join_only_while_they_continue_each_other():
    rings = _Rings(8, 4)
    try:
        for s, p in enumerate((4, 5, 6, 8, 9), start=1):  # position 7 never came: two runs
            rings.write(s, [("r0", p), ("r1", p)])
        rings.write(6, [("r0", 10)])  # another table
        rings.write(7, [("r0", 11), ("r1", 11)])
        items = list(step_runs.runs(rings.batched.poll(), ()))
        assert [(start, len(run)) for start, run in items] == [(0, 3), (3, 2), (5, 1), (6, 1)]
        run = step_runs.join(items[0][1], None)
        assert run.positions.tolist() == [4, 5, 6, 4, 5, 6] and run.groups == [(0, slice(0, 3)), (1, slice(3, 6))]
        assert run.n_slices == 3 * 2 * 2 and [sec.data.shape for sec in run.sections] == [(6, 8), (6, 4)]
        for s, p in enumerate((12, 13, 14), start=8):
            rings.write(s, [("r0", p), ("r1", p)])
        recs = rings.batched.poll()
        assert [len(run) for _, run in step_runs.runs(recs, {2})] == [2, 1]  # a rejected record came before the third
    finally:
        rings.close()
