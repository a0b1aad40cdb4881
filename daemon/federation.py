"""Federation: a peer daemon streams its rings' raw records to the engine's home daemon, which
reassembles them as more ranks; the home sends its peers its engine rings' control records, with
which a peer delivers captures its own ranks' records suffice for. The protocol of both sides as pure state machines (no sockets, no
clock: messages and `now` in, messages and facts out); daemon/peer_link.py drives them over ZeroMQ,
vllm_tap/federation_format.py is what crosses the wire.

The peer's side (one session per connection it makes; it dials the home, nothing is discovered):

    state       what happens                                  next state   it sends
    ──────────  ────────────────────────────────────────────  ───────────  ─────────────────────────
    IDLE        connect(session)                              GREETING     Hello
    GREETING    Welcome of this session                       STREAMING    RingOpened of every ring
    GREETING    Refused                                       REFUSED      -
    GREETING    nothing heard for SILENCE_S, or disconnected  IDLE         -
    STREAMING   Credit                                        STREAMING    -
    STREAMING   Controls of this session                      STREAMING    - (the peer's reassembly
                                                                           takes its records)
    STREAMING   a ring's records, within credit               STREAMING    RecordBatch
    STREAMING   a ring opened / gone                          STREAMING    RingOpened / RingGone
    STREAMING   nothing sent for BEAT_INTERVAL_S              STREAMING    Beat
    STREAMING   nothing heard for SILENCE_S, or disconnected  IDLE         -
    REFUSED     connect(session)                              GREETING     Hello

The home's side, per peer session:

    state       what happens                                  next state   out
    ──────────  ────────────────────────────────────────────  ───────────  ─────────────────────────
    (none)      Hello of this version                         STREAMING    Welcome; an older session
                                                                           of that host ends (its
                                                                           rings: `peer reconnected`)
    (none)      Hello of another version                      (none)       Refused
    STREAMING   RingOpened                                    STREAMING    RingAdded
    STREAMING   RecordBatch, next seq, within credit          STREAMING    Records, RingRead; Credit
    STREAMING   RecordBatch out of seq or beyond credit       ENDED        every ring RingLost
    STREAMING   RingGone                                      STREAMING    RingLost
    STREAMING   the home read control records from an engine  STREAMING    Controls
                ring
    STREAMING   its connection closed, or nothing heard for   ENDED        every ring RingLost
                SILENCE_S                                                  (`peer gone`)

A ring lost is the home's dead writer: its captures resolve what waits on it with the reason given,
under the same rule (and within the same second) as a local writer's death.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Union

from vllm_tap import federation_format as ff

log = logging.getLogger(__name__)

PEER_GONE = "peer gone"  # the peer daemon stopped answering (killed, its host or the network down)
PEER_RECONNECTED = "peer reconnected"  # a new session of the same host: what was on the way is lost
PEER_LINK_BROKEN = "peer link lost records"  # a batch out of sequence or beyond its credit


class PeerState(enum.Enum):
    IDLE = "idle"
    GREETING = "greeting"
    STREAMING = "streaming"
    REFUSED = "refused"


class PeerEvent(enum.Enum):
    CONNECT = "connect"
    WELCOME = "welcome"
    REFUSED = "refused"
    SILENCE = "silence"
    CREDIT = "credit"
    CONTROLS = "controls"


PEER_TRANSITIONS: dict[tuple[PeerState, PeerEvent], PeerState] = {
    (PeerState.IDLE, PeerEvent.CONNECT): PeerState.GREETING,
    (PeerState.REFUSED, PeerEvent.CONNECT): PeerState.GREETING,
    (PeerState.GREETING, PeerEvent.WELCOME): PeerState.STREAMING,
    (PeerState.GREETING, PeerEvent.REFUSED): PeerState.REFUSED,
    (PeerState.GREETING, PeerEvent.SILENCE): PeerState.IDLE,
    (PeerState.STREAMING, PeerEvent.CREDIT): PeerState.STREAMING,
    (PeerState.STREAMING, PeerEvent.CONTROLS): PeerState.STREAMING,
    (PeerState.STREAMING, PeerEvent.SILENCE): PeerState.IDLE,
}


class ProtocolError(RuntimeError):
    """A move the table does not have: a bug."""


@dataclass
class Outgoing:
    """A message to send, and its record frames."""

    msg: ff.Message
    records: list[bytes] = field(default_factory=list)


@dataclass
class _PeerRing:
    opened: ff.RingOpened


class PeerProtocol:
    """The peer's side: what to send, and how much it may (its credit)."""

    def __init__(self, host: str):
        self.host = host
        self.state = PeerState.IDLE
        self.session = 0
        self.credit = 0
        self.window = 0  # the credit of a Welcome: when credit is back to it, nothing is in flight
        self.refused_reason = ""
        self._seq = 0
        self._rings: dict[int, _PeerRing] = {}
        self._heard = 0.0
        self._sent = 0.0
        self.batches_sent = 0
        self.bytes_sent = 0

    def _go(self, event: PeerEvent) -> None:
        nxt = PEER_TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise ProtocolError(f"peer side: {event.value} in state {self.state.value}")
        self.state = nxt

    @property
    def streaming(self) -> bool:
        return self.state is PeerState.STREAMING

    def connect(self, session: int, now: float) -> Outgoing:
        """A new connection to the home (`session`: new each time): say hello."""
        self._go(PeerEvent.CONNECT)
        self.session, self.credit, self._seq = session, 0, 0
        self._heard = self._sent = now
        return Outgoing(ff.Hello(ff.FEDERATION_VERSION, self.host, session))

    def received(self, msg: ff.Message, now: float) -> list[Outgoing]:
        """A message from the home."""
        if isinstance(msg, ff.Welcome) and msg.session == self.session and self.state is PeerState.GREETING:
            self._go(PeerEvent.WELCOME)
            self._heard = now
            self.credit = self.window = max(msg.credit, 0)
            for r in self._rings.values():  # announced again, in this session
                r.opened.session = self.session
            return [Outgoing(r.opened) for r in self._rings.values()]
        if isinstance(msg, ff.Refused) and self.state is PeerState.GREETING:
            self._go(PeerEvent.REFUSED)
            self.refused_reason = msg.reason
            return []
        if isinstance(msg, ff.Credit) and msg.session == self.session and self.streaming:
            self._go(PeerEvent.CREDIT)
            self._heard = now
            self.credit += max(msg.grant, 0)
        return []  # another session's, or out of turn: stale, ignored

    def controls(self, msg: ff.Controls, now: float) -> bool:
        """The home's control records: True if they are this session's (the driver feeds them to
        the peer's own reassembly), False if stale."""
        if msg.session != self.session or not self.streaming:
            return False
        self._go(PeerEvent.CONTROLS)
        self._heard = now
        return True

    def lost(self) -> None:
        """The connection cannot take a message (the driver's send failed): as good as silence."""
        if self.state in (PeerState.GREETING, PeerState.STREAMING):
            self._go(PeerEvent.SILENCE)

    def tick(self, now: float) -> list[Outgoing]:
        """Time: a Beat when nothing was sent for a while; back to IDLE when the home went silent."""
        if self.state in (PeerState.GREETING, PeerState.STREAMING) and now - self._heard >= ff.SILENCE_S:
            self._go(PeerEvent.SILENCE)
            return []
        if self.streaming and now - self._sent >= ff.BEAT_INTERVAL_S:
            self._sent = now
            return [Outgoing(ff.Beat(self.session))]
        return []

    def ring_opened(self, ring_id: int, instance: str, name: str, epoch: int, rank: int, world_size: int,
                    placement: bytes) -> list[Outgoing]:
        opened = ff.RingOpened(self.session, ring_id, instance, name, epoch, rank, world_size, placement)
        self._rings[ring_id] = _PeerRing(opened)
        if not self.streaming:
            return []  # announced with the others on Welcome
        opened.session = self.session
        return [Outgoing(opened)]

    def room(self) -> int:
        """Bytes of records that may be read and sent now (0 when not streaming)."""
        return max(self.credit, 0) if self.streaming else 0

    def room_for_one(self) -> int:
        """How large one record sent alone may be now: any size once nothing is in flight (a record
        larger than the whole window goes by itself), else what the credit leaves."""
        if not self.streaming:
            return 0
        return ff.MAX_RECORD_BYTES if self.credit >= self.window > 0 else max(self.credit, 0)

    def records(self, ring_id: int, records: list[bytes], read: int, written: int, now: float) -> list[Outgoing]:
        """Records read from a ring (within room()), and its cursors after that poll."""
        if not self.streaming:
            return []
        n = sum(len(r) for r in records)
        if n > self.credit and not (len(records) == 1 and n <= self.room_for_one()):
            raise ProtocolError(f"peer side: {n} bytes of records read with {self.credit} bytes of credit")
        self.credit -= n
        self._sent = now
        batch = ff.RecordBatch(self.session, self._seq, ring_id, read, written, [len(r) for r in records])
        self._seq += 1
        self.batches_sent += 1
        self.bytes_sent += n
        return [Outgoing(batch, records)]

    def ring_gone(self, ring_id: int, reason: str, closed: bool, now: float) -> list[Outgoing]:
        if closed:
            self._rings.pop(ring_id, None)
        if not self.streaming:
            return []
        self._sent = now
        gone = ff.RingGone(self.session, self._seq, ring_id, reason[: ff.MAX_NAME], closed)
        self._seq += 1
        return [Outgoing(gone)]


