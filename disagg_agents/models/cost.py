"""What a forward pass costs, from a model's shape and a device's published figures:
a roofline model (time = the larger of FLOPs / throughput and bytes / bandwidth,
plus kernel launches and host syncs), not a measurement.

Pure Python (no torch, no mlx): the decode agent's placement uses `prior` as its
guess before it has measured any rate, and `disagg plan` builds its cost model of
the user's cluster on the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Device:
    name: str
    bandwidth: float  # bytes/s of the memory weights are read from
    flops: float  # dense bf16/fp16 matmul FLOP/s
    launch_s: float  # per kernel launch (an aten op on the GPU)
    sync_s: float  # per host sync: the queue drains, the host wakes, the next launch waits
    memory: float  # bytes
    source: str


# Every figure with its source. A GPU kernel launch costs a few microseconds (NVIDIA,
# "Getting Started with CUDA Graphs", 2019: launch overheads of a few us per kernel);
# a sync is modelled as a drained queue plus a round trip, a few launches' worth.
DEVICES = {
    "gb10": Device(
        "DGX Spark (GB10)",
        273e9,
        100e12,
        4e-6,
        20e-6,
        128e9,
        "128 GB, 273 GB/s LPDDR5x: NVIDIA DGX Spark spec. 100 TFLOP/s FP16: EXO Labs' figure "
        "(blog.exolabs.net/nvidia-dgx-spark), matching their measured 1.47 s prefill of "
        "Llama-3.1-8B FP16 at 8k; NVIDIA publishes 1 PFLOP FP4 with sparsity, which "
        "(/2 dense, /4 FP4->BF16) bounds dense BF16 at 125 TFLOP/s",
    ),
    "m3-ultra": Device(
        "Mac Studio (M3 Ultra)",
        819e9,
        26e12,
        4e-6,
        20e-6,
        256e9,
        "256 GB (as EXO's), 819 GB/s: Apple Mac Studio spec. ~26 TFLOP/s FP16 GPU: "
        "EXO Labs' figure (Apple publishes none), matching their measured 5.57 s "
        "prefill of Llama-3.1-8B FP16 at 8k",
    ),
    "h100-sxm": Device(
        "H100 SXM",
        3.35e12,
        989e12,
        4e-6,
        20e-6,
        80e9,
        "80 GB, 3.35 TB/s HBM3, 989 TFLOP/s dense BF16 (1,979 with sparsity): "
        "NVIDIA H100 SXM datasheet",
    ),
}
# Link rates in bytes/s (line rate; the model takes no protocol overhead off).
LINKS = {
    "10gbe": (10e9 / 8, "10 Gb/s Ethernet: the Mac Studio's port (Apple spec), EXO's setup"),
    "cx7-200g": (200e9 / 8, "ConnectX-7 200 Gb/s: the DGX Spark's QSFP ports (NVIDIA spec)"),
}
HANDSHAKE_S = 2e-3  # a prefill request's round trips on a LAN (a model guess)


@dataclass(frozen=True)
class Shape:
    """What the cost of a decoder forward depends on. Bits per weight count scales."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0  # 0: a dense MLP of width `inter`
    top_k: int = 0
    inter: int = 0  # expert (or dense MLP) width
    sliding_window: int | None = None
    sliding_layers: int = 0  # how many layers use the window
    expert_bits: float = 16.0
    attn_bits: float = 16.0  # attention projections
    embed_bits: float = 16.0  # embedding table and LM head
    act_bytes: int = 2  # compute dtype (bf16)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], bits: float = 16.0) -> Shape:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
        kinds = cfg.get("layer_types") or []
        return cls(
            layers=int(cfg["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=int(cfg["vocab_size"]),
            experts=experts,
            top_k=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            inter=inter,
            sliding_window=cfg.get("sliding_window") if "sliding_attention" in kinds else None,
            sliding_layers=sum(k == "sliding_attention" for k in kinds),
            expert_bits=bits,
            attn_bits=bits,
            embed_bits=bits,
        )

    # Parameters of one layer, by part.
    @property
    def attn_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden

    @property
    def expert_params(self) -> int:
        """One expert (or the dense MLP): gate, up [inter, hidden], down [hidden, inter]."""
        return 3 * self.hidden * self.inter

    @property
    def router_params(self) -> int:
        return self.hidden * self.experts


def matmul_flops_per_token(s: Shape) -> float:
    """2 x the weights one token multiplies by in every layer (its routed experts only)."""
    experts = s.top_k if s.experts else 1
    per_layer = s.attn_params + s.router_params + experts * s.expert_params
    return 2.0 * s.layers * per_layer


def attention_flops(s: Shape, tokens: int, context: int = 0) -> float:
    """Scores and weighted values (2 matmuls, 2 FLOPs per MAC) for `tokens` new tokens
    after `context` cached ones, causal; sliding layers attend to the window at most."""
    full = s.layers - s.sliding_layers
    # Token i (0-based) of the new ones attends to context + i + 1 positions.
    total = tokens * context + tokens * (tokens + 1) / 2
    slid = _windowed(context + 1, context + tokens, s.sliding_window) if s.sliding_layers else 0
    return 4.0 * s.heads * s.head_dim * (full * total + s.sliding_layers * slid)


def _windowed(a: int, b: int, window: int | None) -> float:
    """sum of min(p, window) for p in a..b: positions attended under a window."""
    if not window or b <= window:
        return (a + b) * (b - a + 1) / 2
    if a > window:
        return (b - a + 1) * window
    return (a + window) * (window - a + 1) / 2 + (b - window) * window


def prefill_flops(s: Shape, tokens: int, context: int = 0) -> float:
    """A prefill of `tokens` after `context`: matmuls, attention, the LM head on the
    last position only."""
    head = 2.0 * s.hidden * s.vocab
    return matmul_flops_per_token(s) * tokens + attention_flops(s, tokens, context) + head


def experts_hit(s: Shape, tokens: int) -> float:
    """Expected experts a layer routes `tokens` to, routing uniform: E(1-(1-k/E)^T)."""
    if not s.experts:
        return 1.0
    return s.experts * (1.0 - (1.0 - s.top_k / s.experts) ** tokens)


def total_params(s: Shape) -> dict[str, float]:
    """Parameters by how they are stored: quantized parts apart from 16-bit ones."""
    n_experts = s.experts or 1
    return {
        "attention": s.layers * s.attn_params,
        "router": s.layers * s.router_params,
        "experts": s.layers * n_experts * s.expert_params,
        "embeddings": 2.0 * s.hidden * s.vocab,  # table and LM head, untied
    }


def model_bytes(s: Shape, kept: bool = False) -> float:
    """Bytes the weights take: as stored, or with quantized ones dequantized (kept)."""
    bits = {"attention": s.attn_bits, "router": 16.0, "experts": s.expert_bits}
    bits["embeddings"] = s.embed_bits
    return sum(
        n * (s.act_bytes if kept or bits[k] >= 16 else bits[k] / 8)
        for k, n in total_params(s).items()
    )


MODES = ("kept", "packed", "fused")


def weight_bytes(s: Shape, tokens: int, mode: str = "kept") -> dict[str, float]:
    """Bytes of weights one prefill forward reads, and the bytes it dequantizes.

    mode "kept": quantized weights were dequantized at load (read in the compute
    dtype, none dequantized per forward); "packed": read packed, and (our torch
    prefill, with no fused kernel) every quantized weight of a layer dequantized into
    the compute dtype, written and read back once per forward; "fused": read packed
    by kernels that dequantize in registers (mlx's quantized matmuls)."""
    act = float(s.act_bytes)
    hit = experts_hit(s, tokens)
    n_experts = s.experts or 1
    parts = {  # (params read, bits stored)
        "attention": (s.layers * s.attn_params, s.attn_bits),
        "router": (s.layers * s.router_params, 16.0),
        "experts": (s.layers * hit * s.expert_params, s.expert_bits),
        "head": (s.hidden * s.vocab, s.embed_bits),
    }
    read = dequant = 0.0
    for name, (params, bits) in parts.items():
        if bits >= 16 or mode == "kept":
            read += params * (act if bits < 16 else bits / 8)
            continue
        read += params * bits / 8
        if mode == "packed":  # all experts of a layer (one batched op), not only the hit
            full = s.layers * n_experts * s.expert_params if name == "experts" else params
            dequant += full * act
    return {"read": read + 2 * dequant, "weights_read": read, "dequantized": dequant}


def kv_bytes(s: Shape, tokens: int, context: int = 0) -> float:
    """K/V bytes one prefill of `tokens` sends: full layers all of them, sliding
    layers at most the window's worth."""
    per_layer_token = 2.0 * s.kv_heads * s.head_dim * s.act_bytes
    full = (s.layers - s.sliding_layers) * tokens
    slid = s.sliding_layers * min(tokens, s.sliding_window or tokens)
    return per_layer_token * (full + slid)


def roofline_s(flops: float, nbytes: float, d: Device, ops: float = 0, syncs: float = 0) -> float:
    """max(compute, memory) + launches + syncs, in seconds."""
    return max(flops / d.flops, nbytes / d.bandwidth) + ops * d.launch_s + syncs * d.sync_s


def decode_step_s(s: Shape, context: int, d: Device) -> float:
    """One decode token: the routed weights read packed (mlx reads packed weights in
    its quantized matmuls) plus the K/V read, at the device's bandwidth."""
    experts = s.top_k if s.experts else 1
    per_layer = (
        s.attn_params * s.attn_bits / 8
        + s.router_params * 2
        + experts * s.expert_params * s.expert_bits / 8
    )
    weights = s.layers * per_layer + s.hidden * s.vocab * s.embed_bits / 8
    kv = kv_bytes(s, context) if context else 0.0
    return roofline_s(2 * weights, weights + kv, d)


@dataclass(frozen=True)
class Prior:
    """Rates the placement guesses before it measures: prefill tokens/s of the remote
    prefill device and of this (decode) device, K/V bytes per layer and token, the link."""

    remote_tokens_per_s: float
    local_tokens_per_s: float
    layer_bytes_per_token: float
    link_bytes_per_s: float
    handshake_s: float = HANDSHAKE_S


def spark_mode(s: Shape, d: Device) -> str:
    """Our prefill's load-time choice: dequantized and kept if it fits with a quarter
    of the memory to spare (disagg_agents.quant.budget), else packed."""
    return "kept" if model_bytes(s, kept=True) <= 0.75 * d.memory else "packed"


def prefill_tokens_per_s(s: Shape, d: Device, mode: str, tokens: int = 2048) -> float:
    """Roofline prefill rate of a `tokens`-token prompt on `d`."""
    nbytes = weight_bytes(s, tokens, mode)["read"] + kv_bytes(s, tokens)
    return tokens / roofline_s(prefill_flops(s, tokens), nbytes, d)


def prior(
    cfg: dict[str, Any],
    prefill_device: str = "gb10",
    decode_device: str = "m3-ultra",
    link: str = "10gbe",
    bits: float = 16.0,
) -> Prior:
    """The placement's prior for a model config (HF config.json as a dict)."""
    s = Shape.from_config(cfg, bits)
    remote_dev = DEVICES[prefill_device]
    remote = prefill_tokens_per_s(s, remote_dev, spark_mode(s, remote_dev))
    # The decode host prefills with mlx, reading packed weights in its quantized matmuls.
    local = prefill_tokens_per_s(s, DEVICES[decode_device], "fused")
    return Prior(remote, local, kv_bytes(s, 1) / s.layers, LINKS[link][0])
