"""The fleet's inventory: hosts (how to reach them over SSH, their data-plane
addresses, roles and agent ports) and pipelines (which hosts serve which model).

Parsed from TOML and validated up front: every error names the file, the key
and the fix, so nothing is dialled with a broken inventory.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from disagg.errors import DisaggError, UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROLES = ("prefill", "decode")
SERVICES = ("auto", "systemd", "launchd", "nohup")
DTYPES = ("auto", "float32", "float16", "bfloat16")
INTEGRITY = ("mac", "none")  # disagg_agents.wire.INTEGRITY, default first
# The seeds' ports: prefill 8000, decode 8001; control endpoints beside them.
DEFAULT_PORTS = {"prefill": (8000, 8010), "decode": (8001, 8011)}
DEFAULT_TIMEOUTS_S = {"prefill": 60.0, "decode": 180.0}
ENV_VAR = "DISAGG_INVENTORY"
# A Linux CPU list as taskset -c and cpuset take it: "0", "0-3", "0,2,4-7".
CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")
DEFAULT_FILE = "inventory.toml"

HOST_KEYS = {
    "ssh",
    "user",
    "port",
    "key",
    "proxy_jump",
    "data",
    "roles",
    "python",
    "remote_dir",
    "service",
    "cpus",
    *ROLES,
}
PIPELINE_KEYS = {
    "prefill",
    "decode",
    "prefill_model",
    "decode_model",
    "prefill_timeout",
    "decode_timeout",
    "max_migrations",
    "dtype",
    "aliases",
    "mixed_weights",
    "integrity",
    "embedding_model",
    "prefix_disk",
    "prefix_disk_mb",
}
# An embedding pipeline runs prefill agents only: these keys belong to a decode side.
DECODE_ONLY_KEYS = (
    "decode",
    "decode_model",
    "decode_timeout",
    "max_migrations",
    "mixed_weights",
    "prefix_disk",
    "prefix_disk_mb",
)
# A decode agent's prefix disk tier: a directory on its host (relative: under the
# host's remote_dir) and its budget (0: off), as `serve --local` has it by default.
DEFAULT_PREFIX_DISK = "prefix-disk"
DEFAULT_PREFIX_DISK_MB = 4096.0
SSH_KEYS = {"config", "known_hosts", "connect_timeout"}


class InventoryError(DisaggError):
    """The inventory file is missing, unreadable or invalid."""


@dataclass(frozen=True)
class AgentPorts:
    port: int  # the data (KV / generate) TCP port
    control_port: int  # the HTTP control port: /health, /status


@dataclass(frozen=True)
class Host:
    name: str
    ssh: str  # an address or an ssh-config alias
    user: str | None = None  # None: ssh config's User, else the local user
    port: int | None = None  # None: ssh config's Port, else 22
    key: str | None = None  # None: ssh config's IdentityFile, else ssh-agent / ~/.ssh/id_*
    proxy_jump: str | None = None  # None: ssh config's ProxyJump, if any
    data: tuple[str, ...] = ()  # data-plane addresses, fastest first
    roles: dict[str, AgentPorts] = field(default_factory=dict)
    python: str | None = None  # None: deploy prepares a venv under remote_dir
    remote_dir: str = "~/.disagg"
    service: str = "auto"
    cpus: str | None = None  # Linux CPU list the agents are pinned to (taskset -c); None: all

    def addresses(self) -> list[str]:
        """Where this host's agents may be reached: data plane first, then the ssh address."""
        out = list(self.data)
        if self.ssh not in out and _looks_like_address(self.ssh):
            out.append(self.ssh)
        return out


@dataclass(frozen=True)
class Pipeline:
    name: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    prefill_model: str
    decode_model: str
    prefill_timeout: float = DEFAULT_TIMEOUTS_S["prefill"]
    decode_timeout: float = DEFAULT_TIMEOUTS_S["decode"]
    dtype: str = "auto"
    aliases: tuple[str, ...] = ()
    # Prefill and decode on different weights (e.g. bf16 prefill, 4-bit decode): the
    # agents refuse that unless told; results then say weights: "mixed".
    mixed_weights: bool = False
    # Frames between agents after the handshake: "mac" tags each one (altered K/V
    # is refused before it is placed or cached), "none" trusts the link (docs/threat-model.md).
    integrity: str = "mac"
    # Times one request may move to another decode agent mid-answer (0: never).
    max_migrations: int = 2
    # An embedding model with no decode side (`embedding_model = ...`): its prefill
    # agents answer /api/embed and /v1/embeddings; chat and generate are refused.
    embedding: bool = False
    # The decode agents' prefix disk tier: prompt K/V kept across their restarts.
    prefix_disk: str = DEFAULT_PREFIX_DISK
    prefix_disk_mb: float = DEFAULT_PREFIX_DISK_MB


