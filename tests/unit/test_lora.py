"""LoRA adapters (`runtime/models/lora.py`): both file forms read to the same updates, a
mismatched adapter refused with a sentence, and the batched per-row update equal to the
merged matrix's."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.models.lora import AdapterSet, LoRAAdapter, check_fits, load_adapter
from tests.adapters import updates, write_gguf, write_peft

SHAPES = [{"wq": (32, 16), "wk": (8, 16), "wv": (8, 16), "wo": (16, 32),
           "w_gate": (48, 16), "w_up": (48, 16), "w_down": (16, 48)}] * 2
"""A two-layer toy model's matrices, (outputs, inputs)."""


def masters(shapes=SHAPES) -> list[dict]:
    return [{m: (torch.zeros(shape), None) for m, shape in layer.items()} for layer in shapes]


def test_peft_and_gguf_adapters_read_to_the_same_updates(tmp_path) -> None:
    peft = load_adapter("p", write_peft(tmp_path / "peft", SHAPES, seed=3))
    gguf = load_adapter("g", write_gguf(tmp_path / "a.gguf", SHAPES, seed=3))
    assert peft.rank == gguf.rank == 8 and peft.scale == gguf.scale == 2.0
    assert set(peft.updates) == set(gguf.updates) == {
        (i, m) for i in range(2) for m in ("wq", "wv", "w_up", "w_down")}
    for key, (a, b) in peft.updates.items():
        want_a, want_b = updates(SHAPES, 3, 8)[key]
        assert np.array_equal(a.numpy(), want_a) and np.array_equal(b.numpy(), want_b)
        assert torch.equal(gguf.updates[key][0], a) and torch.equal(gguf.updates[key][1], b)
    check_fits(peft, masters(), "gemma3", "neox")


def test_rslora_scales_by_the_root_of_the_rank(tmp_path) -> None:
    folder = write_peft(tmp_path / "peft", SHAPES, seed=1, rank=4, alpha=8)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    assert load_adapter("r", folder).scale == pytest.approx(8 / 2)


def test_an_adapter_for_another_model_is_refused_with_a_sentence(tmp_path) -> None:
    other = [{**layer, "wq": (64, 16)} for layer in SHAPES]
    adapter = load_adapter("x", write_peft(tmp_path / "peft", other, seed=1))
    with pytest.raises(ConfigError, match=re.escape(
            "The LoRA adapter 'x' was made for another base model: its layer 0 wq update "
            "is 64×16 (rank 8), and this model's matrix is 32×16.")):
        check_fits(adapter, masters(), "gemma3", "neox")
    deeper = load_adapter("y", write_peft(tmp_path / "deep", SHAPES * 2, seed=1))
    with pytest.raises(ConfigError, match="it updates layer 2, and this model has 2 layers"):
        check_fits(deeper, masters(), "gemma3", "neox")


def test_q_and_k_updates_are_refused_where_the_gguf_permutes_them(tmp_path) -> None:
    adapter = load_adapter("x", write_peft(tmp_path / "peft", SHAPES, seed=1))
    with pytest.raises(ConfigError, match="stores permuted from the Hugging Face order"):
        check_fits(adapter, masters(), "llama", "normal")


@pytest.mark.parametrize(("files", "says"), [
    ({}, "is neither a PEFT folder (adapter_config.json and adapter_model.safetensors) nor "
         "a llama.cpp adapter GGUF."),
    ({"adapter_config.json": '{"r": 8}', "adapter_model.safetensors": "not safetensors"},
     "could not be read (SafetensorError"),
    ({"adapter_config.json": "{}", "adapter_model.safetensors": ""}, "could not be read"),
    ({"adapter_config.json": '{"r": 0}', "adapter_model.safetensors": ""}, "has rank 0"),
    ({"adapter_config.json": '{"r": 8, "rank_pattern": {"q_proj": 4}}',
      "adapter_model.safetensors": ""}, "per-matrix rank_pattern/alpha_pattern"),
])
def test_unreadable_adapters_get_one_sentence(tmp_path, files, says) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_adapter("bad", tmp_path)


def test_a_gguf_that_is_a_model_is_not_an_adapter(tmp_path) -> None:
    from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model

    with pytest.raises(ConfigError, match="is a GGUF but not a LoRA adapter"):
        load_adapter("m", resolve_model(DEFAULT_MODEL))


def test_each_rows_update_equals_its_merged_matrix() -> None:
    """Rows of two adapters and of none in one batch: each row equals x·(W + s·BA)ᵀ."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 16, generator=g)

    def adapter(name: str, scale: float) -> LoRAAdapter:
        a, b = torch.randn(4, 16, generator=g), torch.randn(32, 4, generator=g)
        return LoRAAdapter(name, name, 4, scale, {(0, "wq"): (a, b)})

    one, two = adapter("one", 0.5), adapter("two", 2.0)
    adapters = AdapterSet(torch.device("cpu"), torch.float32)
    adapters.add(one)
    adapters.add(two)
    rows = [("one", 2), (None, 3), ("two", 1), ("one", 1)]
    adapters.begin_step(rows)
    x = torch.randn(7, 16, generator=g)
    y = adapters.apply(0, "wq", x, x @ w.T)
    by_name = {"one": one, "two": two}
    names = [name for name, n in rows for _ in range(n)]
    for i, name in enumerate(names):
        merged = w
        if name is not None:
            a, b = by_name[name].updates[(0, "wq")]
            merged = w + by_name[name].scale * (b @ a)
        assert torch.allclose(y[i], x[i] @ merged.T, atol=1e-4)
    assert torch.equal(adapters.apply(0, "wk", x, x @ w.T), x @ w.T)  # no update for wk


def test_an_adapter_of_mixed_ranks_is_refused(tmp_path) -> None:
    from safetensors.numpy import save_file

    folder = write_peft(tmp_path / "peft", SHAPES, seed=1)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
               np.zeros((4, 16), np.float32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
               np.zeros((32, 4), np.float32)}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match="has rank 4 at layer 0's wq and 8 elsewhere"):
        check_fits(load_adapter("m", folder), masters(), "gemma3", "neox")


def test_prefix_cache_blocks_are_each_adapters_own() -> None:
    """A prompt's blocks cached under the base model are a miss for an adapter, and the
    adapter's its own hit; a KV format switch keeps both namespaces (renamed together)."""
    from kvdeck.runtime.core.config import EngineConfig
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.core.request import SamplingParams
    from kvdeck.runtime.executors.sim import SimConfig, SimExecutor

    engine = Engine(EngineConfig(block_size=8, num_blocks=64), SimExecutor(SimConfig()))
    prompt = list(range(100, 140))  # five full blocks

    def cached(lora: str | None) -> int:
        req = engine.add_request(prompt, SamplingParams(max_tokens=2, lora=lora))
        while engine.has_work:
            engine.step()
        engine.check_integrity()
        return req.num_cached_tokens

    assert cached(None) == 0
    assert cached("a") == 0  # the base model's blocks are not the adapter's
    assert cached("a") == 32 and cached(None) == 32 and cached("b") == 0
    engine.set_knobs(kv_format="q8_0")
    while engine.has_work:
        engine.step()
    cached(None)  # an iteration applies the switch
    assert "|q8_0|" in engine.kv.state.namespace
    assert cached("a") == 32 and cached(None) == 32
