"""How many bytes of dequantized weights the prefill agent may keep at load.

Dequantized once and kept, a weight costs no work per forward; kept packed, it
is dequantized on every forward (for a long prompt, the whole model rewritten
per prefill). The choice is made at load, weight by weight in load order, within
a budget: what the device has available, less the packed checkpoint still to
come and a reserve for K/V, activations and the batched dequantization of the
weights left packed. `--dequant-budget-gb` / DISAGG_DEQUANT_BUDGET_GB cap it
(0: keep everything packed).
"""

from __future__ import annotations

import os
from pathlib import Path

BUDGET_ENV = "DISAGG_DEQUANT_BUDGET_GB"
RESERVE_FRACTION = 0.25  # of the device's memory, left for K/V and activations
GB = 1 << 30


def available_bytes(device: str) -> tuple[int, int]:
    """(available, total) bytes of the memory `device` computes from."""
    import torch

    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), int(total)
    if device == "mps":
        total = int(torch.mps.recommended_max_memory())
        return total - int(torch.mps.current_allocated_memory()), total
    return host_memory()


def host_memory() -> tuple[int, int]:
    """(MemAvailable, MemTotal) from /proc/meminfo; else physical pages."""
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if "MemAvailable" in info and "MemTotal" in info:
        return info["MemAvailable"], info["MemTotal"]
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def dequant_budget(device: str, checkpoint_bytes: int, cap_gb: float | None = None) -> int:
    """Bytes that weights may grow by when dequantized at load on `device`.

    `cap_gb` (else $DISAGG_DEQUANT_BUDGET_GB) caps it; without either it is what
    the device has available, less the checkpoint and a quarter of its memory.
    """
    if cap_gb is None and os.environ.get(BUDGET_ENV):
        cap_gb = float(os.environ[BUDGET_ENV])
    available, total = available_bytes(device)
    auto = max(0, available - checkpoint_bytes - int(RESERVE_FRACTION * total))
    if cap_gb is None:
        return auto
    return max(0, min(auto, int(cap_gb * GB)))
