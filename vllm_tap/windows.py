"""Position windows: which token positions of a request a capture holds.

A window is a Python-style slice of one of three segments of a request's computed positions.
With a prompt of P tokens whose request ends having computed positions 0 … E-1 (E = P+G-1 for G
generated tokens; fewer when it was aborted):

    segment   positions                  known when the request begins
    all       0 … E-1                    start only
    prompt    0 … P-1                    all of it
    output    P-1 … E-1  (G of them)     start only: output[i] is position P-1+i, whose logits
                                         predict generated token i

`SEGMENT[START:STOP]` takes the segment's items START … STOP-1 as Python slices them: either end
may be left out, and a negative number counts from the segment's end. Two more spellings:
a list `[START, STOP]` of two non-negative ints is `all[START:STOP]` (absolute positions), and the
named modes are windows too: all, prompt, output, last_prompt = prompt[-1:], last_output =
output[-1:]. A window is then cut to the positions the request really computed.

The end of `all` and `output` is known only when the request ends, so on them:
  - a negative START with no STOP (`output[-16:]`, `all[-16:]`) is a *tail*: the last N positions.
    Workers capture the whole segment from its start and the daemon keeps the last N once the
    END names the last position;
  - a negative STOP, or a negative START with a STOP, is refused: what it keeps could only be
    decided at the end, after positions were already delivered.
Windows that are empty whatever the request (`output[5:5]`, `prompt[-2:-4]`) are refused too.

Everything here is pure arithmetic on ints; the parser raises ValueError with a message meant to
be prefixed by the option's name.
"""

from __future__ import annotations

import enum
import re
import reprlib
from dataclasses import dataclass
from typing import Any

UNBOUNDED = 1 << 62  # "no end yet" in live ranges
_MAX = 1 << 31  # positions travel as int32


class Segment(str, enum.Enum):
    ALL = "all"
    PROMPT = "prompt"
    OUTPUT = "output"


ALIASES = {"last_prompt": "prompt[-1:]", "last_output": "output[-1:]"}
# ASCII digits only (Python's \d and int() take any script's), the whole string (no newline after).
_SYNTAX = re.compile(r"(all|prompt|output)(?:\[(-?[0-9]{1,10})?:(-?[0-9]{1,10})?\])?")
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlist = _SHOWN.maxtuple = 8


def shown(value: Any) -> str:
    """A value as an error message may echo it: its repr, cut short (a request may send megabytes)."""
    return _SHOWN.repr(value)
SYNTAX_HELP = (
    "'all', 'prompt', 'output', 'last_prompt', 'last_output', a window SEGMENT[START:STOP] "
    "(SEGMENT all|prompt|output, Python slice bounds, e.g. 'prompt[-16:]', 'output[:32]', "
    "'output[-16:]', 'all[100:200]') or [START, STOP] (absolute positions)"
)


def _slice(n: int, lo: int | None, hi: int | None) -> tuple[int, int]:
    """[a, b) of range(n)[lo:hi], with a <= b (Python's own arithmetic)."""
    a, b, _ = slice(lo, hi).indices(n)
    return a, max(a, b)


