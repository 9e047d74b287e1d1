"""Model fingerprints: what two agents must agree on before K/V crosses between them."""

from __future__ import annotations

from typing import Any

FINGERPRINT_KEYS = ("architecture", "num_layers", "num_kv_heads", "head_dim", "dtype", "layers")


def fingerprint_mismatch(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Name every fingerprint field on which two agents disagree."""
    diffs = []
    for key in FINGERPRINT_KEYS:
        a, b = ours.get(key), theirs.get(key)
        if key == "layers" and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            bad = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
            if bad:
                diffs.append(f"layers {bad[:4]} cache kind/window {a[bad[0]]} vs {b[bad[0]]}")
            continue
        if a != b:
            diffs.append(f"{key} {a} vs {b}")
    return diffs
