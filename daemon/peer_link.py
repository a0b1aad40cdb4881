"""The sockets of federation (daemon/federation.py is the protocol, vllm_tap/federation_format.py the
messages): a peer daemon's link to its home, and the home's listener for its peers. Both over
tcp:// with CURVE, on a ZeroMQ context of their own (their keys are not the subscribers').

PeerLink (a daemon with `home` set): the ring poller hands it every ring to read (`forward`); it
reads raw records within its credit, sends them, and tells the home of rings opened and gone (it is
the poller's RingFacts). Sends never block: a message the socket cannot take ends the session, and
the link dials again with a new one; what the rings hold meanwhile waits in them. It also feeds
what it reads, with the control records the home sends (Controls), to the peer daemon's own
reassembly: the peer delivers the captures its host's ranks suffice for (a layer on one of its
stages); the others lack the other hosts' ranks there (`incomplete`), and are whole at the home.
Captures in flight there when the session ends end (HOME_GONE): their END would come through it.

HomeLink (a daemon with `federation_endpoint` set): takes peers' sessions, decodes their records
against the ring schema and feeds them to reassembly (daemon/instances.py) as rings of the instance.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from vllm_tap import federation_format as ff
from vllm_tap import placement as placement_format
from vllm_tap import ring_schema

from .curve import CurveError, _check_private, load_secret
from .federation import (HomeProtocol, Outgoing, PeerProtocol, PeerState, Records, Reply, RingAdded,
                         RingLost, RingRead)
from .reassembly import ENGINE_SOURCE
from .ring_poller import READ_BUDGET_BYTES  # a peer reads each ring no more a round than the poller would

log = logging.getLogger(__name__)

REDIAL_S = 0.2  # after a session ended, the next dial
RECV_BUDGET = 256  # messages handled per round
SNDHWM = 100_000  # messages; what is in flight is bounded by the credit in bytes
LOG_FIRST = 20
HOME_GONE = "home daemon gone"  # a peer's captures in flight when its session with the home ended


def load_public(path: str) -> bytes:
    """The z85 public key of a `.key` file; CurveError (one line) otherwise."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveError(f"home_key {path}: {e}") from None
    if not public:
        raise CurveError(f"home_key {path}: holds no public key")
    return public


