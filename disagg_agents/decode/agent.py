"""Decode agent: takes generate requests, gets the prompt's KV cache streamed
from a prefill agent (or prefills itself), and decodes with mlx-lm.

Run: python -m disagg_agents.decode --model DIR [--host H --port P]
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagg_agents.runtime import fastblas  # first: it gives mlx an optimized BLAS before mlx loads

# isort: split
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

from disagg_agents.chatformat import (
    ChatStream,
    FormatError,
    Piece,
    ToolCall,
    detect,
    generic,
    open_stream,
    render_chat,
    render_fim,
)
from disagg_agents.decode.codectuner import CodecTuner
from disagg_agents.decode.grammar import ANALYSIS_MAX_TOKENS, ClientGone, Grammars, Matcher
from disagg_agents.decode.grammarformats import generic_lark
from disagg_agents.decode.keepalive import Keepalive, progress_interval
from disagg_agents.decode.kvcaches import MX_DTYPES, cache_kinds, fill_layer
from disagg_agents.decode.kvfetch import PrefillUnavailable, fetch_kv
from disagg_agents.decode.kvslots import Slots, allocate, inplace_enabled
from disagg_agents.decode.loop import DecodeLoop, Sampler, Seq, make_sampler, sample_rows
from disagg_agents.decode.placement import Placement
from disagg_agents.decode.prefixcache import DecodePrefix, Hit, Recording, Span
from disagg_agents.decode.prefixstore import PendingStore
from disagg_agents.decode.upfront import client_gone, max_token_bytes, too_long
from disagg_agents.models import get_adapter, load_hf_config
from disagg_agents.models.pooling import pooling_config
from disagg_agents.prefix.store import default_max_mb
from disagg_agents.quant import check_supported, weights_identity
from disagg_agents.runtime.args import common_args, fail
from disagg_agents.runtime.blasshare import BlasShare
from disagg_agents.runtime.metrics import Stats
from disagg_agents.runtime.serve import serve, start_agent
from disagg_agents.runtime.settings import (
    Setting,
    attr_setting,
    budget_setting,
    disk_setting,
    tenant_share_setting,
)
from disagg_agents.wire.answer import CONTENT, REASONING, Done, Metrics, TokenEvent
from disagg_agents.wire.answer import ToolCall as WireCall
from disagg_agents.wire.channel import recv_json, send_error, send_frame, send_json
from disagg_agents.wire.frames import (
    CONTROL_MAX_FRAME,
    Frame,
    PeerClosed,
    ProtocolError,
    RemoteError,
)
from disagg_agents.wire.kvcodec import Codec, LayerKV
from disagg_agents.wire.request import GenerateRequest, PrefillRequest, RequestError
from disagg_agents.wire.text import printable

log = logging.getLogger("disagg.decode")

DEFAULT_DISK_MB = 8192  # the --prefix-disk tier's default budget
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
        self.chat = detect(self.tokenizer)  # its chat format, from vocab and template
        self.context = int(self.cfg.get("max_position_embeddings") or 1 << 20)
        self.vocab_size = int(self.cfg["vocab_size"])
        self.max_token_bytes = max_token_bytes(self.tokenizer)
        # Structured outputs: compiled grammars for this tokenizer, cached.
        eos_ids = self.tokenizer.eos_token_ids or []
        self.grammars = Grammars(self.tokenizer, self.vocab_size, eos_ids)
        # The chat format ("harmony", "qwen_json", "qwen_xml", "plain") decides what a
        # grammar wraps around the JSON.
        self.format_kind = self.chat.kind
        # Reasoning that ends with "</think>" (one token in Qwen3's vocab): a
        # constraint then starts after it.
        think_end = self.tokenizer.encode("</think>", add_special_tokens=False)
        self.think_end: list[int] | None = think_end if len(think_end) == 1 else None
        think_start = self.tokenizer.encode("<think>", add_special_tokens=False)
        self.think_start: int | None = think_start[0] if len(think_start) == 1 else None
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

    def check_fits(self, req: GenerateRequest) -> None:
        """Refuse, before tokenizing, a prompt that surely cannot fit the context."""
        why = too_long(req, self.context, self.max_token_bytes)
        if why:
            raise BadRequest(why)

    def encode(self, req: GenerateRequest) -> list[int]:
        """The request's prompt as token ids: chat template unless raw, or the
        fill-in-the-middle prompt when it has a suffix. Chat messages and FIM code
        are text (special tokens' names in them stay characters); a raw prompt is
        the caller's own markup, encoded as the tokenizer encodes it, specials and all.
        A prompt that surely cannot fit the context is refused before any of that."""
        self.check_fits(req)
        tok = self.tokenizer
        try:
            if req.suffix is not None:
                return render_fim(tok, self.chat, req.prompt or "", req.suffix)
            if not self.is_chat(req):
                if req.messages is not None:
                    raise BadRequest(
                        f"{Path(self.model_dir).name} has no chat template: "
                        "send a raw prompt instead"
                    )
                assert req.prompt is not None  # GenerateRequest checked it
                return list(tok.encode(req.prompt))
            messages = req.messages or [{"role": "user", "content": req.prompt}]
            # A Lark-grammar answer is a forced custom tool's input: its tools are context.
            lark = (req.response_format or {}).get("type") == "lark"
            forced = req.tool_choice not in (None, "auto", "none") or lark
            return render_chat(
                tok,
                self.chat,
                messages,
                system=req.system,
                tools=_tools(req),
                think=req.think,
                forced=forced,
                structured=req.response_format is not None,
            )
        except FormatError as e:
            raise BadRequest(str(e)) from None

    def chat_info(self) -> dict[str, Any]:
        """What /api/show tells clients: the chat format, its template, what stops it,
        and the fill-in-the-middle tokens where the tokenizer has them."""
        tok = self.tokenizer
        stop_ids = set(tok.eos_token_ids or []) | self.chat.stop_ids
        info = {
            **self.chat.describe(),
            "template": self.chat.template,
            "stop": sorted({tok.convert_ids_to_tokens(i) for i in stop_ids}),
        }
        if self.chat.fim is not None:
            info["fim_tokens"] = tok.convert_ids_to_tokens(list(self.chat.fim))
        if pooling_config(self.model_dir) is not None:  # an embedding model's checkpoint
            info["capabilities"] = [*info["capabilities"], "embedding"]
        return info

    def is_chat(self, req: GenerateRequest) -> bool:
        """Whether the prompt goes through the chat template."""
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        return req.suffix is None and has_template and (req.messages is not None or not req.raw)

    def stops(self, req: GenerateRequest) -> frozenset[int]:
        """Token ids that end the answer (and are not sent): EOS, harmony's
        <|return|> and <|call|>, and for FIM what starts another file."""
        if req.ignore_eos:
            return frozenset()
        ids = set(self.tokenizer.eos_token_ids or []) | self.chat.stop_ids
        if req.suffix is not None:
            ids |= self.chat.fim_stop_ids
        return frozenset(ids)

    def stream(self, req: GenerateRequest, ids: list[int]) -> ChatStream:
        """The answer's parser: reasoning, content and tool calls apart."""
        return open_stream(
            self.chat,
            self.tokenizer,
            ids,
            chat=self.is_chat(req),
            tools=_tools(req),
            structured=req.response_format is not None,
            forced=req.tool_choice not in (None, "auto", "none"),
        )


def _tools(req: GenerateRequest) -> list[dict[str, Any]] | None:
    """The tools the model is shown: none when tool_choice is "none"."""
    return None if req.tool_choice == "none" else req.tools


# What is known once the first token is out: a client that stops reading early (a stop
# string matched, its caller left) still reports the prompt's side of the request.
FIRST_METRICS = (
    "prompt_tokens",
    "cached_tokens",
    "prefill_cached_tokens",
    "disk_cached_tokens",
    "method",
    "prefill_server",
    "decode_server",
    "prefill_time",
    "prefill_queue_time",
    "kv_bytes",
    "kv_transfer_time",
    "weights",
    "placement",
    "placement_reason",
    "fallback_reason",
    "fallback_kind",
)


def first_metrics(metrics: Metrics, at: float, t0: float, t_first: float) -> Metrics:
    """The first TOKEN frame's `metrics`: the prompt's side, the agent's ttft, and the
    timeline so far (`at`, first_token in seconds after it)."""
    early = Metrics.from_json(
        {k: v for k in FIRST_METRICS if (v := getattr(metrics, k)) is not None}
    )
    early.ttft = t_first - t0
    early.timeline = {"at": at, "first_token": t_first - t0}
    return early


def token_events(
    tid: int | None, events: list[Piece | ToolCall], metrics: Metrics | None = None
) -> list[TokenEvent]:
    """What one token completed, as TOKEN frames: the first carries the id (one per
    token, even when markup shows nothing) and on the request's first token its
    `metrics` (first_metrics); text on one channel rides in one frame; a finished
    tool call rides alone."""
    out: list[TokenEvent] = []
    for e in events:
        if isinstance(e, Piece):
            channel = REASONING if e.channel == REASONING else CONTENT
            last = out[-1] if out else None
            if last is not None and last.channel == channel and last.tool_call is None:
                out[-1] = dataclasses.replace(last, text=last.text + e.text)
            else:
                out.append(TokenEvent(text=e.text, channel=channel))
        else:
            out.append(TokenEvent(tool_call=WireCall(e.name, e.arguments, e.text)))
    if tid is not None:
        out[:1] = [dataclasses.replace(out[0] if out else TokenEvent(), id=tid)]
    if metrics is not None and out:
        out[0] = dataclasses.replace(out[0], metrics=metrics)
    return out


def send_events(
    sock: socket.socket,
    tid: int | None,
    events: list[Piece | ToolCall],
    metrics: Metrics | None = None,
) -> None:
    """The TOKEN frames for what one token completed (token_events)."""
    for event in token_events(tid, events, metrics):
        send_json(sock, Frame.TOKEN, event.to_json())


Item = tuple[int, "np.ndarray | None"]


def bursts(out: queue.Queue[Item | Exception | None]) -> Iterator[list[Item]]:
    """A request's tokens as the loop queued them, in bursts: whatever queued up
    while the last burst was being sent (a lagging client) goes out together."""
    while True:
        got = out.get()
        burst: list[Item] = []
        while True:
            if got is None:
                if burst:
                    yield burst
                return
            if isinstance(got, Exception):
                if burst:
                    yield burst
                raise got
            burst.append(got)
            try:
                got = out.get_nowait()
            except queue.Empty:
                break
        yield burst


@contextlib.contextmanager
def corked(sock: socket.socket, on: bool) -> Iterator[None]:
    """A burst's frames in as few TCP segments as fit (Linux TCP_CORK): one
    wake-up for a lagging client instead of one per token."""
    cork = getattr(socket, "TCP_CORK", None)
    if not on or cork is None:
        yield
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, cork, 1)
    except OSError:  # not TCP: nothing to coalesce
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, cork, 0)


