"""The architecture's import rules, held by reading every module's imports.

Each rule is a function that returns what breaks it (empty: the rule holds);
`RULES` runs each on the project and, beside it, on a small tree planted with one
violation, which the rule must find: a rule that stops matching anything (a
renamed package) fails there.

- `disagg_agents` ships alone to the hosts: it never imports `disagg`.
- Only `disagg.cli` imports typer; nothing imports `disagg.cli`.
- rich only in `disagg.cli` and the benchmarks' tables (`disagg.bench`).
- Arrows run one way, up: `disagg.serving` (what the API is built on) and
  `disagg.fleet` never import the front doors, serving never imports the API,
  the API never imports the front doors (`disagg.frontends`).
- The benchmarks (`disagg.bench`) sit beside the serving path, never on it: no
  module under `disagg.bench` is reachable from the front doors, serving, the
  API, the fleet, the agents or `disagg serve`'s own module, walking every
  import (those inside functions too, and the packages each one runs).
- Each front door's request and answer types (`disagg.frontends.<api>.types`)
  stand apart from its routes: they reach no routes module and no fastapi; no
  front door reaches another (`app` mounts them all; what they share is
  `disagg.frontends.core`, `apirequest` and `refusal`), and the guard reaches none.
- Each API maps its body straight onto the one GenerateRequest: only OpenAI's
  front door knows OpenAI's chat body (`ChatRequest`), by any path.
- The answer is typed to the end: no module of `disagg` reads a field of the
  agents' answer (Metrics, ToolCall, AgentStatus) by its string key.
- The agents ship no fault injection.
- The groups of `disagg_agents` import only the groups `AGENT_ARROWS` allows
  (decode and prefill never each other; wire nothing), every group has its
  arrows, and the wire loads no framework; the control plane (outside the
  benchmarks) uses only `CONTROL_PLANE_AGENTS` of the agents.
- No import circle in either package, imports under `if TYPE_CHECKING:` included.
- No private name (`_x`) of our modules is imported from another module.
"""

from __future__ import annotations

import ast
import dataclasses
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest

from disagg_agents.wire.answer import Metrics, ToolCall
from disagg_agents.wire.status import STATUS_FIELDS
from disagg_agents.wire.timeline import PHASES

REPO = Path(__file__).resolve().parent.parent


# -- reading imports ----------------------------------------------------------------


def imports(path: Path) -> set[str]:
    """Top-level names of every module a file imports, at any depth in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def violations(package: str, forbidden: str, allowed_under: tuple[str, ...] = ()) -> list[str]:
    out = []
    for path in modules(package):
        rel = path.relative_to(REPO).as_posix()
        if any(rel.startswith(a) for a in allowed_under):
            continue
        for name in imports(path):
            if name == forbidden or name.startswith(forbidden + "."):
                out.append(f"{rel} imports {name}")
    return out


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def resolved_imports(path: Path, *, typing_too: bool = False) -> set[str]:
    """Every module a file imports, relative ones made absolute; names imported
    from a package count as its submodules where such a file exists. Imports
    under `if TYPE_CHECKING:` only with `typing_too`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    skip: set[int] = set()
    if not typing_too:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip.update(id(n) for n in ast.walk(node))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            for a in node.names:
                sub = REPO.joinpath(*f"{mod}.{a.name}".split("."))
                if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
                    out.add(f"{mod}.{a.name}")
    return out


def our_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in ("disagg", "disagg_agents") for p in modules(pkg)}


def imported_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """Our modules a file imports (`resolved_imports`: at any depth in the file,
    under TYPE_CHECKING too), with the packages above each: their `__init__` runs."""
    found: set[str] = set()
    for target in resolved_imports(path, typing_too=True):
        parts = target.split(".")
        found.update(
            m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in known
        )
    return found


