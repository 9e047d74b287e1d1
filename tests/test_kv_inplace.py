"""K/V received straight into its mlx caches (disagg_agents.decode.kvslots) is bit for bit what
the prefill side sent: every dtype, every codec, int8 rows, a prefix hit, a
sliding layer (left to the copy path), sealed frames. Frames cross a real socket
from a fake prefill agent that encodes with the real codec; the expected caches
come from torch (the sender's values, torch's own casts for int8), and the old
copy path (decode_layer + fill_layer) must agree with them too."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_lm.models.cache import KVCache, RotatingKVCache

from disagg.serving import wireclient as client
from disagg.serving.localagents import AgentProc
from disagg_agents.decode.kvcaches import fill_layer
from disagg_agents.decode.kvfetch import Into, receive_layers
from disagg_agents.decode.kvslots import Slots, allocate
from disagg_agents.decode.prefixcache import DecodePrefixCache, Hit, Span
from disagg_agents.prefill.engine import to_wire
from disagg_agents.wire import kvcodec as K
from disagg_agents.wire.auth import client_auth, server_auth
from disagg_agents.wire.channel import recv_json, send_buffers, send_frame, send_json
from disagg_agents.wire.frames import Frame, ProtocolError, pack_header
from disagg_agents.wire.request import PrefillRequest
from disagg_agents.wire.seal import _SEALS, IntegrityError, sealed
from tests.agentpool import AgentSet
from tests.conftest import ask, remote_request, socket_pair

HEADS, DIM, LAYERS, PROMPT = 3, 16, 4, 45
WINDOW = 8  # the sliding layer's window in the mixed-cache test
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
BITS = {"float32": torch.int32, "float16": torch.int16, "bfloat16": torch.int16}
VOCAB = 11
TOKEN = b"t" * 32


def source(dtype: str, seq: int = PROMPT, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer [H, seq, D] K and V as the prefill's torch computed them; odd values
    in: -0.0, tiny ones (fp16 subnormals), large ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        k = torch.randn(HEADS, seq, DIM, generator=g) * 3
        v = torch.randn(HEADS, seq, DIM, generator=g) * 1e-5
        k[0, 0, :4] = torch.tensor([-0.0, 0.0, 6e4, -6e4])
        out.append((k.to(TORCH[dtype]), v.to(TORCH[dtype])))
    return out


def int8_reference(x: torch.Tensor) -> torch.Tensor:
    """What int8 rows restore to, by torch: row absmax/127 scales, rounded rows,
    q * scale in float32, cast to the model's dtype by torch."""
    f = x.float()
    scale = f.abs().amax(-1) / 127
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.clamp(torch.round(f * inv[..., None]), -127, 127).to(torch.int8).float()
    return (q * scale[..., None]).to(x.dtype)


def wire_kv(layer: int, k: torch.Tensor, v: torch.Tensor, kind: K.Kind = K.Kind.FULL) -> K.LayerKV:
    return K.LayerKV(layer, kind, K.DTYPE_NAMES[_name(k.dtype)], to_wire(k[None]), to_wire(v[None]))


def _name(dt: torch.dtype) -> str:
    return next(n for n, t in TORCH.items() if t == dt)


