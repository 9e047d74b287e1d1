#!/usr/bin/env bash
# The checks a lent NVIDIA machine runs (docs/performance-prefill.md, "On a GPU"),
# within ~8 minutes: the Triton MoE kernels on CUDA against the reference; one MoE
# layer at the user's models' real shapes per path; a tile sweep printing the table
# it would pick; the whole prefill of every layer of both user models (random
# weights in the stored form, the Triton path) with each layer's K/V over TCP to
# the decode side, TTFT at 2k / 8k / 32k against `disagg plan`; gpt-oss attention.
# Nothing there reaches a package index or a hub: first run scripts/device-pack.sh
# here, then carry .whl and .devkit.
# Run from the repo root: OUT=dir bash scripts/device-cuda.sh
# `--cpu-smoke`: every piece that can, at tiny shapes on this machine's CPU (the
# kernels interpreted), in seconds: what CI runs (tests/test_device_script.py).
set -u -o pipefail
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
if [ "${1:-}" = "--cpu-smoke" ]; then
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
  echo "== cpu smoke: the whole path at tiny shapes"
  timeout 240 python3 -m disagg.bench.wholepath --cpu-smoke --json | tee "$OUT/wholepath.jsonl" \
    || exit 1
  echo "== cpu smoke: the tile sweep"
  timeout 120 python3 -m disagg.bench.tilesweep --cpu-smoke | tee "$OUT/tiles.txt" || exit 1
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DISAGG_CACHE=/tmp/dcache \
  TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'capability', torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/machine.txt"

echo "== the kernels on CUDA against dequantize-then-matmul (tests/test_moe_triton.py, unit part)"
timeout 90 python3 -m pytest -q -p no:cacheprovider --noconftest -o addopts="" \
  -m "not slow" tests/test_moe_triton.py 2>&1 | tee "$OUT/pytest.log" | tail -8

echo "== one MoE layer at the real shapes, per path (sync debug mode: error)"
timeout 70 python3 -m disagg.bench.moelayer --paths triton grouped --json \
  >"$OUT/moelayer.jsonl" 2>"$OUT/moelayer.err"
echo "moelayer rc=$?"; tail -3 "$OUT/moelayer.err"
python3 - "$OUT/moelayer.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "path" not in r:
        print(r); continue
    if r["error"]:
        print(f"{r['shape']:18} {r['path']:8} {r['tokens']:6} {r['error']}"); continue
    err = f" err {r['rel_err']:.1e}" if r["rel_err"] is not None else ""
    print(f"{r['shape']:18} {r['path']:8} {r['tokens']:6} {r['ms']:9.2f} ms {r['tok_s']:9.0f} tok/s "
          f"{r['tflops']:6.1f} TFLOP/s {r['gb_s']:6.0f} GB/s{err}")
PY

echo "== tile sweep: the table it would pick (16 / 512 / 2k / 8k tokens)"
timeout 100 python3 -m disagg.bench.tilesweep --json 2>"$OUT/tiles.err" | tee "$OUT/tiles.txt" \
  | grep -v '^{'

echo "== the whole prefill, every layer, K/V over TCP, TTFT against disagg plan"
timeout 150 python3 -m disagg.bench.wholepath --json 2>"$OUT/wholepath.err" \
  | tee "$OUT/wholepath.jsonl"
tail -3 "$OUT/wholepath.err"

echo "== attention on CUDA: equal to eager, peak memory linear (tests/test_prefill_attention.py)"
timeout 40 python3 -m pytest -q -p no:cacheprovider --noconftest -o addopts="" -k cuda \
  tests/test_prefill_attention.py 2>&1 | tee "$OUT/pytest-attention.log" | tail -3

echo "== gpt-oss attention: fused SDPA vs eager, time and memory per layer"
timeout 50 python3 -m disagg.bench.attention 2>"$OUT/attention.err" | tee "$OUT/attention.jsonl"
tail -2 "$OUT/attention.err"
