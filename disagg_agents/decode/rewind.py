"""Dropping a verify forward's rejected positions from the caches.

A verify forward writes L positions for every row (its input token, its draft,
padding); row r keeps the first L - garbage[r]. Afterwards every cache must
hold what a run that never drafted would hold: the same K/V at the same
positions, rows still right-aligned at one write column.

- plain caches (a lone row): KVCache trims; a RotatingKVCache (after the
  multi-token forward it is in temporal order) drops its last columns;
- batch caches: the fewest rejected positions, `least`, are trimmed from every
  row; a row with more is moved right by the rest and its left padding grows
  (mlx-lm's BatchKVCache / BatchRotatingKVCache roll it, the preallocated rows
  copy only that row: disagg_agents/decode/rows.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from disagg_agents.decode.rows import RowBatch, RowsKVCache

# The cache kinds whose positions can be dropped this way.
REWINDABLE = (KVCache, RotatingKVCache, BatchKVCache, BatchRotatingKVCache, RowsKVCache)


def can_rewind(caches: list[Any]) -> bool:
    """Whether every layer's cache is of a kind rewind handles (exact types:
    a subclass may keep state this does not know)."""
    return all(type(c) in REWINDABLE for c in caches)


def rewind_plain(caches: list[Any], garbage: int) -> None:
    """A lone row's plain caches, the last `garbage` positions dropped."""
    if garbage <= 0:
        return
    for c in caches:
        if type(c) is RotatingKVCache:
            _drop_tail(c, garbage)
        else:
            c.trim(garbage)


def _drop_tail(c: Any, n: int) -> None:
    """A rotating cache after a multi-token update holds its columns in temporal
    order, exactly `_idx` of them: the last n go (its own trim keeps them, as
    columns a later rotation would read)."""
    c.offset -= n
    c._idx -= n
    c.keys = c.keys[..., : c._idx, :]
    c.values = c.values[..., : c._idx, :]


def rewind_batch(caches: list[Any], rows: RowBatch | None, garbage: list[int]) -> None:
    """Batch caches: row r loses its last garbage[r] positions."""
    least = min(garbage)
    extra = [g - least for g in garbage]
    if rows is not None:
        rows.rewind(least, extra)
    shift = mx.array(extra)
    for c in caches:
        if type(c) is BatchKVCache:
            _rewind_batch_kv(c, least, shift, any(extra))
        elif type(c) is BatchRotatingKVCache:
            _rewind_batch_rotating(c, least, shift, any(extra))


def _rewind_batch_kv(c: Any, least: int, shift: mx.array, moved: bool) -> None:
    if least:
        c.trim(least)
    if moved:  # as a right-padded prompt: rolled right, the padding now on the left
        c._right_padding = shift
        c.finalize()


def _rewind_batch_rotating(c: Any, least: int, shift: mx.array, moved: bool) -> None:
    if least:  # temporal order after the multi-token update, as a lone one's
        c.trim(least)
        c.keys = c.keys[..., : c._idx, :]
        c.values = c.values[..., : c._idx, :]
    if moved:
        c._lengths = c.offset - shift
        c.finalize()
