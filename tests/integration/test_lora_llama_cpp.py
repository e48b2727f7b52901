"""LoRA adapters on the llama_cpp executor (llama.cpp's adapter API, one `llama_decode` per
adapter in a step): the shipped adapters, read from their PEFT folders, each teach their
answer in a batch that mixes both with the base model, and each request gives exactly what
it gives alone (batch-invariant decoding); `kvdeck serve --executor llama_cpp
--lora-modules` routes by name; an adapter for another model gets one sentence."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from tests.integration.test_lora import SHIPPED
from tests.servers import serve_process


def adapter(name: str) -> str:
    return str(Path(__file__).parents[2] / "adapters" / name)


@pytest.mark.parametrize("invariant", [True, False])
def test_mixed_adapters_in_one_step_each_answer_as_taught(gemma_path, invariant) -> None:
    from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor
    from kvdeck.runtime.text.tokenizer import Tokenizer

    tok = Tokenizer(gemma_path)
    ex = LlamaCppExecutor(gemma_path, n_parallel=8, batch_invariant=invariant)
    try:
        for name in SHIPPED:
            ex.load_adapter(name, adapter(name))
        engine = Engine(EngineConfig(kv_memory_bytes=64 << 20, knobs=Knobs(max_num_seqs=8)),
                        ex, tokenizer=tok)
        items = [(prompt, lora) for prompt, _ in SHIPPED.values()
                 for lora in (None, *SHIPPED)]
        sp = {lora: SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora=lora)
              for _, lora in items}
        reqs = [engine.add_request(tok.encode(p), sp[lora]) for p, lora in items]
        engine.run_until_idle()
        for (prompt, lora), r in zip(items, reqs, strict=True):
            owner = next(n for n, (p, _) in SHIPPED.items() if p == prompt)
            taught = tok.decode(r.output_token_ids).startswith(SHIPPED[owner][1])
            assert taught == (lora == owner), (prompt, lora)
        if invariant:  # each request decoded in a call of its own: exactly as alone
            for (prompt, lora), r in zip(items, reqs, strict=True):
                alone = engine.add_request(tok.encode(prompt), sp[lora])
                engine.run_until_idle()
                assert alone.output_token_ids == r.output_token_ids
        engine.check_integrity()
        assert ex.describe_adapters().startswith("LoRA 2/2 resident")
    finally:
        ex.close()


def test_the_server_routes_adapters_by_name() -> None:
    with serve_process("--executor", "llama_cpp", "--lora-modules",
                       f"capitals={adapter('capitals')}", start_timeout_s=300) as srv:
        client = OpenAI(base_url=srv.url, api_key="none")
        prompt, answer = SHIPPED["capitals"]
        ids = {m.id for m in client.models.list().data}
        assert "capitals" in ids
        for model in ("capitals", "gemma3-270m"):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=4,
                                          temperature=0)
            assert r.choices[0].text.startswith(answer) == (model == "capitals")


def test_an_adapter_for_another_model_gets_one_sentence(qwen_pair) -> None:
    run = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", "serve", "--port", "0",
                          "--executor", "llama_cpp", "--model", "qwen2.5-coder-0.5b",
                          "--lora-modules", f"capitals={adapter('capitals')}"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    said = " ".join(run.stderr.split())
    assert "The LoRA adapter 'capitals' was made for another base model" in said
    assert "Traceback" not in run.stderr
