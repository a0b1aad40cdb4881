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
        self._step: list[Reservation] = []

    def _view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return self.ring[offset : offset + nbytes].view(dtype).view(shape)

    def copy(self, res: Reservation, src: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Queue the copy of src [n, w] and its token ids into the reservation."""
        dst = self._view(res.payload_offset, src.dtype, tuple(src.shape))
        ids = self._view(res.token_ids_offset, torch.int32, (src.shape[0],))
        self._copy(dst, src, ids, token_ids)
        self._step.append(res)

    def _copy(self, dst, src, ids_dst, ids_src) -> None:
        dst.copy_(src)
        ids_dst.copy_(ids_src)

    def end_step(self) -> None:
        for res in self._step:
            self.writer.commit(res)
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

    def _copy(self, dst, src, ids_dst, ids_src) -> None:
        dst.copy_(src, non_blocking=True)
        ids_dst.copy_(ids_src, non_blocking=True)

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
            for res in reservations:
                self.writer.commit(res)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)


def make_publisher(writer: RingWriter, device: torch.device) -> Publisher:
    if device.type == "cuda":
        return CudaPublisher(writer, device)
    return Publisher(writer, device)
