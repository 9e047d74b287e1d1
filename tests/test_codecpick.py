"""The adaptive codec choice: never slower than raw, compression only where the
link is the bottleneck, and nothing unmeasured is ever picked."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg_agents.decode.codectuner import (
    MARGIN,
    MIN_LINK_FRAME,
    CodecSpeed,
    CodecTuner,
    fastest_codec,
    stream_rate,
)
from disagg_agents.wire.kvcodec import Codec
from tests.conftest import ask

GB = 1e9
# Roughly what this machine measures on SmolLM2 KV: shuffle+zstd wins on size.
SPEEDS = {
    Codec.ZSTD: CodecSpeed(ratio=1.2, encode_bps=0.6 * GB, decode_bps=1.5 * GB),
    Codec.SHUFFLE_ZSTD: CodecSpeed(ratio=1.35, encode_bps=0.4 * GB, decode_bps=0.8 * GB),
}


def test_unmeasured_link_or_codecs_mean_raw() -> None:
    assert fastest_codec(None, SPEEDS) == Codec.RAW
    assert fastest_codec(0.0, SPEEDS) == Codec.RAW
    assert fastest_codec(math.nan, SPEEDS) == Codec.RAW
    assert fastest_codec(math.inf, SPEEDS) == Codec.RAW
    assert fastest_codec(0.125 * GB, {}) == Codec.RAW


def test_slow_link_picks_the_best_ratio_fast_link_stays_raw() -> None:
    # 1 Gbit/s: the compressor (0.4 GB/s) outruns the link (0.125 GB/s) -> ratio wins.
    assert fastest_codec(0.125 * GB, SPEEDS) == Codec.SHUFFLE_ZSTD
    # 10 Gbit/s: 1.25 GB/s of raw link beats both compressors.
    assert fastest_codec(1.25 * GB, SPEEDS) == Codec.RAW
    # In between: shuffle+zstd is compressor-bound at 0.4 GB/s, zstd is not yet.
    assert fastest_codec(0.45 * GB, SPEEDS) == Codec.ZSTD


def test_margin_keeps_raw_for_a_marginal_gain() -> None:
    tiny = {Codec.ZSTD: CodecSpeed(ratio=1.05, encode_bps=10 * GB, decode_bps=10 * GB)}
    assert fastest_codec(0.125 * GB, tiny) == Codec.RAW  # 5 % < MARGIN
    assert fastest_codec(0.125 * GB, tiny, margin=1.0) == Codec.ZSTD


def test_bad_measurements_are_ignored() -> None:
    bad = {
        Codec.ZSTD: CodecSpeed(ratio=math.nan, encode_bps=GB, decode_bps=GB),
        Codec.SHUFFLE_ZSTD: CodecSpeed(ratio=2.0, encode_bps=0.0, decode_bps=GB),
    }
    assert fastest_codec(0.1 * GB, bad) == Codec.RAW


def test_stream_rate_is_the_slowest_stage() -> None:
    s = CodecSpeed(ratio=2.0, encode_bps=3.0, decode_bps=5.0)
    assert stream_rate(1.0, Codec.ZSTD, s) == 2.0  # link-bound: link x ratio
    assert stream_rate(10.0, Codec.ZSTD, s) == 3.0  # compressor-bound
    assert stream_rate(10.0, Codec.RAW) == 10.0
    with pytest.raises(ValueError):
        stream_rate(1.0, Codec.ZSTD)


speed = st.builds(
    CodecSpeed,
    ratio=st.floats(0.5, 20.0),
    encode_bps=st.floats(1e6, 1e11),
    decode_bps=st.floats(1e6, 1e11),
)


@given(
    link=st.floats(1e5, 1e11),
    speeds=st.dictionaries(st.sampled_from([Codec.ZSTD, Codec.SHUFFLE_ZSTD]), speed),
)
def test_never_slower_than_raw(link: float, speeds: dict[Codec, CodecSpeed]) -> None:
    picked = fastest_codec(link, speeds)
    rate = stream_rate(link, picked, speeds.get(picked))
    assert rate >= link
    if picked != Codec.RAW:
        assert rate >= link * MARGIN
        # ... and it is the fastest of the measured codecs
        assert all(rate >= stream_rate(link, c, s) for c, s in speeds.items())


def fetch_metrics(**kw: object) -> dict[str, object]:
    return {
        "codec": int(Codec.RAW),
        "kv_link_bytes": 0,
        "kv_link_time": 0.0,
        "kv_raw_bytes": 0,
        "kv_payload_bytes": 0,
        **kw,
    }


def probe(ratio: float, enc: float, dec: float, raw: int = 3 << 20) -> dict[str, float]:
    return {
        "raw_bytes": raw,
        "wire_bytes": raw / ratio,
        "encode_s": raw / enc,
        "decode_s": raw / dec,
    }


def test_tuner_probes_first_then_picks_from_what_it_measured() -> None:
    t = CodecTuner()
    assert t.wants_probe()
    assert t.choose()[0] == Codec.RAW  # nothing measured
    # A raw fetch over a slow link (0.1 GB/s) that also carried the prefill side's probe.
    t.observe_fetch(
        fetch_metrics(
            kv_link_bytes=100 * MIN_LINK_FRAME,
            kv_link_time=100 * MIN_LINK_FRAME / (0.1 * GB),
            codec_probe={
                "1": probe(1.08, 0.6 * GB, 1.5 * GB),
                "2": probe(1.35, 0.4 * GB, 0.8 * GB),
                "7": probe(9.0, GB, GB),  # a codec we do not know: ignored
            },
        )
    )
    assert not t.wants_probe()
    codec, why = t.choose()
    assert codec == Codec.SHUFFLE_ZSTD, why
    assert "link 100 MB/s" in why
    # The link turns out fast (measured on the compressed stream): back to raw.
    for _ in range(20):
        t.observe_fetch(
            fetch_metrics(
                codec=int(Codec.SHUFFLE_ZSTD),
                kv_link_bytes=10 << 20,
                kv_link_time=(10 << 20) / (5 * GB),
                kv_raw_bytes=int(13.5 * (1 << 20)),
                kv_payload_bytes=10 << 20,
                kv_encode_time=13.5 * (1 << 20) / (0.4 * GB),
                kv_decode_time=13.5 * (1 << 20) / (0.8 * GB),
            )
        )
    assert t.choose()[0] == Codec.RAW


def test_tuner_without_link_frames_stays_raw() -> None:
    t = CodecTuner()
    t.observe_fetch(fetch_metrics(codec_probe={"1": probe(3.0, GB, GB), "2": probe(3.0, GB, GB)}))
    assert t.link_bps is None
    assert t.choose() == (Codec.RAW, "link not measured yet")


@pytest.mark.slow
def test_auto_codec_through_real_agents(smol_agents: Any) -> None:
    """codec "auto": the first fetch probes the prefill agent's codecs and measures
    the link; later fetches use what was learned; the text never changes."""
    from disagg.errors import UsageError
    from disagg.serving import wireclient as client

    prefill, decode = smol_agents
    base = {
        "prompt": "Name three colours. " * 120,  # ~1k tokens: frames large enough to time
        "raw": True,
        "max_tokens": 4,
        "ignore_eos": True,
        "prefill": {"host": prefill.host, "port": prefill.port},
        "placement": "remote",
        # The same prompt each time: without this the prefix cache would send only
        # the last block, and the link would never be measured on large frames.
        "prefix_cache": False,
    }

    def run(**kw: Any) -> client.Result:
        return ask(decode, {**base, **kw})

    raw = run()
    assert raw.metrics.codec == int(Codec.RAW) and raw.metrics.codec_probe is None
    first = run(codec="auto")
    m = first.metrics
    assert m.method == "disaggregated" and m.codec == int(Codec.RAW)
    assert m.codec_reason == "link not measured yet"
    assert set(m.codec_probe or {}) == {str(int(Codec.ZSTD)), str(int(Codec.SHUFFLE_ZSTD))}
    assert (m.kv_link_bytes or 0) > 0 and (m.kv_link_time or 0) > 0
    assert m.kv_raw_bytes == m.kv_payload_bytes
    second = run(codec="auto")
    assert (second.metrics.codec_reason or "").startswith("link ")
    assert second.metrics.codec_probe is None  # measured once, then learned from use
    assert second.metrics.codec in {int(c) for c in Codec}
    for r in (first, second, run(codec=int(Codec.SHUFFLE_ZSTD))):
        assert r.token_ids == raw.token_ids
    with pytest.raises(UsageError, match="unknown codec"):
        run(codec="fast")
