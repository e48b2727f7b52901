"""The step-time model a real executor learns from its own steps.

`fixed + per_token × new tokens + per_pair × causal pairs`, fitted by least squares over
the steps it has measured (exponentially forgetting old ones, so it follows a knob or
format change), starting from a prior until the steps seen vary enough to pin the
coefficients down. Admission control, eviction value and the adaptive draft length ask it
what a step will cost; a rough prior would mislead them (on a CPU the roofline prior of
the torch executor overestimates a decode row's cost several times over).
"""

from __future__ import annotations

import numpy as np

from kvdeck.runtime.planning.profiles import StepFit


class OnlineFit:
    """Least squares of measured step seconds on (1, new tokens, pairs)."""

    def __init__(self, prior: StepFit, forget: float = 0.995, min_steps: int = 16):
        self.prior = prior
        self.forget = forget
        self.min_steps = min_steps
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._steps = 0
        self.fit = prior
        """The current model: the prior until enough varied steps were seen."""

    def observe(self, num_new_tokens: int, num_pairs: int, seconds: float) -> None:
        x = np.array([1.0, float(num_new_tokens), float(num_pairs)])
        self._xtx = self.forget * self._xtx + np.outer(x, x)
        self._xty = self.forget * self._xty + x * seconds
        self._steps += 1
        if self._steps >= self.min_steps and self._steps % 4 == 0:
            self._solve()

    def _solve(self) -> None:
        # Scale the columns so the pair counts (millions) do not swamp the solve.
        scale = np.sqrt(np.maximum(np.diag(self._xtx), 1e-12))
        a = self._xtx / np.outer(scale, scale)
        if np.linalg.cond(a) > 1e8:
            return  # the steps seen do not vary enough yet (e.g. only decodes of one size)
        coef = np.linalg.solve(a, self._xty / scale) / scale
        if coef[2] < 0:  # no attention term visible: fit fixed + per_token alone
            sub = self._xtx[:2, :2]
            if np.linalg.cond(sub) > 1e8:
                return
            coef = np.append(np.linalg.solve(sub, self._xty[:2]), 0.0)
        if coef[0] < 0 or coef[1] <= 0:
            return
        self.fit = StepFit(float(coef[0]), float(coef[1]), float(coef[2]))

    def seconds(self, num_new_tokens: int, num_pairs: int) -> float:
        return self.fit.seconds(num_new_tokens, num_pairs)
