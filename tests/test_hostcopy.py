"""K/V copies off the device: pooled host buffers, reused once the sender drops
them, never while an array still views them. On a CPU (no side stream) the same
class copies synchronously; on CUDA it adds the stream and events (tests/test_cuda)."""

from __future__ import annotations

import gc

import numpy as np
import torch

from disagg_agents.prefill.engine import to_wire
from disagg_agents.prefill.hostcopy import HostCopies, PinnedPool


def test_pool_reuses_a_buffer_only_once_every_view_is_gone() -> None:
    pool = PinnedPool(pin=False)
    a = pool.take(torch.Size([4, 8]), torch.float32)[1]
    view = a.view(np.uint32)[1:]  # a view of a view, as the frame's casts make
    del a
    gc.collect()
    b = pool.take(torch.Size([4, 8]), torch.float32)[1]
    assert pool.allocated == 2  # the first buffer is still viewed
    del view
    gc.collect()
    assert pool.idle_bytes == 128
    c = pool.take(torch.Size([2, 8]), torch.int16)[1]  # smaller: fits the free buffer
    assert pool.allocated == 2 and pool.idle_bytes == 0
    del b, c
    gc.collect()
    assert pool.idle_bytes == 256


def test_idle_buffers_are_capped() -> None:
    pool = PinnedPool(pin=False, max_idle_bytes=100)
    held = [pool.take(torch.Size([n]), torch.uint8)[1] for n in (40, 50, 60)]
    del held
    gc.collect()
    assert pool.idle_bytes <= 100


def test_copies_equal_the_wire_arrays_for_every_layout() -> None:
    copies = HostCopies("cpu")
    assert HostCopies.for_device("cpu") is None  # the engine hands views over on a CPU
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        k = torch.randn(1, 2, 10, 4).to(dtype)
        sliding = k[:, :, -6:]  # a sliding layer's last positions: not contiguous
        for _ in range(3):  # reused buffers hold the new layer's bytes
            (a, b), ready = copies.copy((k, sliding))
            ready()
            assert a.dtype == to_wire(k).dtype and (a == to_wire(k)).all()
            assert (b == to_wire(sliding)).all() and b.flags.c_contiguous
            del a, b
            gc.collect()
    assert copies.pool.allocated == 2  # the first layer's two buffers, reused throughout
