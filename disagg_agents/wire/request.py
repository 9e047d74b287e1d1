"""The two requests on the wire, their fields, defaults and limits, defined once.

`GenerateRequest`: every front door (CLI, Python API, batch files, the OpenAI and
Ollama gateways) turns its input into one; it travels as the GENERATE frame's
JSON (`to_wire`) and the decode agent parses it once with `from_dict`.
`PrefillRequest`: what a decode agent asks a prefill agent for (the PREFILL
frame), checked once on the prefill agent. Stdlib only: agents ship alone.
"""

from __future__ import annotations

import json
import math
import re
import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from dataclasses import replace as _replace
from typing import Any

from disagg_agents.wire.schemasize import SchemaTooBig, check_lark, check_schemas

# Limits, in one place. OpenAI and Ollama both take temperature up to 2.
TEMPERATURE_MAX = 2.0
SEED_MAX = (1 << 63) - 1
STOP_MAX_COUNT = 32  # stop strings per request
STOP_MAX_CHARS = 256  # characters per stop string
MESSAGES_MAX = 4096
ROLES = ("system", "user", "assistant", "tool", "developer")
PLACEMENTS = ("auto", "local", "remote")
KV_QUANTS = (None, "int8")
CODECS = (0, 1, 2, "auto")  # raw, zstd, shuffle+zstd, or chosen per link
WIRE_CODECS = (0, 1, 2)  # what a PREFILL may ask for: "auto" is resolved before
TOOLS_MAX = 128  # function definitions per request
GRAMMAR_MAX_CHARS = 65536  # a Lark response_format (a custom tool's grammar), as text
TOOL_CHOICES = ("auto", "none", "required")
THINK_LEVELS = ("low", "medium", "high")
# OpenAI's rule for function names, plus dots (MCP servers name tools a.b).
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# A JSON Schema's own types: a bare schema's "type" is one of these (or a list).
JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class RequestError(ValueError):
    """A request field is missing, of the wrong type, or out of range."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.field = name


@dataclass(frozen=True)
class PrefillTarget:
    """Where the decode agent fetches the prompt's KV: a prefill agent's
    data-plane addresses (fastest first) and port."""

    hosts: list[str]
    port: int
    timeout: float | None = None
    name: str | None = None
    integrity: str = "mac"  # the K/V stream's frames: "mac" tagged, "none" (protocol.INTEGRITY)

    @classmethod
    def from_dict(cls, d: Any) -> PrefillTarget:
        if isinstance(d, PrefillTarget):
            return d  # already typed (a caller building a request from fields)
        if not isinstance(d, Mapping):
            raise RequestError("prefill", "prefill must be an object with hosts and port")
        hosts = d.get("hosts") or ([d["host"]] if d.get("host") else [])
        if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
            raise RequestError("prefill", "prefill.hosts must be a non-empty list of addresses")
        port = d.get("port")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise RequestError("prefill", f"prefill.port must be a TCP port, got {port!r}")
        timeout = d.get("timeout")
        if timeout is not None and (not is_num(timeout) or timeout <= 0):
            raise RequestError("prefill", f"prefill.timeout must be > 0 seconds, got {timeout!r}")
        name = d.get("name")
        integrity = d.get("integrity", "mac")
        if integrity not in ("mac", "none"):
            raise RequestError(
                "prefill", f"prefill.integrity must be mac or none, got {integrity!r}"
            )
        return cls(list(hosts), port, timeout, str(name) if name is not None else None, integrity)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hosts": self.hosts, "host": self.hosts[0], "port": self.port}
        if self.timeout is not None:
            out["timeout"] = self.timeout
        if self.name is not None:
            out["name"] = self.name
        if self.integrity != "mac":
            out["integrity"] = self.integrity
        return out


@dataclass(frozen=True)
class GenerateRequest:
    """A prompt (or chat messages) and how to sample its continuation."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    system: str | None = None
    raw: bool = False  # no chat template
    max_tokens: int = 256  # the agent caps it by the model's context
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # matched by the client, on text
    logprobs: bool = False
    ignore_eos: bool = False
    placement: str = "auto"  # where the prompt is prefilled: auto, local, remote
    kv_quant: str | None = None  # "int8": lossy 8-bit KV on the wire
    codec: int | str = 0  # KV compression, see CODECS
    return_prompt_ids: bool = False
    prefill: PrefillTarget | None = None
    prefix_cache: bool = True  # reuse (and keep) K/V of prompt prefixes seen before
    # Prompt-lookup drafts checked in the batch's forward (the decode agent's
    # --no-speculate turns them off for all); false: this request never drafts.
    speculate: bool = True
    # Chat formats (disagg_agents/chatformat): OpenAI-style function definitions, which
    # of them the model may call, its reasoning effort, and fill-in-the-middle.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # auto, none, required, or one function
    think: bool | str | None = None  # None: the template's default; or low, medium, high
    suffix: str | None = None  # the text after the middle the model writes (FIM)
    # Constrained output: None (text), {"type": "json_object"} or
    # {"type": "json_schema", "schema": {...}, "strict": bool} or {"type": "lark",
    # "grammar": "..."}; see normalize_format().
    response_format: dict[str, Any] | None = None
    # Mixed into the prefix cache's first block key on both agents: only requests
    # with the same salt share cached K/V (the gateway sets one per API key).
    cache_salt: str | None = None
    # Whose request it is, as the gateway tags its API key (never the key, and not
    # the caller's own cache_salt): the decode agent's grammar cache and compile
    # queue keep tenants apart by it. None: no key (one shared tenant).
    tenant: str | None = None
    # Seconds between the PROGRESS frames the decode agent sends while no token is
    # due (the wire client sets it from its idle deadline); None: it sends none, as
    # to a client of a release that knows no such frame.
    progress_s: float | None = None
    # A migrated request (disagg.serving.router): the answer's tokens that a decode
    # agent which died already sent. They are prefilled after the prompt, fed to the
    # answer's parser and grammar, never sent again; a seeded sampler skips as many
    # draws, so the text stays what the seed gives at each position.
    resume_ids: list[int] | None = None

    def __post_init__(self) -> None:
        check(self)

    @classmethod
    def from_dict(cls, d: Any, *, ignore: frozenset[str] = frozenset()) -> GenerateRequest:
        """Build from JSON-like data; unknown keys (beyond `ignore`) are refused."""
        if not isinstance(d, Mapping):
            raise RequestError("request", "a request must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known - ignore)
        if unknown:
            raise RequestError(unknown[0], f"unknown request fields: {', '.join(unknown)}")
        args = {k: v for k, v in d.items() if k in known and v is not None}
        if args.get("kv_quant") == "none":
            del args["kv_quant"]
        if isinstance(args.get("stop"), str):
            args["stop"] = [args["stop"]]
        if "prefill" in args:
            args["prefill"] = PrefillTarget.from_dict(args["prefill"])
        if "response_format" in args:
            args["response_format"] = cls.normalize_format(args["response_format"])
        return cls(**args)

    @staticmethod
    def normalize_format(raw: Any) -> dict[str, Any] | None:
        """The one normalizer of a requested output format; every front door hands
        it its raw shape:

        - the CLI's `--format`: "json", or the JSON Schema its file holds;
        - OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"}, or
          {"type": "json_schema", "json_schema": {"name", "schema", "strict"}};
        - Ollama's `format`: "", "json", or a JSON Schema;
        - a Lark grammar (the Responses API's custom tools): {"type": "grammar",
          "syntax": "lark", "definition": ...};
        - the wire's own form (below), unchanged.

        Returns None (free text), {"type": "json_object"}, {"type": "json_schema",
        "schema": {...}, "strict": bool} or {"type": "lark", "grammar": "..."}.

        `strict`: a bare schema (Ollama's `format`, the CLI's file) is strict, True:
        Ollama compiles `format` into a grammar its sampler must follow, so its
        clients are promised a conforming answer. OpenAI's json_schema keeps the
        caller's `strict` (False unless it says true, OpenAI's default). Either way
        the decode agent enforces the schema with a grammar: `strict` records what
        the caller asked for; it never loosens the enforcement.

        Raises RequestError (field "response_format") for any other shape.
        """
        if raw is None or raw == "" or (isinstance(raw, Mapping) and raw.get("type") == "text"):
            return None
        if raw == "json" or (isinstance(raw, Mapping) and raw.get("type") == "json_object"):
            return {"type": "json_object"}
        if not isinstance(raw, Mapping):
            raise RequestError(
                "response_format",
                'the output format (response_format; Ollama\'s format) must be "json" or '
                'a JSON object: a JSON Schema, or {"type": "json_object" | "json_schema"}',
            )
        kind = raw.get("type")
        if kind == "json_schema":
            inner = raw.get("json_schema", raw)  # OpenAI's wrapper, or the wire's flat form
            if not isinstance(inner, Mapping) or not isinstance(inner.get("schema"), Mapping):
                raise RequestError(
                    "response_format",
                    "a json_schema response_format needs a schema: "
                    "response_format.json_schema.schema, a JSON Schema object",
                )
            strict = inner.get("strict", raw.get("strict", False)) is True
            return {"type": "json_schema", "schema": dict(inner["schema"]), "strict": strict}
        if kind in ("lark", "grammar"):  # the whole answer follows a Lark grammar
            text = raw.get("grammar", raw.get("definition"))
            if raw.get("syntax", "lark") != "lark" or not isinstance(text, str) or not text.strip():
                raise RequestError("response_format", "a grammar response_format needs Lark text")
            return {"type": "lark", "grammar": text}
        if isinstance(kind, str) and kind not in JSON_TYPES:
            raise RequestError(
                "response_format",
                f"response_format type {kind!r}: use text, json_object, json_schema or "
                "grammar (or give a JSON Schema)",
            )
        return {"type": "json_schema", "schema": dict(raw), "strict": True}  # a bare schema

    def to_wire(self) -> dict[str, Any]:
        """The GENERATE frame's JSON: only what differs from the defaults."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            default = f.default_factory() if callable(f.default_factory) else f.default
            if value != default:
                out[f.name] = value.to_wire() if isinstance(value, PrefillTarget) else value
        # The decode agent reads max_tokens even at its default; keep it explicit.
        out["max_tokens"] = self.max_tokens
        return out

    def replace(self, **changes: Any) -> GenerateRequest:
        """A copy with `changes`, checked like any request."""
        return _replace(self, **changes)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def check(r: GenerateRequest) -> None:
    """Every limit of a request; the message names the field and the fix."""
    _check_input(r)
    _check_sampling(r)
    _check_transport(r)
    _check_format(r)
    _check_chat_fields(r)
    _check_schema_sizes(r)
    _check_session(r)


def _check_input(r: GenerateRequest) -> None:
    """A prompt or messages (not both), and the system text."""
    if r.messages is not None:
        if r.prompt is not None:
            raise RequestError("messages", "give a prompt or messages, not both")
        if r.suffix is not None:
            raise RequestError(
                "suffix", "suffix goes with a prompt (fill-in-the-middle), not messages"
            )
        ok = isinstance(r.messages, list) and 0 < len(r.messages) <= MESSAGES_MAX
        if not ok or not all(isinstance(m, Mapping) and m.get("role") in ROLES for m in r.messages):
            raise RequestError(
                "messages",
                f"messages must be a non-empty list of {{role, content}} objects "
                f"(roles: {', '.join(ROLES)})",
            )
        for i, m in enumerate(r.messages):
            _check_message(i, m)
    elif not isinstance(r.prompt, str) or (r.suffix is None and not r.prompt.strip()):
        raise RequestError("prompt", "the prompt is empty: give some text")
    if r.system is not None and not isinstance(r.system, str):
        raise RequestError("system", "system must be text")


def _check_sampling(r: GenerateRequest) -> None:
    """The switches, how many tokens, how they are drawn, and where they stop."""
    switches = ("raw", "logprobs", "ignore_eos", "return_prompt_ids", "prefix_cache", "speculate")
    for name in switches:
        if not isinstance(getattr(r, name), bool):
            raise RequestError(name, f"{name} must be true or false")
    if not _is_int(r.max_tokens) or r.max_tokens < 1:
        raise RequestError("max_tokens", f"max_tokens must be at least 1, got {r.max_tokens!r}")
    if not is_num(r.temperature) or not 0 <= r.temperature <= TEMPERATURE_MAX:
        raise RequestError(
            "temperature",
            f"temperature must be in [0, {TEMPERATURE_MAX:g}] (0 is greedy), got {r.temperature!r}",
        )
    if not is_num(r.top_p) or not 0 < r.top_p <= 1:
        raise RequestError("top_p", f"top_p must be in (0, 1], got {r.top_p!r}")
    if r.seed is not None and (not _is_int(r.seed) or not 0 <= r.seed <= SEED_MAX):
        raise RequestError("seed", f"seed must be a non-negative integer, got {r.seed!r}")
    if not isinstance(r.stop, list) or not all(isinstance(s, str) for s in r.stop):
        raise RequestError("stop", "stop must be a string or a list of strings")
    if len(r.stop) > STOP_MAX_COUNT or any(len(s) > STOP_MAX_CHARS for s in r.stop):
        raise RequestError(
            "stop",
            f"at most {STOP_MAX_COUNT} stop strings of at most {STOP_MAX_CHARS} characters",
        )


def _check_transport(r: GenerateRequest) -> None:
    """Where the prompt is prefilled and how its K/V travels."""
    if r.placement not in PLACEMENTS:
        raise RequestError(
            "placement", f"placement must be one of {', '.join(PLACEMENTS)}, got {r.placement!r}"
        )
    check_kv_quant(r.kv_quant)
    if isinstance(r.codec, bool) or r.codec not in CODECS:
        raise RequestError(
            "codec", f"unknown codec {r.codec!r}: 0 raw, 1 zstd, 2 shuffle+zstd, or auto"
        )
    if r.prefill is not None and not isinstance(r.prefill, PrefillTarget):
        raise RequestError("prefill", "prefill must be a PrefillTarget")


def _check_format(r: GenerateRequest) -> None:
    """A response_format already normalized, and a grammar small enough to compile."""
    rf = r.response_format
    if rf is not None and GenerateRequest.normalize_format(rf) != rf:
        raise RequestError("response_format", "response_format must be normalized")
    grammar = (r.response_format or {}).get("grammar")
    if isinstance(grammar, str) and len(grammar) > GRAMMAR_MAX_CHARS:
        raise RequestError(
            "response_format",
            f"the grammar is {len(grammar)} characters; at most {GRAMMAR_MAX_CHARS}",
        )
    if isinstance(grammar, str):
        try:
            check_lark(grammar, "response_format", "the grammar")
        except SchemaTooBig as e:
            raise RequestError(e.field, str(e)) from None


def _check_session(r: GenerateRequest) -> None:
    """What ties the request to others and to time: the prefix cache's salt, progress
    events, a resumed answer's token ids."""
    check_cache_salt(r.cache_salt)
    if r.tenant is not None and (not isinstance(r.tenant, str) or not 0 < len(r.tenant) <= 64):
        raise RequestError("tenant", "tenant must be text of 1 to 64 characters")
    if r.progress_s is not None and (not is_num(r.progress_s) or r.progress_s <= 0):
        raise RequestError("progress_s", f"progress_s must be > 0 seconds, got {r.progress_s!r}")
    ids = r.resume_ids
    if ids is not None and (
        not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < 1 << 31 for t in ids)
    ):
        raise RequestError("resume_ids", "resume_ids must be a list of token ids")


