"""Moving captured rows from the model's tensors into ring reservations.

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

    def copy(self, res: Reservation, src: torch.Tensor | list[torch.Tensor], token_ids: torch.Tensor | None) -> None:
        """Queue the copy of src [n, w] (or of row blocks to stack, each [k, w]: copied one after
        the other, never concatenated first) and of its token ids into the reservation
        (token_ids=None: the writer already stored them, from the host)."""
        if isinstance(src, list):
            n = sum(p.shape[0] for p in src)
            dst = self._view(res.payload_offset, src[0].dtype, (n, src[0].shape[1]))
            at = 0
            for part in src:
                k = part.shape[0]
                self._copy_into(dst[at : at + k], part)
                at += k
        else:
            n = src.shape[0]
            self._copy_into(self._view(res.payload_offset, src.dtype, tuple(src.shape)), src)
        if token_ids is not None:
            self._copy_into(self._view(res.token_ids_offset, torch.int32, (n,)), token_ids)
        self._step.append(res)

    def _copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

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

    def _copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

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


def make_publisher(writer: RingWriter, device: torch.device) -> Publisher:
    if device.type == "cuda":
        return CudaPublisher(writer, device)
    return Publisher(writer, device)
