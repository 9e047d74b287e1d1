"""Watch the local agents `disagg serve --local` started: say when one exits, start
it again with backoff, and route to it again once it is back. Once the server drains
(Ctrl-C, SIGTERM), an agent that exits is stopping with it: said, not restarted."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter
from typing import Any

from disagg.errors import DisaggError
from disagg.serving.localagents import AgentProc, restart_agent

BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # before each restart in a row
STABLE_S = 60.0  # an agent that ran this long before it died starts the backoff afresh
CHECK_S = 0.5

log = logging.getLogger("disagg.agents")


def how_it_ended(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class Supervisor:
    """A thread over `client.agents` (a local Client): restarts the ones that died."""

    def __init__(self, client: Any, check_s: float = CHECK_S) -> None:
        self.client = client
        self.check_s = check_s
        self.stopping = threading.Event()
        self.in_a_row: Counter[str] = Counter()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="disagg-supervise")

    def __enter__(self) -> Supervisor:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopping.set()

    def draining(self) -> str:
        """The server began to stop: from now on an agent's exit is part of it, not a
        crash. What to say about it (the draining line says it: a signal handler)."""
        self.stopping.set()
        return "no agent is restarted from now on"

    def _watch(self) -> None:
        while not self.stopping.wait(self.check_s):
            for i, agent in enumerate(list(self.client.agents)):
                if agent._stopped or agent.alive() or self.stopping.is_set():
                    continue
                self._restart(i, agent)

    def _restart(self, i: int, agent: AgentProc) -> None:
        lived = time.monotonic() - agent.started
        if lived > STABLE_S:
            self.in_a_row[agent.name] = 0
        n = self.in_a_row[agent.name]
        delay = BACKOFF_S[min(n, len(BACKOFF_S) - 1)]
        log.warning(
            "%s agent %s exited (%s) after %.0fs; restarting in %gs (log: %s)",
            agent.role,
            agent.name,
            how_it_ended(agent.proc.returncode),
            lived,
            delay,
            agent.log_path,
        )
        agent._stopped = True  # said once; the new process takes its place
        if self.stopping.wait(delay):
            return
        self.in_a_row[agent.name] = n + 1
        try:
            new = restart_agent(agent)
        except DisaggError as e:
            log.error("%s agent %s did not start again: %s", agent.role, agent.name, e)
            agent._stopped = False  # seen dead again next round: the next, longer wait
            return
        if self.stopping.is_set():
            new.stop()
            return
        self.client.agents[i] = new
        self.client.router.moved(new.name, new.host, new.port, new.control_port)
        log.warning(
            "%s agent %s is back on %s (control %d)",
            new.role,
            new.name,
            new.address,
            new.control_port,
        )
