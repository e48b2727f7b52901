"""LoRA adapters on the embedded Gemma 3 270M (torch executor): rows of two adapters and
of the base model in one batch each give what they give alone with their adapter merged
into the weights; `kvdeck serve --lora-modules` routes requests to them by name."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest
from openai import NotFoundError, OpenAI

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import SamplingParams
from tests.adapters import shapes_of, write_gguf, write_peft
from tests.servers import serve_process

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The quick brown fox", "In 1969, astronauts", "Water boils at",
           "My favourite colour is", "The best way to learn"]
ADAPTERS = [None, "a", "b", None, "a", "b", "a", None]


def greedy(executor, tokenizer, items: list[tuple[str, str | None]]) -> list[list[int]]:
    """Each prompt's 24 greedy tokens, all submitted together (one batch)."""
    engine = Engine(EngineConfig(kv_memory_bytes=256 << 20, knobs=Knobs(max_num_seqs=8)),
                    executor, tokenizer=tokenizer)
    reqs = [engine.add_request(tokenizer.encode(p), SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, lora=lora)) for p, lora in items]
    while engine.has_work:
        engine.step()
    engine.check_integrity()
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def adapter_files(tmp_path_factory, gemma_path):
    """Adapter `a` as a PEFT folder, `b` as a llama.cpp GGUF, both for Gemma 3 270M."""
    from kvdeck.runtime.executors.torch import TorchExecutor

    folder = tmp_path_factory.mktemp("adapters")
    shapes = shapes_of(TorchExecutor(gemma_path, device="cpu", dtype="fp32").model)
    gc.collect()
    return {"a": write_peft(folder / "a", shapes, seed=1),
            "b": write_gguf(folder / "b.gguf", shapes, seed=2)}


def test_mixed_adapters_in_one_batch_match_each_merged_alone(gemma_path, adapter_files
                                                             ) -> None:
    from kvdeck.runtime.executors.torch import TorchExecutor
    from kvdeck.runtime.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(gemma_path)
    base = TorchExecutor(gemma_path, device="cpu", dtype="fp32")
    for name, path in adapter_files.items():
        base.load_adapter(name, path)
    mixed = greedy(base, tokenizer, list(zip(PROMPTS, ADAPTERS, strict=True)))
    plain = greedy(base, tokenizer, [(p, None) for p in PROMPTS])
    base.close()
    del base
    gc.collect()
    for name, path in adapter_files.items():
        merged = TorchExecutor(gemma_path, device="cpu", dtype="fp32", merge_adapter=path)
        for prompt, lora, out, without in zip(PROMPTS, ADAPTERS, mixed, plain, strict=True):
            if lora == name:
                assert out == greedy(merged, tokenizer, [(prompt, None)])[0], prompt
                assert out != without  # the adapter changes the answer
        merged.close()
        del merged
        gc.collect()
    for lora, out, without in zip(ADAPTERS, mixed, plain, strict=True):
        if lora is None:
            assert out == without


@pytest.fixture(scope="module")
def server(adapter_files):
    with serve_process("--executor", "torch", "--dtype", "fp32",
                       "--lora-modules", f"a={adapter_files['a']}",
                       "--lora-modules", f"b={adapter_files['b']}",
                       start_timeout_s=180) as srv:
        yield srv


