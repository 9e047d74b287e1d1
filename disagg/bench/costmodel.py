"""`disagg plan`: a cost model of the user's cluster, calibrated to published figures.

The physics is in disagg_agents.models.cost (FLOPs, bytes, K/V, each MoE path's
traffic); this module holds the published measurements its efficiencies were
fitted to (POINTS, each with its source), the fit itself (`fit`, which the tests run
against the constants in disagg_agents.models.cost.EFFICIENCY), EXO's published split
as an outside check (`exo_check`), and the table `disagg plan` prints: prefill, TTFT
and decode of the user's two models at 2k / 8k / 32k / 64k tokens, the Spark
prefilling for a Mac against that Mac alone, and the prompt length from which the
split wins. A model, not a measurement: nothing here ran on a Spark or a Mac.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from disagg_agents.models.cost import (
    DEVICES,
    EFFICIENCY,
    HANDSHAKE_S,
    LINKS,
    Shape,
    attention_flops,
    auto_path,
    decode_bytes,
    decode_step_s,
    kv_bytes,
    layer_paths,
    model_bytes,
    moe_layer_s,
    moe_traffic,
    prefill_flops,
    prefill_terms,
    score_elements,
    spark_mode,
)
from disagg_agents.models.moecost import Pick, recording_pick

# Shapes from each model's config.json. Bits per weight count scales: MLX affine 4-bit
# group 64 carries a bf16 scale and bias per 64 weights (4.5); MXFP4 an E8M0 scale per
# 32 (4.25; attention and embeddings stay bf16); GGUF Q8_0 a fp16 scale per 32 (8.5).
_QWEN3_MOE = Shape(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936,
                   experts=128, top_k=8, inter=768)  # fmt: skip
_GPT_OSS_120B = Shape(layers=36, hidden=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088,
                      experts=128, top_k=4, inter=2880, sliding_window=128,
                      sliding_layers=18)  # fmt: skip
_LLAMA8B = Shape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, vocab=128256,
                 inter=14336)  # fmt: skip
_QWEN25_7B = Shape(layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, vocab=152064,
                   inter=18944)  # fmt: skip


def _bits(s: Shape, b: float, rest: float | None = None) -> Shape:
    """`s` with experts at `b` bits, attention and embeddings at `rest` (default `b`)."""
    rest = b if rest is None else rest
    return replace(s, expert_bits=b, attn_bits=rest, embed_bits=rest)


SHAPES = {
    # The user's two models.
    "qwen3-coder-30b-a3b": _bits(_QWEN3_MOE, 4.5),
    "gpt-oss-120b": _bits(_GPT_OSS_120B, 4.25, 16),
    # The shapes of the published measurements.
    "qwen3-moe-q8": _bits(_QWEN3_MOE, 8.5),
    "gpt-oss-120b-q8": _bits(_GPT_OSS_120B, 8.5),
    "gpt-oss-20b-4bit": _bits(
        replace(_GPT_OSS_120B, layers=24, experts=32, sliding_layers=12), 4.5
    ),
    "llama-3.1-8b-fp16": _LLAMA8B,
    "llama-3.1-8b-4bit": _bits(_LLAMA8B, 4.5),
    "qwen2.5-7b-q8": _bits(_QWEN25_7B, 8.5),
}
USER_MODELS = {
    "qwen3-coder-30b-a3b": "Qwen3-Coder-30B-A3B, MLX affine 4-bit",
    "gpt-oss-120b": "GPT-OSS-120B, MXFP4",
}
# Which user models ran eager attention before the chunked attention (gpt-oss: sinks):
# the "before" column, with the blocked MoE path.
EAGER_TODAY = {"gpt-oss-120b"}
PROMPTS = (2048, 8192, 32768, 65536)
LLAMA_CPP = "ggml-org/llama.cpp benches/dgx-spark.md (llama-bench, build 2f68ce7cf)"
MLX_432 = "ml-explore/mlx-lm issue 432 (M3 Ultra, gpt-oss-120b 8-bit, mlx-lm 0.27)"
MLX_406 = "ml-explore/mlx-lm PR 406 (M4 Max, mlx_lm.benchmark, prompt 2048)"
EXO = "blog.exolabs.net/nvidia-dgx-spark (Llama-3.1-8B FP16, 8,192-token prompt)"
RAPID = "raullenchai/Rapid-MLX PR 586 (M3 Ultra, mlx 0.31.2, decode median)"


@dataclass(frozen=True)
class Point:
    """One published measurement: `tokens` new tokens after `context` (prefill), or
    one decode step after `context` (decode), at `tokens_per_s`."""

    device: str
    model: str  # a key of SHAPES
    kind: str  # "prefill" | "decode"
    tokens: int
    context: int
    tokens_per_s: float
    source: str


def _depths(model: str, rates: tuple[float, ...]) -> list[Point]:
    """llama-bench pp2048 at depths 0, 4k, 8k, 16k, 32k on the Spark."""
    depths = (0, 4096, 8192, 16384, 32768)
    pairs = zip(depths, rates, strict=True)
    return [Point("gb10", model, "prefill", 2048, d, r, LLAMA_CPP) for d, r in pairs]


POINTS = [
    *_depths("gpt-oss-120b", (1937.54, 1653.89, 1580.60, 1411.42, 1155.40)),
    *_depths("qwen3-moe-q8", (3175.62, 2704.06, 2381.88, 1900.91, 1292.19)),
    Point("gb10", "llama-3.1-8b-fp16", "prefill", 8192, 0, 8192 / 1.47, EXO),
    Point("gb10", "gpt-oss-120b", "decode", 1, 0, 59.02, LLAMA_CPP + " tg32"),
    Point("gb10", "qwen3-moe-q8", "decode", 1, 0, 60.92, LLAMA_CPP + " tg32"),
    Point("gb10", "qwen2.5-7b-q8", "decode", 1, 0, 29.30, LLAMA_CPP + " tg32"),
    # Time to first token as the table gives it, the model's second run (no stall).
    Point("m3-ultra", "gpt-oss-120b-q8", "prefill", 4300, 0, 4300 / 4.3, MLX_432),
    Point("m3-ultra", "gpt-oss-120b-q8", "prefill", 10000, 0, 10000 / 10, MLX_432),
    Point("m3-ultra", "gpt-oss-120b-q8", "prefill", 25000, 0, 25000 / 30, MLX_432),
    Point("m3-ultra", "llama-3.1-8b-fp16", "prefill", 8192, 0, 8192 / 5.57, EXO),
    Point("m3-ultra", "gpt-oss-120b-q8", "decode", 1, 0, 60.0, MLX_432),
    Point("m3-ultra", "llama-3.1-8b-4bit", "decode", 1, 0, 119.39, RAPID),
    Point("m4-max", "qwen3-coder-30b-a3b", "prefill", 2048, 0, 1731.99, MLX_406),
    Point("m4-max", "gpt-oss-20b-4bit", "prefill", 2048, 0, 1588.66, MLX_406),
]
# No published mlx figure found for these: taken from the M3 Ultra (see EFFICIENCY).
BORROWED = {"m4-max": "m3-ultra"}


def _matmul_s(s: Shape, p: Point) -> float:
    """Matmul time at 100 % of the device's nominal FLOP/s."""
    flops = prefill_flops(s, p.tokens, p.context) - attention_flops(s, p.tokens, p.context)
    return flops / DEVICES[p.device].flops


