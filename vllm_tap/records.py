"""Typed records that travel through a ring, shared by the writer (hooks) and the reader (daemon)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_tap.ring_format import RecordKind, TensorKind


@dataclass(frozen=True)
class TensorId:
    """Which tensor a slice belongs to. `layer` is -1 for everything but HIDDEN."""

    kind: TensorKind
    layer: int = -1

    @property
    def name(self) -> str:
        from vllm_tap.ring_format import TENSOR_NAMES

        base = TENSOR_NAMES[self.kind]
        return f"{base}.{self.layer}" if self.kind == TensorKind.HIDDEN else base


@dataclass
class RingRecord:
    """One record as read back from a ring (arrays are private copies, safe after the ring moves on).

    For DATA records `data` has shape [len(positions), slice_stop - slice_start] in the ring's
    storage dtype (bfloat16 arrives as uint16); `dtype` is the ring_format.DType code.
    """

    kind: RecordKind
    request_id: str
    tap_key: str = ""
    step: int = 0
    rank: int = 0
    expected_ranks: int = 1
    rank_parts: int = 1
    tensor: TensorId | None = None
    dtype: int = 0
    slice_start: int = 0
    slice_stop: int = 0
    full_dim: int = 0
    num_prompt_tokens: int = 0
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    data: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # Where it came from: (ring name, epoch) lets the reassembler tell writers apart.
    source: str = ""
    epoch: int = 0
