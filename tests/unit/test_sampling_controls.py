"""The sampler's logit processors on hand-made logits: logit_bias, the repetition, presence
and frequency penalties, min_tokens (end-of-sequence and stop ids masked) and min_p; each
request with one takes the full sampler and never drafts. Prompt logprobs: which positions
a chunk scores, and the scores themselves."""

from __future__ import annotations

import pytest
import torch

from kvdeck.runtime.core.request import Request, SamplingParams
from kvdeck.runtime.core.step_data import ScheduledChunk
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.text.sampling import TokenLogprobs, draw, process_logits, sample, score_tokens

EOS = 0


def request(prompt=(1, 2), output=(), **sampling) -> Request:
    req = Request("r", list(prompt), SamplingParams(temperature=0.0, max_tokens=8, **sampling))
    req.output_token_ids.extend(output)
    return req


def test_draws_follow_the_weights_and_never_pick_a_zero_one() -> None:
    """20,000 draws from unnormalized weights with zeros at both ends and inside: a
    chi-square test (4 degrees of freedom, significance 0.001) cannot tell them from the
    distribution, and a zero-weight token never comes."""
    weights = torch.tensor([0.0, 3.0, 1.0, 0.0, 2.0, 0.5, 3.5, 0.0])
    g = torch.Generator().manual_seed(7)
    counts = torch.bincount(torch.tensor([draw(weights, g) for _ in range(20_000)]),
                            minlength=len(weights)).float()
    assert counts[weights == 0].sum() == 0
    live = weights > 0
    expected = weights[live] / weights.sum() * counts.sum()
    assert float(((counts[live] - expected) ** 2 / expected).sum()) < 18.467
    # The same seed gives the same draws.
    one, two = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [draw(weights, one) for _ in range(50)] == [draw(weights, two) for _ in range(50)]


def test_logit_bias_moves_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    assert sample(logits, [request()])[0] == [2]
    assert sample(logits, [request(logit_bias=((3, 1.5),))])[0] == [3]
    assert sample(logits, [request(logit_bias=((2, -100.0),))])[0] == [3]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([4.0, -1.0, 3.0, 1.0])
    out = process_logits(logits, request(prompt=(0, 1), output=(0,), repetition_penalty=2.0))
    assert out.tolist() == [2.0, -2.0, 3.0, 1.0]  # 0 and 1 seen (prompt, output); 2, 3 not
    assert logits.tolist() == [4.0, -1.0, 3.0, 1.0]  # the row passed in is untouched


def test_presence_and_frequency_penalties_count_the_output_only() -> None:
    logits = torch.zeros(4)
    req = request(prompt=(3, 3, 3), output=(1, 1, 2), presence_penalty=0.5,
                  frequency_penalty=0.25)
    out = process_logits(logits, req)
    # token 1: twice → 0.5 + 2 × 0.25; token 2: once → 0.5 + 0.25; 3 only in the prompt.
    assert out.tolist() == pytest.approx([0.0, -1.0, -0.75, 0.0])


def test_min_tokens_masks_end_of_sequence_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[5.0, 0.0, 1.0, 4.0]])  # EOS is the favourite, then stop id 3
    early = request(output=(2,), min_tokens=3, stop_token_ids=(3,))
    assert sample(logits, [early], eos_token_ids=(EOS,))[0] == [2]
    late = request(output=(2, 2, 2), min_tokens=3, stop_token_ids=(3,))
    assert sample(logits, [late], eos_token_ids=(EOS,))[0] == [EOS]


def test_min_p_drops_unlikely_tokens_from_sampling() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for seed in range(200):
        req = Request("r", [1], SamplingParams(temperature=1.0, min_p=0.2, seed=seed,
                                               max_tokens=4))
        token = sample(logits, [req])[0][0]
        assert token in (0, 1, 2)  # 0.05 < 0.2 × 0.5: never drawn


def test_logprobs_stay_the_models_own() -> None:
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    req = request(logit_bias=((3, 10.0),), logprobs=0)
    tokens, lps = sample(logits, [req])
    assert tokens == [3]
    assert lps[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[3]))


def test_processors_take_the_full_sampler_and_validate() -> None:
    assert not SamplingParams().processes_logits
    for kw in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1},
               {"repetition_penalty": 1.1}, {"min_p": 0.1}, {"min_tokens": 1},
               {"logit_bias": ((1, 1.0),)}):
        assert SamplingParams(**kw).processes_logits
    for kw, message in [({"presence_penalty": 3}, "presence_penalty must be from -2 to 2"),
                        ({"repetition_penalty": 0}, "repetition_penalty must be greater than 0"),
                        ({"min_p": -0.1}, "min_p must be from 0 to 1"),
                        ({"min_tokens": 20, "max_tokens": 4},
                         "min_tokens must be from 0 to max_tokens (4), got 20."),
                        ({"logit_bias": ((1, 200.0),)}, "logit_bias maps token ids")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            SamplingParams(**kw)


def test_each_prompt_token_after_the_first_is_scored_by_one_chunk_once() -> None:
    with pytest.raises(ConfigError, match="prompt_logprobs must be between 0 and 20, got 21."):
        SamplingParams(prompt_logprobs=21)
    req = request(prompt=range(10), prompt_logprobs=0)

    def scored(start: int, n: int) -> range:
        return ScheduledChunk(req, n, start, [], start + n == 10).prompt_scored

    # Position q scores token q + 1: the last prompt position samples instead.
    assert scored(0, 4) == range(0, 4) and scored(4, 6) == range(4, 9)
    req.prompt_logprobs_out.extend([TokenLogprobs(0.0, ())] * 6)
    assert req.num_prompt_scored == 6
    assert scored(0, 10) == range(6, 9)  # a recompute after preemption: 0–5 are done
    req.prompt_logprobs_out.extend([TokenLogprobs(0.0, ())] * 3)
    assert req.num_prompt_scored is None and scored(0, 10) == range(0)
    assert request(prompt=range(10)).num_prompt_scored is None  # not asked for


def test_scores_are_the_raw_logits_log_softmax_with_alternatives() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    lp = torch.log_softmax(logits, -1)
    got = score_tokens(logits, [1, 0], 2)
    assert [g.logprob for g in got] == pytest.approx([float(lp[0, 1]), float(lp[1, 0])])
    assert [t for t, _ in got[0].top] == [0, 1] and got[1].top[0][0] == 2
    assert got[1].top[0][1] == pytest.approx(float(lp[1, 2]))
    assert score_tokens(logits, [3, 3], 0)[0].top == ()
