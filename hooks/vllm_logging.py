"""The tap's log lines go where vLLM's go, in its format and at its level.

vLLM configures only its own logger, and not always before the plugin loads: in the OpenAI server
of vLLM 0.32 the API process's tap lines (the ring size it chose, and why) never reached vLLM's log.
So the tap follows vLLM's logger again wherever it is about to say something an operator needs (the
plugin's registration, the API process's start-up checks); until then its lines would fall to
Python's last-resort handler, which prints warnings only.
"""

from __future__ import annotations

import logging


def log_like_vllm() -> None:
    """Give the tap's logger vLLM's handlers and level, once vLLM has some."""
    theirs, ours = logging.getLogger("vllm"), logging.getLogger("vllm_tap")
    if theirs.handlers and not ours.handlers:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(theirs.level)
        ours.propagate = False
