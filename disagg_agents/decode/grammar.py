"""Structured outputs: grammars that constrain what the decode agent samples.

A request's `response_format` (JSON object or JSON Schema) or forced tool call
becomes an llguidance grammar, compiled once per model and tenant and cached by
its canonical text (a grader sends the same schema every time); compiles queue
fairly between tenants (disagg_agents.decode.compilequeue). Each request gets
its own `Matcher`; before every sample its bitmask sets the logits of tokens
the grammar cannot take to -inf, so the text is valid by construction, even
from random weights. EOS is allowed only where the grammar accepts.

llguidance was chosen by measurement (SmolLM2 tokenizer, this machine's CPU):
compile 3-4 ms cold, a cache hit is a ~1 us matcher copy; mask + consume 0.07 ms
per step at batch 1, 0.5 ms at batch 16 with different schemas; and it refuses
the JSON Schema keywords it cannot enforce (`not`, `uniqueItems`) by name, where
xgrammar accepts them silently and outlines-core ignores integer bounds.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from disagg_agents.decode.compilequeue import CompileQueue, Expired, Job
from disagg_agents.decode.schemas import closed
from disagg_agents.runtime.grammarcheck import CompileCheck, TooSlow, limits
from disagg_agents.wire.request import RequestError
from disagg_agents.wire.text import printable

try:
    import llguidance as llg
    import llguidance.numpy as llg_np
except ImportError:  # the agent still serves unconstrained requests
    llg = None  # type: ignore[assignment]

KINDS = ("plain", "harmony", "qwen_json", "qwen_xml")
CACHE_ENTRIES = 256  # compiled grammars kept per model (and refusals remembered)
CACHE_MAX_BYTES = 256 << 20  # their estimated memory, per model (DISAGG_GRAMMAR_CACHE_MB)
# A compiled grammar's memory, estimated from its text (measured: a 57 kB one
# grew the process by 5-7 MB; the issue saw ~60 MB for 230 kB).
GRAMMAR_BASE_BYTES = 256 << 10
GRAMMAR_BYTES_PER_CHAR = 256
COMPILE_WORKERS = 3  # grammars compiling at once, per model; others queue
# Of them, at most this many for one tenant: the last is always free for the others.
TENANT_COMPILES = COMPILE_WORKERS - 1
COMPILE_BUDGET_S = 10.0  # a request waits this long for its grammar, then it is a 400
GONE_POLL_S = 0.25  # how often a waiting request checks that its client is still there
ANALYSIS_MAX_TOKENS = 512  # harmony: the reasoning's budget under a constraint
# Compact but readable JSON, as json.dumps writes it: no free whitespace, so a
# model cannot spend its max_tokens on blanks.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# The checking children, shared by every model of the process (grammarcheck).
CHECK = CompileCheck()


@dataclass(frozen=True)
class Framing:
    """What surrounds the constrained part of an answer.

    kind: the chat format ("harmony", "qwen_json", "qwen_xml", "plain"); harmony
        constrains the whole output (bounded analysis, then a final message).
    trigger: token ids (e.g. of "</think>") after which the grammar starts.
    analysis_max_tokens: the reasoning's budget (harmony's analysis message, or
        the tokens before the trigger); then the answer is forced to begin.
    opener: with a trigger, the token that opens the reasoning, forced first.
    """

    kind: str = "plain"
    trigger: list[int] | None = None
    analysis_max_tokens: int = ANALYSIS_MAX_TOKENS
    opener: int | None = None

    def matcher(self, inner: Any, eos: frozenset[int]) -> Matcher:
        """A matcher over compiled `inner`: harmony's grammar covers the reasoning
        itself; others start at the trigger."""
        trigger = self.trigger if self.kind != "harmony" else None
        return Matcher(inner, eos, trigger, self.analysis_max_tokens, self.opener)


class ClientGone(RequestError):
    """The client hung up while its grammar compiled: nobody to answer."""


class Matcher:
    """One request's grammar state. `trigger`: token ids after which the grammar
    starts (reasoning models: the answer, not the reasoning, is constrained);
    until then every token but EOS is allowed, for at most `budget` tokens,
    after which the trigger itself is forced (so the answer still comes)."""

    def __init__(
        self,
        inner: Any,
        eos: frozenset[int],
        trigger: list[int] | None = None,
        budget: int = ANALYSIS_MAX_TOKENS,
        opener: int | None = None,
    ) -> None:
        self.inner = inner
        # The reasoning's opening token (<think>), forced first when the prompt did
        # not open it: so what comes before the trigger is reasoning, never answer.
        self.opener = opener
        self.eos = eos
        self.trigger = trigger or []
        self.active = not self.trigger
        self.tail: list[int] = []
        self.free = 0  # tokens before the trigger
        self.budget = budget
        self.failed: str | None = None

    def consume(self, token: int) -> None:
        """Advance past a sampled token (one the mask allowed)."""
        if not self.active:
            self.tail = (self.tail + [token])[-len(self.trigger) :]
            self.free += 1
            self.active = self.tail == self.trigger
            return
        if not self.inner.consume_token(token):
            self.failed = self.inner.get_error() or f"token {token} was not allowed"

    def forced(self) -> int | None:
        """Past the budget: the trigger's next token (continuing a partial one)."""
        if self.active:
            return None
        if self.free == 0 and self.opener is not None:
            return self.opener
        if self.free < self.budget:
            return None
        for k in range(len(self.trigger) - 1, 0, -1):
            if self.tail[-k:] == self.trigger[:k]:
                return self.trigger[k]
        return self.trigger[0]

    @property
    def finished(self) -> bool:
        """Nothing may follow: the grammar ended (its own end marker or EOS)."""
        return self.active and self.inner.is_stopped()


