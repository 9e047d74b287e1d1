"""`disagg deploy`: put the agents on each host and install them as services.

Per host, over one SSH session: detect the platform, upload disagg_agents/ (only files
whose content hash differs), check or prepare the role's Python, write each
agent's config, run script and auth token, and restart an agent that is running
with an older config. `dry_run` reports all that and changes nothing.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import disagg_agents
from disagg.errors import AgentError, AuthError, ModelError
from disagg.fleet import service
from disagg.fleet.inventory import Agent, Host, Inventory
from disagg.fleet.operations import HostSay, start_agent
from disagg.fleet.requirements import role_modules, role_requirements
from disagg.fleet.service import HostInfo, host_python, probe, remote_root, service_kind
from disagg.fleet.ssh import HostResult, Session, on_hosts, q
from disagg.fleet.token import load_token

HASH_SCRIPT = """
import hashlib, json, os, sys
root = sys.argv[1]
out = {}
for d, dirs, files in os.walk(root):
    dirs[:] = [x for x in dirs if x != "__pycache__"]
    for f in files:
        p = os.path.join(d, f)
        with open(p, "rb") as fh:
            out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
print(json.dumps(out))
"""

CHECK_SCRIPT = """
import importlib.util, json, sys
mods = sys.argv[1:]
print(json.dumps({"version": list(sys.version_info[:3]), "executable": sys.executable,
                  "missing": [m for m in mods if importlib.util.find_spec(m) is None]}))
"""


@dataclass
class HostDeploy:
    host: str
    platform: str = ""
    service: str = ""
    python: str = ""
    uploaded: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: int = 0
    configs_changed: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dry_run: bool = False


def local_manifest() -> dict[str, str]:
    """sha256 of every file of the agents package, by path relative to agents/."""
    root = Path(disagg_agents.__file__).parent
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _ensure_python(
    host: Host, session: Session, info: HostInfo, roles: list[str], dry: bool, say: HostSay
) -> str:
    py = host_python(host, info)
    mods = sorted({m for r in roles for m in role_modules(r)})
    res = session.run(f"{q(py)} -c {q(CHECK_SCRIPT)} {' '.join(mods)}")
    missing = json.loads(res.out)["missing"] if res.rc == 0 else mods
    if not missing:
        return py
    if host.python:
        extras = ",".join(roles)
        why = f"lacks {', '.join(missing)}" if res.rc == 0 else "does not run"
        raise AgentError(
            f"{host.name}: python {py} {why}; fix: pip install 'disagg[{extras}]' with it, or "
            f"remove hosts.{host.name}.python so deploy prepares a venv"
        )
    reqs = sorted({r for role in roles for r in role_requirements(role)})
    if dry:
        say(host.name, f"would create {py} and pip install {' '.join(reqs)}")
        return py
    if not info.python3:
        raise AgentError(f"{host.name}: no python3 on the host; fix: install Python 3.10+ there")
    venv = py.rsplit("/bin/", 1)[0]
    say(
        host.name, f"preparing {venv} ({', '.join(missing)} missing): pip install, may take minutes"
    )
    session.check(f"{q(info.python3)} -m venv {q(venv)}", timeout_s=300)
    _pip_install(host, session, py, venv, reqs)
    return py


def _pip_install(host: Host, session: Session, py: str, venv: str, reqs: list[str]) -> None:
    """pip as the host's user, so its own pip config (an offline wheelhouse, a private
    index) applies; a failure is one line with pip's last word, not its whole log."""
    pip = f"{q(py)} -m pip install -q --upgrade pip && {q(py)} -m pip install -q"
    res = session.run(f"{pip} {' '.join(q(r) for r in reqs)}", timeout_s=3600)
    if res.rc != 0:
        lines = (res.err or res.out).strip().splitlines()
        why = lines[-1] if lines else f"exit status {res.rc}"
        raise AgentError(
            f"{host.name}: pip install into {venv} failed: {why}; fix: let the host reach a "
            "package index, or point its pip at a wheelhouse (docs/fleet.md), or set "
            f"hosts.{host.name}.python to a python that has the packages"
        )


