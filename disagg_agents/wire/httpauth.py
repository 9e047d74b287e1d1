"""HTTP control calls (GET /status, /metrics) authenticated without the cluster
token on the wire: challenge-response, as on the KV socket.

    client  GET /status                              (no credentials)
    agent   401, WWW-Authenticate: Disagg-HMAC nonce="<agent nonce>"
    client  GET /status, Authorization: Disagg-HMAC nonce=.., cnonce=.., mac=..
    agent   200 + body, X-Disagg-Proof: HMAC over the answer

mac = HMAC-SHA256(token, side | method | path | nonce | cnonce [| status | sha256(body)]);
a request with a body (PUT /settings) adds sha256(its body) to the client's MAC.
The agent's nonce carries its own issue time and a MAC under a per-process key,
so the agent keeps no state for unanswered challenges (nobody can fill it); a
nonce is good for NONCE_TTL_S and once: used ones are remembered only after a
valid MAC, so only token holders add to that memory. The agent proves the
answer too, so a client holding a token never believes a process that merely
listens on the port. Stdlib only: the control plane imports `control_get`.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import re
import secrets
import struct
import threading
import time

from disagg_agents.wire.frames import PeerAuthError
from disagg_agents.wire.text import printable

SCHEME = "Disagg-HMAC"
PROOF_HEADER = "X-Disagg-Proof"
NONCE_TTL_S = 30.0
MAX_BODY = 8 << 20  # what a client reads of an answer, at most
UNAUTHENTICATED = frozenset({"/health"})
_PARAM = re.compile(r'(\w+)="([0-9a-f]{1,128})"')


class ControlError(OSError):
    """The agent answered with an HTTP error status."""

    def __init__(self, status: int, body: bytes, where: str) -> None:
        super().__init__(
            f"{where} answered HTTP {status}: {printable(body.decode(errors='replace'))}"
        )
        self.status = status
        self.body = body


def _mac(
    token: bytes, side: str, method: str, path: str, nonce: str, cnonce: str, *rest: str
) -> str:
    msg = "|".join(("disagg-http-v1", side, method, path, nonce, cnonce, *rest))
    return hmac.new(token, msg.encode(), hashlib.sha256).hexdigest()


def _answer_digest(status: int, body: bytes) -> tuple[str, str]:
    return str(status), hashlib.sha256(body).hexdigest()


def parse_authorization(value: str | None) -> dict[str, str] | None:
    """`Disagg-HMAC k="hex", ...` as a dict; None for another scheme or none."""
    if not value or not value.startswith(SCHEME + " "):
        return None
    return dict(_PARAM.findall(value[len(SCHEME) + 1 : 2048]))


class ServerAuth:
    """The agent's side: hands out challenges, checks answers, proves replies."""

    def __init__(self, token: bytes, ttl_s: float = NONCE_TTL_S) -> None:
        self.token = token
        self.ttl_s = ttl_s
        self._key = secrets.token_bytes(32)  # signs our nonces; lives as long as the process
        self._used: dict[str, float] = {}  # nonce -> when it expires
        self._lock = threading.Lock()

    def challenge(self) -> str:
        """The WWW-Authenticate value of a 401."""
        stamp = struct.pack(">d", time.time()) + secrets.token_bytes(16)
        tag = hmac.new(self._key, stamp, hashlib.sha256).digest()[:16]
        return f'{SCHEME} nonce="{(stamp + tag).hex()}"'

    def _fresh(self, nonce: str) -> bool:
        try:
            raw = bytes.fromhex(nonce)
        except ValueError:
            return False
        if len(raw) != 40:
            return False
        stamp, tag = raw[:24], raw[24:]
        if not hmac.compare_digest(tag, hmac.new(self._key, stamp, hashlib.sha256).digest()[:16]):
            return False
        age = time.time() - struct.unpack(">d", stamp[:8])[0]
        return 0 <= age <= self.ttl_s

    def check(
        self, method: str, path: str, authorization: str | None, body: bytes | None = None
    ) -> tuple[str, str] | str:
        """(nonce, cnonce) when the request proves the token (and `body`, where it
        has one, is the body the client signed); else why not."""
        params = parse_authorization(authorization)
        if params is None:
            return "no credentials"
        nonce, cnonce, mac = (
            params.get("nonce", ""),
            params.get("cnonce", ""),
            params.get("mac", ""),
        )
        if not (nonce and cnonce and mac):
            return "incomplete credentials"
        if not self._fresh(nonce):
            return "stale or forged challenge"
        signed = () if body is None else (hashlib.sha256(body).hexdigest(),)
        if not hmac.compare_digest(
            mac, _mac(self.token, "client", method, path, nonce, cnonce, *signed)
        ):
            return "wrong token"
        now = time.time()
        with self._lock:
            if nonce in self._used:
                return "replayed request"
            self._used = {n: t for n, t in self._used.items() if t > now}
            self._used[nonce] = now + self.ttl_s
        return nonce, cnonce

    def proof(
        self, method: str, path: str, nonce: str, cnonce: str, status: int, body: bytes
    ) -> str:
        """The X-Disagg-Proof value for an answer to an authenticated request."""
        return _mac(
            self.token, "server", method, path, nonce, cnonce, *_answer_digest(status, body)
        )