class FakePrefill:
    """Answers one PREFILL on `sock` with the given layers (from `start`), the
    logits and PREFILL_DONE; `tamper` flips one byte of the first layer's payload
    after sealing it."""

    def __init__(
        self,
        sock: socket.socket,
        layers: list[K.LayerKV],
        codec: K.Codec,
        quant: bool = False,
        tamper: bool = False,
    ) -> None:
        self.sock, self.layers, self.codec, self.quant, self.tamper = (
            sock,
            layers,
            codec,
            quant,
            tamper,
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            recv_json(self.sock, Frame.PREFILL)
            for n, kv in enumerate(self.layers):
                parts = K.encode_layer(K.quantize_layer(kv) if self.quant else kv, self.codec)
                if self.tamper and n == 0:
                    self.send_tampered(parts)
                    return
                send_frame(self.sock, Frame.KV_LAYER, parts)
            send_frame(self.sock, Frame.LOGITS, np.zeros(VOCAB, np.float32).tobytes())
            send_json(self.sock, Frame.PREFILL_DONE, {"prefill_time": 0.0})
        except BaseException as e:  # the test reads it
            self.error = e

    def send_tampered(self, parts: list[bytes | memoryview]) -> None:
        payload = bytearray(b"".join(bytes(p) for p in parts))
        head = pack_header(Frame.KV_LAYER, len(payload))
        tag = _SEALS[self.sock].sign(head, [payload])
        payload[len(payload) // 2] ^= 1
        send_buffers(self.sock, [head, payload, tag])

    def join(self) -> None:
        self.thread.join(10)
        assert self.error is None, self.error


def make_caches(sliding: int | None = None) -> list[Any]:
    return [RotatingKVCache(max_size=WINDOW) if i == sliding else KVCache() for i in range(LAYERS)]


def connected(seal: bool) -> tuple[socket.socket, socket.socket]:
    ours, theirs = socket_pair()
    if seal:
        t = threading.Thread(target=server_auth, args=(theirs, TOKEN))
        t.start()
        client_auth(ours, TOKEN, "mac")
        t.join()
        assert sealed(ours) and sealed(theirs)
    return ours, theirs


def fetch(
    layers: list[K.LayerKV],
    codec: K.Codec,
    dtype: str,
    *,
    inplace: bool,
    quant: bool = False,
    sliding: int | None = None,
    prefix: tuple[DecodePrefixCache, Hit] | None = None,
    sealed: bool = False,
    tamper: bool = False,
) -> tuple[list[Any], Slots | None, dict[str, Any]]:
    """Receive `layers` over a real socket into fresh caches, in place or by the
    copy path; return the caches (and the slots used)."""
    caches = make_caches(sliding)
    ours, theirs = connected(sealed)
    peer = FakePrefill(theirs, layers, codec, quant, tamper)
    slots: Slots | None = None
    remote = prefix[0].remote_prefix(prefix[1], list(range(PROMPT))) if prefix else None
    if inplace:
        slots = allocate(caches, PROMPT, dtype, HEADS, DIM)
        if prefix:
            dp, hit = prefix
            slots.prefix_start = hit.tokens
            slots.fill_prefix = lambda layer, k, v: dp.fill_prefix(hit, layer, k, v)
    got_slots = slots
    request = PrefillRequest(
        list(range(PROMPT)), codec=int(codec), kv_quant="int8" if quant else None
    )
    fingerprint = {"num_kv_heads": HEADS, "head_dim": DIM}
    try:
        source = (lambda: got_slots) if got_slots is not None else None
        # copy-path layers placed on this (the only mlx) thread
        into = Into(caches, fill_layer, remote, source)
        got = receive_layers(ours, request, into, fingerprint, VOCAB)
    finally:
        ours.close()
        peer.thread.join(10)
        theirs.close()
    peer.join()
    return caches, slots, got.metrics


def cache_words(cache: Any) -> np.ndarray:
    """A cache's whole keys buffer as raw words (bf16 as uint16)."""
    a = cache.keys
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def expect_cache(cache: Any, want_k: torch.Tensor, want_v: torch.Tensor) -> None:
    """`cache` holds exactly `want` (torch, [H, S, D]) at positions [0, S), bit for
    bit, zeros after, with the capacity and offset mlx's own prefill leaves."""
    seq = want_k.shape[1]
    assert cache.offset == PROMPT
    assert cache.keys.shape == (1, HEADS, (PROMPT // cache.step + 1) * cache.step, DIM)
    for arr, want in ((cache.keys, want_k), (cache.values, want_v)):
        assert arr.dtype == getattr(mx, _name(want.dtype))
        words = np.array(arr.view(mx.uint16) if arr.dtype == mx.bfloat16 else arr)[0]
        bits = want.contiguous().view(BITS[_name(want.dtype)]).numpy()
        assert np.array_equal(words[:, :seq].view(bits.dtype), bits)
        assert not words[:, seq:].any()


DTYPES = ["float32", "float16", "bfloat16"]


def same_counts(m: dict[str, Any], old: dict[str, Any]) -> None:
    """The byte counts (codecpick and placement learn from them) match the copy path's."""
    keys = ("kv_bytes", "kv_payload_bytes", "kv_raw_bytes", "kv_quant")
    assert {k: m[k] for k in keys} == {k: old[k] for k in keys}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", list(K.Codec))
def test_lossless_in_place_is_bit_exact(dtype: str, codec: K.Codec) -> None:
    src = source(dtype)
    layers = [wire_kv(i, k, v) for i, (k, v) in enumerate(src)]
    caches, slots, m = fetch(layers, codec, dtype, inplace=True)
    assert slots is not None and slots.placed == set(range(LAYERS))
    for cache, (k, v) in zip(caches, src, strict=True):
        expect_cache(cache, k, v)
    # The old copy path agrees, word for word.
    old, _, m_old = fetch(layers, codec, dtype, inplace=False)
    for a, b in zip(caches, old, strict=True):
        assert np.array_equal(cache_words(a), cache_words(b))
    same_counts(m, m_old)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", list(K.Codec))
def test_int8_dequantizes_in_place_bit_exact(dtype: str, codec: K.Codec) -> None:
    src = source(dtype, seed=1)
    layers = [wire_kv(i, k, v) for i, (k, v) in enumerate(src)]
    caches, slots, m = fetch(layers, codec, dtype, inplace=True, quant=True)
    assert slots is not None and slots.placed == set(range(LAYERS))
    assert m["kv_quant"] == "int8"
    for cache, (k, v) in zip(caches, src, strict=True):
        expect_cache(cache, int8_reference(k), int8_reference(v))
    old, _, m_old = fetch(layers, codec, dtype, inplace=False, quant=True)
    for a, b in zip(caches, old, strict=True):
        assert np.array_equal(cache_words(a), cache_words(b))
    same_counts(m, m_old)


def stored_prefix(
    dtype: str, src: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[DecodePrefixCache, Hit]:
    """A decode prefix cache holding an earlier request's blocks of this prompt,
    and the hit a new request for the same prompt gets."""
    dp = DecodePrefixCache(64 << 20, [["full", 0]] * LAYERS, dtype)
    ids = list(range(PROMPT))
    first = dp.lookup("remote:x", ids, local=False)
    assert first.tokens == 0
    spans: list[Span | None] = []
    for i, (k, v) in enumerate(src):
        kv = wire_kv(i, k, v)
        spans.append(Span(kv.keys, kv.values))
    assert dp.save(first, spans) > 0
    hit = dp.lookup("remote:x", ids, local=False)
    assert hit.tokens == (PROMPT - 1) // 16 * 16 == 32
    return dp, hit


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", [K.Codec.RAW, K.Codec.SHUFFLE_ZSTD])
def test_prefix_hit_copies_its_blocks_in_place(dtype: str, codec: K.Codec) -> None:
    src = source(dtype, seed=2)
    dp, hit = stored_prefix(dtype, src)
    # The prefill agent sends only the positions after the hit.
    suffix = [wire_kv(i, k[:, hit.tokens :], v[:, hit.tokens :]) for i, (k, v) in enumerate(src)]
    caches, slots, m = fetch(suffix, codec, dtype, inplace=True, prefix=(dp, hit))
    assert slots is not None and slots.placed == set(range(LAYERS)) and hit.used
    for cache, (k, v) in zip(caches, src, strict=True):
        expect_cache(cache, k, v)
    _, hit2 = dp, dp.lookup("remote:x", list(range(PROMPT)), local=False)
    old, _, m_old = fetch(suffix, codec, dtype, inplace=False, prefix=(dp, hit2))
    for a, b in zip(caches, old, strict=True):
        assert np.array_equal(cache_words(a), cache_words(b))
    # What crossed is the suffix only, counted as the copy path counts it.
    same_counts(m, m_old)
    itemsize = 4 if dtype == "float32" else 2
    assert m["kv_raw_bytes"] == LAYERS * 2 * HEADS * (PROMPT - hit.tokens) * DIM * itemsize


def test_a_prefix_hit_sent_whole_is_taken_as_is() -> None:
    """An older prefill agent ignores `start` and sends every position."""
    src = source("float32", seed=3)
    dp, hit = stored_prefix("float32", src)
    layers = [wire_kv(i, k, v) for i, (k, v) in enumerate(src)]
    caches, slots, _ = fetch(layers, K.Codec.RAW, "float32", inplace=True, prefix=(dp, hit))
    assert slots is not None and slots.placed == set(range(LAYERS)) and not hit.used
    for cache, (k, v) in zip(caches, src, strict=True):
        expect_cache(cache, k, v)


def test_sliding_layer_keeps_the_copy_path() -> None:
    src = source("bfloat16", seed=4)
    layers = [wire_kv(i, k, v) for i, (k, v) in enumerate(src)]
    # transformers keeps a sliding layer's last window-1 tokens.
    k1, v1 = src[1]
    layers[1] = wire_kv(1, k1[:, -(WINDOW - 1) :], v1[:, -(WINDOW - 1) :], K.Kind.SLIDING)
    caches, slots, _ = fetch(layers, K.Codec.ZSTD, "bfloat16", inplace=True, sliding=1)
    assert slots is not None and slots.placed == {0, 2, 3}
    old, _, _ = fetch(layers, K.Codec.ZSTD, "bfloat16", inplace=False, sliding=1)
    for i, (cache, (k, v)) in enumerate(zip(caches, src, strict=True)):
        if i != 1:
            expect_cache(cache, k, v)
        assert np.array_equal(cache_words(cache), cache_words(old[i]))
    assert (caches[1].offset, caches[1]._idx) == (PROMPT, WINDOW - 1)


def test_sealed_frames_land_in_place_and_a_tampered_one_is_refused() -> None:
    src = source("float16", seed=5)
    layers = [wire_kv(i, k, v) for i, (k, v) in enumerate(src)]
    caches, slots, _ = fetch(layers, K.Codec.RAW, "float16", inplace=True, sealed=True)
    assert slots is not None and slots.placed == set(range(LAYERS))
    for cache, (k, v) in zip(caches, src, strict=True):
        expect_cache(cache, k, v)
    with pytest.raises(IntegrityError):
        fetch(layers, K.Codec.RAW, "float16", inplace=True, sealed=True, tamper=True)


def test_bad_frames_are_refused_as_on_the_copy_path() -> None:
    """A frame that does not fit the slots goes through decode_layer, whose
    checks refuse it: a layer twice, a short layer."""
    src = source("float32", seed=6)
    twice = [wire_kv(i, k, v) for i, (k, v) in enumerate(src)] + [wire_kv(0, src[0][0], src[0][1])]
    with pytest.raises(ProtocolError, match="unexpected KV for layer 0"):
        fetch(twice, K.Codec.RAW, "float32", inplace=True)
    short = [wire_kv(i, k[:, :-1], v[:, :-1]) for i, (k, v) in enumerate(src)]
    with pytest.raises(ProtocolError, match="full-attention layer sent 44 of 45"):
        fetch(short, K.Codec.RAW, "float32", inplace=True)


# -- real agents: the in-place decode agent against one on the copy path --------


@pytest.fixture(scope="module")
def both(smol_set: AgentSet) -> Iterator[tuple[AgentProc, AgentProc, AgentProc]]:
    """A SmolLM2 prefill agent, a decode agent receiving in place, and the set's
    second decode agent on the copy path (its live setting kv_inplace, as
    DISAGG_KV_INPLACE=0 gives at start), in one cluster."""
    prefill, inplace = smol_set.pair
    copy = smol_set.decodes[1]
    assert copy.settings(kv_inplace=False)["kv_inplace"] is False
    try:
        yield prefill, inplace, copy
    finally:
        copy.settings(kv_inplace=True)  # a pooled agent: its own value again


def same_answer(a: client.Result, b: client.Result) -> None:
    """Same tokens and the same logprobs, bit for bit, at every step."""
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.tobytes() == y.tobytes()


@pytest.mark.slow
def test_agents_in_place_answer_as_the_copy_path(
    both: tuple[AgentProc, AgentProc, AgentProc],
) -> None:
    prefill, inplace, copy = both
    prompt = " ".join(f"Stone {i} weighs {i * 7 % 11} grams." for i in range(12))

    def compare(results: list[client.Result], fields: dict[str, Any]) -> None:
        for r in results:
            assert r.metrics.method == "disaggregated", r.metrics
            assert r.metrics.kv_quant == fields.get("kv_quant"), fields
        # Each path was the one asked for: every layer in place, none on the copy path.
        assert (results[0].metrics.kv_inplace_layers or 0) > 0
        assert results[1].metrics.kv_inplace_layers == 0
        same_answer(*results)

    for fields in (
        {"codec": 1},
        {"codec": 2},
        {"codec": 2, "kv_quant": "int8"},
    ):
        results = []
        for agent in (inplace, copy):
            req = remote_request(prefill, prompt, 6, logprobs=True, prefix_cache=False, **fields)
            results.append(ask(agent, req))
        compare(results, fields)
    # Codec 0, then a decode-side prefix hit: each agent's first ask misses every cache
    # (a salt each, so neither sees the other's entries on either agent: the whole
    # prompt crosses, as with the cache off) and its second reuses the first's blocks.
    firsts, hits = [], []
    for agent, salt in ((inplace, "in-place"), (copy, "copy")):
        req = remote_request(prefill, prompt, 6, logprobs=True, codec=0, cache_salt=salt)
        first, second = ask(agent, req), ask(agent, req)
        assert (first.metrics.cached_tokens or 0) == 0 and (second.metrics.cached_tokens or 0) > 0
        assert first.metrics.prefill_cached_tokens in (0, None), first.metrics
        firsts.append(first)
        hits.append(second)  # (not bitwise the first: the prefill agent hit its cache too)
    compare(firsts, {"codec": 0})
    same_answer(*hits)
    assert hits[0].metrics.kv_raw_bytes == hits[1].metrics.kv_raw_bytes
