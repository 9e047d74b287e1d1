"""The answer on the wire, typed once: what the decode agent sends back for a
GENERATE and what the client reads.

`TokenEvent`: one TOKEN frame (what one generated token completed). `Done`: the
DONE frame (the whole answer and its `Metrics`). `ToolCall`: a call the model
made, on either. Read by attribute: the wire's JSON is parsed here, once. The
decode agent builds frames from these types and the client parses them back; `to_json` /
`from_json` are the frames' JSON, unchanged from the releases that sent dicts.
Metric names a release does not know (an older or newer agent's) are kept in
`Metrics.extra`, never dropped and never an error. Stdlib only: agents ship alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from disagg_agents.wire.frames import ProtocolError
from disagg_agents.wire.timeline import Timeline

CONTENT = "content"  # the answer
REASONING = "reasoning"  # the model's private reasoning (harmony analysis, <think>)


@dataclass(frozen=True)
class ToolCall:
    """A finished tool call: `arguments` parsed, `arguments_text` the arguments as
    the model wrote them where it wrote JSON (sent back, they render byte-exact)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    arguments_text: str | None = None

    @property
    def arguments_json(self) -> str:
        """The arguments as JSON text: as written where known, else serialized."""
        if self.arguments_text is not None:
            return self.arguments_text
        return json.dumps(self.arguments)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "arguments": self.arguments}
        if self.arguments_text is not None:
            out["arguments_text"] = self.arguments_text
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ToolCall:
        """A call as a frame carries it; ProtocolError without a name."""
        name, args, text = d.get("name"), d.get("arguments"), d.get("arguments_text")
        if not isinstance(name, str):
            raise ProtocolError("tool_call must be {name, arguments}")
        return cls(
            name,
            dict(args) if isinstance(args, Mapping) else {},
            text if isinstance(text, str) else None,
        )


@dataclass(frozen=True)
class TokenEvent:
    """One TOKEN frame.

    `id`: the token's id on the first event of each token (one per token, even when
    markup shows nothing), None on the events that follow it (one token can finish
    text on two channels, or text and a tool call). `text`: visible text on
    `channel` (CONTENT or REASONING). `tool_call`: a finished call (ToolCall); its
    text is empty. `metrics`: on a request's first token
    only, what is known by then (the prompt's side, the agent's ttft, and the
    timeline's `at` and `first_token`), for a client that stops reading before DONE.
    """

    id: int | None = None
    text: str = ""
    channel: str = CONTENT
    tool_call: ToolCall | None = None
    metrics: Metrics | None = None

    @property
    def is_reasoning(self) -> bool:
        return self.channel == REASONING

    def to_json(self) -> dict[str, Any]:
        """The frame's JSON: `channel` only off the answer, `tool_call` only with one."""
        out: dict[str, Any] = {"id": self.id, "text": self.text}
        if self.channel != CONTENT:
            out["channel"] = self.channel
        if self.tool_call is not None:
            out["tool_call"] = self.tool_call.to_json()
        if self.metrics is not None:
            early = self.metrics.to_json()
            early.update(early.pop("timeline", None) or {})  # at, first_token: flat
            out["metrics"] = early
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TokenEvent:
        """A received TOKEN frame; keys a newer agent adds are ignored."""
        tid, text = d.get("id"), d.get("text", "")
        channel, call = d.get("channel") or CONTENT, d.get("tool_call")
        if tid is not None and (not isinstance(tid, int) or isinstance(tid, bool)):
            raise ProtocolError(f"TOKEN frame: id must be an integer or null, got {tid!r}")
        if not isinstance(text, str) or not isinstance(channel, str):
            raise ProtocolError("TOKEN frame: text and channel must be text")
        if call is not None and not (
            isinstance(call, Mapping) and isinstance(call.get("name"), str)
        ):
            raise ProtocolError("TOKEN frame: tool_call must be {name, arguments}")
        tool_call = None if call is None else ToolCall.from_json(call)
        sent, metrics = d.get("metrics"), None
        if isinstance(sent, Mapping):
            metrics = Metrics.from_json({k: v for k, v in sent.items() if k not in EARLY_MARKS})
            marks = {k: sent[k] for k in EARLY_MARKS if k in sent}
            metrics.timeline = Timeline.from_json(marks) if marks else None
        return cls(tid, text, channel, tool_call, metrics)


