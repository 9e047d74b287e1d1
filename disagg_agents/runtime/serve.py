"""An agent's life, whatever its role: start (options, logging, token, engine),
bind both ports on every address, print the READY line that tells whoever started
it which ports it got, serve until SIGTERM/SIGINT, then drain."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn, Protocol, TypeVar

from disagg_agents.runtime.args import fail, load_token
from disagg_agents.runtime.control import ControlServer, listener_settings, start_control
from disagg_agents.runtime.gate import trusted_set
from disagg_agents.runtime.listener import FrameServer
from disagg_agents.runtime.logs import setup_logging
from disagg_agents.runtime.metrics import Stats
from disagg_agents.runtime.report import StatusReport
from disagg_agents.runtime.settings import Setting, Settings

log = logging.getLogger("disagg.agent")

E = TypeVar("E")


class Agent(Protocol):
    """What serve() needs of a prefill or decode agent."""

    stats: Stats

    def handle(self, sock: socket.socket, peer: str) -> None: ...

    def status(self) -> StatusReport: ...

    def live_settings(self) -> list[Setting]: ...


def start_agent(
    role: str, parser: argparse.ArgumentParser, load: Callable[[argparse.Namespace], E]
) -> tuple[argparse.Namespace, bytes | None, E]:
    """An agent's start, whatever its role: options, logging, the cluster token, and
    the engine `load` builds (an unsupported model ends here with one FAILED line)."""
    from disagg_agents.models import UnsupportedModel

    args = parser.parse_args()
    setup_logging(role, args.log_file, args.log_max_bytes)
    token = load_token(args.token_file)
    try:
        engine = load(args)
    except UnsupportedModel as e:
        fail(str(e))
    log.info("loaded %s on %s as %s", args.model, engine.device, engine.dtype)  # type: ignore[attr-defined]
    return args, token, engine


def serve(role: str, args: argparse.Namespace, token: bytes | None, agent: Agent) -> None:
    """Bind both ports on every address, print READY, serve until SIGTERM/SIGINT,
    then stop accepting and let in-flight requests finish (up to --drain-timeout)."""
    hosts = [h.strip() for h in str(args.host).split(",") if h.strip()]
    draining = threading.Event()
    settings = Settings(*agent.live_settings())
    frames, controls = bind(hosts, args, token, agent, draining, settings)
    settings.add(*listener_settings(frames, controls))
    for server in frames:
        # A short poll so a SIGTERM closes the listener within a tenth of a second.
        threading.Thread(
            target=server.serve_forever, args=(0.1,), daemon=True, name="frames"
        ).start()
    announce(role, hosts, frames[0].server_address[1], controls[0].server_address[1], token)
    wait_for_signal()
    drain(role, agent, frames, controls, draining, args.drain_timeout)


def exit_now() -> NoReturn:
    """End the process once it has drained and saved all it keeps: flush the logs and
    skip the interpreter's teardown of torch's and the model's objects (~0.7 s of a
    loaded prefill agent's exit, 0.3 s of torch alone), which a restart waits on."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def bind(
    hosts: list[str],
    args: argparse.Namespace,
    token: bytes | None,
    agent: Agent,
    draining: threading.Event,
    settings: Settings,
) -> tuple[list[FrameServer], list[ControlServer]]:
    """Both ports on every address (port 0: the first bind picks it, the others
    reuse it); the control port serves from here on, the data port once started."""
    trusted = trusted_set(args.trusted_peers)
    frames: list[FrameServer] = []
    controls: list[ControlServer] = []
    port, control_port = args.port, args.control_port
    try:
        for host in hosts:
            frames.append(
                FrameServer(
                    host,
                    port,
                    agent.handle,
                    token,
                    args.handshake_timeout,
                    args.max_connections,
                    args.max_preauth_per_peer,
                    trusted,
                )
            )
            port = frames[-1].server_address[1]
            controls.append(
                start_control(
                    host,
                    control_port,
                    agent.status,
                    agent.stats.prometheus,
                    token,
                    draining,
                    args.handshake_timeout,
                    trusted,
                    settings,
                )
            )
            control_port = controls[-1].server_address[1]
    except OSError as e:
        fail(f"cannot listen on {host}: {e.strerror}")
    return frames, controls


def announce(
    role: str, hosts: list[str], port: int, control_port: int, token: bytes | None
) -> None:
    """The READY line whoever started the agent reads its ports from, and the log's."""
    ready = {
        "role": role,
        "host": hosts[0],
        "hosts": hosts,
        "port": port,
        "control_port": control_port,
        "auth": token is not None,
    }
    print("READY " + json.dumps(ready), flush=True)
    log.info(
        "serving %s on %s port %d (control %d), auth %s",
        role,
        ",".join(hosts),
        port,
        control_port,
        "on" if token else "OFF",
    )


def wait_for_signal() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()  # the handlers run on this thread, so the wait wakes as soon as one fires


def drain(
    role: str,
    agent: Agent,
    frames: list[FrameServer],
    controls: list[ControlServer],
    draining: threading.Event,
    timeout_s: float,
) -> None:
    """Stop accepting, then let in-flight requests finish for up to `timeout_s`."""

    def busy() -> int:
        return agent.stats.in_flight

    log.info("%s draining: no new connections, waiting for %d requests", role, busy())
    draining.set()
    for server in frames:
        server.shutdown()
        server.server_close()  # new connections are refused from here on
    deadline = time.monotonic() + timeout_s
    while busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = busy()
    for c in controls:
        c.shutdown()
    if left:
        log.warning("%s stopped with %d requests still running after %.0fs", role, left, timeout_s)
    else:
        log.info("%s drained and stopped", role)
