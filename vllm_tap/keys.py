"""`vllm-tap keygen`: a CURVE key pair as ZeroMQ certificate files (zmq.auth.create_certificates).

NAME.key holds the public key (give it out: a client's goes into the daemon's curve_clients
directory, the daemon's to every client); NAME.key_secret holds the pair and is made 0600 before a
key is written into it. Nothing is overwritten: a key pair in use is replaced on purpose, by hand.
"""

from __future__ import annotations

import os
import re

import zmq
import zmq.auth


class KeygenError(RuntimeError):
    """One line: why no key pair was written."""


def load_pair(path: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of a NAME.key_secret file; ValueError, one line without the path,
    when it cannot be read or holds no secret key (a NAME.key file given by mistake)."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(str(e)) from None
    if not secret:
        raise ValueError("holds no secret key: give the `.key_secret` file, not the `.key` one")
    return public, secret


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def make_keys(directory: str, name: str) -> tuple[str, str, str]:
    """(public file, secret file, public key as z85 text)."""
    if not _NAME.match(name):
        raise KeygenError(f"--name {name!r}: use letters, digits, '.', '_' and '-'")
    if not zmq.has("curve"):
        raise KeygenError("this libzmq was built without CURVE")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    base = os.path.join(directory, name)
    for path in (base + ".key", base + ".key_secret"):
        if os.path.lexists(path):
            raise KeygenError(f"{path} exists: remove it first to replace that key pair")
    old = os.umask(0o077)  # the secret file is private from its first byte
    try:
        public_path, secret_path = zmq.auth.create_certificates(directory, name)
    except OSError as e:
        raise KeygenError(f"cannot write keys in {directory}: {e.strerror or e}") from None
    finally:
        os.umask(old)
    os.chmod(secret_path, 0o600)
    os.chmod(public_path, 0o644)
    public, _ = zmq.auth.load_certificate(public_path)
    return public_path, secret_path, public.decode()
