"""Prefill agent: runs the prompt through PyTorch + transformers and streams
each layer's K/V to the decode agent as soon as that layer is computed.

Run: python -m agents.prefill --model DIR [--host H --port P --device cuda]
"""

from __future__ import annotations

import argparse
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import protocol as P
from .kvcodec import (
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
from .metrics import Stats
from .models import get_adapter, layer_kinds_from_hf, load_hf_config
from .prefix.prefill_side import PrefillPrefix
from .prefix.store import default_max_mb, prefix_digest
from .quant import check_supported, weights_identity, weights_mismatch
from .request import PrefillRequest, RequestError
from .server import common_args, serve, start_agent

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


class PrefillEngine:
    """One loaded model; `prefill` streams K/V layer by layer through a callback."""

    def __init__(
        self, model_dir: str, device: str = "auto", dtype: str = "auto", layer_delay_s: float = 0.0
    ) -> None:
        from transformers import AutoModelForCausalLM  # heavy: import once the args parsed

        from .quant.loader import load_packed_model, needs_packed_loader

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
        self.lock = threading.Lock()  # one forward pass at a time per device
        # Fault-injection aid for tests: stretch the KV stream so a fault can land mid-way.
        self.layer_delay_s = layer_delay_s

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: list[int],
        on_layer: Callable[[LayerKV], None],
        start: int = 0,
        prefix: PrefillPrefix | None = None,
        after: list[Callable[[], None]] | None = None,
        salt: str | None = None,
    ) -> tuple[dict[str, Any], np.ndarray]:
        """Run the prompt; call `on_layer` with each layer's K/V the moment it exists.

        Only positions from `start` on are sent (the decode side holds the rest).
        With `prefix`, a cached prefix of the prompt is not computed again, and
        the prompt's blocks are kept: at once, or by a call appended to `after`
        for the caller to make once the K/V and logits are out.
        Returns timings and the float32 logits of the last position, from which
        the decode side samples the first token without running a step itself.
        """
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        total = len(token_ids)
        marks: dict[str, float] = {}
        wire = DTYPE_NAMES[self.dtype]

        def hook(idx: int) -> Callable[..., None]:
            def _after_layer(module: Any, args: Any, output: Any) -> None:
                layer: Any = cache.layers[idx]
                kind = Kind.SLIDING if self.kinds[idx][0] == "sliding" else Kind.FULL
                # [1, H, S, D]: a sliding layer holds only the prompt's last S positions.
                keep = min(layer.keys.shape[2], total - start)
                keys, values = layer.keys[:, :, -keep:], layer.values[:, :, -keep:]
                on_layer(LayerKV(idx, kind, wire, to_wire(keys), to_wire(values)))
                if idx == len(self.layers) - 1:
                    marks["last_layer_at"] = time.time()
                elif self.layer_delay_s:
                    time.sleep(self.layer_delay_s)

            return _after_layer

        # Hooks are per module, shared by all requests: add them only under the lock.
        t_wait = time.perf_counter()
        with self.lock:
            handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(self.layers)]
            try:
                t0 = time.perf_counter()
                queue_s = t0 - t_wait  # behind other prompts' forward passes
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
            **marks,
        }
        return stats, logits.numpy()


class LayerSender:
    """Sends KV_LAYER frames from its own thread so the socket overlaps compute.

    Counts the raw (model dtype) K/V bytes and the time spent encoding them.
    With `kv_quant` "int8" each layer is quantized first (lossy; timed apart in
    `quant_s`, so `encode_s` stays the codec's own time). With `probe_layer`,
    that layer is also encoded and decoded once with every other compressing
    codec after it is sent, and the sizes and times are kept in `probe` for the
    decode side's codec choice (agents.codecpick).
    """

    def __init__(
        self,
        sock: socket.socket,
        codec: Codec,
        probe_layer: int | None = None,
        kv_quant: str | None = None,
    ) -> None:
        self.sock = sock
        self.codec = codec
        self.kv_quant = kv_quant
        self.probe_layer = probe_layer
        self.probe: dict[str, dict[str, float]] = {}
        self.q: queue.Queue[LayerKV | None] = queue.Queue()
        self.bytes = 0
        self.raw_bytes = 0
        self.encode_s = 0.0
        self.quant_s = 0.0
        self.closed = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="kv-sender")
        self.thread.start()

    def put(self, kv: LayerKV) -> None:
        if self.error is None:
            self.q.put(kv)

    def _run(self) -> None:
        while (kv := self.q.get()) is not None:
            if self.error is not None:
                continue  # drain: the peer is gone
            try:
                t0 = time.perf_counter()
                wire: LayerKV | QuantKV = quantize_layer(kv) if self.kv_quant else kv
                t1 = time.perf_counter()
                parts = encode_layer(wire, self.codec)
                self.quant_s += t1 - t0
                self.encode_s += time.perf_counter() - t1
                self.raw_bytes += kv.keys.nbytes + kv.values.nbytes
                self.bytes += P.send_frame(self.sock, P.Frame.KV_LAYER, parts)
            except OSError as e:
                self.error = e
                continue
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
        if not self.closed:
            self.closed = True
            self.q.put(None)
            self.thread.join()