# -- the home's side --


@dataclass(frozen=True)
class RingAdded:
    """A peer's ring to take as one more of the instance's rings, named `ring` here."""

    host: str
    instance: str
    ring: str
    rank: int
    world_size: int
    placement: bytes


@dataclass(frozen=True)
class Records:
    instance: str
    ring: str
    epoch: int
    records: list[bytes]


@dataclass(frozen=True)
class RingRead:
    instance: str
    ring: str
    read: int
    written: int


@dataclass(frozen=True)
class RingLost:
    """A peer's ring no longer reports: its writer is gone (the peer said so), or the whole session
    ended (`session`: then nothing more comes from any of the peer's ranks)."""

    instance: str
    ring: str
    reason: str
    closed: bool
    session: bool = False


@dataclass(frozen=True)
class Reply:
    """A message to the peer connection `to` (the driver's routing id)."""

    to: bytes
    msg: ff.Message
    records: list[bytes] = field(default_factory=list)  # Controls: its record frames


Fact = Union[RingAdded, Records, RingRead, RingLost, Reply]


class HomeState(enum.Enum):
    STREAMING = "streaming"
    ENDED = "ended"


class HomeEvent(enum.Enum):
    RING = "ring opened or gone"
    CONTROLS = "control records to send"
    BATCH = "a batch in sequence and within credit"
    BAD_BATCH = "a batch out of sequence or beyond credit"
    SILENCE = "silence"
    DISCONNECTED = "its connection closed"
    REPLACED = "a newer session of the host"


