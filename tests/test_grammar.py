"""Structured outputs: JSON Schema and forced tool calls by constrained decoding.

Units drive the grammars with random tokens drawn from their own masks (what a
random-weight model does at worst) and check the text with `jsonschema`; the
slow tier asks real decode agents on tiny random-weight checkpoints, alone, 16
at once with different schemas, and with the first token's logits from the
prefill agent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from disagg_agents.decode.grammar import Framing, Grammars, Matcher
from disagg_agents.wire.request import GenerateRequest, RequestError
from tests.tinymodels import shared_tiny

GRADER = {
    "type": "object",
    "properties": {
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "verdict": {"enum": ["pass", "fail", "partial"]},
        "reason": {"type": "string", "maxLength": 40},
    },
    "required": ["score", "verdict", "reason"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 99},
                "ok": {"type": "boolean"},
            },
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "tags", "owner"],
    "additionalProperties": False,
}
LIST = {
    "type": "array",
    "items": {"type": "integer", "minimum": -5, "maximum": 5},
    "minItems": 2,
    "maxItems": 4,
}
SCHEMAS = [GRADER, NESTED, LIST]
HARMONY = [
    "<|endoftext|>",
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}},
    },
]


def variant(i: int) -> dict[str, Any]:
    """GRADER with its own bounds and one more field: 16 different schemas."""
    s = json.loads(json.dumps(GRADER))
    s["properties"]["score"]["maximum"] = 10 + i
    s["properties"][f"extra{i}"] = {"type": "integer", "minimum": i, "maximum": i + 3}
    s["required"].append(f"extra{i}")
    return s


# -- units: the request field ----------------------------------------------------


def test_response_format_forms_normalize_to_one() -> None:
    flat = {"type": "json_schema", "schema": GRADER, "strict": True}
    openai = {"type": "json_schema", "json_schema": {"name": "g", "schema": GRADER, "strict": True}}
    assert (
        GenerateRequest.from_dict({"prompt": "x", "response_format": openai}).response_format
        == flat
    )
    assert (
        GenerateRequest.from_dict({"prompt": "x", "response_format": flat}).response_format == flat
    )
    ollama = GenerateRequest.from_dict({"prompt": "x", "response_format": GRADER}).response_format
    assert ollama == {"type": "json_schema", "schema": GRADER, "strict": True}  # as Ollama's
    for json_mode in ("json", {"type": "json_object"}):
        r = GenerateRequest.from_dict({"prompt": "x", "response_format": json_mode})
        assert r.response_format == {"type": "json_object"}
    assert (
        GenerateRequest.from_dict(
            {"prompt": "x", "response_format": {"type": "text"}}
        ).response_format
        is None
    )
    wire = GenerateRequest.from_dict({"prompt": "x", "response_format": openai}).to_wire()
    assert GenerateRequest.from_dict(wire).response_format == flat


@pytest.mark.parametrize(
    "bad, message",
    [
        (7, "must be"),
        ({"type": "json_schema"}, "needs a schema"),
        ({"type": "object", "description": "x" * 70000}, "at most 65536"),
    ],
)
def test_response_format_refused(bad: Any, message: str) -> None:
    with pytest.raises(RequestError, match=message) as err:
        GenerateRequest.from_dict({"prompt": "x", "response_format": bad})
    assert err.value.field == "response_format"


# -- units: grammars driven by random tokens ------------------------------------


@pytest.fixture(scope="module")
def harmony_tok() -> Any:
    return harmony_tokenizer()


def harmony_tokenizer() -> Any:
    """A small byte-level BPE with harmony's special tokens (by name, from the spec)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=HARMONY,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        ['{"score": 3, "name": "get_weather"} final analysis json'], trainer=trainer
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>")


@pytest.fixture(scope="module")
def grammars(harmony_tok: Any) -> Grammars:
    ids = harmony_tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    return Grammars(harmony_tok, 320, ids, check=None)  # in-process: no child in the fast tier


