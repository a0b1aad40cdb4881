"""Federation as pure state machines: a peer host's ring records through the peer's and the home's
protocol (daemon/federation.py, every message through its wire format) into the home's reassembly,
beside the home host's own rings. Real ring records from a synthetic two-stage engine whose second
stage runs on the peer host; no sockets, time given."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_tap import federation_format as ff
from vllm_tap import ring_format as rf
from vllm_tap import ring_schema
from vllm_tap.daemon.events import End, Gap, Tokens
from vllm_tap.daemon.federation import (PEER_GONE, PEER_LINK_BROKEN, HomeProtocol, PeerProtocol, PeerState,
                                        ProtocolError, Records, Reply, RingLost, RingRead)
from vllm_tap.daemon.reassembly import ENGINE_SOURCE, Reassembler
from vllm_tap.ring_files import ring_path
from vllm_tap.ring_reader import RingReader

from synthetic_writer import Scenario, SyntheticEngine, expected

SC = Scenario(n_requests=2, prompt_len=6, gen_len=3, tp=1, pp=2, layers=(0, 1), chunk=3)
PEER_RANK = 1  # the second stage (layer 1 and the logits) runs on the peer host
TO = b"peer-connection"


def ring_records(tmp_path) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """(engine ring, home rank 0, peer rank 1) records of SC, as the rings hold them."""
    eng = SyntheticEngine(SC, str(tmp_path))
    eng.run()
    assert eng.flush() and eng.dropped == 0
    out = []
    for rank in (rf.ENGINE_RANK, 0, PEER_RANK):
        reader = RingReader(ring_path(str(tmp_path), SC.instance, rank))
        out.append(reader.poll_raw(1 << 30))
        assert reader.read_cursor == reader.written
        reader.close()
    eng.close()
    return out[0], out[1], out[2]


def wire(o) -> tuple[ff.Message, list[bytes]]:
    """A message through its encoding, as the sockets carry it."""
    return ff.decode([ff.encode(o.msg), *o.records])


class TwoHosts:
    """The home's reassembler, fed the home's rings directly and the peer's through both protocols."""

    def __init__(self, credit: int = ff.DEFAULT_CREDIT_BYTES, end_grace_s: float = 0.5):
        self.r = Reassembler(SC.instance, end_grace_s=end_grace_s)
        self.home = HomeProtocol(credit)
        self.peer = PeerProtocol("peer-host")
        self.events: list = []
        self.lost: list[RingLost] = []

    def local(self, ring: str, records: list[bytes], now: float) -> None:
        for raw in records:
            for rec in ring_schema.decode_record(raw, ring=ring):
                self.events += self.r.feed(rec, now)

    def to_home(self, out, now: float) -> None:
        for o in out:
            msg, records = wire(o)
            self.apply(self.home.received(TO, msg, records, now), now)

    def apply(self, facts, now: float) -> None:
        for f in facts:
            if isinstance(f, Reply):
                self.to_home(self.peer.received(ff.decode([ff.encode(f.msg)])[0], now), now)
            elif isinstance(f, Records):
                for raw in f.records:
                    for rec in ring_schema.decode_record(raw, ring=f.ring, epoch=f.epoch):
                        self.events += self.r.feed(rec, now)
            elif isinstance(f, RingRead):
                self.events += self.r.ring_read(f.ring, f.read, f.written, now)
            elif isinstance(f, RingLost):
                self.lost.append(f)
                if f.session:
                    self.r.ranks_lost(f.ring, now, f.reason)
                else:
                    self.r.writer_gone(f.ring, now, f.reason)
                if f.closed:
                    self.events += self.r.ring_closed(f.ring, now)

    def connect(self, now: float = 0.0, session: int = 7) -> None:
        self.to_home([self.peer.connect(session, now)], now)
        assert self.peer.state is PeerState.STREAMING
        self.to_home(self.peer.ring_opened(1, SC.instance, "rank-00001.ring", 1, PEER_RANK, SC.world, b""), now)

    def send(self, records: list[bytes], now: float, written: int = 0) -> None:
        self.to_home(self.peer.records(1, records, 0, written, now), now)

    def tick(self, now: float, peer: bool = True) -> None:
        self.apply(self.home.tick(now), now)
        if peer:
            self.to_home(self.peer.tick(now), now)
        self.events += self.r.tick(now)

    def end_of(self, i: int) -> End:
        ends = [e for e in self.events if isinstance(e, End) and e.request_id == SC.request_id(i)]
        assert len(ends) == 1, ends
        return ends[0]

    def arrays(self, i: int) -> dict[str, np.ndarray]:
        toks = [e for e in self.events if isinstance(e, Tokens) and e.request_id == SC.request_id(i)]
        out = {"positions": np.concatenate([t.positions for t in toks]),
               "token_ids": np.concatenate([t.token_ids for t in toks])}
        for name in toks[0].tensors:
            out[name] = np.concatenate([t.tensors[name] for t in toks])
        return out

    def gaps(self, i: int) -> list[tuple[list[int], str]]:
        return [(list(e.positions), e.reason) for e in self.events
                if isinstance(e, Gap) and e.request_id == SC.request_id(i)]