@dataclass(frozen=True)
class SshSettings:
    config: str | None = "~/.ssh/config"  # None: read no ssh config at all
    known_hosts: str = "~/.ssh/known_hosts"
    connect_timeout: float = 10.0


@dataclass(frozen=True)
class Agent:
    """One agent to run: a role on a host, with the model its pipelines give it."""

    host: Host
    role: str
    ports: AgentPorts
    model: str
    dtype: str
    pipelines: tuple[str, ...]
    allow_mixed: bool = False  # a decode agent of a mixed_weights pipeline
    # A decode agent's prefix disk tier (its first pipeline's): directory, budget (0: off).
    prefix_disk: str = DEFAULT_PREFIX_DISK
    prefix_disk_mb: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.host.name}/{self.role}"


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: dict[str, Host]
    pipelines: dict[str, Pipeline]
    ssh: SshSettings = SshSettings()

    def select(self, names: list[str] | None = None) -> list[Host]:
        """The named hosts (all when none are named), in inventory order."""
        if not names:
            return list(self.hosts.values())
        unknown = [n for n in names if n not in self.hosts]
        if unknown:
            raise UsageError(
                f"unknown host {unknown[0]!r} in {self.path}; known: {', '.join(self.hosts)}"
            )
        return [h for n, h in self.hosts.items() if n in names]

    def agents(self, hosts: list[Host] | None = None) -> list[Agent]:
        """The agents the pipelines place on `hosts` (all hosts when None)."""
        names = {h.name for h in hosts} if hosts is not None else set(self.hosts)
        found: dict[tuple[str, str], Agent] = {}
        for p in self.pipelines.values():
            for role, members, model in (
                ("prefill", p.prefill, p.prefill_model),
                ("decode", p.decode, p.decode_model),
            ):
                for name in members:
                    host = self.hosts[name]
                    key = (name, role)
                    mixed = role == "decode" and p.mixed_weights
                    if key in found:
                        a = found[key]
                        found[key] = replace(
                            a,
                            pipelines=(*a.pipelines, p.name),
                            allow_mixed=a.allow_mixed or mixed,
                        )
                    elif name in names:
                        found[key] = Agent(
                            host, role, host.roles[role], model, p.dtype, (p.name,), mixed
                        )
                        if role == "decode":
                            found[key] = replace(
                                found[key],
                                prefix_disk=p.prefix_disk,
                                prefix_disk_mb=p.prefix_disk_mb,
                            )
        order = list(self.hosts)
        return sorted(found.values(), key=lambda a: (order.index(a.host.name), a.role))

    def pipeline_for(self, model: str) -> Pipeline:
        """The pipeline serving `model`: its name or one of its aliases."""
        for p in self.pipelines.values():
            if model == p.name or model in p.aliases:
                return p
        names = ", ".join(self.pipelines) or "none"
        raise UsageError(f"no pipeline serves model {model!r} in {self.path}; pipelines: {names}")


def _looks_like_address(s: str) -> bool:
    return s.replace(".", "").isdigit() or ":" in s


def resolve_path(option: str | Path | None = None) -> Path:
    """The inventory file: -i/--inventory, else $DISAGG_INVENTORY, else ./inventory.toml."""
    if option:
        return Path(option).expanduser()
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path(DEFAULT_FILE)


def load(option: str | Path | None = None) -> Inventory:
    """Resolve, read and validate the inventory; InventoryError names file, key and fix."""
    path = resolve_path(option)
    if not path.exists():
        how = "-i/--inventory" if option else (ENV_VAR if os.environ.get(ENV_VAR) else "default")
        raise InventoryError(
            f"{path}: inventory not found ({how}); fix: create it (see the top-level "
            f"inventory.toml), or pass -i FILE or set {ENV_VAR}"
        )
    try:
        text = path.read_text()
    except OSError as e:
        raise InventoryError(
            f"{path}: cannot read the inventory ({e.strerror or e}); fix: check that it is a "
            "file you may read"
        ) from None
    except UnicodeDecodeError:
        raise InventoryError(f"{path}: not UTF-8 text; fix: point at the TOML inventory") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InventoryError(f"{path}: not valid TOML: {e}; fix: correct the syntax") from None
    return parse(data, path)


