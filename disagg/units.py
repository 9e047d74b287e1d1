"""Numbers with units as people read them (tables in the CLI and the benchmarks)."""

from __future__ import annotations

from typing import Any

UNITS = {
    "prefill_time": "s",
    "decode_time": "s",
    "total_time": "s",
    "ttft": "s",
    "kv_transfer_time": "s",
    "prefill_speed": "tok/s",
    "decode_speed": "tok/s",
    "kv_bytes": "B",
}


def fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if unit == "s":
            return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.3f} s"
        return f"{value:,.1f} {unit}".strip()
    if isinstance(value, int) and unit == "B":
        return f"{value / 1e6:,.2f} MB" if value >= 1e6 else f"{value:,} B"
    return f"{value} {unit}".strip() if unit else str(value)
