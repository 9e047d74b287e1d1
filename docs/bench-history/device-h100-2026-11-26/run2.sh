set -u -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DISAGG_CACHE=/tmp/dcache TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
echo "== diag"
timeout 80 python3 .devkit/diag.py 2>"$OUT/diag.err" | tee "$OUT/diag.jsonl" | cut -c1-400
echo "== the failing test"
timeout 50 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" --tb=short "tests/test_quant_models.py::test_agents_on_one_quantized_dir_match_an_independent_reference[gptoss-hf-mxfp4]" >"$OUT/fail.log" 2>&1; tail -12 "$OUT/fail.log" | cut -c1-300
echo "== parity with the asynchronous copy"
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra --durations=5" tests/test_agents_tiny.py tests/test_quant_models.py -k "moe-affine4 and agents or tiny" >"$OUT/pytest.log" 2>&1; tail -15 "$OUT/pytest.log"
echo "== bench"
python3 -m disagg.bench.randommodel /tmp/r360 --tokenizer .devkit >/dev/null 2>&1 || exit 1
timeout 100 python3 -m disagg.cli bench --local --model /tmp/r360 --json >"$OUT/core-r360.json" 2>"$OUT/core-r360.err"; echo "bench rc=$?"
python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); t=d['ttft']
print({k:v for k,v in t.items() if not isinstance(v,(list,dict))}); print(t['disagg_ttft_s'], t['transformers_prefill_s']); print(t['breakdown'])
print({k:v for k,v in d['decode'].items() if not isinstance(v,(list,dict))})" "$OUT/core-r360.json"
