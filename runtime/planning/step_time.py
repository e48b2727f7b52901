"""The step-time model behind the sim executor and the planner, in one place so that the two
agree by construction (docs/architecture.md, "Step time").

- **Roofline:** `max(F / (P·MFU), D / (β·MBU))`, with `F = 2·matrix_params·n_new +
  4·pairs·heads·head_dim·layers` (matmuls, then attention's QKᵀ and PV over the causal
  query–key pairs) and `D = D_w + context·k` (weights once, the batch's KV once).
- **Fitted:** `fixed + per_token·n_new + per_pair·pairs`, measured with the profile's own
  weight and KV formats; other formats change the bytes a step reads, priced at the card's
  bandwidth (`extra / (β·MBU)`, never below a tenth of the fitted time).
"""

from __future__ import annotations

from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile, StepFit


def roofline_seconds(model: ModelProfile, hw: HardwareProfile, weight_bytes: float,
                     kv_bytes_per_token: float, num_new: int, num_pairs: int,
                     num_context: int) -> float:
    """One step by the roofline: `num_new` new tokens, `num_pairs` causal pairs and
    `num_context` KV positions read, with `weight_bytes` of matrices read once."""
    flops = 2.0 * model.matrix_params * num_new \
        + 4.0 * num_pairs * model.num_heads * model.head_dim * model.num_layers
    bytes_read = weight_bytes + num_context * kv_bytes_per_token
    return max(flops / (hw.peak_flops * hw.mfu), bytes_read / (hw.bandwidth_bytes_per_s * hw.mbu))


def fitted_seconds(fit: StepFit, hw: HardwareProfile, extra_bytes: float, num_new: float,
                   num_pairs: float, num_sampled: float = 0.0) -> float:
    """One step by the fitted model, plus `extra_bytes` read beyond what the fit measured
    (negative when a smaller format reads less); `num_sampled` rows priced by the fit's
    per-sample term where it has one."""
    seconds = fit.seconds(num_new, num_pairs, num_sampled)
    return max(seconds + extra_bytes / (hw.bandwidth_bytes_per_s * hw.mbu), seconds * 0.1)