def _call(
    host: str,
    port: int,
    path: str,
    timeout_s: float,
    headers: dict[str, str],
    method: str = "GET",
    body: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        if body is not None:
            headers = {**headers, "Content-Type": "application/json"}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        body = resp.read(MAX_BODY + 1)
        if len(body) > MAX_BODY:
            raise ControlError(resp.status, b"answer too large", f"{host}:{port}{path}")
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    except http.client.HTTPException as e:  # a malformed answer: not an HTTP agent
        raise ConnectionError(f"{host}:{port}{path}: bad HTTP answer: {printable(e)}") from None
    finally:
        conn.close()


def control_get(
    host: str, port: int, path: str, token: bytes | None, timeout_s: float = 5.0
) -> bytes:
    """GET an agent's control endpoint, proving the token without sending it."""
    return control_call(host, port, path, token, timeout_s)


def control_put(
    host: str, port: int, path: str, token: bytes | None, body: bytes, timeout_s: float = 5.0
) -> bytes:
    """PUT `body` to an agent's control endpoint (PUT /settings), signed with the token."""
    return control_call(host, port, path, token, timeout_s, "PUT", body)


def control_call(
    host: str,
    port: int,
    path: str,
    token: bytes | None,
    timeout_s: float = 5.0,
    method: str = "GET",
    body: bytes | None = None,
) -> bytes:
    """Call an agent's control endpoint, proving the token without sending it.

    Holding a token, the answer must carry the agent's proof (no downgrade to an
    agent that asks for nothing). Raises PeerAuthError when either side fails to
    prove itself, ControlError for another HTTP error, OSError when unreachable.
    """
    where = f"{host}:{port}{path}"
    status, headers, answer = _call(host, port, path, timeout_s, {}, method, body)
    if path in UNAUTHENTICATED and status != 401:
        if status != 200:
            raise ControlError(status, answer, where)
        return answer
    if status != 401:
        if token is not None and status == 200:
            raise PeerAuthError(
                f"the agent at {host}:{port} asks for no cluster token, so it cannot prove it "
                "belongs to this cluster: refusing its answer; restart it with --token-file"
            )
        if status != 200:
            raise ControlError(status, answer, where)
        return answer
    if token is None:
        raise PeerAuthError(
            f"the agent at {host}:{port} requires the cluster token and none was given"
        )
    challenge = parse_authorization(headers.get("www-authenticate"))
    nonce = (challenge or {}).get("nonce")
    if not nonce:
        raise PeerAuthError(f"{where} answered 401 without a {SCHEME} challenge")
    cnonce = secrets.token_hex(16)
    signed = () if body is None else (hashlib.sha256(body).hexdigest(),)
    mac = _mac(token, "client", method, path, nonce, cnonce, *signed)
    auth = f'{SCHEME} nonce="{nonce}", cnonce="{cnonce}", mac="{mac}"'
    status, headers, answer = _call(
        host, port, path, timeout_s, {"Authorization": auth}, method, body
    )
    if status == 401:
        raise PeerAuthError(f"the agent at {host}:{port} refused our proof: wrong cluster token?")
    expected = _mac(token, "server", method, path, nonce, cnonce, *_answer_digest(status, answer))
    if not hmac.compare_digest(headers.get(PROOF_HEADER.lower(), ""), expected):
        raise PeerAuthError(
            f"the agent at {host}:{port} could not prove it holds the cluster token"
        )
    if status != 200:
        raise ControlError(status, answer, where)
    return answer