def reachable(
    roots: list[str], known: dict[str, Path], opaque: tuple[str, ...] = ()
) -> dict[str, str]:
    """Every module reachable from `roots`, each with the chain that reaches it.
    `opaque` modules are reached but not walked into."""
    chain = {r: r for r in roots}
    todo = deque(roots)
    while todo:
        mod = todo.popleft()
        if mod in opaque:
            continue
        for nxt in sorted(imported_modules(known[mod], known)):
            if nxt not in chain:
                chain[nxt] = f"{chain[mod]} -> {nxt}"
                todo.append(nxt)
    return chain


def names_in(path: Path) -> set[str]:
    """Every name a file defines, uses or imports (classes, attributes, aliases)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            out.add(node.name)
        elif isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.alias):
            out.update(n for n in (node.name.rpartition(".")[2], node.asname) if n)
    return out


# -- the rules: each returns what breaks it -----------------------------------------


def agents_never_import_disagg() -> list[str]:
    return violations("disagg_agents", "disagg")


def only_cli_imports_typer() -> list[str]:
    return violations("disagg", "typer", ("disagg/cli/",)) + violations("disagg_agents", "typer")


def nothing_imports_the_cli() -> list[str]:
    return violations("disagg", "disagg.cli", ("disagg/cli/",)) + violations(
        "disagg_agents", "disagg.cli"
    )


def rich_only_in_cli_and_bench() -> list[str]:
    return violations("disagg", "rich", ("disagg/cli/", "disagg/bench/")) + violations(
        "disagg_agents", "rich"
    )


def serving_and_fleet_import_no_api_or_front_door() -> list[str]:
    return (
        violations("disagg/serving", "disagg.api")
        + violations("disagg/serving", "disagg.frontends")
        + violations("disagg/fleet", "disagg.frontends")
    )


def the_api_imports_no_front_door() -> list[str]:
    api = REPO / "disagg" / "api.py"
    return [f"disagg/api.py imports {n}" for n in imports(api) if n.startswith("disagg.frontends")]


def no_bench_module_on_the_serving_path() -> list[str]:
    known = our_modules()
    starts = ("disagg.frontends", "disagg.serving", "disagg.api", "disagg.fleet", "disagg_agents")
    roots = [m for m in known if any(m == s or m.startswith(s + ".") for s in starts)]
    # `disagg serve`'s module. The CLI package's __init__ registers every command,
    # the bench sub-app too, whose commands import the benches only when they run
    # (tests/test_bench_cli.py checks what a real process loads): not walked into.
    roots.append("disagg.cli.commands")
    chain = reachable(roots, known, opaque=("disagg.cli",))
    return [c for m, c in chain.items() if m.startswith("disagg.bench")]


FRONT_DOORS = ("openai", "ollama", "anthropic", "responses")
# Every front door, the web view too: what they share lives in disagg/frontends/
# (core: the run, refusals, usage; apirequest: the one request's builder; agentinfo),
# never in another.
ALL_DOORS = ("openai", "ollama", "anthropic", "responses", "embeddings", "webview")


def door_modules(known: dict[str, Path], api: str) -> list[str]:
    return [m for m in known if m.startswith(f"disagg.frontends.{api}.")]


def front_door_types_stand_apart() -> list[str]:
    known = our_modules()
    out = []
    for api in FRONT_DOORS:
        types = f"disagg.frontends.{api}.types"
        if types not in known:
            out.append(f"no {types}")
            continue
        chain = reachable([types], known)
        out += [c for m, c in chain.items() if m.rpartition(".")[2] == "routes"]
        out += [
            f"{types} imports {n}" for n in imports(known[types]) if n.split(".")[0] == "fastapi"
        ]
    return out


def front_doors_import_no_other() -> list[str]:
    known = our_modules()
    out = []
    for api in ALL_DOORS:
        chain = reachable(door_modules(known, api), known) if door_modules(known, api) else {}
        out += [] if chain else [f"no front door {api}"]
        others = tuple(f"disagg.frontends.{d}" for d in ALL_DOORS if d != api)
        out += [c for m, c in chain.items() if m.startswith(others)]
    return out


def only_openai_knows_openais_chat_body() -> list[str]:
    # Anthropic's and Responses' bodies once went through OpenAI's chat body on
    # their way to the one request; each maps straight onto GenerateRequest now.
    known = our_modules()
    out = []
    for api in (d for d in ALL_DOORS if d != "openai"):
        chain = reachable(door_modules(known, api), known)
        out += [
            c
            for m, c in chain.items()
            if m == "disagg.frontends.chat" or "ChatRequest" in names_in(known[m])
        ]
    return out


def the_guard_reaches_no_front_door() -> list[str]:
    known = our_modules()
    chain = reachable(["disagg.frontends.guard"], known)
    doors = tuple(f"disagg.frontends.{d}" for d in ALL_DOORS)
    return [c for m, c in chain.items() if m.startswith(doors)]


# The answer's field names a string key could read: Metrics', its Timeline's,
# ToolCall's and AgentStatus's with its nested documents' (disagg_agents.wire parses
# each from the wire's JSON, once). Names that are every JSON body's words are left
# to the types: a tool call's name and arguments, a status's model, backend, device,
# requests, errors, batch and chat, the chat facts' template (a tokenizer config's
# too), a timeline's at and done (Ollama's chunks say done too).
GENERIC = {
    *("name", "arguments", "model", "backend", "device", "requests", "errors", "batch"),
    *("template", "at", "done"),
}
ANSWER_FIELDS = (
    (
        {f.name for f in dataclasses.fields(Metrics)} - {"extra"}
        | set(PHASES)
        | {f.name for f in dataclasses.fields(ToolCall)}
        | STATUS_FIELDS
    )
    - GENERIC
    - {"chat"}
)


def answer_key_reads(path: Path, rel: str) -> list[str]:
    """`x["field"]` and `x.get("field")` reads of the answer's field names, whatever
    the document read: no module has its own reader of them (`disagg status`
    included: AgentStatus names the fields an agent sent with another type)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
        ):
            key = node.args[0]
        else:
            continue
        if isinstance(key, ast.Constant) and key.value in ANSWER_FIELDS:
            out.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return out


