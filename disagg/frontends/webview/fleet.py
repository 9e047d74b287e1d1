"""The fleet as the web view draws it: every agent the router knows, polled over
its control port (/status, challenge-response with the cluster token), and the
links between each pipeline's prefill and decode agents with measured rates.

Polled on demand, at most once a second, so an idle gateway polls nobody.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from disagg.fleet.crashes import last_error_in
from disagg.frontends.webview.tracker import RequestLog
from disagg.serving.control import agent_status
from disagg_agents.wire.frames import PeerAuthError
from disagg_agents.wire.status import AgentStatus, PrefixDiskStatus
from disagg_agents.wire.text import printable

POLL_EVERY_S = 1.0
CRASH_EVERY_S = 30.0  # a down fleet agent's last error is read over SSH at most this often
POLL_TIMEOUT_S = 1.5
RATE_WINDOW_S = 30.0  # tokens/s and link rates over the last this many seconds


def last_error_line(log_path: Path, max_bytes: int = 64 << 10) -> str | None:
    """The last error (a crash's closing line, or an ERROR line) at the end of a
    local agent's log, where its stderr goes too; None if none."""
    try:
        with log_path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    return last_error_in(lines)


def _device(st: AgentStatus) -> str | None:
    """`cpu`, `cuda`, `gpu` …: mlx writes its device as `Device(cpu, 0)`."""
    d = st.device
    return str(d).removeprefix("Device(").split(",")[0].rstrip(")") if d else None


def _weights(st: AgentStatus) -> str | None:
    w = st.weights_format
    kind = f"{w.bits}-bit {w.mode}" if w.bits is not None or w.mode is not None else None
    return " ".join(x for x in (kind, w.dtype) if x) or None


class FleetWatch:
    def __init__(self, client: Any, log: RequestLog) -> None:
        self.client = client
        self.log = log
        self.lock = threading.Lock()
        self.lock_crashes = threading.Lock()
        self.polled_at = 0.0
        self.agents: list[dict[str, Any]] = []
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ui-poll")
        # Fleet agents that stopped answering: their last error, read over SSH in the
        # background (name -> (when asked, line)); the poll never waits for it.
        self.crashes: dict[str, tuple[float, str | None]] = {}
        self.ssh = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ui-ssh")

    def _fleet_crash(self, name: str) -> str | None:
        inv = getattr(self.client, "inventory", None)
        if inv is None:
            return None
        now = time.monotonic()
        with self.lock_crashes:
            asked = self.crashes.get(name)
            if asked is None or now - asked[0] > CRASH_EVERY_S:
                self.crashes[name] = (now, asked[1] if asked else None)
                self.ssh.submit(self._read_crash, inv, name, now)
            return self.crashes[name][1]

    def _read_crash(self, inv: Any, name: str, asked: float) -> None:
        from disagg.fleet.operations import crash_line  # SSH: only for a fleet

        line = crash_line(inv, name)
        with self.lock_crashes:
            self.crashes[name] = (asked, line)

    def pipelines(self) -> list[Any]:
        """The router's routes less aliases (an alias's route holds the same agents)."""
        seen: set[tuple[str, ...]] = set()
        out = []
        for p in self.client.router.pipelines.values():
            agents = tuple(ep.name for ep in (*p.prefill, *p.decode))
            if agents not in seen:
                seen.add(agents)
                out.append(p)
        return out

    def _endpoints(self) -> list[tuple[str, str, Any]]:
        pipes = self.pipelines()
        return [
            (p.name, role, ep)
            for p in pipes
            for role in ("prefill", "decode")
            for ep in getattr(p, role)
        ]

    def _local(self, name: str) -> Any:
        return next((a for a in getattr(self.client, "agents", []) if a.name == name), None)

    def _poll_one(self, model: str, role: str, ep: Any) -> dict[str, Any]:
        row: dict[str, Any] = {
            "name": ep.name,
            "role": role,
            "model": model,
            "address": f"{ep.host}:{ep.port}",
            "up": False,
            # An embedding pipeline's agent: the view marks it (no chat, no generate).
            "embedding_only": bool(
                getattr(self.client.router.pipelines.get(model), "embedding_only", False)
            ),
        }
        local = self._local(ep.name)
        if local is not None and not local.alive():
            row["error"] = f"exited with {local.proc.returncode}"
            row["last_error"] = last_error_line(local.log_path)
            return row
        if ep.control_port is None:
            row["error"] = "no control port"
            return row
        try:
            st = agent_status(ep.host, ep.control_port, self.client.router.token, POLL_TIMEOUT_S)
        except (OSError, ValueError, PeerAuthError) as e:
            row["error"] = printable(e, 200)
            if local is not None:
                row["last_error"] = last_error_line(local.log_path)
            else:
                row["last_error"] = self._fleet_crash(ep.name)
            return row
        row.update(
            up=True,
            device=_device(st),
            backend=st.backend,
            model_dir=Path(st.model or "").name or None,
            weights=_weights(st),
            in_flight=st.in_flight,
            queued=st.queued,
            batch=st.batch,
            max_batch=st.max_batch,
            requests=st.requests,
            errors=st.errors,
            cancelled=st.cancelled,
            uptime_s=st.uptime_s,
            rss_bytes=st.rss_bytes,
            prefix_hit_rate=st.prefix_cache.hit_rate if st.prefix_cache else None,
            # every tier: disk hits included
            prefix_memory_tokens=st.prefix_cache.cached_tokens if st.prefix_cache else None,
            prefix_disk=_disk(st.prefix_disk),
            ttft_p50_s=st.ttft_p50_s,
        )
        reported = st.last_error
        if isinstance(reported, dict) and reported.get("message"):
            row["last_error"] = printable(reported["message"], 300)
        elif local is not None:
            row["last_error"] = last_error_line(local.log_path)
        return row

    def poll(self) -> list[dict[str, Any]]:
        """Every agent's row, fresh to within POLL_EVERY_S."""
        with self.lock:
            if time.monotonic() - self.polled_at < POLL_EVERY_S:
                return self.agents
            futures = [self.pool.submit(self._poll_one, *e) for e in self._endpoints()]
            rows = [f.result() for f in futures]
            self._add_rates(rows)
            for r in rows:
                self.log.metrics.agent(r["name"], r["role"], r["model"], r["up"])
            self.agents, self.polled_at = rows, time.monotonic()
            return rows

    def _add_rates(self, rows: list[dict[str, Any]]) -> None:
        recent = self.log.finished_since(RATE_WINDOW_S)
        for r in rows:
            decode = r["role"] == "decode"
            mine = [
                m for m in recent if (m.decode_server if decode else m.prefill_server) == r["name"]
            ]
            made = sum(int((m.completion_tokens if decode else m.prompt_tokens) or 0) for m in mine)
            r["tokens_per_s"] = round(made / RATE_WINDOW_S, 2)

    def links(self) -> list[dict[str, Any]]:
        """Each pipeline's prefill -> decode pairs, with what their K/V streams measured."""
        recent = self.log.finished_since(RATE_WINDOW_S * 10)
        out = []
        for p in self.pipelines():
            for pre in p.prefill:
                for dec in p.decode:
                    ms = [
                        m
                        for m in recent
                        if m.prefill_server == pre.name
                        and m.decode_server == dec.name
                        and m.method == "disaggregated"
                    ]
                    link_b = sum(float(m.kv_link_bytes or 0) for m in ms)
                    link_s = sum(float(m.kv_link_time or 0) for m in ms)
                    kv_b = sum(float(m.kv_bytes or 0) for m in ms)
                    kv_s = sum(float(m.kv_transfer_time or 0) for m in ms)
                    rate = link_b / link_s if link_s > 0 else (kv_b / kv_s if kv_s > 0 else None)
                    out.append(
                        {
                            "model": p.name,
                            "prefill": pre.name,
                            "decode": dec.name,
                            "requests": len(ms),
                            "bytes_per_s": rate,
                            # "link": timed on the wire (large frames, decode.codectuner);
                            # "stream": K/V bytes over first-to-last layer, paced by compute
                            "rate_kind": "link" if link_s > 0 else "stream",
                            "kv_bytes_last": ms[-1].kv_bytes if ms else None,
                        }
                    )
        return out


def _disk(d: PrefixDiskStatus | None) -> dict[str, Any] | None:
    """A decode agent's disk tier as a card shows it: hits, tokens, bytes of budget."""
    if d is None:
        return None
    return {
        "hits": d.hits,
        "cached_tokens": d.cached_tokens,
        "bytes": d.bytes,
        "max_bytes": d.max_bytes,
        "corrupt": d.corrupt,
    }
