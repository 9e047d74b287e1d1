"""Which KV codec a connection should use: the one that moves the prompt's raw
K/V bytes fastest through compress -> wire -> decompress, and never one that
is slower than sending them raw.

The three stages run pipelined per layer (the prefill agent's sender thread
compresses layer i while layer i-1 is on the wire and the decode agent expands
layer i-2), so a codec's steady-state rate in raw bytes per second is the
slowest of its stages:

    raw:    link
    codec:  min(encode speed, decode speed, link x compression ratio)

Compression can only win on a link slower than the compressor. Picking it is
wrong exactly when the link was underestimated, so the link estimate fed in
must err high (see `CodecTuner.observe_fetch`): an overestimate only keeps
raw, which is the safe side. A codec must also beat raw by `MARGIN`, so noise
in the measurements never flips the choice for a gain too small to matter.

Pure: no torch, no mlx, no sockets.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from disagg_agents.runtime.metrics import ema
from disagg_agents.wire.kvcodec import Codec

MARGIN = 1.10  # a compressing codec must be at least this much faster than raw
# A KV frame smaller than this may sit whole in the socket buffer before we
# read it, so its read time says nothing about the link: not measured.
MIN_LINK_FRAME = 256 << 10


@dataclass(frozen=True)
class CodecSpeed:
    """What one codec does to this stream's K/V, in raw (uncompressed) bytes."""

    ratio: float  # raw bytes / wire bytes
    encode_bps: float  # raw bytes per second through the compressor (sender side)
    decode_bps: float  # raw bytes per second through the decompressor (receiver side)


def _ok(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def stream_rate(link_bps: float, codec: Codec, speed: CodecSpeed | None = None) -> float:
    """Steady-state raw KV bytes per second of a pipelined stream with `codec`."""
    if codec == Codec.RAW:
        return link_bps
    if speed is None:
        raise ValueError(f"{codec.name} needs its measured speed")
    return min(speed.encode_bps, speed.decode_bps, link_bps * speed.ratio)


def fastest_codec(
    link_bps: float | None, speeds: Mapping[Codec, CodecSpeed], margin: float = MARGIN
) -> Codec:
    """The fastest codec for a link of `link_bps` wire bytes per second.

    RAW unless some codec's measured pipeline beats the raw link by `margin`;
    RAW too when the link or a codec was never measured (or measured nonsense).
    """
    if not _ok(link_bps) or margin < 1.0:
        return Codec.RAW
    assert link_bps is not None
    best, best_rate = Codec.RAW, link_bps * margin
    for codec, s in speeds.items():
        if codec == Codec.RAW or not all(_ok(x) for x in (s.ratio, s.encode_bps, s.decode_bps)):
            continue
        rate = stream_rate(link_bps, codec, s)
        if rate > best_rate:
            best, best_rate = codec, rate
    return best


@dataclass
class _Avg:
    ratio: float | None = None
    encode_bps: float | None = None
    decode_bps: float | None = None

    def speed(self) -> CodecSpeed | None:
        if _ok(self.ratio) and _ok(self.encode_bps) and _ok(self.decode_bps):
            return CodecSpeed(self.ratio, self.encode_bps, self.decode_bps)  # type: ignore[arg-type]
        return None


@dataclass
class CodecTuner:
    """What a decode agent learned about one prefill agent's stream.

    Fed the metrics of each KV fetch (`observe_fetch`); `choose` then picks the
    codec for the next one. Until every compressing codec has been measured it
    asks the prefill agent to probe them (`wants_probe`): the prefill agent
    compresses one layer with each on its sender thread and reports sizes and
    times, so no request is ever sent with an unmeasured codec.
    """

    link_bps: float | None = None
    codecs: dict[Codec, _Avg] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wants_probe(self) -> bool:
        with self.lock:
            return any(
                (a := self.codecs.get(c)) is None or a.speed() is None
                for c in Codec
                if c != Codec.RAW
            )

    def speeds(self) -> dict[Codec, CodecSpeed]:
        with self.lock:
            return {c: s for c, a in self.codecs.items() if (s := a.speed()) is not None}

    def choose(self) -> tuple[Codec, str]:
        """(codec, why) for the next fetch."""
        speeds = self.speeds()
        link = self.link_bps
        codec = fastest_codec(link, speeds)
        if link is None:
            return codec, "link not measured yet"
        parts = [f"link {link / 1e6:,.0f} MB/s"] + [
            f"{c.name.lower()} x{s.ratio:.2f} {stream_rate(link, c, s) / 1e6:,.0f} MB/s"
            for c, s in sorted(speeds.items())
        ]
        return codec, ", ".join(parts)

    def observe_link(self, wire_bytes: float, seconds: float) -> None:
        if _ok(wire_bytes) and _ok(seconds):
            with self.lock:
                self.link_bps = ema(self.link_bps, wire_bytes / seconds)

    def observe_codec(
        self,
        codec: Codec,
        raw_bytes: float,
        wire_bytes: float,
        encode_s: float | None,
        decode_s: float | None,
    ) -> None:
        """One measurement of `codec`; times of None leave that average as it is."""
        if codec == Codec.RAW or not _ok(raw_bytes) or not _ok(wire_bytes):
            return
        with self.lock:
            a = self.codecs.setdefault(codec, _Avg())
            a.ratio = ema(a.ratio, raw_bytes / wire_bytes)
            if encode_s is not None and _ok(encode_s):
                a.encode_bps = ema(a.encode_bps, raw_bytes / encode_s)
            if decode_s is not None and _ok(decode_s):
                a.decode_bps = ema(a.decode_bps, raw_bytes / decode_s)

    def observe_fetch(self, m: Mapping[str, Any]) -> None:
        """Learn from one fetch's metrics (`disagg_agents.decode.kvfetch.fetch_kv`).

        The link: wire bytes over the time spent reading the payloads of large
        KV frames, each timed from its header's arrival. That excludes the gaps
        in which the prefill agent was still computing the next layer (a whole
        stream's bytes / time is only a lower bound of the link when it was
        compute-bound), and whatever arrived before we started reading makes it
        err high, which is the safe side.
        """
        self.observe_link(m.get("kv_link_bytes") or 0, m.get("kv_link_time") or 0.0)
        try:
            used = Codec(m.get("codec", Codec.RAW))
        except ValueError:
            used = Codec.RAW
        if used != Codec.RAW:
            self.observe_codec(
                used,
                m.get("kv_raw_bytes") or 0,
                m.get("kv_payload_bytes") or 0,
                m.get("kv_encode_time"),
                m.get("kv_decode_time"),
            )
        for key, p in (m.get("codec_probe") or {}).items():
            try:
                codec = Codec(int(key))
                self.observe_codec(
                    codec,
                    float(p["raw_bytes"]),
                    float(p["wire_bytes"]),
                    float(p["encode_s"]),
                    float(p["decode_s"]),
                )
            except (ValueError, KeyError, TypeError):
                continue  # a probe we cannot read teaches us nothing


class CodecTuners:
    """A decode agent's tuners, one per prefill agent (by its address), shared
    by the requests' threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tuners: dict[str, CodecTuner] = {}

    def for_link(self, key: str) -> CodecTuner:
        """The tuner of prefill agent `key`, new on its first fetch."""
        with self._lock:
            return self._tuners.setdefault(key, CodecTuner())
