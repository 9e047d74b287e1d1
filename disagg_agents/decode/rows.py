"""Preallocated batch rows: a join writes one row, a departure moves one row.

mlx-lm's BatchKVCache copies the whole batch on every join (merge + extend) and
gathers every row on a departure (filter). Here each full-attention layer keeps
one buffer [capacity, heads, width, dim] that lives across joins and departures:

- the live rows are the first `n`; the forward reads `keys[:n]` (a view), so a
  dead row is never computed;
- every row writes its next token at the same column `idx` (as in mlx-lm, rows
  are right-aligned at the write index with left padding, masked);
- a join writes its prompt into row `n`, right-aligned at `idx`; only a prompt
  longer than `idx` regrows the buffer, with left headroom so that stays rare;
- a departure moves the last live row into the departed slot (one row, or none
  when the last row leaves).

Writes are slice updates on a buffer nothing else holds, so mlx does them in
place. Layers of other kinds (RotatingKVCache: gpt_oss' sliding layers) keep
mlx-lm's batch caches and follow the same row order by merge/extend/filter.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

STEP = 256  # columns added at a time, as mlx-lm's KVCache grows


def _round_up(x: int, to: int = STEP) -> int:
    return -(-x // to) * to


class Layout:
    """The row layout every full-attention layer shares: live rows, the column
    where the next token goes, and each row's left padding (host side: it changes
    only between steps)."""

    def __init__(self, capacity: int, idx: int) -> None:
        self.capacity = capacity
        self.n = 0
        self.idx = idx  # the write column of the next step (before it runs)
        self.start = idx  # the leftmost column any live row uses
        self.pad = np.zeros(capacity, np.int64)  # row r holds columns [pad[r], idx)
        self._memo: dict[tuple[str, int], mx.array] = {}

    def changed(self) -> None:
        self._memo.clear()
        self.start = int(self.pad[: self.n].min()) if self.n else self.idx

    def offsets(self, idx: int) -> mx.array:
        """[n] each live row's position of the token written at column idx."""
        key = ("offset", idx)
        if key not in self._memo:  # once per step, not once per layer
            self._memo = {k: v for k, v in self._memo.items() if k[1] == idx}
            self._memo[key] = mx.array((idx - self.pad[: self.n]).astype(np.int32))
        return self._memo[key]

    def padding(self, idx: int) -> mx.array:
        """[n] left padding relative to `start` (what the mask reads)."""
        key = ("pad", idx)
        if key not in self._memo:
            self._memo[key] = mx.array((self.pad[: self.n] - self.start).astype(np.int32))
        return self._memo[key]


class RowsKVCache:
    """One full-attention layer's K/V for the whole batch; duck-types mlx-lm's
    cache for the model (offset, update_and_fetch, make_mask)."""

    def __init__(self, layout: Layout, keys: mx.array, values: mx.array) -> None:
        self.layout = layout
        self.keys = keys  # [capacity, H, width, Dk]
        self.values = values
        self._idx = layout.idx  # this layer's write column (advances within a step)

    @property
    def offset(self) -> mx.array:
        return self.layout.offsets(self._idx)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n, s = self.layout.n, keys.shape[2]
        assert keys.shape[0] == n, (keys.shape, n)
        if self._idx + s > self.keys.shape[2]:  # out of columns: grow to the right
            self.keys, self.values = (
                _widen(a, 0, _round_up(self._idx + s) - a.shape[2])
                for a in (self.keys, self.values)
            )
        a, b = self._idx, self._idx + s
        self.keys[:n, :, a:b] = keys
        self.values[:n, :, a:b] = values
        self._idx = b
        start = self.layout.start
        return self.keys[:n, :, start:b], self.values[:n, :, start:b]

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None, **_: Any
    ) -> mx.array:
        # The rows' left padding always needs an array mask (as BatchKVCache).
        return create_causal_mask(
            N,
            offset=self._idx - self.layout.start,
            window_size=window_size,
            left_padding=self.layout.padding(self._idx),
        )

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    def size(self) -> int:
        return self._idx - self.layout.start

    def empty(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)


