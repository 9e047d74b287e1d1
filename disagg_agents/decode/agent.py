"""Decode agent: takes generate requests, gets the prompt's KV cache streamed
from a prefill agent (or prefills itself), and decodes with mlx-lm.

A request is one `Job` (decode.job) moving through stages, each in its own
module: prompt (ids, grammar, budget) -> kvsource (remote fetch or local
prefill) -> firsttoken -> stream (the shared batch) -> events (metrics, DONE).
This module holds what the requests share and wires the stages.

Run: python -m disagg_agents.decode --model DIR [--host H --port P]
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any

from disagg_agents.runtime import fastblas  # first: it gives mlx an optimized BLAS before mlx loads

# isort: split
from disagg_agents.decode import events, firsttoken, prompt, stream
from disagg_agents.decode.codectuner import CodecTuners
from disagg_agents.decode.engine import BadRequest, DecodeEngine
from disagg_agents.decode.grammar import ClientGone
from disagg_agents.decode.keepalive import Keepalive, progress_interval
from disagg_agents.decode.kvslots import inplace_enabled
from disagg_agents.decode.kvsource import KVSource
from disagg_agents.decode.loop import DRAFT_ROWS, DecodeLoop
from disagg_agents.decode.placement import Placement
from disagg_agents.decode.prefixcache import DecodePrefixCache
from disagg_agents.prefix.store import default_max_mb
from disagg_agents.runtime.args import common_args, fail
from disagg_agents.runtime.blasshare import BlasShare
from disagg_agents.runtime.hangup import HungUp
from disagg_agents.runtime.metrics import Stats
from disagg_agents.runtime.report import DecodeStatus
from disagg_agents.runtime.serve import exit_now, serve, start_agent
from disagg_agents.runtime.settings import (
    Setting,
    attr_setting,
    budget_setting,
    disk_setting,
    tenant_share_setting,
)
from disagg_agents.wire.answer import Metrics
from disagg_agents.wire.channel import recv_json, send_error
from disagg_agents.wire.frames import (
    CONTROL_MAX_FRAME,
    Frame,
    PeerClosed,
    ProtocolError,
    RemoteError,
)
from disagg_agents.wire.request import GenerateRequest, RequestError
from disagg_agents.wire.text import printable

log = logging.getLogger("disagg.decode")

DEFAULT_DISK_MB = 8192  # the --prefix-disk tier's default budget
PREFILL_STEP = 2048  # mlx-lm's generate_step default: same chunks, same numerics


@dataclass(frozen=True)
class DecodeOptions:
    """A decode agent's settings from its flags (main)."""

    max_batch: int = 32  # most requests decoded together in one step
    max_request_bytes: int = CONTROL_MAX_FRAME  # largest GENERATE frame taken
    allow_mixed: bool = False  # accept prefill agents on other weights
    prefix_cache_mb: float | None = None  # None: prefix.store.default_max_mb()
    prefix_disk: str | None = None  # the prefix cache's disk tier (None: off)
    prefix_disk_mb: float | None = None  # None: DEFAULT_DISK_MB
    speculate: bool = True  # prompt-lookup drafts verified in the batch (decode.draft)


