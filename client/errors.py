"""What can go wrong for a subscriber, one exception type per thing a caller would handle differently."""

from __future__ import annotations

from vllm_tap import wire_format as wf


class TapError(Exception):
    """Base of every client error."""


class CaptureNotFound(TapError, TimeoutError):
    """No capture by that name appeared within the timeout (or no daemon answered)."""


class CaptureTimeout(TapError, TimeoutError):
    """fetch(): the capture began but had not ended when its `timeout` (the whole call's) ran out."""


class CaptureEvicted(CaptureNotFound):
    """The capture ended and the daemon no longer keeps it (retain_bytes / retain_ttl_s)."""


class AmbiguousCapture(TapError, LookupError):
    """The name matches several captures: pass index= (choice) or instance=."""


class DaemonUnavailable(TapError, ConnectionError):
    """No daemon answered, or contact was lost mid-stream for longer than the timeout."""


class DaemonStopped(DaemonUnavailable):
    """The daemon said it is stopping and no other came back within the timeout; the message is its
    reason. (Subscriptions and watches wait for the next daemon first: a restart is ridden through.)"""


class TooSlow(TapError):
    """The daemon cut this subscriber off for falling too far behind."""


class CaptureLost(TapError):
    """The daemon restarted mid-stream and no longer knows the capture."""


class Refused(TapError):
    """The daemon refused this subscription or connection: too many (its max_* settings), or this
    client's CURVE key is not allowed, or the two disagree on CURVE (the message says which)."""


class KeyFileError(TapError, ValueError):
    """CURVE keys that cannot be used (missing half, unreadable file, a public file given as secret)."""


class ProtocolError(TapError):
    """The daemon sent something this client cannot read (another wire version?)."""


_BY_CODE: dict[str, type[TapError]] = {
    wf.E_NOT_FOUND: CaptureNotFound,
    wf.E_EVICTED: CaptureEvicted,
    wf.E_AMBIGUOUS: AmbiguousCapture,
    wf.E_TOO_SLOW: TooSlow,
    wf.E_STOPPING: DaemonStopped,
    wf.E_VERSION: ProtocolError,
    wf.E_BAD_REQUEST: ProtocolError,
    wf.E_LIMIT: Refused,
}


def error_for(code: str, message: str) -> TapError:
    cls = _BY_CODE.get(code, TapError)
    if cls is DaemonStopped:
        return cls(f"daemon stopped: {message}")
    return cls(message)