def walk(g: Grammars, m: Matcher, seed: int, limit: int = 400) -> list[int]:
    """Sample uniformly among the allowed tokens until the grammar ends."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for _ in range(limit):
        allowed = np.flatnonzero(g.masks([m])[0])
        assert len(allowed), "the grammar allowed nothing"
        t = int(rng.choice(allowed))
        out.append(t)
        m.consume(t)
        assert m.failed is None
        if t in m.eos or m.finished:
            return out
    raise AssertionError(f"no end in {limit} tokens")


@pytest.mark.parametrize("schema", SCHEMAS, ids=["grader", "nested", "list"])
def test_random_tokens_under_a_schema_give_valid_json(
    grammars: Grammars, harmony_tok: Any, schema: Any
) -> None:
    for seed in range(4):
        m = grammars.matcher({"type": "json_schema", "schema": schema, "strict": True})
        assert m is not None
        ids = walk(grammars, m, seed)
        text = harmony_tok.decode([t for t in ids if t not in m.eos])
        jsonschema.validate(json.loads(text), schema)


def test_harmony_answer_is_json_in_the_final_channel_after_bounded_reasoning(
    grammars: Grammars, harmony_tok: Any
) -> None:
    pattern = re.compile(
        r"^(<\|channel\|>analysis<\|message\|>(?P<think>.*?)<\|end\|><\|start\|>assistant)?"
        r"<\|channel\|>final<\|message\|>(?P<json>.*)<\|return\|>$",
        re.S,
    )
    reasoned = 0
    for seed in range(8):
        m = grammars.matcher(
            {"type": "json_schema", "schema": GRADER},
            framing=Framing("harmony", analysis_max_tokens=6),
        )
        assert m is not None
        ids = walk(grammars, m, seed)
        text = harmony_tok.decode(ids, skip_special_tokens=False)
        found = pattern.match(text)
        assert found, text
        jsonschema.validate(json.loads(found["json"]), GRADER)
        if found["think"] is not None:
            reasoned += 1
            think_ids = harmony_tok.encode(found["think"])
            assert len(think_ids) <= 6 * 4  # 6 tokens, each up to a few bytes re-encoded
    assert reasoned > 0  # the reasoning stays possible, only bounded


@pytest.mark.parametrize("kind", ["harmony", "qwen_json", "qwen_xml", "plain"])
def test_forced_tool_call_in_each_format(grammars: Grammars, harmony_tok: Any, kind: str) -> None:
    params = TOOLS[0]["function"]["parameters"]  # type: ignore[index]
    for seed in range(4):
        named = {"type": "function", "function": {"name": "get_weather"}}
        m = grammars.matcher(None, framing=Framing(kind), tools=TOOLS, tool_choice=named)
        assert m is not None
        text = harmony_tok.decode(walk(grammars, m, seed), skip_special_tokens=False)
        if kind == "harmony":
            found = re.search(
                r"<\|channel\|>commentary to=functions\.get_weather <\|constrain\|>json"
                r"<\|message\|>(.*)<\|call\|>$",
                text,
                re.S,
            )
            assert found, text
            args = json.loads(found[1])
        elif kind == "qwen_xml":
            found = re.fullmatch(
                r"<tool_call>\n<function=get_weather>\n<parameter=city>\n(.*)\n</parameter>\n"
                r"<parameter=days>\n(.*)\n</parameter>\n</function>\n</tool_call>",
                text,
                re.S,
            )
            assert found, text
            args = {"city": found[1], "days": json.loads(found[2])}
        else:
            body = text
            if kind == "qwen_json":
                assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
                body = text[len("<tool_call>\n") : -len("\n</tool_call>")]
            call = json.loads(body)
            assert call["name"] == "get_weather"
            args = call["arguments"]
        jsonschema.validate(args, params)


def test_required_tool_choice_calls_one_of_the_tools(grammars: Grammars, harmony_tok: Any) -> None:
    names = set()
    for seed in range(6):
        m = grammars.matcher(
            None, framing=Framing("qwen_json"), tools=TOOLS, tool_choice="required"
        )
        assert m is not None
        text = harmony_tok.decode(walk(grammars, m, seed), skip_special_tokens=False)
        names.add(
            json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))["name"]
        )
    assert names <= {"get_weather", "noop"} and names


def test_deferred_grammar_starts_after_its_trigger(grammars: Grammars, harmony_tok: Any) -> None:
    trigger = harmony_tok.encode("</x>")
    m = grammars.matcher({"type": "json_object"}, framing=Framing(trigger=trigger))
    assert m is not None
    free = harmony_tok.encode("any text, no JSON")
    for t in free:
        assert grammars.masks([m])[0][t] and not grammars.masks([m])[0][list(m.eos)].any()
        m.consume(t)
    for t in trigger:
        m.consume(t)
    allowed = grammars.masks([m])[0]
    assert allowed[harmony_tok.encode("{")[0]] and not allowed[harmony_tok.encode("any")[0]]


@pytest.mark.parametrize(
    "rf, tool_choice, field, message",
    [
        (
            {"type": "json_schema", "schema": {"not": {"type": "string"}}},
            None,
            "response_format",
            '"not"',
        ),
        (
            {"type": "json_schema", "schema": {"type": "array", "uniqueItems": True}},
            None,
            "response_format",
            "uniqueItems",
        ),
        (
            {"type": "json_schema", "schema": {"type": "integer", "minimum": "x"}},
            None,
            "response_format",
            "minimum",
        ),
        ({"type": "json_schema", "schema": {"type": "wat"}}, None, "response_format", "wat"),
        (
            None,
            {"type": "function", "function": {"name": "nope"}},
            "tool_choice",
            "'nope' is not among",
        ),
    ],
)
def test_unenforceable_or_invalid_constraints_name_the_problem(
    grammars: Grammars, rf: Any, tool_choice: Any, field: str, message: str
) -> None:
    with pytest.raises(RequestError, match=re.escape(message)) as err:
        grammars.matcher(rf, tools=TOOLS, tool_choice=tool_choice)
    assert err.value.field == field


def test_a_schema_compiles_once(grammars: Grammars) -> None:
    before = grammars.misses
    for _ in range(3):
        grammars.matcher({"type": "json_schema", "schema": variant(99)})
    assert grammars.misses == before + 1 and grammars.hits >= 2


# -- slow: real agents on tiny random-weight checkpoints ----------------------


@pytest.fixture(scope="module")
def tiny_pair(agent_pair: Any) -> Any:
    return agent_pair(shared_tiny("llama"))


def _ask(pair: Any, schema: Any, placement: str, i: int = 0, **kw: Any) -> Any:
    from tests.conftest import ask

    prefill, decode = pair
    req = {
        "prompt": f"Grade answer number {i}.",
        "raw": True,
        "max_tokens": 200,
        "placement": placement,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        **kw,
    }
    return ask(decode, req, prefill=prefill)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["local", "remote"])
def test_agent_answers_validate_from_random_weights(tiny_pair: Any, placement: str) -> None:
    for i, schema in enumerate(SCHEMAS):
        res = _ask(tiny_pair, schema, placement, i)
        assert res.metrics.finish_reason == "stop", res.text
        assert res.metrics.method == ("disaggregated" if placement == "remote" else "local")
        jsonschema.validate(json.loads(res.text), schema)
    res = _ask(tiny_pair, {}, placement, 9)
    assert isinstance(json.loads(res.text), dict | list | str | int | float | bool | None)


@pytest.mark.slow
def test_sixteen_schemas_in_one_batch(tiny_pair: Any, refs: Any) -> None:
    from tests.conftest import ask

    prefill, decode = tiny_pair
    # The agent's peak is over its life: below 8 now, a peak of 8 after is this test's.
    assert json.loads(decode.control("/status"))["batch_peak"] < 8
    plain = {
        "prompt": "Once upon a time",
        "raw": True,
        "max_tokens": 24,
        "ignore_eos": True,
        "placement": "local",
    }

    def run(i: int) -> Any:
        if i == 16:  # an unconstrained greedy row in the same batch
            return ask(decode, {**plain, "return_prompt_ids": True})
        return _ask(tiny_pair, variant(i), "remote" if i % 2 else "local", i)

    with ThreadPoolExecutor(17) as pool:
        results = list(pool.map(run, range(17)))
    status = json.loads(decode.control("/status"))
    assert status["batch_peak"] >= 8 and status["batch"] == 0
    for i, res in enumerate(results[:16]):
        jsonschema.validate(json.loads(res.text), variant(i))
    free = results[16]
    from .references import TIE, mlx_greedy, near_tie_misses

    # mlx-lm's own model alone: token-identical, or a near-tie flipped by the batch.
    model = refs.mlx_own(decode.status()["model"])
    ids = free.prompt_ids or []
    if free.token_ids != mlx_greedy(model, ids, 24):
        misses = near_tie_misses(model, ids, free.token_ids)
        assert misses and all(gap <= TIE for _, gap in misses), misses


@pytest.mark.slow
def test_bad_constraints_are_bad_requests_and_the_agent_stays_healthy(tiny_pair: Any) -> None:
    from disagg.errors import UsageError

    prefill, decode = tiny_pair
    for schema, message in [({"not": {}}, "not"), ({"type": "nope"}, "nope")]:
        with pytest.raises(UsageError, match=message):
            _ask(tiny_pair, schema, "remote")
    assert prefill.alive() and decode.alive()
    jsonschema.validate(json.loads(_ask(tiny_pair, GRADER, "remote").text), GRADER)


TinyModel = Callable[..., Path]


def test_an_unended_reasoning_is_cut_at_its_budget_and_the_answer_follows(
    grammars: Grammars, harmony_tok: Any
) -> None:
    trigger = harmony_tok.encode("</x>")
    for seed in range(4):
        m = grammars.matcher(
            {"type": "json_schema", "schema": GRADER},
            framing=Framing(trigger=trigger, analysis_max_tokens=5),
        )
        assert m is not None
        ids = [t for t in walk(grammars, m, seed) if t not in m.eos]
        ends = [i for i in range(len(ids)) if ids[i : i + len(trigger)] == trigger]
        assert ends and ends[0] <= 5, ids  # within the budget, or forced right after it
        answer = harmony_tok.decode(ids[ends[0] + len(trigger) :])
        jsonschema.validate(json.loads(answer), GRADER)
