"""Whether a client hung up, asked without blocking: both agents check it while
work the client waits on is under way (a grammar compiling, an embedding queued,
a prompt waiting for its prefill agent, a local prefill between chunks)."""

from __future__ import annotations

import select
import socket


class HungUp(Exception):
    """The client hung up before its answer began: the work for it stops, and
    nobody is told."""


def client_gone(sock: socket.socket) -> bool:
    """The client closed its end (or the connection broke), without blocking.
    A pipelined next request is data, not a hang-up."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True
