"""Chaos: the daemon is killed, stopped and restarted at random while captured requests run.

One vLLM server (eager, tiny float32 Llama, the logits captured) and one `vllm-tap daemon`. Three
clients send captured completions (logprobs=1) while a chaos thread, at random moments of the load,
SIGKILLs the daemon and restarts it, stops it (SIGSTOP) for a moment, or stops it gracefully
(SIGTERM) and restarts it; each event lands just after a request was sent, while it is captured.
A watcher follows every capture from before the load, through the restarts; a probe asks the
daemon's status every 50 ms while the daemon runs. Afterwards every request's
capture is fetched and checked: it is there, it accounts for every expected position as data or as
a Gap with a documented reason, and its data gives vLLM's logprobs; the watch saw every sequence
number once, as a capture or inside a LostCaptures.

The randomness comes from one seed (VLLM_TAP_CHAOS_SEED, else SEED), printed with every failure.
The status latencies, the events and the gaps by reason go to stderr and to chaos-report.json in
the test's tmp_path (chaos-detail.json adds every capture and the watch's items); nothing about time
is asserted. VLLM_TAP_CHAOS_EVENTS=none runs the same load without chaos: the status latency the
box gives with vLLM's CPU engine on the same cores, to compare with.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from reference import logprob_mismatches
from server_stack import ServerStack
from vllm_tap import wire_format as wf
from vllm_tap.client import CaptureNotFound, Client, Gap, LostCaptures, WatchedCapture
from vllm_tap.tools.tiny_model import TinyLlamaSpec, prompt_text

pytestmark = pytest.mark.vllm

SEED = int(os.environ.get("VLLM_TAP_CHAOS_SEED", "20261128"))
TOL = 1e-5
SPEC = TinyLlamaSpec()
INSTANCE = "chaos"
CLIENTS = 3
KINDS = ("SIGKILL", "SIGSTOP", "SIGTERM")
PROBE_PERIOD_S = 0.05
PROBE_TIMEOUT_S = 2.0  # a status unanswered this long while the daemon runs counts as unanswered
FETCH_TIMEOUT_S = 3.0  # the daemon is idle by then: a capture it holds is found at once
# Finish reasons of a capture whose END the daemon never read (docs/semantics.md, "Finish reason").
END_UNKNOWN = {"writer gone", "ring broken", "end lost", "malformed record"}
SEMANTICS = Path(__file__).resolve().parents[2] / "docs" / "semantics.md"


def documented_gap_reasons() -> tuple[set[str], tuple[str, ...]]:
    """The gap-reason table of docs/semantics.md: exact reasons, and prefixes (those ending in '…')."""
    text = SEMANTICS.read_text()
    table = text[text.index("| reason | cause |"):]
    table = table[:table.index("\n\n")]
    names = [m.group(1) for m in re.finditer(r"^\s*\| `([^`]+)` \|", table, re.M)]
    exact = {n for n in names if not n.endswith("…")}
    prefixes = tuple(n.rstrip("…").rstrip() for n in names if n.endswith("…"))
    assert len(exact) >= 10 and prefixes, (exact, prefixes)  # the table was found and read
    return exact, prefixes


@pytest.fixture(scope="module")
def stack():
    with ServerStack(INSTANCE, eager=True) as s:
        yield s


def _ids(n: int, salt: int) -> list[int]:
    return [(salt * 31 + 7 * i) % (SPEC.vocab_size - 3) + 3 for i in range(n)]


def _request(stack, prompt_len: int, salt: int, max_tokens: int):
    return stack.complete(prompt_text(_ids(prompt_len, salt)), {"tap": 1}, max_tokens=max_tokens, logprobs=1)


# -- the plan: everything random is drawn here, from the seed --


@dataclass
class Event:
    kind: str
    gap_s: float  # after the previous event (or the start of the load) ...
    delay_s: float  # ... and this long after the next request was sent, the event begins
    pause_s: float  # SIGSTOP: how long stopped; SIGKILL / SIGTERM: how long down before the restart
    t0: float = 0.0  # seconds into the load, when it began and ended (set as it runs)
    t1: float = 0.0
    answered: int = 0  # requests answered and running when it began
    running: int = 0
    returncode: int | None = None  # SIGTERM: the stopped daemon's exit status


@dataclass
class Request:
    prompt_len: int
    max_tokens: int
    think_s: float  # the client waits this long before sending it


@dataclass
class Plan:
    seed: int
    requests: list[Request]
    events: list[Event]


PROBE_SCRIPT = """
import sys, threading, time
from vllm_tap.client import Client, DaemonUnavailable
endpoint, out, period, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with Client(endpoint) as c, open(out, "w") as f:
    while not done.is_set():
        t = time.monotonic()
        try:
            c.status(timeout=timeout)
            ok = 1
        except DaemonUnavailable:
            ok = 0
        dt = time.monotonic() - t
        f.write(f"{t} {dt} {ok}\\n")
        time.sleep(max(0.0, period - dt))
