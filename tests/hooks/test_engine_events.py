"""The engine-core hook's records (BEGIN, END, LIVE) through a real ring, driven the way vLLM's
scheduler drives it: add_request, _free_request, and its LIVE timer thread, which writes whether or
not the scheduler runs steps. The requests are plain objects with the attributes the scheduler's
Request has; vLLM itself runs in test_hook_offline and the server tests."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from vllm_tap import ring_format as rf
from vllm_tap.hooks import engine_events
from vllm_tap.hooks.engine_events import EngineEvents
from vllm_tap.hooks.settings import SPEC_EXTRA_ARG
from vllm_tap.identity import N_EXTRA_ARG
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_reader import RingReader
from vllm_tap.spec import CaptureSpec, ServerCaptureConfig


def _config(shm: str):
    return SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="m", model="m"),
        parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
    ), ServerCaptureConfig(layers=(0, 1), instance="eng", shm_dir=shm)


def _request(rid: str, extra: dict | None, prompt=(5, 6, 7), out=(9, 10)):
    reason = SimpleNamespace(name="LENGTH")
    return SimpleNamespace(
        request_id=rid, sampling_params=SimpleNamespace(extra_args=extra), num_prompt_tokens=len(prompt),
        prompt_token_ids=list(prompt), output_token_ids=list(out), num_computed_tokens=len(prompt) + len(out) - 1,
        get_finished_reason=lambda: reason,
    )


@pytest.fixture
def events(shm_dir, monkeypatch):
    monkeypatch.setattr(engine_events, "LIVE_INTERVAL_S", 0.05)
    vc, cfg = _config(shm_dir)
    ev = EngineEvents(vc, cfg)
    reader = RingReader(ring_path(shm_dir, "eng", rf.ENGINE_RANK))
    yield ev, reader
    ev.close()
    reader.close()


def _until(reader, cond, timeout: float = 10.0) -> list:
    recs: list = []
    deadline = time.monotonic() + timeout
    while not cond(recs):
        assert time.monotonic() < deadline, [(r.kind.name, r.request_id, r.meta) for r in recs]
        time.sleep(0.01)
        recs += reader.poll()
    return recs


def _lives(recs) -> list:
    return [sorted(r.meta["requests"]) for r in recs if r.kind == rf.RecordKind.LIVE]


def test_begin_end_and_live_records(events):
    ev, reader = events
    spec = CaptureSpec(layers=(1,), positions="output[-4:]", key="k", source="policy")
    extra = {SPEC_EXTRA_ARG: spec.to_meta(), N_EXTRA_ARG: 2}
    ev.begin(_request("a", extra))
    ev.begin(_request("b", {SPEC_EXTRA_ARG: CaptureSpec().to_meta()}))
    ev.begin(_request("plain", {"top_k": 3}))
    recs = _until(reader, lambda rs: ["a", "b"] in _lives(rs))  # no scheduler step: the timer writes it
    ev.end(_request("a", extra))
    ev.end(_request("plain", None))
    recs += _until(reader, lambda rs: ["b"] in _lives(rs))
    ev.end(_request("b", None))
    recs += _until(reader, lambda rs: _lives(rs)[-2:] == [[], []])  # idle: still about once an interval
    control = [(r.kind.name, r.request_id) for r in recs if r.kind != rf.RecordKind.LIVE]
    assert control == [("BEGIN", "a"), ("BEGIN", "b"), ("END", "a"), ("END", "b")]
    # Every LIVE names exactly the captures between their BEGIN and END records.
    running: set[str] = set()
    for r in recs:
        if r.kind == rf.RecordKind.BEGIN:
            running.add(r.request_id)
        elif r.kind == rf.RecordKind.END:
            running.discard(r.request_id)
        else:
            assert set(r.meta["requests"]) == running
    begin_a = next(r for r in recs if (r.kind, r.request_id) == (rf.RecordKind.BEGIN, "a"))
    end_a = next(r for r in recs if (r.kind, r.request_id) == (rf.RecordKind.END, "a"))
    assert begin_a.tap_key == "k" and begin_a.meta["spec"] == spec.to_meta() and begin_a.meta["source"] == "policy"
    assert begin_a.meta["n"] == 2 and begin_a.meta["prompt_token_ids"] == [5, 6, 7]
    assert end_a.tap_key == "k" and end_a.meta["spec"] == spec.to_meta() and end_a.meta["source"] == "policy"
    assert end_a.meta["end_position"] == 4 and end_a.meta["reason"] == "length" and end_a.meta["output_token_ids"] == [9, 10]


def _fill_with_begins(ev) -> tuple[int, dict]:
    """BEGINs with ~600 kB of prompt ids each until the 16 MiB ring is full and one waits: (how many, spec)."""
    ev.writer.max_backlog_records = 10_000
    big = list(range(200_000))
    spec = {SPEC_EXTRA_ARG: CaptureSpec().to_meta()}
    n = 0
    while ev.writer.flush():
        ev.begin(_request(f"r{n}", spec, prompt=big))
        n += 1
    return n, spec


def test_an_idle_engine_sends_the_ends_that_waited_for_room(events):
    """The ring was full (no reader) when the last captures ended, and then nothing runs: the
    timer's tick sends the queued ENDs once a reader frees room, with no scheduler step to do it."""
    ev, reader = events
    n, spec = _fill_with_begins(ev)
    for i in range(n):
        ev.end(_request(f"r{i}", spec))
    assert ev.writer.backlog_records() > n  # the last BEGIN and every END wait
    recs = _until(reader, lambda rs: len([r for r in rs if r.kind == rf.RecordKind.END]) == n)
    assert [r.request_id for r in recs if r.kind == rf.RecordKind.END] == [f"r{i}" for i in range(n)]
    recs += _until(reader, lambda rs: [] in _lives(rs))


