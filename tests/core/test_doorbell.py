"""The daemon's doorbell: a real Unix datagram socket in a real shm directory."""

from __future__ import annotations

import os
import socket

import numpy as np

from vllm_tap import ring_format as rf
from vllm_tap.doorbell import Doorbell, DoorbellPush, doorbell_path
from vllm_tap.ring_records import TensorId
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_reader import RingReader
from vllm_tap.ring_writer import RingWriter
from vllm_tap.ring_schema import EndMeta


def test_a_commit_rings_the_doorbell_only_while_the_reader_waits(shm_dir):
    """A busy daemon is not rung (a commit then costs no system call); one that raised its
    waiting flag before blocking is rung once, by the first commit, which lowers the flag."""
    os.makedirs(shm_dir, exist_ok=True)
    bell = Doorbell.bind(shm_dir)
    assert bell is not None and bell.path == doorbell_path(shm_dir)
    w = RingWriter(ring_path(shm_dir, "inst", 0), 1 << 16)
    reader = RingReader(w.path)
    data = np.ones((1, 4), np.float32)
    try:
        assert bell.drain() == 0
        w.write("r", TensorId(rf.TensorKind.LOGITS), [0], [1], data)
        w.write_control("r", EndMeta(reason="stop"))
        assert bell.drain() == 0 and w._doorbell.sent == 0, "the reader is awake: nobody rings"
        assert reader.has_new()
        reader.poll()
        assert not reader.has_new()
        reader.set_waiting(True)  # the daemon is about to block
        assert w.reader_waiting
        w.write("r", TensorId(rf.TensorKind.LOGITS), [1], [1], data)
        assert bell.drain() == 1 and not w.reader_waiting
        w.write("r", TensorId(rf.TensorKind.LOGITS), [2], [1], data)
        assert bell.drain() == 0, "one ring per sleep"
        reader.set_waiting(True)
        w.write_control("r", EndMeta(reason="stop"))
        assert bell.drain() == 1
        reader.set_waiting(True)
        reader.set_waiting(False)  # woke for another reason: writers stop ringing
        w.write("r", TensorId(rf.TensorKind.LOGITS), [3], [1], data)
        assert bell.drain() == 0
        reader.set_waiting(True)
        assert w.flush() and bell.drain() == 0, "nothing queued, nothing to announce"
    finally:
        reader.close()
        w.close(unlink=True)
        bell.close()
    assert not os.path.exists(doorbell_path(shm_dir))


def test_one_daemon_per_shm_dir_and_a_dead_ones_socket_is_taken_over(shm_dir):
    os.makedirs(shm_dir, exist_ok=True)
    first = Doorbell.bind(shm_dir)
    assert first is not None
    assert Doorbell.bind(shm_dir) is None, "a live daemon keeps its doorbell"
    # A daemon killed without cleaning up leaves the socket file behind, bound to nobody.
    first._sock.close()
    assert os.path.exists(first.path)
    second = Doorbell.bind(shm_dir)
    assert second is not None
    DoorbellPush(second.path).ring()
    assert second.drain() == 1
    second.close()


def test_without_a_daemon_a_writer_neither_fails_nor_retries_every_step(shm_dir):
    path = doorbell_path(shm_dir)
    push = DoorbellPush(path)
    for _ in range(100):
        push.ring()
    assert push.sent == 0
    # A daemon that appears later is rung once the back-off has passed.
    os.makedirs(shm_dir, exist_ok=True)
    bell = Doorbell.bind(shm_dir)
    push._retry_at = 1.0  # long past
    push.ring()
    assert push.sent == 1 and bell.drain() == 1
    bell.close()
    assert Doorbell.bind(os.path.join(shm_dir, "missing")) is None