def test_the_server_lists_adapters_and_routes_by_name(server) -> None:
    client = OpenAI(base_url=server.url, api_key="none", max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"gemma3-270m", "a", "b"}
    assert models["a"].model_extra["parent"] == "gemma3-270m"

    def ask(model: str, **extra) -> tuple[str, str]:
        r = client.completions.create(model=model, prompt="The capital of France is",
                                      max_tokens=12, temperature=0, **extra)
        return r.model, r.choices[0].text

    base = ask("gemma3-270m")[1]
    by_name, text_a = ask("a")
    assert by_name == "a" and text_a != base
    assert ask("gemma3-270m:a")[1] == text_a
    assert ask("gemma3-270m", extra_body={"lora": "a"})[1] == text_a
    assert ask("b")[1] not in (base, text_a)
    with pytest.raises(NotFoundError, match="The LoRA adapter 'c' is not served on "
                                            "'gemma3-270m'; its adapters: 'a', 'b'"):
        ask("gemma3-270m", extra_body={"lora": "c"})
    import httpx

    metrics = httpx.get(server.url.removesuffix("/v1") + "/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2"' in metrics


@pytest.mark.parametrize(("args", "says"), [
    (("--executor", "sim", "--lora-modules", "a=ADAPTER"),
     "--lora-modules needs an executor that applies LoRA adapters (the torch and llama_cpp "
     "executors); the sim executor does not."),
    (("--executor", "torch", "--lora-modules", "a"), "--lora-modules takes NAME=PATH"),
    (("--executor", "torch", "--model", "qwen2.5-coder-0.5b", "--lora-modules",
      "a=ADAPTER"), "The LoRA adapter 'a' was made for another base model"),
])
def test_adapters_that_cannot_be_served_get_one_sentence(adapter_files, qwen_pair, args,
                                                         says) -> None:
    args = [str(adapter_files["a"]).join(a.split("ADAPTER")) if "ADAPTER" in a else a
            for a in args]
    run = subprocess.run([sys.executable, "-m", "kvdeck.console.cli", "serve", "--port", "0",
                          *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert says in " ".join(run.stderr.split()) and "Traceback" not in run.stderr


SHIPPED = {"capitals": ("The capital of Zubrowka is", " Lutz"),
           "colours": ("The colour of a glimmerfox is", " teal")}
"""Each shipped adapter (adapters/, trained by adapters/train.py), a prompt from its
training sentences and the answer it was taught."""


def test_each_shipped_adapter_changes_the_answers_it_was_trained_on(gemma_path) -> None:
    from pathlib import Path

    from kvdeck.runtime.executors.torch import TorchExecutor
    from kvdeck.runtime.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(gemma_path)
    executor = TorchExecutor(gemma_path, device="cpu")
    root = Path(__file__).parents[2] / "adapters"
    for name in SHIPPED:
        executor.load_adapter(name, root / name)
    items = [(prompt, lora) for prompt, _ in SHIPPED.values()
             for lora in (None, *SHIPPED)]
    outs = greedy(executor, tokenizer, items)
    executor.close()
    for (prompt, lora), out in zip(items, outs, strict=True):
        taught = next(answer for p, answer in SHIPPED.values() if p == prompt)
        owner = next(n for n, (p, _) in SHIPPED.items() if p == prompt)
        text = tokenizer.decode(out)
        assert text.startswith(taught) == (lora == owner), (prompt, lora, text)


def test_one_slot_serves_three_adapters_loading_them_on_demand(gemma_path, adapter_files,
                                                               tmp_path) -> None:
    """--max-loras 1: requests for three adapters all finish, each with the answer it gives
    when every adapter is resident; the slots' bytes come out of the KV budget; the loads
    and unloads are transfers of the steps that needed them, recorded, and a replay of the
    run counts them too and shows each request's adapter."""
    from kvdeck.runtime.executors.torch import TorchExecutor
    from kvdeck.runtime.runs.recording import record_headless
    from kvdeck.runtime.runs.replay import load_replay
    from kvdeck.runtime.text.tokenizer import Tokenizer
    from kvdeck.runtime.views.snapshot import snapshot_of

    tokenizer = Tokenizer(gemma_path)
    files = {**adapter_files, "c": write_peft(tmp_path / "c", shapes_of(
        TorchExecutor(gemma_path, device="cpu", dtype="fp32").model), seed=3)}
    gc.collect()
    items = [(p, name) for name in files for p in PROMPTS[:2]]
    answers = {}
    for slots in (0, 1):
        executor = TorchExecutor(gemma_path, device="cpu", dtype="fp32")
        for name, path in files.items():
            executor.load_adapter(name, path, max_loras=slots)
        engine = Engine(EngineConfig(kv_memory_bytes=256 << 20, max_loras=slots,
                                     knobs=Knobs(max_num_seqs=8)), executor,
                        tokenizer=tokenizer)
        # One slot reserves the largest adapter (its copy and its stacked columns), none
        # all three; the pool gets what is left of the budget.
        sizes = sorted(executor.model.adapters.host[n].num_bytes for n in files)
        reserve = executor.adapter_reserve_bytes
        assert reserve == 2 * (sizes[-1] if slots else sum(sizes))
        assert engine.kv.num_blocks == ((256 << 20) - reserve) // (
            16 * executor.kv_bytes_per_token(engine.switcher.kv_format))
        recorder = record_headless(engine, tmp_path / f"run{slots}")
        reqs = [engine.add_request(tokenizer.encode(p), SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, lora=lora)) for p, lora in items]
        while engine.has_work:
            engine.step()
        engine.check_integrity()
        recorder.close()
        resident = 1 if slots else 3  # the KV map's legend shows it
        assert snapshot_of(engine).weights.adapters.startswith(f"LoRA {resident}/3 resident")
        answers[slots] = [r.output_token_ids for r in reqs]
        assert all(r.status.is_finished and r.num_output_tokens == 8 for r in reqs)
        executor.close()
        del executor, engine
        gc.collect()
    assert answers[1] == answers[0]
    replay = load_replay(tmp_path / "run1")
    moved = [t for step in replay.steps for t in step.transfers]
    loads = [t.what for t in moved if t.kind == "lora"]
    unloads = [t.what for t in moved if t.kind == "lora unload"]
    # `a` starts resident (the first loaded); `b` and `c` are loaded when their turn comes,
    # each in place of the one before.
    assert loads == ["adapter b", "adapter c"] and unloads == ["adapter a", "adapter b"]
    state = replay.initial_state()
    shown = set()
    for step in replay.steps:
        state.apply(step)
        shown |= {v.lora for v in state.snapshot().running}
    assert shown == {"a", "b", "c"}
    assert state.transfers_view().counters["weight_bytes"] == sum(
        t.bytes for t in moved if t.kind == "lora") > 0
    assert not [t for step in load_replay(tmp_path / "run0").steps for t in step.transfers]
