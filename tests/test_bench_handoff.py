"""The wire bench's receiver into mlx caches (disagg.bench.handoffmlx) gets every
layer bit for bit, as the decode agent would: in place (every layer taken in
place) and by the copy path, fp32 and bf16, every codec. A real receiving
process and a real socket; the expected bytes are the sender's arrays hashed here."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from mlx_lm.models.cache import KVCache

from disagg.bench.handoff import Receiver
from disagg_agents.decode.kvfetch import Into, receive_layers
from disagg_agents.decode.kvslots import allocate
from disagg_agents.wire.channel import recv_json, send_frame
from disagg_agents.wire.frames import Frame, ProtocolError
from disagg_agents.wire.kvcodec import Codec, DType, Kind, LayerKV, encode_layer
from disagg_agents.wire.request import PrefillRequest
from tests.conftest import socket_pair

LAYERS, HEADS, SEQ, DIM = 5, 3, 37, 16


def layers_of(dtype: str) -> list[LayerKV]:
    """[H, S, D] per layer as the prefill's torch computes them (bf16: torch's
    own cast, its 16-bit words on the wire), with -0.0 and extremes in."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(LAYERS):
        kv = []
        for scale in (3.0, 1e-5):
            t = torch.randn(HEADS, SEQ, DIM, generator=g) * scale
            t[0, 0, :3] = torch.tensor([-0.0, 3e38, -3e38])
            if dtype == "bfloat16":
                kv.append(t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
            else:
                kv.append(t.numpy())
        wire = DType.BFLOAT16 if dtype == "bfloat16" else DType.FLOAT32
        out.append(LayerKV(i, Kind.FULL, wire, kv[0], kv[1]))
    return out


def sha(layers: list[LayerKV]) -> str:
    h = hashlib.sha256()
    for kv in layers:
        h.update(kv.keys.tobytes())
        h.update(kv.values.tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def rx() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("codec", list(Codec))
def test_into_mlx_in_place_is_bit_exact(rx: Receiver, dtype: str, codec: Codec) -> None:
    layers = layers_of(dtype)
    secs, wire_bytes, got = rx.into_mlx(layers, inplace=True, codec=codec, verify=True)
    assert got["digest"] == sha(layers)
    assert got["placed"] == LAYERS  # every layer in place, none by the copy path
    assert secs > 0 and got["alloc_s"] > 0
    if codec == Codec.RAW:  # K/V plus a 16-byte frame header and the layer header each
        assert wire_bytes > sum(kv.keys.nbytes + kv.values.nbytes for kv in layers)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_into_mlx_copy_path_is_bit_exact(rx: Receiver, dtype: str) -> None:
    layers = layers_of(dtype)
    _, _, got = rx.into_mlx(layers, inplace=False, verify=True)
    assert got["digest"] == sha(layers)
    assert got["placed"] == 0


def test_a_wrong_byte_changes_the_digest(rx: Receiver) -> None:
    """The receiver's digest reads the caches: a flipped bit in what is sent shows."""
    layers = layers_of("bfloat16")
    want = sha(layers)
    layers[2].values[1, 5, 3] ^= 1
    _, _, got = rx.into_mlx(layers, inplace=True, verify=True)
    assert got["digest"] == sha(layers) != want


def test_a_whole_layer_header_on_a_longer_frame_is_refused() -> None:
    """The fast path knows a whole raw layer by its layer header; a frame that
    carries that header but more bytes goes to the checks and is refused."""
    layers = layers_of("float32")
    ours, theirs = socket_pair()

    def prefill() -> None:
        recv_json(theirs, Frame.PREFILL)
        parts = encode_layer(layers[0])
        send_frame(theirs, Frame.KV_LAYER, [*parts, bytes(8)])

    t = threading.Thread(target=prefill)
    t.start()
    caches = [KVCache() for _ in range(LAYERS)]
    slots = allocate(caches, SEQ, "float32", HEADS, DIM)
    fp = {"num_kv_heads": HEADS, "head_dim": DIM}
    request = PrefillRequest(list(range(SEQ)))
    try:
        with pytest.raises(ProtocolError):
            receive_layers(
                ours, request, Into(caches, lambda *a: None, None, lambda: slots), fp, None
            )
    finally:
        t.join(10)
        ours.close()
        theirs.close()
    assert not slots.placed