def no_answer_field_read_by_its_string_key() -> list[str]:
    # The benchmarks' reports are their own JSON documents, named as the metrics are.
    return [
        hit
        for p in modules("disagg")
        if not (rel := p.relative_to(REPO).as_posix()).startswith("disagg/bench/")
        for hit in answer_key_reads(p, rel)
    ]


def the_agents_ship_no_fault_injection() -> list[str]:
    # Tests stretch the K/V stream with their own wrapper (tests/slowprefill.py).
    return [
        p.relative_to(REPO).as_posix()
        for p in modules("disagg_agents")
        if "--fault" in p.read_text() or "layer_delay" in p.read_text()
    ]


# Which groups of `disagg_agents` each group may import. wire/ is bytes only (the
# one seam both processes and the control plane share); decode and prefill are two
# processes and never import each other: what both use lives in runtime/ (the
# grammar compile check, the hang-up probe) or below.
AGENT_ARROWS: dict[str, set[str]] = {
    "wire": set(),
    "prefix": set(),
    "chatformat": set(),
    "models": set(),
    "quant": {"models", "wire"},
    "runtime": {"wire", "models", "prefix"},
    "decode": {"wire", "runtime", "models", "quant", "prefix", "chatformat"},
    "prefill": {"wire", "runtime", "models", "quant", "prefix"},
}
# What the control plane may use of the agents (outside the benchmarks, which
# run engines in-process): the wire, the runtime's shared services (the grammar
# compile check) and what reads a model directory.
CONTROL_PLANE_AGENTS = {"wire", "runtime", "models", "quant"}
# Third-party frameworks a wire module must never load: it ships to both roles.
HEAVY = ("torch", "mlx", "mlx_lm", "transformers", "llguidance")


