"""`disagg plan`: a cost model of the user's cluster (a model, not a measurement).

Per forward of each user model: aten ops and host syncs (counted on this machine
during `PrefillEngine.prefill` at the models' real layer shapes, layers cut to a
few and scaled to the real count), FLOPs, weight bytes read, bytes dequantized and
K/V bytes (disagg_agents.models.cost, from the shapes). From published device figures
(disagg_agents.models.cost.DEVICES, LINKS: each with its source) it predicts prefill
time, TTFT and per-token decode time on the grader's load, the Spark prefilling
for the Mac (disaggregated) against the Mac alone, and the prompt length from
which the split wins.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from disagg_agents.models.cost import (
    DEVICES,
    HANDSHAKE_S,
    LINKS,
    Shape,
    decode_step_s,
    kv_bytes,
    prefill_flops,
    roofline_s,
    spark_mode,
    weight_bytes,
)

# The user's models. Bits per weight count scales: MLX affine 4-bit group 64 carries a
# bf16 scale and bias per 64 weights (4 + 32/64 = 4.5); MXFP4 an E8M0 scale per 32 (4.25).
MODELS = {
    "qwen3-coder-30b-a3b": Shape(
        layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936,
        experts=128, top_k=8, inter=768, expert_bits=4.5, attn_bits=4.5, embed_bits=4.5,
    ),
    "gpt-oss-120b": Shape(
        layers=36, hidden=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088,
        experts=128, top_k=4, inter=2880, sliding_window=128, sliding_layers=18,
        expert_bits=4.25,
    ),
}  # fmt: skip
LABELS = {
    "qwen3-coder-30b-a3b": "Qwen3-Coder-30B-A3B, MLX affine 4-bit",
    "gpt-oss-120b": "GPT-OSS-120B, MXFP4",
}
# The grader's load: a 3k-token rubric and a 300-token submission; 8k prompts.
SCENARIOS = [
    ("rubric + submission", 3300, 0),
    ("rubric cached, submission", 300, 3000),
    ("8k prompt", 8192, 0),
]
# What the per-expert loop dispatched (measured here, commit 48f74c2, tiny qwen3_moe
# at 128 experts top-8, affine 4-bit, 256 tokens): per MoE layer.
LOOP_MOE_OPS, LOOP_MOE_SYNCS = 7731, 246
COUNT_TOKENS = 256


@dataclass
class Counts:
    """Ops and syncs of one prefill forward, from a counting pass (or none)."""

    per_layer_ops: float
    per_layer_syncs: float
    moe_ops: float  # per MoE layer
    moe_syncs: float
    other_ops: float  # embedding, final norm, LM head
    other_syncs: float
    counted_layers: int
    mode: str  # kept | packed: how the weights were held while counted

    def forward(self, layers: int, moe_ops: float | None = None) -> tuple[float, float]:
        """(ops, syncs) of a forward with `layers` layers."""
        ops = self.per_layer_ops - self.moe_ops + (self.moe_ops if moe_ops is None else moe_ops)
        return layers * ops + self.other_ops, layers * self.per_layer_syncs + self.other_syncs


def count(model: str, layers: int = 2, mode: str | None = None) -> Counts:
    """Count a prefill of COUNT_TOKENS tokens on `model` at its real layer shapes,
    `layers` layers (disagg.bench.synthmodels), weights kept or packed (default: as
    the Spark would hold them)."""
    from disagg.bench.opcount import count_prefill, per_call
    from disagg.bench.synthmodels import VOCAB, synthetic_dir
    from disagg_agents.prefill.engine import PrefillEngine

    mode = mode or spark_mode(MODELS[model], DEVICES["gb10"])
    d = synthetic_dir(model, layers)
    budget = None if mode == "kept" else 0.0
    eng = PrefillEngine(str(d), device="cpu", dtype="bfloat16", dequant_budget_gb=budget)
    c = count_prefill(eng, [(i * 7919 + 13) % VOCAB for i in range(COUNT_TOKENS)])
    calls = c.scopes["layer"].calls
    ops = sum(s.ops for k, s in c.scopes.items() if k != "other") / calls
    syncs = sum(s.syncs for k, s in c.scopes.items() if k != "other") / calls
    moe_ops, moe_syncs = per_call(c, "moe")
    other = c.scopes["other"]
    return Counts(ops, syncs, moe_ops, moe_syncs, other.ops, other.syncs, layers, mode)


def forward_cost(s: Shape, tokens: int, context: int, mode: str) -> dict[str, float]:
    """FLOPs and bytes of one prefill forward (disagg_agents.models.cost)."""
    w = weight_bytes(s, tokens, mode)
    return {
        "flops": prefill_flops(s, tokens, context),
        "weight_bytes_read": w["weights_read"],
        "bytes_dequantized": w["dequantized"],
        "bytes_moved": w["read"] + kv_bytes(s, tokens, context),
        "kv_bytes": kv_bytes(s, tokens, context),
    }


def prefill_s(
    s: Shape, tokens: int, context: int, device: str, mode: str, ops: float, syncs: float
) -> float:
    f = forward_cost(s, tokens, context, mode)
    return roofline_s(f["flops"], f["bytes_moved"], DEVICES[device], ops, syncs)


def disaggregated_ttft_s(s: Shape, tokens: int, context: int, prefill: float, link: float) -> float:
    """Prefill on the Spark, K/V streamed per layer as computed: the last layer's
    transfer follows the compute, unless the link is slower than the layers come;
    then the logits, and the handshake's round trips."""
    kv = kv_bytes(s, tokens, context)
    stream = max(prefill + kv / s.layers / link, prefill / s.layers + kv / link)
    return HANDSHAKE_S + stream + 4 * s.vocab / link


