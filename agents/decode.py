"""Decode agent: takes generate requests, gets the prompt's KV cache streamed
from a prefill agent (or prefills itself), and decodes with mlx-lm.

Run: python -m agents.decode --model DIR [--host H --port P]
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from . import fastblas  # first: it gives mlx an optimized BLAS before mlx loads

# isort: split
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

from . import protocol as P
from .batching import DecodeLoop, Sampler, Seq, make_sampler, sample_rows
from .codecpick import CodecTuner
from .kvcodec import Codec, LayerKV
from .kvfetch import PrefillUnavailable, fetch_kv
from .kvplace import MX_DTYPES, cache_kinds, fill_layer
from .metrics import Stats
from .models import get_adapter, load_hf_config
from .placement import Placement
from .prefix.decode_side import DecodePrefix, Hit
from .prefix.store import default_max_mb
from .quant import check_supported, weights_identity
from .request import GenerateRequest, PrefillRequest, RequestError
from .server import common_args, fail, serve, start_agent

log = logging.getLogger("disagg.decode")

PREFILL_STEP = 2048  # mlx-lm's generate_step default: same chunks, same numerics


class BadRequest(Exception):
    """The request itself is wrong; the agent stays healthy."""


class DecodeEngine:
    """One loaded mlx model and its tokenizer."""

    def __init__(self, model_dir: str, dtype: str = "auto", device: str = "auto") -> None:
        if device in ("cpu", "gpu"):
            mx.set_default_device(mx.cpu if device == "cpu" else mx.gpu)
        self.model_dir = model_dir
        check_supported(model_dir)
        self.cfg = load_hf_config(model_dir)
        self.adapter = adapter = get_adapter(self.cfg["model_type"])

        def classes(config: dict[str, Any]) -> tuple[type, type]:
            model_cls, args_cls = _get_classes(config)

            class Adapted(model_cls):  # type: ignore[valid-type, misc]
                def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
                    weights = adapter.mlx_weights(weights, config)
                    base = getattr(super(), "sanitize", None)
                    return base(weights) if base else weights

            return Adapted, args_cls

        overrides = adapter.mlx_config(self.cfg)
        self.model, self.mlx_cfg = load_model(
            Path(model_dir), model_config=overrides, get_model_classes=classes
        )
        adapter.patch_mlx_model(self.model, self.mlx_cfg)
        stored = self.cfg.get("dtype") or self.cfg.get("torch_dtype") or "float32"
        self.dtype = stored if dtype == "auto" and stored in MX_DTYPES else dtype
        if self.dtype == "auto":
            self.dtype = "float32"
        self.model.set_dtype(MX_DTYPES[self.dtype])
        mx.eval(self.model.parameters())
        self.tokenizer = load_tokenizer(Path(model_dir))
        self.context = int(self.cfg.get("max_position_embeddings") or 1 << 20)
        self.vocab_size = int(self.cfg["vocab_size"])
        self.device = str(mx.default_device())
        self.fingerprint = {
            "architecture": self.cfg["model_type"],
            "num_layers": len(self.model.layers),
            "num_kv_heads": adapter.num_kv_heads(self.cfg),
            "head_dim": adapter.head_dim(self.cfg),
            "dtype": self.dtype,
            "layers": cache_kinds(make_prompt_cache(self.model)),
            "weights": weights_identity(model_dir),
        }

    def encode(self, req: GenerateRequest) -> list[int]:
        """The request's prompt as token ids: chat template unless raw."""
        tok = self.tokenizer
        if req.messages is not None:
            messages = req.messages
            if not getattr(tok, "chat_template", None):
                raise BadRequest(
                    f"{Path(self.model_dir).name} has no chat template: send a raw prompt instead"
                )
        else:
            assert req.prompt is not None  # GenerateRequest checked it
            if req.raw or not getattr(tok, "chat_template", None):
                return list(tok.encode(req.prompt))
            messages = [{"role": "user", "content": req.prompt}]
        if req.system:
            messages = [{"role": "system", "content": req.system}, *messages]
        return list(tok.apply_chat_template(messages, add_generation_prompt=True))


def first_token(
    logits: np.ndarray | mx.array, sampler: Sampler | None, want_logprobs: bool
) -> tuple[int, np.ndarray | None]:
    """The first new token, sampled from the prompt's last-position logits (the
    prefill side's, or a local prefill's) as mlx-lm's generate_step samples it.
    Runs on the mlx thread."""
    row = mx.array(logits).astype(mx.float32).reshape(1, -1)
    logprobs = row - mx.logsumexp(row, keepdims=True)
    token = sample_rows(logprobs, [sampler])
    mx.eval(token, logprobs)
    tid = int(np.array(token)[0])
    return tid, np.array(logprobs[0]) if want_logprobs else None


