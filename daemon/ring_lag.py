"""How far behind its writer the daemon is on one ring, in seconds: how long the oldest unread byte
has waited.

Records carry no time, so the daemon dates what it sees: at every poll it notes how far the writer
had written. Bytes first seen at one poll were committed after the poll before it, so the oldest
unread byte has waited at most since that earlier poll; that upper bound is the figure given. While
the daemon runs it polls every ring at least every few tens of milliseconds, which bounds the
error; a daemon that was stopped (SIGSTOP) counts the whole stop, as it should. Bytes a ring held
before the daemon's first poll of it are dated from that poll.

    marks:  (cursor c1, since t0) (c2, t1) (c3, t2) ...   bytes in [c(k-1), ck) were first seen at the
                                                          poll after t(k-1), committed after t(k-1)

The marks are bounded (MAX_MARKS): past that, the newest mark is moved on instead, which dates new
bytes earlier than they were (the bound stays an upper bound).
"""

from __future__ import annotations

from collections import deque

MAX_MARKS = 1024


class RingLag:
    __slots__ = ("_marks", "_polled_at")

    def __init__(self) -> None:
        self._marks: deque[tuple[int, float]] = deque()
        self._polled_at: float | None = None

    def observe(self, read: int, written: int, now: float) -> None:
        """A poll at `now` found the writer at `written` and left the reader at `read`."""
        marks = self._marks
        since = now if self._polled_at is None else self._polled_at
        self._polled_at = now
        if written > read and (not marks or written > marks[-1][0]):
            if len(marks) < MAX_MARKS:
                marks.append((written, since))
            else:
                marks[-1] = (written, marks[-1][1])
        while marks and marks[0][0] <= read:
            marks.popleft()

    def seconds(self, read: int, now: float) -> float:
        """How long the oldest byte at or past `read` has waited (0 when nothing is unread)."""
        marks = self._marks
        while marks and marks[0][0] <= read:
            marks.popleft()
        return max(now - marks[0][1], 0.0) if marks else 0.0
