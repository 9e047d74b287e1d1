"""The whole prefill path at the user's shapes, on the machine it runs on: every
layer of each user model (random weights in the stored form), the prefill agent's
own engine on its default MoE path (the fused Triton kernels on CUDA), and the
K/V of every layer over TCP to the decode side, timed to the logits' arrival (the
first token is sampled from them) against `disagg plan`'s prediction.

Disk: one layer is written (disagg.bench.synthmodels); every layer reads layer 0's
tensors from it (each read is a fresh tensor, so memory holds the whole model,
~17 GB and ~61 GB packed). The decode side is the decode agent's wire reader (its
frames decoded into numpy): mlx does not run on a CUDA machine.

Run (a CUDA machine): python -m disagg.bench.wholepath [--tokens 2048 8192 32768] [--json]
`--cpu-smoke`: both models cut to tiny dims on the CPU, the kernels interpreted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from disagg.bench import synthmodels
from disagg.bench.synthmodels import TINY, VOCAB, WRITERS

MODELS = tuple(WRITERS)
LAYERS = {"qwen3-coder-30b-a3b": 48, "gpt-oss-120b": 36}
CONFIGS = {
    "qwen3-coder-30b-a3b": synthmodels.qwen3_coder_config,
    "gpt-oss-120b": synthmodels.gpt_oss_120b_config,
}
# The cost model's device for a CUDA capability (None: no prediction for it).
PLAN_DEVICES = {(9, 0): "h200", (12, 1): "gb10"}


def write_one_layer(model: str, dst: Path, layers: int, tiny: bool) -> Path:
    """`model`'s dir with one layer's tensors on disk and a config of `layers` layers."""
    WRITERS[model](dst, 1, VOCAB, tiny)
    cfg = {**CONFIGS[model](layers, VOCAB), **(TINY[model] if tiny else {})}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


@contextlib.contextmanager
def layers_from_layer_zero() -> Iterator[None]:
    """While active, the packed loader reads `model.layers.N.*` from layer 0's entry."""
    from disagg_agents.quant import loader

    base = loader.Checkpoint

    class Aliased(base):  # type: ignore[misc, valid-type]
        def __init__(self, model_dir: Path) -> None:
            super().__init__(model_dir)
            cfg = json.loads((model_dir / "config.json").read_text())
            zero = [n for n in self.where if n.startswith("model.layers.0.")]
            for i in range(1, int(cfg["num_hidden_layers"])):
                for n in zero:
                    self.where[f"model.layers.{i}." + n[len("model.layers.0.") :]] = self.where[n]

    loader.Checkpoint = Aliased  # type: ignore[misc]
    try:
        yield
    finally:
        loader.Checkpoint = base  # type: ignore[misc]


def serve(agent: Any) -> tuple[int, socket.socket]:
    """The prefill agent's connection handler on a TCP port of this machine."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def loop() -> None:
        while True:
            try:
                conn, addr = lsock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=agent.handle, args=(conn, str(addr)), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return lsock.getsockname()[1], lsock


def fetch(port: int, fingerprint: dict[str, Any], model: str, ids: list[int]) -> dict[str, Any]:
    """One PREFILL over TCP as the decode agent sends it; every layer's K/V read and
    decoded as its reader does. Times from the PREFILL to the logits."""
    from disagg_agents.wire.channel import FrameReader, recv_json, send_json
    from disagg_agents.wire.frames import Frame, error_from
    from disagg_agents.wire.kvcodec import decode_layer
    from disagg_agents.wire.request import PrefillRequest

    with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_json(sock, Frame.HELLO, {"role": "decode", "fingerprint": fingerprint, "model": model})
        recv_json(sock, Frame.HELLO_OK)
        t0 = time.perf_counter()
        send_json(sock, Frame.PREFILL, PrefillRequest(ids, prefix_cache=False).to_wire())
        reader = FrameReader(sock, 1 << 31)
        layers, kv_bytes, first, logits_at = 0, 0, None, None
        while True:
            header, payload = reader.read()
            if header.type == Frame.KV_LAYER:
                kv = decode_layer(payload)
                layers, kv_bytes = layers + 1, kv_bytes + kv.keys.nbytes + kv.values.nbytes
                first = first or time.perf_counter() - t0
            elif header.type == Frame.LOGITS:
                logits_at = time.perf_counter() - t0
            elif header.type == Frame.ERROR:
                raise error_from(header, payload)
            elif header.type == Frame.PREFILL_DONE:
                break
    return {"layers": layers, "kv_bytes": kv_bytes, "first_layer_s": first, "ttft_s": logits_at}


def predicted_s(model: str, tokens: int, device: str | None) -> float | None:
    """`disagg plan`'s prefill time on this device (the fused path), if it models it."""
    from disagg.bench.costmodel import SHAPES
    from disagg_agents.models.cost import prefill_terms

    if device is None:
        return None
    return float(prefill_terms(SHAPES[model], tokens, device, "triton")["total_s"])


