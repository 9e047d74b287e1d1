"""Why gptoss-hf-mxfp4 parity failed with the prefill agent on CUDA: the reference's
own margins, and transformers' greedy on CPU vs CUDA (same dequantized weights)."""
import json
import torch
from transformers import AutoModelForCausalLM, Mxfp4Config
from tests.quantmodels import quant_dir
from tests.references import hf_greedy, tokenizer_ids
from tests.tinymodels import PROMPT
from tests.test_quant_models import N_NEW

d = quant_dir("gptoss-hf-mxfp4")
ids = tokenizer_ids(d, " ".join([PROMPT] * 2), raw=True)
out = {}
for dev in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)).to(dev).eval()
    toks = hf_greedy(m, ids, N_NEW) if dev == "cpu" else []
    if dev == "cuda":
        with torch.inference_mode():
            seq = list(ids); toks = []
            for _ in range(N_NEW):
                lg = m(torch.tensor([seq], device=dev)).logits[0, -1].float()
                toks.append(int(lg.argmax())); seq.append(toks[-1])
    with torch.inference_mode():
        seq = ids + toks
        lg = m(torch.tensor([seq], device=dev)).logits[0, len(ids) - 1 :].float()
        top = lg.topk(2, dim=-1).values
        margins = (top[:, 0] - top[:, 1]).tolist()
    out[dev] = {"tokens": toks, "min_margin": min(margins[:N_NEW]), "margins": [round(x, 4) for x in margins[:N_NEW]]}
print(json.dumps(out))

# The asynchronous device-to-host copy hands over the same bytes as the synchronous one.
if torch.cuda.is_available():
    import numpy as np
    from agents.prefill import PrefillEngine
    from tests.tinymodels import make_tiny
    import tempfile, pathlib
    checks = {}
    tiny = make_tiny("qwen3", pathlib.Path(tempfile.mkdtemp()) / "q", seed=1)
    for path in (d, tiny):
        for dtype in ("float32", "bfloat16"):
            eng = PrefillEngine(str(path), device="cuda", dtype=dtype)
            runs = {}
            for overlap in (False, True):
                got = []
                eng.prefill(list(ids) * 3, got.append, host_async=overlap)
                for kv in got:
                    kv.wait()
                runs[overlap] = got
            same = all(np.array_equal(a.keys, b.keys) and np.array_equal(a.values, b.values) and a.keys.dtype == b.keys.dtype
                       for a, b in zip(runs[False], runs[True], strict=True))
            checks[f"{path.name}-{dtype}"] = {"layers": len(runs[True]), "bit_identical": same}
    print(json.dumps({"async_copy": checks}))
