"""What sealing the frames (disagg_agents.wire INTEGRITY "mac") costs a K/V handoff.

The same KV_LAYER frames through a real loopback TCP connection, authenticated
both ways, once bare ("none") and once sealed ("mac"): the receiver reads each
frame as disagg_agents.decode.kvfetch does (FrameReader; sealed, the tag is checked before the
payload is handed on). The figure that decides (sealing may add at most 5 % at
10 Gbit/s) is the receiver's check on the critical path: the tag rate measured
here against the time the same bytes take on a 10 Gbit/s wire.

Run: python -m disagg.bench.integrity [--layer-mb 8 --layers 48]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
import time
from typing import Any

from rich.table import Table

from disagg.bench.common import num, table
from disagg_agents.wire.auth import client_auth, server_auth
from disagg_agents.wire.channel import FrameReader, send_frame
from disagg_agents.wire.frames import Frame

LINK_BYTES_PER_S = 10e9 / 8  # 10 Gbit/s


def _transfer(integrity: str, layer: bytes, layers: int) -> float:
    """Seconds from the first frame sent to the last one checked and read."""
    token = secrets.token_hex(32).encode()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    took: list[float] = []

    def receive() -> None:
        conn, _ = listener.accept()
        with conn:
            server_auth(conn, token)
            reader = FrameReader(conn)
            reader.read()  # the start mark
            t0 = time.perf_counter()
            for _ in range(layers):
                reader.read()
            took.append(time.perf_counter() - t0)
            conn.sendall(b"k")

    t = threading.Thread(target=receive)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as s:
        client_auth(s, token, integrity)
        send_frame(s, Frame.KV_LAYER, b"start")
        for _ in range(layers):
            send_frame(s, Frame.KV_LAYER, layer)
        s.recv(1)
    t.join()
    listener.close()
    return took[0]


def tag_rate(nbytes: int = 64 << 20) -> float:
    """Bytes per second one core tags (HMAC-SHA256, as Seal does)."""
    buf = os.urandom(nbytes)
    t0 = time.perf_counter()
    hmac.new(b"k" * 32, buf, hashlib.sha256).digest()
    return nbytes / (time.perf_counter() - t0)


def measure(layer_mb: float = 8.0, layers: int = 48, repeats: int = 3) -> dict[str, Any]:
    """Defaults: Qwen3-30B-A3B's K/V for a 4k-token prompt (48 layers x 8 MiB, bf16)."""
    layer = os.urandom(int(layer_mb * (1 << 20)))
    total = len(layer) * layers
    bare = min(_transfer("none", layer, layers) for _ in range(repeats))
    sealed = min(_transfer("mac", layer, layers) for _ in range(repeats))
    rate = max(tag_rate() for _ in range(repeats))
    wire_s = total / LINK_BYTES_PER_S
    return {
        "kv_bytes": total,
        "loopback_none_s": bare,
        "loopback_mac_s": sealed,
        "tag_rate_gb_s": rate / 1e9,
        "wire_10gbit_s": wire_s,
        # The receiver checks each frame after it arrived: that time adds to the wire's.
        "mac_added_at_10gbit_pct": 100 * (total / rate) / wire_s,
    }


def integrity_table(r: dict[str, Any]) -> Table:
    """Render `measure`'s result."""
    t = table(
        f"sealed frames (mac) vs bare: {r['kv_bytes'] / 1e6:,.0f} MB of K/V on loopback",
        ("figure", "value"),
        left=("figure",),
    )
    t.add_row("loopback, bare", num(r["loopback_none_s"], "s"))
    t.add_row("loopback, sealed", num(r["loopback_mac_s"], "s"))
    t.add_row("one core tags", f"{r['tag_rate_gb_s']:.2f} GB/s")
    t.add_row("the same bytes at 10 Gbit/s", num(r["wire_10gbit_s"], "s"))
    t.add_row("the check added at 10 Gbit/s", f"{r['mac_added_at_10gbit_pct']:.1f} %")
    return t


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m disagg.bench.integrity")
    p.add_argument("--layer-mb", type=float, default=8.0)
    p.add_argument("--layers", type=int, default=48)
    args = p.parse_args()
    print(json.dumps(measure(args.layer_mb, args.layers), indent=1))


if __name__ == "__main__":
    main()
