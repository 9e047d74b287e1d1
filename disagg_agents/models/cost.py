"""What a forward pass costs, from a model's shape and a device's published figures:
FLOPs, bytes and K/V from the shapes; time from each device's nominal peak times an
efficiency fitted to published whole-model measurements (EFFICIENCY: llama.cpp on
the DGX Spark, mlx-lm on the Macs, EXO's fp16 runs), the larger of compute and
memory, plus what each MoE path adds (copies, dequantization, launches, syncs). A
model, not a measurement.

Pure Python (no torch, no mlx): the decode agent's placement uses `prior` as its
guess before it has measured any rate, and `disagg plan` (disagg.bench.costmodel:
the published points and the fit) builds its table on the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .moecost import PROPS, Pick, kernel_efficiency, kernel_tiles, layer_s, layer_traffic


@dataclass(frozen=True)
class Device:
    name: str
    bandwidth: float  # bytes/s of the memory weights are read from
    flops: float  # dense bf16/fp16 matmul FLOP/s (nominal: the fitted efficiencies scale it)
    launch_s: float  # per kernel launch (an aten op on the GPU)
    sync_s: float  # per host sync: the queue drains, the host wakes, the next launch waits
    memory: float  # bytes
    source: str
    grouped_mm_fast: bool = False  # torch's fast grouped_mm kernel runs here (sm90 / sm100)
    arch: str = ""  # CUDA architecture family ("sm90", "sm121"): which kernel figures apply


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
        "128 GB, 273 GB/s LPDDR5x: NVIDIA DGX Spark spec. 100 TFLOP/s FP16: EXO Labs' "
        "figure (blog.exolabs.net/nvidia-dgx-spark). Compute capability 12.1: torch's "
        "fast grouped_mm kernel (sm90/sm100) does not run",
        arch="sm121",
    ),
    "m3-ultra": Device(
        "Mac Studio (M3 Ultra)",
        819e9,
        26e12,
        4e-6,
        20e-6,
        256e9,
        "256 GB (as EXO's), 819 GB/s: Apple Mac Studio spec. ~26 TFLOP/s FP16 GPU: "
        "EXO Labs' figure (Apple publishes none)",
    ),
    "m4-max": Device(
        "Mac Studio (M4 Max)",
        546e9,
        18.4e12,
        4e-6,
        20e-6,
        128e9,
        "128 GB, 546 GB/s: Apple Mac Studio (M4 Max, 40-core GPU) spec. ~18.4 TFLOP/s: "
        "40 cores x 128 ALUs x 2 FLOP x 1.8 GHz (Apple publishes none; the fitted "
        "efficiencies absorb the choice)",
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
        grouped_mm_fast=True,
        arch="sm90",
    ),
    "h200": Device(
        "H200",
        4.8e12,
        989e12,
        4e-6,
        20e-6,
        141e9,
        "141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s dense BF16: NVIDIA H200 datasheet (the "
        "H100's compute); the one lent on 2026-11-27 ran the fused MoE kernel",
        grouped_mm_fast=True,
        arch="sm90",
    ),
}


@dataclass(frozen=True)
class Efficiency:
    """How much of a device's nominal figures the engine that runs there reaches, by
    model class, fitted to published whole-model measurements (the points and the fit:
    disagg.bench.costmodel; tests/test_costmodel.py refits them and checks these)."""

    dense: float  # of peak FLOP/s: a dense model's prefill matmuls
    moe: float  # of peak FLOP/s: an MoE model's prefill matmuls (experts, router, projections)
    score_ps: float  # picoseconds per attention score (one head x one query x one key)
    decode_dense: float  # of bandwidth: one decode step of a dense model
    decode_moe: float
    source: str


# Fitted by disagg.bench.costmodel.fit() (rounded); each field's points in `source`.
EFFICIENCY = {
    "gb10": Efficiency(
        dense=0.977,
        moe=0.176,
        score_ps=8.72,
        decode_dense=0.806,
        decode_moe=0.902,
        source="MoE prefill, attention: llama.cpp pp2048 at depths 0-32k, gpt-oss-120b "
        "MXFP4 and Qwen3-Coder-30B-A3B Q8_0 (ggml-org/llama.cpp benches/dgx-spark.md, "
        "build 2f68ce7cf); dense prefill: EXO's Spark prefill of Llama-3.1-8B FP16 at "
        "8k, 1.47 s; decode: the same llama.cpp file's tg32 (Qwen2.5-Coder-7B Q8_0; "
        "the MoE pair)",
    ),
    "m3-ultra": Efficiency(
        dense=0.886,
        moe=0.377,
        score_ps=17.7,
        decode_dense=0.615,
        decode_moe=0.4,
        source="MoE prefill, attention: gpt-oss-120b 8-bit prefill times at 4.3k-25k "
        "tokens (ml-explore/mlx-lm issue 432, mlx-lm 0.27); dense prefill: EXO's M3 "
        "Ultra prefill of Llama-3.1-8B FP16 at 8k, 5.57 s; decode: 60 tok/s in issue "
        "432 (MoE), Llama-3.1-8B 4-bit 119 tok/s (raullenchai/Rapid-MLX PR 586, mlx 0.31)",
    ),
    "m4-max": Efficiency(
        dense=0.886,
        moe=0.547,
        score_ps=25.0,
        decode_dense=0.615,
        decode_moe=0.4,
        source="MoE prefill: mlx-lm pp2048, Qwen3-30B-A3B 4-bit 1,732 and GPT-OSS-20B "
        "4-bit 1,589 tok/s (ml-explore/mlx-lm PR 406, M4 Max); dense prefill, decode: "
        "the M3 Ultra's (no published M4 Max figure found); attention: the M3 Ultra's "
        "x 26/18.4",
    ),
}
# Link rates in bytes/s as measured (TCP goodput), not line rate.
LINKS = {
    "10gbe": (
        1.1e9,
        "10 GbE: ~9.4 Gb/s TCP goodput at MTU 1500 (~1.1 GB/s, issue 44's measured "
        "figure); the Spark's and the Mac Studio's RJ45 ports, EXO's setup",
    ),
    "tb5": (
        5.0e9,
        "Thunderbolt 5 IP link: 80 Gb/s per direction (USB4 v2); taken at half the line "
        "rate as Thunderbolt networking measures (16.4 Gb/s TCP on a 20/40 Gb/s "
        "USB4 link, jiribrejcha.net); no Spark-to-Mac measurement published",
    ),
    "cx7-200g": (
        200e9 / 8,
        "ConnectX-7 200 Gb/s: the DGX Spark's QSFP ports (NVIDIA spec), line rate",
    ),
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
    """max(compute, memory) + launches + syncs, in seconds, at nominal peak."""
    return max(flops / d.flops, nbytes / d.bandwidth) + ops * d.launch_s + syncs * d.sync_s


def score_elements(s: Shape, tokens: int, context: int = 0) -> float:
    """Attention scores (head x query x key) of `tokens` new tokens after `context`."""
    return attention_flops(s, tokens, context) / (4.0 * s.head_dim)


# The MoE paths our prefill can take on a CUDA device; the Macs run mlx's.
MOE_PATHS = ("triton", "grouped", "blocked")
MACS = ("m3-ultra", "m4-max")
BLOCK_ROWS = 64  # disagg_agents.quant.moe.BLOCK: rows per expert block
# Bytes per weight dequantized by today's torch path: int32 codes and bf16 values,
# each written and read back once (issue 44's reading of disagg_agents/quant).
DEQUANT_BYTES = 12.0
EAGER_PASSES = 4  # eager attention: scores written, read by softmax, written, read by PV


def moe_blocks(s: Shape, tokens: int) -> float:
    """Row blocks of one MoE layer: the upper bound the blocked layout sizes to
    (pairs + experts x (block - 1)) / block; the Triton kernel's program rows too."""
    pairs = tokens * s.top_k
    return float(-(-(pairs + s.experts * (BLOCK_ROWS - 1)) // BLOCK_ROWS))


def auto_path(device: str) -> str:
    """The path our prefill takes on `device` once the fused kernel exists: grouped_mm
    where torch's fast kernel runs, else the Triton kernel. Macs run mlx."""
    if device in MACS:
        return "mlx"
    return "grouped" if DEVICES[device].grouped_mm_fast else "triton"


def _expert_bytes(s: Shape, bits: float) -> float:
    return s.expert_params * bits / 8


def _moe_traffic(s: Shape, tokens: int, device: str, path: str) -> dict[str, float]:
    """Per forward: expert bytes read by the GEMMs (overlap compute), bytes moved by
    kernels that compute nothing (copies, dequantization: add), host syncs, launches,
    and the FLOP factor of padded rows."""
    d, hit, blocks = DEVICES[device], experts_hit(s, tokens), moe_blocks(s, tokens)
    kept = spark_mode(s, d) == "kept" or s.expert_bits >= 16
    packed, bf16 = _expert_bytes(s, s.expert_bits), _expert_bytes(s, 16.0)
    out = {"read": 0.0, "extra": 0.0, "syncs": 0.0, "launches": 0.0, "pad": 1.0}
    if path == "triton":  # timed on its own: moe_layer_s
        out["read"] = s.layers * moe_traffic(s, tokens, device).read_bytes
    elif path == "mlx":  # weights read in their stored form, each hit expert once
        out["read"] = s.layers * packed * hit
    elif path == "grouped":
        out["read"] = s.layers * hit * bf16
        if not kept:  # every expert dequantized per forward, one batched op a layer
            out["extra"] = s.layers * s.experts * s.expert_params * DEQUANT_BYTES
        if not d.grouped_mm_fast:  # torch's fallback: offsets to the host, a GEMM per group
            out["syncs"] = 3.0 * s.layers
            out["launches"] = 3.0 * s.layers * s.experts
    elif path == "blocked":
        # take(block_expert) writes one expert copy per block, which the bmm reads back.
        per_block = 2 * bf16 if kept else s.expert_params * (s.expert_bits / 8 + DEQUANT_BYTES)
        out["extra"] = s.layers * blocks * per_block
        out["pad"] = blocks * BLOCK_ROWS / (tokens * s.top_k)
    else:
        raise ValueError(f"unknown MoE path {path!r}: one of {', '.join(MOE_PATHS)} or mlx")
    return out


def moe_traffic(s: Shape, tokens: int, device: str, tiles: Pick | None = None) -> Any:
    """One MoE layer of `s` on the fused kernel (disagg_agents.models.moecost), at
    `tiles` or those the kernel picks on `device`."""
    t = tiles or kernel_tiles(PROPS[DEVICES[device].arch], tokens * s.top_k, s.experts)
    return layer_traffic(tokens, s.hidden, s.inter, s.experts, s.top_k, s.expert_bits, t,
                         s.act_bytes)  # fmt: skip


def moe_layer_s(s: Shape, tokens: int, device: str, tiles: Pick | None = None) -> float:
    """One MoE layer on the fused kernel: its computed FLOPs at the efficiency measured
    on the device's architecture (else sm90's), or its bytes as read, the longer."""
    d = DEVICES[device]
    eff, _ = kernel_efficiency(d.arch)
    return layer_s(moe_traffic(s, tokens, device, tiles), d.flops, d.bandwidth, eff)


def layer_paths(s: Shape, device: str, path: str = "auto") -> dict[str, str]:
    """What each kind of layer runs on `device` (our torch prefill on CUDA)."""
    d = DEVICES[device]
    out: dict[str, str] = {}
    if s.experts:
        p = auto_path(device) if path == "auto" else path
        if p == "triton":
            eff, own = kernel_efficiency(d.arch)
            seen = "measured on" if own else "until measured here, taken from"
            p += f" (fused, experts packed as stored; {eff.padded:.0%} of peak {seen} {eff.arch})"
        out["MoE experts"] = p
    out["full attention"] = "SDPA flash, causal; a cached prefix bottom-right causal"
    if s.sliding_layers:
        out["sliding attention"] = (
            f"SDPA memory-efficient, window {s.sliding_window} as bands of one window"
        )
    out["projections"] = "cuBLAS bf16"
    return out


def prefill_terms(
    s: Shape, tokens: int, device: str, path: str = "auto", context: int = 0, eager: bool = False
) -> dict[str, float]:
    """A prefill's time by term, in seconds, with the device's fitted efficiencies:
    matmuls (FLOPs / (peak x efficiency)) and flash attention (scores x seconds per
    score) against the weights' and K/V's bytes at the bandwidth, whichever is longer;
    plus bytes of kernels that compute nothing, launches and syncs. `eager`: the
    score matrix materialized (today's gpt-oss attention); `fits` 0 when it cannot."""
    d, e = DEVICES[device], EFFICIENCY[device]
    path = auto_path(device) if path == "auto" else path
    moe = _moe_traffic(s, tokens, device, path) if s.experts else None
    experts = s.top_k if s.experts else 1
    expert_flops = 2.0 * s.layers * experts * s.expert_params * tokens
    flops = prefill_flops(s, tokens, context) - attention_flops(s, tokens, context)
    flops += expert_flops * ((moe["pad"] if moe else 1.0) - 1.0)
    fused = bool(moe) and path == "triton"
    if fused:  # the experts on the kernel's own figures; the rest cuBLAS, as dense
        flops -= expert_flops
    matmul = flops / (d.flops * (e.moe if s.experts and not fused else e.dense))
    scores = score_elements(s, tokens, context)
    attention = scores * e.score_ps * 1e-12
    other = weight_bytes(s, tokens, "fused")["weights_read"]
    if moe:  # the experts' part as the path reads it (the fused kernel's: in moe_s)
        other -= s.layers * experts_hit(s, tokens) * _expert_bytes(s, s.expert_bits)
        other += 0.0 if fused else moe["read"]
    memory = (other + kv_bytes(s, tokens, context)) / d.bandwidth
    extra = moe["extra"] if moe else 0.0
    fits = 1.0
    if eager:  # every layer materializes [heads, n, context + n] (sliding ones masked)
        square = s.heads * tokens * (context + tokens) * s.act_bytes
        extra += EAGER_PASSES * s.layers * square
        fits = float(2 * square + model_bytes(s, kept=False) <= d.memory)
    overhead = (moe["launches"] * d.launch_s + moe["syncs"] * d.sync_s) if moe else 0.0
    moe_s = s.layers * moe_layer_s(s, tokens, device) if fused else 0.0
    total = max(matmul + attention, memory) + moe_s + extra / d.bandwidth + overhead
    return {
        "matmul_s": matmul,
        "moe_s": moe_s,
        "attention_s": attention,
        "memory_s": memory,
        "extra_s": extra / d.bandwidth,
        "overhead_s": overhead,
        "total_s": total,
        "fits": fits,
    }


def decode_bytes(s: Shape, context: int) -> float:
    """Bytes one decode step reads: the routed weights as stored, the K/V so far."""
    experts = s.top_k if s.experts else 1
    per_layer = (
        s.attn_params * s.attn_bits / 8
        + s.router_params * 2
        + experts * s.expert_params * s.expert_bits / 8
    )
    weights = s.layers * per_layer + s.hidden * s.vocab * s.embed_bits / 8
    return weights + (kv_bytes(s, context) if context else 0.0)


def decode_step_s(s: Shape, context: int, device: str) -> float:
    """One decode token at the bandwidth the device's engine reaches on this model class."""
    d, e = DEVICES[device], EFFICIENCY[device]
    eff = e.decode_moe if s.experts else e.decode_dense
    return decode_bytes(s, context) / (d.bandwidth * eff)


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


def prefill_tokens_per_s(s: Shape, device: str, tokens: int = 2048, path: str = "auto") -> float:
    """Calibrated prefill rate of a `tokens`-token prompt on `device`."""
    return tokens / prefill_terms(s, tokens, device, path)["total_s"]


def prior(
    cfg: dict[str, Any],
    prefill_device: str = "gb10",
    decode_device: str = "m3-ultra",
    link: str = "10gbe",
    bits: float = 16.0,
) -> Prior:
    """The placement's prior for a model config (HF config.json as a dict)."""
    s = Shape.from_config(cfg, bits)
    remote = prefill_tokens_per_s(s, prefill_device)
    local = prefill_tokens_per_s(s, decode_device)  # mlx, packed weights
    return Prior(remote, local, kv_bytes(s, 1) / s.layers, LINKS[link][0])