class PeerLink:
    """A peer daemon's link to the engine's home daemon."""

    def __init__(self, home: str, home_key: str, own_key: str, host: str = "", instances: Any = None):
        self.home = home
        self._instances = instances  # the peer daemon's own reassembly (daemon/instances.py), or None
        self._caches: dict[tuple[str, str], ring_schema.TableCache] = {}
        self._controlled: set[str] = set()  # instances the home sent control records of in the current link
        self._streaming = False
        self.controls_in = 0
        self.rejected = 0
        self._key_paths = (home_key, own_key)
        self._home_public = self._public = self._secret = b""
        self.proto = PeerProtocol(host or socket.gethostname())
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._ids: dict[tuple[str, str], tuple[int, int]] = {}  # ring key -> (ring id, epoch)
        self._next_id = 0
        self._reported: dict[int, float] = {}  # ring id -> when its cursors last went to the home
        self._dial_at = 0.0
        self.sessions = 0
        self.refused_logged = False

    def start(self) -> None:
        """Read the keys (CurveError: one line); the first dial is the loop's."""
        home_key, own_key = self._key_paths
        self._home_public = load_public(home_key)
        self._public, self._secret = load_secret(own_key, "federation_key")
        _check_private(own_key, what="federation_key", secret=True)
        log.info("a peer of the home daemon %s (federation, as %s)", self.home, self.proto.host)

    # -- the daemon's loop --

    def pump(self, now: float) -> bool:
        """Answers from the home, time, and (re)dialling; True if anything came."""
        busy = False
        proto = self.proto
        for _ in range(RECV_BUDGET if self._sock is not None else 0):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            busy = True
            try:
                msg, records = ff.decode(frames)
            except ff.FormatError as e:
                log.error("home daemon %s: %s", self.home, e)
                continue
            if isinstance(msg, ff.Controls):
                if proto.controls(msg, now):
                    self._controls(msg.instance, records, now)
                continue
            was = proto.state
            self._send(proto.received(msg, now))
            if proto.state is PeerState.STREAMING and was is not PeerState.STREAMING:
                log.info("streaming to the home daemon %s (session %x)", self.home, proto.session)
            if proto.state is PeerState.REFUSED and not self.refused_logged:
                self.refused_logged = True
                log.error("the home daemon %s refused this daemon: %s", self.home, proto.refused_reason)
        if self._monitor is not None and self._monitor.poll(0):
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            else:
                proto.lost()  # what was on the way may be lost with the connection: a new session
                self._dial_at = now + REDIAL_S
        self._send(proto.tick(now))
        if self._streaming and not proto.streaming:
            self._home_lost(now)
        self._streaming = proto.streaming
        if proto.state in (PeerState.IDLE, PeerState.REFUSED) and now >= self._dial_at:
            self._dial(now)
        return busy

    def _controls(self, instance: str, records: list[bytes], now: float) -> None:
        """The home's engine-ring control records, into this daemon's reassembly."""
        if self._instances is None:
            return
        self._controlled.add(instance)
        for raw in records:
            try:
                recs = ring_schema.decode_record(raw, ring=ENGINE_SOURCE, epoch=0)
            except ring_schema.Rejected as e:
                self.rejected += 1
                log.error("home daemon %s: a control record that does not fit the ring schema (%s)", self.home, e.why)
                continue
            for rec in recs:
                if rec.kind not in ff.CONTROL_KINDS:
                    self.rejected += 1
                    continue
                self.controls_in += 1
                self._instances.record(instance, rec, now, f"home {self.home}")

    def _home_lost(self, now: float) -> None:
        """The session ended: ENDs of the captures in flight here would have come through it."""
        if self._instances is None:
            return
        for instance in self._controlled:
            self._instances.writer_gone(instance, ENGINE_SOURCE, now, HOME_GONE)
        self._controlled.clear()

    def _local(self, ring: Any, recs: list[bytes], now: float) -> None:
        """What was read of `ring` and sent, also into this daemon's reassembly."""
        reader = ring.reader
        inst = self._instances
        if recs:
            cache = self._caches.setdefault(ring.key, ring_schema.TableCache())
            for raw in recs:
                try:
                    decoded = ring_schema.decode_record(raw, ring=reader.name, epoch=reader.epoch, table_cache=cache)
                except ring_schema.Rejected as e:
                    self.rejected += 1
                    if e.request_ids:
                        inst.rejected(ring.instance, e.request_ids, e.why, now)
                    continue
                for rec in decoded:
                    inst.record(ring.instance, rec, now, ring.path)
        inst.ring_read(ring.instance, reader.name, reader.read_cursor, reader.written, now)

    def _dial(self, now: float) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            if self.sessions:
                log.warning("no answer from the home daemon %s: dialling again", self.home)
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, SNDHWM)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.curve_serverkey = self._home_public
        s.curve_publickey = self._public
        s.curve_secretkey = self._secret
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self._monitor = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # the home gone: dial anew at once
        s.connect(self.home)
        self._sock = s
        self.sessions += 1
        self._dial_at = now + max(ff.SILENCE_S, REDIAL_S)
        self._reported.clear()
        self._send([self.proto.connect(int.from_bytes(os.urandom(8), "little") >> 1, now)])

    def _send(self, out: list[Outgoing]) -> None:
        for o in out:
            if self._sock is None:
                return
            try:
                self._sock.send_multipart([ff.encode(o.msg), *o.records], flags=zmq.NOBLOCK, copy=len(o.records) == 0)
            except zmq.ZMQError:
                self.proto.lost()  # the session ends; the next pump dials a new one
                return

    # -- what the ring poller asks (forward) and tells (RingFacts) --

    def forward(self, ring: Any) -> int:
        """Read `ring` (daemon/ring_poller.OpenRing) within credit and send what was read."""
        reader = ring.reader
        key = ring.key
        known = self._ids.get(key)
        if known is None or known[1] != reader.epoch:
            ring_id = self._next_id
            self._next_id += 1
            self._ids[key] = (ring_id, reader.epoch)
            where = placement_format.encode(reader.placement) if reader.placement is not None else b""
            self._send(self.proto.ring_opened(ring_id, ring.instance, reader.name, reader.epoch, reader.rank,
                                              reader.world_size, where))
        else:
            ring_id = known[0]
        room = min(self.proto.room(), READ_BUDGET_BYTES)
        first = self.proto.room_for_one()
        now = time.monotonic()
        if not self.proto.streaming:
            return 0
        recs = reader.poll_raw(room, first) if first > 0 else []
        if first <= 0:
            reader.written = reader.write_cursor()
        if recs or now - self._reported.get(ring_id, -1e9) >= ff.BEAT_INTERVAL_S:
            # Its cursors go with every batch, and at least every beat: the home's Barriers wait on them.
            self._reported[ring_id] = now
            self._send(self.proto.records(ring_id, recs, reader.read_cursor, reader.written, now))
        if self._instances is not None:
            self._local(ring, recs, now)
        return len(recs)

    def ring_resumed(self, instance: str, ring: str, replay_until: int = 0) -> None:
        if self._instances is not None:
            self._instances.ring_resumed(instance, ring)

    def record(self, instance: str, record: Any, now: float, path: str) -> None:
        pass  # a peer reads raw records (forward) and decodes them there

    def rejected(self, instance: str, request_ids: tuple[str, ...], why: str, now: float) -> None:
        pass

    def ring_read(self, instance: str, ring: str, read: int, written: int, now: float) -> None:
        pass  # told with what forward read

    def writer_gone(self, instance: str, ring: str, now: float, reason: str) -> None:
        known = self._ids.get((instance, ring))
        if known is not None:
            self._send(self.proto.ring_gone(known[0], reason, False, now))
        if self._instances is not None:
            self._instances.writer_gone(instance, ring, now, reason)

    def ring_closed(self, instance: str, ring: str, now: float) -> None:
        known = self._ids.pop((instance, ring), None)
        if known is not None:
            self._reported.pop(known[0], None)
            self._send(self.proto.ring_gone(known[0], "ring closed", True, now))
        self._caches.pop((instance, ring), None)
        if self._instances is not None:
            self._instances.ring_closed(instance, ring, now)

    def status(self) -> dict[str, Any]:
        p = self.proto
        return {"role": "peer", "home": self.home, "state": p.state.value, "sessions": self.sessions,
                "credit_bytes": p.credit, "batches_sent": p.batches_sent, "bytes_sent": p.bytes_sent,
                "refused": p.refused_reason, "controls_in": self.controls_in, "records_rejected": self.rejected}

    def close(self) -> None:
        self._sock = self._monitor = None
        self._ctx.destroy(linger=0)  # every socket of the link, closed without waiting