class CompileTimeout(RequestError):
    """The grammar did not compile within the request's budget (never remembered:
    the same grammar may compile in time on a quieter agent)."""


class Grammars:
    """Per model: its llguidance tokenizer (built once, ~0.5 s, in the background),
    the compiled-grammar cache, and the batch mask buffers."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos: Iterable[int],
        check: CompileCheck | None = CHECK,
    ) -> None:
        """check: the children that compile each grammar first (None: in-process
        only, for unit tests that start no process)."""
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words per mask row
        self.eos = frozenset(int(t) for t in eos)
        self._hf = hf_tokenizer
        self._tok: Any = None
        self._tok_error: str | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()
        # By the digest of the tenant and the grammar: (matcher, estimated bytes);
        # refusals too. Per tenant: a hit's speed must not tell one tenant which
        # schemas another used.
        self.cache: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self.owner: dict[bytes, str] = {}  # each entry's tenant
        self.tenant_bytes: dict[str, int] = {}
        self.refused: OrderedDict[bytes, str] = OrderedDict()
        self.cache_bytes = 0
        self.cache_max_bytes = _env_mb("DISAGG_GRAMMAR_CACHE_MB", CACHE_MAX_BYTES)
        self.budget_s = COMPILE_BUDGET_S
        self._cache_lock = threading.Lock()  # never held while anything else runs
        self.queue = CompileQueue(COMPILE_WORKERS, TENANT_COMPILES, self._finished)
        self.hits = self.misses = 0
        self._executor: Any = None
        self.check = check

    def snapshot(self) -> dict[str, int]:
        """For the agent's /status: compiles running or queued, and the cache."""
        queue = self.queue.snapshot()
        with self._cache_lock:
            return {
                **queue,
                "cached": len(self.cache),
                "cache_bytes": self.cache_bytes,
                "hits": self.hits,
                "misses": self.misses,
            }

    def warm(self) -> None:
        """Build the tokenizer now, off the request path."""
        threading.Thread(target=self._tokenizer, daemon=True, name="grammar-tok").start()
        if self.check is not None:
            threading.Thread(target=self.check.warm, daemon=True, name="grammar-check").start()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._tok is None and self._tok_error is None:
                try:
                    if llg is None:
                        raise RuntimeError("llguidance is not installed (pip install llguidance)")
                    self._tok = llg.LLTokenizer(
                        _tokenizer_json(self._hf),
                        n_vocab=self.vocab_size,
                        eos_token=sorted(self.eos) or None,
                    )
                    self._executor = llg.LLExecutor()
                except Exception as e:  # e.g. a slow (non-Rust) tokenizer
                    self._tok_error = f"structured outputs are unavailable for this model: {e}"
        if self._tok is None:
            raise RequestError("response_format", self._tok_error or "no grammar engine")
        return self._tok

    # -- compiling -------------------------------------------------------------

    def compile(
        self,
        key: str,
        build: Callable[[], str],
        field: str,
        gone: Callable[[], bool] | None = None,
        tenant: str = "",
    ) -> Any:
        """A pristine matcher for the grammar `build()` writes (llguidance's JSON),
        cached under `tenant` and `key`. Compiled by the fair queue, once for all of
        the tenant's requests that ask for it at the same time, within budget_s; an
        invalid or unenforceable grammar, or one over the budget, raises RequestError
        naming `field`. `gone()` true: the client left, stop waiting (ClientGone)."""
        digest = cache_key(key, tenant)
        tok = self._tokenizer()  # built once (~0.5 s); raises when there is no engine
        with self._cache_lock:
            hit = self.cache.get(digest)
            if hit is not None:
                self.cache.move_to_end(digest)
                self.hits += 1
                return hit[0]
            refused = self.refused.get(digest)
            if refused is not None:
                raise RequestError(field, refused)
        deadline = time.monotonic() + self.budget_s
        check = self.check

        def run(job_deadline: float) -> tuple[Any, int]:
            return self._build(tok, build, field, check, job_deadline - time.monotonic())

        job, new = self.queue.join(digest, tenant, run, deadline)
        if new:
            with self._cache_lock:
                self.misses += 1
        try:
            return self._wait(job, field, gone, deadline)
        finally:
            self.queue.leave(job)  # the last waiter's leaving drops a job not started

    def _wait(self, job: Job, field: str, gone: Callable[[], bool] | None, deadline: float) -> Any:
        while True:
            left = deadline - time.monotonic()
            if job.done.wait(max(0.0, min(GONE_POLL_S, left))):
                if job.error is not None and not isinstance(job.error, Expired):
                    raise job.error
                if job.result is None:
                    break  # it expired in the queue
                return job.result[0]
            if gone is not None and gone():
                raise ClientGone(field, f"{field}: the client went away while it compiled")
            if time.monotonic() >= deadline:
                break
        raise CompileTimeout(
            field,
            f"{field}: the grammar did not compile within {self.budget_s:g}s; "
            "make the schema smaller",
        )

    @staticmethod
    def _build(
        tok: Any, build: Callable[[], str], field: str, check: CompileCheck | None, left_s: float
    ) -> tuple[Any, int]:
        """(matcher, its estimated bytes) on a queue worker; llguidance drops the GIL.
        Compiled in a child first: a grammar that crashes the compiler kills only it."""
        try:
            text = build()
            if left_s <= 0:
                raise TooSlow("no time left")
            crashed = check.check(text, left_s) if check is not None else None
            if crashed is not None:
                raise RequestError(field, f"{field}: {_short(crashed)}")
            m = llg.LLMatcher(tok, text, log_level=0, limits=limits())
        except TooSlow:
            raise CompileTimeout(field, f"{field}: the grammar did not compile in time") from None
        except BaseException as e:  # ValueError, and llguidance's PanicException (a BaseException)
            if isinstance(e, KeyboardInterrupt | SystemExit | RequestError):
                raise
            raise RequestError(field, f"{field}: {_short(str(e) or type(e).__name__)}") from None
        if m.is_error():
            raise RequestError(field, f"{field}: {_short(m.get_error())}")
        return m, GRAMMAR_BASE_BYTES + GRAMMAR_BYTES_PER_CHAR * len(text)

    def _finished(self, job: Job) -> None:
        """A compile ended (on a queue worker, no queue lock held): cached if someone
        still waited for it (an abandoned one is dropped), a refusal remembered (not
        a timeout: no verdict), the cache trimmed to its bytes."""
        error, digest = job.error, job.key
        assert isinstance(digest, bytes)
        with self._cache_lock:
            if isinstance(error, RequestError) and not isinstance(error, CompileTimeout):
                self.refused[digest] = str(error)
                while len(self.refused) > CACHE_ENTRIES:
                    self.refused.popitem(last=False)
                return
            if error is not None or job.result is None or not job.kept:
                return
            m, size = job.result
            if digest in self.cache:  # compiled twice (a race): counted once
                self._drop(digest)
            self.cache[digest] = (m, size)
            self.owner[digest] = job.tenant
            self.cache_bytes += size
            self.tenant_bytes[job.tenant] = self.tenant_bytes.get(job.tenant, 0) + size
            self._trim(job.tenant)

    def _trim(self, tenant: str) -> None:
        """The cache within its bytes and entries (oldest out first), and `tenant`
        within half of each while another tenant holds some: one tenant's flood of
        schemas cannot flush everyone's grammars (alone, it may use it all)."""
        mine = [d for d in self.cache if self.owner[d] == tenant]  # least recent first
        shared = len(self.tenant_bytes) > 1
        while (
            shared
            and len(mine) > 1
            and (
                self.tenant_bytes[tenant] > self.cache_max_bytes // 2
                or len(mine) > CACHE_ENTRIES // 2
            )
        ):
            self._drop(mine.pop(0))
        while self.cache and (
            self.cache_bytes > self.cache_max_bytes or len(self.cache) > CACHE_ENTRIES
        ):
            self._drop(next(iter(self.cache)))

    def _drop(self, digest: bytes) -> None:
        _, size = self.cache.pop(digest)
        owner = self.owner.pop(digest)
        self.cache_bytes -= size
        self.tenant_bytes[owner] -= size
        if not self.tenant_bytes[owner]:
            del self.tenant_bytes[owner]

    def matcher(
        self,
        response_format: Mapping[str, Any] | None = None,
        *,
        framing: Framing = Framing(),
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        gone: Callable[[], bool] | None = None,
        tenant: str = "",
    ) -> Matcher | None:
        """The request's matcher, or None when nothing constrains it.

        response_format: the normalized form from GenerateRequest (None,
            {"type": "json_object"}, {"type": "json_schema", "schema": ..., "strict": ...}).
        framing: the chat format's reasoning around the answer (Framing).
        tools, tool_choice: OpenAI's; "required" or a named function forces a call.
        gone: true once the client left (a compile is then no longer waited for).
        tenant: whose request it is (the gateway's tag of its API key): its share
            of the compile workers and its own cache entries.
        """
        from disagg_agents.decode import (
            grammarformats as grammarfmt,  # lark builders; only needed here
        )

        kind, budget = framing.kind, framing.analysis_max_tokens
        if kind not in KINDS:
            raise ValueError(f"unknown format kind {kind!r}")
        forced = grammarfmt.forced_tools(tools, tool_choice)
        if forced:
            lark = grammarfmt.tool_call_lark(forced, kind, budget)
            field = "tool_choice"
        elif response_format is not None and response_format.get("type") == "lark":
            return self._lark(str(response_format["grammar"]), framing, gone, tenant)
        elif response_format is not None and response_format.get("type") != "text":
            schema = json_schema_of(response_format)
            if kind != "harmony":
                return self._json(schema, framing, gone, tenant)
            lark = grammarfmt.harmony_final_lark(schema, budget)
            field = "response_format"
        else:
            return None
        m = self.compile(
            "lark:" + lark, lambda: str(llg.LLMatcher.grammar_from_lark(lark)), field, gone, tenant
        )
        return framing.matcher(m.deep_copy(), self.eos)

    def _json(
        self,
        schema: Mapping[str, Any],
        framing: Framing,
        gone: Callable[[], bool] | None,
        tenant: str,
    ) -> Matcher:
        """A JSON schema's matcher, compiled by llguidance's own JSON compiler."""
        text = canonical(schema)

        def from_schema() -> str:
            return str(
                llg.LLMatcher.grammar_from_json_schema(
                    text,
                    overrides=JSON_OPTIONS,  # type: ignore[arg-type]
                )
            )

        m = self.compile("json:" + text, from_schema, "response_format", gone, tenant)
        f = framing
        return Matcher(m.deep_copy(), self.eos, f.trigger, f.analysis_max_tokens, f.opener)

    def _lark(
        self, lark: str, framing: Framing, gone: Callable[[], bool] | None, tenant: str
    ) -> Matcher:
        """A caller's Lark grammar for the answer (harmony: its final message)."""
        from disagg_agents.decode import grammarformats as grammarfmt

        kind = framing.kind
        grammar = grammarfmt.lark_answer(lark, kind, framing.analysis_max_tokens)
        key = "grammar:" + kind + ":" + grammar
        m = self.compile(key, lambda: grammar, "response_format", gone, tenant)
        return framing.matcher(m.deep_copy(), self.eos)

    # -- masks for a batch -------------------------------------------------------

    def masks(self, matchers: list[Matcher | None]) -> np.ndarray:
        """[B, vocab] bool: the tokens each row may take (all for rows without a
        matcher or whose grammar ended). One parallel llguidance call for the
        active rows."""
        bits = np.full((len(matchers), self.words), -1, dtype=np.int32)
        active = [
            (m.inner, i)
            for i, m in enumerate(matchers)
            if m is not None and m.active and not m.failed and not m.inner.is_stopped()
        ]
        if len(active) == 1:  # e.g. a first token, on its request's own thread
            m, i = active[0]
            m.unsafe_compute_mask_ptr(bits[i].ctypes.data, bits[i].nbytes)
        elif active:
            llg_np.fill_next_token_bitmask_par(self._executor, active, bits)
        allowed = unpack(bits, self.vocab_size)
        eos = [t for t in self.eos if t < self.vocab_size]
        for i, m in enumerate(matchers):
            if m is None or m.active:
                continue
            forced = m.forced()
            if forced is not None:
                allowed[i] = False
                allowed[i, forced] = True
            elif eos:
                allowed[i, eos] = False  # before its trigger: anything but the end
        return allowed


