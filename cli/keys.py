"""The CLI's CURVE key options, shared by every command that talks to the daemon (commands, datasets)."""

from __future__ import annotations

import os
from typing import Callable

import click

from vllm_tap.client.auth import CLIENT_KEY_ENV, SERVER_KEY_ENV


def _key_into_env(var: str) -> Callable:
    def put(_ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
        if value:  # every Client this command makes reads it (vllm_tap.client.auth)
            os.environ[var] = value
    return put


def key_options(f: Callable) -> Callable:
    """--server-key / --client-key: CURVE keys for a daemon that requires them."""
    f = click.option("--client-key", metavar="FILE", expose_value=False, callback=_key_into_env(CLIENT_KEY_ENV),
                     help=f"This client's secret certificate (NAME.key_secret from `vllm-tap keygen`), for a daemon "
                          f"with CURVE keys; default ${CLIENT_KEY_ENV}.")(f)
    return click.option("--server-key", metavar="FILE|KEY", expose_value=False, callback=_key_into_env(SERVER_KEY_ENV),
                        help=f"The daemon's public certificate (server.key) or key, for a daemon with CURVE keys; "
                             f"default ${SERVER_KEY_ENV}.")(f)
