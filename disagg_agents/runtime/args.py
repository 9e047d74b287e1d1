"""An agent's start before any engine loads: the flags both roles share, the
cluster token, and the one FAILED line a launcher shows the user as is."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from disagg_agents.prefix.store import default_max_mb
from disagg_agents.runtime.gate import HANDSHAKE_TIMEOUT_S, MAX_CONNECTIONS, MAX_PREAUTH_PER_PEER
from disagg_agents.runtime.logs import LOG_MAX_BYTES, setup_logging
from disagg_agents.wire.auth import TOKEN_MIN_CHARS
from disagg_agents.wire.frames import CONTROL_MAX_FRAME

log = logging.getLogger("disagg.agent")


def fail(message: str) -> NoReturn:
    """Exit with one line the launcher can show to the user as is."""
    print(f"FAILED {message}", flush=True)
    log.error("%s", message)
    raise SystemExit(1)


def common_args(role: str) -> argparse.ArgumentParser:
    """The flags both roles take; a role adds its own to the parser."""
    p = argparse.ArgumentParser(prog=f"python -m agents.{role}")
    _add_model_and_ports(p)
    _add_admission(p)
    _add_logs_and_lifetime(p)
    return p


def _add_model_and_ports(p: argparse.ArgumentParser) -> None:
    """What to load, on what, and where to listen."""
    p.add_argument("--model", required=True, help="local Hugging Face model dir")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address(es) to bind, comma-separated (both ports); 0.0.0.0 only if told",
    )
    p.add_argument("--port", type=int, default=0, help="KV/data TCP port (0: any free)")
    p.add_argument("--control-port", type=int, default=0, help="HTTP control port (0: any free)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", help="auto, or a framework device name")
    p.add_argument("--name", default=None, help="how this agent names itself in metrics")


def _add_admission(p: argparse.ArgumentParser) -> None:
    """Who may connect, and how many at once (the gate's caps)."""
    p.add_argument(
        "--token-file",
        default=None,
        help="cluster token (0600); without it the agent accepts anyone",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=CONTROL_MAX_FRAME,
        help="largest control frame (request, hello) accepted from a peer",
    )
    p.add_argument(
        "--handshake-timeout",
        type=float,
        default=HANDSHAKE_TIMEOUT_S,
        help="seconds a new connection has to authenticate (an HTTP call: to be answered)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="connections at once on the data port (half at most unauthenticated)",
    )
    p.add_argument(
        "--max-preauth-per-peer",
        type=int,
        default=MAX_PREAUTH_PER_PEER,
        help="unauthenticated connections at once from one address",
    )
    p.add_argument(
        "--trusted-peers",
        default="",
        help="the cluster's own addresses, comma-separated (disagg deploy passes the "
        "inventory's): their connections have slots strangers cannot fill (loopback always)",
    )


def _add_logs_and_lifetime(p: argparse.ArgumentParser) -> None:
    """Where the log goes, how a stop drains, and the prefix cache's memory."""
    p.add_argument("--log-file", default=None, help="log here, rotated by size (else stderr)")
    p.add_argument(
        "--log-max-bytes", type=int, default=LOG_MAX_BYTES, help="rotate --log-file at this size"
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=None,
        help="memory for prompt K/V reused across requests sharing a prefix "
        f"(default min(2 GiB, 10%% of RAM): {default_max_mb()} MB here; 0: off)",
    )


def preflight(role: str, check_model: Callable[[str], None]) -> None:
    """What an agent can refuse before torch or mlx loads (seconds of a start): a
    token file it must not use, a checkpoint `check_model` refuses (one neither agent
    can run, or whose headers lie). One FAILED line in a fraction of a second;
    start_agent checks again."""
    from disagg_agents.models import UnsupportedModel

    argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        return  # the whole parser, with the role's own flags, answers that
    args, _ = common_args(role).parse_known_args(argv)
    setup_logging(role, args.log_file, args.log_max_bytes)
    load_token(args.token_file)
    try:
        check_model(args.model)
    except UnsupportedModel as e:
        fail(str(e))


def load_token(path: str | None) -> bytes | None:
    """The cluster token, refusing a file that others may read."""
    if path is None:
        return None
    try:
        st = os.stat(path)
        token = Path(path).read_bytes().strip()
    except OSError as e:
        fail(f"cannot read token file {path}: {e.strerror}")
    if st.st_mode & 0o077:
        fail(f"token file {path} is readable by others; fix: chmod 600 {path}")
    if len(token) < TOKEN_MIN_CHARS:
        what = "is empty" if not token else f"holds only {len(token)} characters"
        fail(
            f"token file {path} {what}, a cluster token has at least {TOKEN_MIN_CHARS}; "
            "fix: copy the operator's token there again (disagg deploy does), chmod 600"
        )
    return token
