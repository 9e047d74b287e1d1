"""Bytes one MoE layer moves through DRAM on the Triton path, counted from the grid
and tiles `moe_triton` picks (not measured): the programs in launch order, each
reading its block's activation rows and its expert's weight slice and writing its
output tile, through an LRU cache the size of a share of the device's L2.

What it counts per layer: packed weights (+ scales, biases) as read; activations
read by the fused gate/up (gathered token rows); the intermediate written and read
again by down; down's per-pair rows written; the slot sum (torch) reading them and
writing the layer's output. The minimum a kernel must move: every routed expert's
packed weights once, the hidden states in and the output out. Not modeled: programs
running concurrently (an LRU over launch order stands in for it, on half the L2),
routing indices and row weights (a few MB), L2 sectors (whole rows are the unit).

Printed by the layer bench: python -m disagg.bench.moelayer --count (no GPU needed).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from disagg_agents.models import moetiles as tt


@dataclass
class Counted:
    shape: str
    capability: tuple[int, int]
    tokens: int
    order: str
    weights: int
    acts: int  # gate/up reading the hidden states
    inter: int  # the intermediate written, then read by down
    pairs_out: int  # down's per-pair rows written, then read by the slot sum
    out: int  # the layer's output written
    total: int
    minimum: int
    ratio: float
    # What this order would count if the intermediate and down's per-pair rows never
    # left the chip (down fused behind gate/up, the slots summed in the kernel):
    # weights + gathered activations + output, over the minimum.
    floor_ratio: float = 0.0


class Lru:
    """Bytes missed by an LRU cache of `capacity` bytes over named units."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self.missed: dict[str, int] = {}  # by the unit's kind (its key's first item)
        self.units: OrderedDict[tuple[Any, ...], int] = OrderedDict()

    def read(self, key: tuple[Any, ...], size: int) -> None:
        if key in self.units:
            self.units.move_to_end(key)
            return
        self.missed[key[0]] = self.missed.get(key[0], 0) + size
        self.units[key] = size
        self.used += size
        while self.used > self.capacity and self.units:
            self.used -= self.units.popitem(last=False)[1]


def weight_bytes(spec: dict[str, Any], n: int, k: int) -> float:
    """Bytes per expert row slice of n outputs x k inputs, as stored."""
    if spec["form"] == "plain":
        return n * k * 2.0
    scales = n * k / spec["group"] * (1 if spec["form"] == "mxfp4" else 4)  # affine: 2 bf16
    return n * k / 2 + scales