def skip_draws(sampler: Sampler, n: int) -> None:
    """Advance a sampler past `n` draws, as if it had sampled `n` tokens: a migrated
    seeded request then draws at each position what the seed gives there. mlx thread."""
    key = sampler.key
    for _ in range(n):
        key, _sub = mx.random.split(key)
    mx.eval(key)
    sampler.key = key


def first_token(
    logits: np.ndarray | mx.array,
    sampler: Sampler | None,
    want_logprobs: bool,
    allowed: np.ndarray | None = None,
) -> tuple[int, np.ndarray | None]:
    """The first new token, sampled from the prompt's last-position logits (the
    prefill side's, or a local prefill's) as mlx-lm's generate_step samples it;
    `allowed` ([vocab] bool): a grammar's mask for it. Runs on the mlx thread."""
    row = mx.array(logits).astype(mx.float32).reshape(1, -1)
    logprobs = row - mx.logsumexp(row, keepdims=True)
    pick = logprobs
    if allowed is not None:
        pick = mx.where(mx.array(allowed[: row.shape[-1]])[None], logprobs, -mx.inf)
    token = sample_rows(pick, [sampler])
    mx.eval(token, logprobs)
    tid = int(np.array(token)[0])
    return tid, np.array(logprobs[0]) if want_logprobs else None


