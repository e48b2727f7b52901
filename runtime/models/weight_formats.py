"""Weight formats per layer group, as the `weight_format` knob writes them.

Groups: `attn` (Q, K, V and output projections), `ffn` (gate, up, down) and `head` (the
output projection to the vocabulary — on Gemma 3 270M, 168M of its 268M matrix parameters).
Formats:

    dense              dense weights in the executor's compute dtype (as loaded)
    fp32, bf16, fp16   dense weights in that dtype (activations cast to it for the product)
    int8               weight-only, a scale per output channel per 64 inputs
                       (`linear.WeightOnlyInt8`)
    int4               weight-only, group-wise scale and zero (`linear.WeightOnlyInt4`)
    auto               per step, the fastest of dense (compute dtype), bf16 and int8 for
                       the step's row count (its packed tokens), from the crossovers
                       measured at start-up (`kernels.py`); every packing stays resident.
                       int4 is never chosen for you: its accuracy cost is the largest

A knob value is one format for every group (`int8`), or groups named with their formats
(`attn=int8,ffn=int4,head=bf16`; groups left out stay as they are), or `measured`: per
group, the fastest at batch 1 among dense (the compute dtype), bf16 and int8, as the
start-up micro-benchmark found it.
"""

from __future__ import annotations

from kvdeck.runtime.errors import ConfigError

GROUPS = ("attn", "ffn", "head")
FORMATS = ("dense", "fp32", "bf16", "fp16", "int8", "int4", "auto")
DENSE = ("fp32", "bf16", "fp16")
PARAM_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.5}
"""Bytes per weight, codes only (scales add ~0.4 % for int8 per channel, 1/8 byte per
weight for int4 in groups of 32 with bf16 scale and zero)."""


def parse_weight_format(text: str, current: dict[str, str] | None = None) -> dict[str, str]:
    """The formats per group a knob value names, over `current` for groups it leaves out;
    a ConfigError sentence for anything else. `measured` is resolved by the executor."""
    value = text.strip()
    if value == "measured":
        return {g: "measured" for g in GROUPS}
    if "=" not in value:
        if value not in FORMATS:
            raise ConfigError(f"weight_format must be one of {', '.join(FORMATS)}, measured, or "
                              f"per group like attn=int8,ffn=int4,head=bf16; got {text!r}.")
        return {g: value for g in GROUPS}
    out = dict(current or {g: "dense" for g in GROUPS})
    for item in value.split(","):
        group, _, fmt = item.partition("=")
        group, fmt = group.strip(), fmt.strip()
        if group not in GROUPS:
            raise ConfigError(f"weight_format names group {group!r}; groups are "
                              f"{', '.join(GROUPS)}.")
        if fmt not in FORMATS:
            raise ConfigError(f"weight_format gives {group} the format {fmt!r}; formats are "
                              f"{', '.join(FORMATS)}.")
        out[group] = fmt
    return out


def format_weight_format(formats: dict[str, str]) -> str:
    """The knob's text for formats per group: one word when every group agrees."""
    values = {formats[g] for g in GROUPS}
    if len(values) == 1:
        return values.pop()
    return ",".join(f"{g}={formats[g]}" for g in GROUPS)
