"""CURVE keys for a subscriber: which daemon to trust and who this client is.

A daemon with `curve_key` set (daemon/curve.py) only talks to clients whose public key is in its
`curve_clients` directory, encrypted. The client then needs
- the daemon's public key: `server_key=` / $VLLM_TAP_SERVER_KEY / `--server-key`, a certificate
  file (`server.key`, as `vllm-tap keygen` writes it) or the 40-character key itself;
- its own key pair: `client_key=` / $VLLM_TAP_CLIENT_KEY / `--client-key`, a secret certificate
  file (`NAME.key_secret`), whose public half (`NAME.key`) the operator put in `curve_clients`.

The keys ride on a shadow of the client's zmq context (same I/O threads, its own default socket
options), so every socket the client opens (subscriptions, watches, status) is a CURVE client.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import zmq
import zmq.auth

from vllm_tap.keys import load_pair

from .errors import KeyFileError

SERVER_KEY_ENV = "VLLM_TAP_SERVER_KEY"
CLIENT_KEY_ENV = "VLLM_TAP_CLIENT_KEY"
Z85_KEY_CHARS = 40


@dataclass(frozen=True)
class ClientKeys:
    server_public: bytes  # z85
    public: bytes
    secret: bytes

    def context(self, base: zmq.Context) -> zmq.Context:
        """A context on the same libzmq context whose sockets all use these keys."""
        ctx = type(base).shadow(base.underlying)
        ctx.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        ctx.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        ctx.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        return ctx


def _server_public(value: str) -> bytes:
    if len(value) == Z85_KEY_CHARS and not os.path.exists(value):
        return value.encode("ascii")
    try:
        public, _ = zmq.auth.load_certificate(value)
    except (OSError, ValueError) as e:
        raise KeyFileError(f"server key {value}: {e} (give the daemon's public certificate, e.g. server.key)") from None
    return public


def _client_pair(path: str) -> tuple[bytes, bytes]:
    try:
        return load_pair(path)
    except ValueError as e:
        raise KeyFileError(f"client key {path}: {e}") from None


def client_keys(server_key: str | None = None, client_key: str | None = None,
                env: Mapping[str, str] | None = None) -> ClientKeys | None:
    """The keys from the arguments, else the environment; None when neither names any."""
    env = os.environ if env is None else env
    server_key = server_key or env.get(SERVER_KEY_ENV) or None
    client_key = client_key or env.get(CLIENT_KEY_ENV) or None
    if server_key is None and client_key is None:
        return None
    if server_key is None or client_key is None:
        missing = "server_key / $VLLM_TAP_SERVER_KEY" if server_key is None else "client_key / $VLLM_TAP_CLIENT_KEY"
        raise KeyFileError(f"CURVE needs both the daemon's public key and this client's key pair: {missing} is missing")
    public, secret = _client_pair(client_key)
    return ClientKeys(_server_public(server_key), public, secret)


def keyed_context(base: zmq.Context, keys: ClientKeys | None) -> zmq.Context:
    return base if keys is None else keys.context(base)


__all__ = ["CLIENT_KEY_ENV", "SERVER_KEY_ENV", "ClientKeys", "client_keys", "keyed_context"]
