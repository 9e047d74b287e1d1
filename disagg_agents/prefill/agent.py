"""Prefill agent: runs the prompt through PyTorch + transformers and streams
each layer's K/V to the decode agent as soon as that layer is computed.

Run: python -m disagg_agents.prefill --model DIR [--host H --port P --device cuda]
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from disagg_agents.prefill.embed import Embedder
from disagg_agents.prefill.engine import PrefillEngine
from disagg_agents.prefill.prefixcache import PrefillPrefixCache
from disagg_agents.prefill.queue import Dropped
from disagg_agents.prefill.sender import KV_BUFFER_MB, KV_STALL_S, LayerSender, PeerStalled
from disagg_agents.prefix.store import default_max_mb, prefix_digest
from disagg_agents.quant import weights_mismatch
from disagg_agents.runtime.args import common_args
from disagg_agents.runtime.hangup import client_gone
from disagg_agents.runtime.metrics import Stats
from disagg_agents.runtime.report import PrefillStatus
from disagg_agents.runtime.serve import exit_now, serve, start_agent
from disagg_agents.runtime.settings import (
    Setting,
    attr_setting,
    budget_setting,
    tenant_share_setting,
)
from disagg_agents.wire.channel import (
    recv_control,
    recv_json,
    send_error,
    send_json,
)
from disagg_agents.wire.fingerprint import fingerprint_mismatch
from disagg_agents.wire.frames import (
    CONTROL_MAX_FRAME,
    IDS_U32_CAP,
    Frame,
    PeerClosed,
    ProtocolError,
    RemoteError,
    json_bytes,
    split_json_ids,
)
from disagg_agents.wire.kvcodec import (
    Codec,
)
from disagg_agents.wire.request import PrefillRequest, RequestError
from disagg_agents.wire.text import printable

log = logging.getLogger("disagg.prefill")


class PrefillAgent:
    def __init__(
        self,
        engine: PrefillEngine,
        name: str,
        max_request_bytes: int = CONTROL_MAX_FRAME,
        prefix_cache_mb: float | None = None,
        kv_buffer_mb: float = KV_BUFFER_MB,
        kv_stall_s: float = KV_STALL_S,
    ) -> None:
        self.engine = engine
        self.name = name
        self.max_request_bytes = max_request_bytes  # largest HELLO / PREFILL frame taken
        self.kv_buffer_bytes = int(kv_buffer_mb * (1 << 20))
        self.kv_stall_s = kv_stall_s
        self.senders: set[LayerSender] = set()  # requests whose K/V is still going out
        self.senders_lock = threading.Lock()
        self.stats = Stats("prefill")
        mb = default_max_mb() if prefix_cache_mb is None else prefix_cache_mb
        # K/V computed here, on this device and dtype: its own namespace.
        namespace = f"torch:{engine.device}:{engine.dtype}"
        self.prefix = PrefillPrefixCache(int(mb * (1 << 20)), engine.kinds, namespace)
        self.stats.extra.append(lambda: self.prefix.store.prometheus("prefill"))
        self.embedder = Embedder(engine)  # EMBED frames (disagg_agents.prefill.embed)

    def live_settings(self) -> list[Setting]:
        """What PUT /settings may change (disagg_agents.runtime.settings), for new requests."""
        return [
            budget_setting(self.prefix.store),
            tenant_share_setting(self.prefix.store),
            attr_setting(
                "kv_stall_timeout_s",
                self,
                "kv_stall_s",
                float,
                0.1,
                86400.0,
                "cut a peer that takes no K/V bytes for this many seconds",
            ),
        ]

    def status(self) -> PrefillStatus:
        return PrefillStatus(
            name=self.name,
            model=self.engine.model_dir,
            device=self.engine.device,
            fingerprint=self.engine.fingerprint,
            moe_paths=self.engine.moe_paths,
            stats=self.stats.snapshot(),
            prefix_cache=self.prefix.store.snapshot(),
            queue=self.engine.slots.snapshot(),
            kv_send=self.send_snapshot(),
        )

    def send_snapshot(self) -> dict[str, Any]:
        """Requests still sending K/V, what they hold, and the longest stalled send."""
        with self.senders_lock:
            senders = list(self.senders)
        return {
            "requests": len(senders),
            "buffered_bytes": sum(s.buffered for s in senders),
            "stalled_s": round(max((s.stalled_s() for s in senders), default=0.0), 3),
            "stall_timeout_s": self.kv_stall_s,
        }

    def handle(self, sock: socket.socket, peer: str) -> None:
        """One decode agent connection: HELLO, then any number of PREFILLs."""
        try:
            _, hello = recv_json(sock, Frame.HELLO, self.max_request_bytes)
        except (ProtocolError, RemoteError, OSError) as e:
            log.warning("%s: bad hello: %s", peer, printable(e))
            send_error(sock, "protocol", str(e))
            return
        if hello.get("role") == "embed":  # embeddings: no K/V leaves, no fingerprint
            info = {"server": self.name, "model": self.engine.model_dir}
            send_json(sock, Frame.HELLO_OK, {**info, "pooling": self.embedder.pooling})
            self.embedder.serve(sock, self.max_request_bytes)
            return
        ours = self.engine.fingerprint
        diffs = fingerprint_mismatch(ours, hello.get("fingerprint") or {})
        if diffs:
            msg = (
                f"model mismatch: prefill {self.name} has {self.engine.model_dir}, "
                f"decode has {printable(hello.get('model'))}: {'; '.join(diffs)}"
            )
            log.warning("%s: %s", peer, printable(msg, 1000))
            send_error(sock, "model_mismatch", msg)
            return
        # Different weights (bf16 here, 4-bit there) decode other text than either
        # side alone would: refused unless the decode agent was told to allow it.
        mixed = weights_mismatch(
            ours, hello.get("fingerprint") or {}, self.engine.model_dir, str(hello.get("model"))
        )
        if mixed and hello.get("allow_mixed") is not True:
            log.warning("%s: %s", peer, mixed)
            send_error(sock, "model_mismatch", mixed)
            return
        send_json(
            sock,
            Frame.HELLO_OK,
            {
                "fingerprint": ours,
                "model": self.engine.model_dir,
                "server": self.name,
                "weights": "mixed" if mixed else "same",
                **IDS_U32_CAP,
            },
        )
        while True:
            try:
                header, payload = recv_control(sock, Frame.PREFILL, self.max_request_bytes)
                req, packed = split_json_ids(header, payload)
            except PeerClosed:
                return  # the decode agent is done with this connection
            except ProtocolError as e:
                log.warning("%s: %s", peer, printable(e))
                send_error(sock, "protocol", str(e))
                return
            except OSError:
                return
            if not self._prefill_one(sock, peer, req, packed):
                return

    def _prefill_one(
        self, sock: socket.socket, peer: str, frame: dict[str, Any], packed: memoryview | None
    ) -> bool:
        arrived = time.monotonic()
        req = self._read_request(sock, frame, packed)
        if req is None:
            return False
        ids, start, codec = req.token_ids, req.start, Codec(req.codec)
        prefix = self.prefix if req.prefix_cache else None
        self.stats.begin()
        sender = self._open_sender(sock, req, codec)
        outcome, result = "error", None
        after: list[Callable[[], None]] = []  # the prefix cache's save, once all is sent
        try:
            result, logits = self.engine.prefill(
                ids,
                sender.put,
                start,
                prefix,
                after,
                req.cache_salt,
                host_async=True,
                cores_busy=req.cores_busy,
                gone=lambda: client_gone(sock),
                # The requester waits this long for its first K/V; past it, it has left.
                deadline=None if req.wait_s is None else arrived + req.wait_s,
            )
            # Every send goes through the sender, whose deadline cuts a peer that
            # stops reading; this thread holds no lock while it waits.
            sender.put_frame(Frame.LOGITS, logits.tobytes())
            sender.put_frame(Frame.PREFILL_DONE, self._done_frame(sender, result, req))
            sender.drain()
            outcome = "ok"
            took, sent = result["prefill_time"], sender.bytes
            log.info("%s: prefilled %d tokens in %.3fs, %d KV bytes", peer, len(ids), took, sent)
            return True
        except PeerStalled as e:
            outcome = "peer_stalled"
            log.warning("%s: dropped: %s", peer, e)
            return False
        except (Dropped, OSError) as e:  # the requester left: nobody to tell
            outcome = "cancelled"
            log.info("%s: %s", peer, e if isinstance(e, Dropped) else f"connection lost: {e}")
            return False
        except Exception as e:
            log.exception("%s: prefill failed", peer)
            err = {"code": "prefill_failed", "message": f"{type(e).__name__}: {e}"}
            with contextlib.suppress(Exception):  # best effort, after what was queued
                sender.put_frame(Frame.ERROR, json_bytes(err))
            return False
        finally:
            sender.close()
            with self.senders_lock:
                self.senders.discard(sender)
            for fn in after:
                fn()
            self.stats.end(outcome, result)

    def _open_sender(self, sock: socket.socket, req: PrefillRequest, codec: Codec) -> LayerSender:
        """The request's sender (a codec probe on the middle layer when asked),
        counted among the live ones."""
        probe = self.engine.fingerprint["num_layers"] // 2 if req.probe_codecs else None
        sender = LayerSender(
            sock, codec, probe, req.kv_quant, self.kv_buffer_bytes, self.kv_stall_s
        )
        with self.senders_lock:
            self.senders.add(sender)
        return sender

    def _read_request(
        self, sock: socket.socket, frame: dict[str, Any], packed: memoryview | None
    ) -> PrefillRequest | None:
        """The PREFILL checked once; a bad one is answered with ERROR (None)."""
        try:
            vocab = int(self.engine.cfg.get("vocab_size") or 0)
            req = PrefillRequest.from_dict(frame, vocab, packed)
            digest = req.prefix_digest
            if digest is not None and digest != prefix_digest(req.token_ids[: req.start]):
                raise RequestError("prefix_digest", "prefix_digest does not match the start tokens")
        except RequestError as e:
            send_error(sock, "bad_request", str(e))
            return None
        return req

    def _done_frame(
        self, sender: LayerSender, done: dict[str, Any], req: PrefillRequest
    ) -> Callable[[], bytes]:
        """PREFILL_DONE's payload, made on the sending thread once LOGITS is out
        (so it counts every byte sent)."""

        def payload() -> bytes:
            done.update(
                kv_bytes=sender.bytes,
                kv_raw_bytes=sender.raw_bytes,
                kv_encode_time=sender.encode_s,
                kv_quant=req.kv_quant,
                kv_quant_time=sender.quant_s,
                codec=int(req.codec),
                server=self.name,
                device=self.engine.device,
                # Prompts waiting for the device now: 0 tells the requester we are idle.
                queue_waiting=self.engine.slots.snapshot()["waiting"],
            )
            if sender.probe:
                done["codec_probe"] = sender.probe
            return json_bytes(done)

        return payload


def main() -> None:
    parser = common_args("prefill")
    parser.add_argument(
        "--kv-buffer-mb",
        type=float,
        default=KV_BUFFER_MB,
        help="K/V one connection may have computed and not yet sent; past it, that "
        f"request is dropped (default {KV_BUFFER_MB})",
    )
    parser.add_argument(
        "--kv-stall-timeout",
        type=float,
        default=KV_STALL_S,
        help=f"cut a peer that takes no K/V bytes for this many seconds (default {KV_STALL_S:.0f})",
    )
    parser.add_argument(
        "--dequant-budget-gb",
        type=float,
        default=None,
        help="quantized weights dequantized once at load, up to this many GB of growth "
        "(0: all kept packed; default: what the device's memory allows)",
    )
    args, token, engine = start_agent(
        "prefill",
        parser,
        lambda a: PrefillEngine(
            a.model, device=a.device, dtype=a.dtype, dequant_budget_gb=a.dequant_budget_gb
        ),
    )
    agent = PrefillAgent(
        engine,
        args.name or f"prefill@{socket.gethostname()}",
        args.max_request_bytes,
        args.prefix_cache_mb,
        args.kv_buffer_mb,
        args.kv_stall_timeout,
    )
    serve("prefill", args, token, agent)
    exit_now()  # drained: nothing in memory is kept past this process
