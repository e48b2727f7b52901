"""Choosing tokens from logits: greedy, temperature, top-k, top-p, per-request seeds, and
optional logprobs. One implementation shared by every executor that returns logits.

Reproducibility: a request with a seed draws its n-th token from a generator seeded with
(seed, n), so its output does not depend on what else is in the batch or on preemption.
Requests without a seed are seeded from the executor's seed and the request id — also
deterministic, but different per request.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from kvdeck.runtime.core.request import Request
from kvdeck.runtime.text.guided import apply_mask


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's log-probability and the most likely alternatives."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def request_generator(req: Request, base_seed: int, salt: int = 0) -> torch.Generator:
    """The generator a request's draws come from at its current position: seeded from its
    seed (or `base_seed` and its id), its output length and `salt` (a draft model's draws
    use their own)."""
    seed = req.sampling.seed if req.sampling.seed is not None \
        else base_seed ^ zlib.crc32(req.request_id.encode())
    g = torch.Generator()
    g.manual_seed(((seed ^ salt) * 1_000_003 + req.num_output_tokens) & ((1 << 63) - 1))
    return g


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from `probs` (a row of non-negative weights; need not sum to 1) by the
    inverse of its cumulative distribution: one uniform draw from `generator`. Why not
    `torch.multinomial`: over Gemma 3's 262,144 tokens it takes about 10 ms a row on a
    2-core CPU, this about 0.6 (the sum in float64, so no token's share is rounded away)."""
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    # The first token whose cumulative weight exceeds u: a zero-weight one never is.
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= probs.shape[-1]:  # u rounded up to the total: the last token with weight
        i = int(torch.nonzero(probs > 0)[-1])
    return i


def process_logits(logits: torch.Tensor, req: Request, eos_token_ids: tuple[int, ...] = ()
                   ) -> torch.Tensor:
    """One row of logits after the request's logit processors, in vLLM's order: the bias,
    then the repetition penalty (over prompt and output), then the presence and frequency
    penalties (over the output), then `min_tokens` masking end-of-sequence and the stop
    token ids. A copy; the row passed in is left as it was."""
    sp = req.sampling
    x = logits.clone()
    vocab = x.shape[-1]
    for token, bias in sp.logit_bias:
        if token < vocab:
            x[token] += bias
    output = req.output_token_ids
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*req.prompt_token_ids, *output) if t < vocab}),
                            dtype=torch.long)
        if len(seen):
            v = x[seen]
            x[seen] = torch.where(v > 0, v / sp.repetition_penalty, v * sp.repetition_penalty)
    if (sp.presence_penalty or sp.frequency_penalty) and len(output):
        counts = torch.bincount(torch.tensor([t for t in output if t < vocab],
                                             dtype=torch.long), minlength=vocab).float()
        x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).float()
    if sp.min_tokens and len(output) < sp.min_tokens:
        ends = [t for t in (*(() if sp.ignore_eos else eos_token_ids), *sp.stop_token_ids)
                if t < vocab]
        if ends:
            x[ends] = float("-inf")
    return x


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  min_p: float = 0.0) -> torch.Tensor:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p set to
    -inf."""
    x = logits / temperature
    if min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return x


def sampling_probs(logits: torch.Tensor, sp) -> torch.Tensor:
    """The distribution a sampling request draws from: softmax of its filtered logits."""
    return torch.softmax(filter_logits(logits, sp.temperature, sp.top_k, sp.top_p, sp.min_p),
                         dim=-1)


def constrain(scores: torch.Tensor, raw: torch.Tensor, allowed: torch.Tensor | None
              ) -> torch.Tensor:
    """`scores` with the tokens a grammar refuses at -inf (`allowed`: a bool row, None for
    an unconstrained request). Should processors have masked everything the grammar allows
    (`min_tokens` holding back the end a finished grammar needs), the grammar wins."""
    if allowed is None:
        return scores
    masked = apply_mask(scores, allowed)
    if scores is not raw and not torch.isfinite(masked).any():
        masked = apply_mask(raw, allowed)
    return masked


def sample(logits: torch.Tensor, requests: list[Request], base_seed: int = 0,
           eos_token_ids: tuple[int, ...] = (), masks: dict[str, torch.Tensor] | None = None
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of `logits` [N, vocab] (float32) for the matching request, after
    its logit processors (`process_logits`; `eos_token_ids` for `min_tokens`) and its
    grammar's mask (`masks`: request id → allowed tokens, `guided.MaskJob`). Logprobs are
    the model's own distribution, before processors, as OpenAI and vLLM report them."""
    logits = logits.float().cpu()
    # numpy's argmax over a [16, 262,144] float32 block takes 0.6 ms on a 2-core Xeon,
    # torch's 5; both take the first of equal maxima (and a NaN as the maximum).
    greedy = logits.detach().numpy().argmax(axis=-1).tolist()
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    for row, req in enumerate(requests):
        sp = req.sampling
        scores = process_logits(logits[row], req, eos_token_ids) if sp.processes_logits \
            else logits[row]
        allowed = masks.get(req.request_id) if masks else None
        scores = constrain(scores, logits[row], allowed)
        if sp.temperature == 0.0:
            token = int(scores.argmax()) if sp.processes_logits or allowed is not None \
                else greedy[row]
        else:
            probs = sampling_probs(scores, sp)
            token = draw(probs, request_generator(req, base_seed))
        tokens.append(token)
        logprobs.append(None if sp.logprobs is None else
                        score_tokens(logits[row:row + 1], [token], sp.logprobs)[0])
    return tokens, logprobs


