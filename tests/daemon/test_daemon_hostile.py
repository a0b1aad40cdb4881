"""A real daemon process reading real ring files that a broken or hostile writer made: it must
survive every one of them, say what it skipped, end the captures concerned with a reason, and keep
serving everyone else."""

from __future__ import annotations

import os
import socket
import urllib.request

import numpy as np
import pytest

from ring_forge import RingForge, control, data, entry, pack
from vllm_tap import ring_format as rf
from vllm_tap.client import CaptureNotFound
from vllm_tap.spec import CaptureSpec
from waiting import wait_until as _wait

BEGIN, END = rf.RecordKind.BEGIN, rf.RecordKind.END
SPEC = CaptureSpec().to_meta()
W = 4  # logits width of the forged records


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vals(positions) -> np.ndarray:
    return (np.asarray(positions, np.float32)[:, None] * 10 + np.arange(W, dtype=np.float32)[None, :])


def begin_meta(n_prompt: int = 2) -> dict:
    return {"spec": SPEC, "num_prompt_tokens": n_prompt, "prompt_token_ids": list(range(n_prompt)), "n": 1, "model": "m"}


def end_meta(end_position: int = 3, **over) -> dict:
    n_out = min(end_position - 1, 8)  # the ids are not what these tests are about: keep them few
    m = {"reason": "length", "num_prompt_tokens": 2, "num_output_tokens": n_out,
         "output_token_ids": [5] * n_out, "end_position": end_position}
    m.update(over)
    return m


def rows(rid, positions, step: int = 0, **entry_fields) -> bytes:
    pos = list(positions)
    return data([entry(rid, num_prompt_tokens=2, **entry_fields)], [0] * len(pos), pos, [p + 100 for p in pos],
                _vals(pos), step=step)


def good(eng: RingForge, rank: RingForge, rid: str, n: int = 3) -> None:
    eng.append(control(BEGIN, rid, begin_meta()))
    rank.append(rows(rid, range(n)))
    eng.append(control(END, rid, end_meta(n)))


def _rss_peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _assert_good(client, rid: str, n: int = 3) -> None:
    cap = client.fetch(rid, timeout=10)
    assert cap.complete and cap.finish_reason == "length", (rid, cap.missing_positions, cap.finish_reason)
    assert cap.positions.tolist() == list(range(n)) and cap.logits.tobytes() == _vals(range(n)).tobytes()


# -- item 5: the seven type confusions found by fuzzing --

# (name, which ring holds the bad record, the request a subscriber can still name, how to write it)
CONFUSIONS = {
    "begin_meta_a_list": ("engine", "bad", lambda e, r: e.append(control(BEGIN, "bad", [1, 2, 3]))),
    "end_position_a_string": ("engine", "bad", lambda e, r: (
        e.append(control(BEGIN, "bad", begin_meta())), r.append(rows("bad", range(3))),
        e.append(control(END, "bad", {**end_meta(3), "end_position": "12"})))),
    "prompt_ids_an_int": ("engine", "bad", lambda e, r: e.append(control(BEGIN, "bad", {**begin_meta(), "prompt_token_ids": 5}))),
    "request_id_an_int": ("rank", None, lambda e, r: r.append(rows(5, range(3)))),
    "request_id_a_list": ("rank", None, lambda e, r: r.append(rows(["bad"], range(3)))),
    "expected_ranks_a_string": ("rank", "bad", lambda e, r: (
        e.append(control(BEGIN, "bad", begin_meta())), r.append(rows("bad", range(3), expected_ranks="1")))),
    "tap_key_a_list": ("rank", "bad", lambda e, r: (
        e.append(control(BEGIN, "bad", begin_meta())), r.append(rows("bad", range(3), tap_key=["k"])))),
}


@pytest.mark.parametrize("case", sorted(CONFUSIONS))
def test_a_type_confused_record_is_rejected_counted_logged_and_ends_its_capture(daemon_factory, shm_dir, case):
    where, named, write = CONFUSIONS[case]
    port = _port()
    d = daemon_factory(end_grace_s=1.0, metrics_addr=f"127.0.0.1:{port}")
    eng = RingForge(shm_dir, "default", rf.ENGINE_RANK)
    rank = RingForge(shm_dir, "default", 0)
    c = d.client()
    good(eng, rank, "good-a")
    _assert_good(c, "good-a")
    bad_ring = eng if where == "engine" else rank
    cursor = bad_ring.write_cursor
    write(eng, rank)
    good(eng, rank, "good-b")  # the records after the bad one are read as before
    _assert_good(c, "good-b")
    assert d.alive()
    s = d.status()
    by_name = {r["name"]: r for r in s["rings"]}
    name = os.path.basename(bad_ring.path)
    assert by_name[name]["rejected"] == 1 and s["rejected_records"] == 1, by_name
    assert sum(r["rejected"] for r in s["rings"]) == 1
    _wait(lambda: f"{bad_ring.path}: record at cursor" in d.log(), what="the log line")
    line = next(x for x in d.log().splitlines() if "record at cursor" in x)
    assert f"record at cursor {cursor} rejected" in line or f"record at cursor {cursor + len(control(BEGIN, 'bad', begin_meta()))}" in line, line
    if named is not None:
        cap = c.fetch(named, timeout=10)
        assert cap.finish_reason == "malformed record" and not cap.complete, cap.meta()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert f'vllm_tap_ring_rejected_records_total{{instance="default",rank="{-1 if where == "engine" else 0}",ring="{name}"}} 1.0' in metrics
    assert "vllm_tap_rejected_records_total 1.0" in metrics