def _lsq(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) minimizing the relative error of a*x + b*y against t over (x, y, t)."""
    sxx = sum((x / t) ** 2 for x, _, t in rows)
    syy = sum((y / t) ** 2 for _, y, t in rows)
    sxy = sum(x * y / t**2 for x, y, t in rows)
    sx = sum(x / t for x, _, t in rows)
    sy = sum(y / t for _, y, t in rows)
    det = sxx * syy - sxy**2
    return (sx * syy - sy * sxy) / det, (sy * sxx - sx * sxy) / det


def fit() -> dict[str, dict[str, float]]:
    """The efficiencies the published POINTS give, per device (EFFICIENCY's fields)."""
    out: dict[str, dict[str, float]] = {}
    for dev in ("gb10", "m3-ultra", "m4-max"):
        pts = [p for p in POINTS if p.device == dev]
        moe = [p for p in pts if p.kind == "prefill" and SHAPES[p.model].experts]
        rows = [
            (_matmul_s(SHAPES[p.model], p), score_elements(SHAPES[p.model], p.tokens, p.context),
             p.tokens / p.tokens_per_s)
            for p in moe
        ]  # fmt: skip
        if dev in BORROWED:  # two points at one length: the score rate comes from elsewhere
            src = out[BORROWED[dev]]
            score = src["score_ps"] * 1e-12 * DEVICES[BORROWED[dev]].flops / DEVICES[dev].flops
            inv = sum(x * (t - y * score) / t**2 for x, y, t in rows) / sum(
                (x / t) ** 2 for x, _, t in rows
            )
            out[dev] = {**src, "moe": 1 / inv, "score_ps": score * 1e12}
            continue
        inv_moe, score = _lsq(rows)
        fitted = {"moe": 1 / inv_moe, "score_ps": score * 1e12}
        for p in pts:
            if p.kind == "prefill" and not SHAPES[p.model].experts:
                fitted["dense"] = _dense_eff(p, score)
        for kind, pick in (("decode_moe", True), ("decode_dense", False)):
            effs = [_decode_eff(p) for p in pts if p.kind == "decode" and bool(
                SHAPES[p.model].experts) == pick]  # fmt: skip
            fitted[kind] = sum(effs) / len(effs)
        out[dev] = fitted
    return out


def _decode_eff(p: Point) -> float:
    """The fraction of the bandwidth at which one step reads what decode_bytes counts."""
    return decode_bytes(SHAPES[p.model], p.context) * p.tokens_per_s / DEVICES[p.device].bandwidth


def _dense_eff(p: Point, score_s: float) -> float:
    """The matmul efficiency of a dense prefill point, attention at `score_s` a score."""
    s = SHAPES[p.model]
    left = p.tokens / p.tokens_per_s - score_elements(s, p.tokens, p.context) * score_s
    return _matmul_s(s, p) / left


def predicted_tokens_per_s(p: Point) -> float:
    """What the calibrated model says for the point's workload (path as llama.cpp's
    or mlx's: weights read in their stored form by fused kernels)."""
    s = SHAPES[p.model]
    if p.kind == "decode":
        return 1 / decode_step_s(s, p.context, p.device)
    t = prefill_terms(s, p.tokens, p.device, "mlx", p.context)["total_s"]
    return p.tokens / t


# EXO's published split: Llama-3.1-8B FP16, an 8,192-token prompt; one Spark
# prefilling, one M3 Ultra decoding, K/V over 10 GbE: 2.8x the total time of the M3
# Ultra alone. Their results table is an image: 32 generated tokens and 6.42 s against
# 2.32 s as read from it (with none generated the model would give 3.7x, not 2.6x).
EXO_SPEEDUP = 2.8
EXO_GENERATED = 32


def disaggregated_ttft_s(s: Shape, tokens: int, context: int, prefill: float, link: float) -> float:
    """Prefill on the Spark, K/V streamed per layer as computed: the last layer's
    transfer follows the compute, unless the link is slower than the layers come;
    then the logits, and the handshake's round trips."""
    kv = kv_bytes(s, tokens, context)
    stream = max(prefill + kv / s.layers / link, prefill / s.layers + kv / link)
    return HANDSHAKE_S + stream + 4 * s.vocab / link


# A dense prefill on the Spark by llama.cpp (Q8_0 kernels), for the check's second reading.
LLAMA_CPP_DENSE = Point("gb10", "qwen2.5-7b-q8", "prefill", 2048, 0, 2276.28, LLAMA_CPP)


def exo_check(link: str = "10gbe") -> dict[str, float]:
    """The model's speedup on EXO's workload, against their 2.8x. Both dense prefill
    efficiencies were fitted to EXO's own prefill times, so this checks the rest (the
    K/V streamed over the link, decode); `speedup_llamacpp_spark` redoes it with the
    Spark's dense efficiency from llama.cpp's Q8_0 figure instead."""
    s, n = SHAPES["llama-3.1-8b-fp16"], 8192
    mac = prefill_terms(s, n, "m3-ultra")["total_s"]
    spark = prefill_terms(s, n, "gb10")
    decode = sum(decode_step_s(s, n + i, "m3-ultra") for i in range(EXO_GENERATED))
    link_bps = LINKS[link][0]
    split = disaggregated_ttft_s(s, n, 0, spark["total_s"], link_bps) + decode
    gb10 = EFFICIENCY["gb10"]
    slower = gb10.dense / _dense_eff(LLAMA_CPP_DENSE, gb10.score_ps * 1e-12)
    spark_alt = spark["total_s"] + spark["matmul_s"] * (slower - 1)
    split_alt = disaggregated_ttft_s(s, n, 0, spark_alt, link_bps) + decode
    return {
        "mac_alone_s": mac + decode,
        "split_s": split,
        "speedup": (mac + decode) / split,
        "speedup_llamacpp_spark": (mac + decode) / split_alt,
        "published": EXO_SPEEDUP,
    }


# One MoE layer on the fused kernel as a device run timed it: the raw record the docs
# cite (docs/performance-prefill.md), read as is; the kernel's efficiency per arch is
# fitted to all of a run's layers at once (fit_kernel), never per figure.
HISTORY = Path(__file__).resolve().parents[2] / "docs" / "bench-history"
RECORDED = [HISTORY / "device-2026-11-27" / "moelayer-final.jsonl"]
# The recordings made before the per-device tile table, with the tiles and 2-D grid
# every device ran then (moetiles.recording_tiles): predicted with what they ran.
BEFORE_TABLE = {"moelayer-final.jsonl"}
# disagg.bench.moelayer's shapes -> SHAPES; its device names -> DEVICES.
BENCH_SHAPES = {"qwen3-coder-4bit": "qwen3-coder-30b-a3b", "gpt-oss-mxfp4": "gpt-oss-120b"}
BENCH_DEVICES = {"NVIDIA H200": "h200"}


@dataclass(frozen=True)
class LayerFigure:
    """One recorded layer timing of the fused kernel."""

    device: str  # a key of DEVICES
    model: str  # a key of SHAPES
    tokens: int
    ms: float
    min_bytes: int  # as the bench counted them: packed weights once + activations in, out
    source: str


def recorded_layers(files: list[Path] | None = None) -> list[LayerFigure]:
    """The fused kernel's layer timings in the recorded device runs (JSON lines of
    disagg.bench.moelayer: a device line, then one line per shape, path and size)."""
    out = []
    for f in files or RECORDED:
        device = ""
        for line in f.read_text().splitlines():
            row = json.loads(line)
            if "device" in row and "shape" not in row:
                device = BENCH_DEVICES[row["device"]]
            elif row.get("path") == "triton" and not row.get("error"):
                model = BENCH_SHAPES[row["shape"]]
                fig = LayerFigure(device, model, row["tokens"], row["ms"], row["min_bytes"], f.name)
                out.append(fig)
    return out


def figure_tiles(f: LayerFigure) -> Pick | None:
    """The tiles a recorded layer ran at: the recording's where it predates the
    table, else (None) what the kernel picks on its device."""
    s = SHAPES[f.model]
    return recording_pick(f.tokens * s.top_k, s.experts) if f.source in BEFORE_TABLE else None


def predicted_layer_ms(f: LayerFigure) -> float:
    return moe_layer_s(SHAPES[f.model], f.tokens, f.device, figure_tiles(f)) * 1e3


def fit_kernel(figures: list[LayerFigure]) -> dict[str, float]:
    """Per architecture, the share of peak FLOP/s on computed (padded) FLOPs that best
    fits all its recorded layers (least relative error)."""
    by_arch: dict[str, list[tuple[float, float]]] = {}
    for f in figures:
        d = DEVICES[f.device]
        x = moe_traffic(SHAPES[f.model], f.tokens, f.device, figure_tiles(f)).padded_flops / d.flops
        by_arch.setdefault(d.arch, []).append((x, f.ms / 1e3))
    return {
        arch: sum((x / t) ** 2 for x, t in rows) / sum(x / t for x, t in rows)
        for arch, rows in by_arch.items()
    }


@dataclass
class Counts:
    """Ops and syncs of one prefill forward, from a counting pass (`--count-layers`)."""

    per_layer_ops: float
    per_layer_syncs: float
    moe_ops: float  # per MoE layer
    moe_syncs: float
    other_ops: float  # embedding, final norm, LM head
    other_syncs: float
    counted_layers: int
    mode: str  # kept | packed: how the weights were held while counted

    def overhead_s(self, layers: int, device: str) -> float:
        d = DEVICES[device]
        ops = layers * self.per_layer_ops + self.other_ops
        return ops * d.launch_s + (layers * self.per_layer_syncs + self.other_syncs) * d.sync_s


def count(model: str, layers: int = 2) -> Counts:
    """Count aten ops and host syncs of a 256-token prefill of `model` at its real layer
    shapes, `layers` layers (disagg.bench.synthmodels: written once into the cache,
    ~1 and ~3.4 GB at 2 layers; ~8 GB of memory while counting GPT-OSS)."""
    from disagg.bench.opcount import count_prefill, per_call
    from disagg.bench.synthmodels import VOCAB, synthetic_dir
    from disagg_agents.prefill.engine import PrefillEngine

    mode = spark_mode(SHAPES[model], DEVICES["gb10"])
    d = synthetic_dir(model, layers)
    budget = None if mode == "kept" else 0.0
    eng = PrefillEngine(str(d), device="cpu", dtype="bfloat16", dequant_budget_gb=budget)
    c = count_prefill(eng, [(i * 7919 + 13) % VOCAB for i in range(256)])
    calls = c.scopes["layer"].calls
    ops = sum(s.ops for k, s in c.scopes.items() if k != "other") / calls
    syncs = sum(s.syncs for k, s in c.scopes.items() if k != "other") / calls
    moe_ops, moe_syncs = per_call(c, "moe")
    other = c.scopes["other"]
    return Counts(ops, syncs, moe_ops, moe_syncs, other.ops, other.syncs, layers, mode)


def scenario(
    model: str, tokens: int, mac: str, link: str, path: str = "auto", counts: Counts | None = None
) -> dict[str, Any]:
    """One prompt of `tokens` new tokens: the Spark prefilling for `mac` over `link`
    against `mac` alone; decode on the Mac in both."""
    s = SHAPES[model]
    path = auto_path("gb10") if path == "auto" else path
    spark = prefill_terms(s, tokens, "gb10", path)
    spark_s = spark["total_s"] + (counts.overhead_s(s.layers, "gb10") if counts else 0.0)
    today = prefill_terms(s, tokens, "gb10", "blocked", eager=model in EAGER_TODAY)
    mac_s = prefill_terms(s, tokens, mac)["total_s"]
    ttft = disaggregated_ttft_s(s, tokens, 0, spark_s, LINKS[link][0])
    return {
        "tokens": tokens,
        "moe_path": path,
        "spark_prefill_s": spark_s,
        "spark_terms": spark,
        "spark_today_s": today["total_s"] if today["fits"] else None,
        "kv_bytes": kv_bytes(s, tokens),
        "ttft_split_s": ttft,
        "ttft_mac_alone_s": mac_s,
        "speedup": mac_s / ttft,
        "decode_s_per_token": decode_step_s(s, tokens, mac),
    }


@dataclass(frozen=True)
class PromptRow:
    """One prompt's line of `disagg plan`'s table, read from a scenario's JSON."""

    tokens: int
    spark_prefill_s: float | None
    spark_today_s: float | None  # None: the path before the fused kernel ran out of memory
    kv_bytes: float
    ttft_split_s: float | None
    ttft_mac_alone_s: float | None
    speedup: float

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PromptRow:
        return cls(
            d["tokens"],
            d["spark_prefill_s"],
            d["spark_today_s"],
            d["kv_bytes"],
            d["ttft_split_s"],
            d["ttft_mac_alone_s"],
            d["speedup"],
        )


def crossover(model: str, mac: str, link: str, path: str = "auto") -> int | None:
    """The fewest prompt tokens from which the split has the shorter TTFT; None if
    it never does up to 128k (the split's lead grows with the prompt)."""

    def wins(n: int) -> bool:
        return bool(scenario(model, n, mac, link, path)["speedup"] > 1.0)

    lo, hi = 1, 131072
    if not wins(hi):
        return None
    if wins(lo):
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return hi


def plan(
    mac: str = "m3-ultra",
    link: str = "10gbe",
    path: str = "auto",
    counts: dict[str, Counts] | None = None,
) -> dict[str, Any]:
    """Everything `disagg plan` shows, as plain data."""
    models = {}
    for name, label in USER_MODELS.items():
        s = SHAPES[name]
        c = (counts or {}).get(name)
        models[name] = {
            "label": label,
            "weights_gb": model_bytes(s) / 1e9,
            "prompts": [scenario(name, n, mac, link, path, c) for n in PROMPTS],
            "crossover_tokens": crossover(name, mac, link, path),
            "counts": asdict(c) if c else None,
            "layer_paths": layer_paths(s, "gb10", path),
        }
    return {
        "note": "a model calibrated to published measurements, not a measurement",
        "mac": {"key": mac, **asdict(DEVICES[mac])},
        "moe_path": auto_path("gb10") if path == "auto" else path,
        "spark": asdict(DEVICES["gb10"]),
        "link": {"name": link, "bytes_per_s": LINKS[link][0], "source": LINKS[link][1]},
        "efficiency": {k: asdict(v) for k, v in EFFICIENCY.items()},
        "models": models,
        "exo_check": exo_check(),
        "points": [
            {**asdict(p), "predicted_tokens_per_s": predicted_tokens_per_s(p)} for p in POINTS
        ],
        "kernel_layers": [
            {**asdict(f), "predicted_ms": predicted_layer_ms(f)} for f in recorded_layers()
        ],
    }