HOME_TRANSITIONS: dict[tuple[HomeState, HomeEvent], HomeState] = {
    (HomeState.STREAMING, HomeEvent.RING): HomeState.STREAMING,
    (HomeState.STREAMING, HomeEvent.CONTROLS): HomeState.STREAMING,
    (HomeState.STREAMING, HomeEvent.BATCH): HomeState.STREAMING,
    (HomeState.STREAMING, HomeEvent.BAD_BATCH): HomeState.ENDED,
    (HomeState.STREAMING, HomeEvent.SILENCE): HomeState.ENDED,
    (HomeState.STREAMING, HomeEvent.DISCONNECTED): HomeState.ENDED,
    (HomeState.STREAMING, HomeEvent.REPLACED): HomeState.ENDED,
}


@dataclass
class Session:
    """One connection of one peer daemon, as the home sees it."""

    to: bytes
    host: str
    session: int
    heard: float
    credit: int
    state: HomeState = HomeState.STREAMING
    seq: int = 0
    rings: dict[int, ff.RingOpened] = field(default_factory=dict)
    records_in: int = 0
    bytes_in: int = 0

    def go(self, event: HomeEvent) -> None:
        nxt = HOME_TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise ProtocolError(f"home side: {event.value} in state {self.state.value}")
        self.state = nxt

    def ring_name(self, ring_id: int) -> str:
        return f"{self.host}/{self.rings[ring_id].name}"


