"""A request's limits, as units: schema size limits, the grammar pool (a bad grammar a
request error, compiles once, abandoned when the client leaves, the cache
bounded in bytes), the prompt-length check before tokenizing, and a hung-up
client seen without blocking."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from disagg_agents.decode.grammar import Grammars
from disagg_agents.runtime.hangup import client_gone
from disagg_agents.wire.answer import Metrics
from disagg_agents.wire.promptsize import max_token_bytes, too_long
from disagg_agents.wire.request import GenerateRequest, RequestError
from disagg_agents.wire.schemasize import ENUM_MAX, PROPERTIES_MAX, TOOLS_MAX_CHARS, shape


def deep(levels: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}}
    return s


def tool(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def wide(n: int, start: int = 0) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(start, n)}}


def test_shape_counts_without_recursion() -> None:
    assert shape(deep(5000))[0] == 2 * 5000 + 1  # no RecursionError
    assert shape({"enum": [1, 2, 3], "properties": {"a": {"enum": ["x"]}}})[1:] == (1, 4)


@pytest.mark.parametrize(
    "fields, field, words",
    [
        ({"response_format": deep(400)}, "response_format", "levels of nesting"),
        ({"tools": [tool("f", deep(400))], "tool_choice": "required"}, "tools", "nesting"),
        ({"tools": [tool("f", wide(8000))]}, "tools", "characters of JSON"),  # ~230 kB
        (
            {"tools": [tool(f"f{k}", {"description": "d" * 60_000}) for k in range(3)]},
            "tools",
            str(TOOLS_MAX_CHARS),
        ),
        ({"tools": [tool("f", wide(1200)), tool("g", wide(1200))]}, "tools", str(PROPERTIES_MAX)),
        ({"response_format": {"enum": list(range(ENUM_MAX + 1))}}, "response_format", "enum"),
    ],
)
def test_oversized_schemas_are_request_errors(
    fields: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(RequestError, match=words) as err:
        GenerateRequest.from_dict({"prompt": "x", **fields})
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_a_schema_within_the_limits_passes() -> None:
    GenerateRequest.from_dict({"prompt": "x", "tools": [tool("f", wide(1000))]})
    GenerateRequest.from_dict({"prompt": "x", "response_format": deep(20)})


# -- the grammar pool -------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.test_grammar import HARMONY

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=HARMONY,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(['{"a": 1, "name": "x"}'], trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>")
    eos: Any = hf.convert_tokens_to_ids("<|return|>")
    return Grammars(hf, 300, [eos], check=None)  # in-process: the fast tier starts no child


def test_the_compilers_own_failure_is_a_request_error(grammars: Grammars) -> None:
    # Past the request checks (a caller that skipped them): llguidance's
    # ValueError ("recursion limit exceeded") is the request's, not the agent's.
    with pytest.raises(RequestError, match="response_format: .*recursion") as err:
        grammars.matcher({"type": "json_schema", "schema": deep(400), "strict": False})
    assert err.value.field == "response_format"
    with pytest.raises(RequestError):  # remembered: refused again without compiling
        grammars.matcher({"type": "json_schema", "schema": deep(400), "strict": False})


LARK = 'start: "yes" | "no"'


def slow(seconds: float, text: str = LARK, done: threading.Event | None = None) -> Any:
    def build() -> str:
        time.sleep(seconds)
        import llguidance as llg

        out = str(llg.LLMatcher.grammar_from_lark(text))
        if done is not None:
            done.set()
        return out

    return build


def test_compiles_at_the_same_time_run_once(grammars: Grammars) -> None:
    before = grammars.misses
    out: list[Any] = []
    threads = [
        threading.Thread(target=lambda: out.append(grammars.compile("once", slow(0.5), "tools")))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(out) == 4 and len({id(m) for m in out}) == 1
    assert grammars.misses == before + 1


def test_a_hung_up_clients_compile_is_abandoned_and_not_cached(grammars: Grammars) -> None:
    built = threading.Event()
    with pytest.raises(RequestError, match="went away"):
        grammars.compile("gone", slow(3.0, done=built), "tools", gone=lambda: True)
    assert not built.is_set()  # it answered before the compile ended: it did not wait for it
    deadline = time.monotonic() + 30
    while sum(grammars.queue.snapshot().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    from disagg_agents.decode.grammar import cache_key

    assert not sum(grammars.queue.snapshot().values())
    assert cache_key("gone") not in grammars.cache


def test_over_its_budget_a_compile_is_a_request_error(grammars: Grammars) -> None:
    grammars.budget_s = 0.3
    try:
        with pytest.raises(RequestError, match="did not compile within 0.3s"):
            grammars.compile("late", slow(1.0), "response_format")
    finally:
        grammars.budget_s = 10.0


def test_the_cache_is_bounded_in_bytes(grammars: Grammars) -> None:
    grammars.cache_max_bytes = 600 << 10  # two small grammars' estimate
    try:
        for i in range(5):
            grammars.compile(f"bytes{i}", slow(0, f'start: "v{i}"'), "tools")
        assert grammars.cache_bytes <= grammars.cache_max_bytes
        assert 1 <= len(grammars.cache) <= 2
    finally:
        grammars.cache_max_bytes = 256 << 20


# -- before tokenizing --------------------------------------------------------------


class Vocab:
    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "Ġthe": 1, "<|im_start|>": 2}


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing() -> None:
    assert max_token_bytes(Vocab()) == len("<|im_start|>")
    big = GenerateRequest(prompt="x" * 3_900_000)
    why = too_long(big, 8192, 12)  # takes no tokenizer: it cannot have tokenized
    assert why and "context is 8192" in why
    # 8191 tokens' worth at the longest token: it might fit, so it is not refused here.
    assert too_long(GenerateRequest(prompt="x" * (8191 * 12)), 8192, 12) is None
    chat = GenerateRequest(messages=[{"role": "user", "content": "é" * 60_000}])
    assert too_long(chat, 8192, 12)  # bytes, not characters


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_a_client_that_hung_up_is_seen_without_blocking(timeout: float | None) -> None:
    # Blocking, or with a timeout Python polls for before a recv: a check that waited
    # would not return while b is silent and open.
    a, b = socket.socketpair()
    a.settimeout(timeout)
    seen: list[bool] = []

    def look() -> None:
        seen.append(client_gone(a))

    try:
        t = threading.Thread(target=look, daemon=True)
        t.start()
        t.join(25)  # a hang guard, under the 30 s timeout: the check reads only what is there
        assert seen == [False], "the check blocked on a silent, open peer"
        b.sendall(b"next request")
        assert not client_gone(a)  # data is not a hang-up
        a.recv(100)
        b.close()
        assert client_gone(a)
    finally:
        a.close()
        b.close()


# -- tenants: admission shares and what each sees ------------------------------------


def test_a_tenant_holds_its_share_and_another_is_served() -> None:
    from disagg.errors import Overloaded
    from disagg.frontends import tenancy
    from disagg.frontends.workers import Workers

    pool = Workers(2, limit=2, per_key=1)
    gate = threading.Event()
    a, b = b"a" * 32, b"b" * 32
    try:
        mark = tenancy.enter(a)
        held = pool.submit(lambda: (gate.wait(30), tenancy.current())[1])
        with pytest.raises(Overloaded, match="share of 1"):
            pool.submit(lambda: None)
        tenancy.leave(mark)
        mark = tenancy.enter(b)
        assert pool.submit(tenancy.current).result(10) == b  # the tenant rode along
        tenancy.leave(mark)
        gate.set()
        assert held.result(10) == a
    finally:
        gate.set()
        pool.shutdown()


def test_a_tenant_sees_its_own_requests_only() -> None:
    from disagg.frontends import tenancy
    from disagg.frontends.webview.tracker import RequestLog

    log = RequestLog(["m"])
    for who, prompt in ((b"a" * 32, "A's secret"), (b"b" * 32, "B's secret")):
        mark = tenancy.enter(who)
        t = log.begin("m", {"prompt": prompt})
        tenancy.leave(mark)
        log.end(t, Metrics(decode_server="127.0.0.1:9999", method="local"), None)
    mine = log.snapshot(b"a" * 32, everyone=False)
    assert [r["prompt"] for r in mine] == ["A's secret"]
    assert mine[0]["decode_server"] is None and "tenant" not in mine[0]
    assert {r["prompt"] for r in log.snapshot()} == {"A's secret", "B's secret"}
    assert log.snapshot(None, everyone=False) == []
    assert "agent_up" not in log.metrics.text(fleet=False)


# -- connections: the oldest silent one makes room ---------------------------------------


def test_a_full_reserve_evicts_its_oldest_unauthenticated_connection() -> None:
    from disagg_agents.runtime.gate import Gate

    gate = Gate(8, 2)  # 4 unauthenticated slots for strangers, 4 in loopback's reserve
    pairs = [socket.socketpair() for _ in range(6)]
    try:
        for a, _ in pairs[:4]:
            assert gate.admit("127.0.0.1", a) is None
        assert gate.admit("127.0.0.1", pairs[4][0]) is None  # full: the oldest goes
        assert pairs[0][1].recv(1) == b""  # shut down
        gate.release("127.0.0.1", authenticated=False, conn=pairs[0][0])  # its own: no-op
        assert gate.authenticated("127.0.0.1", pairs[1][0])
        assert gate.admit("127.0.0.1", pairs[5][0]) is None  # room, none evicted
        assert gate.open == 5 and gate.trusted_preauth == 4 and gate.evicted == 1
        assert gate.admit("127.0.0.1") is not None  # untracked: refused, as before
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_a_stranger_at_its_own_cap_is_refused_even_when_the_pool_is_full() -> None:
    from disagg_agents.runtime.gate import Gate

    gate = Gate(8, 2)  # 4 unauthenticated slots for strangers, 2 a peer
    pairs = [socket.socketpair() for _ in range(6)]
    try:
        for i, (a, _) in enumerate(pairs[:4]):
            assert gate.admit(f"10.0.0.{1 + i // 2}", a) is None
        # 10.0.0.1 holds its 2 (the oldest among them): a third is refused, not let evict.
        assert gate.admit("10.0.0.1", pairs[4][0]) is not None
        assert gate.evicted == 0 and gate.preauth == {"10.0.0.1": 2, "10.0.0.2": 2}
        # A newcomer takes the oldest stranger's slot.
        assert gate.admit("10.0.0.3", pairs[5][0]) is None
        assert gate.evicted == 1 and pairs[0][1].recv(1) == b""
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_gateway_admission_evicts_the_oldest_silent_connection() -> None:
    from disagg.frontends.limits import Admission, network_key

    class Conn:
        def __init__(self, addr: str) -> None:
            self.addr, self.gone = addr, False

        def evict(self) -> None:
            self.gone = True
            adm.release(self, self.addr)

    assert network_key("10.1.2.3") == network_key("10.1.2.200") == "10.1.2.0/24"
    assert network_key("2001:db8::1") == "2001:db8::/64"
    adm = Admission(total=4, per_address=3)
    silent = [Conn(f"127.1.0.{i}") for i in range(3)]
    for c in silent:
        assert adm.admit(c, c.addr)
        adm.waiting(c, c.addr)
    talker = Conn("127.1.0.9")  # the same /24, at its cap of 3: the oldest silent goes
    assert adm.admit(talker, talker.addr) and silent[0].gone
    adm.waiting(talker, talker.addr)
    adm.heard(talker)  # it sent its headers: never evicted
    others = [Conn(f"127.2.0.{i}") for i in range(3)]
    for c in others:  # the total of 4: each evicts the oldest silent anywhere
        assert adm.admit(c, c.addr)
        adm.waiting(c, c.addr)
    assert silent[1].gone and silent[2].gone and not talker.gone
    assert adm.count == 4