@pytest.mark.parametrize("bad", ["x", 1, None, [], {"logits": "full"}, {**CaptureSpec().to_meta(), "topk": "5"},
                                 {**CaptureSpec().to_meta(), "positions": "output[:-1]"}])
def test_a_malformed_spec_is_no_capture_and_one_logged_error(events, bad, caplog):
    ev, reader = events
    caplog.set_level(logging.ERROR, "vllm_tap.hooks")
    for i in range(5):
        ev.begin(_request(f"r{i}", {SPEC_EXTRA_ARG: bad, N_EXTRA_ARG: "x"}))
        ev.end(_request(f"r{i}", None))
    assert {r.kind for r in reader.poll()} <= {rf.RecordKind.LIVE}  # the timer's only
    assert len([r for r in caplog.records if "malformed capture spec" in r.getMessage()]) == 1
    assert ev.bad_spec.count == 5


def test_live_is_never_queued_ahead_of_control_records_waiting_for_room(events, monkeypatch):
    ev, reader = events
    monkeypatch.setattr(engine_events, "LIVE_INTERVAL_S", 3600)  # this test ticks by hand
    time.sleep(0.1)  # the timer is in its (now long) wait
    reader.poll()
    n, spec = _fill_with_begins(ev)
    assert ev.writer.backlog_records() > 0
    assert not ev.live()  # refused while BEGINs wait: it would overtake them
    recs = reader.poll()
    assert [r.kind for r in recs] == [rf.RecordKind.BEGIN] * len(recs)
    ev.live()
    while not ev.writer.flush():
        recs += reader.poll()
    recs += reader.poll()
    assert ev.live()
    recs += reader.poll()
    assert [r.request_id for r in recs if r.kind == rf.RecordKind.BEGIN] == [f"r{i}" for i in range(n)]
    assert recs[-1].kind == rf.RecordKind.LIVE and len(recs[-1].meta["requests"]) == n