def test_a_restart_does_not_read_a_rejected_record_again(daemon_factory, shm_dir):
    """Under systemd a crash on a record meant a restart on the same record, until the unit failed."""
    eng = RingForge(shm_dir, "default", rf.ENGINE_RANK)
    rank = RingForge(shm_dir, "default", 0)
    eng.append(control(BEGIN, "bad", [1, 2, 3]))
    good(eng, rank, "good-a")
    d = daemon_factory(end_grace_s=1.0)
    _assert_good(d.client(), "good-a")
    d.stop()
    d.start()
    assert d.status()["rejected_records"] == 0 and d.alive()


# -- item 3: a ring file that changes size under the daemon --


@pytest.mark.parametrize("new_size", [0, rf.HEADER_SIZE + 4096, None])
def test_a_ring_truncated_or_grown_under_the_daemon_is_dropped_and_the_rest_served(daemon_factory, shm_dir, new_size):
    d = daemon_factory(end_grace_s=1.0)
    eng = RingForge(shm_dir, "default", rf.ENGINE_RANK)
    rank = RingForge(shm_dir, "default", 0, capacity=1 << 20)
    c = d.client()
    good(eng, rank, "before")
    _assert_good(c, "before")
    eng.append(control(BEGIN, "cut", begin_meta(8)))
    rank.append(rows("cut", range(4)))
    _wait(lambda: d.status()["requests_in_flight"] == 1, what="the capture in flight")
    with open(rank.path, "r+b") as f:  # anyone who may open the ring for writing can do this
        f.truncate(new_size if new_size is not None else (rf.HEADER_SIZE + (1 << 20)) * 2)
    if new_size is None:  # grown: the old mapping still works, and the writer goes on
        rank.append(rows("cut", range(4, 6), step=1))
    cap = c.fetch("cut", timeout=10)  # the capture of the broken ring ends, with what it got
    assert not cap.complete and cap.finish_reason == "ring broken", cap.meta()
    assert d.alive()
    s = d.status()
    assert s["rings_broken"] == 1 and "size changed" in s["broken_rings"][0]["why"], s["broken_rings"]
    assert [r["name"] for r in s["rings"]] == ["engine.ring"]
    assert "no longer read" in d.log()
    # A new ring from a restarted writer (a new file) is read again.
    rank2 = RingForge(shm_dir, "default", 0)
    good(eng, rank2, "after")
    _assert_good(c, "after")


def test_a_sparse_ring_is_refused_and_costs_no_memory(daemon_factory, shm_dir):
    d = daemon_factory()
    peak = _rss_peak_kib(d.proc.pid)
    big = RingForge(shm_dir, "default", 0, capacity=1 << 30, allocate=False)  # 1 GiB of holes
    big.set_write_cursor(1 << 30)  # claims a full ring of records
    _wait(lambda: d.status()["rings_refused"] == 1, what="the refusal")
    assert d.status()["rings"] == [] and "sparse" in d.log()
    assert _rss_peak_kib(d.proc.pid) - peak < 64 << 10


# -- item 6: sizes taken from records are bounded before anything is allocated --


def _limited(daemon_factory, **kw):
    """A daemon that may not grow past 3 GiB of address space: a blow-up fails it, not the machine."""
    return daemon_factory(rlimits={"RLIMIT_AS": 3 << 30}, end_grace_s=1.0, **kw)


def test_a_huge_end_position_and_far_apart_positions_cost_ranges_not_memory(daemon_factory, shm_dir):
    d = _limited(daemon_factory)
    eng = RingForge(shm_dir, "default", rf.ENGINE_RANK)
    rank = RingForge(shm_dir, "default", 0)
    far = (1 << 31) - 2
    eng.append(control(BEGIN, "huge", begin_meta()))
    rank.append(data([entry("huge", num_prompt_tokens=2)], [0, 0], [0, far], [1, 2], _vals([0, 1])))
    eng.append(control(END, "huge", end_meta((1 << 31) - 1)))
    cap = d.client().fetch("huge", timeout=15)
    assert cap.positions.tolist() == [0, far]
    assert cap.missing_positions.ranges == [(1, far)] and len(cap.missing_positions) == far - 1
    assert not cap.complete and d.alive()
    assert _rss_peak_kib(d.proc.pid) < 1 << 20  # < 1 GiB peak (the fix keeps it near its start size)
    good(eng, rank, "next")
    _assert_good(d.client(), "next")