def _upload_agents(
    host: Host, session: Session, info: HostInfo, result: HostDeploy, dry: bool, py: str
) -> str:
    """Upload the agent files whose hash differs; returns the manifest's own hash."""
    local = local_manifest()
    root = remote_root(host, info)
    res = session.run(f"{q(info.python3 or py)} -c {q(HASH_SCRIPT)} {q(root + '/disagg_agents')}")
    remote: dict[str, str] = json.loads(res.out) if res.rc == 0 else {}
    changed = [p for p, h in local.items() if remote.get(p) != h]
    stale = [p for p in remote if p not in local]
    result.unchanged = len(local) - len(changed)
    result.uploaded, result.removed = changed, stale
    if not dry and (changed or stale):
        src = Path(disagg_agents.__file__).parent
        dirs = sorted({str(Path(root, "disagg_agents", p).parent) for p in changed})
        session.check(f"mkdir -p {' '.join(q(d) for d in dirs) or q(root)}")
        for p in changed:
            session.sftp.putfo(io.BytesIO((src / p).read_bytes()), f"{root}/disagg_agents/{p}")
        if stale:
            session.check("rm -f " + " ".join(q(f"{root}/disagg_agents/{p}") for p in stale))
    return hashlib.sha256(json.dumps(local, sort_keys=True).encode()).hexdigest()


def _check_cpus(inv: Inventory, host: Host, session: Session, info: HostInfo) -> None:
    """A host's `cpus` pins its agents with taskset -c: refuse it where that cannot work.
    macOS is refused, not ignored: it lets no process choose its cores, and a pin that
    silently does nothing would make timings lie."""
    if host.cpus is None:
        return
    key = f"hosts.{host.name}.cpus"
    if info.system != "Linux":
        raise AgentError(
            f"{host.name}: {key} is set, but {info.system} has no CPU pinning (taskset -c is "
            f"Linux only); fix: remove cpus from [hosts.{host.name}] in {inv.path}"
        )
    res = session.run(f"taskset -c {q(host.cpus)} true")
    if res.rc != 0:
        why = res.err.strip().splitlines()[-1] if res.err.strip() else f"exit {res.rc}"
        fix = (
            "install util-linux (it has taskset) there"
            if res.rc == 127
            else "name CPUs the host has (see nproc or lscpu there)"
        )
        raise AgentError(
            f"{host.name}: cannot pin to {key} = {host.cpus!r} ({why}); fix: {fix}, "
            f"or remove cpus from [hosts.{host.name}] in {inv.path}"
        )


def agent_config(
    agent: Agent, info: HostInfo, python: str, root: str, trusted: list[str] | None = None
) -> dict[str, object]:
    return {
        "role": agent.role,
        "name": f"{agent.role}@{agent.host.name}",
        "model": info.expand(agent.model),
        "dtype": agent.dtype,
        # The host's own addresses only, never 0.0.0.0: data plane first, then ssh's.
        "bind": ",".join(agent.host.addresses()) or "127.0.0.1",
        "port": agent.ports.port,
        "control_port": agent.ports.control_port,
        "python": python,
        "pipelines": list(agent.pipelines),
        "token_file": f"{root}/token",
        # Only when set, so hosts without it keep their config hash across upgrades.
        **({"cpus": agent.host.cpus} if agent.host.cpus else {}),
        **({"allow_mixed": True} if agent.allow_mixed else {}),
        # The inventory's addresses get connection slots strangers cannot fill.
        **({"trusted_peers": ",".join(trusted)} if trusted else {}),
        **prefix_disk_config(agent, info, root),
    }


def prefix_disk_config(agent: Agent, info: HostInfo, root: str) -> dict[str, object]:
    """A decode agent's prefix disk tier: its directory on the host (a relative one
    under the remote root) and budget; nothing when it is off."""
    if agent.role != "decode" or agent.prefix_disk_mb <= 0:
        return {}
    where = info.expand(agent.prefix_disk)
    if not where.startswith("/"):
        where = f"{root}/{where}"
    return {"prefix_disk_dir": where, "prefix_disk_mb": agent.prefix_disk_mb}


def inventory_addresses(inv: Inventory) -> list[str]:
    """Every address of every host in the inventory, sorted (a stable config hash)."""
    return sorted({a for h in inv.hosts.values() for a in h.addresses()})


def _write(session: Session, path: str, text: str) -> None:
    session.check(f"mkdir -p {q(path.rsplit('/', 1)[0])} && cat > {q(path)}", stdin=text)