# The first TOKEN's timeline entries, sent flat beside its metrics.
EARLY_MARKS = ("at", "first_token")


@dataclass
class Metrics:
    """A result's metrics, each field documented once.

    The names are the wire's and the JSON's (`disagg generate --json`, the gateways'
    `disagg_metrics`): the seed documents' names first, then what explains them.
    Times are seconds, sizes bytes; None where a run did not have that step. The
    decode agent fills what it measured; the client adds its own view (total_time,
    ttft, the route, reroutes).
    """

    # --- the seed documents' names: every result carries these ---------------------
    prefill_time: float | None = None  # prompt through the model (remote: on the prefill agent)
    decode_time: float | None = None  # first token to last
    total_time: float | None = None  # the client's wall time, request sent to result read
    ttft: float | None = None  # the client's time to the first token
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prefill_speed: float | None = None  # prompt tokens / prefill_time
    decode_speed: float | None = None  # (completion_tokens - 1) / decode_time
    kv_bytes: int | None = None  # K/V frames on the wire, headers included
    kv_transfer_time: float | None = None  # first K/V layer placed to last
    method: str | None = None  # disaggregated | local | local-fallback | decode-only
    prefill_server: str | None = None
    decode_server: str | None = None
    # --- how the request went ------------------------------------------------------
    finish_reason: str | None = None  # "stop" (EOS or a stop sequence), "length", "tool_calls"
    tpot: float | None = None  # decode_time per token after the first
    agent_ttft: float | None = None  # the decode agent's own time to the first token
    agent_total_time: float | None = None  # the decode agent's request, start to end
    weights: str | None = None  # "same", or "mixed" when the prefill side has other weights
    placement: str | None = None  # where the decode agent chose to prefill: local | remote
    placement_reason: str | None = None
    fallback_reason: str | None = None  # why a remote prefill fell back to a local one
    rerouted_from: list[str] | None = None  # decode agents that failed this request first
    migrations: int | None = None  # times the stream moved to another decode agent mid-answer
    # Answer tokens a migrated request's last agent took as prompt (sent before it).
    resumed_tokens: int | None = None
    resume_time: float | None = None  # a migration: failure noticed to the next agent's first token
    # Of cached_tokens: positions read back from the decode agent's disk tier.
    disk_cached_tokens: int | None = None
    # The router's pick of decode agent (disagg.serving.affinity): agent, affine agent,
    # hit_chars of its remembered prefix, busy (in flight per healthy agent), reason.
    route: dict[str, Any] | None = None
    cached_tokens: int | None = None  # prompt positions whose K/V came from a prefix cache
    prefill_cached_tokens: int | None = None  # ... of those, served by the prefill agent's cache
    grammar_ms: float | None = None  # compiling the output grammar, or finding it cached
    # Prompt-lookup drafts (disagg_agents.decode.draft): tokens proposed, and of them
    # accepted (each one a token that cost no forward of its own).
    draft_tokens: int | None = None
    draft_accepted_tokens: int | None = None
    # --- the K/V stream (disaggregated runs) -----------------------------------------
    prefill_address: str | None = None  # the address the decode agent reached it on
    path_failures: list[str] | None = None  # faster addresses that did not answer first
    codec: int | None = None  # 0 raw, 1 zstd, 2 shuffle+zstd
    codec_reason: str | None = None  # why codec "auto" chose it
    codec_probe: dict[str, Any] | None = None  # other codecs timed on one layer
    kv_quant: str | None = None  # None lossless, "int8"
    kv_payload_bytes: int | None = None  # K/V blocks as sent (compressed or not)
    kv_raw_bytes: int | None = None  # K/V blocks expanded
    kv_inplace_layers: int | None = None  # layers received straight into their caches (0: copied)
    kv_encode_time: float | None = None  # prefill side: shuffle + compress
    kv_quant_time: float | None = None  # prefill side: int8 quantization
    kv_decode_time: float | None = None  # decode side: decompress + unshuffle (+ dequantize)
    kv_link_bytes: int | None = None  # large frames only, timed from header to payload
    kv_link_time: float | None = None
    kv_wait_time: float | None = None  # PREFILL sent to the first layer placed
    kv_fetch_time: float | None = None  # dial to PREFILL_DONE
    kv_first_layer_at: float | None = None  # wall clock (time.time) of the first layer placed
    prefill_last_layer_at: float | None = None  # wall clock of the prefill side's last layer
    prefill_threads: int | None = None  # the prefill agent's compute threads for this prompt
    # --- where the time went (the web view draws it; disagg_agents.wire.timeline) ------
    timeline: Timeline | None = None
    queue_time: float | None = None  # waiting: for the prefill device, then a batch slot
    prefill_queue_time: float | None = None  # ... of it, on the prefill agent
    fallback_kind: str | None = None  # unreachable | timeout | stream | prefill_error
    # Names an agent of another release sends that this one does not know: kept.
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Metrics:
        """Metrics as the wire names them; unknown names go to `extra`."""
        m = cls()
        m.update(d)
        return m

    def update(self, values: Mapping[str, Any] | None = None, **more: Any) -> None:
        """Set metrics by their wire names: known ones as fields, others in `extra`."""
        for name, value in {**(values or {}), **more}.items():
            if name == "timeline":
                self.timeline = Timeline.read(value)
            elif name in NAMES:
                setattr(self, name, value)
            else:
                self.extra[name] = value

    def to_json(self) -> dict[str, Any]:
        """The JSON names: the seed's always, the rest where the run had them, then
        `extra` as received."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if isinstance(value, Timeline):
                value = value.as_json()
            if value is not None or f.name in SEED_NAMES:
                out[f.name] = value
        return {**out, **self.extra}


NAMES = frozenset(f.name for f in fields(Metrics)) - {"extra"}
SEED_NAMES = (
    "prefill_time",
    "decode_time",
    "total_time",
    "ttft",
    "prompt_tokens",
    "completion_tokens",
    "prefill_speed",
    "decode_speed",
    "kv_bytes",
    "kv_transfer_time",
    "method",
    "prefill_server",
    "decode_server",
)


@dataclass
class Done:
    """The DONE frame: the whole answer, then nothing more on this request.

    `text` is the answer only; `reasoning` and `tool_calls` ride beside it.
    `prompt_ids`: the prompt's token ids, when the request asked.
    """

    text: str
    token_ids: list[int]
    metrics: Metrics
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_ids: list[int] | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.metrics.finish_reason

    def to_json(self) -> dict[str, Any]:
        """The frame's JSON: `reasoning`, `tool_calls`, `prompt_ids` only when present."""
        out: dict[str, Any] = {"text": self.text}
        if self.reasoning:
            out["reasoning"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [c.to_json() for c in self.tool_calls]
        out.update(token_ids=self.token_ids, metrics=self.metrics.to_json())
        if self.prompt_ids is not None:
            out["prompt_ids"] = self.prompt_ids
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Done:
        """A received DONE frame; what an older agent left out takes its default."""
        sent, calls, prompt = d.get("metrics"), d.get("tool_calls"), d.get("prompt_ids")
        text, ids = d.get("text", ""), d.get("token_ids") or []
        if not isinstance(text, str) or not isinstance(ids, list):
            raise ProtocolError("DONE frame: text must be text and token_ids a list")
        return cls(
            text,
            list(ids),
            Metrics.from_json(sent if isinstance(sent, Mapping) else {}),
            str(d.get("reasoning") or ""),
            [ToolCall.from_json(c) for c in calls if isinstance(c, Mapping)]
            if isinstance(calls, list)
            else [],
            list(prompt) if isinstance(prompt, list) else None,
        )
