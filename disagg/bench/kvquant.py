"""Lossy int8 KV on the wire (`kv_quant: "int8"`): what it saves, what it costs.

Per prompt, on a real model, in this process: `disagg_agents.prefill.PrefillEngine`
computes the prompt's K/V and last-position logits; every layer goes through
`kvcodec` twice, lossless and int8, into two sets of mlx caches of
`disagg_agents.decode.DecodeEngine`'s model
(`disagg_agents.decode.kvcaches.fill_layer`), and mlx-lm's
`generate_step` decodes greedily on from each. Measured:

* bytes: the KV_LAYER frames of each, raw and with shuffle+zstd, and the ratio;
* logit error at the first decode step on the filled cache (token 1: token 0
  comes from the prefill's own logits, which the wire cannot touch): max and
  mean |Δ log-prob| over the vocab, int8 vs lossless, and at the greedy token;
* greedy agreement over `tokens` new tokens (token 0 included, as the agents
  emit them): the fraction of equal positions and the first that differs.
  One changed choice changes every input after it, so this says little once
  the text has forked; hence also
* teacher-forced agreement: both caches fed the lossless tokens, the fraction
  of steps whose greedy choice is the same, the log-prob error over all those
  steps, and how close lossless itself was to int8's choice where they differ;
* the same for mlx-lm's own prefill of the prompt against lossless (no wire):
  the noise floor disaggregation already has, to read int8's numbers against.

`run_kvquant_bench` returns plain data; `kvquant_table` renders it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from disagg.bench.common import Say, long_text, quiet, table
from disagg_agents.wire.frames import HEADER
from disagg_agents.wire.kvcodec import (
    Codec,
    LayerKV,
    QuantKV,
    decode_layer,
    encode_layer,
    quantize_layer,
)

# ints: a deterministic inventory of about that many tokens (chat template on);
# strings: that user message as is.
DEFAULT_PROMPTS: tuple[int | str, ...] = (
    "Explain why the sky is blue, in two short paragraphs.",
    128,
    1000,
)
CODECS = {"raw": Codec.RAW, "shuffle_zstd": Codec.SHUFFLE_ZSTD}


def prompt_ids(tokenizer: Any, prompt: int | str) -> list[int]:
    """Token ids of a chat turn: `prompt` itself, or an inventory of ~`prompt` tokens
    with a question about it (so decoding must attend over the whole prompt)."""
    if isinstance(prompt, str):
        text = prompt
    else:
        question = (
            "\n\nList the boxes that hold more than 20 stones, one per line, with their shelf."
        )
        overhead = len(tokenizer.encode(question)) + 20  # the question + the chat template
        text = long_text(lambda s: len(tokenizer.encode(s)), max(prompt - overhead, 8)) + question
    messages = [{"role": "user", "content": text}]
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(text))


def prefill_layers(pre: Any, ids: list[int]) -> tuple[list[LayerKV], np.ndarray]:
    """Every layer's K/V (own copies: the cache tensors die with the pass) and
    the float32 logits of the last position."""
    layers: list[LayerKV] = []

    def keep(kv: LayerKV) -> None:
        layers.append(LayerKV(kv.layer, kv.kind, kv.dtype, kv.keys.copy(), kv.values.copy()))

    _, logits = pre.prefill(ids, keep)
    return layers, logits


def through_wire(
    layers: list[LayerKV], kv_quant: str | None, codec: Codec = Codec.RAW
) -> tuple[list[LayerKV], int, float, float]:
    """Layers as the decode agent gets them: (layers, frame bytes incl. headers,
    quantize seconds, decode_layer seconds)."""
    out: list[LayerKV] = []
    nbytes, quant_s, decode_s = 0, 0.0, 0.0
    for kv in layers:
        t0 = time.perf_counter()
        wire: LayerKV | QuantKV = quantize_layer(kv) if kv_quant else kv
        quant_s += time.perf_counter() - t0
        payload = b"".join(bytes(b) for b in encode_layer(wire, codec))
        nbytes += HEADER.size + len(payload)
        t0 = time.perf_counter()
        out.append(decode_layer(payload))
        decode_s += time.perf_counter() - t0
    return out, nbytes, quant_s, decode_s


def fill_caches(model: Any, layers: list[LayerKV], prompt_len: int) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    from disagg_agents.decode.kvcaches import fill_layer

    caches = make_prompt_cache(model)
    for kv in layers:
        fill_layer(caches[kv.layer], kv, prompt_len)
    return caches


def greedy_from(model: Any, caches: list[Any], first: int, n: int) -> list[int]:
    """`first`, then the n-1 tokens mlx-lm decodes greedily on from `caches`."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array([first]), model, prompt_cache=caches, max_tokens=n - 1)
    return [first, *(int(tok) for tok, _ in steps)]


