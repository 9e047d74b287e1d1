"""Load a quantized (or mlx-converted) checkpoint into the transformers model the
prefill agent runs, keeping the weights packed.

transformers cannot read these dirs (MLX affine's `quantization_config` has no
`quant_method`; OpenAI's MXFP4 would be dequantized to bf16 off-GPU), so: build the
model with its parameters on the meta device (no full-precision allocation), then
read each tensor straight from the safetensors files into its place, packed where
it is quantized. Names follow mlx-lm's loader, so both sides compute one function:
- llama/qwen3 Linears and embeddings: the same names on both sides;
- qwen3_moe: experts stacked as `mlp.switch_mlp.{gate,up,down}_proj` (mlx-lm's
  sanitize output), the router `mlp.gate` (8-bit by mlx-lm's default predicate);
- gpt_oss, mlx-converted: `mlp.experts.{gate,up,down}_proj.{weight,scales,bias}`;
- gpt_oss, OpenAI MXFP4: `mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}`,
  gate/up interleaved by rows, split as mlx-lm's sanitize does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models.base import UnsupportedModel
from .dequant import FP_MODES, Packed, QSpec
from .formats import mlx_quantization, read_header, weight_files
from .modules import PackedExperts, PackedWeightHook, QuantEmbedding, QuantLinear

ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U32": torch.uint32,
    "BOOL": torch.bool,
}
EXPERTS = re.compile(
    r"^(?P<layer>.*\.mlp)\.(?:switch_mlp|experts)\."
    r"(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)(?P<part>_blocks|_scales|_bias|\..+)$"
)


class Checkpoint:
    """Every tensor of a dir's safetensors files, read on demand with plain file
    reads into fresh tensors (no mmap: the page cache does not count as ours)."""

    def __init__(self, model_dir: Path) -> None:
        self.where: dict[str, tuple[Path, int, dict[str, Any]]] = {}
        for file in weight_files(model_dir):
            header, start = read_header(file)
            for name, entry in header.items():
                if name != "__metadata__":
                    self.where[name] = (file, start, entry)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def names(self) -> list[str]:
        return list(self.where)

    def read(self, name: str) -> torch.Tensor:
        file, start, entry = self.where[name]
        begin, end = entry["data_offsets"]
        dtype = ST_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise UnsupportedModel(f"{file}: tensor {name} has dtype {entry['dtype']}")
        buf = torch.empty(end - begin, dtype=torch.uint8)
        with open(file, "rb") as f:
            f.seek(start + begin)
            if f.readinto(buf.numpy()) != end - begin:  # type: ignore[arg-type]
                raise UnsupportedModel(f"{file} is truncated at tensor {name}")
        return buf.view(dtype).reshape(entry["shape"])


def hf_config(cfg: dict[str, Any], dtype: torch.dtype) -> Any:
    """A transformers config from the dir's config.json, without the quantization
    entries that make transformers refuse it."""
    from transformers import AutoConfig

    clean = {k: v for k, v in cfg.items() if k not in ("quantization", "quantization_config")}
    model_type = clean.pop("model_type")
    config = AutoConfig.for_model(model_type, **clean)
    config.dtype = dtype
    return config


class PackedLoader:
    """`keep_budget`: bytes the weights may grow by when dequantized at load (kept),
    weight by weight in load order (disagg_agents.quant.budget); the rest stay packed.
    A layer's gate and up are kept or packed together (the fused kernel reads both
    in one form). `experts_packed`: the fused MoE kernel runs on the device and
    reads experts as stored, so experts it reads are never kept (3.5x the bytes per
    forward in bf16, and ~61 GB instead of ~17 GB for Qwen3-Coder 4-bit)."""

    def __init__(
        self,
        model_dir: Path,
        cfg: dict[str, Any],
        dtype: torch.dtype,
        device: str,
        keep_budget: int = 0,
        experts_packed: bool = False,
    ):
        self.experts_packed = experts_packed
        self.dir, self.cfg, self.dtype, self.device = model_dir, cfg, dtype, device
        self.ckpt = Checkpoint(model_dir)
        self.quant = mlx_quantization(cfg) or {}
        self.hf_mxfp4 = (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"
        self.used: set[str] = set()
        self.packed_bytes = 0  # of the quantized weights read, as packed
        self.kept_bytes = 0  # of the weights dequantized at load and kept
        self.keep_left = keep_budget

    def _hold(self, *ps: Packed, keep: bool = True) -> None:
        """Keep all of `ps` dequantized if `keep` and the budget allows them all
        (else none), and count what is held."""
        self.packed_bytes += sum(p.nbytes for p in ps)
        grow = sum(p.full_nbytes - p.nbytes for p in ps)
        if keep and grow <= self.keep_left:
            self.keep_left -= grow
            for p in ps:
                p.keep()
                self.kept_bytes += p.nbytes

    def _hold_experts(self, *ws: Packed | torch.Tensor) -> None:
        """Gate and up (or down) of one layer: as one; packed where the fused kernel
        runs and reads them (else a form only the other paths read: kept by budget)."""
        ps = [w for w in ws if isinstance(w, Packed)]
        if not ps:
            return
        if self.experts_packed:
            from .moe_triton import stored

            self._hold(*ps, keep=any(stored(p) is None for p in ps))
        else:
            self._hold(*ps)

    def take(self, name: str) -> torch.Tensor:
        self.used.add(name)
        return self.ckpt.read(name)

    def plain(self, name: str) -> torch.Tensor:
        t = self.take(name)
        return (t.to(self.dtype) if t.is_floating_point() else t).to(self.device)

    def spec_for(self, path: str, n_in: int) -> QSpec:
        """As mlx-lm's class_predicate: the per-module override, else from the shapes."""
        if self.hf_mxfp4:
            return QSpec("mxfp4", 4, 32)
        override = self.quant.get(path)
        if isinstance(override, dict):
            mode = override.get("mode", self.quant.get("mode", "affine"))
            return QSpec(mode, int(override["bits"]), int(override["group_size"]))
        scales = self.ckpt.where[f"{path}.scales"][2]
        words = self.ckpt.where[f"{path}.weight"][2]["shape"][-1]
        group, bits = n_in // scales["shape"][-1], words * 32 // n_in
        if scales["dtype"] != "U8":
            return QSpec("affine", bits, group)
        for mode, fit in FP_MODES.items():
            if fit == (bits, group):
                return QSpec(mode, bits, group)
        raise UnsupportedModel(f"{self.dir}: cannot tell how {path} is quantized")

    def packed(self, path: str, n_in: int, hold: bool = True) -> Packed:
        spec = self.spec_for(path, n_in)
        biases = self.take(f"{path}.biases") if f"{path}.biases" in self.ckpt else None
        p = Packed(
            self.take(f"{path}.weight"), self.take(f"{path}.scales"), biases, spec, n_in, self.dtype
        ).to(self.device)
        if hold:
            self._hold(p)
        return p

    def experts_weight(self, prefix: str, n_in: int) -> Packed | torch.Tensor:
        if f"{prefix}.scales" in self.ckpt:
            return self.packed(prefix, n_in, hold=False)
        return self.plain(f"{prefix}.weight")

    def load_experts(self, model: nn.Module, layer: str) -> None:
        """Replace `<layer>.experts` with PackedExperts from either expert layout."""
        cfg, kind = self.cfg, self.cfg["model_type"]
        hidden = int(cfg["hidden_size"])
        if kind == "qwen3_moe":
            inter, n_exp = (
                int(cfg["moe_intermediate_size"]),
                int(cfg.get("num_experts") or cfg["num_local_experts"]),
            )
        else:
            inter, n_exp = int(cfg["intermediate_size"]), int(cfg["num_local_experts"])
        biases = None
        gate: Packed | torch.Tensor
        up: Packed | torch.Tensor
        down: Packed | torch.Tensor
        if f"{layer}.experts.gate_up_proj_blocks" in self.ckpt:  # OpenAI's MXFP4 layout
            gate, up, gate_b, up_b = self._split_gate_up(f"{layer}.experts", hidden)
            down = self._hf_blocks(f"{layer}.experts.down_proj", inter)
            self._hold_experts(gate, up)
            self._hold_experts(down)
            biases = (gate_b, up_b, self.plain(f"{layer}.experts.down_proj_bias"))
        else:
            base = f"{layer}.switch_mlp" if kind == "qwen3_moe" else f"{layer}.experts"
            gate = self.experts_weight(f"{base}.gate_proj", hidden)
            up = self.experts_weight(f"{base}.up_proj", hidden)
            down = self.experts_weight(f"{base}.down_proj", inter)
            self._hold_experts(gate, up)
            self._hold_experts(down)
            if f"{base}.gate_proj.bias" in self.ckpt:
                biases = tuple(
                    self.plain(f"{base}.{p}.bias") for p in ("gate_proj", "up_proj", "down_proj")
                )  # type: ignore[assignment]
        old: Any = model.get_submodule(f"{layer}.experts")
        new = PackedExperts(
            kind,
            gate,
            up,
            down,
            n_exp,
            self.dtype,
            biases,
            act=getattr(old, "act_fn", None),
            alpha=float(getattr(old, "alpha", 1.702)),
            limit=float(getattr(old, "limit", 7.0)),
        )
        model.get_submodule(layer).experts = new

    def _hf_blocks(self, prefix: str, n_in: int, rows: slice = slice(None)) -> Packed:
        blocks = self.take(f"{prefix}_blocks")  # [E, out, G, 16] uint8
        scales = self.take(f"{prefix}_scales")  # [E, out, G] E8M0
        blocks = blocks.reshape(*blocks.shape[:2], -1)[:, rows].contiguous()
        return Packed(
            blocks, scales[:, rows].contiguous(), None, QSpec("mxfp4", 4, 32), n_in, self.dtype
        ).to(self.device)

    def _split_gate_up(self, prefix: str, hidden: int) -> tuple[Packed, Packed, Any, Any]:
        # Rows interleave gate and up, as mlx-lm's sanitize splits them: ::2 and 1::2.
        gate = self._hf_blocks(f"{prefix}.gate_up_proj", hidden, slice(0, None, 2))
        up = self._hf_blocks(f"{prefix}.gate_up_proj", hidden, slice(1, None, 2))
        bias = self.plain(f"{prefix}.gate_up_proj_bias")
        return gate, up, bias[:, ::2].contiguous(), bias[:, 1::2].contiguous()

    def load(self) -> nn.Module:
        from transformers import AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        config = hf_config(self.cfg, self.dtype)
        # Everything on the meta device: even an untouched torch.empty of the
        # embedding costs resident pages here. Buffers are rebuilt below.
        with torch.device("meta"), no_init_weights():
            model: Any = AutoModelForCausalLM.from_config(config, dtype=self.dtype)
        model.eval()
        self._rebuild_buffers(model)
        names = self.ckpt.names()
        layers = sorted({m["layer"] for n in names if (m := EXPERTS.match(n))})
        for layer in layers:
            self.load_experts(model, layer)
        for name in names:
            if name in self.used or not name.endswith(".scales"):
                continue
            path = name[: -len(".scales")]
            self._load_quantized(model, path)
        for name in names:
            if name not in self.used:
                self._load_plain(model, name)
        self._tie_head(model)
        missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        if missing:
            raise UnsupportedModel(
                f"{self.dir}: the checkpoint lacks {', '.join(missing[:3])}"
                f"{' ...' if len(missing) > 3 else ''} for transformers' {self.cfg['model_type']}"
            )
        return model

    def _rebuild_buffers(self, model: nn.Module) -> None:
        """Buffers made on the meta device (RoPE's inv_freq): build their module
        again for real; it computes them from the config."""
        for name, mod in list(model.named_modules()):
            if not any(b is not None and b.is_meta for b in mod._buffers.values()):
                continue
            config = getattr(mod, "config", None)
            if config is None or "rotary" not in type(mod).__name__.lower():
                raise UnsupportedModel(
                    f"{self.dir}: cannot build {name} ({type(mod).__name__}) without its weights"
                )
            parent, _, leaf = name.rpartition(".")
            with torch.device(self.device):
                setattr(model.get_submodule(parent), leaf, type(mod)(config))

    def _module(self, model: nn.Module, path: str) -> nn.Module:
        try:
            return model.get_submodule(path)
        except AttributeError:
            raise UnsupportedModel(
                f"{self.dir}: {path} has no place in transformers' {self.cfg['model_type']}"
            ) from None

    def _load_quantized(self, model: nn.Module, path: str) -> None:
        mod = self._module(model, path)
        weight = mod._parameters.get("weight")
        if weight is None:
            raise UnsupportedModel(f"{self.dir}: {path} is quantized but has no weight")
        packed = self.packed(path, int(weight.shape[-1]))
        parent, _, leaf = path.rpartition(".")
        if isinstance(mod, nn.Linear):
            bias = self.plain(f"{path}.bias") if f"{path}.bias" in self.ckpt else None
            setattr(self._module(model, parent), leaf, QuantLinear(packed, bias))
        elif isinstance(mod, nn.Embedding):
            setattr(self._module(model, parent), leaf, QuantEmbedding(packed))
        else:  # routers: their own forward reads self.weight
            PackedWeightHook(mod, packed)

    def _load_plain(self, model: nn.Module, name: str) -> None:
        path, _, leaf = name.rpartition(".")
        mod = self._module(model, path)
        if leaf not in mod._parameters:
            raise UnsupportedModel(
                f"{self.dir}: tensor {name} has no place in transformers' {self.cfg['model_type']}"
            )
        mod._parameters[leaf] = nn.Parameter(self.plain(name), requires_grad=False)

    def _tie_head(self, model: Any) -> None:
        head = model.get_output_embeddings()
        emb = model.get_input_embeddings()
        if head is None or "lm_head.weight" in self.ckpt or "lm_head.scales" in self.ckpt:
            return
        if isinstance(emb, QuantEmbedding):
            # The tied head is the quantized embedding: mlx-lm's `as_linear`.
            model.lm_head = QuantLinear(emb.packed)
        else:
            head.weight = emb.weight


def load_packed_model(
    model_dir: str | Path,
    cfg: dict[str, Any],
    dtype: torch.dtype,
    device: str,
    keep_budget: int = 0,
    experts_packed: bool = False,
) -> tuple[nn.Module, int, int]:
    """The transformers model for `model_dir` with quantized weights held packed, or
    dequantized at load within `keep_budget` bytes of growth (MoE experts the fused
    kernel reads never, with `experts_packed`); the bytes of its quantized weights
    as packed, and of those kept dequantized. Raises UnsupportedModel."""
    loader = PackedLoader(Path(model_dir), cfg, dtype, device, keep_budget, experts_packed)
    return loader.load(), loader.packed_bytes, loader.kept_bytes


def needs_packed_loader(model_dir: str | Path, cfg: dict[str, Any]) -> bool:
    """Quantized, or already in mlx-lm's layout (which transformers cannot read)."""
    if mlx_quantization(cfg) is not None:
        return True
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        names = list(json.loads(index.read_text()).get("weight_map", {}))
    else:
        names = [n for f in weight_files(model_dir) for n in read_header(f)[0]]
    return any(".switch_mlp." in n or n.endswith("experts.gate_proj.weight") for n in names)