def score_tokens(logits: torch.Tensor, tokens: list[int], num_alternatives: int
                 ) -> list[TokenLogprobs]:
    """Each row of `logits` [N, vocab] scoring the matching token of `tokens`: the token's
    log-probability under the model's own distribution (the log-softmax of the raw logits,
    before any processor) and the `num_alternatives` most likely tokens. Sampled tokens'
    logprobs and prompt logprobs both come from here."""
    out: list[TokenLogprobs] = []
    for a in range(0, len(tokens), SCORE_ROWS):  # a row's log-softmax is a vocabulary
        b = min(a + SCORE_ROWS, len(tokens))      # of floats: a long prompt in slices
        lp = torch.log_softmax(logits[a:b].float().cpu(), dim=-1)
        chosen = lp[torch.arange(b - a), torch.tensor(tokens[a:b], dtype=torch.long)].tolist()
        if not num_alternatives:
            out.extend(TokenLogprobs(v, ()) for v in chosen)
            continue
        top = torch.topk(lp, num_alternatives, dim=-1)
        out.extend(TokenLogprobs(v, tuple(zip(i, t, strict=True))) for v, i, t in
                   zip(chosen, top.indices.tolist(), top.values.tolist(), strict=True))
    return out


SCORE_ROWS = 64
"""Rows scored at a time (1 MiB of floats per row on Gemma 3's vocabulary)."""


def sample_branches(logits: torch.Tensor, chunks: list, base_seed: int = 0,
                    eos_token_ids: tuple[int, ...] = (),
                    masks: dict[str, torch.Tensor] | None = None
                    ) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
    """The first tokens of the other samples of prompts completed this step (`n` > 1):
    row j of `logits` is the last row of `chunks[j]`, and each of its `branches` draws from
    that row with its own generator (and its first sample's grammar mask). Returns
    (request id → token, request id → logprobs)."""
    rows, reqs, branch_masks = [], [], {}
    for j, chunk in enumerate(chunks):
        for b in chunk.branches:
            rows.append(j)
            reqs.append(b)
            if masks and chunk.request_id in masks:
                branch_masks[b.request_id] = masks[chunk.request_id]
    if not reqs:
        return {}, {}
    tokens, lps = sample(logits[rows], reqs, base_seed, eos_token_ids, branch_masks)
    return ({r.request_id: t for r, t in zip(reqs, tokens, strict=True)},
            {r.request_id: lp for r, lp in zip(reqs, lps, strict=True) if lp is not None})
