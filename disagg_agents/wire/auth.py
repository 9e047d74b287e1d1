"""Challenge-response authentication with HMAC-SHA256 over both sides' nonces:
the token never crosses the wire, a recorded exchange cannot be replayed (fresh
nonces), and the server proves it knows the token too."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
from typing import Any

from disagg_agents.wire.channel import recv_json, send_error, send_json
from disagg_agents.wire.frames import (
    PREAUTH_MAX_FRAME,
    Deadline,
    DeadlineExceeded,
    Frame,
    PeerAuthError,
    PeerClosed,
    ProtocolError,
    RemoteError,
)
from disagg_agents.wire.seal import seal_connection
from disagg_agents.wire.text import printable

NONCE_BYTES = 32
TOKEN_MIN_CHARS = 32  # a cluster token file holds at least this (the generator writes 64 hex)
# What protects the frames after the handshake, chosen by the client:
# "mac": every frame carries an HMAC-SHA256 tag over its sequence number, header
# and payload, keyed per connection and direction from the token and both nonces;
# a frame altered, injected, dropped or replayed is refused. "none": nothing (an
# older peer, or a pipeline on a link its operator trusts). Neither hides content.
INTEGRITY = ("mac", "none")


def _mac(token: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes, mode: str) -> bytes:
    # The mode is inside the proof (but "none" keeps the old message): stripping
    # "mac" from an AUTH on the path makes the proof fail, not the frames bare.
    tag = b"" if mode == "none" else b"|" + mode.encode()
    msg = b"disagg-auth-v1|" + side + tag + b"|" + server_nonce + b"|" + client_nonce
    return hmac.new(token, msg, hashlib.sha256).digest()


def _hex_field(obj: dict[str, Any], key: str, size: int) -> bytes:
    try:
        raw = bytes.fromhex(str(obj.get(key, "")))
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise ProtocolError(f"{key} must be {size} bytes of hex")
    return raw


def server_auth(
    sock: socket.socket,
    token: bytes | None,
    deadline: Deadline | None = None,
    max_frame: int = PREAUTH_MAX_FRAME,
) -> None:
    """Open a connection as the server; raises PeerAuthError after telling the peer why.

    The whole exchange must end by `deadline`, and no frame may exceed `max_frame`
    (the answer is tiny): an unknown peer costs a few kB for a bounded time.
    Frames after it are sealed when the client asks (see INTEGRITY)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    challenge: dict[str, Any] = {"nonce": nonce.hex(), "auth": token is not None}
    if token is not None:
        challenge["integrity"] = ["mac"]
    send_json(sock, Frame.CHALLENGE, challenge)
    if token is None:
        return
    try:
        _, msg = recv_json(sock, Frame.AUTH, max_frame, deadline)
        client_nonce = _hex_field(msg, "nonce", NONCE_BYTES)
        mac = _hex_field(msg, "mac", hashlib.sha256().digest_size)
        mode = msg.get("integrity", "none")
        if mode not in INTEGRITY:
            raise ProtocolError(f"integrity {printable(mode, 20)}: this agent knows mac, none")
    except RemoteError as e:
        reason = f"sent ERROR {printable(e.code, 40)}: {printable(e.message)}"
        send_error(sock, "unauthorized", "authentication required")
        raise PeerAuthError(reason) from None
    except ProtocolError as e:
        if isinstance(e, PeerClosed | DeadlineExceeded):
            raise
        send_error(sock, "unauthorized", f"authentication required: {e}")
        raise PeerAuthError(str(e)) from None
    if not hmac.compare_digest(mac, _mac(token, b"client", nonce, client_nonce, mode)):
        send_error(sock, "unauthorized", "wrong token: this agent belongs to another cluster")
        raise PeerAuthError("wrong token")
    proof = _mac(token, b"server", nonce, client_nonce, mode)
    send_json(sock, Frame.AUTH_OK, {"mac": proof.hex()})
    if mode == "mac":
        seal_connection(sock, token, nonce, client_nonce, server=True)


def client_auth(sock: socket.socket, token: bytes | None, integrity: str = "mac") -> None:
    """Open a connection as the client: answer the server's challenge.

    Holding a token, we require the server's proof: one whose challenge says it
    wants no token (a process that grabbed the port, say) is refused. With
    `integrity` "mac" every later frame is sealed; a server that cannot is refused."""
    _, challenge = recv_json(sock, Frame.CHALLENGE, PREAUTH_MAX_FRAME)
    nonce = _hex_field(challenge, "nonce", NONCE_BYTES)
    if not challenge.get("auth"):
        if token is None:
            return
        raise PeerAuthError(
            "the agent runs without a cluster token, so it cannot prove it belongs to this "
            "cluster: refusing to send it work; restart it with --token-file"
        )
    if token is None:
        raise PeerAuthError("the agent requires the cluster token and none was given")
    offered = challenge.get("integrity")
    if integrity == "mac" and not (isinstance(offered, list) and "mac" in offered):
        raise PeerAuthError(
            "the agent cannot check frames after the handshake (an older release?): "
            'upgrade it, or set integrity = "none" for this pipeline'
        )
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    mac = _mac(token, b"client", nonce, client_nonce, integrity)
    auth: dict[str, Any] = {"nonce": client_nonce.hex(), "mac": mac.hex()}
    if integrity != "none":
        auth["integrity"] = integrity
    send_json(sock, Frame.AUTH, auth)
    try:
        _, ok = recv_json(sock, Frame.AUTH_OK, PREAUTH_MAX_FRAME)
    except RemoteError as e:
        raise PeerAuthError(printable(e.message)) from None
    proof = _hex_field(ok, "mac", hashlib.sha256().digest_size)
    if not hmac.compare_digest(proof, _mac(token, b"server", nonce, client_nonce, integrity)):
        raise PeerAuthError("the agent could not prove it holds the cluster token")
    if integrity == "mac":
        seal_connection(sock, token, nonce, client_nonce, server=False)
