"""An embedding pipeline deployed beside the bed's fleet: one prefill agent on
dgx-spark-1 (its own ports and remote_dir, so the chat fleet's agents are
untouched), the tiny qwen3 that declares last-token pooling as Qwen3-Embedding
does, and a gateway in the ops namespace answering /api/embed and /v1/embeddings
with the values of a plain transformers forward; chat to it is a 400."""

from __future__ import annotations

import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from disagg_agents.models.pooling import pooling_of
from tests.references import hf_embedding
from tests.testbed.bed import ROOT, TestBed
from tests.testbed.conftest import REPO, FleetCli
from tests.tinymodels import shared_tiny

pytestmark = pytest.mark.testbed
HOST = "dgx-spark-1"
MODEL = "qwen3-embedding"
TEXTS = ["The capital of France is Paris.", "def add(a, b):"]

GATEWAY = """
import json, socket, sys, threading, time, urllib.error, urllib.request
import uvicorn
from disagg import Client
from disagg.frontends.app import create_app

app = create_app(Client(sys.argv[1]))
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
threading.Thread(target=server.run, daemon=True).start()
while not server.started:
    time.sleep(0.05)

def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=240) as r:
            return [r.status, json.loads(r.read())]
    except urllib.error.HTTPError as e:
        return [e.code, json.loads(e.read())]

def get(path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
        return [r.status, json.loads(r.read())]

texts = json.loads(sys.argv[2])
print(json.dumps({
    "ollama": post("/api/embed", {"model": sys.argv[3], "input": texts}),
    "openai": post("/v1/embeddings",
                   {"model": sys.argv[3], "input": texts, "encoding_format": "float"}),
    "chat": post("/v1/chat/completions",
                 {"model": sys.argv[3], "messages": [{"role": "user", "content": "hi"}]}),
    "show": post("/api/show", {"model": sys.argv[3]}),
    "view": get("/ui/api/state"),
}))
server.should_exit = True
"""


def embedding_inventory(bed: TestBed, model: Path) -> str:
    # Beside the chat fleet's prefill agent (~/.disagg, port 8000) on the same host.
    host = [f'python = "{sys.executable}"', 'remote_dir = "~/.disagg-embed"', 'service = "nohup"']
    return bed.embedding_inventory(HOST, MODEL, str(model), (8002, 8012), *host)


def test_embedding_pipeline_serves_embed_and_embeddings(
    testbed: TestBed, fleet_cli: FleetCli
) -> None:
    tiny = shared_tiny("qwen3")
    assert pooling_of(tiny) == "last"
    model = ROOT / "models" / "tiny-qwen3-embedding"
    if not model.exists():
        shutil.copytree(tiny, model)
        for p in [model, *model.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    inv = testbed.ops_dir / "embedding" / "inventory.toml"
    inv.parent.mkdir(exist_ok=True)
    inv.write_text(embedding_inventory(testbed, model))

    # The plain transformers references, in this process while the fleet commands and
    # the gateway (other processes) run: they waited for one another before.
    with ThreadPoolExecutor(1) as pool:
        refs_fut = pool.submit(lambda: [hf_embedding(tiny, t, "last") for t in TEXTS])
        dep = fleet_cli("deploy", "-i", str(inv), "--json")
        assert dep.returncode == 0, dep.stdout + dep.stderr
        started = fleet_cli("start", HOST, "-i", str(inv), timeout=400)
        try:
            assert started.returncode == 0, started.stdout + started.stderr
            assert started.stdout.count("started") == 1, started.stdout  # no decode agent
            proc = testbed.ops(
                sys.executable, "-c", GATEWAY, str(inv), json.dumps(TEXTS), MODEL,
                cwd=REPO, timeout=300,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-3000:]
            out = json.loads(proc.stdout.strip().splitlines()[-1])
        finally:
            fleet_cli("stop", "-i", str(inv))
        refs = refs_fut.result()

    status, ollama = out["ollama"]
    assert status == 200, ollama
    status, openai = out["openai"]
    assert status == 200, openai
    vectors = {
        "ollama": ollama["embeddings"],
        "openai": [d["embedding"] for d in openai["data"]],
    }
    for api, got in vectors.items():
        assert len(got) == len(TEXTS), api
        for v, (ref, _) in zip(got, refs, strict=True):
            assert len(v) == len(ref)
            assert max(abs(a - b) for a, b in zip(v, ref, strict=True)) < 1e-3, api
    assert ollama["prompt_eval_count"] == sum(n for _, n in refs)
    status, chat = out["chat"]
    assert status == 400 and "serves embeddings only" in chat["error"]["message"], chat
    status, show = out["show"]
    assert status == 200 and show["capabilities"] == ["embedding"], show
    status, view = out["view"]  # the web view marks the pipeline's agent
    rows = [a for a in view["agents"] if a["model"] == MODEL]
    assert status == 200 and rows and all(a["embedding_only"] for a in rows), view
