"""The start-up check of engines that may span hosts: from the placements its rings carry
(vllm_tap/placement.py: local rings, and the rings peer daemons stream here, daemon/peer_link.py),
the home daemon knows each engine's world size and which of its ranks write, and says so loudly
(status `engines`, one log line, the metrics vllm_tap_engine_ranks_missing and
vllm_tap_engine_settings_differ) when a rank never reports or a host runs the tap with other
settings than the home (under vLLM's multi-node launch each node parses its own command line, and
nothing else checks that `--additional-config` matches): no silent half captures.

Pure: placements and `now` in, problems out; the daemon feeds it about once a second.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

from vllm_tap.placement import Placement

log = logging.getLogger(__name__)

RANKS_GRACE_S = 30.0  # workers start one by one (model loading): a rank missing this long after the first never reported
ENGINE_RANK = -1


def writing_ranks(p: Placement) -> set[int]:
    """The world ranks of the engine that write rings: per stage, its tp ranks on the home host
    when it has any (tensor parallel across hosts writes from the home alone), else all of them;
    node k holds world ranks [k × L, (k + 1) × L), L = world size ÷ nodes (hooks/topology.py)."""
    local = max(p.world_size // max(p.nnodes, 1), 1)
    out: set[int] = set()
    for s in range(p.pp_size):
        home = [t for t in range(p.tp_size) if s * p.tp_size + t < local]
        out.update(s * p.tp_size + t for t in (home or range(p.tp_size)))
    return out


@dataclass
class Engine:
    """One engine instance, as its rings' placements tell it."""

    instance: str
    first_seen: float
    home: Placement | None = None  # the engine core's placement (it runs on the home host)
    ranks: dict[int, Placement] = field(default_factory=dict)  # model rank -> its ring's placement
    said: set[str] = field(default_factory=set)  # problems already logged

    def expected(self) -> set[int]:
        some = self.home or next(iter(self.ranks.values()), None)
        return writing_ranks(some) if some is not None else set()

    def missing(self, now: float) -> list[int]:
        if now - self.first_seen < RANKS_GRACE_S:
            return []
        return sorted(self.expected() - set(self.ranks))

    def settings_differ(self) -> list[str]:
        """Hosts whose tap settings hash is not the home's."""
        if self.home is None or not self.home.settings:
            return []
        return sorted({p.host for p in self.ranks.values() if p.settings and p.settings != self.home.settings})


class EngineCheck:
    """Every engine instance the daemon has seen placements of."""

    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}

    def observe(self, placements: Iterable[tuple[str, int, Placement | None]], now: float) -> list[str]:
        """(instance, rank, placement) of every ring read now; the problems newly found, each one line (logged)."""
        for instance, rank, p in placements:
            if p is None:
                continue  # a ring of a writer before placements: nothing to check against
            e = self.engines.get(instance)
            if e is None:
                e = self.engines[instance] = Engine(instance, now)
            if rank == ENGINE_RANK or p.engine:
                e.home = p
            else:
                e.ranks[rank] = p
        new = []
        for e in self.engines.values():
            for line in self._problems(e, now):
                if line not in e.said:
                    e.said.add(line)
                    log.error("%s", line)
                    new.append(line)
        return new

    @staticmethod
    def _problems(e: Engine, now: float) -> list[str]:
        out = []
        missing = e.missing(now)
        if missing:
            world = (e.home or next(iter(e.ranks.values()))).world_size
            out.append(f"engine {e.instance}: ranks {missing} of its world of {world} never reported "
                       f"(a host without a daemon, or without the tap?): their part of every capture will be gaps")
        differ = e.settings_differ()
        if differ:
            out.append(f"engine {e.instance}: hosts {differ} run the tap with other settings than the home "
                       f"{e.home.host if e.home else '?'} (give every node the same --additional-config)")
        return out

    def status(self, now: float) -> list[dict[str, Any]]:
        out = []
        for e in self.engines.values():
            some = e.home or next(iter(e.ranks.values()), None)
            out.append({"instance": e.instance, "world_size": some.world_size if some else 0,
                        "ranks_expected": sorted(e.expected()), "ranks_reporting": sorted(e.ranks),
                        "ranks_missing": e.missing(now), "settings_differ": e.settings_differ(),
                        "hosts": sorted({p.host for p in e.ranks.values()} | ({e.home.host} if e.home else set()))})
        return out


def placements_of(rings: Iterable[Any], link: Any) -> list[tuple[str, int, Placement | None]]:
    """(instance, rank, placement) of the rings the ring poller reads and those peers stream here."""
    out = [(r.instance, r.reader.rank, r.reader.placement) for r in rings]
    if link is not None:
        out += [(inst, rank, p) for (inst, _), (rank, p) in getattr(link, "placements", {}).items()]
    return out