def assert_whole(h: TwoHosts, i: int) -> None:
    end = h.end_of(i)
    assert list(end.missing_positions) == [] and end.delivered == SC.end_position, end
    got, want = h.arrays(i), expected(SC, i)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].tobytes() == v.tobytes(), k


def test_a_peer_stage_streamed_through_both_protocols_makes_whole_captures(tmp_path):
    engine, rank0, rank1 = ring_records(tmp_path)
    h = TwoHosts()
    h.connect()
    h.local(ENGINE_SOURCE, engine[:2], 0.0)  # the BEGINs
    h.local("rank-00000.ring", rank0, 0.1)
    h.send(rank1, 0.1)
    h.local(ENGINE_SOURCE, engine[2:], 0.2)
    for i in range(SC.n_requests):
        assert_whole(h, i)
    assert h.home.sessions[TO].records_in == len(rank1)


def test_a_late_peer_and_an_end_before_its_last_record_still_make_whole_captures(tmp_path):
    engine, rank0, rank1 = ring_records(tmp_path)
    h = TwoHosts(end_grace_s=0.5)
    h.connect()
    h.local(ENGINE_SOURCE, engine, 0.0)  # every END read before any of the peer's records
    h.local("rank-00000.ring", rank0, 0.0)
    h.send(rank1[:-1], 0.3)
    h.tick(0.3)
    assert not [e for e in h.events if isinstance(e, End) and e.request_id == SC.request_id(1)]
    h.send(rank1[-1:], 0.4)  # the last one, after the ENDs, inside end_grace_s
    for i in range(SC.n_requests):
        assert_whole(h, i)


def test_a_peer_that_never_reports_makes_gaps_and_the_captures_end(tmp_path):
    engine, rank0, _ = ring_records(tmp_path)
    h = TwoHosts(end_grace_s=0.5)
    h.local(ENGINE_SOURCE, engine, 0.0)
    h.local("rank-00000.ring", rank0, 0.0)
    h.tick(0.6)
    for i in range(SC.n_requests):
        end = h.end_of(i)
        assert list(end.missing_positions) == list(range(SC.end_position)) and end.delivered == 0
        assert [p for ps, _ in h.gaps(i) for p in ps] == list(range(SC.end_position))


def test_duplicate_records_deliver_each_position_once(tmp_path):
    engine, rank0, rank1 = ring_records(tmp_path)
    h = TwoHosts()
    h.connect()
    h.local(ENGINE_SOURCE, engine[:2], 0.0)
    h.local("rank-00000.ring", rank0, 0.0)
    h.send(rank1, 0.1)
    h.send(rank1, 0.1)  # sent again, in sequence: reassembly drops what it delivered
    h.local(ENGINE_SOURCE, engine[2:], 0.2)
    for i in range(SC.n_requests):
        assert_whole(h, i)


def test_a_batch_out_of_sequence_ends_the_session_with_its_reason(tmp_path):
    _, _, rank1 = ring_records(tmp_path)
    h = TwoHosts()
    h.connect()
    [o] = h.peer.records(1, rank1[:1], 0, 0, 0.1)
    h.to_home([o], 0.1)
    h.to_home([o], 0.1)  # the same batch twice: a connection that replays
    assert [(f.ring, f.reason) for f in h.lost] == [("peer-host/rank-00001.ring", PEER_LINK_BROKEN)]
    assert TO not in h.home.sessions


def test_a_peer_gone_mid_capture_ends_its_captures_with_the_reason_within_a_second(tmp_path):
    engine, rank0, rank1 = ring_records(tmp_path)
    h = TwoHosts(end_grace_s=5.0)  # the END's grace is not what ends them
    h.connect()
    h.local(ENGINE_SOURCE, engine, 0.0)
    h.local("rank-00000.ring", rank0, 0.0)
    first = [raw for raw in rank1 if SC.request_id(0).encode() in raw]
    h.send(first, 0.1)  # request 0 whole; request 1's stage-two records never come
    last_record = 0.1
    h.apply(h.home.disconnected(TO, 0.15), 0.15)  # the peer daemon killed: its connection closes
    t = last_record
    while not all(any(isinstance(e, End) and e.request_id == SC.request_id(i) for e in h.events)
                  for i in range(SC.n_requests)):
        t = round(t + 0.05, 2)
        assert t <= last_record + 1.0, "captures not ended a second after the peer's last record"
        h.tick(t, peer=False)  # the peer daemon was killed: nothing more from it
    assert_whole(h, 0)
    end = h.end_of(1)
    assert list(end.missing_positions) == list(range(SC.end_position))
    assert {reason for _, reason in h.gaps(1)} == {PEER_GONE}
    assert [f.reason for f in h.lost] == [PEER_GONE]