CACHE_SALT_MAX = 256  # characters


def check_cache_salt(salt: Any) -> str | None:
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= CACHE_SALT_MAX):
        raise RequestError(
            "cache_salt", f"cache_salt must be text of 1 to {CACHE_SALT_MAX} characters"
        )
    return salt


def check_kv_quant(kv_quant: Any) -> str | None:
    """None (lossless) or "int8"; "none" means None."""
    kv_quant = None if kv_quant == "none" else kv_quant
    if kv_quant not in KV_QUANTS:
        raise RequestError(
            "kv_quant", f"kv_quant {kv_quant!r}: use 'int8', or 'none' / leave it out"
        )
    return kv_quant


WAIT_S_MAX = 86400.0  # a PREFILL's wait_s at most (a day)


@dataclass(frozen=True)
class PrefillRequest:
    """The PREFILL frame: a prompt's token ids and how to send their K/V back.

    Optional fields are left off the wire at their defaults, so a prefill agent
    of an older release never sees what it would not know.
    """

    token_ids: list[int]
    codec: int = 0  # 0 raw, 1 zstd, 2 shuffle+zstd (kvcodec.Codec)
    kv_quant: str | None = None  # "int8": lossy 8-bit rows
    start: int = 0  # positions the decode side already holds (a prefix cache hit)
    prefix_digest: str | None = None  # digest of token_ids[:start], checked by the prefill side
    prefix_cache: bool = True  # False: the prefill agent neither uses nor fills its cache
    probe_codecs: bool = False  # also time the other codecs on one layer
    cache_salt: str | None = None  # the GENERATE's, for the prefill agent's cache keys
    # The requester is decoding on the same machine right now (a local pair): the
    # prefill agent runs on its shared thread count (disagg_agents.runtime.torchshare).
    cores_busy: bool = False
    # Seconds the requester waits for the first K/V before it gives up: a prompt
    # still queued past it is dropped, not computed for nobody (None: no bound).
    wait_s: float | None = None

    @classmethod
    def from_dict(
        cls, d: Any, vocab_size: int | None = None, packed_ids: Any = None
    ) -> PrefillRequest:
        """Check a received PREFILL; `vocab_size` bounds the token ids. With
        `packed_ids` (a buffer of little-endian uint32s) the ids come from it,
        not from the JSON."""
        if not isinstance(d, Mapping):
            raise RequestError("request", "PREFILL must be a JSON object")
        ids = d.get("token_ids")
        if packed_ids is not None:
            if ids is not None:
                raise RequestError("token_ids", "PREFILL has token ids both as JSON and packed")
            ids = unpack_ids(packed_ids)
            if not ids:
                raise RequestError("token_ids", "PREFILL needs a non-empty list of token ids")
            # ints >= 0 by construction: max is the only check left.
            out = bool(vocab_size) and max(ids) >= (vocab_size or 0)
        else:
            # type() is: JSON gives exact ints, and bools are ints to isinstance. One
            # pass each, in C (min/max): a long prompt's checks were most of a PREFILL's.
            if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
                raise RequestError("token_ids", "PREFILL needs a non-empty list of token ids")
            out = bool(vocab_size) and (min(ids) < 0 or max(ids) >= (vocab_size or 0))
        if out:
            raise RequestError("token_ids", f"token id out of range 0..{(vocab_size or 0) - 1}")
        codec = d.get("codec", 0)
        if not _is_int(codec) or codec not in WIRE_CODECS:
            raise RequestError("codec", f"unknown codec {codec!r}")
        start = d.get("start", 0)
        if not _is_int(start) or not 0 <= start < len(ids):
            raise RequestError("start", f"start must be in 0..{len(ids) - 1}, got {start!r}")
        digest = d.get("prefix_digest")
        if digest is not None and not isinstance(digest, str):
            raise RequestError("prefix_digest", "prefix_digest must be text")
        wait_s = d.get("wait_s")
        if wait_s is not None and not (is_num(wait_s) and 0 < wait_s <= WAIT_S_MAX):
            raise RequestError("wait_s", f"wait_s must be in (0, {WAIT_S_MAX:g}], got {wait_s!r}")
        return cls(
            token_ids=ids,
            codec=codec,
            kv_quant=check_kv_quant(d.get("kv_quant")),
            start=start,
            prefix_digest=digest,
            prefix_cache=d.get("prefix_cache", True) is not False,
            probe_codecs=d.get("probe_codecs") is True,
            cache_salt=check_cache_salt(d.get("cache_salt")),
            cores_busy=d.get("cores_busy") is True,
            wait_s=None if wait_s is None else float(wait_s),
        )

    def to_wire(self, packed_ids: bool = False) -> dict[str, Any]:
        """The PREFILL's JSON; with `packed_ids` without the ids (see pack_ids)."""
        out: dict[str, Any] = {"codec": self.codec}
        if not packed_ids:
            out["token_ids"] = self.token_ids
        if self.kv_quant:
            out["kv_quant"] = self.kv_quant
        if self.start:
            out.update(start=self.start, prefix_digest=self.prefix_digest)
        if not self.prefix_cache:
            out["prefix_cache"] = False
        if self.probe_codecs:
            out["probe_codecs"] = True
        if self.cache_salt is not None:
            out["cache_salt"] = self.cache_salt
        if self.cores_busy:
            out["cores_busy"] = True
        if self.wait_s is not None:
            out["wait_s"] = self.wait_s
        return out


