"""The torch executor's LoRA adapters (`runtime/models/lora.py`): loading them, the slots
they take out of the KV budget, and making a step's adapters resident. `TorchExecutor`
mixes this in; it reads the executor's model, device, config and link."""

from __future__ import annotations

import time
from pathlib import Path

from kvdeck.runtime.core.step_data import SchedulerOutput
from kvdeck.runtime.kv.transfers import Transfer
from kvdeck.runtime.models.lora import AdapterSet, check_fits, load_adapter


class TorchAdapters:
    """`TorchExecutor`'s `Adapters` capability."""

    def load_adapter(self, name: str, path: str | Path, max_loras: int = 0) -> int:
        """Serve the LoRA adapter at `path` as `name` (`runtime/models/lora.py`), at most
        `max_loras` of them resident at once (0: all); its bytes. ConfigError when it does
        not fit this model."""
        adapter = load_adapter(name, path)
        check_fits(adapter, self.model.masters, self.cfg.arch.name, self.cfg.arch.rope_style)
        if self.model.adapters is None:
            self.model.adapters = AdapterSet(self.device, self.model.dtype, max_loras)
        self.model.adapters.add(adapter)
        return adapter.num_bytes

    def describe_adapters(self) -> str:
        a = self.model.adapters
        return "" if a is None else \
            f"LoRA {len(a.adapters)}/{len(a.host)} resident · {a.num_bytes / 2**20:.1f} of " \
            f"{a.reserve_bytes / 2**20:.1f} MiB reserved"

    @property
    def adapter_reserve_bytes(self) -> int:
        """Device bytes the adapters' slots can take at most (`AdapterSet.reserve_bytes`),
        which the KV pool's budget leaves out."""
        a = self.model.adapters
        return 0 if a is None else a.reserve_bytes

    def _load_adapters(self, plan: SchedulerOutput, t0: float) -> list[Transfer]:
        """The step's adapters made resident: each load a timed host → device copy, each
        unload (the least recently used, for a slot) a transfer of no bytes."""
        start = time.perf_counter() - t0
        loads, unloads = self.model.adapters.make_resident(
            {c.request.sampling.lora for c in plan.chunks} - {None})
        out = [Transfer("lora unload", "d2h", f"adapter {n}", 0, 0, start, 0.0, 0.0, 0.0)
               for n in unloads]
        for name, nbytes, seconds in loads:
            out.append(Transfer("lora", "h2d", f"adapter {name}", 0, nbytes, start, seconds,
                                nbytes / self.info.link_bandwidth, seconds))
            start += seconds
        return out
