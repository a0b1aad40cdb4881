"""Admission: whether a worker takes on a new capture, decided once, when it learns the request.

When the daemon falls behind, the worker's ring fills; records that do not fit are dropped, and
every capture in flight loses rows. Shedding whole captures instead keeps the ones already taken
on complete: a capture the worker learns while its ring holds more than `shed_at` (a share of the
ring, half by default; the server setting vllm_tap.shed_at) that the daemon has not read yet is not admitted. The worker writes one SHED
record for it (reason `overloaded`, the spec and prompt length, counted in the ring header's
`captures_shed`) and no DATA; the daemon delivers it as one Gap over its expected positions.
Captures admitted earlier keep writing: shedding stops new work, never work under way.

The rules:
- The check is one read of two cursors of this worker's ring per learned request (RingWriter.
  unread_bytes: reserved minus read, so records staged for copy count too); nothing per step.
- A decision is kept per request id (the last MEMORY of them): a request learned again (the V2
  runner re-adds a request after a streaming-input update) keeps it, so an admitted capture is never
  shed part way and a shed one never resumes part way.
- Only a rank that would write something for the request decides (a top-k capture under tensor
  parallelism is written by TP rank 0 alone: the other ranks have nothing to shed).
- Under tensor or pipeline parallelism each rank decides from its own ring, and ranks may disagree
  (their fills differ by a few records at the threshold). The daemon makes that safe: a SHED from
  any rank sheds the capture, and the other ranks' records for it are discarded (without the
  shedding rank's, no step of it could complete anyway). Reading every rank's fill instead would
  cost each learn a read per rank and still race the writers.
- Why the worker and not the engine core (which writes BEGIN/END for every capture regardless): the
  ring that overflows is the worker's, and the worker is the one that would drop rows; the engine
  core has no view of it and would have to reach every worker's ring to decide. The engine core's
  BEGIN and END still come, so the daemon knows the capture and where it ends.
"""

from __future__ import annotations

import collections
import logging

from vllm_tap import ring_format as rf
from vllm_tap.ring_schema import ShedMeta, spec_field
from vllm_tap.ring_writer import RingWriter
from vllm_tap.spec import DEFAULT_SHED_AT, CaptureSpec

log = logging.getLogger("vllm_tap.hooks")

MEMORY = 1 << 16  # request ids whose decision is kept


class Admission:
    """Per worker: admit or shed each capture when it is learned."""

    def __init__(self, writer: RingWriter, shed_at: float = DEFAULT_SHED_AT):
        self.writer = writer
        self.limit = int(writer.capacity * shed_at)
        self.shed = 0  # captures shed so far (the cost log line reports the difference)
        self._decided: collections.OrderedDict[str, bool] = collections.OrderedDict()

    def admit(self, rid: str, spec: CaptureSpec, num_prompt: int) -> bool:
        """Whether this capture is taken on; when not, its SHED record is written."""
        known = self._decided.get(rid)
        if known is not None:
            return known
        unread = self.writer.unread_bytes()
        ok = unread <= self.limit
        self._decided[rid] = ok
        if len(self._decided) > MEMORY:
            self._decided.popitem(last=False)
        if not ok:
            self.shed += 1
            self.writer.write_shed(rid, ShedMeta(
                reason=rf.SHED_OVERLOADED, num_prompt_tokens=num_prompt, spec=spec_field(spec), source=spec.source,
                unread_bytes=unread, capacity=self.writer.capacity,
            ), tap_key=spec.key)
        return ok