class HomeProtocol:
    """The home's side: peer sessions in, facts for reassembly and replies out."""

    def __init__(self, credit_bytes: int = ff.DEFAULT_CREDIT_BYTES):
        self.credit_bytes = credit_bytes
        self.sessions: dict[bytes, Session] = {}  # by the connection's routing id
        self.sessions_ended = 0
        self.ended_reasons: dict[str, int] = {}

    def received(self, to: bytes, msg: ff.Message, records: list[bytes], now: float) -> list[Fact]:
        out: list[Fact] = []
        if isinstance(msg, ff.Hello):
            if msg.version != ff.FEDERATION_VERSION:
                return [Reply(to, ff.Refused(f"federation version {msg.version}, this daemon speaks "
                                             f"{ff.FEDERATION_VERSION}: run one vllm-tap version on every host"))]
            for old_to, old in list(self.sessions.items()):
                if old.host == msg.host or old_to == to:
                    self._end(old_to, HomeEvent.REPLACED, PEER_RECONNECTED, out)
            self.sessions[to] = Session(to, msg.host, msg.session, now, self.credit_bytes)
            log.info("peer daemon %s connected (session %x)", msg.host, msg.session)
            out.append(Reply(to, ff.Welcome(ff.FEDERATION_VERSION, msg.session, self.credit_bytes)))
            return out
        s = self.sessions.get(to)
        if s is None or getattr(msg, "session", None) != s.session:
            return out  # an ended session's, or before its Hello: nothing of it can be placed
        s.heard = now
        if isinstance(msg, ff.RingOpened):
            s.go(HomeEvent.RING)
            s.rings[msg.ring_id] = msg
            out.append(RingAdded(s.host, msg.instance, s.ring_name(msg.ring_id), msg.rank, msg.world_size,
                                 msg.placement))
        elif isinstance(msg, ff.RecordBatch):
            n = sum(msg.sizes)
            alone = len(msg.sizes) == 1 and s.credit >= self.credit_bytes  # nothing in flight: any size
            if msg.seq != s.seq or (n > s.credit and not alone) or msg.ring_id not in s.rings:
                why = (f"batch {msg.seq} where {s.seq} was due" if msg.seq != s.seq else
                       f"{n} bytes with {s.credit} of credit" if n > s.credit else f"unknown ring {msg.ring_id}")
                log.error("peer daemon %s: %s; its rings end here (%s)", s.host, why, PEER_LINK_BROKEN)
                self._end(to, HomeEvent.BAD_BATCH, PEER_LINK_BROKEN, out)
                return out
            s.go(HomeEvent.BATCH)
            s.seq += 1
            s.credit -= n
            s.records_in += len(records)
            s.bytes_in += n
            ring = s.rings[msg.ring_id]
            name = s.ring_name(msg.ring_id)
            if records:
                out.append(Records(ring.instance, name, ring.epoch, records))
            out.append(RingRead(ring.instance, name, msg.read, msg.written))
            if n:  # taken: the same again may come
                s.credit += n
                out.append(Reply(to, ff.Credit(s.session, n)))
        elif isinstance(msg, ff.RingGone):
            if msg.seq != s.seq or msg.ring_id not in s.rings:
                self._end(to, HomeEvent.BAD_BATCH, PEER_LINK_BROKEN, out)
                return out
            s.go(HomeEvent.RING)
            s.seq += 1
            ring = s.rings[msg.ring_id]
            out.append(RingLost(ring.instance, s.ring_name(msg.ring_id), msg.reason, msg.closed))
            if msg.closed:
                del s.rings[msg.ring_id]
        return out

    def controls(self, instance: str, records: list[bytes]) -> list[Fact]:
        """Control records the home read from `instance`'s engine ring, for every peer session."""
        out: list[Fact] = []
        if not records:
            return out
        sizes = [len(r) for r in records]
        for to, s in self.sessions.items():
            s.go(HomeEvent.CONTROLS)
            out.append(Reply(to, ff.Controls(s.session, instance, sizes), records))
        return out

    def disconnected(self, to: bytes, now: float) -> list[Fact]:
        """The connection `to` closed (the peer daemon killed, crashed or stopped): its session ends at once."""
        out: list[Fact] = []
        s = self.sessions.get(to)
        if s is not None:
            log.warning("peer daemon %s disconnected: its rings end (%s)", s.host, PEER_GONE)
            self._end(to, HomeEvent.DISCONNECTED, PEER_GONE, out)
        return out

    def tick(self, now: float) -> list[Fact]:
        """Sessions silent for SILENCE_S end (`peer gone`); the others get a heartbeat."""
        out: list[Fact] = []
        for to, s in list(self.sessions.items()):
            if now - s.heard >= ff.SILENCE_S:
                log.warning("peer daemon %s silent for %.1f s: its rings end (%s)", s.host, now - s.heard, PEER_GONE)
                self._end(to, HomeEvent.SILENCE, PEER_GONE, out)
            else:
                out.append(Reply(to, ff.Credit(s.session, 0)))
        return out

    def _end(self, to: bytes, event: HomeEvent, reason: str, out: list[Fact]) -> None:
        s = self.sessions.pop(to)
        s.go(event)
        self.sessions_ended += 1
        self.ended_reasons[reason] = self.ended_reasons.get(reason, 0) + 1
        for ring_id, ring in s.rings.items():
            out.append(RingLost(ring.instance, s.ring_name(ring_id), reason, True, session=True))