def test_a_bloated_request_table_is_rejected_before_it_is_decoded(daemon_factory, shm_dir):
    d = _limited(daemon_factory)
    eng = RingForge(shm_dir, "default", rf.ENGINE_RANK)
    rank = RingForge(shm_dir, "default", 0, capacity=64 << 20)
    # 24 MiB of msgpack that expands ~75x when decoded without a schema: 65536 entries of nested nils.
    table = rf.msgpack_array_header(65536) + pack([None] * 384) * 65536
    assert len(table) > 24_000_000
    rank.append(data(table, [0], [0], [1], _vals([0]), n_requests=65536))
    good(eng, rank, "next")
    _assert_good(d.client(), "next")
    assert d.status()["rejected_records"] == 1
    assert _rss_peak_kib(d.proc.pid) < 1 << 20


# -- item 9: the ring directory itself --


def test_links_under_the_ring_directory_are_never_followed(daemon_factory, shm_dir, tmp_path):
    other = tmp_path / "other-daemons-shm"
    theirs = RingForge(str(other), "theirs", 0)
    theirs.append(rows("theirs", range(3)))
    os.makedirs(os.path.join(shm_dir, "mine"), mode=0o700)
    os.symlink(theirs.path, os.path.join(shm_dir, "mine", "rank-00001.ring"))  # a linked ring
    os.symlink(os.path.dirname(theirs.path), os.path.join(shm_dir, "linked-instance"))  # a linked instance
    d = daemon_factory()
    eng = RingForge(shm_dir, "mine", rf.ENGINE_RANK)
    rank = RingForge(shm_dir, "mine", 0)
    good(eng, rank, "mine")
    _assert_good(d.client(), "mine")
    with pytest.raises(CaptureNotFound):
        d.client().fetch("theirs", timeout=1)
    assert sorted(r["name"] for r in d.status()["rings"]) == ["engine.ring", "rank-00000.ring"]
    assert theirs.read_cursor == 0  # the other daemon's ring was not consumed


def test_a_hundred_thousand_junk_ring_files_are_skipped_a_slice_at_a_time(daemon_factory, shm_dir):
    junk = os.path.join(shm_dir, "junk")
    os.makedirs(junk, mode=0o700)
    for i in range(100_000):
        with open(os.path.join(junk, f"x{i}.ring"), "wb") as f:
            f.write(b"not a ring")
    d = daemon_factory()
    eng = RingForge(shm_dir, "real", rf.ENGINE_RANK)
    rank = RingForge(shm_dir, "real", 0)
    good(eng, rank, "real")
    _assert_good(d.client(), "real")  # served while the junk is still being sorted out
    _wait(lambda: d.status()["rings_refused"] == 100_000, 120, "every junk file to be looked at once")
    s = d.status()
    assert s["discovery"] == "inotify" and s["rings_refused"] == 100_000
    log = d.log()
    assert log.count("ignoring ") <= 20 and "only counted" in log
    # New rings are found by their inotify event, not by a rescan of the junk.
    eng2 = RingForge(shm_dir, "late", rf.ENGINE_RANK)
    rank2 = RingForge(shm_dir, "late", 0)
    good(eng2, rank2, "late")
    _assert_good(d.client(), "late")
    assert d.status()["rings_refused"] == 100_000


def test_captures_in_flight_are_kept_inside_inflight_bytes(daemon_factory, shm_dir):
    d = daemon_factory(end_grace_s=1.0, inflight_bytes="1MiB")
    eng = RingForge(shm_dir, "default", rf.ENGINE_RANK)
    rank = RingForge(shm_dir, "default", 0, capacity=8 << 20)
    wide = 4096  # 16 KiB a position: 100 positions are 1.6 MiB, more than the budget
    eng.append(control(BEGIN, "big", begin_meta()))
    for step in range(25):
        pos = list(range(4 * step, 4 * step + 4))
        rank.append(data([entry("big", num_prompt_tokens=2)], [0] * 4, pos, pos, np.ones((4, wide), np.float32),
                         step=step))
    _wait(lambda: d.status()["captures_cut"] == 1, what="the cut")
    s = d.status()
    assert s["inflight_bytes"] <= 1 << 20, s["inflight_bytes"]
    good(eng, rank, "small")  # others are served as before
    _assert_good(d.client(), "small")
    eng.append(control(END, "big", end_meta(100)))
    sub = d.client().subscribe("big", timeout=10)
    items = list(sub.chunks())
    assert not sub.end.complete and sub.end.reason == "length"
    reasons = {it.reason.split(":")[0] for it in items if not hasattr(it, "logits")}
    assert reasons == {"over budget"}, reasons
    assert sum(len(it.positions) for it in items) == 100  # every position accounted for, once
    assert "cut" in d.log() and "inflight_bytes" in d.log()
