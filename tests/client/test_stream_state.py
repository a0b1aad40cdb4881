"""The client's subscription state machine, driven directly (sans-IO): what it sends on silence and
when silence becomes an error."""

from __future__ import annotations

import pytest

from vllm_tap import wire_format as wf
from vllm_tap.client import CaptureLost, DaemonUnavailable
from vllm_tap.client.stream import StreamState

HB = 0.5


def _streaming(timeout: float = 4.0) -> StreamState:
    """A subscription that got its BEGIN at t=0 and nothing since."""
    st = StreamState("ipc:///nowhere", "req-0", None, None, timeout, heartbeat_s=HB)
    st.start(0.0)
    begin = wf.pack(wf.BEGIN, st.sub_id, request_id="req-0", instance="i", start_position=0)
    assert st.on_frames([begin], 0.0) == []
    assert st.begin is not None
    return st


def _asked_wait(frames: list[bytes]) -> float:
    return float(wf.parse_request(frames).timeout)


def test_a_restarted_daemons_not_found_in_flight_at_the_limit_is_a_lost_capture_not_an_unavailable_daemon():
    """The daemon is asked to say `not found` by the silence limit; its answer arrives just after it.
    Before, the client gave up at the limit itself and reported the daemon gone."""
    st = _streaming(timeout=4.0)
    for t in (0.5, 2.0, 3.5):
        assert _asked_wait(st.on_silence(t)) == pytest.approx(4.0 - t)  # every resend: the answer is due at 4 s
    st.on_silence(4.05)  # the answer is on its way: not yet an error
    not_found = wf.error_frames(wf.E_NOT_FOUND, "no capture named 'req-0'", st.sub_id)
    with pytest.raises(CaptureLost):
        st.on_frames(not_found, 4.1)


def test_silence_past_the_limit_and_one_heartbeat_is_an_unavailable_daemon():
    st = _streaming(timeout=4.0)
    st.on_silence(4.0 + HB - 0.01)
    with pytest.raises(DaemonUnavailable):
        st.on_silence(4.0 + HB + 0.01)
