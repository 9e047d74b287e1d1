"""What only a CUDA machine can check (skipped elsewhere; run on lent GPU machines by
scripts/device-cuda.sh): the prefill engine's asynchronous device-to-host copy hands
over the same bytes as the synchronous one, for every dtype the wire carries."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# At the top, not in the test: a CPU-only CI collects this file, and a renamed module
# fails the collection there instead of hiding behind the skip.
from disagg_agents.prefill.engine import PrefillEngine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss"])
def test_async_host_copy_is_bit_identical(
    tiny_model: Callable[..., Path], arch: str, dtype: str
) -> None:
    eng = PrefillEngine(str(tiny_model(arch, seed=5)), device="cuda", dtype=dtype)
    ids = [(i * 37 + 11) % 400 for i in range(300)]
    runs: dict[bool, list[Any]] = {}
    for overlap in (False, True):
        got: list[Any] = []
        eng.prefill(ids, got.append, host_async=overlap)
        for kv in got:
            kv.wait()
        runs[overlap] = got
    assert len(runs[True]) == len(eng.layers)
    for sync, overlapped in zip(runs[False], runs[True], strict=True):
        assert overlapped.keys.dtype == sync.keys.dtype
        assert np.array_equal(overlapped.keys, sync.keys)
        assert np.array_equal(overlapped.values, sync.values)
