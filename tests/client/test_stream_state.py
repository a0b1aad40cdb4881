"""The client's subscription state machine, driven directly (sans-IO): what it sends on silence and
when silence becomes an error."""

from __future__ import annotations

import pytest

from vllm_tap import wire_format as wf
from vllm_tap.client import CaptureLost, DaemonStopped, DaemonUnavailable
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


def test_a_daemon_that_says_it_stops_is_waited_for_like_a_silent_one():
    """E_STOPPING (a graceful stop) ends nothing: the subscription is resent from the next position,
    and only when no daemon answers within the limit is it an error, naming the stop's reason."""
    st = _streaming(timeout=4.0)
    assert st.on_frames(wf.error_frames(wf.E_STOPPING, "daemon stopping (SIGTERM)", st.sub_id), 1.0) == []
    assert not st.done
    resent = wf.parse_request(st.on_silence(1.0 + HB))
    assert resent.from_position == st.next_position == 0
    with pytest.raises(DaemonStopped, match="SIGTERM"):
        st.on_silence(1.0 + 4.0 + HB + 0.01)


def test_a_watch_rides_through_a_stop_and_tells_a_caller_that_persists_at_watermarks():
    from vllm_tap.client.watch import DaemonStopping, watch_state

    st = watch_state("ipc:///nowhere", 5, instance=None, source=None, tap_key_prefix=None, model=None, whole=True,
                     watermarks=True, timeout=10.0, heartbeat_s=HB)
    st.request(0.0)
    assert st.on_frames([wf.pack(wf.WATCHING, st.sub_id, since=5, oldest=1, next=9, run_first=1, arena=None)], 0.0) == []
    items = st.on_frames(wf.error_frames(wf.E_STOPPING, "daemon stopping (SIGTERM)", st.sub_id), 1.0)
    assert items == [DaemonStopping(5, "daemon stopping (SIGTERM)")] and not st.done
    assert st.on_silence(1.0 + 3 * HB - 0.01) is None
    again = wf.parse_request(st.on_silence(1.0 + 3 * HB))  # the same watch, from the same seq
    assert again.since == 5
    with pytest.raises(DaemonStopped, match="SIGTERM"):
        st.on_silence(11.01)


def test_replies_are_one_tagged_union_decoded_in_one_call():
    """What the daemon encodes from a reply Struct the client decodes into the same Struct; a tokens
    message names an arena only when it has one; a wrong field type or another version is a WireError."""
    import msgpack
    import msgspec

    t = wf.TokensReply(id=3, seq=9, request_id="r", instance="i", start=4, count=1, token_ids=b"\x07\0\0\0",
                       tensors=[["logits", "float32", 1, 2]])
    frame = wf.encode(t)
    assert "arena" not in msgpack.unpackb(frame) and msgpack.unpackb(frame)["v"] == wf.WIRE_VERSION
    assert wf.decode_reply(frame) == t
    e = wf.EndReply(id=3, request_id="r", instance="i", reason="stop", missing=[[1, 3]], expected=[0, 5])
    assert wf.decode_reply(wf.encode(e)) == e
    assert isinstance(wf.decode_reply(wf.encode(wf.PingReply(id=None))), wf.PingReply)
    with pytest.raises(wf.WireError, match="gap"):
        wf.decode_reply(wf.pack(wf.GAP, 3, request_id="r", start="4", stop=5))
    with pytest.raises(wf.WireError) as info:
        wf.decode_reply(msgspec.msgpack.encode({**msgspec.to_builtins(t), "v": wf.WIRE_VERSION + 1}))
    assert info.value.code == wf.E_VERSION
