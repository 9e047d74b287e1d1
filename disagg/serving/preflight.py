"""What the CLI checks on its own before any agent starts: whether a local model
writes reasoning apart (for --think), and whether a --format schema compiles (for
--format). Files and llguidance only: nothing loads a model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# disagg_agents.chatformat.detect's, read here from the files
# (the control plane imports no chatformat)
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
# disagg_agents.decode.grammar.JSON_OPTIONS: the schema compiled as the decode agent compiles it
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def reasons_apart(model_dir: Path) -> bool | None:
    """Whether the model in `model_dir` writes its reasoning apart (harmony, or a chat
    template with <think>), from its tokenizer files. None: cannot tell."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    template = config.get("chat_template")
    jinja = model_dir / "chat_template.jinja"
    if not isinstance(template, str) and jinja.is_file():
        template = jinja.read_text(errors="replace")
    if isinstance(template, list):  # named templates: any of them
        template = " ".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    added = config.get("added_tokens_decoder") or {}
    names = {str(t.get("content")) for t in added.values() if isinstance(t, dict)}
    if all(t in names for t in HARMONY_TOKENS):
        return True
    if not isinstance(template, str):
        return None
    harmony = "<|channel|>" in template and "<|start|>" in template
    return harmony or ("<think>" in template and "</think>" in template)


def schema_error(response_format: Mapping[str, Any]) -> str | None:
    """What keeps a json_schema response_format from compiling; None: it compiles, or
    llguidance is not installed here (the decode agent then says it)."""
    try:
        import llguidance as llg
    except ImportError:
        return None
    schema = response_format.get("schema")
    text = json.dumps(schema if isinstance(schema, Mapping) else {}, separators=(",", ":"))
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        problem = llg.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError, RuntimeError) as e:
        problem = str(e)
    if not problem:
        return None
    return " ".join(x.strip() for x in problem.strip().splitlines() if x.strip())[:300]