def cache_key(key: str, tenant: str = "") -> bytes:
    """The cache's key of a grammar for a tenant (the tenant's length first: no
    tenant's tag can run into the grammar's text)."""
    return hashlib.sha256(f"{len(tenant)}:{tenant}|{key}".encode()).digest()


def _env_mb(name: str, default: int) -> int:
    raw = os.environ.get(name)
    try:
        return int(float(raw) * (1 << 20)) if raw else default
    except ValueError:
        return default


def _tokenizer_json(hf: Any) -> str:
    """The Rust tokenizer's JSON (with the added tokens), as llguidance.hf takes it,
    without its isinstance check (transformers 5 renamed the fast class)."""
    backend = hf
    for _ in range(3):  # mlx-lm's wrapper -> transformers' tokenizer -> the Rust one
        if hasattr(backend, "to_str"):
            break
        inner = getattr(backend, "backend_tokenizer", None)
        backend = inner or getattr(backend, "_tokenizer", None)
    if not hasattr(backend, "to_str"):
        raise RuntimeError("it needs a fast (Rust) Hugging Face tokenizer")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return _added_as_text(str(backend.to_str()))


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map, as byte-level BPE vocabs write bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _added_as_text(tokenizer_json: str) -> str:
    """llguidance takes every added token for a special one (matched only by id), but
    a byte-level vocab's non-special added tokens (Qwen's <tool_call>, <think>) are
    text the model writes: move them into the vocab, spelled as the vocab spells
    bytes, so grammars match them as the text they are."""
    data = json.loads(tokenizer_json)
    model = data.get("model") or {}
    byte_level = "ByteLevel" in json.dumps(data.get("decoder"))
    if model.get("type") != "BPE" or not byte_level or not isinstance(model.get("vocab"), dict):
        return tokenizer_json
    chars = _byte_chars()
    keep = []
    for added in data.get("added_tokens") or []:
        if added.get("special", True):
            keep.append(added)
        else:
            spelled = "".join(chars[b] for b in str(added["content"]).encode())
            model["vocab"][spelled] = added["id"]
    data["added_tokens"] = keep
    return json.dumps(data)


def unpack(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 bitmask words [B, W] -> bool [B, vocab] (bit j of word w = token 32w+j)."""
    return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].astype(
        bool
    )


def json_schema_of(response_format: Mapping[str, Any]) -> dict[str, Any]:
    """The schema a normalized response_format asks for ({} : any JSON object)."""
    if response_format.get("type") == "json_object":
        return {"type": "object"}
    schema = response_format.get("schema")
    return closed(schema) if isinstance(schema, Mapping) else {}


def canonical(schema: Any) -> str:
    """The cache key and the text compiled. Key order is kept: it is the order
    the properties are written in."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _short(error: str) -> str:
    """llguidance's error's first line (verbose ones carry the parser state)."""
    line = " ".join(x.strip() for x in error.strip().splitlines() if x.strip()) or "invalid"
    if line.startswith("Unimplemented keys"):
        line = f"JSON Schema keywords not supported by constrained decoding: {line[20:].strip()}"
    return printable(line, 300)  # a schema's `pattern` may carry ESC bytes into our logs
