"""Subscribe to captures from the daemon (numpy only; no torch, no vllm).

    from vllm_tap import client
    for rec in client.subscribe("my-request-id", timeout=30):
        if rec.missing:            # a Gap: these positions will not arrive
            print("missing", rec.positions, rec.reason)
        else:                      # a TokenRecord
            print(rec.position, rec.phase, rec.token_id, rec.logits.argmax())
    cap = client.fetch("my-request-id")   # everything stacked: cap.logits [T, V], cap.hidden {layer: [T, H]}
    cap.reduced["toxicity"]                # a probe's scores [T, k]; an SAE's Latents (.ids, .values [T, k])

    for item in client.Client().watch(since=last_seq):   # every capture, in sequence order, resumable
        ...                        # WatchedCapture (item.seq, .begin, .capture, .end) or LostCaptures

The module-level functions use $VLLM_TAP_ENDPOINT, else the daemon's default socket; `Client(endpoint)`
and `AsyncClient(endpoint)` take an explicit one.
"""

from __future__ import annotations

from typing import Any

from .aio import AsyncClient, AsyncSubscription
from .errors import (AmbiguousCapture, CaptureEvicted, CaptureLost, CaptureNotFound, CaptureTimeout, DaemonStopped,
                     DaemonUnavailable, KeyFileError, ProtocolError, Refused, TapError, TooSlow)
from .records import Capture, CaptureBegin, CaptureEnd, Chunk, Gap, Latents, TokenRecord
from .stream import ENDPOINT_ENV, resolve_endpoint
from .sync import Client, Subscription
from .watch import (AsyncWatch, DaemonStopping, LostCaptures, Watch, WatchData, WatchedCapture, WatchEnd, Watermark,
                    WatchItem, WatchRejected, WatchStart)


def subscribe(name: str, index: int | None = None, instance: str | None = None, timeout: float = 30.0) -> Subscription:
    return Client().subscribe(name, index, instance, timeout)


def fetch(name: str, index: int | None = None, instance: str | None = None, timeout: float = 30.0) -> Capture:
    return Client().fetch(name, index, instance, timeout)


def status(timeout: float = 5.0) -> dict[str, Any]:
    return Client().status(timeout)


__all__ = [
    "AmbiguousCapture", "AsyncClient", "AsyncSubscription", "Capture", "CaptureBegin", "CaptureEnd", "CaptureEvicted",
    "CaptureLost", "CaptureNotFound", "CaptureTimeout", "Chunk", "Client", "DaemonStopped", "DaemonUnavailable", "ENDPOINT_ENV", "Gap", "KeyFileError",
    "Latents", "ProtocolError", "Refused", "Subscription", "TapError", "TokenRecord", "TooSlow", "fetch", "resolve_endpoint",
    "status",
    "subscribe",
    # watch: every capture, resumable (vllm_tap.client.watch)
    "AsyncWatch", "DaemonStopping", "LostCaptures", "Watch", "WatchData", "WatchEnd", "WatchItem", "WatchRejected", "WatchStart",
    "WatchedCapture", "Watermark",
]
