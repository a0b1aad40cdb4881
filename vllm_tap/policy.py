"""The server capture policy: which requests are captured without asking, and with which spec.

Selection is a pure function of the request id, so anyone can reproduce it:

    h = int.from_bytes(hashlib.sha256(request_id.encode("utf-8")).digest()[:8], "big")
    selected = h < share * 2**64          # exact: Python compares int and float exactly

`request_id` is the id vLLM's API process gives the request before it appends its random
8-character suffix (vllm_tap.identity): `cmpl-{base}-{prompt index}` for /v1/completions (one
decision per prompt of a multi-prompt request), `chatcmpl-{base}` for chat, the counter ("0",
"1", …) for offline `LLM.generate`; {base} is the X-Request-Id header, else the body's
`request_id`, else random. A request with n > 1 is decided once: all its samples are captured,
or none. The same id always gets the same answer (a client that reuses one id is always in or
always out). The decision is made once, in the API process, and stamped into the request's
extra_args like a client's own options, so the engine and every tensor/pipeline-parallel rank
follow it without talking.

How the policy meets a request's own tap* options is the policy's `client` setting
(spec.CLIENT_PRECEDENCE): "wins" (default), "loses" or "refused".
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

from vllm_tap.spec import (
    CaptureOptionError, CaptureSpec, ServerCaptureConfig, client_options, opts_out, parse_capture_spec,
)
from vllm_tap.windows import shown


def selects(request_id: str, share: float) -> bool:
    """Whether a policy capturing `share` of requests selects this request id (see the module)."""
    if share >= 1:
        return True
    if share <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(request_id.encode("utf-8")).digest()[:8], "big")
    return h < share * 2**64


def choose_spec(
    request_id: str, extra_args: Mapping[str, Any] | None, server: ServerCaptureConfig, vocab_size: int | None,
) -> CaptureSpec | None:
    """The spec a request is captured with (its source says whose), or None. CaptureOptionError
    names a bad option (HTTP 400)."""
    policy = server.policy
    if policy is None:
        return parse_capture_spec(extra_args, server, vocab_size)
    if policy.client == "refused":
        opts = client_options(extra_args)
        if opts:
            raise CaptureOptionError(f"{shown(sorted(opts)[0])[1:-1]}: this server does not take capture options from "
                                     "requests; its capture policy decides what is captured")
        return policy.spec if selects(request_id, policy.share) else None
    own = parse_capture_spec(extra_args, server, vocab_size)  # validated whatever the policy says
    if policy.client == "wins":
        if own is not None:
            return own
        if opts_out(client_options(extra_args)):
            return None
        return policy.spec if selects(request_id, policy.share) else None
    # "loses"
    return policy.spec if selects(request_id, policy.share) else own