def test_a_peer_connected_but_silent_is_gone_after_the_silence(tmp_path):
    engine, rank0, rank1 = ring_records(tmp_path)
    h = TwoHosts(end_grace_s=1.0)
    h.connect()
    h.local(ENGINE_SOURCE, engine, 0.0)
    h.local("rank-00000.ring", rank0, 0.0)
    h.tick(ff.SILENCE_S - 0.01, peer=False)
    assert not h.lost and TO in h.home.sessions  # quiet, not yet gone (a large message on its way)
    h.tick(ff.SILENCE_S, peer=False)
    assert [f.reason for f in h.lost] == [PEER_GONE]


def test_the_peer_sends_only_within_its_credit_and_the_home_tops_it_up(tmp_path):
    _, _, rank1 = ring_records(tmp_path)
    size = len(rank1[0])
    h = TwoHosts(credit=size)
    h.connect()
    assert h.peer.room() == size
    with pytest.raises(ProtocolError):
        h.peer.records(1, rank1[:2], 0, 0, 0.1)
    h.send(rank1[:1], 0.1)
    assert h.peer.room() == size  # the home took it and granted as much again
    # A peer that sends beyond its credit anyway: the home ends its session.
    batch = ff.RecordBatch(h.peer.session, 1, 1, 0, 0, [len(r) for r in rank1[:2]])
    h.apply(h.home.received(TO, batch, rank1[:2], 0.2), 0.2)
    assert [f.reason for f in h.lost] == [PEER_LINK_BROKEN]


def test_a_peer_of_another_version_is_refused_and_a_silent_home_sends_the_peer_back_to_dial():
    home, peer = HomeProtocol(), PeerProtocol("p")
    hello = peer.connect(1, 0.0)
    hello.msg.version = ff.FEDERATION_VERSION + 1
    [reply] = home.received(TO, *wire(hello), 0.0)
    peer.received(reply.msg, 0.0)
    assert peer.state is PeerState.REFUSED and "version" in peer.refused_reason
    peer.connect(2, 1.0)
    assert peer.tick(1.0 + ff.SILENCE_S) == [] and peer.state is PeerState.IDLE


def test_messages_are_decoded_against_their_bounds():
    ok = ff.RecordBatch(1, 0, 1, 0, 0, [64])
    with pytest.raises(ff.FormatError):
        ff.decode([ff.encode(ok), b"x" * 63])  # a frame that is not the length its batch says
    with pytest.raises(ff.FormatError):
        ff.decode([ff.encode(ff.Beat(1)), b"extra"])
    with pytest.raises(ff.FormatError):
        ff.decode([b"\x93garbage"])
    with pytest.raises(ff.FormatError):
        ff.decode([ff.encode(ff.Hello(1, "h" * (ff.MAX_NAME + 1), 1))])


def test_raw_polls_never_read_past_their_bytes_and_leave_the_rest_in_the_ring(tmp_path):
    eng = SyntheticEngine(SC, str(tmp_path))
    eng.run()
    eng.close()
    reader = RingReader(ring_path(str(tmp_path), SC.instance, PEER_RANK))
    whole = RingReader(ring_path(str(tmp_path), SC.instance, PEER_RANK), writable=False).poll_raw(1 << 30)
    first = reader.poll_raw(len(whole[0]) + len(whole[1]) - 1)
    assert first == whole[:1] and reader.read_cursor < reader.written
    assert reader.poll_raw(len(whole[1]) - 1) == []  # the next does not fit: it stays
    assert first + reader.poll_raw(1 << 30) == whole and reader.read_cursor == reader.written
    # The cursor went back into the file: a reader opened now (a restarted peer) starts after them.
    again = RingReader(ring_path(str(tmp_path), SC.instance, PEER_RANK))
    assert again.resumed and again.poll_raw(1 << 30) == []