"""


def _probe_latencies(path, t_zero: float, windows: list[tuple[float, float]]
                     ) -> tuple[list[float], list[tuple[float, float]], list[float]]:
    """The probe's answers (seconds), those over 100 ms (when, seconds into the load; seconds) and
    when a status went unanswered, leaving out every question that spans a chaos event (from the
    signal to the daemon answering again)."""
    latencies, slow, unanswered = [], [], []
    for line in path.read_text().splitlines():
        t, dt, ok = line.split()
        t0, dt = float(t) - t_zero, float(dt)
        if any(t0 < w1 and w0 < t0 + dt for w0, w1 in windows):
            continue
        if ok == "1":
            latencies.append(dt)
            if dt > 0.1:
                slow.append((t0, dt))
        else:
            unanswered.append(t0)
    return latencies, slow, unanswered


def make_plan(seed: int) -> Plan:
    rng = random.Random(seed)
    requests = [Request(rng.randint(3, 60), rng.randint(20, 120), rng.uniform(0.4, 2.0))
                for _ in range(rng.randint(36, 44))]
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(rng.randint(2, 4))]
    rng.shuffle(kinds)
    events = [Event(k, rng.uniform(0.3, 1.5), rng.uniform(0.02, 0.15),
                    rng.uniform(0.2, 1.5) if k == "SIGSTOP" else rng.uniform(0.0, 0.5)) for k in kinds]
    if os.environ.get("VLLM_TAP_CHAOS_EVENTS") == "none":  # the same load, no chaos: the box's own status latency
        events = []
    return Plan(seed, requests, events)


# -- the threads --


@dataclass
class Daemon:
    """What the chaos thread did to the daemon, for the others to read: `phase` up / down / stopped,
    `epoch` counts changes (a probe that spans one is not counted)."""

    phase: str = "up"
    epoch: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, phase: str) -> None:
        with self.lock:
            self.phase, self.epoch = phase, self.epoch + 1

    def get(self) -> tuple[str, int]:
        with self.lock:
            return self.phase, self.epoch


@dataclass
class Sent:
    index: int
    prompt_len: int
    max_tokens: int
    t_sent: float
    t_done: float
    response: object


def _percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def test_a_daemon_killed_stopped_and_restarted_at_random_under_captured_load_loses_nothing_silently(
        stack, tmp_path, request):
    """Three clients send captured requests (prompts of 3-60 tokens, 20-120 new tokens) while the
    daemon is SIGKILLed and restarted, SIGSTOPped for 0.2-1.5 s, and SIGTERMed and restarted, each
    at least once, 5-7 times in all, each just after a request was sent. vLLM serves every request.
    Afterwards every capture is fetched and: ends; with its END read, expects exactly the request's
    positions and its positions + missing_positions are that range (without its END it says so,
    `end_known` false, and accounts for the range it gives); its Gaps carry documented reasons and
    are its missing_positions; each delivered output position gives vLLM's logprob; the watcher got
    it bit-equal. The watcher got every sequence number from before the load to the end once, in
    order, as a capture or inside a LostCaptures. And no capture is lost: every request's capture is
    fetchable from the last daemon, including those a killed or stopped daemon had retained."""
    plan = make_plan(SEED)
    tag = f"seed={SEED}"
    exact_reasons, prefix_reasons = documented_gap_reasons()
    endpoint = stack.daemon.endpoint
    stack.client.fetch(_request(stack, 3, 9998, 1).id, timeout=60)  # the daemon runs and is caught up
    since = stack.client.status()["sequence"]["next"] - 1

    daemon = Daemon()
    t_zero = time.monotonic()

    def now() -> float:
        return time.monotonic() - t_zero

    # The watcher: every capture from `since` on, reconnecting across restarts by itself.
    watched: list[WatchedCapture] = []
    lost: list[LostCaptures] = []
    watch_errors: list[BaseException] = []
    watch_client = Client(endpoint)
    watch = watch_client.watch(since=since, timeout=60)

    def watcher() -> None:
        try:
            for item in watch:
                (lost if isinstance(item, LostCaptures) else watched).append(item)
        except BaseException as e:  # noqa: BLE001 - asserted below
            watch_errors.append(e)

    # The load: each client waits its think time and sends the next request; the last CLIENTS
    # requests wait for the last event to begin, so that requests run through all of the chaos. An
    # event begins its delay after a request was sent (while it is captured), or, if every client
    # waits for the last event, at once.
    sent: dict[int, Sent] = {}
    client_errors: list[tuple[int, BaseException]] = []
    cond = threading.Condition()
    progress = {"next": 0, "sent": 0, "answered": 0, "events_begun": 0, "events_done": 0, "clients_left": CLIENTS,
                "held": 0}
    n = len(plan.requests)

    def running() -> int:
        return progress["sent"] - progress["answered"] - len(client_errors)

    def client() -> None:
        try:
            while True:
                with cond:
                    j = progress["next"]
                    if j >= n:
                        return
                    progress["next"] += 1
                    if j >= n - CLIENTS:
                        progress["held"] += 1
                        cond.notify_all()
                        while progress["events_begun"] < len(plan.events):
                            cond.wait(0.5)
                        progress["held"] -= 1
                req = plan.requests[j]
                time.sleep(req.think_s)
                with cond:
                    progress["sent"] += 1
                    cond.notify_all()
                t_sent = now()
                try:
                    r = _request(stack, req.prompt_len, 100 + j, req.max_tokens)
                except BaseException as e:  # noqa: BLE001 - asserted below
                    client_errors.append((j, e))
                    return
                sent[j] = Sent(j, req.prompt_len, req.max_tokens, t_sent, now(), r)
                with cond:
                    progress["answered"] += 1
                    cond.notify_all()
        finally:
            with cond:
                progress["clients_left"] -= 1
                cond.notify_all()

    chaos_errors: list[BaseException] = []

    def chaos() -> None:
        try:
            for ev in plan.events:
                time.sleep(ev.gap_s)
                with cond:
                    mark = progress["sent"]
                    while progress["sent"] == mark and progress["held"] < progress["clients_left"]:
                        cond.wait(0.5)
                time.sleep(ev.delay_s)
                with cond:
                    ev.t0, ev.answered, ev.running = now(), progress["answered"], running()
                    progress["events_begun"] += 1
                    cond.notify_all()
                proc = stack.daemon.proc
                if ev.kind == "SIGSTOP":
                    daemon.set("stopped")
                    os.kill(proc.pid, signal.SIGSTOP)
                    time.sleep(ev.pause_s)
                    os.kill(proc.pid, signal.SIGCONT)
                    daemon.set("up")
                else:
                    daemon.set("down")
                    if ev.kind == "SIGKILL":
                        proc.kill()
                        proc.wait()
                    else:
                        stack.daemon.stop()  # SIGTERM; SIGKILL only if it has not exited 20 s later
                        ev.returncode = proc.returncode
                    time.sleep(ev.pause_s)
                    stack.daemon.start(timeout=90)  # a loaded machine can take long to start a process
                    daemon.set("up")
                ev.t1 = now()
                with cond:
                    progress["events_done"] += 1
                    cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - asserted below
            chaos_errors.append(e)
        finally:
            with cond:  # the held requests go whatever happened
                progress["events_begun"] = len(plan.events)
                cond.notify_all()

    # The probe: status every 50 ms, from a process of its own (in this one, the clients' and the
    # watcher's threads would hold the GIL while its answer waits); answers that span a moment the
    # daemon was down or stopped are left out afterwards (_probe_latencies).
    probe_out = tmp_path / "probe.txt"
    probe_proc = subprocess.Popen([sys.executable, "-c", PROBE_SCRIPT, endpoint, str(probe_out), str(PROBE_PERIOD_S),
                                   str(PROBE_TIMEOUT_S)], stdin=subprocess.PIPE)
    probing = threading.Event()

    request.addfinalizer(lambda: (probing.set(), watch.close(), watch_client.close(), probe_proc.kill()))
    watch_thread = threading.Thread(target=watcher, daemon=True)
    watch_thread.start()
    chaos_thread = threading.Thread(target=chaos, daemon=True)
    chaos_thread.start()
    clients = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(300)
    chaos_thread.join(300)
    probing.set()
    probe_proc.stdin.close()  # the probe stops at the end of its input
    assert probe_proc.wait(30) == 0, (tag, "the status probe failed")
    t_load = now()
    assert not chaos_thread.is_alive() and not any(t.is_alive() for t in clients), (tag, progress)
    assert not chaos_errors, (tag, "the chaos thread failed", chaos_errors)
    assert not client_errors, (tag, "vLLM failed requests under chaos", client_errors[:3])
    assert progress["events_done"] == len(plan.events), (tag, progress)
    events = [(e.kind, f"{e.answered} answered, {e.running} running", round(e.t0, 2), round(e.t1, 2))
              for e in plan.events]
    latencies, slow, unanswered = _probe_latencies(probe_out, t_zero, [(e.t0, e.t1) for e in plan.events])

    # Settle: the daemon has read everything and ended every capture; one more capture, fetched whole.
    deadline = time.monotonic() + 120
    while True:
        s = stack.client.status()
        if all(r["pending_bytes"] == 0 for r in s["rings"]) and s["requests_in_flight"] == 0:
            break
        assert time.monotonic() < deadline, (tag, "the daemon never settled", s["rings"], s["requests"][:4])
        time.sleep(0.2)
    stack.client.fetch(_request(stack, 3, 9999, 1).id, timeout=60)
    last = stack.client.status()["sequence"]["next"] - 1
    deadline = time.monotonic() + 60
    while (watch.last_seq or 0) < last and not watch_errors and time.monotonic() < deadline:
        time.sleep(0.1)
    watch.close()
    watch_thread.join(10)

    # Every request's capture.
    def check(s: Sent) -> dict:
        name, stop = s.response.id, s.prompt_len + s.max_tokens - 1
        out: dict = {"index": s.index, "id": name, "problems": [], "gaps": {}}
        try:
            cap = stack.client.fetch(name, timeout=FETCH_TIMEOUT_S)
        except CaptureNotFound:
            out["not_found"] = True
            return out
        sub = stack.client.subscribe(name, timeout=FETCH_TIMEOUT_S)
        gaps = [item for item in sub.chunks() if isinstance(item, Gap)]
        problems = out["problems"]
        pos = cap.positions.tolist()
        missing = list(cap.missing_positions)
        out.update(delivered=len(pos), end_known=cap.end_known, reason=cap.finish_reason, expected=cap.expected)
        if cap.end_known:
            if cap.finish_reason != "length" or cap.expected != (0, stop):
                problems.append(f"END read: finish {cap.finish_reason!r}, expected {cap.expected}, not (0, {stop})")
        else:
            if cap.finish_reason not in END_UNKNOWN or cap.complete:
                problems.append(f"END not read, yet finish {cap.finish_reason!r}, complete {cap.complete}")
            if cap.expected is not None and (cap.expected[0] != 0 or cap.expected[1] > stop):
                problems.append(f"END not read: expected {cap.expected} is not within (0, {stop})")
        if cap.expected is not None and sorted(pos + missing) != list(range(*cap.expected)):
            problems.append(f"positions + missing_positions != expected {cap.expected}: {len(pos)} delivered "
                            f"{pos[:2]}..{pos[-1:]}, missing {cap.missing_positions.ranges[:4]}")
        gap_positions = sorted(p for g in gaps for p in g.positions)
        if gap_positions != missing:
            problems.append(f"the Gaps' positions are not missing_positions: {[(g.positions, g.reason) for g in gaps][:4]}"
                            f" vs {cap.missing_positions.ranges[:4]}")
        for g in gaps:
            if not (g.reason in exact_reasons or g.reason.startswith(prefix_reasons)):
                problems.append(f"undocumented gap reason {g.reason!r} at {g.positions}")
            out["gaps"][g.reason] = out["gaps"].get(g.reason, 0) + len(g.positions)
        rows = dict(zip(pos, cap.logits)) if cap.logits is not None else {}
        if len(rows) != len(pos):
            problems.append(f"{len(pos)} positions delivered, {len(rows)} rows of logits")
        bad = logprob_mismatches(rows, s.response, s.prompt_len, TOL)
        if bad:
            problems.append(f"{len(bad)} output positions differ from vLLM's logprobs (k, got, vLLM): {bad[:3]}")
        seen = [w for w in watched if w.response_id == name]
        out["watched"] = len(seen)
        for w in seen:
            if not (np.array_equal(w.capture.positions, cap.positions) and np.array_equal(w.capture.logits, cap.logits)
                    and list(w.capture.missing_positions) == missing):
                problems.append(f"watched as seq {w.seq} unlike the fetched capture: {len(w.capture.positions)} "
                                f"positions, missing {w.capture.missing_positions.ranges[:4]}")
        return out

    with cf.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(check, [sent[j] for j in sorted(sent)]))

    def after(j: int) -> str:
        """The first restart after request j was answered: the daemon that had its capture went."""
        ev = next(((k, e) for k, e in enumerate(plan.events) if e.kind != "SIGSTOP" and e.t0 >= sent[j].t_done), None)
        return f"event {ev[0]} {ev[1].kind} at {ev[1].t0:.1f}s" if ev else "no restart after it"

    not_found = [(r["index"], r["id"], after(r["index"])) for r in results if r.get("not_found")]
    not_found_by = {k: sum(1 for _, _, a in not_found if k in a) for k in ("SIGKILL", "SIGTERM")}
    problems = [(r["index"], r["id"], p) for r in results for p in r["problems"]]
    gaps_by_reason: dict[str, int] = {}
    for r in results:
        for k, v in r["gaps"].items():
            gaps_by_reason[k] = gaps_by_reason.get(k, 0) + v

    # The watch: each seq once, in order; every seq from since+1 to the last yielded or reported lost.
    seqs = [w.seq for w in watched]
    lost_seqs = {q for x in lost for q in range(x.first, x.last + 1)}
    uncovered = sorted(set(range(since + 1, last + 1)) - set(seqs) - lost_seqs)
    lost_by_reason: dict[str, int] = {}
    for x in lost:
        lost_by_reason[x.reason] = lost_by_reason.get(x.reason, 0) + len(x)
    ours = {s.response.id: s for s in sent.values()}
    watch_problems = []
    for w in watched:
        cap = w.capture
        pos = cap.positions.tolist()
        if cap.expected is not None and sorted(pos + list(cap.missing_positions)) != list(range(*cap.expected)):
            watch_problems.append((w.seq, w.response_id, f"positions + missing != expected {cap.expected}"))
        s = ours.get(w.response_id)
        if s is not None and cap.logits is not None:
            bad = logprob_mismatches(dict(zip(pos, cap.logits)), s.response, s.prompt_len, TOL)
            if bad:
                watch_problems.append((w.seq, w.response_id, f"differs from vLLM's logprobs: {bad[:3]}"))

    report = {
        "seed": SEED, "requests": len(sent), "load_s": round(t_load, 1), "events": events,
        "sigterm_exit": [e.returncode for e in plan.events if e.kind == "SIGTERM"],
        "status_probes": len(latencies), "status_unanswered": len(unanswered),
        "status_p50_ms": None if not latencies else round(1000 * _percentile(latencies, 50), 2),
        "status_p99_ms": None if not latencies else round(1000 * _percentile(latencies, 99), 2),
        "status_max_ms": None if not latencies else round(1000 * max(latencies), 2),
        "status_over_100ms": len(slow),
        "captures_found": len(results) - len(not_found), "captures_not_found": len(not_found),
        "not_found_after": not_found_by, "end_unknown": sum(1 for r in results if r.get("end_known") is False),
        "positions_delivered": sum(r.get("delivered", 0) for r in results), "gap_positions_by_reason": gaps_by_reason,
        "watch": {"since": since, "last": last, "yielded": len(seqs), "lost_by_reason": lost_by_reason,
                  "uncovered": len(uncovered),
                  "requests_watched_twice": sum(1 for r in results if r.get("watched", 0) > 1)},
        "problems": len(problems), "watch_problems": len(watch_problems),
    }
    detail = {**report, "captures": [{**r, "t_sent": round(sent[r["index"]].t_sent, 2),
                                     "t_done": round(sent[r["index"]].t_done, 2)} for r in results],
              "lost": [(x.first, x.last, x.reason) for x in lost], "seqs": seqs,
              "status_over_100ms": [(round(t, 2), round(1000 * dt)) for t, dt in slow]}
    (tmp_path / "chaos-detail.json").write_text(json.dumps(detail, indent=1, default=str))
    text = json.dumps(report, indent=1, default=str)
    (tmp_path / "chaos-report.json").write_text(text)
    sys.stderr.write(f"\nchaos report ({tmp_path / 'chaos-report.json'}):\n{text}\n")

    assert not watch_errors, (tag, "the watch failed", watch_errors[:1])
    assert all(e.returncode == 0 for e in plan.events if e.kind == "SIGTERM"), (tag, "a graceful stop failed", report)
    assert not problems, (tag, f"{len(problems)} problems in {len(results)} captures", problems[:6], report)
    assert results and report["positions_delivered"] > 0, (tag, report)
    assert seqs == sorted(set(seqs)), (tag, "the watch yielded a seq twice or out of order", seqs)
    assert not set(seqs) & lost_seqs, (tag, "yielded and reported lost", sorted(set(seqs) & lost_seqs))
    assert set(lost_by_reason) <= set(wf.LOST_REASONS), (tag, lost_by_reason)
    assert not uncovered, (tag, f"{len(uncovered)} seqs neither yielded nor reported lost", uncovered[:10], report)
    assert not watch_problems, (tag, watch_problems[:6])
    assert not not_found, (tag, f"{len(not_found)} of {len(results)} captures CaptureNotFound after the chaos "
                                f"(request index, id, the first restart after it was answered)", not_found[:8], report)