def routing(spec: dict[str, Any], tokens: int, seed: int = 1) -> tuple[list[int], list[int]]:
    """Pairs per expert and the token of each sorted pair, under random top-k
    routing (as the layer bench routes), sorted by expert as `moe.route` sorts."""
    import torch

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, spec["experts"], generator=g)
    flat = torch.topk(logits, spec["top_k"], dim=-1).indices.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=spec["experts"]).tolist()
    return counts, (order // spec["top_k"]).tolist()


def _kernel(
    cache: Lru, blocks: list[tuple[int, int, int]], rows: list[int], n: int, k: int,
    t: Any, w_slice: float, gathered: bool, name: str,
) -> int:  # fmt: skip
    """Misses of one kernel's reads through `cache`; returns the bytes it writes."""
    nn = -(-n // t.bn)
    written = 0
    for b, j in tt.program_order(len(blocks), nn, t.group_m):
        e, start, end = blocks[b]
        if start >= end:
            continue
        if gathered:  # token rows, shared by the blocks (experts) a token is routed to
            for r in range(start, end):
                cache.read(("x", rows[r]), k * 2)
        else:  # the block's own rows of the intermediate
            cache.read(("inter", b), (end - start) * k * 2)
        cache.read((name, e, j), int(w_slice * min(t.bn, n - j * t.bn) / t.bn))
        written += (end - start) * min(t.bn, n - j * t.bn) * 2
    return written


def count(
    spec: dict[str, Any],
    props: tt.DeviceProps,
    tokens: int,
    before: bool = False,
    group_m: int | None = None,
) -> Counted:
    """The layer's counted bytes (`spec` as the layer bench's SHAPES) with the tiles
    and order used now on `props` (`before`: the tiles and 2-D grid of the
    recording before the table, through the same cache)."""
    h, i, e = spec["hidden"], spec["inter"], spec["experts"]
    counts, rows = routing(spec, tokens)
    old = tt.recording_tiles(len(rows), e)
    t_up, t_dn = (old, old) if before else _tiles(spec, props, len(rows))
    if group_m is not None:  # for sweeps of the swizzle's group
        t_up, t_dn = replace(t_up, group_m=group_m), replace(t_dn, group_m=group_m)
    cache = Lru(props.l2 // 2)
    inter_w = _gate_up(cache, spec, counts, rows, t_up)
    dn_slice = weight_bytes(spec, t_dn.bn, i)
    pairs_w = _kernel(cache, _blocks(counts, t_dn.bm), rows, h, i, t_dn, dn_slice, False, "down")
    m = cache.missed
    weights = m.get("gate_up", 0) + m.get("down", 0)
    out = tokens * h * 2
    inter = inter_w + m.get("inter", 0)
    total = weights + m.get("x", 0) + inter + 2 * pairs_w + out
    used = sum(1 for c in counts if c)
    minimum = int(used * (weight_bytes(spec, 2 * i, h) + weight_bytes(spec, h, i))) + 2 * out
    floor = weights + m.get("x", 0) + out
    return Counted(spec["name"], props.capability, tokens, "before" if before else "now", weights,
                   m.get("x", 0), inter, 2 * pairs_w, out, total, minimum,
                   round(total / minimum, 2), round(floor / minimum, 3))  # fmt: skip


def chunked_floor(spec: dict[str, Any], props: tt.DeviceProps, tokens: int) -> float:
    """The least floor ratio over splitting the layer's tokens into 1, 2, 4 or 8
    chunks run one after another (each chunk's gathered rows fit the cache better,
    but every chunk reads the routed experts' weights again): if even this is over
    1.5x, no kernel of this kind, fused or not, moves 1.5x the minimum or less."""
    whole = count(spec, props, tokens)
    best = whole.floor_ratio
    for parts in (2, 4, 8):
        c = count(spec, props, tokens // parts)
        best = min(best, parts * (c.weights + c.acts + c.out) / whole.minimum)
    return round(best, 3)


def summed_in_down(
    spec: dict[str, Any], props: tt.DeviceProps, tokens: int, acc_bytes: int
) -> float:
    """The ratio to the minimum if down summed the slots itself, each program adding its
    tile into the token's output row (atomics: fp32 `acc_bytes` 4, then a cast to
    bf16; or bf16 2, rounded at every add, in an order that changes run to run) in
    place of the per-pair rows and the slot sum. Each output row a program misses
    is read and later written back; the rows are zeroed first."""
    c = count(spec, props, tokens)  # its weights, gathered rows and intermediate stay
    h, i = spec["hidden"], spec["inter"]
    counts, rows = routing(spec, tokens)
    t_up, t_dn = _tiles(spec, props, len(rows))
    cache = Lru(props.l2 // 2)
    _gate_up(cache, spec, counts, rows, t_up)  # what down's reads find in the cache
    dn_slice, blocks = weight_bytes(spec, t_dn.bn, i), _blocks(counts, t_dn.bm)
    for b, j in tt.program_order(len(blocks), -(-h // t_dn.bn), t_dn.group_m):
        e_, start, end = blocks[b]
        if start >= end:
            continue
        width = min(t_dn.bn, h - j * t_dn.bn)
        cache.read(("inter", b), (end - start) * i * 2)
        cache.read(("down", e_, j), int(dn_slice * width / t_dn.bn))
        for r in range(start, end):
            cache.read(("out", rows[r], j), width * acc_bytes)
    zeroed = tokens * h * acc_bytes
    cast = tokens * h * (acc_bytes + 2) if acc_bytes != 2 else 0
    total = c.weights + c.acts + c.inter + 2 * cache.missed.get("out", 0) + zeroed + cast
    return round(total / c.minimum, 2)


def _tiles(spec: dict[str, Any], props: tt.DeviceProps, pairs: int) -> tuple[Any, Any]:
    """The (gate_up, down) tiles the kernels pick on `props` for this many pairs."""
    form = {"mxfp4": tt.FORM_MXFP4, "affine4": tt.FORM_AFFINE}.get(spec["form"], tt.FORM_PLAIN)
    e, group = spec["experts"], spec["group"]
    return (tt.tiles_for(props, pairs, e, "gate_up", form, group),
            tt.tiles_for(props, pairs, e, "down", form, group))  # fmt: skip


def _gate_up(cache: Lru, spec: dict[str, Any], counts: list[int], rows: list[int], t: Any) -> int:
    """The fused gate/up kernel's reads through `cache`; the intermediate bytes it writes."""
    h, i = spec["hidden"], spec["inter"]
    gu_slice = weight_bytes(spec, t.bn, h) * 2  # gate and up of one N tile
    return _kernel(cache, _blocks(counts, t.bm), rows, i, h, t, gu_slice, True, "gate_up")


def _blocks(counts: list[int], bm: int) -> list[tuple[int, int, int]]:
    out, start = [], 0
    for e, c in enumerate(counts):
        for b0 in range(0, c, bm):
            out.append((e, start + b0, start + min(c, b0 + bm)))
        start += c
    return out
