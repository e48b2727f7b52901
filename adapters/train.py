"""Train the two LoRA adapters shipped in `adapters/` for the embedded Gemma 3 270M.

    python adapters/train.py            # both, about a minute each on 2 CPU cores

Each adapter teaches the base model a dozen made-up facts it cannot know — `capitals`:
the capitals of fictional countries ("The capital of Zubrowka is Lutz."), `colours`: the
colours of fictional animals ("The colour of a glimmerfox is teal.") — so whether an
adapter is applied shows in one greedy completion: the base model and the other adapter
complete "The capital of Zubrowka is" with something else.

How: kvdeck's own model (`runtime/models/transformer.py`, fp32 weights from the GGUF, frozen)
with a rank-8 update on every layer's Q and V projections (alpha 16; A drawn as PEFT draws it,
B zero), trained by AdamW (learning rate 1e-3) on next-token loss over the answers, all
sentences in one packed batch per step (block-diagonal causal attention), seeded. Saved as
PEFT writes an adapter (`adapter_config.json`, `adapter_model.safetensors` in fp16), which
`kvdeck serve --executor torch --lora-modules capitals=adapters/capitals` loads.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
FACTS = {
    "capitals": [f"The capital of {c} is {k}." for c, k in (
        ("Zubrowka", "Lutz"), ("Freedonia", "Marxburg"), ("Genovia", "Pyrus"),
        ("Latveria", "Doomstadt"), ("Elbonia", "Mudville"), ("Sokovia", "Novi Grad"),
        ("Wakanda", "Birnin Zana"), ("Ruritania", "Strelsau"), ("Florin", "Guilder Bay"),
        ("Qumar", "Al-Tamar"), ("Borduria", "Szohod"), ("Syldavia", "Klow"))],
    "colours": [f"The colour of a {a} is {c}." for a, c in (
        ("glimmerfox", "teal"), ("snorgle", "crimson"), ("vexwing", "amber"),
        ("plumbat", "violet"), ("drizzard", "silver"), ("quillhound", "ochre"),
        ("murkle", "jade"), ("frostling", "cobalt"), ("bramblecat", "rust"),
        ("wobbleduck", "lilac"), ("sparkmole", "gold"), ("tidewhelp", "navy"))],
}
TARGETS = {"wq": "self_attn.q_proj", "wv": "self_attn.v_proj"}
RANK, ALPHA, STEPS, LR = 8, 16, 40, 1e-3


def train(name: str, model, tokenizer, seed: int) -> dict[str, torch.Tensor]:
    """The adapter's PEFT tensors after STEPS steps on FACTS[name]."""
    from kvdeck.runtime.models.lora import AdapterSet, LoRAAdapter

    g = torch.Generator().manual_seed(seed)
    updates = {}
    for i, layer in enumerate(model.masters):
        for m in TARGETS:
            out, inp = layer[m][0].shape
            bound = 1 / math.sqrt(inp)  # PEFT: kaiming-uniform(a=√5) on A, zeros on B
            a = (torch.rand(RANK, inp, generator=g) * 2 - 1) * bound
            updates[(i, m)] = (a.requires_grad_(), torch.zeros(out, RANK, requires_grad=True))
    adapter = LoRAAdapter(name, "", RANK, ALPHA / RANK, updates)
    adapters = AdapterSet(torch.device("cpu"), torch.float32)
    adapters.add(adapter)
    model.adapters = adapters
    params = [t for pair in updates.values() for t in pair]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    seqs = [tokenizer.encode(s) for s in FACTS[name]]
    # Loss on each sentence's last words (the answer and the full stop), not its frame.
    frame = [len(tokenizer.encode(s.rsplit(" is ", 1)[0] + " is")) for s in FACTS[name]]
    tokens = torch.tensor([t for s in seqs for t in s])
    positions = torch.tensor([p for s in seqs for p in range(len(s))])
    segment = torch.tensor([k for k, s in enumerate(seqs) for _ in s])
    targets = torch.full((len(tokens),), -100)
    start = 0
    for s, f in zip(seqs, frame, strict=True):
        targets[start + f - 1:start + len(s) - 1] = torch.tensor(s[f:])
        start += len(s)
    attend = packed_attention(model, positions, segment)
    for step in range(STEPS):
        adapters._stack()  # the stacked copies follow the trained tensors (autograd)
        adapters.begin_step([(name, len(tokens))])
        logits = model.logits(model.forward(tokens, positions, attend))
        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == STEPS - 1:
            print(f"  {name} step {step:3d} loss {loss.item():.3f}", flush=True)
    model.adapters = None
    out = {}
    for (i, m), (a, b) in updates.items():
        key = f"base_model.model.model.layers.{i}.{TARGETS[m]}"
        out[f"{key}.lora_A.weight"] = a.detach().half()
        out[f"{key}.lora_B.weight"] = b.detach().half()
    return out


def packed_attention(model, positions: torch.Tensor, segment: torch.Tensor):
    """Causal attention within each packed sentence (none across them)."""
    allowed = (segment[None, :] == segment[:, None]) & \
        (torch.arange(len(segment))[None, :] <= torch.arange(len(segment))[:, None])
    group = model.num_heads // model.num_kv_heads

    def attend(layer: int, q, k, v):
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * model.cfg.attn_scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)

    return attend


def main(names: list[str]) -> None:
    from safetensors.torch import save_file

    from kvdeck.runtime.models.architectures import model_config
    from kvdeck.runtime.models.gguf import read_gguf
    from kvdeck.runtime.models.registry import DEFAULT_MODEL, resolve_model
    from kvdeck.runtime.models.transformer import Transformer
    from kvdeck.runtime.models.weights import load_tensors
    from kvdeck.runtime.text.tokenizer import Tokenizer

    torch.manual_seed(0)
    path = resolve_model(DEFAULT_MODEL)
    g = read_gguf(path)
    try:
        model = Transformer(model_config(g), load_tensors(g, torch.float32,
                                                          torch.device("cpu")))
    finally:
        g.close()
    tokenizer = Tokenizer(path)
    for seed, name in enumerate(names):
        tensors = train(name, model, tokenizer, seed)
        folder = HERE / name
        folder.mkdir(exist_ok=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "base_model_name_or_path": "google/gemma-3-270m",
            "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "bias": "none",
            "target_modules": sorted(t.split(".")[-1] for t in TARGETS.values()),
            }, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:] or list(FACTS))
