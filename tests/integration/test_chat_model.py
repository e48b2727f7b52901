"""Chat that answers: an instruct model (Qwen2.5-Coder-0.5B-Instruct, chat template in its
GGUF) answers in the console's prompt panel and through the API; the embedded Gemma 3 270M
has no chat template, is reported as a base model, and the prompt panel runs it as a plain
completion and says so."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from openai import OpenAI

from kvdeck.console.app import KvdeckApp
from kvdeck.console.widgets.prompt import COMPLETION_MAX_TOKENS
from kvdeck.runtime.core.config import EngineConfig
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.executors.torch import TorchExecutor
from kvdeck.runtime.text.tokenizer import Tokenizer
from kvdeck.runtime.views.snapshot import snapshot_of
from tests.servers import serve_process
from tests.ui.panel_text import panel_text

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France? Answer with one word."


def test_models_says_base_or_instruct(chat_model_path, gemma_path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", "models", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    kinds = {e["name"]: e["kind"] for e in json.loads(r.stdout)}
    assert kinds["gemma3-270m"] == "base" and kinds["qwen2.5-coder-0.5b"] == "instruct"
    r = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", "models", "gemma3-270m"],
                       capture_output=True, text=True, timeout=120)
    assert "base: no chat template" in r.stdout


async def run_prompt(path, text: str) -> tuple[KvdeckApp, str, object]:
    tokenizer = Tokenizer(path)
    engine = Engine(EngineConfig(kv_memory_bytes=64 << 20),
                    TorchExecutor(path, device="cpu", dtype="fp32"), tokenizer=tokenizer)
    app = KvdeckApp(engine, autostart=False, hardware=False)
    async with app.run_test(size=(160, 48)) as pilot:
        rid = app.submit_prompt(text)
        engine.step()  # takes the prompt from the inbox
        req = engine.find(rid)
        while not req.status.is_finished:
            engine.step()
        app.render_snapshot(snapshot_of(engine))
        await pilot.pause()
        shown = panel_text(app.query_one("#prompt-output")) + \
            str(app.query_one("#prompt-input").placeholder)
    engine.close()
    return app, shown, req


async def test_an_instruct_model_answers_in_the_prompt_panel(chat_model_path) -> None:
    _, shown, req = await run_prompt(chat_model_path, QUESTION)
    assert "Paris" in req.output_text
    assert req.status.value == "finished_stopped"  # the end of its turn, not the token limit
    assert "instruct model: asked as a chat" in shown and "Paris" in shown


async def test_a_base_model_runs_a_plain_completion_and_says_so(gemma_path) -> None:
    text = "The capital of France is"
    _, shown, req = await run_prompt(gemma_path, text)
    tokenizer = Tokenizer(gemma_path)
    assert req.prompt_token_ids == tokenizer.encode(text)  # no chat template around it
    assert req.num_output_tokens == COMPLETION_MAX_TOKENS
    assert "base model (no chat template): the text is continued" in shown
    assert req.output_text.split()  # it continued the text


def test_an_instruct_model_chats_through_the_api(chat_model_path) -> None:
    with serve_process("--model", str(chat_model_path), start_timeout_s=180) as server:
        client = OpenAI(base_url=server.url, api_key="unused")
        (model,) = client.models.list().data
        r = client.chat.completions.create(
            model=model.id, messages=[{"role": "user", "content": QUESTION}],
            max_tokens=32, temperature=0)
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
        chunks = client.chat.completions.create(
            model=model.id, messages=[{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": QUESTION}],
            max_tokens=32, temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert "Paris" in text
