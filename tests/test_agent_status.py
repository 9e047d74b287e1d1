"""An agent's /status read typed (disagg_agents.wire.status): each field by its
type, nested documents by their own readers, and every field sent with another
type named in `mistyped` (dotted for a nested one) so `disagg status` can say
which; then `disagg status`'s table drawn from the typed status alone."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console

from disagg.cli.render_fleet import disk_tier, status_json, status_table
from disagg.fleet.operations import HostProbe
from disagg_agents.wire.status import (
    STATUS_FIELDS,
    AgentStatus,
    ChatFacts,
    PrefixCacheStatus,
    PrefixDiskStatus,
    WeightsFormat,
)


def test_an_agents_status_is_read_typed_and_a_mistyped_field_costs_itself() -> None:
    doc = {
        "role": "decode",
        "max_batch": 8,
        "in_flight": "lots",  # another release's (or a hostile agent's) type
        "uptime_s": 12.5,
        "context": True,  # a bool is no count
        "loaded": 1,  # a count is no bool
        "ttft_p50_s": None,  # no request yet: null is absent, not mistyped
        "fingerprint": {"architecture": "llama", "dtype": "bfloat16"},
        "chat": {"reasoning": False},
        "prefix_cache": ["not", "an", "object"],
        "from_the_future": 1,
    }
    st = AgentStatus.from_json(doc)
    assert (st.max_batch, st.in_flight, st.uptime_s, st.context) == (8, None, 12.5, None)
    assert st.loaded is None and st.ttft_p50_s is None
    assert st.fingerprint["architecture"] == "llama" and st.chat == ChatFacts(reasoning=False)
    assert st.prefix_cache is None and st.prefix_disk is None and st.doc == doc
    assert st.mistyped == ("loaded", "context", "in_flight", "prefix_cache")
    assert AgentStatus.from_json({}).chat is None  # an older agent: no chat facts
    assert AgentStatus.from_json({}).mistyped == ()
    assert "max_batch" in STATUS_FIELDS and "doc" not in STATUS_FIELDS
    assert {"hit_rate", "fim_tokens", "corrupt"} <= STATUS_FIELDS  # the nested ones too


def test_the_status_nested_documents_are_read_typed() -> None:
    doc = {
        "fingerprint": {
            "dtype": "bfloat16",
            "weights": {"quantization": {"bits": 4, "mode": "affine", "group_size": 64}},
        },
        "prefix_cache": {"hit_rate": 0.5, "cached_tokens": "many", "hits": 3, "bytes": 7 << 20},
        "prefix_disk": {"hits": 2, "bytes": 5 << 20, "max_bytes": 64 << 20, "corrupt": "?"},
    }
    st = AgentStatus.from_json(doc)
    assert st.weights_format == WeightsFormat("bfloat16", 4, "affine")
    assert st.prefix_cache == PrefixCacheStatus(
        hit_rate=0.5, bytes=7 << 20, mistyped=("cached_tokens",)
    )
    assert st.prefix_disk == PrefixDiskStatus(
        hits=2, bytes=5 << 20, max_bytes=64 << 20, mistyped=("corrupt",)
    )
    assert st.mistyped == ("prefix_cache.cached_tokens", "prefix_disk.corrupt")
    bare = AgentStatus.from_json({"fingerprint": {"weights": "odd"}, "prefix_cache": None})
    assert (bare.weights_format, bare.prefix_cache, bare.mistyped) == (WeightsFormat(), None, ())


def test_the_chat_facts_are_read_typed() -> None:
    chat: dict[str, Any] = {
        "kind": "qwen_xml",
        "capabilities": ["completion", "tools", "insert"],
        "template": "{{ messages }}",
        "stop": ["<|im_end|>", "<|endoftext|>"],
        "tool_format": "template",
        "reasoning": False,
        "fim_tokens": ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"],
    }
    facts = AgentStatus.from_json({"chat": chat}).chat
    assert facts == ChatFacts(
        capabilities=("completion", "tools", "insert"),
        template="{{ messages }}",
        stop=("<|im_end|>", "<|endoftext|>"),
        tool_format="template",
        reasoning=False,
        fim_tokens=("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    )
    odd = {**chat, "stop": ["ok", 7], "fim_tokens": ["a", "b"], "reasoning": "no"}
    st = AgentStatus.from_json({"chat": odd})
    assert st.chat is not None and (st.chat.stop, st.chat.fim_tokens, st.chat.reasoning) == (
        (),
        None,
        None,
    )
    assert st.mistyped == ("chat.stop", "chat.reasoning", "chat.fim_tokens")


def _row(doc: dict[str, Any]) -> HostProbe:
    st = AgentStatus.from_json(doc)
    return HostProbe("mac", "decode", "healthy", "10.0.0.2:8001", st, 42, 3 << 30)


def _shown(rows: list[HostProbe], width: int) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(status_table(rows, width))
    return console.export_text()


DECODE = {
    "model": "/models/SmolLM2-135M-Instruct/",
    "loaded": True,
    "backend": "mlx",
    "device": "Device(gpu, 0)",
    "uptime_s": 90.0,
    "requests": 17,
    "ttft_p50_s": 0.25,
    "ttft_p95_s": 0.5,
    "ttft_p99_s": 2.0,
    "prefix_cache": {"hit_rate": 0.75, "queries": 8, "bytes": 3 << 20, "max_bytes": 1 << 30},
    "prefix_disk": {"hits": 4, "bytes": 5 << 20, "max_bytes": 64 << 20},
}


def test_the_status_table_is_drawn_from_the_typed_status() -> None:
    wide = _shown([_row(DECODE)], 300)
    for said in (
        "SmolLM2-135M-Instruct",
        "True",
        "mlx/Device(gpu, 0)",
        "90.000 s",
        "250.0 ms / 500.0 ms / 2.000 s",
        "hit 75% of 8, 3 MiB / 1,024 MiB; disk 4 hits, 5 MiB / 64 MiB",
        "3,072 MiB",
    ):
        assert said in wide, (said, wide)
    narrow = _shown([_row(DECODE)], 80)
    assert "prefix cache hit 75% of 8" in narrow and "250.0 ms" in narrow, narrow
    assert disk_tier(None) == "-"


def test_a_mistyped_field_makes_a_bad_answer_row_that_names_it() -> None:
    hostile = {**DECODE, "requests": "17", "prefix_disk": {"hits": 4, "bytes": [1]}}
    good = _row(DECODE)
    bad = _row(hostile)
    assert good.ok and not bad.ok  # `disagg status` exits 1 for it
    for width in (300, 80):
        text = _shown([good, bad], width)
        assert "bad answer" in text and "requests, prefix_disk.bytes" in text, text
        assert "SmolLM2-135M-Instruct" in text, text  # the good row, whole
    # --json: the agent's document as it sent it, the typed read aside.
    shown = json.loads(json.dumps(status_json([bad])))[0]
    assert shown["status"] == hostile and shown["ok"] is False and shown["host"] == "mac"


def test_a_number_too_large_to_show_costs_its_row_only() -> None:
    huge = _row({**DECODE, "prefix_cache": {"bytes": 10**400}})  # JSON allows it
    text = _shown([_row(DECODE), huge], 300)
    assert "bad answer" in text and "out of range" in text and "SmolLM2" in text, text
