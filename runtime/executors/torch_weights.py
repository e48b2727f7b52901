"""How the torch executor packs its matrices into weight formats.

The kernel micro-benchmark of this machine and model (`models/kernels.py`, measured on
first use and cached on disk) decides the activation dtype quantized formats take, the
row-count rule of `auto` and the row count from which int8 runs its gemm kernel; packing
starts from the master copies the model keeps (on the host, on an accelerator, so a
compact format frees device memory).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvdeck.runtime.core.config import check_int
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.models.kernels import FLOAT, KernelTable, describe, load_or_measure
from kvdeck.runtime.models.linear import INT4_GROUP_SIZES, AutoMatrix, pack_matrix
from kvdeck.runtime.models.transformer import GROUP_MATRICES, Transformer

log = logging.getLogger("kvdeck.torch")


class WeightPacker:
    """Packs one model's matrices for one device and compute dtype."""

    AUTO_MAX_ROWS = 4096

    def __init__(self, model: Transformer, device: torch.device, compute: str,
                 int4_group_size: int, int8_group_size: int, weight_activations: str,
                 kernel_cache: Path):
        """`compute`: the float dtype activations are in (fp32 under the int8 FBGEMM
        dtypes). See `TorchExecutor` for the other arguments."""
        if int4_group_size not in INT4_GROUP_SIZES:
            raise ConfigError(f"int4_group_size must be one of "
                              f"{', '.join(map(str, INT4_GROUP_SIZES))}, got {int4_group_size}.")
        check_int("int8_group_size", int8_group_size, 0, 1 << 16)
        if weight_activations not in ("measured", *FLOAT):
            raise ConfigError(f"weight_activations must be measured, {', '.join(FLOAT)}; got "
                              f"{weight_activations!r}.")
        self.model, self.device = model, device
        self.compute = compute
        self.int4_group_size, self.int8_group_size = int4_group_size, int8_group_size
        self.weight_activations = weight_activations
        self.kernel_cache = kernel_cache
        self._kernels: KernelTable | None = None
        self._auto_rules: dict[str, list[tuple[int, str]]] = {}

    @property
    def measured(self) -> bool:
        """True once the activation dtypes are known without a measurement to come."""
        return self._kernels is not None or self.weight_activations != "measured"

    def kernel_lines(self) -> tuple[str, ...]:
        """The kernel measurements in lines; empty before they are made."""
        return tuple(describe(self._kernels)) if self._kernels is not None else ()

    @property
    def kernels(self) -> KernelTable:
        """The kernel micro-benchmark for this machine and model (measured on first use,
        then cached on disk)."""
        if self._kernels is None:
            m = self.model
            shapes = {"attn": tuple(m.masters[0]["wq"][0].shape),
                      "ffn": tuple(m.masters[0]["w_up"][0].shape),
                      "head": tuple(m.head_master.shape)}
            self._kernels = load_or_measure(shapes, self.device, self.compute, self.kernel_cache,
                                            self.int4_group_size, self.int8_group_size)
            verb = "read from cache" if self._kernels.cached else \
                f"measured in {self._kernels.seconds_spent:.1f} s"
            log.info("kernel table %s: %s", verb, "; ".join(describe(self._kernels)))
        return self._kernels

    def masters_to_host(self) -> None:
        """On an accelerator the master copies that re-packing starts from live in host
        memory, so a compact format frees device memory (the dense matrices on the device
        are dropped when their group is re-packed)."""
        m = self.model
        for layer in m.masters:
            for name, (w, b) in layer.items():
                layer[name] = (w.cpu(), b.cpu() if b is not None else None)
        m.head_master = m.head_master.cpu()

    def masters(self, group: str) -> list[torch.Tensor]:
        """The master copies of a group's matrices (`attn`, `ffn` or `head`)."""
        if group == "head":
            return [self.model.head_master]
        return [layer[n][0] for layer in self.model.masters for n in GROUP_MATRICES[group]]

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, group: str):
        """One matrix of `group` in `fmt`, from its master copy."""
        weight = weight.to(self.device)  # from a host master copy on an accelerator
        bias = bias.to(self.device) if bias is not None else None
        if fmt == "dense":
            return pack_matrix(weight, bias, "dense", FLOAT[self.compute])
        if fmt in FLOAT:
            return pack_matrix(weight, bias, "dense", FLOAT[fmt])
        if fmt == "auto":
            return AutoMatrix([(limit, f, self.pack(weight, bias, f, group))
                               for limit, f in self.auto_segments(group)])
        act = self.activations_for(fmt)
        return pack_matrix(weight, bias, fmt, FLOAT[act], self.int4_group_size,
                           self.int8_group_size,
                           self.int8_gemm_from(group, act) if fmt == "int8" else 1)

    def int8_gemm_from(self, group: str, act: str) -> int:
        """From how many rows a group's int8 matrices run their gemm kernel here: measured
        on the CPU (`KernelTable.int8_gemm_from`); elsewhere there is no packed kernel."""
        if self.device.type != "cpu":
            return 1
        return self.kernels.int8_gemm_from(group, act)

    def activations_for(self, fmt: str) -> str:
        """The activation dtype a quantized format's products take here."""
        if self.weight_activations != "measured":
            return self.weight_activations
        return self.kernels.best_act(fmt)

    def auto_segments(self, group: str) -> list[tuple[int, str]]:
        """`auto`'s rule for a group: (most rows, format) ranges, by measured time — at each
        row count the fastest of dense (compute dtype), bf16 and int8."""
        rule = self._auto_rules.get(group)
        if rule is None:
            candidates = tuple(dict.fromkeys((self.compute, "bf16", "int8")))
            segments: list[tuple[int, str]] = []
            for rows in range(1, self.AUTO_MAX_ROWS + 1):
                best = self.kernels.fastest(group, candidates, rows, self.activations_for)
                if segments and segments[-1][1] == best:
                    segments[-1] = (rows, best)
                else:
                    segments.append((rows, best))
            segments[-1] = (1 << 62, segments[-1][1])
            # Dense weights in the compute dtype are the loaded ones ("dense").
            rule = [(limit, "dense" if f == self.compute else f) for limit, f in segments]
            self._auto_rules[group] = rule
        return rule

