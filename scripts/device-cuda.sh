#!/usr/bin/env bash
# The checks a lent NVIDIA machine runs (docs/performance.md, "On an NVIDIA GPU"): the prefill
# agent on CUDA, the decode agent on mlx (CPU there), parity against monolithic
# references and the speed figures. Nothing there reaches a package index or a hub,
# so the caller carries:
#   .whl/    mlx, mlx-cpu, mlx-lm, zstandard wheels for its Python (3.12)
#   .devkit/ the embedded default's tokenizer files (the weights are made there)
# Run from the repo root: OUT=dir bash scripts/device-cuda.sh
set -u -o pipefail
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DISAGG_CACHE=/tmp/dcache \
  TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  python3 -c "import torch, transformers, numpy, mlx.core as mx, mlx_lm; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'numpy', numpy.__version__, 'mlx', mx.__version__, mx.default_device(), 'mlx-lm', mlx_lm.__version__)"
} 2>&1 | tee "$OUT/machine.txt"

echo "== parity: prefill agent on CUDA against monolithic transformers and mlx-lm"
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra --durations=8" \
  tests/test_cuda.py tests/test_agents_tiny.py tests/test_chatformat_agents.py tests/test_load_batch.py \
  tests/test_quant_models.py -k "not smol and not memory" 2>&1 | tee "$OUT/pytest.log" | tail -25

echo "== a random SmolLM2-360M-shaped checkpoint, and mlx_lm.convert's 4-bit of it"
python3 -m disagg.bench.randommodel /tmp/r360 --tokenizer .devkit >/dev/null 2>&1 || exit 1
python3 -m mlx_lm convert --hf-path /tmp/r360 --mlx-path /tmp/r360-q4 -q >/dev/null 2>&1 || exit 1

echo "== prefill on CUDA: fp32, bf16, packed 4-bit (2000 tokens)"
{
  timeout 60 python3 -m disagg.bench.gpuprefill /tmp/r360 /tmp/r360-q4
  timeout 40 python3 -m disagg.bench.gpuprefill /tmp/r360 --dtype bfloat16
} 2>"$OUT/gpuprefill.err" | tee "$OUT/gpuprefill.jsonl"

echo "== disagg bench: TTFT against transformers on the same GPU, decode against mlx-lm"
timeout 170 python3 -m disagg.cli bench --local --model /tmp/r360 --json \
  >"$OUT/core-r360.json" 2>"$OUT/core-r360.err"
echo "bench rc=$?"; tail -3 "$OUT/core-r360.err"
python3 - "$OUT/core-r360.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print({k: d["machine"].get(k) for k in ("prefill_device", "decode_device", "decode_blas")})
for part in ("decode", "ttft"):
    print(part, {k: v for k, v in d[part].items() if not isinstance(v, (list, dict))})
PY