class PrefillAgent:
    def __init__(
        self,
        engine: PrefillEngine,
        name: str,
        max_request_bytes: int = P.CONTROL_MAX_FRAME,
        prefix_cache_mb: float | None = None,
    ) -> None:
        self.engine = engine
        self.name = name
        self.max_request_bytes = max_request_bytes  # largest HELLO / PREFILL frame taken
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
        }

    def handle(self, sock: socket.socket, peer: str) -> None:
        """One decode agent connection: HELLO, then any number of PREFILLs."""
        try:
            _, hello = P.recv_json(sock, P.Frame.HELLO, self.max_request_bytes)
        except (P.ProtocolError, P.RemoteError, OSError) as e:
            log.warning("%s: bad hello: %s", peer, P.printable(e))
            P.send_error(sock, "protocol", str(e))
            return
        ours = self.engine.fingerprint
        diffs = P.fingerprint_mismatch(ours, hello.get("fingerprint") or {})
        if diffs:
            msg = (
                f"model mismatch: prefill {self.name} has {self.engine.model_dir}, "
                f"decode has {P.printable(hello.get('model'))}: {'; '.join(diffs)}"
            )
            log.warning("%s: %s", peer, P.printable(msg, 1000))
            P.send_error(sock, "model_mismatch", msg)
            return
        # Different weights (bf16 here, 4-bit there) decode other text than either
        # side alone would: refused unless the decode agent was told to allow it.
        mixed = weights_mismatch(
            ours, hello.get("fingerprint") or {}, self.engine.model_dir, str(hello.get("model"))
        )
        if mixed and hello.get("allow_mixed") is not True:
            log.warning("%s: %s", peer, mixed)
            P.send_error(sock, "model_mismatch", mixed)
            return
        P.send_json(
            sock,
            P.Frame.HELLO_OK,
            {
                "fingerprint": ours,
                "model": self.engine.model_dir,
                "server": self.name,
                "weights": "mixed" if mixed else "same",
            },
        )
        while True:
            try:
                _, req = P.recv_json(sock, P.Frame.PREFILL, self.max_request_bytes)
            except P.PeerClosed:
                return  # the decode agent is done with this connection
            except P.ProtocolError as e:
                log.warning("%s: %s", peer, P.printable(e))
                P.send_error(sock, "protocol", str(e))
                return
            except OSError:
                return
            if not self._prefill_one(sock, peer, req):
                return

    def _prefill_one(self, sock: socket.socket, peer: str, frame: dict[str, Any]) -> bool:
        try:
            req = PrefillRequest.from_dict(frame, int(self.engine.cfg.get("vocab_size") or 0))
            digest = req.prefix_digest
            if digest is not None and digest != prefix_digest(req.token_ids[: req.start]):
                raise RequestError("prefix_digest", "prefix_digest does not match the start tokens")
        except RequestError as e:
            P.send_error(sock, "bad_request", str(e))
            return False
        ids, start, kv_quant, codec = req.token_ids, req.start, req.kv_quant, Codec(req.codec)
        prefix = self.prefix if req.prefix_cache else None
        self.stats.begin()
        probe = self.engine.fingerprint["num_layers"] // 2 if req.probe_codecs else None
        sender = LayerSender(sock, codec, probe, kv_quant)
        outcome, result = "error", None
        after: list[Callable[[], None]] = []  # the prefix cache's store, once all is sent
        try:
            result, logits = self.engine.prefill(
                ids, sender.put, start, prefix, after, req.cache_salt
            )
            sender.close()
            if sender.error is not None:
                raise sender.error
            P.send_frame(sock, P.Frame.LOGITS, logits.tobytes())
            result.update(
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
                result["codec_probe"] = sender.probe
            P.send_json(sock, P.Frame.PREFILL_DONE, result)
            outcome = "ok"
            log.info(
                "%s: prefilled %d tokens in %.3fs, %d KV bytes",
                peer,
                len(ids),
                result["prefill_time"],
                sender.bytes,
            )
            return True
        except OSError as e:
            outcome = "client_gone"
            log.warning("%s: connection lost during prefill: %s", peer, e)
            return False
        except Exception as e:
            log.exception("%s: prefill failed", peer)
            P.send_error(sock, "prefill_failed", f"{type(e).__name__}: {e}")
            return False
        finally:
            sender.close()
            for fn in after:
                fn()
            self.stats.end(outcome, result)


def main() -> None:
    parser = common_args("prefill")
    parser.add_argument("--fault-layer-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    args, token, engine = start_agent(
        "prefill",
        parser,
        lambda a: PrefillEngine(
            a.model, device=a.device, dtype=a.dtype, layer_delay_s=a.fault_layer_delay
        ),
    )
    agent = PrefillAgent(
        engine,
        args.name or f"prefill@{socket.gethostname()}",
        args.max_request_bytes,
        args.prefix_cache_mb,
    )
    serve("prefill", args, token, agent)


if __name__ == "__main__":
    main()
