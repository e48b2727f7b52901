"""The torch executor's step-time model learns its coefficients from measured steps."""

from __future__ import annotations

import random

from kvdeck.runtime.executors.online_fit import OnlineFit
from kvdeck.runtime.planning.profiles import StepFit


def test_recovers_a_linear_step_model_from_noisy_steps_and_keeps_the_prior_until_then() -> None:
    prior = StepFit(0.5, 0.01, 0.0)
    fit = OnlineFit(prior)
    truth = StepFit(0.020, 0.0004, 2e-9)
    rng = random.Random(1)
    for _ in range(15):
        fit.observe(8, 8 * 300, truth.seconds(8, 8 * 300))
    assert fit.fit == prior  # too few steps: the prior stands
    for _ in range(400):
        new = rng.choice((1, 4, 8, 16, 64, 256))
        pairs = new * rng.randrange(10, 2000) + new * (new + 1) // 2
        fit.observe(new, pairs, truth.seconds(new, pairs) * rng.uniform(0.97, 1.03))
    assert abs(fit.fit.fixed_s - 0.020) < 0.002
    assert abs(fit.fit.per_token_s - 0.0004) < 0.00005
    assert fit.seconds(32, 32 * 1000) == fit.fit.seconds(32, 32 * 1000)


def test_steps_of_one_size_only_do_not_replace_the_prior() -> None:
    prior = StepFit(0.5, 0.01, 0.0)
    fit = OnlineFit(prior)
    for _ in range(100):
        fit.observe(4, 0, 0.03)  # decodes with no context: no way to split fixed from per-row
    assert fit.fit == prior
