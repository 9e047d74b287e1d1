#!/usr/bin/env bash
# Here, on a machine that reaches a package index: make what scripts/device-cuda.sh
# carries to a CUDA machine that reaches nothing (both folders git-ignored locally):
#   .whl/     wheels the CUDA image lacks or has at another version, for its Python 3.12
#   .devkit/  the embedded default's tokenizer files (random weights are made there)
# Then: the device tool runs `OUT=dir bash scripts/device-cuda.sh` carrying .whl and .devkit.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in /.whl/ /.devkit/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
rm -rf .whl .devkit && mkdir -p .whl .devkit
# The versions this checkout is tested with (pip here); the image has torch and triton.
want=$(python -m pip list --format=freeze 2>/dev/null | grep -iE '^(zstandard|transformers)==')
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $want
python - <<'PY'
import shutil
from pathlib import Path
from disagg.bench.randommodel import TOKENIZER_FILES
from disagg.serving.defaultmodel import ensure_default_model
src = ensure_default_model()
for name in TOKENIZER_FILES:
    if (src / name).is_file():
        shutil.copy(src / name, Path(".devkit") / name)
PY
du -sh .whl .devkit