class DecodeAgent:
    def __init__(
        self,
        engine: DecodeEngine,
        name: str,
        token: bytes | None = None,
        max_batch: int = 32,
        max_request_bytes: int = P.CONTROL_MAX_FRAME,
        allow_mixed: bool = False,
        prefix_cache_mb: float | None = None,
    ) -> None:
        self.engine = engine
        # Accept a prefill agent on other weights (results then say weights: "mixed").
        self.allow_mixed = allow_mixed
        self.name = name
        self.max_request_bytes = max_request_bytes  # largest GENERATE frame taken
        self.token = token  # the cluster token, also proves us to prefill agents
        self.stats = Stats("decode")
        self.placement = Placement()
        self.lock = threading.Lock()
        # Per prefill agent: what its KV stream measured, for requests with codec "auto".
        self.codec_tuners: dict[str, CodecTuner] = {}
        # All mlx work runs on the loop's thread; requests decode there together.
        self.loop = DecodeLoop(engine.model, max_batch=max_batch)
        mb = default_max_mb() if prefix_cache_mb is None else prefix_cache_mb
        self.prefix = DecodePrefix(int(mb * (1 << 20)), engine.fingerprint["layers"], engine.dtype)
        self.stats.extra.append(lambda: self.prefix.cache.prometheus("decode"))

    def status(self) -> dict[str, Any]:
        batch = self.loop.snapshot()
        return {
            "role": "decode",
            "name": self.name,
            "model": self.engine.model_dir,
            "loaded": True,
            "backend": "mlx",
            "device": self.engine.device,
            "blas": fastblas.loaded,
            "fingerprint": self.engine.fingerprint,
            "context": self.engine.context,
            "queued": batch["batch_waiting"],
            "max_batch": self.loop.max_batch,
            **batch,
            **self.stats.snapshot(),
            "prefix_cache": self.prefix.cache.snapshot(),
        }

    def handle(self, sock: socket.socket, peer: str) -> None:
        """One client connection: any number of GENERATE requests, one at a time
        (other connections' requests decode alongside in the same batch)."""
        while True:
            try:
                _, req = P.recv_json(sock, P.Frame.GENERATE, self.max_request_bytes)
            except P.PeerClosed:
                return  # the client is done
            except P.ProtocolError as e:
                P.send_error(sock, "protocol", str(e))
                return
            except (P.RemoteError, OSError):
                return
            self.stats.begin()
            outcome, metrics = "error", None
            try:
                metrics = self._generate(GenerateRequest.from_dict(req), sock)
                outcome = "ok"
            except (BadRequest, RequestError) as e:
                outcome = "bad_request"
                P.send_error(sock, "bad_request", str(e))
            except P.RemoteError as e:
                P.send_error(sock, e.code, e.message)
            except OSError as e:
                outcome = "client_gone"
                log.warning("client went away: %s", P.printable(e))
                return
            except Exception as e:
                log.exception("generate failed")
                P.send_error(sock, "decode_failed", f"{type(e).__name__}: {e}")
            finally:
                self.stats.end(outcome, metrics)

    def _max_tokens(self, req: GenerateRequest, ids: list[int]) -> int:
        """The request's max_tokens, capped by what the model's context leaves."""
        if len(ids) >= self.engine.context:
            raise BadRequest(
                f"the prompt is {len(ids)} tokens; the model's context is {self.engine.context}: "
                "shorten the prompt"
            )
        return min(req.max_tokens, self.engine.context - len(ids))

    def _lookup(self, req: GenerateRequest, namespace: str, ids: list[int], local: bool) -> Hit:
        if not req.prefix_cache or req.kv_quant:  # int8 K/V is lossy: never reused
            return Hit(namespace, [], [], self.prefix.cache.block)
        return self.prefix.lookup(namespace, ids, local, req.cache_salt)

    def _prefill(
        self, req: GenerateRequest, ids: list[int], metrics: dict[str, Any], hits: list[Hit]
    ) -> tuple[list[Any], np.ndarray | None]:
        """Caches holding the prompt and, after a remote prefill, the logits of
        its last position (None: prefill here, with local_prefill). A prefix
        cache hit is appended to `hits`, to store the prompt's blocks later."""
        caches = make_prompt_cache(self.engine.model)
        if req.prefill is None:
            metrics["method"] = "decode-only"
            return caches, None
        key = f"{','.join(req.prefill.hosts)}:{req.prefill.port}"
        tuner: CodecTuner | None = None
        probe = False
        if req.codec == "auto":
            with self.lock:
                tuner = self.codec_tuners.setdefault(key, CodecTuner())
            codec, why = tuner.choose()
            probe = tuner.wants_probe()
            metrics["codec_reason"] = why
        else:
            codec = Codec(int(req.codec))
        where, why = self.placement.choose(key, len(ids))
        if req.placement in ("local", "remote"):
            where, why = req.placement, "placement forced by the request"
        metrics.update(placement=where, placement_reason=why)
        if where == "local":
            metrics["method"] = "local"
            return caches, None
        hello = {
            "role": "decode",
            "fingerprint": self.engine.fingerprint,
            "model": self.engine.model_dir,
            "server": self.name,
            "allow_mixed": self.allow_mixed,
        }
        fills: list[Future[Any]] = []
        hit = self._lookup(req, f"remote:{key}", ids, local=False)

        def place(cache: Any, kv: LayerKV, prompt_len: int) -> None:
            # A copy: the reader reuses its buffer for the next layer at once
            # (a layer extended with a cached prefix is a new array already).
            own = kv
            if not (kv.keys.flags.owndata and kv.values.flags.owndata):
                own = LayerKV(kv.layer, kv.kind, kv.dtype, kv.keys.copy(), kv.values.copy())
            if req.prefix_cache and not req.kv_quant:
                self.prefix.keep(hit, own, prompt_len)
            fills.append(self.loop.post(fill_layer, cache, own, prompt_len))

        try:
            prefix = self.prefix.remote_prefix(hit, ids)
            ask = PrefillRequest(
                ids,
                codec=int(codec),
                kv_quant=req.kv_quant,
                start=prefix.start if prefix else 0,
                prefix_digest=prefix.digest if prefix else None,
                prefix_cache=req.prefix_cache,
                probe_codecs=probe,
                cache_salt=req.cache_salt,
            )
            fetched, logits = fetch_kv(
                req.prefill, ask, caches, hello, self.token, self.engine.vocab_size, place, prefix
            )
            for f in fills:
                f.result()
        except PrefillUnavailable as e:
            log.warning("%s; prefilling locally", e)
            metrics.update(method="local-fallback", fallback_reason=str(e))
            return make_prompt_cache(self.engine.model), None
        # Rates from what was computed and sent, not what came from a prefix cache.
        computed = len(ids) - max(hit.tokens if hit.used else 0, fetched["prefill_cached_tokens"])
        self.placement.observe_remote(key, computed, len(caches), fetched)
        if tuner is not None:
            tuner.observe_fetch(fetched)
        metrics.update(fetched, method="disaggregated", cached_tokens=hit.tokens if hit.used else 0)
        hits.append(hit)
        return caches, logits

    def _local_prefill(
        self,
        ids: list[int],
        caches: list[Any],
        req: GenerateRequest | None = None,
        metrics: dict[str, Any] | None = None,
        hits: list[Hit] | None = None,
    ) -> mx.array:
        """The prompt through the model here, chunked exactly as mlx-lm's
        generate_step does (so the text matches it), one chunk per loop task so
        the batch keeps decoding in between. Returns the last position's logits.
        With `req`, a prefix cache hit (mlx's own K/V, namespace "local") seeds
        the caches and only the rest is computed."""
        model = self.engine.model
        done = 0
        hit = None
        if req is not None and hits is not None:
            hit = self._lookup(req, "local", ids, local=True)
            hits.append(hit)
            if hit.tokens:
                self.loop.call(self.prefix.seed, hit, caches)
                done = hit.tokens
            if metrics is not None:
                metrics["cached_tokens"] = hit.tokens

        def chunk(part: list[int]) -> None:
            model(mx.array(part)[None], cache=caches)
            mx.eval([c.state for c in caches])
            mx.clear_cache()  # as generate_step does: a chunk's activations are large

        def last() -> mx.array:
            logits = model(mx.array(ids[-1:])[None], cache=caches)[:, -1, :]
            mx.eval(logits)
            if hit is not None and req is not None and req.prefix_cache and not self.prefix.window:
                self.prefix.keep_caches(hit, caches, len(ids))  # before any decode step
            return logits[0]

        for start in range(done, len(ids) - 1, PREFILL_STEP):
            self.loop.call(chunk, ids[start : min(start + PREFILL_STEP, len(ids) - 1)])
        return self.loop.call(last)

    def _generate(self, req: GenerateRequest, sock: socket.socket) -> dict[str, Any]:
        eng = self.engine
        t0 = time.perf_counter()
        ids = eng.encode(req)
        max_tokens = self._max_tokens(req, ids)
        metrics: dict[str, Any] = {
            "prompt_tokens": len(ids),
            "kv_bytes": 0,
            "kv_transfer_time": 0.0,
            "decode_server": self.name,
            "prefill_server": None,
            "prefill_time": None,
            "cached_tokens": 0,  # prompt positions whose K/V came from the prefix cache
            "weights": "same",  # a remote prefill on other weights says "mixed"
        }
        hits: list[Hit] = []
        caches, remote_logits = self._prefill(req, ids, metrics, hits)
        t_local = time.perf_counter()
        logits: np.ndarray | mx.array
        if remote_logits is not None:
            logits = remote_logits
        else:
            logits = self._local_prefill(ids, caches, req, metrics, hits)
        sampler = make_sampler(req.temperature, req.top_p, req.seed)
        want_logprobs = req.logprobs
        first, first_lp = self.loop.call(first_token, logits, sampler, want_logprobs)
        t_first = time.perf_counter()
        ttft = t_first - t0
        if metrics["method"] != "disaggregated":
            metrics["prefill_time"] = t_first - t_local
        eos = frozenset() if req.ignore_eos else frozenset(eng.tokenizer.eos_token_ids or [])
        detok = eng.tokenizer.detokenizer
        detok.reset()
        out: list[int] = []

        def emit(tid: int, lp: np.ndarray | None) -> None:
            out.append(tid)
            detok.add_token(tid)
            P.send_json(sock, P.Frame.TOKEN, {"id": tid, "text": detok.last_segment})
            if lp is not None:
                P.send_frame(sock, P.Frame.LOGPROBS, lp.tobytes())

        if first not in eos:
            emit(first, first_lp)
        for hit in hits:  # after the first token: off the TTFT path, before DONE
            self.prefix.store(hit)
        if first not in eos and max_tokens > 1:
            seq = Seq(caches, first, sampler, max_tokens, eos, want_logprobs)
            self.loop.join(seq)
            try:
                while (item := seq.out.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    emit(*item)
            finally:
                seq.done = True  # a no-op when it ended; stops it if we failed
        detok.finalize()
        t_end = time.perf_counter()
        tail = detok.last_segment
        if tail:
            P.send_json(sock, P.Frame.TOKEN, {"id": None, "text": tail})
        decode_s = t_end - t_first
        if metrics["method"] != "disaggregated" and metrics["prefill_time"]:
            self.placement.observe_local(
                len(ids) - metrics["cached_tokens"], metrics["prefill_time"]
            )
        if len(out) > 1:
            self.placement.observe_step(decode_s / (len(out) - 1))
        metrics.update(
            completion_tokens=len(out),
            # max_tokens here is the request's, capped by what the context leaves.
            finish_reason="length" if len(out) >= max_tokens else "stop",
            ttft=ttft,
            decode_time=decode_s,
            decode_speed=(len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else None,
            tpot=decode_s / (len(out) - 1) if len(out) > 1 else None,
            agent_total_time=t_end - t0,
            prefill_speed=(len(ids) / metrics["prefill_time"]) if metrics["prefill_time"] else None,
        )
        done: dict[str, Any] = {"text": detok.text, "token_ids": out, "metrics": metrics}
        if req.return_prompt_ids:
            done["prompt_ids"] = ids
        P.send_json(sock, P.Frame.DONE, done)
        log.info(
            "%s: %d prompt + %d new tokens, ttft %.3fs, %.1f tok/s, %s",
            metrics["method"],
            len(ids),
            len(out),
            ttft,
            metrics["decode_speed"] or 0.0,
            metrics.get("prefill_address") or "local prefill",
        )
        return metrics


def main() -> None:
    parser = common_args("decode")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=32,
        help="most requests decoded together in one step; more wait for a free slot",
    )
    parser.add_argument(
        "--allow-mixed",
        action="store_true",
        help="accept prefill agents whose weights differ from ours (metrics say so)",
    )

    def load(args: Any) -> DecodeEngine:
        if args.max_batch < 1:
            fail("--max-batch must be at least 1")
        return DecodeEngine(args.model, dtype=args.dtype, device=args.device)

    args, token, engine = start_agent("decode", parser, load)
    agent = DecodeAgent(
        engine,
        args.name or f"decode@{socket.gethostname()}",
        token,
        max_batch=args.max_batch,
        max_request_bytes=args.max_request_bytes,
        allow_mixed=args.allow_mixed,
        prefix_cache_mb=args.prefix_cache_mb,
    )
    serve("decode", args, token, agent)


if __name__ == "__main__":
    main()