def forced_logprobs(model: Any, caches: list[Any], tokens: list[int]) -> np.ndarray:
    """Teacher forcing: [len(tokens) - 1, vocab] float32 log-probs, row i the
    distribution of tokens[i + 1] given the prompt in `caches` and tokens[:i + 1]."""
    import mlx.core as mx

    logits = model(mx.array(tokens[:-1])[None], cache=caches)[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(logprobs)


def compare(
    ref: list[int], got: list[int], ref_lp: np.ndarray, got_lp: np.ndarray
) -> dict[str, Any]:
    """int8 against lossless: free-running greedy tokens (`ref`, `got`), and
    teacher-forced log-probs on the lossless tokens (`ref_lp`, `got_lp`), where
    one changed choice cannot change the inputs of the next."""
    diverge = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
    err = np.abs(ref_lp - got_lp)  # [steps, vocab]
    ref_top, got_top = ref_lp.argmax(axis=-1), got_lp.argmax(axis=-1)
    rows = np.arange(len(ref_top))
    flipped = ref_top != got_top
    # How close lossless itself was to int8's choice where they differ (a near tie?).
    margins = (ref_lp[rows, ref_top] - ref_lp[rows, got_top])[flipped]
    return {
        "agreement": sum(a == b for a, b in zip(ref, got, strict=True)) / len(ref),
        "first_divergence": diverge,
        "first_step_logprob_err_max": float(err[0].max()),
        "first_step_logprob_err_mean": float(err[0].mean()),
        "first_step_top_logprob_err": float(err[0, ref_top[0]]),
        "forced_agreement": float(1.0 - flipped.mean()),
        "forced_logprob_err_max": float(err.max()),
        "forced_logprob_err_mean": float(err.mean()),
        "forced_flip_margin_max": float(margins.max(initial=0.0)),
    }


def mlx_prefill(model: Any, ids: list[int]) -> tuple[list[Any], int]:
    """mlx-lm's own prefill of `ids` (no wire at all): caches and greedy token 0."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    logits = model(mx.array(ids)[None], cache=caches)[0, -1]
    mx.eval(logits, [c.state for c in caches])
    return caches, int(np.argmax(np.array(logits.astype(mx.float32))))


def measure_prompt(
    pre: Any, dec: Any, ids: list[int], tokens: int, baseline: bool = True
) -> dict[str, Any]:
    """Bytes and quality of int8 against lossless for one prompt. With `baseline`,
    also mlx's own prefill against the same lossless run: the float noise that
    disaggregation (torch K/V into mlx) has before any quantization."""
    layers, logits = prefill_layers(pre, ids)
    first = int(np.argmax(logits))  # greedy, as the decode agent samples token 0
    nbytes: dict[str, dict[str, int]] = {"lossless": {}, "int8": {}}
    cost: dict[str, dict[str, float]] = {}
    received: dict[str, list[LayerKV]] = {}
    for name, quant in (("lossless", None), ("int8", "int8")):
        for cname, codec in CODECS.items():
            got, nbytes[name][cname], quant_s, decode_s = through_wire(layers, quant, codec)
            if codec == Codec.RAW:
                cost[name] = {"quantize_s": quant_s, "decode_layer_s": decode_s}
                received[name] = got
    model = dec.model
    runs = {
        name: greedy_from(model, fill_caches(model, kv, len(ids)), first, tokens)
        for name, kv in received.items()
    }
    forced = {
        name: forced_logprobs(model, fill_caches(model, kv, len(ids)), runs["lossless"])
        for name, kv in received.items()
    }
    out = {
        "prompt_tokens": len(ids),
        "kv_bytes": nbytes,
        "ratio": {c: nbytes["lossless"][c] / nbytes["int8"][c] for c in CODECS},
        "cost": cost,
        **compare(runs["lossless"], runs["int8"], forced["lossless"], forced["int8"]),
        "tokens": runs,
    }
    if baseline:
        caches, local_first = mlx_prefill(model, ids)
        runs["mlx_prefill"] = greedy_from(model, caches, local_first, tokens)
        local_lp = forced_logprobs(model, mlx_prefill(model, ids)[0], runs["lossless"])
        out["baseline"] = compare(
            runs["lossless"], runs["mlx_prefill"], forced["lossless"], local_lp
        )
    return out


def run_kvquant_bench(
    model_dir: Path | str,
    prompts: Sequence[int | str] = DEFAULT_PROMPTS,
    tokens: int = 64,
    dtype: str = "auto",
    say: Say = quiet,
) -> dict[str, Any]:
    """int8 vs lossless KV on `model_dir` for each prompt; plain data."""
    from disagg_agents.decode.engine import DecodeEngine
    from disagg_agents.prefill.engine import PrefillEngine

    if tokens < 2 or not prompts:
        raise ValueError("tokens >= 2 and at least one prompt")
    t_start = time.perf_counter()
    say(f"loading {model_dir} (torch prefill, mlx decode)")
    pre = PrefillEngine(str(model_dir), device="cpu", dtype=dtype)
    dec = DecodeEngine(str(model_dir), dtype=dtype)
    results = []
    for prompt in prompts:
        ids = prompt_ids(dec.tokenizer, prompt)
        say(f"{len(ids)}-token prompt: lossless and int8, {tokens} new tokens each")
        results.append(measure_prompt(pre, dec, ids, tokens))
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": str(model_dir),
        "dtype": pre.dtype,
        "new_tokens": tokens,
        "cpu_count": os.cpu_count(),
        "prompts": results,
        "elapsed_s": time.perf_counter() - t_start,
    }


KVQUANT_COLUMNS = (
    "prompt",
    "vs lossless",
    "KV bytes",
    "ratio",
    "ratio (shuffle+zstd)",
    "max |Δ logprob|",
    "mean |Δ logprob|",
    "greedy agreement",
    "first diff",
    "forced agreement",
    "max margin",
)


def kvquant_table(report: dict[str, Any]) -> Table:
    t = table(
        f"int8 KV on the wire vs lossless: {Path(report['model']).name}, {report['dtype']}",
        KVQUANT_COLUMNS,
        left=("vs lossless",),
        caption=(
            f"{report['date']} · greedy, {report['new_tokens']} new tokens (token 0 is the "
            "prefill's own) · |Δ logprob|: first decode step, over the vocab · forced: both "
            "fed the lossless tokens; margin: lossless's own gap where the other chose "
            "otherwise · mlx prefill: no wire at all, the noise floor of disaggregation"
        ),
    )
    for p in report["prompts"]:
        b = p["kv_bytes"]
        rows = [
            ("int8 wire", p, f"{b['int8']['raw'] / 1e6:.2f} MB of {b['lossless']['raw'] / 1e6:.2f}")
        ]
        if "baseline" in p:
            rows.append(("mlx prefill", p["baseline"], ""))
        for i, (label, q, size) in enumerate(rows):
            t.add_row(
                f"{p['prompt_tokens']} tok" if i == 0 else "",
                label,
                size,
                f"x{p['ratio']['raw']:.2f}" if i == 0 else "",
                f"x{p['ratio']['shuffle_zstd']:.2f}" if i == 0 else "",
                f"{q['first_step_logprob_err_max']:.3g}",
                f"{q['first_step_logprob_err_mean']:.3g}",
                f"{q['agreement']:.0%}",
                "none" if q["first_divergence"] is None else str(q["first_divergence"]),
                f"{q['forced_agreement']:.0%}",
                f"{q['forced_flip_margin_max']:.3g}",
            )
    return t
