"""The decode side of a prefill connection: dial, handshake, receive the prompt's
K/V layer by layer straight into mlx caches."""

from __future__ import annotations

import socket
import time
from typing import Any

import numpy as np

from . import protocol as P
from .kvcodec import Codec, decode_layer
from .mlxcache import fill_layer


class PrefillUnavailable(Exception):
    """The prefill agent could not be reached or dropped the stream: fall back."""


def target_hosts(target: dict[str, Any]) -> list[str]:
    """Data-plane addresses to try, fastest path first."""
    hosts = target.get("hosts") or [target.get("host")]
    return [str(h) for h in hosts if h]


def dial(hosts: list[str], port: int, timeout_s: float) -> tuple[socket.socket, str, list[str]]:
    """Connect to the first address that answers; also return why the others failed."""
    failures: list[str] = []
    for host in hosts:
        try:
            sock = socket.create_connection((host, port), timeout=min(timeout_s, 5.0))
            return sock, host, failures
        except OSError as e:
            failures.append(f"{host}:{port}: {e}")
    raise PrefillUnavailable(f"cannot reach prefill agent at {'; '.join(failures) or 'no address'}")


def fetch_kv(
    target: dict[str, Any],
    ids: list[int],
    caches: list[Any],
    hello: dict[str, Any],
    codec: Codec,
    token: bytes | None = None,
    vocab_size: int | None = None,
) -> tuple[dict[str, Any], np.ndarray]:
    """Fill `caches` with the K/V of `ids` from the prefill agent; return metrics
    and the float32 logits of the prompt's last position.

    Raises PrefillUnavailable when the agent is down, slow past its timeout, fails,
    or drops the stream (the caller prefills locally); RemoteError only for a
    model mismatch, which must never be papered over by a local prefill.
    """
    port = int(target["port"])
    timeout_s = float(target.get("timeout", 60.0))
    t0 = time.perf_counter()
    sock, host, failures = dial(target_hosts(target), port, timeout_s)
    addr = f"{host}:{port}"
    metrics: dict[str, Any] = {"kv_bytes": 0}
    try:
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        P.client_auth(sock, token)
        P.send_json(sock, P.Frame.HELLO, hello)
        _, ok = P.recv_json(sock, P.Frame.HELLO_OK)
        P.send_json(sock, P.Frame.PREFILL, {"token_ids": ids, "codec": int(codec)})
        t_sent = time.perf_counter()
        first = last = None
        logits: np.ndarray | None = None
        got: set[int] = set()
        while True:
            header, payload = P.recv_frame(sock)
            if header.type == P.Frame.KV_LAYER:
                kv = decode_layer(payload)
                if not 0 <= kv.layer < len(caches) or kv.layer in got:
                    raise P.ProtocolError(f"unexpected KV for layer {kv.layer}")
                fp = hello["fingerprint"]
                if kv.keys.shape[0] != fp["num_kv_heads"] or kv.keys.shape[2] != fp["head_dim"]:
                    raise P.ProtocolError(f"layer {kv.layer} K/V has shape {kv.keys.shape}")
                try:
                    fill_layer(caches[kv.layer], kv, len(ids))
                except ValueError as e:  # token count or cache kind does not fit
                    raise P.ProtocolError(str(e)) from None
                last = time.perf_counter()
                if first is None:
                    first = last
                    metrics["kv_first_layer_at"] = time.time()
                got.add(kv.layer)
                metrics["kv_bytes"] += P.HEADER.size + len(payload)
            elif header.type == P.Frame.LOGITS:
                logits = np.frombuffer(bytes(payload), np.float32)
                if vocab_size and logits.shape[0] != vocab_size:
                    raise P.ProtocolError(f"{logits.shape[0]} logits for a vocab of {vocab_size}")
            elif header.type == P.Frame.PREFILL_DONE:
                done = P.decode_json(header, payload)
                break
            elif header.type == P.Frame.ERROR:
                err = P.decode_json(header, payload)
                raise P.RemoteError(str(err.get("code")), str(err.get("message")))
            else:
                raise P.ProtocolError(f"unexpected {header.type.name} during KV stream")
        if len(got) != len(caches) or logits is None:
            raise P.ProtocolError(
                f"prefill sent {len(got)} of {len(caches)} layers, "
                f"{'no' if logits is None else ''} logits"
            )
    except (OSError, P.ProtocolError) as e:
        raise PrefillUnavailable(f"prefill stream from {addr} failed: {e}") from e
    except P.AuthError as e:
        # Not a fault to paper over with a local prefill: the cluster is misconfigured.
        raise P.RemoteError("unauthorized", f"prefill agent {addr} refused us: {e}") from e
    except P.RemoteError as e:
        if e.code == "model_mismatch":
            raise  # the user must see this; prefilling locally would hide it
        raise PrefillUnavailable(f"prefill agent {addr} failed: {e.code}: {e.message}") from e
    finally:
        sock.close()
    metrics.update(
        prefill_time=done.get("prefill_time"),
        prefill_server=ok.get("server") or addr,
        prefill_address=addr,
        kv_transfer_time=(last - first) if first and last else 0.0,
        kv_wait_time=(first - t_sent) if first else None,
        kv_fetch_time=time.perf_counter() - t0,
        prefill_last_layer_at=done.get("last_layer_at"),
    )
    if failures:
        metrics["path_failures"] = failures
    return metrics, logits