class HomeLink:
    """The home daemon's listener for its peers; their records go into `instances` (daemon/instances.py)."""

    def __init__(self, endpoint: str, own_key: str, peer_keys: str, instances: Any,
                 credit_bytes: int = ff.DEFAULT_CREDIT_BYTES):
        self.endpoint = endpoint
        self._own_key = own_key
        self._public = self._secret = b""
        self.peer_keys = peer_keys
        self._instances = instances
        self.proto = HomeProtocol(credit_bytes)
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._sock: zmq.Socket | None = None
        self._caches: dict[str, ring_schema.TableCache] = {}
        self.destination: Any = None  # where DATA payloads land (the daemon's arena); None: the heap
        self.placements: dict[tuple[str, str], Any] = {}  # (instance, ring) -> (rank, Placement) of peers' rings
        self.rejected = 0
        self.malformed = 0
        self._logs = LOG_FIRST
        self._beat_at = 0.0
        self._controls: dict[str, list[bytes]] = {}  # instance -> its engine ring's control records, for the peers

    def control(self, instance: str, record: Any) -> None:
        """A BEGIN, END or LIVE the home read from `instance`'s engine ring: its peers get it (Controls)."""
        if not self.proto.sessions:
            return
        self._controls.setdefault(instance, []).append(ring_schema.control_bytes(
            record.control, record.request_id, tap_key=record.tap_key, rank=record.rank, step=record.step))

    def start(self) -> None:
        """Read the keys (CurveError: one line) and listen (zmq.ZMQError)."""
        self._public, self._secret = load_secret(self._own_key, "federation_key")
        _check_private(self._own_key, what="federation_key", secret=True)
        if not os.path.isdir(self.peer_keys):
            raise CurveError(f"peer_keys {self.peer_keys} is not a directory")
        _check_private(self.peer_keys, what="peer_keys directory", secret=False)
        self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(__name__ + ".auth"))
        self._auth.start()
        self._auth.configure_curve(domain="*", location=self.peer_keys)
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.curve_server = True
        s.curve_publickey = self._public
        s.curve_secretkey = self._secret
        s.bind(self.endpoint)
        self._sock = s
        log.info("taking peer daemons on %s (keys in %s)", self.endpoint, self.peer_keys)

    def socket(self) -> zmq.Socket | None:
        """What wakes the daemon's loop when a peer sends (records wait for no timer)."""
        return self._sock

    def pump(self, now: float) -> bool:
        busy = False
        assert self._sock is not None
        for _ in range(RECV_BUDGET):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            busy = True
            if len(frames) < 2:
                continue
            try:
                msg, records = ff.decode(frames[1:])
            except ff.FormatError as e:
                self.malformed += 1
                self._say("a peer daemon sent %s", e)
                continue
            self._apply(self.proto.received(frames[0], msg, records, now), now)
        if self._controls:
            pending, self._controls = self._controls, {}
            for instance, recs in pending.items():
                for i in range(0, len(recs), ff.MAX_RECORDS_PER_BATCH):
                    self._apply(self.proto.controls(instance, recs[i : i + ff.MAX_RECORDS_PER_BATCH]), now)
        if now >= self._beat_at:
            self._beat_at = now + ff.BEAT_INTERVAL_S
            self._apply(self.proto.tick(now), now)
        return busy

    def _apply(self, facts: list[Any], now: float) -> None:
        inst = self._instances
        for f in facts:
            if type(f) is Reply:
                try:
                    self._sock.send_multipart([f.to, ff.encode(f.msg), *f.records], flags=zmq.NOBLOCK)
                except zmq.ZMQError as e:
                    # Mandatory routing: a connection that closed (the peer daemon killed, crashed or
                    # stopped) is unreachable at the next beat; a full one ends by silence, if ever.
                    if e.errno == zmq.EHOSTUNREACH:
                        self._apply(self.proto.disconnected(f.to, now), now)
            elif type(f) is Records:
                self._records(f, now)
            elif type(f) is RingRead:
                inst.ring_read(f.instance, f.ring, f.read, f.written, now)
            elif type(f) is RingLost:
                if f.session and f.ring in self._caches:  # it sent records: captures may wait on its ranks
                    inst.ranks_lost(f.instance, f.ring, now, f.reason)
                else:
                    inst.writer_gone(f.instance, f.ring, now, f.reason)
                if f.closed:
                    self._caches.pop(f.ring, None)
                    inst.ring_closed(f.instance, f.ring, now)
            elif type(f) is RingAdded:
                where = None
                if f.placement:
                    try:
                        where = placement_format.decode(f.placement)
                    except Exception as e:  # noqa: BLE001 - untrusted bytes: msgspec's errors
                        self._say("peer %s ring %s: bad placement (%s)", f.host, f.ring, e)
                self.placements[(f.instance, f.ring)] = (f.rank, where)
                log.info("peer daemon %s: reading ring %s of instance %s (rank %d of %d)", f.host, f.ring,
                         f.instance, f.rank, f.world_size)

    def _records(self, f: Records, now: float) -> None:
        cache = self._caches.setdefault(f.ring, ring_schema.TableCache())
        path = f"peer ring {f.ring}"
        for raw in f.records:
            try:
                recs = ring_schema.decode_record(raw, ring=f.ring, epoch=f.epoch, table_cache=cache,
                                                 destination=self.destination)
            except ring_schema.Rejected as e:
                self.rejected += 1
                self._say("%s: a record that does not fit the ring schema (%s)", path, e.why)
                if e.request_ids:
                    self._instances.rejected(f.instance, e.request_ids, e.why, now)
                continue
            for rec in recs:
                self._instances.record(f.instance, rec, now, path)

    def _say(self, fmt: str, *args: Any) -> None:
        if self._logs > 0:
            self._logs -= 1
            log.error(fmt, *args)

    def status(self) -> dict[str, Any]:
        p = self.proto
        return {"role": "home", "endpoint": self.endpoint,
                "peers": [{"host": s.host, "session": f"{s.session:x}", "rings": len(s.rings),
                           "records_in": s.records_in, "bytes_in": s.bytes_in} for s in p.sessions.values()],
                "sessions_ended": dict(p.ended_reasons), "records_rejected": self.rejected,
                "messages_malformed": self.malformed}

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._sock = None
        self._ctx.destroy(linger=0)  # every socket of the link, closed without waiting



def link_of(config: Any, instances: Any) -> "PeerLink | HomeLink | None":
    """The federation role the settings give this daemon (daemon/config.py): a peer, a home, or none."""
    if config.home:
        return PeerLink(config.home, config.home_key, config.federation_key, instances=instances)
    if config.federation_endpoint:
        return HomeLink(config.federation_endpoint, config.federation_key, config.peer_keys, instances)
    return None