def test_after_a_silent_home_the_peer_dials_a_new_session_that_announces_its_rings_again(tmp_path):
    engine, rank0, rank1 = ring_records(tmp_path)
    h = TwoHosts()
    h.connect(0.0, session=7)
    h.tick(ff.SILENCE_S, peer=False)  # the home hears nothing: the old session ends ...
    h.peer.tick(ff.SILENCE_S + 0.1)  # ... and the peer, hearing nothing either, goes back to dial
    assert h.peer.state is PeerState.IDLE and not h.home.sessions
    h.to_home([h.peer.connect(8, 1.0)], 1.0)  # Welcome: its ring is announced again, in the new session
    assert h.peer.streaming and h.home.sessions[TO].rings.keys() == {1}
    h.local(ENGINE_SOURCE, engine[:2], 1.0)
    h.local("rank-00000.ring", rank0, 1.0)
    h.send(rank1, 1.1)
    h.local(ENGINE_SOURCE, engine[2:], 1.2)
    for i in range(SC.n_requests):
        assert_whole(h, i)


def test_a_record_larger_than_the_whole_credit_goes_alone_once_nothing_is_in_flight(tmp_path):
    _, _, rank1 = ring_records(tmp_path)
    small, big = min(len(r) for r in rank1), max(len(r) for r in rank1)
    h = TwoHosts(credit=small)  # a window smaller than the largest record
    h.connect()
    assert h.peer.room_for_one() >= big  # nothing in flight: one record of any size may go
    h.send([r for r in rank1 if len(r) == big][:1], 0.1)
    assert h.peer.room() == small and TO in h.home.sessions  # taken, and the credit given back
    # With something in flight, a large record waits: the peer may not send it, the home would not take it.
    h.peer.credit = h.home.sessions[TO].credit = small - 64
    assert h.peer.room_for_one() == small - 64
    with pytest.raises(ProtocolError):
        h.peer.records(1, [r for r in rank1 if len(r) == big][:1], 0, 0, 0.2)
    eng = SyntheticEngine(SC, str(tmp_path / "again"))
    eng.run()
    eng.close()
    raw = RingReader(ring_path(str(tmp_path / "again"), SC.instance, PEER_RANK))
    assert raw.poll_raw(len(rank1[0]) - 1) == []
    got = raw.poll_raw(len(rank1[0]) - 1, first_max=1 << 40)  # the first record goes whatever its size
    assert got == rank1[:1]


def test_the_home_sends_its_engine_control_records_and_a_peer_delivers_what_its_own_ranks_suffice_for(tmp_path):
    """Controls: the home's engine-ring records to every peer session, through the wire format; the
    peer's own reassembly, given them and its ring's records, delivers captures of the logits (its
    stage's) whole, with the engine's values. Another session's Controls are stale."""
    sc = Scenario(n_requests=2, prompt_len=6, gen_len=3, tp=1, pp=2, layers=(), chunk=3)
    eng = SyntheticEngine(sc, str(tmp_path))
    eng.run()
    assert eng.flush() and eng.dropped == 0
    raws = {}
    for rank in (rf.ENGINE_RANK, PEER_RANK):
        reader = RingReader(ring_path(str(tmp_path), sc.instance, rank))
        raws[rank] = reader.poll_raw(1 << 30)
        reader.close()
    eng.close()
    home, peer = HomeProtocol(), PeerProtocol("peer-host")
    [welcome] = home.received(TO, *wire(peer.connect(7, 0.0)), 0.0)
    peer.received(welcome.msg, 0.0)
    [reply] = home.controls(sc.instance, raws[rf.ENGINE_RANK])
    msg, frames = ff.decode([ff.encode(reply.msg), *reply.records])
    assert isinstance(msg, ff.Controls) and msg.instance == sc.instance and frames == raws[rf.ENGINE_RANK]
    assert peer.controls(msg, 0.1) and peer.state is PeerState.STREAMING
    assert not peer.controls(ff.Controls(8, sc.instance, []), 0.1)  # another session's
    own = Reassembler(sc.instance)
    events: list = []
    for ring, records in ((ENGINE_SOURCE, frames), ("rank-00001.ring", raws[PEER_RANK])):
        for raw in records:
            for rec in ring_schema.decode_record(raw, ring=ring):
                events += own.feed(rec, 0.2)
    for i in range(sc.n_requests):
        rid = sc.request_id(i)
        [end] = [e for e in events if isinstance(e, End) and e.request_id == rid]
        assert end.complete and end.reason == "length"
        toks = [e for e in events if isinstance(e, Tokens) and e.request_id == rid]
        assert np.concatenate([t.tensors["logits"] for t in toks]).tobytes() == expected(sc, i)["logits"].tobytes()
    with pytest.raises(ff.FormatError):
        ff.decode([ff.encode(ff.Controls(7, sc.instance, [64])), b"x" * 63])
