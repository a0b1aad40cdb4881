"""The `vllm-tap` command line (package vllm_tap.cli): the top layer. It may import everything below
it (the core formats, daemon, client, tools); nothing below imports it. Commands stay thin: the work
lives in vllm_tap.daemon, vllm_tap.client and vllm_tap.tools.

    commands  the command group: daemon, subscribe, watch, status, keygen, bench
    datasets  record and export
    keys      the CURVE key options every command that talks to the daemon shares
"""

from .commands import main

__all__ = ["main"]
