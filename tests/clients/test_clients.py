"""Real load-testing clients, unchanged, against `kvdeck serve`: GuideLLM 0.8.1 and NVIDIA
AIPerf 0.13, each with its default settings for its OpenAI chat backend (streaming, content
as text parts, `max_completion_tokens`), in its own virtual environment.

`make clients` builds the environments (GuideLLM brings PyTorch and transformers; AIPerf
needs Python 3.11 or newer), writes the Gemma 3 tokenizer the clients count tokens with from
the embedded GGUF (no hub download), and runs this module. Without those environments the
module is skipped: they take minutes and gigabytes to build, too much for every CI run.

The server is the simulated card with Gemma 3's tokenizer: answers are real text read from a
built-in passage, so a client that re-tokenizes them counts exactly what was generated.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from kvdeck.runtime.runs.attach import parse_metrics
from tests.servers import sim_process

REPO = Path(__file__).resolve().parents[2]
CLIENTS = Path(os.environ.get("KVDECK_CLIENTS_DIR", REPO / ".venv-clients"))
TOKENIZER = CLIENTS / "gemma3-270m-tokenizer"
GUIDELLM = CLIENTS / "guidellm" / "bin" / "guidellm"
AIPERF = CLIENTS / "aiperf" / "bin" / "aiperf"
MODEL = "qwen3-8b"
REQUESTS, OUTPUT_TOKENS = 8, 16

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (GUIDELLM.exists() and AIPERF.exists() and TOKENIZER.exists()),
                       reason="the client environments are not built; run `make clients`"),
]


@pytest.fixture(scope="module")
def server():
    with sim_process("--tokenizer", "gemma3-270m") as srv:
        yield srv


def run(cmd: list, cwd: Path) -> subprocess.CompletedProcess:
    # (Not HF_HUB_OFFLINE: AIPerf then refuses a local tokenizer path as a bad repo id.)
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


def generation_tokens(server) -> float:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    status = parse_metrics(text)
    assert status.engine == "kvdeck"
    line = next(x for x in text.splitlines() if x.startswith("vllm:generation_tokens_total"))
    return float(line.split()[-1])


def test_guidellm_chat_defaults(server, tmp_path: Path) -> None:
    before = generation_tokens(server)
    run([GUIDELLM, "run", "--backend", f"kind=openai_http,target={server.url[:-3]}",
         "--profile", "kind=concurrent,streams=4",
         "--data", f"kind=synthetic_text,prompt_tokens=100,output_tokens={OUTPUT_TOKENS}",
         "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--tokenizer", f"kind=huggingface_auto,model={TOKENIZER}",
         "--output", f"kind=json,path={tmp_path / 'guidellm.json'}", "--disable-progress"],
        tmp_path)
    report = json.loads((tmp_path / "guidellm.json").read_text())
    requests = report["benchmarks"][0]["requests"]
    assert len(requests["successful"]) == REQUESTS and not requests["errored"]
    for r in requests["successful"]:
        body = json.loads(r["request_args"])["body"]
        # GuideLLM's chat default: content as text parts, max_completion_tokens.
        assert isinstance(body["messages"][0]["content"], list)
        assert body["max_completion_tokens"] == OUTPUT_TOKENS
        assert r["output_tokens"] == OUTPUT_TOKENS  # its own count of the text it received
    assert generation_tokens(server) - before == REQUESTS * OUTPUT_TOKENS


def aiperf(server, tmp_path: Path, *extra: str) -> dict:
    run([AIPERF, "profile", "--model", MODEL, "--url", server.url[:-3],
         "--endpoint-type", "chat", "--streaming", "--tokenizer", TOKENIZER,
         "--request-count", str(REQUESTS), "--concurrency", "4",
         "--osl", str(OUTPUT_TOKENS), "--isl", "100", "--artifact-dir", tmp_path, *extra],
        tmp_path)
    (export,) = tmp_path.glob("**/profile_export_aiperf.json")
    return json.loads(export.read_text())


def test_aiperf_chat_defaults(server, tmp_path: Path) -> None:
    before = generation_tokens(server)
    d = aiperf(server, tmp_path)
    assert d["request_count"]["avg"] == REQUESTS and not d["error_summary"]
    osl = d["output_sequence_length"]
    assert osl["min"] == osl["max"] == OUTPUT_TOKENS  # its own count equals what it asked
    assert d["osl_mismatch_count"]["avg"] == 0
    assert "usage_prompt_cache_read_tokens" in d  # kvdeck reports cached_tokens
    assert generation_tokens(server) - before == REQUESTS * OUTPUT_TOKENS


def test_aiperf_prompt_cache_metrics_with_a_shared_system_prompt(server, tmp_path) -> None:
    d = aiperf(server, tmp_path, "--shared-system-prompt-length", "256")
    # Every request after the first reads the shared system prompt from the prefix cache.
    assert d["total_usage_prompt_cache_read_tokens"]["avg"] >= (REQUESTS - 4) * 240
    assert d["overall_usage_prompt_cache_read_pct"]["avg"] > 50
