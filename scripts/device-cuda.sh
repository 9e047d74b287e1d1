#!/usr/bin/env bash
# The checks a lent NVIDIA machine runs (docs/performance-prefill.md, "On a GPU"):
# the Triton MoE kernels on CUDA against the reference, one MoE layer at the user's
# models' real shapes per kernel path, and a dense prefill timed with no host sync
# in its forward. Nothing there reaches a package index or a hub: first run
# scripts/device-pack.sh here, then carry .whl and .devkit.
# Run from the repo root: OUT=dir bash scripts/device-cuda.sh   (~4 min on an H100)
set -u -o pipefail
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DISAGG_CACHE=/tmp/dcache \
  TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'capability', torch.cuda.get_device_capability())"
} 2>&1 | tee "$OUT/machine.txt"

echo "== the kernels on CUDA against dequantize-then-matmul (tests/test_moe_triton.py, unit part)"
timeout 150 python3 -m pytest -q -p no:cacheprovider --noconftest -o addopts="" \
  -m "not slow" tests/test_moe_triton.py 2>&1 | tee "$OUT/pytest.log" | tail -8

echo "== one MoE layer at the real shapes, per path (sync debug mode: error)"
timeout 200 python3 -m disagg.bench.moelayer --json >"$OUT/moelayer.jsonl" 2>"$OUT/moelayer.err"
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

echo "== a dense prefill (random SmolLM2-360M shape), bf16, 2000 tokens, forward under sync error mode"
python3 -m disagg.bench.randommodel /tmp/r360 --tokenizer .devkit >/dev/null 2>"$OUT/randommodel.err" || tail -3 "$OUT/randommodel.err"
timeout 60 python3 -m disagg.bench.gpuprefill /tmp/r360 --dtype bfloat16 --sync-check \
  2>"$OUT/gpuprefill.err" | tee "$OUT/gpuprefill.jsonl"
tail -2 "$OUT/gpuprefill.err"

echo "== triton tile sizes at 8192 tokens (bm,bn,bk,warps,stages)"
for tiles in 64,128,64,8,3 128,128,64,8,3 64,64,128,4,3; do
  DISAGG_MOE_TILES=$tiles timeout 60 python3 -m disagg.bench.moelayer --paths triton \
    --tokens 8192 --shapes qwen3-coder-4bit gpt-oss-mxfp4 --json 2>>"$OUT/tiles.err" \
    | sed "s/^/$tiles /" | tee -a "$OUT/tiles.txt" | grep -o '"shape".*"gb_s": [0-9.]*'
done

echo "== gpt-oss attention on CUDA: equal to eager, peak memory linear (tests/test_prefill_attention.py)"
timeout 90 python3 -m pytest -q -p no:cacheprovider --noconftest -o addopts="" -k cuda \
  tests/test_prefill_attention.py 2>&1 | tee "$OUT/pytest-attention.log" | tail -3

echo "== gpt-oss attention: chunked SDPA vs eager, time and memory per layer"
timeout 120 python3 -m disagg.bench.attention 2>"$OUT/attention.err" | tee "$OUT/attention.jsonl"
tail -2 "$OUT/attention.err"
