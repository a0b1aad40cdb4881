"""The handover of a graceful stop, through the parts that make it (daemon/instances.py, the Store, the
codec in daemon/handover.py, the file in a state directory): no daemon process, no rings."""

from __future__ import annotations

from vllm_tap.daemon import handover
from vllm_tap.daemon.events import NOT_CAPTURED_PREVIOUS, Gap, Tokens
from vllm_tap.daemon.instances import Instances
from vllm_tap.daemon.store import Store

from test_reassembly import begin, data, delivered, gaps


def _instances() -> tuple[Instances, list]:
    store = Store(1 << 30, 600.0)
    out: list = []

    def deliver(events, now):
        for ev in events:
            store.add(ev, now)
        out.extend(events)

    return Instances(store, deliver, end_grace_s=1.0, inflight_bytes=1 << 30), out


def _feed(inst: Instances, *records) -> None:
    for r in records:
        inst.record("default", r, 0.0, "test")


def test_what_was_delivered_goes_over_within_its_byte_budget_and_the_rest_as_a_gap(tmp_path, monkeypatch):
    """Two captures in flight, each with positions delivered; the budget holds one capture's history:
    the first goes over whole, the second's delivered positions come as one Gap NOT_CAPTURED_PREVIOUS
    (as before there was a budget), and what each held goes over either way."""
    first, _ = _instances()
    for rid in ("a", "b"):
        _feed(first, begin(rid=rid, n_prompt=2), data(0, [0, 1], rid=rid), data(1, [2], rid=rid), data(2, [3], rid=rid))
    a_bytes = first._store.get(("default", "a")).nbytes
    monkeypatch.setattr(handover, "MAX_DELIVERED_BYTES", a_bytes)
    first.hand_over(str(tmp_path))
    second, out = _instances()
    second.take_handover(str(tmp_path), 1.0)
    by = {rid: [e for e in out if getattr(e, "request_id", None) == rid] for rid in ("a", "b")}
    assert delivered(by["a"]) == [0, 1, 2] and gaps(by["a"]) == []
    assert delivered(by["b"]) == [] and gaps(by["b"]) == [([0, 1, 2], NOT_CAPTURED_PREVIOUS)]
    # Position 3, the newest output position, went over held back, and the next daemon holds it still.
    assert all(not any(isinstance(e, (Tokens, Gap)) and 3 in e.positions for e in by[rid]) for rid in by)