def scenario(
    s: Shape, tokens: int, context: int, counts: Counts | None, link: str = "10gbe"
) -> dict[str, float]:
    """Predicted times of one request, Spark -> Mac vs the Mac alone."""
    ops, syncs = counts.forward(s.layers) if counts else (0.0, 0.0)
    mode = spark_mode(s, DEVICES["gb10"])
    spark = prefill_s(s, tokens, context, "gb10", mode, ops, syncs)
    # mlx reads packed weights in its quantized matmuls; its launches are taken as ours.
    mac = prefill_s(s, tokens, context, "m3-ultra", "fused", ops, 0)
    step = decode_step_s(s, context + tokens, DEVICES["m3-ultra"])
    ttft = disaggregated_ttft_s(s, tokens, context, spark, LINKS[link][0])
    out = {
        "tokens": tokens,
        "context": context,
        "spark_prefill_s": spark,
        "mac_prefill_s": mac,
        "ttft_disaggregated_s": ttft,
        "ttft_mac_alone_s": mac,
        "decode_s_per_token": step,
        "speedup_ttft": mac / ttft,
    }
    # What-if: a fused packed-weight MoE kernel (none runs here yet) reads packed bytes only.
    out["spark_prefill_fused_s"] = prefill_s(s, tokens, context, "gb10", "fused", ops, syncs)
    if counts:
        loop_ops, loop_syncs = counts.forward(s.layers, LOOP_MOE_OPS)
        loop_syncs += s.layers * LOOP_MOE_SYNCS
        out["spark_prefill_loop_s"] = prefill_s(
            s, tokens, context, "gb10", mode, loop_ops, loop_syncs
        )
    return out


def crossover(s: Shape, counts: Counts | None, context: int = 0, link: str = "10gbe") -> int | None:
    """The fewest new tokens (after `context` cached) from which Spark -> Mac has the
    shorter TTFT; None if it never does up to 128k."""
    wins = lambda n: scenario(s, n, context, counts, link)["speedup_ttft"] > 1.0  # noqa: E731
    lo, hi = 1, 131072
    if not wins(hi):
        return None
    if wins(lo):
        return lo
    while hi - lo > 1:  # the split's advantage grows with the prompt
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return hi


def plan(counts: dict[str, Counts | None], link: str = "10gbe") -> dict[str, Any]:
    """Everything `disagg plan` shows, as plain data."""
    models = {}
    for name, s in MODELS.items():
        c = counts.get(name)
        mode = spark_mode(s, DEVICES["gb10"])
        ops, syncs = c.forward(s.layers) if c else (None, None)
        models[name] = {
            "label": LABELS[name],
            "shape": asdict(s),
            "spark_weights": mode,
            "counts": asdict(c) if c else None,
            "forward_2048": {
                **forward_cost(s, 2048, 0, mode),
                "aten_ops": ops,
                "host_syncs": syncs,
            },
            "scenarios": {
                label: scenario(s, tokens, context, c, link) for label, tokens, context in SCENARIOS
            },
            "crossover_tokens": crossover(s, c, 0, link),
            "crossover_tokens_after_3000_cached": crossover(s, c, 3000, link),
        }
    return {
        "note": "a roofline model from published figures, not a measurement",
        "link": {"name": link, "bytes_per_s": LINKS[link][0], "source": LINKS[link][1]},
        "devices": {k: asdict(d) for k, d in DEVICES.items()},
        "models": models,
    }
