"""What token-level KV eviction costs in accuracy, measured through the engine itself.

The shipped passage (`runtime/text/passage.txt`) is scored teacher-forced as one prompt
(`prompt_logprobs`) on a torch executor. It runs once with every block kept (the reference)
and once per eviction policy, computed `chunk_size` tokens a step in a pool of `pool_blocks`
blocks. Eviction runs between steps as it does in serving, so the figures are what a served
request of that length would see. The executor records every scored position's logits.

Per policy, over the positions that may have lost context (those at least sink + recent
tokens in: every earlier key is always kept), the same measures as for the KV and weight
formats (`quality.py`):

- the share of positions where the top-1 next token agrees with the reference;
- the mean |Δlogit| over the reference's `TOP_K` most likely tokens at each position;
- where they disagree, the reference's top-two margin.

It also gives the passage's perplexity over those positions, against the reference's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.kv.eviction import Eviction
from kvdeck.runtime.resources import PASSAGE
from kvdeck.runtime.text.quality import compare, reference_from


@dataclass
class EvictionQuality:
    """One eviction policy's accuracy against full KV on the passage."""

    label: str
    tokens: int
    """The passage's length in tokens."""
    pool_blocks: int
    evicted_blocks: int
    scored_from: int
    """The first position compared: sink (in whole blocks) + recent tokens, the largest
    over the policies measured together."""
    top1_agreement: float
    mean_abs_dlogit: float
    disagreements: list[tuple[int, float]]
    """(position, the reference's top-two margin there) where the top-1 differs."""
    perplexity: float
    reference_perplexity: float

    def line(self) -> str:
        return (f"{self.label}: {self.tokens:,}-token passage in {self.pool_blocks} blocks, "
                f"{self.evicted_blocks:,} evicted; from position {self.scored_from:,}: top-1 "
                f"{self.top1_agreement:.1%}, mean |Δlogit| {self.mean_abs_dlogit:.3f}, "
                f"perplexity {self.perplexity:.2f} vs {self.reference_perplexity:.2f} full")


def _score(executor, tokens: list[int], eviction: Eviction, num_blocks: int,
           chunk_size: int, block_size: int) -> tuple[torch.Tensor, list[float], int]:
    """(logits [positions, vocab], the passage tokens' log-probabilities, blocks evicted)
    of `tokens` under `eviction`: position i scores token i + 1."""
    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.core.request import SamplingParams

    knobs = Knobs(weight_format="dense", kv_format="fp32", chunk_size=chunk_size,
                  max_num_batched_tokens=chunk_size, enable_prefix_caching=False)
    e = Engine(EngineConfig(block_size=block_size, num_blocks=num_blocks,
                            kv_eviction=eviction.mode, kv_sink_tokens=eviction.sink_tokens,
                            kv_recent_tokens=eviction.recent_tokens,
                            kv_heavy_tokens=eviction.heavy_tokens, knobs=knobs), executor)
    executor.logits_log.clear()
    executor.record_logits = True
    try:
        req = e.add_request(tokens, SamplingParams(temperature=0.0, max_tokens=1,
                                                   prompt_logprobs=1))
        e.run_until_idle()
    finally:
        executor.record_logits = False
    e.check_integrity()
    assert req.status.is_finished and len(req.prompt_logprobs_out) == len(tokens) - 1, \
        f"the passage did not complete under {eviction.describe()}: {req.reason}"
    parts = sorted((pos, t) for rid, pos, t in executor.logits_log
                   if rid == req.request_id and t.dim() == 2)
    executor.logits_log.clear()
    logits = torch.cat([t for _, t in parts])
    return logits, [lp.logprob for lp in req.prompt_logprobs_out], \
        e.kv.eviction.num_evicted_blocks


def measure_eviction(executor, tokenizer, policies: list[tuple[str, Eviction]],
                     pool_blocks: int, chunk_size: int = 32, block_size: int = 16
                     ) -> list[EvictionQuality]:
    """Each `(label, policy)` against full KV on the passage, in a pool of `pool_blocks`
    blocks (the reference gets one that holds the whole passage). `executor`: a
    `TorchExecutor` with fp32 compute; it is left with eviction off."""
    tokens = tokenizer.encode(PASSAGE.read_text(encoding="utf-8"))
    # Position i scores token i + 1; a query before sink + recent reads every key. Every
    # policy is compared over the same positions.
    start = max(-(-p.sink_tokens // block_size) * block_size + p.recent_tokens
                for _, p in policies)
    if start >= len(tokens) - 1:
        raise ConfigError(f"The passage has {len(tokens):,} tokens, and eviction keeps the "
                          f"first {start:,} whole; lower --kv-recent-tokens.")
    whole = -(-len(tokens) // block_size) + 1
    logits, ref_lp, _ = _score(executor, tokens, Eviction(), whole, chunk_size, block_size)
    ref = reference_from(logits[start:])
    del logits
    out = []
    for label, policy in policies:
        logits, lp, evicted = _score(executor, tokens, policy, pool_blocks, chunk_size,
                                     block_size)
        q = compare(label, logits[start:], ref)
        n = len(lp) - start
        out.append(EvictionQuality(
            label, len(tokens), pool_blocks, evicted, start, q.top1_agreement,
            q.mean_abs_dlogit, [(start + i, m) for i, m in q.disagreements],
            math.exp(-sum(lp[start:]) / n), math.exp(-sum(ref_lp[start:]) / n)))
    executor.set_token_eviction("off")
    return out