@dataclass(frozen=True)
class Window:
    segment: Segment = Segment.ALL
    start: int | None = None
    stop: int | None = None

    # -- parsing --

    @classmethod
    def parse(cls, value: Any) -> "Window":
        """A window from an option value; ValueError (a reason, no option name) when malformed."""
        if isinstance(value, Window):
            return value
        if isinstance(value, enum.Enum):
            value = value.value
        if isinstance(value, (list, tuple)):
            if len(value) != 2 or not all(type(v) is int for v in value):
                raise ValueError(f"got {shown(list(value))}; a list must be [START, STOP], two ints")
            lo, hi = value
            if lo < 0 or hi < 0:
                raise ValueError(f"got {shown(list(value))}; [START, STOP] are absolute positions (>= 0); "
                                 "count from an end with 'prompt[-16:]' or 'output[-16:]'")
            w = cls(Segment.ALL, lo, hi)
        elif isinstance(value, str):
            m = _SYNTAX.fullmatch(ALIASES.get(value, value))
            if m is None:
                raise ValueError(f"got {shown(value)}; allowed: {SYNTAX_HELP}")
            seg, lo, hi = m.groups()
            w = cls(Segment(seg), None if lo is None else int(lo), None if hi is None else int(hi))
        else:
            raise ValueError(f"got {shown(value)} ({type(value).__name__}); allowed: {SYNTAX_HELP}")
        w.check()
        return w.normal()

    def check(self) -> None:
        """ValueError unless the window is well formed (see the module's rules)."""
        if not isinstance(self.segment, Segment):
            raise ValueError(f"unknown segment {self.segment!r}")
        for v in (self.start, self.stop):
            if v is not None and (type(v) is not int or not -_MAX < v < _MAX):
                raise ValueError(f"{self}: bounds must be ints between -{_MAX} and {_MAX}")
        lo, hi = self.start, self.stop
        if self.segment != Segment.PROMPT:
            if hi is not None and hi < 0:
                raise ValueError(f"{self}: a STOP counted from the end of {self.segment.value} is only known "
                                 "when the request ends; leave STOP out or give a count from the start")
            if lo is not None and lo < 0 and hi is not None:
                raise ValueError(f"{self}: a START counted from the end of {self.segment.value} needs an open STOP "
                                 f"('{self.segment.value}[{lo}:]')")
        if lo is not None and hi is not None and (lo >= 0) == (hi >= 0) and hi <= lo:
            raise ValueError(f"{self}: empty window (STOP <= START)")

    def normal(self) -> "Window":
        """The same window with bounds that change nothing left out (so equal windows compare equal)."""
        lo = None if self.start == 0 else self.start
        return Window(self.segment, lo, self.stop)

    def __str__(self) -> str:
        if self.start is None and self.stop is None:
            return self.segment.value
        lo = "" if self.start is None else str(self.start)
        hi = "" if self.stop is None else str(self.stop)
        return f"{self.segment.value}[{lo}:{hi}]"

    # -- which positions --

    @property
    def tail(self) -> int:
        """N > 0 when the window is the last N positions of a segment whose end comes at the END."""
        if self.segment != Segment.PROMPT and self.start is not None and self.start < 0 and self.stop is None:
            return -self.start
        return 0

    def _origin(self, num_prompt: int) -> int:
        return max(num_prompt - 1, 0) if self.segment == Segment.OUTPUT else 0

    def live_range(self, num_prompt: int) -> tuple[int, int]:
        """[start, stop) a worker captures while the request runs (stop may be UNBOUNDED)."""
        if self.segment == Segment.PROMPT:
            return _slice(num_prompt, self.start, self.stop)
        o = self._origin(num_prompt)
        if self.tail:
            return o, UNBOUNDED
        lo = o + (self.start or 0)
        return lo, UNBOUNDED if self.stop is None else max(lo, o + self.stop)

    def first_position(self, num_prompt: int) -> int | None:
        """The first position when it is known before the request ends (not for a tail)."""
        return None if self.tail else self.live_range(num_prompt)[0]

    def position_range(self, num_prompt: int, end: int) -> tuple[int, int]:
        """[start, stop) of the positions captured for a request that computed [0, end); start is
        first_position() unless the window is a tail, and stop >= start."""
        if self.tail:
            o = self._origin(num_prompt)
            lo = max(o, end - self.tail)
            return lo, max(lo, end)
        lo, hi = self.live_range(num_prompt)
        return lo, max(lo, min(hi, end))

    def reads_prompt(self, num_prompt: int) -> bool:
        """Whether the window holds a position a prefix-cache hit would skip. vLLM always computes
        the last prompt token (P-1), so only positions before it count."""
        lo, hi = self.live_range(num_prompt)
        return lo < min(hi, num_prompt - 1)

    @property
    def may_read_prompt(self) -> bool:
        """reads_prompt() for some prompt length (for callers that do not know it)."""
        if self.segment == Segment.OUTPUT:
            return False
        if self.segment == Segment.PROMPT:
            return not (self.start == -1 and self.stop is None)
        return True
