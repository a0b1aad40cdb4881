"""Every name a user may know a capture by, derived from vLLM's internal request id.

vLLM 0.32 makes internal ids from what the user sees (see shared notes, "Request ids"):
  /v1/completions        cmpl-{base}-{prompt_idx}-{rand8}    response id cmpl-{base}
  /v1/chat/completions   chatcmpl-{base}-{rand8}             response id chatcmpl-{base}
  offline LLM.generate   {n}-{rand8}                          output request_id {n}
  n > 1 sample i         {i}_{one of the above}
where {base} is the X-Request-Id header, else the body's request_id, else random. The response's
choice index is prompt_idx * n + i. Users should never have to know about the suffix or prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CHILD = re.compile(r"^(\d+)_(.*)$")
_RAND8 = re.compile(r"^(.*)-[0-9a-zA-Z]{8}$")
_PROMPT_IDX = re.compile(r"^(cmpl-.*)-(\d+)$")

# The API process stores the request's n here (extra_args are shared by n>1 children), so the
# choice index can be computed. Not a tap_* option, so users never set it.
N_EXTRA_ARG = "vllm_tap_n"


@dataclass(frozen=True)
class RequestIdentity:
    request_id: str  # internal, unique
    response_id: str  # what the API response's `id` is (or the offline request_id)
    choice_index: int  # index in the response's choices (0 when there is one)
    names: tuple[str, ...]  # every name this capture can be subscribed by, most specific first


def identify(request_id: str, tap_key: str = "", n: int = 1) -> RequestIdentity:
    sample = 0
    rest = request_id
    m = _CHILD.match(rest)
    if m:
        sample, rest = int(m.group(1)), m.group(2)
    m = _RAND8.match(rest)
    stripped = m.group(1) if m else rest
    response_id = stripped
    prompt_idx = 0
    m = _PROMPT_IDX.match(stripped)
    if m:
        response_id, prompt_idx = m.group(1), int(m.group(2))
    choice = prompt_idx * max(n, 1) + sample
    names: list[str] = []
    for name in (tap_key, request_id, stripped, response_id):
        if name and name not in names:
            names.append(name)
    for prefix in ("chatcmpl-", "cmpl-"):
        if response_id.startswith(prefix):
            base = response_id[len(prefix) :]
            if base and base not in names:
                names.append(base)  # the X-Request-Id / body request_id the user chose
            break
    return RequestIdentity(request_id, response_id, choice, tuple(names))
