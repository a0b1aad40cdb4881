"""Moving captured rows from the model's tensors into ring reservations.

A record's payload is filled from one or two segments (a tensor and the rows of it to take); rows
that form one run are a slice, others a gather (index_select) straight into the ring on CPU, or
on the device first and then into the ring on CUDA.

On CUDA the ring is page-locked once (cudaHostRegister) so each copy is an asynchronous
device-to-host DMA queued on the compute stream right behind the forward that produced the
tensors: no sync on the serving path, and the copy is ordered before the next step can overwrite
the static CUDA-graph output buffers. An event marks the end of a step's copies; a background
thread waits on it and only then commits the records, so the daemon never sees half-copied bytes.
On CPU the copy is a plain memcpy on the step thread and records commit at once.
"""

from __future__ import annotations

import logging
import queue
import threading

import numpy as np
import torch

from vllm_tap.ring import Reservation, RingWriter

log = logging.getLogger("vllm_tap.hooks")


class Publisher:
    def __init__(self, writer: RingWriter, device: torch.device):
        self.writer = writer
        # The whole ring as one host tensor: reservations become views of it, never new buffers.
        self.ring = torch.frombuffer(writer.buffer, dtype=torch.uint8)
        self._typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}  # the ring viewed as each dtype
        self._step: list[Reservation] = []

    def _view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        # One as_strided on a cached typed view of the whole ring: this runs for every captured
        # tensor of every step, and a slice-then-view chain costs several times as much.
        typed = self._typed.get(dtype)
        if typed is None:
            base = self.ring.view(dtype)
            typed = self._typed[dtype] = (base, base.element_size())
        base, size = typed
        start, misaligned = divmod(offset, size)
        if misaligned:
            raise ValueError(f"ring offset {offset} is not aligned for {dtype}")
        # Payloads are [n, width], token ids [n]: both contiguous.
        strides = (shape[1], 1) if len(shape) == 2 else (1,)
        return torch.as_strided(base, shape, strides, start)

    def fill(self, res: Reservation, dtype: torch.dtype, width: int, n: int,
             segments: list[tuple[torch.Tensor, np.ndarray | None]],
             device_ids: tuple[torch.Tensor, np.ndarray] | None = None) -> None:
        """Queue the copy of a record's payload: the rows `index` (all when None) of each segment's
        tensor, one segment after the other, converted to `dtype`; and, when the token ids live on
        the accelerator, of device_ids = (ids tensor, flat rows) into the record's id area.
        n: the record's rows, all segments together."""
        dst = self._view(res.payload_offset, dtype, (n, width))
        if len(segments) == 1:
            self._gather_into(dst, *segments[0])
        else:
            at = 0
            for src, index in segments:
                k = src.shape[0] if index is None else len(index)
                self._gather_into(dst[at : at + k], src, index)
                at += k
        if device_ids is not None:
            ids, rows = device_ids
            self._gather_into(self._view(res.token_ids_offset, torch.int32, (n,)), ids, rows)
        self._step.append(res)

    def _gather_into(self, dst: torch.Tensor, src: torch.Tensor, index: np.ndarray | None) -> None:
        rows = _slice_rows(src, index)
        if rows is not None:
            # Contiguous rows (a decode batch in which every request captures; a prefill chunk): a slice.
            dst.copy_(rows)
        elif dst.dtype == src.dtype:
            torch.index_select(src, 0, torch.from_numpy(index), out=dst)
        else:
            dst.copy_(src.index_select(0, torch.from_numpy(index)))

    def end_step(self) -> None:
        if self._step:
            self.writer.commit_many(self._step)
            self._step = []

    def close(self) -> None:
        pass


class CudaPublisher(Publisher):
    def __init__(self, writer: RingWriter, device: torch.device):
        super().__init__(writer, device)
        cudart = torch.cuda.cudart()
        # cudaHostRegisterDefault = 0: page-lock the mapping so D2H copies into it are async DMA.
        err = cudart.cudaHostRegister(self.ring.data_ptr(), self.ring.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"vllm-tap: cudaHostRegister of the ring failed ({err})")
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="vllm-tap-publisher", daemon=True)
        self._thread.start()

    def _gather_into(self, dst: torch.Tensor, src: torch.Tensor, index: np.ndarray | None) -> None:
        # Gather on the device first (one kernel into a stream-ordered temporary, freed safely after
        # the copy is queued on the same stream), then one async DMA into the registered ring.
        dst.copy_(gather_rows(src, index), non_blocking=True)

    def end_step(self) -> None:
        if not self._step:
            return
        ev = torch.cuda.Event()
        ev.record()
        self._q.put((ev, self._step))
        self._step = []

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            ev, reservations = item
            ev.synchronize()
            self.writer.commit_many(reservations)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)


def gather_rows(src: torch.Tensor, index: np.ndarray | None) -> torch.Tensor:
    """src's rows `index` (all when None) as a tensor on src's device (a view when contiguous)."""
    rows = _slice_rows(src, index)
    return rows if rows is not None else src.index_select(0, torch.from_numpy(index).to(src.device, non_blocking=True))


def _slice_rows(src: torch.Tensor, index: np.ndarray | None) -> torch.Tensor | None:
    """src's rows `index` as a view when they are one run (index ascending, as every row index
    here is; None = all rows), else None: then they need a gather."""
    if index is None:
        return src
    a, b = int(index[0]), int(index[-1])
    if b - a + 1 != len(index):
        return None
    return src if a == 0 and b + 1 == src.shape[0] else src[a : b + 1]


def make_publisher(writer: RingWriter, device: torch.device) -> Publisher:
    if device.type == "cuda":
        return CudaPublisher(writer, device)
    return Publisher(writer, device)