def _widen(a: mx.array, left: int, right: int) -> mx.array:
    """The buffer with `left` / `right` zero columns more (a copy: growth only).
    Zeros, not garbage: a masked column still meets the values (0 * NaN)."""
    return mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)])


def _rows(a: mx.array, rows: int) -> mx.array:
    """The buffer with `rows` rows (a copy: capacity growth only)."""
    return mx.pad(a, [(0, rows - a.shape[0]), (0, 0), (0, 0), (0, 0)])


class RowBatch:
    """The batch's caches, one per model layer (rows for KVCache layers, mlx-lm's
    batch caches for the others), kept in the order of the loop's sequences."""

    def __init__(self, first: list[Any], capacity: int, max_rows: int) -> None:
        """Starts from one sequence's plain caches (the lone stream's)."""
        self.max_rows = max_rows
        full = [i for i, c in enumerate(first) if type(c) is KVCache]
        if not full:
            raise ValueError("no full-attention layer to batch")
        self.full = set(full)
        length = first[full[0]].offset
        idx = _round_up(max(length, 1))  # left headroom up to the next step
        self.layout = Layout(capacity, idx)
        self.caches: list[Any] = []
        for i, c in enumerate(first):
            if i in self.full:
                h, dk, dv = c.keys.shape[1], c.keys.shape[3], c.values.shape[3]
                k = mx.zeros((capacity, h, idx + STEP, dk), c.keys.dtype)
                v = mx.zeros((capacity, h, idx + STEP, dv), c.values.dtype)
                self.caches.append(RowsKVCache(self.layout, k, v))
            else:
                self.caches.append(type(c).merge([c]))
        self._write_rows([first])

    @property
    def n(self) -> int:
        return self.layout.n

    # -- joins -------------------------------------------------------------------

    def join(self, group: list[list[Any]]) -> None:
        """Appends these sequences' plain caches as rows n, n+1, ..."""
        self._sync()
        need = self.n + len(group)
        if need > self.max_rows:
            raise ValueError(f"{need} rows exceed the batch's {self.max_rows}")
        if need > self.layout.capacity:  # geometric: log2(max) copies in all
            self._grow_rows(min(self.max_rows, max(need, 2 * self.layout.capacity)))
        longest = max(seq[min(self.full)].offset for seq in group)
        if longest > self.layout.idx:  # rare: the prompt is longer than the window
            self._grow_left(_round_up(longest + longest // 4) - self.layout.idx)
        self._write_rows(group)
        for i, c in enumerate(self.caches):
            if i not in self.full:
                theirs = [seq[i] for seq in group]
                c.extend(type(theirs[0]).merge(theirs))

    def _write_rows(self, group: list[list[Any]]) -> None:
        lay = self.layout
        for seq in group:
            r = lay.n
            length = seq[min(self.full)].offset
            lay.pad[r] = lay.idx - length
            for i in self.full:
                mine, theirs = self.caches[i], seq[i]
                assert theirs.offset == length, "layers disagree on the prompt length"
                if length:
                    a, b = lay.idx - length, lay.idx
                    mine.keys[r : r + 1, :, a:b] = theirs.keys[:, :, :length]
                    mine.values[r : r + 1, :, a:b] = theirs.values[:, :, :length]
            lay.n += 1
        lay.changed()

    def _grow_rows(self, capacity: int) -> None:
        for i in self.full:
            c = self.caches[i]
            c.keys, c.values = _rows(c.keys, capacity), _rows(c.values, capacity)
        pad = np.zeros(capacity, np.int64)
        pad[: self.layout.capacity] = self.layout.pad
        self.layout.pad, self.layout.capacity = pad, capacity

    def _grow_left(self, extra: int) -> None:
        for i in self.full:
            c = self.caches[i]
            c.keys, c.values = _widen(c.keys, extra, 0), _widen(c.values, extra, 0)
            c._idx += extra
        self.layout.idx += extra
        self.layout.pad += extra
        self.layout.changed()

    # -- departures --------------------------------------------------------------

    def leave(self, gone: list[int]) -> list[int]:
        """Drops these rows (each departed slot takes the last live row). Returns
        the new row order as old row numbers."""
        lay = self._sync()
        order = list(range(lay.n))
        for d in sorted(set(gone), reverse=True):  # rows after d are all live here
            order[d] = order[-1]
            order.pop()
        moves = [(old, new) for new, old in enumerate(order) if old != new]
        lay.pad[[new for _, new in moves]] = lay.pad[[old for old, _ in moves]]
        lay.n = len(order)
        lay.changed()
        move_kv_rows([self.caches[i] for i in self.full], moves, lay.pad, lay.idx)
        for i, c in enumerate(self.caches):
            if i not in self.full:
                c.filter(order)
        return order

    # -- rejected draft positions ------------------------------------------------

    def rewind(self, least: int, extra: list[int]) -> None:
        """After a verify forward: every row drops its last `least` columns (the
        write column goes back), and row r `extra[r]` more, by moving its used
        columns right (its left padding grows). Only rows with extra are copied."""
        lay = self._sync()
        if least:
            for i in self.full:
                self.caches[i]._idx -= least
            lay.idx -= least
        moved = [r for r in range(lay.n) if extra[r]]
        if moved:
            caches = [self.caches[i] for i in self.full]
            parts = [
                [
                    mx.contiguous(a[r : r + 1, :, int(lay.pad[r]) : lay.idx - extra[r]])
                    for c in caches
                    for a in (c.keys, c.values)
                ]
                for r in moved
            ]
            mx.eval(parts)  # copied out first: see move_kv_rows
            for r, got in zip(moved, parts, strict=True):
                a = int(lay.pad[r]) + extra[r]
                for j, c in enumerate(caches):
                    c.keys[r : r + 1, :, a : lay.idx] = got[2 * j]
                    c.values[r : r + 1, :, a : lay.idx] = got[2 * j + 1]
                lay.pad[r] = a
        lay.changed()

    def extract(self, row: int) -> list[Any]:
        """Row `row` as plain caches (back to the single-stream path)."""
        lay, out = self._sync(), []
        for i, c in enumerate(self.caches):
            if i in self.full:
                plain = KVCache()
                a, b = int(lay.pad[row]), lay.idx
                plain.keys = mx.contiguous(c.keys[row : row + 1, :, a:b])
                plain.values = mx.contiguous(c.values[row : row + 1, :, a:b])
                plain.offset = b - a
                out.append(plain)
            else:
                out.append(c.extract(row))
        return out

    def _sync(self) -> Layout:
        """The layout after the forwards run so far (each layer advanced its own
        write column, as mlx-lm's caches do; between steps they agree)."""
        idx = {self.caches[i]._idx for i in self.full}
        assert len(idx) == 1, idx
        self.layout.idx = idx.pop()
        self.layout.changed()
        return self.layout


def move_kv_rows(
    caches: list[RowsKVCache], moves: list[tuple[int, int]], pad: np.ndarray, idx: int
) -> None:
    """Copies row `old` over row `new` (its used columns [pad[new], idx)) for each
    move, in place. The moved rows are copied out and evaluated first: an update
    that still reads a view of the buffer makes mlx copy the whole buffer."""
    if not moves:
        return
    rows = [
        [
            mx.contiguous(a[old : old + 1, :, int(pad[new]) : idx])
            for c in caches
            for a in (c.keys, c.values)
        ]
        for old, new in moves
    ]
    mx.eval(rows)
    for (_, new), parts in zip(moves, rows, strict=True):
        a = int(pad[new])
        for j, c in enumerate(caches):
            c.keys[new : new + 1, :, a:idx] = parts[2 * j]
            c.values[new : new + 1, :, a:idx] = parts[2 * j + 1]
