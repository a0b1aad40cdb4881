"""A capture's lifecycle in reassembly: one explicit phase, moved only by the table below.

    phase              what happens                                   next phase
    ─────────────────  ─────────────────────────────────────────────  ─────────────────
    RUNNING            its END is read                                ENDED
    RUNNING            the engine's LIVE records stop naming it       END_LOST
    RUNNING            a record of it is read                         RUNNING
    END_LOST           a record of it is read (it was running)        RUNNING
    END_LOST           end_grace_s passed: it joins a Barrier         END_LOST_WAITING
    END_LOST_WAITING   a record of it is read                         RUNNING
    END_LOST_WAITING   its Barrier passed: it ends `end lost`         FINISHED
    ENDED              a record of it is read                         ENDED
    ENDED              end_grace_s passed: it joins a Barrier         ENDED_WAITING
    ENDED_WAITING      a record of it is read                         ENDED_WAITING
    ENDED_WAITING      its Barrier passed: what is missing is a Gap   FINISHED
    any but FINISHED   it ends (every expected position resolved, its
                       writer gone, a malformed record, shed)         FINISHED

A Barrier is where each worker ring's writer had got to at one moment (a tick): the captures waiting
on it end once the daemon has read every ring that far. An END is read from the engine's small ring
at once, the data from the workers' rings maybe long after (the daemon behind); a writer commits a
step's records before the engine ENDs it, and the grace covers records committed a little later (a
GPU's copies). So a capture waits for its data, not for a clock.

Beside the phase, one timer: a writer of the capture's rings died (`dead_at`), which resolves what
waits on it after gone_grace_s whatever the phase. Any other move than the table's is a bug
(LifecycleError).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Phase(enum.Enum):
    RUNNING = "running"  # no END read, and the engine still lists it (or has not said otherwise)
    END_LOST = "end lost"  # no END, and the LIVE rule says none will come: waits end_grace_s
    END_LOST_WAITING = "end lost, waiting for rings"  # ... then a Barrier, before it ends `end lost`
    ENDED = "ended"  # its END was read; positions still to resolve
    ENDED_WAITING = "ended, waiting for rings"  # end_grace_s after the END, still missing positions: a Barrier
    FINISHED = "finished"  # its End event went out


class Happens(enum.Enum):
    END_READ = "its END is read"
    UNLISTED = "the LIVE records stop naming it"
    RECORD = "a record of it is read"
    GRACE = "end_grace_s passed"
    BARRIER = "its Barrier passed"
    FINISH = "it ends"


P, H = Phase, Happens
TRANSITIONS: dict[tuple[Phase, Happens], Phase] = {
    (P.RUNNING, H.END_READ): P.ENDED,
    (P.RUNNING, H.UNLISTED): P.END_LOST,
    (P.RUNNING, H.RECORD): P.RUNNING,
    (P.END_LOST, H.RECORD): P.RUNNING,
    (P.END_LOST, H.GRACE): P.END_LOST_WAITING,
    (P.END_LOST_WAITING, H.RECORD): P.RUNNING,
    (P.END_LOST_WAITING, H.BARRIER): P.FINISHED,
    (P.ENDED, H.RECORD): P.ENDED,
    (P.ENDED, H.GRACE): P.ENDED_WAITING,
    (P.ENDED_WAITING, H.RECORD): P.ENDED_WAITING,
    (P.ENDED_WAITING, H.BARRIER): P.FINISHED,
    **{(p, H.FINISH): P.FINISHED for p in Phase if p is not P.FINISHED},
}
WAITING = frozenset({P.END_LOST_WAITING, P.ENDED_WAITING})  # on a Barrier
NO_END = frozenset({P.RUNNING, P.END_LOST, P.END_LOST_WAITING})  # no END read


class LifecycleError(RuntimeError):
    """A move the transition table does not have: a bug in reassembly."""


@dataclass(eq=False)
class Barrier:
    """Where each worker ring's writer had got to at one moment (a tick): the captures waiting on it
    end once the daemon has read every ring that far. A ring's cursor is the first one the daemon
    reports after the Barrier was made (so it is at or past that moment), and a ring closed meanwhile
    no longer counts."""

    captures: list[Any]  # reassembly's Assembly objects
    cursors: dict[str, int] = field(default_factory=dict)  # ring -> write cursor


class Lifecycle:
    """One capture's phase, when it entered it, and its Barrier while it waits on one."""

    __slots__ = ("phase", "since", "barrier", "dead_at", "dead_reason")

    def __init__(self) -> None:
        self.phase = Phase.RUNNING
        self.since = 0.0  # when ENDED or END_LOST began (the grace counts from there)
        self.barrier: Barrier | None = None
        self.dead_at: float | None = None  # a writer of its rings died (resolved gone_grace_s later)
        self.dead_reason = ""

    def go(self, happens: Happens, at: float | None = None, barrier: Barrier | None = None) -> None:
        """Move on `happens` (at `at`: when ENDED or END_LOST begins; `barrier`: the one it joins)."""
        nxt = TRANSITIONS.get((self.phase, happens))
        if nxt is None:
            raise LifecycleError(f"a capture {self.phase.value} cannot move on `{happens.value}`")
        if nxt is not self.phase:
            if at is not None:
                self.since = at
            self.barrier = barrier if nxt in WAITING else None
            self.phase = nxt

    @property
    def waiting(self) -> bool:
        """It waits on a Barrier."""
        return self.phase in WAITING