def agent_group(module: str) -> str | None:
    """The group of `disagg_agents` a module is in (`decode` for
    `disagg_agents.decode.stream`), None for any other module."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "disagg_agents" else None


def agent_groups_import_only_their_arrows() -> list[str]:
    bad = []
    for path in modules("disagg_agents"):
        mine = agent_group(module_name(path))
        if mine is None or mine not in AGENT_ARROWS:
            continue
        for name in resolved_imports(path, typing_too=True):
            theirs = agent_group(name)
            if theirs and theirs != mine and theirs not in AGENT_ARROWS[mine]:
                bad.append(f"{module_name(path)} imports {name}")
    return bad


def every_agent_group_has_arrows() -> list[str]:
    groups = {p.name for p in (REPO / "disagg_agents").iterdir() if (p / "__init__.py").exists()}
    return [
        f"disagg_agents/{g} has no arrows in AGENT_ARROWS"
        for g in sorted(groups - set(AGENT_ARROWS))
    ]


def the_wire_loads_no_framework() -> list[str]:
    return [
        f"{module_name(p)} imports {n}"
        for p in modules("disagg_agents/wire")
        for n in resolved_imports(p, typing_too=True)
        if n.split(".")[0] in HEAVY
    ]


def the_control_plane_uses_only_its_agent_groups() -> list[str]:
    bad = []
    for path in modules("disagg"):
        if path.relative_to(REPO).as_posix().startswith("disagg/bench/"):
            continue
        for name in resolved_imports(path, typing_too=True):
            group = agent_group(name)
            if group and group not in CONTROL_PLANE_AGENTS:
                bad.append(f"{module_name(path)} imports {name}")
    return bad


def import_graph(*packages: str) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for package in packages:
        for path in modules(package):
            graph[module_name(path)] = set()
    for package in packages:
        for path in modules(package):
            me = module_name(path)
            found = resolved_imports(path, typing_too=True)
            graph[me] = {n for n in found if n in graph and n != me}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan). A
    package's `__init__` importing its own submodules is not a circle of two
    jobs: those edges are left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def edges(v: str) -> set[str]:
        return {w for w in graph[v] if not w.startswith(v + ".")}

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def no_import_circles() -> list[str]:
    return [" <-> ".join(c) for c in cycles(import_graph("disagg_agents", "disagg"))]


def private_imports(path: Path) -> list[str]:
    """`from x import _name` of our own modules, and `module._name` on a module
    this file imported by name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            top = (node.module or "").split(".")[0]
            ours = node.level > 0 or top in ("disagg_agents", "disagg")
            for a in node.names:
                if ours and a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"{node.module}.{a.name}")
                sub = f"{node.module}.{a.name}"
                if ours and (REPO.joinpath(*sub.split(".")).with_suffix(".py")).exists():
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ("disagg_agents", "disagg"):
                    aliases.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            out.append(f"{node.value.id}.{node.attr}")
    return out


def no_private_names_cross_modules() -> list[str]:
    return [
        f"{module_name(p)}: {hit}"
        for package in ("disagg_agents", "disagg")
        for p in modules(package)
        for hit in private_imports(p)
    ]


# -- each rule, held on the project and caught on a planted violation ---------------


@dataclasses.dataclass(frozen=True)
class Rule:
    check: Callable[[], list[str]]
    planted: dict[str, str]  # a tree (path: source) with one violation of the rule
    finds: str  # what the rule's report of that violation says