def deploy_host(
    inv: Inventory, host: Host, session: Session, dry: bool, say: HostSay, token: bytes
) -> HostDeploy:
    result = HostDeploy(host.name, dry_run=dry)
    info = probe(session)
    result.platform = f"{info.system} {info.machine}"
    kind = result.service = service_kind(host, info)
    say(host.name, f"{result.platform}, service: {kind}")
    mine = inv.agents([host])
    if not mine:
        result.notes.append("no pipeline places an agent here")
        return result
    _check_cpus(inv, host, session, info)
    root = remote_root(host, info)
    _check_models(inv, host, session, info, mine)
    py = result.python = _ensure_python(host, session, info, [a.role for a in mine], dry, say)
    code_hash = _upload_agents(host, session, info, result, dry, py)
    if result.uploaded or result.removed:
        verb = "would upload" if dry else "uploaded"
        say(host.name, f"{verb} {len(result.uploaded)} agent files, {result.unchanged} unchanged")
    else:
        say(host.name, f"agents unchanged ({result.unchanged} files), nothing uploaded")
    if not dry:
        _install_token(session, root, token)
    for a in mine:
        _configure_agent(inv, a, session, info, root, code_hash, token, say, result)
    return result


def _check_models(
    inv: Inventory, host: Host, session: Session, info: HostInfo, agents: list[Agent]
) -> None:
    """Every agent's model dir is there (a config.json), or one line that says where."""
    for a in agents:
        model = info.expand(a.model)
        if session.run(f"test -r {q(model + '/config.json')}").rc != 0:
            key = f"pipelines.{a.pipelines[0]}.{a.role}_model"
            raise ModelError(
                f"{host.name}: model dir {model} not found (no config.json); fix: copy the "
                f"model there or correct {key} in {inv.path}"
            )


def _install_token(session: Session, root: str, token: bytes) -> None:
    if not token:
        raise AuthError("no cluster token to deploy; fix: run disagg deploy without --dry-run")
    # The cluster's one token, so agents of different hosts accept each other.
    session.check(
        f"mkdir -p {q(root)}/logs {q(root)}/run && umask 077 && "
        f"cat > {q(root)}/token && chmod 600 {q(root)}/token",
        stdin=token.decode(),
    )


def _configure_agent(
    inv: Inventory,
    a: Agent,
    session: Session,
    info: HostInfo,
    root: str,
    code_hash: str,
    token: bytes,
    say: HostSay,
    result: HostDeploy,
) -> None:
    """Writes one agent's config, script and unit where any of them (or the code, or
    the token) changed, and restarts it if it runs on the old ones."""
    kind, py = result.service, result.python
    paths = service.AgentPaths(root, a.role)
    cfg = agent_config(a, info, py, root, inventory_addresses(inv))
    disk = cfg.get("prefix_disk_dir")
    if disk and not result.dry_run:  # ours alone: the agent refuses to share it
        session.check(f"mkdir -p {q(str(disk))} && chmod 700 {q(str(disk))}")
    script = service.run_script(paths, cfg)
    unit = service.unit_file(kind, paths, info.home)
    # The token's hash, not the token: a new token restarts the agents.
    token_hash = hashlib.sha256(token).hexdigest()
    blob = json.dumps([cfg, script, unit, code_hash, token_hash], sort_keys=True)
    new_hash = hashlib.sha256(blob.encode()).hexdigest()
    old_hash = session.run(f"cat {q(paths.hash)} 2>/dev/null").out.strip()
    if new_hash == old_hash:
        return
    result.configs_changed.append(a.role)
    if result.dry_run:
        say(result.host, f"would write {a.role} config")
        return
    _write(session, paths.config, service.config_json(cfg))
    _write(session, paths.script, script)
    if unit:
        _write(session, *unit)
        session.check(service.after_install(kind))
    _write(session, paths.hash, new_hash + "\n")
    running = session.run(service.is_running(paths)).rc == 0
    started = session.run(f"cat {q(paths.started)} 2>/dev/null").out.strip()
    if running and started != new_hash:
        say(result.host, f"{a.role} config changed: restarting")
        session.check(service.stop(kind, paths))
        start_agent(session, paths, kind, info.home)
        result.restarted.append(a.role)


def deploy(
    inv: Inventory,
    hosts: list[str] | None = None,
    *,
    dry_run: bool = False,
    say: HostSay = lambda _h, _m: None,
) -> list[HostResult[HostDeploy]]:
    """Deploy to the named hosts (all when None), in parallel; one result per host."""
    chosen = inv.select(hosts)
    # A dry run before the first deploy has no token yet: b"" only feeds the config
    # hash and is never written (a dry run writes nothing).
    token = load_token(inv.path, create=not dry_run) or b""
    return on_hosts(
        chosen, inv.ssh, lambda host, session: deploy_host(inv, host, session, dry_run, say, token)
    )
