"""Count the aten ops and host syncs a forward pass dispatches (a TorchDispatchMode).

On a GPU each aten op is at least one kernel launch, and a host sync drains the
stream; on this machine's CPU neither costs much, but both are counted here, so
the GPU shape of the code is checked where no GPU is. Ops are attributed to the
innermost of the named modules whose forward is running (a decoder layer's MoE
block, the layer, ...), or to "other".

A sync is an op whose output the host must read before it can go on: data-dependent
shapes (`nonzero`, `where(cond)`, `unique`, `masked_select`, indexing by a bool mask,
`repeat_interleave` without its size), a scalar read (`.item()`, `int(t)`, `bool(t)`:
`_local_scalar_dense`), a device-to-host copy, and ops whose CUDA kernels read their
input on the host (`bincount`; `histc` without a range). `.tolist()` and `.numpy()`
on a CPU tensor dispatch nothing and cannot be seen from here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {
    "nonzero",
    "_local_scalar_dense",
    "item",
    "is_nonzero",
    "equal",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "masked_select",
    "bincount",
    "_assert_async",
}
BOOL_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
SYNC_ALWAYS_IF = {"repeat_interleave": "output_size", "histc": "max"}


def op_name(func: Any) -> str:
    """`aten.nonzero.default` -> `nonzero`."""
    return str(func.overloadpacket.__name__)


def is_sync(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    name = op_name(func)
    if name in SYNC_OPS:
        return True
    if name in ("where", "nonzero_numpy"):  # where(cond): the indices where cond holds
        return len(args) + len(kwargs) == 1
    if name in BOOL_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in indices or ()
        )
    if name in SYNC_ALWAYS_IF:
        key = SYNC_ALWAYS_IF[name]
        if name == "histc":
            lo, hi = (
                kwargs.get("min", args[2] if len(args) > 2 else 0),
                kwargs.get("max", args[3] if len(args) > 3 else 0),
            )
            return bool(lo == hi)
        return kwargs.get(key) is None
    if name in ("_to_copy", "copy_"):  # device -> host
        src = args[1] if name == "copy_" else args[0]
        dst_dev = args[0].device if name == "copy_" else kwargs.get("device")
        return (
            isinstance(src, torch.Tensor)
            and src.device.type not in ("cpu", "meta")
            and dst_dev is not None
            and torch.device(dst_dev).type == "cpu"
        )
    return False


@dataclass
class Scope:
    ops: int = 0
    syncs: int = 0
    calls: int = 0  # forward calls of the module(s) of this scope
    by_op: Counter[str] = field(default_factory=Counter)
    sync_ops: Counter[str] = field(default_factory=Counter)


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, per scope."""

    def __init__(self) -> None:
        super().__init__()
        self.scopes: dict[str, Scope] = {"other": Scope()}
        self.stack: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        scope = self.scopes[self.stack[-1] if self.stack else "other"]
        name = op_name(func)
        scope.ops += 1
        scope.by_op[name] += 1
        if is_sync(func, args, kwargs):
            scope.syncs += 1
            scope.sync_ops[name] += 1
        return func(*args, **kwargs)

    @property
    def total_ops(self) -> int:
        return sum(s.ops for s in self.scopes.values())

    @property
    def total_syncs(self) -> int:
        return sum(s.syncs for s in self.scopes.values())

    @contextmanager
    def scoped(self, modules: dict[str, list[nn.Module]]) -> Iterator[OpCounter]:
        """Attribute ops to `modules` by scope name while their forward runs."""
        handles = []
        for name, mods in modules.items():
            self.scopes.setdefault(name, Scope())
            for m in mods:
                handles.append(m.register_forward_pre_hook(self._enter(name)))
                handles.append(m.register_forward_hook(self._leave(name)))
        try:
            with self:
                yield self
        finally:
            for h in handles:
                h.remove()

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(name)
            self.scopes[name].calls += 1

        return hook

    def _leave(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.stack.pop()

        return hook


def layer_scopes(layers: list[nn.Module]) -> dict[str, list[nn.Module]]:
    """A decoder stack's scopes: "moe" (each layer's MLP that has experts), "mlp"
    (the dense MLPs), "attention" and "layer" (the rest of a layer)."""
    moe: list[nn.Module] = []
    mlp: list[nn.Module] = []
    attn: list[nn.Module] = []
    for layer in layers:
        block = getattr(layer, "mlp", None)
        if block is not None:
            (moe if hasattr(block, "experts") else mlp).append(block)
        a = getattr(layer, "self_attn", None)
        if a is not None:
            attn.append(a)
    return {"layer": list(layers), "moe": moe, "mlp": mlp, "attention": attn}


def count_prefill(engine: Any, token_ids: list[int]) -> OpCounter:
    """Ops and syncs of one `PrefillEngine.prefill` of `token_ids`, by scope."""
    counter = OpCounter()
    with counter.scoped(layer_scopes(engine.layers)):
        engine.prefill(token_ids, lambda kv: None)
    return counter


def per_call(counter: OpCounter, scope: str) -> tuple[float, float]:
    """(ops, syncs) per forward call of `scope`'s modules (0, 0 if none ran)."""
    s = counter.scopes.get(scope)
    if s is None or not s.calls:
        return 0.0, 0.0
    return s.ops / s.calls, s.syncs / s.calls
