"""How an agent runs on a host, the host's own way: systemd --user on Linux,
launchd on macOS, else nohup + pidfile. Everything here is shell text for the
remote POSIX shell; the run script itself is the same for every kind.

Remote layout under the host's remote_dir (ROOT):
  disagg_agents/     the uploaded agent package
  ROLE.json          the agent's config;  ROLE.sh  its run script;  ROLE.hash
  token              auth token, 0600
  logs/ROLE.log      the agent's log, rotated by size (--log-file);  logs/ROLE.stderr  the rest
  run/ROLE.out       its stdout (the READY / FAILED line);  run/ROLE.pid
  run/ROLE.started   the ROLE.hash the running agent was started with

A host's `cpus` (a Linux CPU list) pins its agents with `taskset -c`, in the run script.
ROOT may hold any character but a control one: each text quotes it its own way (the
shell's, systemd's, XML's). A pidfile counts only while its pid runs this agent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape

from disagg.fleet.inventory import Host, InventoryError
from disagg.fleet.ssh import Session, q

KINDS = ("systemd", "launchd", "nohup")

# One round trip tells platform, home and the service manager the host has.
PROBE = r"""
printf 'system=%s\nmachine=%s\nhome=%s\n' "$(uname -s)" "$(uname -m)" "$HOME"
if command -v systemctl >/dev/null 2>&1 && systemctl --user show-environment >/dev/null 2>&1
then echo service=systemd
elif [ "$(uname -s)" = Darwin ] && command -v launchctl >/dev/null 2>&1
then echo service=launchd
else echo service=nohup
fi
echo "python3=$(command -v python3 || true)"
"""


@dataclass(frozen=True)
class AgentPaths:
    root: str
    role: str

    @property
    def script(self) -> str:
        return f"{self.root}/{self.role}.sh"

    @property
    def config(self) -> str:
        return f"{self.root}/{self.role}.json"

    @property
    def hash(self) -> str:
        return f"{self.root}/{self.role}.hash"

    @property
    def log(self) -> str:
        return f"{self.root}/logs/{self.role}.log"

    @property
    def stderr(self) -> str:
        return f"{self.root}/logs/{self.role}.stderr"

    @property
    def out(self) -> str:
        return f"{self.root}/run/{self.role}.out"

    @property
    def pid(self) -> str:
        return f"{self.root}/run/{self.role}.pid"

    @property
    def started(self) -> str:
        return f"{self.root}/run/{self.role}.started"

    @property
    def unit(self) -> str:
        return f"disagg-{self.role}"

    @property
    def label(self) -> str:
        return f"com.disagg.{self.role}"


def run_script(paths: AgentPaths, config: dict[str, Any]) -> str:
    """The agent's run script: records its pid, then becomes the agent (exec; through
    taskset, which execs too, when the host has a CPU list, so the pid stays the agent's)."""
    # Pinned to the host's CPU list (Linux only; deploy refuses it elsewhere).
    pin = ["taskset", "-c", config["cpus"]] if config.get("cpus") else []
    args = [
        *pin,
        config["python"],
        "-m",
        f"disagg_agents.{paths.role}",
        "--model",
        config["model"],
        "--host",
        config["bind"],
        "--port",
        str(config["port"]),
        "--control-port",
        str(config["control_port"]),
        "--name",
        config["name"],
        "--dtype",
        config["dtype"],
        "--token-file",
        config["token_file"],
        "--log-file",
        paths.log,
        *(["--allow-mixed"] if config.get("allow_mixed") else []),
        *(["--trusted-peers", config["trusted_peers"]] if config.get("trusted_peers") else []),
        *_prefix_disk_args(config),
    ]
    return (
        "#!/bin/sh\n"
        f"# Written by `disagg deploy`; the agent's settings are in {paths.config}.\n"
        f"cd {q(paths.root)} || exit 1\n"
        f"export PYTHONPATH={q(paths.root)} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false\n"
        f"echo $$ > {q(paths.pid)}\n"
        # The agent rotates its own log; stderr (a crash's traceback) gets a file of its own.
        f"exec {' '.join(q(a) for a in args)} > {q(paths.out)} 2>> {q(paths.stderr)} < /dev/null\n"
    )


def _prefix_disk_args(config: dict[str, Any]) -> list[str]:
    """A decode agent's prefix disk tier flags (deploy.prefix_disk_config), if any."""
    if not config.get("prefix_disk_dir"):
        return []
    mb = f"{float(config['prefix_disk_mb']):g}"
    return ["--prefix-disk", str(config["prefix_disk_dir"]), "--prefix-disk-mb", mb]


def systemd_quote(arg: str) -> str:
    """One ExecStart word, per systemd.syntax: double-quoted with C escapes, and `%`
    (specifiers) and `$` (variables) doubled so systemd expands neither."""
    s = arg.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$")
    return f'"{s}"'


def systemd_unit(paths: AgentPaths) -> str:
    return (
        f"[Unit]\nDescription=disagg {paths.role} agent\n\n"
        f"[Service]\nExecStart=/bin/sh {systemd_quote(paths.script)}\nRestart=no\n"
        "KillSignal=SIGTERM\n\n[Install]\nWantedBy=default.target\n"
    )


def launchd_plist(paths: AgentPaths) -> str:
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
<plist version="1.0"><dict>
  <key>Label</key><string>{escape(paths.label)}</string>
  <key>ProgramArguments</key><array><string>/bin/sh</string><string>{escape(paths.script)}</string></array>
  <key>RunAtLoad</key><false/>
  <key>KeepAlive</key><false/>