RULES = [
    Rule(
        agents_never_import_disagg, {"disagg_agents/wire/x.py": "import disagg.api\n"}, "disagg.api"
    ),
    Rule(
        only_cli_imports_typer,
        {"disagg/api.py": "def f():\n    from typer import Option\n"},
        "disagg/api.py imports typer",
    ),
    Rule(
        nothing_imports_the_cli,
        {"disagg/serving/x.py": "import disagg.cli.render\n"},
        "disagg/serving/x.py imports disagg.cli",
    ),
    Rule(
        rich_only_in_cli_and_bench,
        {"disagg/fleet/x.py": "from rich.table import Table\n", "disagg/cli/x.py": "import rich\n"},
        "disagg/fleet/x.py imports rich.table",
    ),
    Rule(
        serving_and_fleet_import_no_api_or_front_door,
        {"disagg/fleet/x.py": "from disagg.frontends import app\n"},
        "disagg/fleet/x.py imports disagg.frontends",
    ),
    Rule(
        the_api_imports_no_front_door,
        {"disagg/api.py": "from disagg.frontends.core import run\n"},
        "disagg.frontends.core",
    ),
    Rule(
        no_bench_module_on_the_serving_path,
        {
            "disagg/serving/b.py": "def f():\n    from disagg.bench import run\n",
            "disagg/bench/run.py": "",
            "disagg/cli/commands.py": "",
        },
        "disagg.serving.b -> disagg.bench.run",
    ),
    Rule(
        front_door_types_stand_apart,
        {
            "disagg/frontends/ollama/types.py": "from disagg.frontends.ollama import routes\n",
            "disagg/frontends/ollama/routes.py": "",
        },
        "disagg.frontends.ollama.types -> disagg.frontends.ollama.routes",
    ),
    Rule(
        front_doors_import_no_other,
        {
            "disagg/frontends/openai/routes.py": "from disagg.frontends.core import x\n",
            "disagg/frontends/core.py": "def x():\n    from disagg.frontends.webview import auth\n",
            "disagg/frontends/webview/auth.py": "",
        },
        "disagg.frontends.openai.routes -> disagg.frontends.core -> disagg.frontends.webview",
    ),
    Rule(
        only_openai_knows_openais_chat_body,
        {
            "disagg/frontends/anthropic/routes.py": "from disagg.frontends import core\n",
            "disagg/frontends/core.py": "class ChatRequest:\n    pass\n",
        },
        "disagg.frontends.anthropic.routes -> disagg.frontends.core",
    ),
    Rule(
        the_guard_reaches_no_front_door,
        {
            "disagg/frontends/guard.py": "from disagg.frontends.embeddings.types import E\n",
            "disagg/frontends/embeddings/types.py": "",
        },
        "disagg.frontends.guard -> disagg.frontends.embeddings",
    ),
    Rule(
        no_answer_field_read_by_its_string_key,
        {"disagg/serving/x.py": 'def f(m):\n    return m["ttft"]\n'},
        "disagg/serving/x.py:2 m['ttft']",
    ),
    Rule(
        the_agents_ship_no_fault_injection,
        {"disagg_agents/decode/x.py": 'FLAG = "--fault"\n'},
        "disagg_agents/decode/x.py",
    ),
    Rule(
        agent_groups_import_only_their_arrows,
        {
            "disagg_agents/prefill/embed.py": "from disagg_agents.decode.upfront import gone\n",
            "disagg_agents/decode/upfront.py": "",
        },
        "disagg_agents.prefill.embed imports disagg_agents.decode.upfront",
    ),
    Rule(
        every_agent_group_has_arrows,
        {"disagg_agents/extra/__init__.py": "", "disagg_agents/wire/__init__.py": ""},
        "disagg_agents/extra has no arrows",
    ),
    Rule(
        the_wire_loads_no_framework,
        {
            "disagg_agents/wire/x.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
            )
        },
        "disagg_agents.wire.x imports torch",
    ),
    Rule(
        the_control_plane_uses_only_its_agent_groups,
        {
            "disagg/frontends/responses/types.py": "from disagg_agents.decode import grammar\n",
            "disagg_agents/decode/grammar.py": "",
        },
        "disagg.frontends.responses.types imports disagg_agents.decode",
    ),
    Rule(
        no_import_circles,
        {
            "disagg/a.py": "from disagg import b\n",
            "disagg/b.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import a\n",
        },
        "disagg.a <-> disagg.b",
    ),
    Rule(
        no_private_names_cross_modules,
        {"disagg/x.py": "from disagg_agents.wire.frames import _X\n"},
        "disagg.x: disagg_agents.wire.frames._X",
    ),
]