class _Checker:
    """Typed reads from the raw TOML, raising errors that name file and key."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, problem: str, fix: str) -> InventoryError:
        return InventoryError(f"{self.path}: {key}: {problem}; fix: {fix}")

    def table(self, raw: Any, key: str) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise self.fail(key, f"expected a table, got {type(raw).__name__}", f"write [{key}]")
        return raw

    def known(self, raw: dict[str, Any], key: str, allowed: set[str]) -> None:
        for k in raw:
            if k not in allowed:
                hint = ", ".join(sorted(allowed))
                raise self.fail(f"{key}.{k}", "unknown key", f"remove it or use one of: {hint}")

    def text(self, raw: dict[str, Any], key: str, name: str, required: bool = False) -> str | None:
        val = raw.get(name)
        if val is None:
            if required:
                raise self.fail(f"{key}.{name}", "missing", f'add {name} = "..." to [{key}]')
            return None
        if not isinstance(val, str) or not val.strip():
            raise self.fail(f"{key}.{name}", f"expected a string, got {val!r}", "quote it")
        return val

    def port(self, raw: dict[str, Any], key: str, name: str, default: int | None) -> int | None:
        val = raw.get(name, default)
        if val is None:
            return None
        if not isinstance(val, int) or isinstance(val, bool) or not 1 <= val <= 65535:
            raise self.fail(f"{key}.{name}", f"not a port: {val!r}", "use an integer 1..65535")
        return val

    def strings(self, raw: dict[str, Any], key: str, name: str) -> tuple[str, ...]:
        val = raw.get(name, [])
        if isinstance(val, str):
            val = [val]
        if not isinstance(val, list) or not all(isinstance(v, str) and v for v in val):
            raise self.fail(f"{key}.{name}", f"expected a list of strings: {val!r}", "quote them")
        return tuple(val)

    def flag(self, raw: dict[str, Any], key: str, name: str) -> bool:
        val = raw.get(name, False)
        if not isinstance(val, bool):
            raise self.fail(f"{key}.{name}", f"expected true or false, got {val!r}", "unquote it")
        return val

    def seconds(self, raw: dict[str, Any], key: str, name: str, default: float) -> float:
        val = raw.get(name, default)
        if not isinstance(val, int | float) or isinstance(val, bool) or val <= 0:
            raise self.fail(f"{key}.{name}", f"not a positive number: {val!r}", "give seconds > 0")
        return float(val)

    def megabytes(self, raw: dict[str, Any], key: str, name: str, default: float) -> float:
        val = raw.get(name, default)
        if not isinstance(val, int | float) or isinstance(val, bool) or val < 0:
            raise self.fail(f"{key}.{name}", f"not a size: {val!r}", "give MB >= 0 (0: off)")
        return float(val)

    def count(self, raw: dict[str, Any], key: str, name: str, default: int) -> int:
        val = raw.get(name, default)
        if not isinstance(val, int) or isinstance(val, bool) or not 0 <= val <= 64:
            raise self.fail(f"{key}.{name}", f"not a count: {val!r}", "give a whole number 0-64")
        return val

    def cpu_list(self, raw: dict[str, Any], key: str, name: str) -> str | None:
        val = raw.get(name)
        if val is None:
            return None
        fix = f'quote a Linux CPU list, e.g. {name} = "0", "0-3" or "0,2,4-7"'
        if isinstance(val, int) and not isinstance(val, bool):
            # An integer reads as "how many CPUs" as easily as "CPU number N": make it explicit.
            raise self.fail(f"{key}.{name}", f"expected a CPU list string, got {val!r}", fix)
        text = val.replace(" ", "") if isinstance(val, str) else ""
        bad = not CPU_LIST.fullmatch(text)
        if not bad:
            for part in text.split(","):
                lo, _, hi = part.partition("-")
                bad = bad or (hi != "" and int(hi) < int(lo))
        if bad:
            raise self.fail(f"{key}.{name}", f"not a CPU list: {val!r}", fix)
        return text

    def choice(self, raw: dict[str, Any], key: str, name: str, options: tuple[str, ...]) -> str:
        val = raw.get(name, options[0])
        if val not in options:
            raise self.fail(f"{key}.{name}", f"unknown value {val!r}", f"use one of {options}")
        return str(val)


def _host(c: _Checker, name: str, raw: Any) -> Host:
    key = f"hosts.{name}"
    raw = c.table(raw, key)
    c.known(raw, key, HOST_KEYS)
    roles_raw = c.strings(raw, key, "roles")
    if not roles_raw:
        raise c.fail(f"{key}.roles", "missing", 'add roles = ["prefill"] or ["decode"] or both')
    roles: dict[str, AgentPorts] = {}
    for role in roles_raw:
        if role not in ROLES:
            raise c.fail(f"{key}.roles", f"unknown role {role!r}", f"use {' or '.join(ROLES)}")
        rkey = f"{key}.{role}"
        table = c.table(raw.get(role, {}), rkey)
        c.known(table, rkey, {"port", "control_port"})
        port = c.port(table, rkey, "port", DEFAULT_PORTS[role][0])
        control = c.port(table, rkey, "control_port", DEFAULT_PORTS[role][1])
        assert port is not None and control is not None
        roles[role] = AgentPorts(port, control)
    for role in ROLES:
        if role in raw and role not in roles:
            raise c.fail(
                f"{key}.{role}",
                f"ports given but {role!r} is not in roles",
                f'add "{role}" to {key}.roles or remove [{key}.{role}]',
            )
    seen: dict[int, str] = {}
    for role, ports in roles.items():
        for what, num in (("port", ports.port), ("control_port", ports.control_port)):
            where = f"{key}.{role}.{what}"
            if num in seen:
                raise c.fail(where, f"port {num} is also {seen[num]}", "give each agent port once")
            seen[num] = where
    return Host(
        name=name,
        ssh=c.text(raw, key, "ssh", required=True) or "",
        user=c.text(raw, key, "user"),
        port=c.port(raw, key, "port", None),
        key=c.text(raw, key, "key"),
        proxy_jump=c.text(raw, key, "proxy_jump"),
        data=c.strings(raw, key, "data"),
        roles=roles,
        python=c.text(raw, key, "python"),
        remote_dir=_remote_dir(c, raw, key),
        service=c.choice(raw, key, "service", SERVICES),
        cpus=c.cpu_list(raw, key, "cpus"),
    )


def _remote_dir(
    c: _Checker, raw: Any, key: str, name: str = "remote_dir", default: str = "~/.disagg"
) -> str:
    path = c.text(raw, key, name) or default
    # Every other character is quoted for the shell, systemd or launchd; a newline can't be.
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in path):
        raise c.fail(
            f"{key}.{name}",
            f"{path!r} holds a newline or control character",
            "choose a directory name without one",
        )
    return path


def _members(
    c: _Checker, raw: dict[str, Any], key: str, role: str, hosts: dict[str, Host]
) -> tuple[str, ...]:
    members = c.strings(raw, key, role)
    if not members:
        raise c.fail(f"{key}.{role}", "missing", f'add {role} = ["HOST"] naming a [hosts.HOST]')
    for h in members:
        if h not in hosts:
            known = ", ".join(hosts)
            raise c.fail(
                f"{key}.{role}",
                f"unknown host {h!r}",
                f"add [hosts.{h}] or use one of: {known}",
            )
        if role not in hosts[h].roles:
            raise c.fail(
                f"{key}.{role}",
                f"host {h!r} has no {role} role",
                f'add "{role}" to hosts.{h}.roles',
            )
    return members


def _embedding_pipeline(
    c: _Checker, name: str, raw: dict[str, Any], hosts: dict[str, Host]
) -> Pipeline:
    """`embedding_model` + `prefill` hosts: prefill agents only, nothing to decode."""
    key = f"pipelines.{name}"
    for k in (*DECODE_ONLY_KEYS, "prefill_model"):
        if k in raw:
            raise c.fail(
                f"{key}.{k}",
                "an embedding pipeline has no decode side and one model",
                f"remove {k} (or embedding_model, for a chat pipeline)",
            )
    model = c.text(raw, key, "embedding_model", required=True) or ""
    return Pipeline(
        name=name,
        prefill=_members(c, raw, key, "prefill", hosts),
        decode=(),
        prefill_model=model,
        decode_model="",
        prefill_timeout=c.seconds(raw, key, "prefill_timeout", DEFAULT_TIMEOUTS_S["prefill"]),
        dtype=c.choice(raw, key, "dtype", DTYPES),
        aliases=c.strings(raw, key, "aliases"),
        integrity=c.choice(raw, key, "integrity", INTEGRITY),
        max_migrations=0,
        embedding=True,
    )


def _pipeline(c: _Checker, name: str, raw: Any, hosts: dict[str, Host]) -> Pipeline:
    key = f"pipelines.{name}"
    raw = c.table(raw, key)
    c.known(raw, key, PIPELINE_KEYS)
    if "embedding_model" in raw:
        return _embedding_pipeline(c, name, raw, hosts)
    sides: dict[str, tuple[str, ...]] = {}
    for role in ROLES:
        sides[role] = _members(c, raw, key, role, hosts)
    return Pipeline(
        name=name,
        prefill=sides["prefill"],
        decode=sides["decode"],
        prefill_model=c.text(raw, key, "prefill_model", required=True) or "",
        decode_model=c.text(raw, key, "decode_model", required=True) or "",
        prefill_timeout=c.seconds(raw, key, "prefill_timeout", DEFAULT_TIMEOUTS_S["prefill"]),
        decode_timeout=c.seconds(raw, key, "decode_timeout", DEFAULT_TIMEOUTS_S["decode"]),
        dtype=c.choice(raw, key, "dtype", DTYPES),
        aliases=c.strings(raw, key, "aliases"),
        mixed_weights=c.flag(raw, key, "mixed_weights"),
        integrity=c.choice(raw, key, "integrity", INTEGRITY),
        max_migrations=c.count(raw, key, "max_migrations", 2),
        prefix_disk=_remote_dir(c, raw, key, "prefix_disk", DEFAULT_PREFIX_DISK),
        prefix_disk_mb=c.megabytes(raw, key, "prefix_disk_mb", DEFAULT_PREFIX_DISK_MB),
    )


def parse(data: dict[str, Any], path: Path) -> Inventory:
    """Validate raw TOML data into an Inventory."""
    c = _Checker(path)
    c.known(data, "(top level)", {"ssh", "hosts", "pipelines"})
    ssh_raw = c.table(data.get("ssh", {}), "ssh")
    c.known(ssh_raw, "ssh", SSH_KEYS)
    config = ssh_raw.get("config", "~/.ssh/config")
    if not isinstance(config, str):
        raise c.fail("ssh.config", f"expected a path, got {config!r}", '"" reads no ssh config')
    ssh = SshSettings(
        config=config or None,
        known_hosts=c.text(ssh_raw, "ssh", "known_hosts") or "~/.ssh/known_hosts",
        connect_timeout=c.seconds(ssh_raw, "ssh", "connect_timeout", 10.0),
    )
    hosts_raw = c.table(data.get("hosts", {}), "hosts")
    if not hosts_raw:
        raise c.fail("hosts", "no hosts", "add a [hosts.NAME] table per machine")
    hosts = {name: _host(c, name, raw) for name, raw in hosts_raw.items()}
    pipes_raw = c.table(data.get("pipelines", {}), "pipelines")
    pipelines = {name: _pipeline(c, name, raw, hosts) for name, raw in pipes_raw.items()}
    # One agent per role per host: two pipelines sharing it must agree on its model.
    placed: dict[tuple[str, str], tuple[str, str]] = {}
    for p in pipelines.values():
        for role, members, model in (
            ("prefill", p.prefill, p.prefill_model),
            ("decode", p.decode, p.decode_model),
        ):
            for h in members:
                prev = placed.setdefault((h, role), (p.name, model))
                if prev[1] != model:
                    raise c.fail(
                        f"pipelines.{p.name}.{role}_model",
                        f"host {h!r} already runs {role} for pipeline {prev[0]!r} with {prev[1]}",
                        f"one {role} agent per host: use another host or the same model",
                    )
    return Inventory(path=path, hosts=hosts, pipelines=pipelines, ssh=ssh)
