"""The prefill engine: one loaded model whose forward pass hands each layer's
K/V to a callback as soon as that layer is computed."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from disagg_agents.models import get_adapter, layer_kinds_from_hf, load_hf_config
from disagg_agents.prefill.attention import use_chunked_attention
from disagg_agents.prefill.hostcopy import HostCopies
from disagg_agents.prefill.prefixcache import PrefillPrefixCache
from disagg_agents.prefill.queue import Dropped, FairQueue
from disagg_agents.quant import check_supported, weights_identity
from disagg_agents.quant.paths import DeviceFacts, log_slow, moe_paths
from disagg_agents.runtime.torchshare import TorchShare
from disagg_agents.wire.kvcodec import (
    DTYPE_NAMES,
    Kind,
    LayerKV,
)

log = logging.getLogger("disagg.prefill")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> str:
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def pick_dtype(name: str, cfg: dict[str, Any]) -> str:
    if name != "auto":
        return name
    stored = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return stored if stored in TORCH_DTYPES else "float32"


def to_wire(t: torch.Tensor) -> np.ndarray:
    """[1, H, S, D] cache tensor -> [H, S, D] numpy in the wire dtype."""
    t = t[0].contiguous()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)  # raw bf16 words
    return t.numpy()


class PrefillEngine:
    """One loaded model; `prefill` streams K/V layer by layer through a callback."""

    def __init__(
        self,
        model_dir: str,
        device: str = "auto",
        dtype: str = "auto",
        dequant_budget_gb: float | None = None,
    ) -> None:
        self.model_dir = model_dir
        check_supported(model_dir)
        self.cfg = load_hf_config(model_dir)
        self.adapter = get_adapter(self.cfg["model_type"])
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.cfg)
        self.packed_bytes = 0  # quantized weights read, as packed (0: full precision)
        self.kept_bytes = 0  # of them, dequantized once at load and kept
        self.model = self._load(dequant_budget_gb).eval()
        from disagg_agents.quant.modules import warm_experts

        # The MoE kernels compiled now (a failure said once, its layers falling back);
        # then each layer's GEMM path on this device, a slower one than the best saying why.
        warm_experts(self.model, torch.device(self.device))
        self.moe_paths = moe_paths(self.model, DeviceFacts.of(self.device))
        log_slow(self.moe_paths)
        # Fused attention kernels only (disagg_agents.prefill.attention): transformers'
        # eager gpt-oss holds [heads, n, n] scores (~8.6 GB a layer at 8k tokens), its
        # SDPA a [q, kv] mask for a cached prefix, and nothing stops the math backend.
        use_chunked_attention(self.model)
        # The decoder stack without the LM head: prefill never needs logits.
        self.body = getattr(self.model, self.model.base_model_prefix)
        self.head = self.model.get_output_embeddings()
        self.layers = list(self.body.layers)
        self.kinds = layer_kinds_from_hf(self.cfg)
        self.fingerprint = {
            "architecture": self.cfg["model_type"],
            "num_layers": len(self.layers),
            "num_kv_heads": self.adapter.num_kv_heads(self.cfg),
            "head_dim": self.adapter.head_dim(self.cfg),
            "dtype": self.dtype,
            "layers": self.kinds,
            "weights": weights_identity(model_dir),
        }
        # K/V copied off a CUDA device on a side stream while the next layer computes.
        self.copies = HostCopies.for_device(self.device)
        self.slots = FairQueue()  # one forward pass at a time per device, fairly
        self.share = TorchShare.from_env()

    def _load(self, dequant_budget_gb: float | None) -> Any:
        """The model on its device: transformers' own, or the packed loader's for
        checkpoints transformers cannot read."""
        from transformers import AutoModelForCausalLM  # heavy: import once the args parsed

        from disagg_agents.quant.budget import dequant_budget
        from disagg_agents.quant.formats import weight_files
        from disagg_agents.quant.loader import load_packed_model, needs_packed_loader
        from disagg_agents.quant.modules import plain_experts

        model_dir, dtype = self.model_dir, TORCH_DTYPES[self.dtype]
        if needs_packed_loader(model_dir, self.cfg):
            # transformers cannot read these; weights packed, or dequantized at load
            # where the device's memory allows (disagg_agents.quant.budget).
            size = sum(f.stat().st_size for f in weight_files(model_dir))
            budget = dequant_budget(self.device, size, dequant_budget_gb)
            fused = DeviceFacts.of(self.device).fused  # experts read as stored
            model, self.packed_bytes, self.kept_bytes = load_packed_model(
                model_dir, self.cfg, dtype, self.device, budget, experts_packed=fused
            )
            return model
        # MoE experts as grouped GEMMs (transformers' "grouped_mm"): no host syncs.
        moe = "num_experts" in self.cfg or "num_local_experts" in self.cfg
        extra = {"experts_implementation": "grouped_mm"} if moe else {}
        loaded: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **extra)
        model = loaded.to(self.device)
        if moe:  # the Triton kernels where transformers' grouped_mm would loop
            kind, dev = self.cfg["model_type"], torch.device(self.device)
            plain_experts(model, kind, dev, dtype)
        return model

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: list[int],
        on_layer: Callable[[LayerKV], None],
        start: int = 0,
        prefix: PrefillPrefixCache | None = None,
        after: list[Callable[[], None]] | None = None,
        salt: str | None = None,
        *,
        host_async: bool = False,
        cores_busy: bool = False,
        gone: Callable[[], bool] | None = None,
        deadline: float | None = None,
    ) -> tuple[dict[str, Any], np.ndarray]:
        """Run the prompt; call `on_layer` with each layer's K/V the moment it exists.

        Only positions from `start` on are sent (the decode side holds the rest).
        With `prefix`, a cached prefix of the prompt is not computed again, and
        the prompt's blocks are kept: at once, or by a call appended to `after`
        for the caller to make once the K/V and logits are out. With `host_async`
        on a CUDA device, the layers handed over may still be in flight: their
        reader calls `LayerKV.wait` first (LayerSender does). `cores_busy`: the
        requester decodes on this machine's cores (disagg_agents.runtime.torchshare).
        `gone()` (the requester hung up; asked again after each layer) or `deadline`
        (monotonic) passed before its turn: queue.Dropped, the rest not computed.
        Returns timings and the float32 logits of the last position, from which
        the decode side samples the first token without running a step itself.
        """
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        total = len(token_ids)
        marks: dict[str, float] = {}
        hook = self._hand_over(cache, total - start, on_layer, host_async, marks, gone)

        # The queue's cost: what is left to compute once a cached prefix is seeded.
        cost = total - (prefix.expected_hit(token_ids, salt) if prefix else 0)
        # Hooks are per module, shared by all requests: add them only in the slot.
        # Nothing here waits on a socket: `on_layer` only queues (LayerSender.put).
        with (
            self.slots.slot(cost, gone, deadline) as queue_s,  # behind other prompts
            self.share.threads(cores_busy) as threads,
        ):
            keys, cached, logits, compute_s = self._forward(token_ids, cache, prefix, salt, hook)
            if prefix:
                save = prefix.saver(keys, cache)
                save() if after is None else after.append(save)
        stats = {
            "prefill_time": compute_s,
            "queue_time": queue_s,
            "tokens": len(token_ids),
            "start": start,
            "cached_tokens": cached,
            "threads": threads,
            **marks,
        }
        return stats, logits.numpy()

    def _forward(
        self,
        token_ids: list[int],
        cache: Any,
        prefix: PrefillPrefixCache | None,
        salt: str | None,
        hook: Callable[[int], Any],
    ) -> tuple[list[bytes], int, torch.Tensor, float]:
        """The prompt past a cached prefix through the body, `hook(i)` on layer i
        meanwhile: the prefix's block keys, its length, the last position's float32
        logits ([vocab], on the host) and the compute time."""
        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(self.layers)]
        try:
            t0 = time.perf_counter()
            keys, cached = prefix.seed(cache, token_ids, salt) if prefix else ([], 0)
            ids = torch.tensor([token_ids[cached:]], device=self.device)
            out = self.body(input_ids=ids, past_key_values=cache, use_cache=True)
            # [1, S, hidden] -> the LM head on the last position only: [vocab]
            logits = self.head(out.last_hidden_state[:, -1:, :])[0, -1].float().cpu()
            return keys, cached, logits, time.perf_counter() - t0
        finally:
            for h in handles:
                h.remove()

    def _hand_over(
        self,
        cache: Any,
        send: int,
        on_layer: Callable[[LayerKV], None],
        host_async: bool,
        marks: dict[str, float],
        gone: Callable[[], bool] | None = None,
    ) -> Callable[[int], Callable[..., None]]:
        """Forward hooks, by layer index, that hand each layer's last `send`
        positions of K/V to `on_layer` as soon as the layer has run, and stop the
        forward (queue.Dropped) once `gone()` says its requester hung up."""
        wire = DTYPE_NAMES[self.dtype]
        copies = self.copies if host_async else None

        def hook(idx: int) -> Callable[..., None]:
            def _after_layer(module: Any, args: Any, output: Any) -> None:
                layer: Any = cache.layers[idx]
                kind = Kind.SLIDING if self.kinds[idx][0] == "sliding" else Kind.FULL
                # [1, H, S, D]: a sliding layer holds only the prompt's last S positions.
                keep = min(layer.keys.shape[2], send)
                keys, values = layer.keys[:, :, -keep:], layer.values[:, :, -keep:]
                if copies is not None:
                    (k, v), ready = copies.copy((keys, values))
                    on_layer(LayerKV(idx, kind, wire, k, v, ready=ready))
                else:
                    on_layer(LayerKV(idx, kind, wire, to_wire(keys), to_wire(values)))
                if idx == len(self.layers) - 1:
                    marks["last_layer_at"] = time.time()
                elif gone is not None and gone():  # a poll, no device sync
                    raise Dropped("gone", f"prefill stopped after layer {idx}")

            return _after_layer

        return hook