# array's 4-byte unsigned code (C unsigned int: 4 bytes on every LP64 platform).
_U32 = next(code for code in "IL" if array(code).itemsize == 4)


def pack_ids(ids: list[int]) -> bytes:
    """Token ids as little-endian uint32s (protocol.IDS_U32)."""
    packed = array(_U32, ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(raw: Any) -> list[int]:
    """pack_ids' inverse; the caller has checked the length is whole uint32s."""
    packed = array(_U32)
    packed.frombytes(raw)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


def _check_message(i: int, m: Mapping[str, Any]) -> None:
    """One chat message: text content, except an assistant's tool-call turn
    (content may be empty) and its reasoning; tool results with their call's id."""
    where = f"messages[{i}]"
    calls = m.get("tool_calls")
    content = m.get("content")
    if not isinstance(content, str) and not (content is None and calls):
        raise RequestError("messages", f"{where}.content must be text")
    for key in ("thinking", "reasoning_content", "reasoning", "tool_call_id", "name"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise RequestError("messages", f"{where}.{key} must be text")
    if calls is None:
        return
    if m["role"] != "assistant" or not isinstance(calls, list):
        raise RequestError("messages", f"{where}.tool_calls: a list, on assistant messages only")
    for n, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise RequestError(
                "messages", f"{where}.tool_calls[{n}] must be {{function: {{name, arguments}}}}"
            )
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = None
        if args is not None and not isinstance(args, Mapping):
            raise RequestError(
                "messages",
                f"{where}.tool_calls[{n}].function.arguments must be a JSON object "
                "(or a string holding one)",
            )


def _tool_names(tools: Any) -> list[str]:
    if not isinstance(tools, list) or len(tools) > TOOLS_MAX:
        raise RequestError("tools", f"tools must be a list of at most {TOOLS_MAX} functions")
    names = []
    for n, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        kind = tool.get("type", "function") if isinstance(tool, Mapping) else None
        if kind != "function" or not isinstance(fn, Mapping):
            raise RequestError(
                "tools", f"tools[{n}] must be {{type: function, function: {{name, parameters}}}}"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise RequestError(
                "tools", f"tools[{n}].function.name must be 1-64 of a-z A-Z 0-9 _ . -, got {name!r}"
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise RequestError(
                "tools", f"tools[{n}].function.parameters must be a JSON schema object"
            )
        names.append(name)
    return names


def _check_schema_sizes(r: GenerateRequest) -> None:
    """Schemas within what a grammar may cost to compile (disagg_agents.wire.schemasize)."""
    schema = (r.response_format or {}).get("schema")
    tools = []
    for tool in r.tools or []:
        fn = tool["function"]
        tools.append((fn["name"], fn.get("parameters") or {}))
    try:
        check_schemas(schema, tools)
    except SchemaTooBig as e:
        raise RequestError(e.field, str(e)) from None


def _check_chat_fields(r: GenerateRequest) -> None:
    names = _tool_names(r.tools) if r.tools is not None else []
    choice = r.tool_choice
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise RequestError(
                "tool_choice", 'tool_choice must be {"type": "function", "function": {"name": ...}}'
            )
        if name not in names:
            known = ", ".join(names) or "none given"
            raise RequestError(
                "tool_choice",
                f"tool_choice names function {name!r}, which is not in tools ({known})",
            )
    elif choice is not None:
        if choice not in TOOL_CHOICES:
            raise RequestError(
                "tool_choice",
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function, "
                f"got {choice!r}",
            )
        if choice == "required" and not names:
            raise RequestError("tool_choice", "tool_choice 'required' needs tools to choose from")
    if r.think is not None and not isinstance(r.think, bool) and r.think not in THINK_LEVELS:
        raise RequestError(
            "think",
            f"think must be true, false or one of {', '.join(THINK_LEVELS)}, got {r.think!r}",
        )
    if r.suffix is not None and not isinstance(r.suffix, str):
        raise RequestError("suffix", "suffix must be text")