</dict></plist>
"""


def unit_file(kind: str, paths: AgentPaths, home: str) -> tuple[str, str] | None:
    """(remote path, content) of the service definition, if the kind has one."""
    if kind == "systemd":
        return f"{home}/.config/systemd/user/{paths.unit}.service", systemd_unit(paths)
    if kind == "launchd":
        return f"{home}/Library/LaunchAgents/{paths.label}.plist", launchd_plist(paths)
    return None


def after_install(kind: str) -> str:
    if kind != "systemd":
        return "true"
    # Without lingering, systemd stops a user's services when their last session ends.
    return "systemctl --user daemon-reload && (loginctl enable-linger 2>/dev/null || true)"


def _agent_pid(paths: AgentPaths) -> str:
    """Shell: sets $pid and exits 0 iff the pidfile's pid is alive AND runs this agent:
    its command line names the agent's module and ROOT (or is its run script, which
    becomes the agent by exec). Else the pidfile is stale (the pid died or was reused
    by another process): removed, so nothing ever signals a stranger."""
    module = q(f"disagg_agents.{paths.role}")
    root, sh = q(f"{paths.root}/"), q(f"/bin/sh {paths.script}")
    return (
        f"pid=$(cat {q(paths.pid)} 2>/dev/null); "
        'case "$pid" in ""|*[!0-9]*) pid="";; *) '
        # /proc joins arguments with NULs (Linux); ps (macOS) needs -ww to never cut the line.
        'cmd=$(tr "\\0" " " 2>/dev/null < /proc/"$pid"/cmdline || ps -ww -o command= -p "$pid"); '
        f'case "$cmd" in {sh}|{sh}" ") ;; *{module}*) case "$cmd" in *{root}*) ;; *) pid="";; '
        'esac;; *) pid="";; esac;; esac; '
        'if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then true; '
        f"else pid=; rm -f {q(paths.pid)}; false; fi"
    )


def is_running(paths: AgentPaths) -> str:
    """Exit 0 iff the agent's recorded pid is alive and is the agent ($pid set)."""
    return f"{{ {_agent_pid(paths)}; }}"


def start(kind: str, paths: AgentPaths, home: str) -> str:
    """Start the agent; the caller then waits for its READY line in paths.out."""
    prep = (
        f"mkdir -p {q(paths.root)}/logs {q(paths.root)}/run && rm -f {q(paths.pid)} && "
        f": > {q(paths.out)} && cp {q(paths.hash)} {q(paths.started)} && "
    )
    if kind == "systemd":
        return prep + f"systemctl --user start {paths.unit}"
    if kind == "launchd":
        plist = f"{home}/Library/LaunchAgents/{paths.label}.plist"
        dom = 'gui/"$(id -u)"'
        return prep + (
            f"(launchctl bootout {dom}/{paths.label} 2>/dev/null; true) && "
            f"launchctl bootstrap {dom} {q(plist)} && launchctl kickstart {dom}/{paths.label}"
        )
    # No service manager: detach from the ssh session (setsid where it exists).
    return prep + (
        "S=$(command -v setsid || true); "
        f"nohup $S /bin/sh {q(paths.script)} > /dev/null 2>&1 < /dev/null &"
    )


def stop(kind: str, paths: AgentPaths, grace_s: int = 35) -> str:
    """Stop the agent: the service manager's way, then SIGTERM, then SIGKILL after grace_s."""
    first = {
        "systemd": f"systemctl --user stop {paths.unit} 2>/dev/null; ",
        "launchd": f'launchctl bootout gui/"$(id -u)"/{paths.label} 2>/dev/null; ',
    }.get(kind, "")
    ticks = grace_s * 5
    running = is_running(paths)
    return first + (
        f'if {running}; then kill -TERM "$pid"; i=0; '
        f'while kill -0 "$pid" 2>/dev/null && [ $i -lt {ticks} ]; do sleep 0.2; i=$((i+1)); done; '
        # Asked again: in the meantime the pid may have exited and been reused.
        f'if {running}; then kill -KILL "$pid"; fi; fi; '
        f"rm -f {q(paths.pid)} {q(paths.started)}; true"
    )


def config_json(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


@dataclass
class HostInfo:
    system: str
    machine: str
    home: str
    service: str
    python3: str

    def expand(self, path: str) -> str:
        if path == "~" or path.startswith("~/"):
            return self.home + path[1:]
        return path


def probe(session: Session) -> HostInfo:
    facts = dict(line.split("=", 1) for line in session.check(PROBE).splitlines() if "=" in line)
    return HostInfo(
        system=facts.get("system", "?"),
        machine=facts.get("machine", "?"),
        home=facts.get("home", ""),
        service=facts.get("service", "nohup"),
        python3=facts.get("python3", ""),
    )


def remote_root(host: Host, info: HostInfo) -> str:
    root = info.expand(host.remote_dir).rstrip("/")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in root):
        raise InventoryError(
            f"hosts.{host.name}.remote_dir: {root!r} holds a newline or control character; "
            "fix: choose a directory name without one"
        )
    return root


def host_python(host: Host, info: HostInfo) -> str:
    if host.python:
        return info.expand(host.python)
    return f"{remote_root(host, info)}/venv/bin/python"


def service_kind(host: Host, info: HostInfo) -> str:
    return info.service if host.service == "auto" else host.service
