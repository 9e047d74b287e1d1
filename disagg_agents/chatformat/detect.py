"""Which chat format a tokenizer speaks, from its vocab and chat template only
(never from a model's name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
# Qwen's FIM names, then StarCoder's: same prefix-suffix-middle order.
FIM_NAMES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
)
# Where a FIM model writes past the middle: it starts another file or pads.
FIM_STOPS = ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|endoftext|>")
KINDS = ("harmony", "qwen_xml", "qwen_json", "plain")


@dataclass(frozen=True)
class ChatFormat:
    """What the model's tokenizer says about how it talks.

    kind: "harmony", "qwen_xml" (`<tool_call><function=NAME><parameter=ARG>`),
    "qwen_json" (`<tool_call>{"name", "arguments"}</tool_call>`) or "plain".
    """

    kind: str
    reasoning: bool  # writes reasoning apart: harmony's analysis channel, or <think>
    tools: bool  # the chat template takes `tools`
    fim: tuple[int, int, int] | None  # prefix, suffix, middle token ids
    stop_ids: frozenset[int]  # end generation besides the tokenizer's EOS (harmony)
    fim_stop_ids: frozenset[int]  # end a fill-in-the-middle answer
    special_ids: dict[str, int]  # harmony's markup tokens by name
    template: str  # the chat template's text ("" without one), for /api/show

    @property
    def tool_format(self) -> str:
        """How tools reach the model: its template's own ("template", "harmony"),
        the generic format (chatformat.generic: a template without tools), or "none"."""
        if self.kind == "harmony":
            return "harmony"
        if self.tools:
            return "template"
        return (
            "generic" if self.kind == "plain" and not self.reasoning and self.template else "none"
        )

    @property
    def capabilities(self) -> list[str]:
        """Ollama's /api/show `capabilities` for this model."""
        caps = ["completion"]
        if self.tool_format != "none":
            caps.append("tools")
        if self.reasoning:
            caps.append("thinking")
        if self.fim is not None:
            caps.append("insert")
        return caps

    def describe(self) -> dict[str, Any]:
        """JSON for a status or /api/show answer."""
        return {
            "kind": self.kind,
            "reasoning": self.reasoning,
            "tools": self.tools,
            "tool_format": self.tool_format,
            "fim": self.fim is not None,
            "capabilities": self.capabilities,
        }


def template_text(tokenizer: Any) -> str:
    """The chat template's text; a dict of named templates gives its default."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default") or next(iter(t.values()), None)
    return t if isinstance(t, str) else ""


def detect(tokenizer: Any) -> ChatFormat:
    """The `ChatFormat` of an mlx-lm TokenizerWrapper or a Hugging Face tokenizer."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    template = template_text(tokenizer)
    takes_tools = "tools" in template
    if all(t in vocab for t in HARMONY_TOKENS):
        names = (*HARMONY_TOKENS, "<|constrain|>")
        specials = {t: vocab[t] for t in names if t in vocab}
        stops = frozenset({vocab["<|return|>"], vocab["<|call|>"]})
        return ChatFormat(
            "harmony", True, takes_tools, _fim(vocab), stops, frozenset(), specials, template
        )
    if "<tool_call>" in template and "<function=" in template:
        kind = "qwen_xml"
    elif "<tool_call>" in template:
        kind = "qwen_json"
    else:
        kind = "plain"
    reasoning = "<think>" in template and "</think>" in template
    fim = _fim(vocab)
    fim_stops = frozenset(vocab[t] for t in FIM_STOPS if t in vocab) if fim else frozenset()
    return ChatFormat(kind, reasoning, takes_tools, fim, frozenset(), fim_stops, {}, template)


def _fim(vocab: dict[str, int]) -> tuple[int, int, int] | None:
    for names in FIM_NAMES:
        if all(n in vocab for n in names):
            return vocab[names[0]], vocab[names[1]], vocab[names[2]]
    return None