def run_model(model: str, tokens: list[int], device: str, tiny: bool) -> list[dict[str, Any]]:
    import torch

    from disagg_agents.prefill.agent import PrefillAgent
    from disagg_agents.prefill.engine import PrefillEngine

    layers = 2 if tiny else LAYERS[model]
    # Tiny dims have no prediction of their own: the smoke asks the real shape's on the
    # Spark, to run that code too, and compares nothing.
    plan_device = "gb10" if tiny else None
    if device.startswith("cuda"):
        plan_device = PLAN_DEVICES.get(torch.cuda.get_device_capability(0))
    with tempfile.TemporaryDirectory() as tmp, layers_from_layer_zero():
        d = write_one_layer(model, Path(tmp) / model, layers, tiny)
        t0 = time.perf_counter()
        dtype = "float32" if tiny else "bfloat16"  # the interpreter's bf16 is wrong
        eng = PrefillEngine(str(d), device=device, dtype=dtype, dequant_budget_gb=0.0)
        load_s = time.perf_counter() - t0
    agent = PrefillAgent(eng, "wholepath")
    port, lsock = serve(agent)
    paths = sorted({p.path for p in eng.moe_paths})
    rows = []
    try:
        # Warm-up: one prompt per band of the tile table (moetiles.band: < 16, < 64,
        # more rows per expert), so no timed prompt pays a kernel compile.
        for n in (8,) if tiny else (8, 512, 2048):
            fetch(port, eng.fingerprint, eng.model_dir, list(range(1, n + 1)))
        for n in tokens:
            ids = [(i * 7919 + 13) % VOCAB for i in range(n)]
            got = fetch(port, eng.fingerprint, eng.model_dir, ids)
            pred = predicted_s(model, n, plan_device)
            rows.append({
                "model": model, "layers": layers, "tokens": n, "device": device,
                "moe_paths": paths, "load_s": round(load_s, 2), **got,
                "predicted_s": pred,
                "measured_over_predicted": got["ttft_s"] / pred if pred and not tiny else None,
            })  # fmt: skip
    finally:
        lsock.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[2048, 8192, 32768])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny dims on the CPU, in seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device = "cuda"
    if args.cpu_smoke:  # the fused kernels too: interpreted (before they are imported)
        os.environ["TRITON_INTERPRET"], os.environ["DISAGG_MOE_GEMM"] = "1", "triton"
        device, args.tokens = "cpu", [24]
    else:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("disagg.bench.wholepath needs a CUDA device (or --cpu-smoke)")
    for model in args.models:
        for r in run_model(model, args.tokens, device, args.cpu_smoke):
            if args.json:
                print(json.dumps(r), flush=True)
                continue
            pred = f"{r['predicted_s']:.3f} s" if r["predicted_s"] else "no prediction"
            print(f"{model:20} {r['layers']:3} layers {r['tokens']:6} tokens "
                  f"TTFT {r['ttft_s']:.3f} s (plan {pred}) first layer {r['first_layer_s']:.3f} s "
                  f"{r['kv_bytes'] / 1e6:.2f} MB K/V, MoE {'/'.join(r['moe_paths'])}")  # fmt: skip


if __name__ == "__main__":
    main()
