"""What token-level KV eviction costs in accuracy, measured through the engine itself.

The shipped passage (`runtime/text/passage.txt`) is scored teacher-forced as one prompt
(`prompt_logprobs`) on a torch executor. It runs once with every block kept (the reference)
and once per eviction policy, computed `chunk_size` tokens a step in a pool of `pool_blocks`
blocks. Eviction runs between steps as it does in serving, so the figures are what a served
request of that length would see.

Per policy, over the positions that may have lost context (those at least sink + recent
tokens in: every earlier key is always kept):

- the share where the top-1 next token agrees with the reference;
- the mean |Δ log p| of the passage's actual next token. This compares log-probabilities,
  not raw logits; the two differ by a constant per position, and the engine reports
  log-probabilities;
- the passage's perplexity over those positions, against the reference's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.kv.eviction import Eviction
from kvdeck.runtime.resources import PASSAGE


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
    mean_abs_dlogp: float
    perplexity: float
    reference_perplexity: float

    def line(self) -> str:
        return (f"{self.label}: {self.tokens:,}-token passage in {self.pool_blocks} blocks, "
                f"{self.evicted_blocks:,} evicted; from position {self.scored_from:,}: top-1 "
                f"{self.top1_agreement:.1%}, mean |Δ log p| {self.mean_abs_dlogp:.3f}, "
                f"perplexity {self.perplexity:.2f} vs {self.reference_perplexity:.2f} full")


def _score(executor, tokens: list[int], eviction: Eviction, num_blocks: int,
           chunk_size: int, block_size: int):
    """(prompt log-probabilities, blocks evicted) of `tokens` under `eviction`."""
    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.core.request import SamplingParams

    knobs = Knobs(weight_format="dense", kv_format="fp32", chunk_size=chunk_size,
                  max_num_batched_tokens=chunk_size, enable_prefix_caching=False)
    e = Engine(EngineConfig(block_size=block_size, num_blocks=num_blocks,
                            kv_eviction=eviction.mode, kv_sink_tokens=eviction.sink_tokens,
                            kv_recent_tokens=eviction.recent_tokens,
                            kv_heavy_tokens=eviction.heavy_tokens, knobs=knobs), executor)
    req = e.add_request(tokens, SamplingParams(temperature=0.0, max_tokens=1,
                                               prompt_logprobs=1))
    e.run_until_idle()
    e.check_integrity()
    assert req.status.is_finished and len(req.prompt_logprobs_out) == len(tokens) - 1, \
        f"the passage did not complete under {eviction.describe()}: {req.reason}"
    return req.prompt_logprobs_out, e.kv.eviction.num_evicted_blocks


def measure_eviction(executor, tokenizer, policies: list[tuple[str, Eviction]],
                     pool_blocks: int, chunk_size: int = 32, block_size: int = 16
                     ) -> list[EvictionQuality]:
    """Each `(label, policy)` against full KV on the passage, in a pool of `pool_blocks`
    blocks (the reference gets one that holds the whole passage). `executor`: a
    `TorchExecutor` with fp32 compute; it is left with eviction off."""
    tokens = tokenizer.encode(PASSAGE.read_text(encoding="utf-8"))
    whole = -(-len(tokens) // block_size) + 1
    ref, _ = _score(executor, tokens, Eviction(), whole, chunk_size, block_size)
    # Position i scores token i + 1; a query before sink + recent reads every key. Every
    # policy is compared over the same positions.
    start = max(-(-p.sink_tokens // block_size) * block_size + p.recent_tokens
                for _, p in policies)
    if start >= len(tokens) - 1:
        raise ConfigError(f"The passage has {len(tokens):,} tokens, and eviction keeps the "
                          f"first {start:,} whole; lower --kv-recent-tokens.")
    out = []
    for label, policy in policies:
        lp, evicted = _score(executor, tokens, policy, pool_blocks, chunk_size, block_size)
        pairs = list(zip(ref[start:], lp[start:], tokens[start + 1:], strict=True))
        agree = sum(r.top[0][0] == t.top[0][0] for r, t, _ in pairs)
        dlogp = sum(abs(r.logprob - t.logprob) for r, t, _ in pairs)
        n = max(len(pairs), 1)
        out.append(EvictionQuality(
            label, len(tokens), pool_blocks, evicted, start, agree / n, dlogp / n,
            math.exp(-sum(t.logprob for _, t, _ in pairs) / n),
            math.exp(-sum(r.logprob for r, _, _ in pairs) / n)))
    _score(executor, tokens[:2], Eviction(), 2, chunk_size, block_size)  # eviction off again
    return out