def greedy_first(logits: np.ndarray, allowed: np.ndarray | None) -> int | None:
    """The greedy first token read off float32 logits on the request's own thread,
    with no turn of the decode loop (which may be mid-step or mid-chunk). The same
    token as first_token's argmax of logprobs unless the top two are so close that
    subtracting logsumexp could round them equal: None then, use first_token.
    Request thread; numpy only."""
    row = np.asarray(logits, np.float32).reshape(-1)
    if allowed is not None:
        row = np.where(allowed[: row.shape[0]], row, -np.inf)
    tid = int(np.argmax(row))
    top = float(row[tid])
    if not np.isfinite(top) or np.isnan(row).any():
        return None
    rest = np.delete(row, tid)
    gap = top - float(rest.max()) if rest.size else np.inf
    return tid if gap > 1e-5 * max(1.0, abs(top)) else None


@dataclass
class Prefilled:
    """Caches holding the prompt; after a remote prefill also the logits of its last
    position and the fetch's marks (perf_counter times on this host: sent, kv_first,
    kv_last), which only the timeline reads."""

    caches: list[Any]
    logits: np.ndarray | None = None
    marks: dict[str, float | None] | None = None


class DecodeAgent:
    def __init__(
        self,
        engine: DecodeEngine,
        name: str,
        token: bytes | None = None,
        max_batch: int = 32,
        max_request_bytes: int = CONTROL_MAX_FRAME,
        allow_mixed: bool = False,
        prefix_cache_mb: float | None = None,
        prefix_disk: str | None = None,
        prefix_disk_mb: float | None = None,
    ) -> None:
        self.engine = engine
        # Accept a prefill agent on other weights (results then say weights: "mixed").
        self.allow_mixed = allow_mixed
        self.kv_inplace = inplace_enabled()  # DISAGG_KV_INPLACE=0: the copy path
        self.name = name
        self.max_request_bytes = max_request_bytes  # largest GENERATE frame taken
        self.token = token  # the cluster token, also proves us to prefill agents
        self.stats = Stats("decode")
        self.placement = Placement()
        self.lock = threading.Lock()
        # Per prefill agent: what its KV stream measured, for requests with codec "auto".
        self.codec_tuners: dict[str, CodecTuner] = {}
        # All mlx work runs on the loop's thread; requests decode there together.
        self.loop = DecodeLoop(
            engine.model, max_batch=max_batch, grammars=engine.grammars, prefill_step=PREFILL_STEP
        )
        engine.grammars.warm()  # its tokenizer (~0.5 s) off the first request's path
        self.blas_share = BlasShare.from_env(self.loop.post)
        self.loop.before_turn, self.loop.on_idle = self.blas_share.tick, self.blas_share.idle
        mb = default_max_mb() if prefix_cache_mb is None else prefix_cache_mb
        self.prefix = DecodePrefix(int(mb * (1 << 20)), engine.fingerprint["layers"], engine.dtype)
        self.stats.extra.append(lambda: self.prefix.cache.prometheus("decode"))
        if prefix_disk:  # the disk tier: blocks kept across restarts
            mb = DEFAULT_DISK_MB if prefix_disk_mb is None else prefix_disk_mb
            self.prefix.enable_disk(prefix_disk, int(mb * (1 << 20)), engine.fingerprint)
            disk = self.prefix.disk
            assert disk is not None
            self.stats.extra.append(lambda: disk.prometheus("decode"))

    def live_settings(self) -> list[Setting]:
        """What PUT /settings may change (disagg_agents.runtime.settings), for new requests."""
        disk = [disk_setting(self.prefix.disk)] if self.prefix.disk is not None else []
        return [
            *disk,
            budget_setting(self.prefix.cache),
            tenant_share_setting(self.prefix.cache),
            attr_setting(
                "allow_mixed",
                self,
                "allow_mixed",
                bool,
                help="accept prefill agents whose weights differ from ours",
            ),
            attr_setting(
                "kv_inplace",
                self,
                "kv_inplace",
                bool,
                help="receive K/V straight into the caches (false: the copy path)",
            ),
        ]

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
            "blas_threads": fastblas.threads(),
            "blas_limited_by": self.blas_share.limited_by,  # None: every thread
            "fingerprint": self.engine.fingerprint,
            "context": self.engine.context,
            "queued": batch["batch_waiting"],
            "max_batch": self.loop.max_batch,
            **batch,
            **self.stats.snapshot(),
            "prefix_cache": self.prefix.cache.snapshot(),
            "prefix_disk": self.prefix.disk.snapshot() if self.prefix.disk is not None else None,
            "grammars": self.engine.grammars.snapshot(),
            "chat": self.engine.chat_info(),  # for /api/show: capabilities, template, stops
        }

    def handle(self, sock: socket.socket, peer: str) -> None:
        """One client connection: any number of GENERATE requests, one at a time
        (other connections' requests decode alongside in the same batch)."""
        while True:
            try:
                _, req = recv_json(sock, Frame.GENERATE, self.max_request_bytes)
            except PeerClosed:
                return  # the client is done
            except ProtocolError as e:
                send_error(sock, "protocol", str(e))
                return
            except (RemoteError, OSError):
                return
            self.stats.begin()
            outcome, metrics = "error", None
            try:
                request = GenerateRequest.from_dict(req)
                # PROGRESS while no token is due, if the client asked (decode.keepalive).
                with Keepalive(sock, progress_interval(request), self.loop) as progress:
                    metrics = self._generate(request, sock, progress)
                outcome = str(metrics.finish_reason or "stop")
            except ClientGone as e:  # hung up while its grammar compiled: nobody to tell
                outcome = "cancelled"
                log.info("client went away: %s", printable(e))
                return
            except (BadRequest, RequestError) as e:
                outcome = "bad_request"
                send_error(sock, "bad_request", str(e))
            except RemoteError as e:
                send_error(sock, e.code, e.message)
            except OSError as e:
                outcome = "cancelled"
                log.warning("client went away: %s", printable(e))
                return
            except Exception as e:
                log.exception("generate failed")
                send_error(sock, "decode_failed", f"{type(e).__name__}: {e}")
            finally:
                self.stats.end(outcome, metrics.to_json() if metrics is not None else None)

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
        self, req: GenerateRequest, ids: list[int], metrics: Metrics, hits: list[Hit]
    ) -> Prefilled:
        """Caches holding the prompt and, after a remote prefill, the logits of its
        last position (None: prefill here, with _local_prefill). Picks the codec,
        looks up the prefix cache, decides where to prefill and fetches the K/V; a
        prefix cache hit is appended to `hits`, to store the prompt's blocks later."""
        caches = make_prompt_cache(self.engine.model)
        if req.prefill is None:
            metrics.method = "decode-only"
            return Prefilled(caches)
        key = f"{','.join(req.prefill.hosts)}:{req.prefill.port}"
        codec, tuner, probe = self._pick_codec(req, key, metrics)
        where, why, hit = self._place(req, key, ids)
        metrics.update(placement=where, placement_reason=why)
        if where == "local":
            metrics.method = "local"
            return Prefilled(caches)
        try:
            fetched, logits = self._fetch_remote(req, ids, caches, hit, codec, probe)
        except PrefillUnavailable as e:
            log.warning("%s; prefilling locally", e)
            metrics.update(method="local-fallback", fallback_reason=str(e), fallback_kind=e.kind)
            return Prefilled(make_prompt_cache(self.engine.model))
        marks = fetched.pop("marks", None)  # this host's clock, for the timeline only
        # Rates from what was computed and sent, not what came from a prefix cache.
        computed = len(ids) - max(hit.tokens if hit.used else 0, fetched["prefill_cached_tokens"])
        self.placement.observe_remote(key, computed, len(caches), fetched)
        if tuner is not None:
            tuner.observe_fetch(fetched)
        metrics.update(fetched, method="disaggregated", cached_tokens=hit.tokens if hit.used else 0)
        metrics.disk_cached_tokens = hit.disk_tokens if hit.used else None
        hits.append(hit)
        return Prefilled(caches, logits, marks)

    def _pick_codec(
        self, req: GenerateRequest, key: str, metrics: Metrics
    ) -> tuple[Codec, CodecTuner | None, bool]:
        """The K/V codec to ask the prefill agent `key` for: the request's, or for
        "auto" what that link measured best. Also the tuner that learns from this
        fetch, and whether to time the other codecs on one layer."""
        if req.codec != "auto":
            return Codec(int(req.codec)), None, False
        with self.lock:
            tuner = self.codec_tuners.setdefault(key, CodecTuner())
        codec, why = tuner.choose()
        metrics.codec_reason = why
        return codec, tuner, tuner.wants_probe()

    def _place(self, req: GenerateRequest, key: str, ids: list[int]) -> tuple[str, str, Hit]:
        """Where the prompt is prefilled ("local" or "remote"), why, and the remote
        prefix cache hit. The hit comes first: placement then weighs only what a
        remote prefill still computes and sends (most of a chat's next turn hits)."""
        hit = Hit(f"remote:{key}", [], [], self.prefix.cache.block)
        if req.placement != "local":
            hit = self._lookup(req, f"remote:{key}", ids, local=False)
        where, why = self.placement.choose(key, len(ids), cached=hit.tokens)
        if req.placement in ("local", "remote"):
            where, why = req.placement, "placement forced by the request"
        return where, why, hit

    def _hello(self) -> dict[str, Any]:
        """Our HELLO to a prefill agent: who we are and the model we decode."""
        return {
            "role": "decode",
            "fingerprint": self.engine.fingerprint,
            "model": self.engine.model_dir,
            "server": self.name,
            "allow_mixed": self.allow_mixed,
        }

    def _fetch_remote(
        self,
        req: GenerateRequest,
        ids: list[int],
        caches: list[Any],
        hit: Hit,
        codec: Codec,
        probe: bool,
    ) -> tuple[dict[str, Any], np.ndarray]:
        """The prompt's K/V from the request's prefill agent, placed into `caches`
        (past a prefix cache `hit`), and its last position's logits; the fetch's
        metrics (kvfetch.fetch_metrics). Raises PrefillUnavailable."""
        assert req.prefill is not None
        fills: list[Future[Any]] = []
        # Full-attention layers are received straight into their caches, which
        # the mlx thread allocates while we dial (disagg_agents.decode.kvslots).
        fp = self.engine.fingerprint
        alloc: Future[Slots] | None = None
        if self.kv_inplace:
            alloc = self.loop.post(
                allocate, caches, len(ids), self.engine.dtype, fp["num_kv_heads"], fp["head_dim"]
            )

        def slots() -> Slots:
            assert alloc is not None
            got: Slots = alloc.result()
            if hit.tokens:
                got.prefix_start = hit.tokens
                got.fill_prefix = lambda layer, k, v: self.prefix.fill_prefix(hit, layer, k, v)
            return got

        def place(cache: Any, kv: LayerKV, prompt_len: int) -> None:
            if alloc is not None and kv.layer in alloc.result().placed:
                return  # received into its cache already
            # A copy: the reader reuses its buffer for the next layer at once
            # (a layer extended with a cached prefix is a new array already).
            own = kv
            if not (kv.keys.flags.owndata and kv.values.flags.owndata):
                own = LayerKV(kv.layer, kv.kind, kv.dtype, kv.keys.copy(), kv.values.copy())
            fills.append(self.loop.post(fill_layer, cache, own, prompt_len))

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
            # Only where the agents share cores (blas_share set up by localagents):
            # rows decoding now, or prefills of ours ahead of this one, whose
            # streams will be decoding by the time this one runs.
            cores_busy=self.blas_share.shared is not None
            and (self.loop.busy() or self.blas_share.prefills > 0),
        )
        with self.blas_share.prefilling():
            fetched, logits = fetch_kv(
                req.prefill,
                ask,
                caches,
                self._hello(),
                self.token,
                self.engine.vocab_size,
                place,
                prefix,
                slots if alloc is not None else None,
            )
        for f in fills:
            f.result()
        placed = alloc.result() if alloc is not None else None
        fetched["kv_inplace_layers"] = len(placed.placed) if placed is not None else 0
        if placed is not None:
            placed.release()  # so decoding updates the caches in place
        return fetched, logits

    def _local_prefill(
        self,
        ids: list[int],
        caches: list[Any],
        req: GenerateRequest | None = None,
        metrics: Metrics | None = None,
        hits: list[Hit] | None = None,
    ) -> np.ndarray:
        """The prompt through the model here. Alone, chunked exactly as mlx-lm's
        generate_step does (so the text matches it); beside decoding streams, in
        chunks the loop sizes to about a decode step or two, a step between each
        (disagg_agents/decode/chunksizer.py), so no stream stalls for the whole prompt. Returns the
        last position's logits (float32). With `req`, a prefix cache hit (mlx's own
        K/V, namespace "local") seeds the caches and only the rest is computed."""
        model = self.engine.model
        done = 0
        if req is not None and hits is not None:
            hit = self._lookup(req, "local", ids, local=True)
            hits.append(hit)
            self.prefix.record(hit, caches)  # a sliding layer's every position, to store
            if hit.tokens:
                self.loop.call(self.prefix.seed, hit, caches)
                done = hit.tokens
            if metrics is not None:
                metrics.cached_tokens = hit.tokens
                metrics.disk_cached_tokens = hit.disk_tokens or None

        def chunk(a: int, b: int) -> None:
            model(mx.array(ids[a:b])[None], cache=caches)
            mx.eval([c.state for c in caches])
            if b - a > 256:
                mx.clear_cache()  # as generate_step does: a big chunk's activations are large

        def last() -> np.ndarray:
            logits = model(mx.array(ids[-1:])[None], cache=caches)[:, -1, :]
            row = logits[0].astype(mx.float32)  # what first_token samples from
            mx.eval(row)
            return np.array(row)

        if done < len(ids) - 1:
            self.loop.prefill(chunk, done, len(ids) - 1).result()
        logits: np.ndarray = self.loop.call(last)
        return logits

    def _stores(self, hits: list[Hit], caches: list[Any], prompt_len: int) -> list[PendingStore]:
        """The prefix stores this request makes; its recorded sliding layers are
        taken now, before any decode step (they turn plain)."""
        hits = [h for h in hits if h.keys and self.prefix.cache.max_bytes]
        if not hits:
            return []
        sliding: list[Span | None] = [None] * len(caches)
        if any(isinstance(c, Recording) for c in caches):
            sliding = self.loop.call(self.prefix.recorded, caches)
        return [PendingStore(self.prefix, self.loop, h, prompt_len, sliding) for h in hits]

    def _matcher(
        self, req: GenerateRequest, ids: list[int], sock: socket.socket | None = None
    ) -> Matcher | None:
        """The request's output grammar, compiled (or found in the cache) before
        any compute: an invalid or unenforceable schema is a bad request."""
        eng = self.engine
        # <think> templates: the answer (and its constraint) starts after </think>;
        # <think> itself comes first unless the prompt opened it.
        thinks = eng.chat.reasoning and eng.chat.kind != "harmony" and req.think is not False
        opener = eng.think_start if thinks and ids[-1:] != [eng.think_start] else None
        forced = req.tool_choice not in (None, "auto", "none")
        tools = _tools(req)
        if eng.is_chat(req) and generic.applies(eng.chat, tools, forced, bool(req.response_format)):
            # A template without tools: the answer is the generic format's JSON.
            try:
                return eng.grammars.matcher(
                    {"type": "lark", "grammar": generic_lark(tools or [])},
                    gone=None if sock is None else lambda: client_gone(sock),
                )
            except ClientGone:
                raise
            except RequestError as e:  # a tool's schema: say so, not our grammar's text
                why = str(e).removeprefix("response_format: ").split(" 1 | ")[0]
                raise RequestError("tools", f"tools: a tool's parameters: {why}") from None
        return eng.grammars.matcher(
            req.response_format,
            kind=eng.format_kind,
            tools=req.tools,
            tool_choice=req.tool_choice,
            trigger=eng.think_end if thinks else None,
            analysis_max_tokens=min(ANALYSIS_MAX_TOKENS, req.max_tokens // 2),
            opener=opener,
            gone=None if sock is None else lambda: client_gone(sock),
        )

    def _decoded(
        self,
        metrics: Metrics,
        n_prompt: int,
        n_out: int,
        max_tokens: int,
        called: bool,
        t0: float,
        t_first: float,
        t_end: float,
    ) -> None:
        """A finished request's decode metrics; placement learns its step time
        (and a local prefill's rate)."""
        decode_s = t_end - t_first
        prefill_s = metrics.prefill_time
        if metrics.method != "disaggregated" and prefill_s:
            self.placement.observe_local(n_prompt - (metrics.cached_tokens or 0), prefill_s)
        if n_out > 1:
            self.placement.observe_step(decode_s / (n_out - 1))
        metrics.completion_tokens = n_out
        # max_tokens here is the request's, capped by what the context leaves.
        metrics.finish_reason = (
            "tool_calls" if called else "length" if n_out >= max_tokens else "stop"
        )
        metrics.ttft = t_first - t0
        metrics.decode_time = decode_s
        metrics.decode_speed = (n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else None
        metrics.tpot = decode_s / (n_out - 1) if n_out > 1 else None
        metrics.agent_total_time = t_end - t0
        metrics.prefill_speed = (n_prompt / prefill_s) if prefill_s else None

    def _generate(
        self, req: GenerateRequest, sock: socket.socket, progress: Keepalive | None = None
    ) -> Metrics:
        """One request: its prompt's K/V (remote, local or from the prefix cache), the
        first token, the rest decoded in the shared batch with TOKEN frames as they
        come, then DONE. Returns the metrics DONE carried."""
        eng = self.engine
        t0, at = time.perf_counter(), time.time()
        prompt_ids = eng.encode(req)
        # A migrated request: the answer so far is prompt here (never sent again).
        resumed = list(req.resume_ids or [])
        ids = prompt_ids + resumed
        max_tokens = self._max_tokens(req, ids)
        t_grammar = time.perf_counter()
        matcher = self._matcher(req, prompt_ids, sock)
        grammar_ms = (time.perf_counter() - t_grammar) * 1000 if matcher is not None else None
        if matcher is not None:
            for tid in resumed:
                matcher.consume(tid)  # the grammar's state after the answer so far
        allowed = eng.grammars.masks([matcher])[0] if matcher is not None else None
        metrics = Metrics(
            prompt_tokens=len(prompt_ids),
            resumed_tokens=len(resumed) or None,
            kv_bytes=0,
            kv_transfer_time=0.0,
            decode_server=self.name,
            cached_tokens=0,  # prompt positions whose K/V came from the prefix cache
            weights="same",  # a remote prefill on other weights says "mixed"
            grammar_ms=grammar_ms,  # compiling the output grammar, or its cache hit
        )
        hits: list[Hit] = []
        prefilled = self._prefill(req, ids, metrics, hits)
        t_local = time.perf_counter()
        logits: np.ndarray | mx.array
        if prefilled.logits is not None:
            logits = prefilled.logits
        else:
            logits = self._local_prefill(ids, prefilled.caches, req, metrics, hits)
        t_prefilled = time.perf_counter()
        sampler = make_sampler(req.temperature, req.top_p, req.seed)
        if sampler is not None and resumed:
            self.loop.call(skip_draws, sampler, len(resumed))  # position len(resumed) draws next
        first = self._first_token(logits, sampler, req.logprobs, allowed)
        t_first = time.perf_counter()
        if metrics.method != "disaggregated":
            metrics.prefill_time = t_first - t_local
        chat = eng.stream(req, prompt_ids)
        for tid in resumed:
            chat.add(tid)  # sent by the agent that died: parsed, not sent again
        # The prompt's blocks are taken from the caches without a copy once
        # decoding stops writing them (disagg_agents.decode.prefixstore), pending from before
        # the first token goes out: a request that follows it finds them.
        stores = self._stores(hits, prefilled.caches, len(ids))
        early = first_metrics(metrics, at, t0, t_first)
        caches = prefilled.caches
        out, seq = self._decode(
            req, sock, progress, chat, caches, stores, first, sampler, max_tokens, matcher, early
        )
        send_events(sock, None, chat.finish(cut=len(out) >= max_tokens))  # cut: no open call
        t_end = time.perf_counter()
        called = bool(chat.tool_calls)
        self._decoded(metrics, len(ids), len(out), max_tokens, called, t0, t_first, t_end)
        marks = prefilled.marks
        local_span = None if marks else (t_local, t_prefilled)
        joined = seq.joined_at if seq else None
        metrics.timeline = timeline(at, t0, marks, metrics, local_span, t_first, joined, t_end)
        batch_wait = seq.joined_at - seq.posted_at if seq and seq.joined_at else 0.0
        metrics.queue_time = (metrics.prefill_queue_time or 0.0) + batch_wait
        self._done(
            sock, progress, chat, out, metrics, prompt_ids if req.return_prompt_ids else None
        )
        return metrics

    def _first_token(
        self,
        logits: np.ndarray | mx.array,
        sampler: Sampler | None,
        want_logprobs: bool,
        allowed: np.ndarray | None,
    ) -> tuple[int, np.ndarray | None]:
        """The first new token and its logprobs: greedy is read off the logits on
        this thread (greedy_first), anything else sampled on the mlx thread."""
        greedy = sampler is None and not want_logprobs
        quick = greedy_first(np.asarray(logits), allowed) if greedy else None
        if quick is not None:
            return quick, None
        got: tuple[int, np.ndarray | None] = self.loop.call(
            first_token, logits, sampler, want_logprobs, allowed
        )
        return got

    def _decode(
        self,
        req: GenerateRequest,
        sock: socket.socket,
        progress: Keepalive | None,
        chat: ChatStream,
        caches: list[Any],
        stores: list[PendingStore],
        first: tuple[int, np.ndarray | None],
        sampler: Sampler | None,
        max_tokens: int,
        matcher: Matcher | None,
        early: Metrics,
    ) -> tuple[list[int], Seq | None]:
        """The answer from its first token on, sent as TOKEN (and LOGPROBS) frames as
        the tokens come (the first with `early`, first_metrics): the rest decoded in
        the loop's shared batch. Returns the tokens sent and the batch row (None: the
        answer ended with its first token)."""
        eos = self.engine.stops(req)
        if matcher is not None:
            matcher.consume(first[0])
            eos = eos | matcher.eos  # under a grammar EOS comes only where it accepts
        out: list[int] = []

        def emit(tid: int, lp: np.ndarray | None) -> None:
            out.append(tid)
            send_events(sock, tid, chat.add(tid), None if out[1:] else early)
            if lp is not None:
                send_frame(sock, Frame.LOGPROBS, lp.tobytes())

        if first[0] in eos or max_tokens <= 1 or (matcher is not None and matcher.finished):
            for store in stores:
                store.now(caches)  # never decoded: nothing writes them
            if first[0] not in eos:
                emit(*first)
            return out, None
        seq = Seq(caches, first[0], sampler, max_tokens, eos, req.logprobs, matcher=matcher)
        seq.tenant = req.cache_salt  # a full batch's free rows go fairly among tenants
        for store in stores:
            store.attach(seq)
        self.loop.join(seq)
        if progress is not None:
            progress.seq = seq  # PROGRESS now says queued (no batch slot yet) or decode
        try:
            emit(*first)
            for burst in bursts(seq.out):
                with corked(sock, len(burst) > 1):
                    for tid, lp in burst:
                        emit(tid, lp)
                for store in stores:
                    store.poll()  # joined a batch: its caches are free now
            for store in stores:
                store.finish()
        finally:
            seq.done = True  # a no-op when it ended; stops it if we failed
            for store in stores:
                store.drop()  # a no-op once stored
        return out, seq

    def _done(
        self,
        sock: socket.socket,
        progress: Keepalive | None,
        chat: ChatStream,
        out: list[int],
        metrics: Metrics,
        prompt_ids: list[int] | None,
    ) -> None:
        """The DONE frame: the answer's text only, reasoning and tool calls beside it."""
        done = Done(
            "".join(chat.content),
            out,
            metrics,
            "".join(chat.reasoning),
            [WireCall(c.name, c.arguments, c.text) for c in chat.tool_calls],
            prompt_ids,
        )
        if progress is not None:
            progress.stop()  # nothing follows DONE
        send_json(sock, Frame.DONE, done.to_json())
        log.info(
            "%s: %d prompt + %d new tokens, ttft %.3fs, %.1f tok/s, %s",
            metrics.method,
            metrics.prompt_tokens,
            len(out),
            metrics.ttft,
            metrics.decode_speed or 0.0,
            metrics.prefill_address or "local prefill",
        )


def timeline(
    at: float,
    t0: float,
    marks: dict[str, float | None] | None,
    metrics: Metrics,
    local_span: tuple[float, float] | None,
    t_first: float,
    t_joined: float | None,
    t_end: float,
) -> dict[str, float | None]:
    """A result's `timeline`, what `disagg serve`'s web view draws: `at`, the Unix
    time this agent took the request; the rest seconds after it, on this agent's
    clock (another host's clock never enters, so skew cannot bend a bar):
    prefill_start/prefill_end (remote: the PREFILL frame's send time plus the prefill
    agent's own queue and compute durations), kv_first/kv_last (K/V layers
    arriving), first_token, joined (entered the decode batch), done."""

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 6)

    out: dict[str, float | None] = {"at": at}
    sent = marks.get("sent") if marks is not None else None
    if marks is not None and sent is not None:
        start = sent + float(metrics.prefill_queue_time or 0.0)
        out["prefill_start"] = rel(start)
        out["prefill_end"] = rel(start + float(metrics.prefill_time or 0.0))
        out["kv_first"], out["kv_last"] = rel(marks.get("kv_first")), rel(marks.get("kv_last"))
    elif local_span is not None:
        out["prefill_start"], out["prefill_end"] = rel(local_span[0]), rel(local_span[1])
    out.update(first_token=rel(t_first), joined=rel(t_joined), done=rel(t_end))
    return out


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

    parser.add_argument(
        "--prefix-disk",
        default=None,
        metavar="DIR",
        help="also keep prefix-cache blocks in DIR on local disk, read back after a restart "
        "(default: off)",
    )
    parser.add_argument(
        "--prefix-disk-mb",
        type=float,
        default=None,
        help=f"most disk the --prefix-disk tier takes (default {DEFAULT_DISK_MB} MB; 0: off)",
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
        prefix_disk=args.prefix_disk,
        prefix_disk_mb=args.prefix_disk_mb,
    )
    serve("decode", args, token, agent)
