"""CURVE for the subscriber socket: the daemon's key pair, and which client keys may connect.

Keys are ZeroMQ's certificate files (`vllm-tap keygen` writes them with zmq.auth.create_certificates,
they are read with zmq.auth.load_certificate(s)): `NAME.key` holds a public key, `NAME.key_secret`
the pair. Rules this module keeps:
- The daemon's secret certificate must be a regular file of the daemon's user (or root) that nobody
  else may read or write, and the directory of allowed client keys must not be writable by anyone
  but its owner (the daemon's user or root): whoever could add a file there could let anyone in.
  Otherwise start-up stops with one line naming the file.
- Whether a key may connect is decided by the daemon's ZAP handler (daemon/peers.py, which also
  enforces the connection limits) through `allowed(key)`; the directory is read again when its
  modification time changes, so adding or removing a `.key` file takes effect for new connections
  without a restart (open connections keep going).
"""

from __future__ import annotations

import logging
import os
import stat
import time

import zmq
import zmq.auth
from zmq.utils import z85

from vllm_tap.keys import load_pair
from vllm_tap.safe_paths import UnsafePath, me, user_name

log = logging.getLogger(__name__)

RECHECK_S = 1.0  # how often the client key directory's modification time is looked at


class CurveError(UnsafePath):
    """A key file or directory that cannot be used; one line naming it."""


def _check_private(path: str, *, what: str, secret: bool) -> None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as e:
        raise CurveError(f"{what} {path}: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode):
        raise CurveError(f"{what} {path} is a symbolic link (not followed)")
    if st.st_uid not in me():
        raise CurveError(f"{what} {path} is owned by {user_name(st.st_uid)}, not by {user_name(os.geteuid())} or root")
    loose = stat.S_IMODE(st.st_mode) & (0o077 if secret else 0o022)
    if loose:
        raise CurveError(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: "
                         f"{'nobody else may read it' if secret else 'nobody else may write it'} "
                         f"(chmod {'600' if secret else 'go-w'} {path})")


def load_secret(path: str, what: str = "CURVE secret certificate") -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of a `.key_secret` file."""
    try:
        return load_pair(path)
    except ValueError as e:
        raise CurveError(f"{what} {path}: {e}") from None


class CurveServer:
    """The daemon's keys, applied to its socket, and the allowed client keys, kept current."""

    def __init__(self, key_path: str, clients_dir: str):
        self.public, self._secret = load_secret(key_path)  # first: a public file given here says so
        _check_private(key_path, what="CURVE secret certificate", secret=True)
        if not os.path.isdir(clients_dir):
            raise CurveError(f"curve_clients {clients_dir} is not a directory")
        _check_private(clients_dir, what="curve_clients directory", secret=False)
        self.clients_dir = clients_dir
        self._keys: set[bytes] = set()
        self._mtime = -1
        self._checked = -1e18
        self._reload(force=True)

    def apply(self, sock: zmq.Socket) -> None:
        """Before bind: the socket is a CURVE server; every handshake goes to the ZAP handler."""
        sock.curve_server = True
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self.public

    @property
    def allowed_keys(self) -> int:
        return len(self._keys)

    def allowed(self, key: bytes) -> bool:
        """Whether a client's (32-byte) public key is in the allowed directory."""
        self._reload()
        return len(key) == 32 and z85.encode(key) in self._keys

    def _reload(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < RECHECK_S:
            return
        self._checked = now
        try:
            mtime = os.stat(self.clients_dir).st_mtime_ns
        except OSError as e:
            log.error("curve_clients %s: %s; no client may connect until it is back", self.clients_dir, e)
            self._keys = set()
            self._mtime = -1
            return
        if mtime == self._mtime and not force:
            return
        self._mtime = mtime
        try:
            keys = set(zmq.auth.load_certificates(self.clients_dir))
        except (OSError, ValueError) as e:
            log.error("curve_clients %s: %s; keeping the %d keys read before", self.clients_dir, e, len(self._keys))
            return
        if not force:
            log.info("curve_clients %s: %d allowed client keys (was %d)", self.clients_dir, len(keys), len(self._keys))
        self._keys = keys