class DecodeAgent:
    """What a decode agent's requests share: the engine, the decode loop, the
    prefix cache, placement and the codec tuners; each request runs the stages."""

    def __init__(
        self,
        engine: DecodeEngine,
        name: str,
        token: bytes | None = None,
        options: DecodeOptions = DecodeOptions(),
    ) -> None:
        self.engine = engine
        self.name = name
        self.max_request_bytes = options.max_request_bytes  # largest GENERATE frame taken
        self.stats = Stats("decode")
        self.placement = Placement()
        # All mlx work runs on the loop's thread; requests decode there together.
        self.loop = DecodeLoop(
            engine.model,
            max_batch=options.max_batch,
            grammars=engine.grammars,
            prefill_step=PREFILL_STEP,
            draft_rows=DRAFT_ROWS if options.speculate else 0,
        )
        self.stats.extra.append(self.loop.prometheus)
        engine.grammars.warm()  # its tokenizer (~0.5 s) off the first request's path
        self.blas_share = BlasShare.from_env(self.loop.post)
        self.loop.before_turn, self.loop.on_idle = self.blas_share.tick, self.blas_share.idle
        self.prefix = self._open_prefix(options, token)
        self.kv = KVSource(
            engine,
            self.loop,
            self.prefix,
            self.placement,
            CodecTuners(),  # per prefill agent: what its K/V stream measured, for "auto"
            self.blas_share,
            name,
            token,
            # Accept a prefill agent on other weights (results then say weights: "mixed").
            allow_mixed=options.allow_mixed,
            kv_inplace=inplace_enabled(),  # DISAGG_KV_INPLACE=0: the copy path
        )

    def _open_prefix(self, options: DecodeOptions, token: bytes | None) -> DecodePrefixCache:
        """The prefix cache, with its disk tier when asked, counted in /metrics."""
        engine = self.engine
        mb = default_max_mb() if options.prefix_cache_mb is None else options.prefix_cache_mb
        prefix = DecodePrefixCache(int(mb * (1 << 20)), engine.fingerprint["layers"], engine.dtype)
        self.stats.extra.append(lambda: prefix.store.prometheus("decode"))
        mb = DEFAULT_DISK_MB if options.prefix_disk_mb is None else options.prefix_disk_mb
        if options.prefix_disk and mb > 0:  # the disk tier: blocks kept across restarts
            try:
                prefix.enable_disk(
                    options.prefix_disk, int(mb * (1 << 20)), engine.fingerprint, token
                )
            except (OSError, ValueError) as e:  # serve without it rather than not at all
                log.error("prefix disk tier off: %s: %s", options.prefix_disk, e)
                return prefix
            disk = prefix.disk
            assert disk is not None
            self.stats.extra.append(lambda: disk.prometheus("decode"))
        return prefix

    def live_settings(self) -> list[Setting]:
        """What PUT /settings may change (disagg_agents.runtime.settings), for new requests."""
        disk = [disk_setting(self.prefix.disk)] if self.prefix.disk is not None else []
        return [
            *disk,
            budget_setting(self.prefix.store),
            tenant_share_setting(self.prefix.store, self.prefix.disk),
            attr_setting(
                "allow_mixed",
                self.kv,
                "allow_mixed",
                bool,
                help="accept prefill agents whose weights differ from ours",
            ),
            attr_setting(
                "kv_inplace",
                self.kv,
                "kv_inplace",
                bool,
                help="receive K/V straight into the caches (false: the copy path)",
            ),
        ]

    def status(self) -> DecodeStatus:
        batch = self.loop.snapshot()
        return DecodeStatus(
            name=self.name,
            model=self.engine.model_dir,
            device=self.engine.device,
            blas=fastblas.loaded,
            blas_threads=fastblas.threads(),
            blas_limited_by=self.blas_share.limited_by,
            fingerprint=self.engine.fingerprint,
            context=self.engine.context,
            queued=batch["batch_waiting"],
            max_batch=self.loop.max_batch,
            batch=batch,
            stats=self.stats.snapshot(),
            prefix_cache=self.prefix.store.snapshot(),
            prefix_disk=self.prefix.disk.snapshot() if self.prefix.disk is not None else None,
            grammars=self.engine.grammars.snapshot(),
            chat=self.engine.chat_info(),
        )

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
            except (ClientGone, HungUp) as e:  # hung up before its answer: nobody to tell
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

    def _generate(
        self, req: GenerateRequest, sock: socket.socket, progress: Keepalive | None = None
    ) -> Metrics:
        """One request: its prompt's K/V (remote, local or from the prefix cache), the
        first token, the rest decoded in the shared batch with TOKEN frames as they
        come, then DONE. Returns the metrics DONE carried."""
        eng, loop = self.engine, self.loop
        job = prompt.open_job(eng, self.name, req, sock, progress)
        self.kv.prompt_kv(job)
        firsttoken.first(eng, loop, self.prefix, job)
        stream.decode(loop, eng.stops, job)
        events.finish(self.placement, job)
        return job.metrics


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

    parser.add_argument(
        "--no-speculate",
        action="store_true",
        help="no prompt-lookup drafts: one token per row per forward (a request's own "
        "speculate: false does this for it alone)",
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
        DecodeOptions(
            max_batch=args.max_batch,
            max_request_bytes=args.max_request_bytes,
            allow_mixed=args.allow_mixed,
            prefix_cache_mb=args.prefix_cache_mb,
            prefix_disk=args.prefix_disk,
            prefix_disk_mb=args.prefix_disk_mb,
            speculate=not args.no_speculate,
        ),
    )
    serve("decode", args, token, agent)
    if agent.prefix.disk is not None:  # the blocks still queued, so a restart finds them
        agent.prefix.disk.close()
    exit_now()
