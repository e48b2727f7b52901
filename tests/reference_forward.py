"""A plain contiguous-KV forward pass: the oracle the paged executor is tested against.

It reuses the model's position-wise pieces (norms, projections, RoPE, FFN) but computes
attention over the whole sequence at once with an explicit causal (and sliding-window)
mask — no blocks, no tables, no cache.
"""

from __future__ import annotations

import torch

from kvdeck.runtime.models.transformer import Transformer


@torch.inference_mode()
def contiguous_logits(model: Transformer, tokens: list[int]) -> torch.Tensor:
    """Logits [L, vocab] for every position of `tokens`, computed in one pass."""
    n = len(tokens)
    pos = torch.arange(n, device=model.device)
    group = model.num_heads // model.num_kv_heads

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        window = model.cfg.window(layer)
        allowed = pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= pos[None, :] > pos[:, None] - window
        k = k.repeat_interleave(group, dim=1)  # [L, H, d]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * model.cfg.attn_scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)

    hidden = model.forward(torch.tensor(tokens, device=model.device), pos, attend)
    return model.logits(hidden)
