"""What the capture core is given by a runner adapter: one step's view of the runner's state
(`StepView`) and where the worker sits (`RankPlace`), whatever the runner (V1, V2) and device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch


def host_ids(ids: torch.Tensor) -> "np.ndarray | torch.Tensor":
    """A runner's token-id tensor as StepView wants it: a host array when it lives on the CPU."""
    return ids.numpy() if ids.device.type == "cpu" else ids


def shard(dim: int, rank: int, size: int) -> tuple[int, int]:
    """This rank's [start, stop) of a last dimension split as evenly as possible."""
    per = -(-dim // size)
    return min(rank * per, dim), min((rank + 1) * per, dim)


@dataclass(frozen=True)
class RankPlace:
    """Where this worker sits: its tensor-parallel rank and the pipeline stage it runs.

    stage_layers[s]: the captured layers pipeline stage s computes (0, the embeddings, on the first
    stage; layer i, the output of decoder layer i, on the stage that runs decoder layer i).
    writers[s]: the tp ranks of stage s that write what the stage captures, each a share of the last
    dimension (None: all of them). Every tp rank holds the whole logits and hidden states, so when a
    stage's tp group spans hosts only its ranks on the engine's home host write, and no captured byte
    has to cross to the home (hooks/runner_patch.rank_place)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    stage_layers: tuple[tuple[int, ...], ...] = ((),)
    writers: tuple[tuple[int, ...], ...] | None = None

    def stage_writers(self, stage: int) -> tuple[int, ...]:
        return tuple(range(self.tp_size)) if self.writers is None else self.writers[stage]

    @property
    def share(self) -> int | None:
        """This rank's share among its stage's writers (None: it writes nothing)."""
        w = self.stage_writers(self.pp_rank)
        return w.index(self.tp_rank) if self.tp_rank in w else None

    @property
    def shares(self) -> int:
        return len(self.stage_writers(self.pp_rank))

    @property
    def pp_size(self) -> int:
        return len(self.stage_layers)

    @property
    def rank(self) -> int:
        """This worker's ring rank: stages one after the other, tp ranks within a stage."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def layers(self) -> tuple[int, ...]:
        return self.stage_layers[self.pp_rank]


@dataclass
class StepView:
    """One step as the core needs it, whatever the runner. Arrays are in batch order.

    token_ids: the step's flattened input token ids, a host int array when the host has them, else
    a tensor, gathered on its device like the payload (decode rows' ids exist only on the GPU under
    async scheduling, and always under V2); `host_ids` makes the adapters' choice. aux: this
    stage's captured layers' hidden states, in `RankPlace.layers` order. logits: the sampled rows, one per request (None when they come later through
    `write_logits`, or on a non-last stage). Requests are told to the core at admission (`learn`),
    never discovered from the batch: a step walks only the capturing requests."""

    req_ids: Sequence[str]  # batch order; the core never walks it per step (row_of finds its requests)
    query_start: np.ndarray  # [num_reqs + 1]: request i owns rows [query_start[i], query_start[i+1])
    computed: np.ndarray  # [num_reqs]: the position of request i's first row this step
    token_ids: Any  # np.ndarray | torch.Tensor, [num_rows]
    hidden: torch.Tensor | None = None  # final hidden states [num_rows(+padding), hidden]
    aux: Sequence[torch.Tensor] | None = None
    logits: torch.Tensor | None = None
    compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None  # the lm head
    finished: Iterable[str] = ()  # requests to forget before this step
    # request id -> batch row, for the scheduled requests (V1: input_batch.req_id_to_index); None:
    # built from req_ids (one C-level pass, for callers without such a map)
    row_of: Mapping[str, int] | None = None
