"""Prefill agent: runs the prompt through PyTorch + transformers and streams
each layer's K/V to the decode agent as soon as that layer is computed.

Run: python -m agents.prefill --model DIR [--host H --port P --device cuda]
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from agents.models import get_adapter, layer_kinds_from_hf, load_hf_config
from agents.prefill.prefixcache import PrefillPrefix
from agents.prefill.queue import FairQueue
from agents.prefix.store import default_max_mb, prefix_digest
from agents.quant import check_supported, weights_identity, weights_mismatch
from agents.runtime.daemonpool import DaemonPool
from agents.runtime.metrics import Stats
from agents.runtime.server import common_args, serve, start_agent
from agents.runtime.torchshare import TorchShare
from agents.wire.channel import (
    OutFrame,
    out_frame,
    recv_control,
    recv_json,
    send_error,
    send_json,
    send_out,
)
from agents.wire.fingerprint import fingerprint_mismatch
from agents.wire.frames import (
    CONTROL_MAX_FRAME,
    IDS_U32_CAP,
    Frame,
    PeerClosed,
    ProtocolError,
    RemoteError,
    json_bytes,
    split_json_ids,
)
from agents.wire.kvcodec import (
    DTYPE_NAMES,
    Codec,
    Kind,
    LayerKV,
    QuantKV,
    block_bytes,
    decode_layer,
    encode_layer,
    quantize_layer,
)
from agents.wire.request import PrefillRequest, RequestError
from agents.wire.text import printable

log = logging.getLogger("disagg.prefill")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> str:
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def pick_dtype(name: str, cfg: dict[str, Any]) -> str:
    if name != "auto":
        return name
    stored = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return stored if stored in TORCH_DTYPES else "float32"


def to_wire(t: torch.Tensor) -> np.ndarray:
    """[1, H, S, D] cache tensor -> [H, S, D] numpy in the wire dtype."""
    t = t[0].contiguous()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)  # raw bf16 words
    return t.numpy()


def to_wire_async(tensors: tuple[torch.Tensor, ...]) -> tuple[list[np.ndarray], Callable[[], None]]:
    """[1, H, S, D] CUDA cache tensors -> [H, S, D] host arrays in pinned memory,
    copied without stopping the device's queue: the next layer computes while this
    one comes across. Read the arrays only after calling the returned function."""
    out = []
    for t in tensors:
        src = t[0].view(torch.int16) if t.dtype == torch.bfloat16 else t[0]
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        host.copy_(src, non_blocking=True)
        arr = host.numpy()  # shares the pinned buffer and keeps it alive
        out.append(arr.view(np.uint16) if t.dtype == torch.bfloat16 else arr)
    done = torch.cuda.Event()
    done.record()
    return out, done.synchronize


class PrefillEngine:
    """One loaded model; `prefill` streams K/V layer by layer through a callback."""

    def __init__(self, model_dir: str, device: str = "auto", dtype: str = "auto") -> None:
        from transformers import AutoModelForCausalLM  # heavy: import once the args parsed

        from agents.quant.loader import load_packed_model, needs_packed_loader

        self.model_dir = model_dir
        check_supported(model_dir)
        self.cfg = load_hf_config(model_dir)
        self.adapter = get_adapter(self.cfg["model_type"])
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.cfg)
        self.packed_bytes = 0  # quantized weights held packed (0: full precision)
        model: Any
        if needs_packed_loader(model_dir, self.cfg):
            # transformers cannot read these; keep the weights packed (agents.quant).
            model, self.packed_bytes = load_packed_model(
                model_dir, self.cfg, TORCH_DTYPES[self.dtype], self.device
            )
        else:
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=TORCH_DTYPES[self.dtype]
            )
            model = loaded.to(self.device)
        self.model = model.eval()
        # The decoder stack without the LM head: prefill never needs logits.
        self.body = getattr(self.model, self.model.base_model_prefix)
        self.head = self.model.get_output_embeddings()
        self.layers = list(self.body.layers)
        self.kinds = layer_kinds_from_hf(self.cfg)
        self.fingerprint = {
            "architecture": self.cfg["model_type"],
            "num_layers": len(self.layers),
            "num_kv_heads": self.adapter.num_kv_heads(self.cfg),
            "head_dim": self.adapter.head_dim(self.cfg),
            "dtype": self.dtype,
            "layers": self.kinds,
            "weights": weights_identity(model_dir),
        }
        self.slots = FairQueue()  # one forward pass at a time per device, fairly
        self.share = TorchShare.from_env()

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: list[int],
        on_layer: Callable[[LayerKV], None],
        start: int = 0,
        prefix: PrefillPrefix | None = None,
        after: list[Callable[[], None]] | None = None,
        salt: str | None = None,
        *,
        host_async: bool = False,
        cores_busy: bool = False,
    ) -> tuple[dict[str, Any], np.ndarray]:
        """Run the prompt; call `on_layer` with each layer's K/V the moment it exists.

        Only positions from `start` on are sent (the decode side holds the rest).
        With `prefix`, a cached prefix of the prompt is not computed again, and
        the prompt's blocks are kept: at once, or by a call appended to `after`
        for the caller to make once the K/V and logits are out. With `host_async`
        on a CUDA device, the layers handed over may still be in flight: their
        reader calls `LayerKV.wait` first (LayerSender does). `cores_busy`: the
        requester decodes on this machine's cores (agents.runtime.torchshare).
        Returns timings and the float32 logits of the last position, from which
        the decode side samples the first token without running a step itself.
        """
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        total = len(token_ids)
        marks: dict[str, float] = {}
        wire = DTYPE_NAMES[self.dtype]
        overlap = host_async and self.device.startswith("cuda")

        def hook(idx: int) -> Callable[..., None]:
            def _after_layer(module: Any, args: Any, output: Any) -> None:
                layer: Any = cache.layers[idx]
                kind = Kind.SLIDING if self.kinds[idx][0] == "sliding" else Kind.FULL
                # [1, H, S, D]: a sliding layer holds only the prompt's last S positions.
                keep = min(layer.keys.shape[2], total - start)
                keys, values = layer.keys[:, :, -keep:], layer.values[:, :, -keep:]
                if overlap:
                    (k, v), ready = to_wire_async((keys, values))
                    on_layer(LayerKV(idx, kind, wire, k, v, ready=ready))
                else:
                    on_layer(LayerKV(idx, kind, wire, to_wire(keys), to_wire(values)))
                if idx == len(self.layers) - 1:
                    marks["last_layer_at"] = time.time()

            return _after_layer

        # The queue's cost: what is left to compute once a cached prefix is seeded.
        cost = total - (prefix.expected_hit(token_ids, salt) if prefix else 0)
        # Hooks are per module, shared by all requests: add them only in the slot.
        # Nothing here waits on a socket: `on_layer` only queues (LayerSender.put).
        with (
            self.slots.slot(cost) as queue_s,  # behind other prompts' forward passes
            self.share.threads(cores_busy) as threads,
        ):
            handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(self.layers)]
            try:
                t0 = time.perf_counter()
                keys, cached = prefix.seed(cache, token_ids, salt) if prefix else ([], 0)
                ids = torch.tensor([token_ids[cached:]], device=self.device)
                out = self.body(input_ids=ids, past_key_values=cache, use_cache=True)
                # [1, S, hidden] -> the LM head on the last position only: [vocab]
                logits = self.head(out.last_hidden_state[:, -1:, :])[0, -1].float().cpu()
                compute_s = time.perf_counter() - t0
            finally:
                for h in handles:
                    h.remove()
            if prefix:
                store = prefix.storer(keys, cache)
                if after is None:
                    store()
                else:
                    after.append(store)
        stats = {
            "prefill_time": compute_s,
            "queue_time": queue_s,
            "tokens": len(token_ids),
            "start": start,
            "cached_tokens": cached,
            "threads": threads,
            **marks,
        }
        return stats, logits.numpy()


class PeerStalled(Exception):
    """The peer stopped taking its K/V: its connection is cut, nobody else waits."""


KV_BUFFER_MB = 4096  # per connection: raw K/V computed and not yet on the wire
KV_STALL_S = 60.0  # a peer that takes no K/V bytes for this long is cut off
# A frame's bytes, or what makes them when the frames before it are sent.
FramePayload = bytes | Callable[[], bytes]


@dataclass(frozen=True, slots=True)
class _Layer:
    """A layer queued to send: its frame made already when that reads no bytes
    (raw, lossless, contiguous: only views), else made by the sending thread."""

    kv: LayerKV
    frame: OutFrame | None
    nbytes: int  # raw K/V bytes


# The threads LayerSenders send from (agents.runtime.daemonpool: reused, never queued).
SENDERS = DaemonPool("kv-sender")


class LayerSender:
    """Sends KV_LAYER frames from its own thread so the socket overlaps compute.

    Counts the raw (model dtype) K/V bytes and the time spent encoding them.
    With `kv_quant` "int8" each layer is quantized first (lossy; timed apart in
    `quant_s`, so `encode_s` stays the codec's own time). With `probe_layer`,
    that layer is also encoded and decoded once with every other compressing
    codec after it is sent, and the sizes and times are kept in `probe` for the
    decode side's codec choice (agents.decode.codectuner).

    `put` never waits on the socket (it runs inside the forward pass): layers
    queue here, at most `max_buffer_bytes` of them, and a peer that lets more
    pile up, or takes no bytes for `stall_s`, is cut off
    (PeerStalled), which ends that request only.
    """

    def __init__(
        self,
        sock: socket.socket,
        codec: Codec,
        probe_layer: int | None = None,
        kv_quant: str | None = None,
        max_buffer_bytes: int = KV_BUFFER_MB << 20,
        stall_s: float = KV_STALL_S,
    ) -> None:
        self.sock = sock
        self.codec = codec
        self.kv_quant = kv_quant
        self.probe_layer = probe_layer
        self.probe: dict[str, dict[str, float]] = {}
        self.max_buffer_bytes = max_buffer_bytes
        self.stall_s = stall_s
        self.q: queue.SimpleQueue[_Layer | tuple[Frame, FramePayload] | None] = queue.SimpleQueue()
        self.cond = threading.Condition()  # guards the counts below; never held over I/O
        self.buffered = 0  # raw K/V bytes put and not yet sent
        self.queued = 0  # items put and not yet sent (or dropped)
        # Monotonic time the send under way began or last got bytes out (None: idle).
        self.sending_since: float | None = None
        self.bytes = 0
        self.raw_bytes = 0
        self.encode_s = 0.0
        self.quant_s = 0.0
        self.closed = False
        self.error: BaseException | None = None
        self.done = SENDERS.run(self._run)  # set once the sending thread is through

    def put(self, kv: LayerKV) -> None:
        """Queue one layer; raises the sender's error (so a failed or stalled
        peer's forward pass stops at once and frees the device)."""
        n = kv.keys.nbytes + kv.values.nbytes
        frame = self._early_frame(kv)  # raises before anything is counted
        with self.cond:
            if self.error is None and self.buffered and self.buffered + n > self.max_buffer_bytes:
                self._stalled(f"{self.buffered} bytes of K/V waiting for it")
            elif self.error is None and self.stalled_s() >= self.stall_s:
                self._stalled(f"it took no K/V for {self.stall_s:.0f}s")
            if self.error is not None:
                raise self.error
            self.buffered += n
            self.queued += 1
        self.q.put(_Layer(kv, frame, n))

    def _early_frame(self, kv: LayerKV) -> OutFrame | None:
        """The layer's frame made here, on the producer's thread, where it costs
        the wire nothing (see protocol.OutFrame); None: the sending thread makes
        it (compressing or quantizing reads the bytes, which a device-to-host
        copy may still be writing)."""
        if self.codec != Codec.RAW or self.kv_quant:
            return None
        if not (kv.keys.flags.c_contiguous and kv.values.flags.c_contiguous):
            return None  # made contiguous by a copy, which reads them
        t0 = time.perf_counter()
        frame = out_frame(Frame.KV_LAYER, encode_layer(kv, Codec.RAW))
        self.encode_s += time.perf_counter() - t0
        return frame

    def put_frame(self, ftype: Frame, payload: FramePayload) -> None:
        """Queue a frame to follow the layers (LOGITS, PREFILL_DONE). A callable
        payload is made by the sending thread when the frames before it are sent
        (PREFILL_DONE's counts), sparing a round trip between the two threads."""
        with self.cond:
            if self.error is not None:
                raise self.error
            self.queued += 1
        self.q.put((ftype, payload))

    def stalled_s(self) -> float:
        """How long the send under way has got no bytes out (0: none under way)."""
        since = self.sending_since
        return 0.0 if since is None else time.monotonic() - since

    def _stalled(self, why: str) -> None:
        """Cut the peer off (called with `cond` held): shutdown wakes the send."""
        self.error = PeerStalled(f"peer stopped reading: {why}")
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.cond.notify_all()

    def drain(self) -> None:
        """Wait until all that was put is on the wire; raises the sender's
        error, cutting the peer off if it takes no bytes for `stall_s`."""
        with self.cond:
            while self.queued and self.error is None:
                left = self.stall_s - self.stalled_s()
                if left <= 0:
                    self._stalled(f"it took no K/V for {self.stall_s:.0f}s")
                    break
                self.cond.wait(left)
            if self.error is not None:
                raise self.error

    def _run(self) -> None:
        while (item := self.q.get()) is not None:
            n = item.nbytes if isinstance(item, _Layer) else 0
            try:
                if self.error is not None:
                    continue  # drain: the peer is gone
                if isinstance(item, _Layer):
                    self._send_layer(item)
                else:
                    ftype, payload = item
                    self._send(out_frame(ftype, payload() if callable(payload) else payload))
            except Exception as e:  # OSError: the peer is gone; else a bug, sent as ERROR
                with self.cond:
                    if self.error is None:
                        self.error = e
            finally:
                with self.cond:
                    self.sending_since = None
                    self.buffered -= n
                    self.queued -= 1
                    # drain() waits for an empty queue (or an error): waking it
                    # per layer only takes the GIL back and forth with this thread.
                    if not self.queued or self.error is not None:
                        self.cond.notify_all()

    def _send(self, frame: OutFrame) -> int:
        self.sending_since = time.monotonic()
        sent = send_out(self.sock, frame, progress=self._progress)
        self.sending_since = None
        return sent

    def _progress(self) -> None:
        # A slow link that keeps taking bytes is not stalled, however long a frame.
        self.sending_since = time.monotonic()

    def _send_layer(self, layer: _Layer) -> None:
        kv, frame = layer.kv, layer.frame
        kv.wait()  # a device-to-host copy may still be under way
        wire: LayerKV | QuantKV = kv
        if frame is None:
            t0 = time.perf_counter()
            wire = quantize_layer(kv) if self.kv_quant else kv
            t1 = time.perf_counter()
            frame = out_frame(Frame.KV_LAYER, encode_layer(wire, self.codec))
            self.quant_s += t1 - t0
            self.encode_s += time.perf_counter() - t1
        self.raw_bytes += layer.nbytes
        self.bytes += self._send(frame)
        if kv.layer == self.probe_layer:
            self._probe(wire)

    def _probe(self, kv: LayerKV | QuantKV) -> None:
        raw = block_bytes(kv)  # what the codec compresses: int8 blocks when quantized
        for codec in Codec:
            if codec in (Codec.RAW, self.codec):
                continue  # the codec in use is measured on every layer anyway
            t0 = time.perf_counter()
            parts = encode_layer(kv, codec)
            t1 = time.perf_counter()
            decode_layer(b"".join(parts))
            t2 = time.perf_counter()
            wire = sum(memoryview(p).nbytes for p in parts[1:])
            self.probe[str(int(codec))] = {
                "raw_bytes": raw,
                "wire_bytes": wire,
                "encode_s": t1 - t0,
                "decode_s": t2 - t1,
            }

    def close(self) -> None:
        """Finish sending (a stalled peer is cut off) and stop the thread."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):
                self.drain()
            self.q.put(None)
            self.done.wait()


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
        self.prefix = PrefillPrefix(int(mb * (1 << 20)), engine.kinds, namespace)
        self.stats.extra.append(lambda: self.prefix.cache.prometheus("prefill"))

    def status(self) -> dict[str, Any]:
        return {
            "role": "prefill",
            "name": self.name,
            "model": self.engine.model_dir,
            "loaded": True,
            "backend": "torch",
            "device": self.engine.device,
            "fingerprint": self.engine.fingerprint,
            **self.stats.snapshot(),
            "prefix_cache": self.prefix.cache.snapshot(),
            "queue": self.engine.slots.snapshot(),
            "kv_send": self.send_snapshot(),
        }

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
        try:
            vocab = int(self.engine.cfg.get("vocab_size") or 0)
            req = PrefillRequest.from_dict(frame, vocab, packed)
            digest = req.prefix_digest
            if digest is not None and digest != prefix_digest(req.token_ids[: req.start]):
                raise RequestError("prefix_digest", "prefix_digest does not match the start tokens")
        except RequestError as e:
            send_error(sock, "bad_request", str(e))
            return False
        ids, start, kv_quant, codec = req.token_ids, req.start, req.kv_quant, Codec(req.codec)
        prefix = self.prefix if req.prefix_cache else None
        self.stats.begin()
        probe = self.engine.fingerprint["num_layers"] // 2 if req.probe_codecs else None
        sender = LayerSender(sock, codec, probe, kv_quant, self.kv_buffer_bytes, self.kv_stall_s)
        with self.senders_lock:
            self.senders.add(sender)
        outcome, result = "error", None
        after: list[Callable[[], None]] = []  # the prefix cache's store, once all is sent
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
            )
            # Every send goes through the sender, whose deadline cuts a peer that
            # stops reading; this thread holds no lock while it waits.
            sender.put_frame(Frame.LOGITS, logits.tobytes())
            done = result  # the closure's own name: a dict here, not Optional

            def done_frame() -> bytes:  # on the sending thread, once LOGITS is out
                done.update(
                    kv_bytes=sender.bytes,
                    kv_raw_bytes=sender.raw_bytes,
                    kv_encode_time=sender.encode_s,
                    kv_quant=kv_quant,
                    kv_quant_time=sender.quant_s,
                    codec=int(codec),
                    server=self.name,
                    device=self.engine.device,
                )
                if sender.probe:
                    done["codec_probe"] = sender.probe
                return json_bytes(done)

            sender.put_frame(Frame.PREFILL_DONE, done_frame)
            sender.drain()
            outcome = "ok"
            log.info(
                "%s: prefilled %d tokens in %.3fs, %d KV bytes",
                peer,
                len(ids),
                result["prefill_time"],
                sender.bytes,
            )
            return True
        except PeerStalled as e:
            outcome = "peer_stalled"
            log.warning("%s: dropped: %s", peer, e)
            return False
        except OSError as e:
            outcome = "cancelled"
            log.warning("%s: connection lost during prefill: %s", peer, e)
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
    args, token, engine = start_agent(
        "prefill",
        parser,
        lambda a: PrefillEngine(a.model, device=a.device, dtype=a.dtype),
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
