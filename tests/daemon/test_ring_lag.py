"""How long a ring's oldest unread byte has waited, from the daemon's polls alone (daemon/ring_lag.py)."""

from __future__ import annotations

from vllm_tap.daemon.ring_lag import MAX_MARKS, RingLag


def test_nothing_unread_is_no_lag_and_a_stopped_daemon_counts_its_whole_stop():
    lag = RingLag()
    lag.observe(0, 0, 1.0)
    assert lag.seconds(0, 1.0) == 0.0
    lag.observe(100, 100, 2.0)  # read as soon as seen
    assert lag.seconds(100, 5.0) == 0.0
    # Stopped after the poll at 2.0; the writer wrote 1000 bytes meanwhile; the poll at 12.0 reads 300.
    lag.observe(400, 1100, 12.0)
    assert lag.seconds(400, 12.5) == 10.5  # committed after 2.0: waited up to 10.5 s
    lag.observe(700, 1500, 12.6)  # more written since 12.0
    assert lag.seconds(700, 12.7) == 10.7  # the oldest unread byte is still one of the first 1000
    lag.observe(1100, 1500, 12.8)
    assert abs(lag.seconds(1100, 13.0) - 1.0) < 1e-9  # now the bytes first seen at 12.6, written after 12.0
    lag.observe(1500, 1500, 13.1)
    assert lag.seconds(1500, 20.0) == 0.0


def test_a_reader_ahead_of_the_last_poll_and_a_bounded_number_of_marks():
    lag = RingLag()
    lag.observe(0, 10, 0.0)  # the first poll of a ring: what it held is dated from that poll
    assert lag.seconds(0, 1.0) == 1.0
    assert lag.seconds(10, 1.0) == 0.0  # status may read a later read cursor than the last poll left
    for k in range(3 * MAX_MARKS):
        lag.observe(10, 20 + k, 1.0 + k)
    assert len(lag._marks) == MAX_MARKS
    assert lag.seconds(10, 5000.0) == 5000.0  # the oldest unread bytes, seen at 1.0, were written after 0.0
    end = 20 + 3 * MAX_MARKS
    lag.observe(end, end, 6000.0)  # all read
    assert lag.seconds(end, 6000.0) == 0.0 and not lag._marks