def rule_id(rule: Rule) -> str:
    return rule.check.__name__


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_the_rule_holds(rule: Rule) -> None:
    assert rule.check() == []


@pytest.mark.parametrize("rule", RULES, ids=rule_id)
def test_the_rule_finds_its_planted_violation(
    rule: Rule, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for rel, source in rule.planted.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    found = rule.check()
    assert any(rule.finds in f for f in found), found


def test_every_rule_is_in_the_table() -> None:
    # A rule written but not listed would be neither held nor planted.
    listed = {rule_id(r) for r in RULES}
    written = {
        name
        for name, f in globals().items()
        if callable(f)
        and getattr(f, "__module__", None) == __name__
        and f.__annotations__.get("return") == "list[str]"
        and not f.__code__.co_argcount
    }
    assert written == listed


# -- the readers the rules stand on ---------------------------------------------------


def test_the_answer_key_reader_sees_both_forms(tmp_path: Path) -> None:
    probe = tmp_path / "x.py"
    probe.write_text(
        'm["ttft"]\nc.metrics.get("method")\nd["arguments_text"]\nok["text"]\n'
        'st.get("prefix_disk")\nst["blas_threads"]\npc.get("hit_rate")\n'
    )
    # `disagg status`'s own module is held as any other: its /status reads included.
    assert [h.split(" ", 1)[1] for h in answer_key_reads(probe, "disagg/cli/render_fleet.py")] == [
        "m['ttft']",
        "c.metrics.get('method')",
        "d['arguments_text']",
        "st.get('prefix_disk')",
        "st['blas_threads']",
        "pc.get('hit_rate')",
    ]


def test_the_graph_walker_sees_lazy_relative_and_package_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "disagg"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "bench" / "__init__.py").write_text("")
    (pkg / "bench" / "x.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("def g():\n    from disagg import bench\n")
    (pkg / "c.py").write_text("import disagg.bench.x\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    known = our_modules()
    assert reachable(["disagg.a"], known)["disagg.bench"] == (
        "disagg.a -> disagg.b -> disagg.bench"
    )
    assert {"disagg", "disagg.bench", "disagg.bench.x"} <= set(reachable(["disagg.c"], known))
    assert "disagg.bench" not in reachable(["disagg.a"], known, opaque=("disagg.b",))


@pytest.mark.parametrize(
    "source, forbidden, expected",
    [
        ("import disagg.api\n", "disagg", ["x.py imports disagg.api"]),
        ("def f():\n    from typer import Option\n", "typer", ["x.py imports typer"]),
        ("from . import disagg\n", "disagg", []),  # relative: the package's own module
    ],
)
def test_the_rule_reader_sees_imports(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    source: str,
    forbidden: str,
    expected: list[str],
) -> None:
    # The checker itself must catch an import anywhere in a file, or the rules prove nothing.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "x.py").write_text(source)
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    found = violations("pkg", forbidden)
    assert [f.replace("pkg/", "") for f in found] == expected


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "p": {"p.x"}, "p.x": {"p"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_private_name_reader_sees_both_forms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "disagg_agents" / "wire").mkdir(parents=True)
    (tmp_path / "disagg_agents" / "wire" / "kvcodec.py").write_text("")
    path = tmp_path / "probe.py"
    path.write_text(
        "from disagg_agents.wire.frames import _X, Y\n"
        "from disagg_agents.wire import kvcodec\nkvcodec._z\n"
    )
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    assert private_imports(path) == ["disagg_agents.wire.frames._X", "kvcodec._z"]
