"""K/V off the device without stalling compute (the prefill agent on CUDA).

Each layer's K/V is copied device-to-host on a side stream, after an event the
compute stream records when the layer is done, so the next layer computes while
this one comes across; the host buffers are pinned (an async copy needs them)
and reused, not allocated per layer: one goes back to the pool once the last
array viewing it is dropped (the sender has sent its frame). The reader waits on
the copy's event before touching the bytes (`LayerKV.wait`).

On a CPU the cache tensors are host memory already: `HostCopies.for_device`
gives None and the prefill hands numpy views over (no copy at all). The pool and
the copy ordering run on a CPU too (`pin=False`), which is how they are tested.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch

IDLE_BYTES = 1 << 30  # pooled buffers no one holds, kept for the next layers at most


class PinnedPool:
    """Host buffers by capacity; `take` gives the smallest free one that fits (or a
    new one), and a buffer returns when the last view of it is gone."""

    def __init__(self, pin: bool = True, max_idle_bytes: int = IDLE_BYTES) -> None:
        self.pin = pin
        self.max_idle_bytes = max_idle_bytes
        self.free: list[torch.Tensor] = []  # uint8 buffers, by capacity ascending
        self.lock = threading.Lock()  # buffers come back on the sender's thread
        self.allocated = 0  # buffers made (a count: reuse shows as few)

    def take(self, shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
        """A host tensor over a pooled buffer, and the numpy array over it to hand
        out: the buffer stays out of the pool while that array or a view of it lives."""
        nbytes = shape.numel() * dtype.itemsize
        with self.lock:
            for i, buf in enumerate(self.free):
                if buf.numel() >= nbytes:
                    del self.free[i]
                    break
            else:
                buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pin)
                self.allocated += 1
        host = buf[:nbytes].view(dtype).view(shape)
        arr = host.numpy()  # its base is not `host`: the array is what views keep alive
        weakref.finalize(arr, self._give_back, buf)
        return host, arr

    def _give_back(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.free.append(buf)
            self.free.sort(key=torch.Tensor.numel)
            while sum(b.numel() for b in self.free) > self.max_idle_bytes:
                self.free.pop()  # the largest goes first

    @property
    def idle_bytes(self) -> int:
        with self.lock:
            return sum(b.numel() for b in self.free)


class HostCopies:
    """Device-to-host copies of [1, H, S, D] cache tensors into [H, S, D] numpy
    arrays (bf16 as raw 16-bit words), on a side stream where there is one."""

    def __init__(self, device: str, pin: bool = True) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pool = PinnedPool(pin=pin and self.cuda)

    @classmethod
    def for_device(cls, device: str) -> HostCopies | None:
        """The copier for `device`; None where cache tensors are host memory."""
        return cls(device) if torch.device(device).type == "cuda" else None

    def copy(
        self, tensors: tuple[torch.Tensor, ...]
    ) -> tuple[list[np.ndarray], Callable[[], None]]:
        """Start the copies; read the arrays only after calling the returned function."""
        if not self.cuda:
            return [self._copy_one(t) for t in tensors], _nothing
        assert self.stream is not None
        computed = torch.cuda.Event()
        computed.record()  # on the compute stream: the layer's K/V is written
        self.stream.wait_event(computed)
        with torch.cuda.stream(self.stream):
            out = [self._copy_one(t) for t in tensors]
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done.synchronize

    def _copy_one(self, t: torch.Tensor) -> np.ndarray:
        src = t[0].view(torch.int16) if t.dtype == torch.bfloat16 else t[0]
        host, arr = self.pool.take(src.shape, src.dtype)
        host.copy_(src, non_blocking=self.cuda)
        if self.cuda and self.stream is not None:
            # The caching allocator must not hand the source's memory to the compute
            # stream before this stream has read it.
            src.record_stream(self.stream)
        return arr.view(np.uint16) if t.dtype == torch.bfloat16 else arr


def _nothing() -> None:
    return None
