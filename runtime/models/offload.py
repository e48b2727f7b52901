"""FFN weights offloaded to host memory and prefetched into device buffers before their layer.

The FFN matrices of the chosen layers (whatever format they are packed in: every tensor a
packed matrix holds) are copied to host memory (pinned on CUDA) and their device tensors
dropped; each offloaded layer's matrices then point at the tensors of one of `num_buffers`
device buffers (layer k of the offloaded ones uses buffer `k mod num_buffers`), which
receive that layer's weights before it runs:

- one buffer: the copy runs when the layer is reached, and compute waits for all of it;
- two buffers: when offloaded layer k starts, the copy of layer k+1 starts into the other
  buffer — on CUDA on a separate stream (ordered after layer k−1 finished with that buffer
  by an event), on the CPU in a worker thread — so it overlaps the compute in between.

Either way a step moves every offloaded byte over the link once: at least
`bytes / bandwidth` per step, however well it overlaps. Device memory saved is the
offloaded bytes minus the buffers' bytes; the engine gives it to the KV pool.

Each copy is reported as a `transfers.Transfer` with its start (from the step's start), its
duration and its *stall* — how long compute waited for it — so the trace shows the
overlap: with one buffer stall equals duration; with two it is what compute did not hide.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.kv.transfers import Transfer

FFN = ("w_gate", "w_up", "w_down")


def tensor_slots(obj, path: str = "") -> list[tuple[object, object, torch.Tensor]]:
    """Every tensor a packed matrix holds, as (container, key, tensor): an attribute of an
    object or an index of a list, recursing into lists and the matrices `AutoMatrix`
    keeps. Opaque packed parameters (FBGEMM's) are refused."""
    out: list[tuple[object, object, torch.Tensor]] = []
    items = list(vars(obj).items()) if hasattr(obj, "__dict__") else []
    for key, value in items:
        if isinstance(value, torch.Tensor):
            out.append((obj, key, value))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    out.append((value, i, item))
                elif isinstance(item, tuple):  # AutoMatrix segments: (limit, format, matrix)
                    out.extend(s for m in item if hasattr(m, "__dict__")
                               for s in tensor_slots(m))
        elif key == "_packed":
            raise ConfigError("offload_layers cannot move FBGEMM-packed int8 matrices (dtype "
                              "int8); use a float dtype with weight_format int8 instead.")
    return out


def _assign(container, key, tensor: torch.Tensor) -> None:
    if isinstance(container, list):
        container[key] = tensor
    else:
        setattr(container, key, tensor)


class FFNOffload:
    """Offloaded FFN weights of some layers of a `Transformer` and their device buffers."""

    def __init__(self, layers: list, offloaded: list[int], num_buffers: int,
                 device: torch.device, link_bandwidth: float):
        """`layers`: the model's `LayerWeights`; `offloaded`: indices of the layers whose
        FFN matrices move to the host; `link_bandwidth`: bytes/s, for each copy's bound."""
        self.device = device
        self.offloaded = list(offloaded)
        self.index = {layer: k for k, layer in enumerate(self.offloaded)}
        self.link_bandwidth = link_bandwidth
        self.cuda = device.type == "cuda"
        self._slots: list[list[tuple[object, object]]] = []
        self.host: list[list[torch.Tensor]] = []
        for i in self.offloaded:
            found = [s for name in FFN for s in tensor_slots(getattr(layers[i], name))]
            self._slots.append([(c, k) for c, k, _ in found])
            self.host.append([self._to_host(t) for _, _, t in found])
        shapes = [[(t.shape, t.dtype) for t in h] for h in self.host]
        if any(s != shapes[0] for s in shapes):
            raise ConfigError("offload_layers needs layers whose FFN matrices have the same "
                              "shapes and formats; this model's differ between layers.")
        self.num_buffers = min(num_buffers, len(self.offloaded))
        self.buffers = [[torch.empty_like(t, device=device) for t in self.host[0]]
                        for _ in range(self.num_buffers)]
        for k, slots in enumerate(self._slots):  # the device copies are dropped here
            for (container, key), buf in zip(slots, self.buffers[k % self.num_buffers],
                                             strict=True):
                _assign(container, key, buf)
        self.layer_bytes = sum(t.numel() * t.element_size() for t in self.host[0])
        self._pool = ThreadPoolExecutor(1, "kvdeck-prefetch") \
            if not self.cuda and self.num_buffers > 1 else None
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._pending: dict[int, Future | tuple] = {}
        self._freed: list[object | None] = [None] * self.num_buffers
        self._t0 = 0.0
        self._origin = None
        self._log: list[tuple[int, float, float, float]] = []
        """(offloaded index, start, seconds, stall) of each copy this step (CPU)."""
        self._events: list[tuple[int, object, object, object]] = []
        """(offloaded index, copy start, copy end, compute reached the layer) (CUDA)."""

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = t.detach().to("cpu", copy=True)
        return host.pin_memory() if self.cuda else host

    @property
    def offloaded_bytes(self) -> int:
        return self.layer_bytes * len(self.offloaded)

    @property
    def buffer_bytes(self) -> int:
        return self.layer_bytes * self.num_buffers

    # -- the forward pass's hooks -----------------------------------------------------------

    def begin(self) -> None:
        """A forward pass starts: with two buffers, prefetch the first offloaded layer."""
        self._t0 = time.perf_counter()
        self._log, self._events = [], []
        if self.cuda:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
        if self.num_buffers > 1:
            self._start(0)

    def before(self, layer: int) -> None:
        """Layer `layer` is about to run: its FFN weights must be in its buffer."""
        k = self.index.get(layer)
        if k is None:
            return
        if self.num_buffers == 1:
            self._start(k)
        self._wait(k)
        if self.num_buffers > 1 and k + 1 < len(self.offloaded):
            self._start(k + 1)

    def after(self, layer: int) -> None:
        """Layer `layer` ran: on CUDA its buffer is free once the queued work is done."""
        k = self.index.get(layer)
        if k is not None and self.cuda:
            done = torch.cuda.Event()
            done.record()
            self._freed[k % self.num_buffers] = done

    def _copy(self, k: int) -> tuple[float, float]:
        t = time.perf_counter()
        # The buffers are inference tensors; a worker thread is outside the caller's mode.
        with torch.inference_mode():
            for dst, src in zip(self.buffers[k % self.num_buffers], self.host[k], strict=True):
                dst.copy_(src)
        return t - self._t0, time.perf_counter() - t

    def _start(self, k: int) -> None:
        if self.cuda:
            stream = self._stream if self.num_buffers > 1 else torch.cuda.current_stream()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                freed = self._freed[k % self.num_buffers]
                if freed is not None and self.num_buffers > 1:
                    stream.wait_event(freed)  # the layer before using this buffer is done
                start.record(stream)
                for dst, src in zip(self.buffers[k % self.num_buffers], self.host[k],
                                    strict=True):
                    dst.copy_(src, non_blocking=True)
                end.record(stream)
            self._pending[k] = (start, end)
        elif self._pool is not None:
            self._pending[k] = self._pool.submit(self._copy, k)
        else:
            self._pending[k] = self._copy(k)

    def _wait(self, k: int) -> None:
        pending = self._pending.pop(k)
        if self.cuda:
            start, end = pending
            reached = torch.cuda.Event(enable_timing=True)
            reached.record()  # compute reached the layer here (device timeline)
            torch.cuda.current_stream().wait_event(end)
            self._events.append((k, start, end, reached))
            return
        t = time.perf_counter()
        start, seconds = pending.result() if isinstance(pending, Future) else pending
        stall = seconds if self.num_buffers == 1 else time.perf_counter() - t
        self._log.append((k, start, seconds, stall))

    def transfers(self) -> list[Transfer]:
        """This step's copies (call after the step's work is complete: on CUDA, after a
        synchronize)."""
        out = []
        bound = self.layer_bytes / self.link_bandwidth if self.link_bandwidth else 0.0
        if self.cuda:
            for k, start, end, reached in self._events:
                begin = self._origin.elapsed_time(start) / 1e3
                seconds = start.elapsed_time(end) / 1e3
                stall = seconds if self.num_buffers == 1 else \
                    max(reached.elapsed_time(end) / 1e3, 0.0)
                out.append(self._transfer(k, begin, seconds, bound, stall))
            return out
        return [self._transfer(k, start, seconds, bound, stall)
                for k, start, seconds, stall in self._log]

    def _transfer(self, k: int, start: float, seconds: float, bound: float,
                  stall: float) -> Transfer:
        return Transfer("weights", "h2d", f"layer {self.offloaded[k]} ffn", 0,
                        self.layer_bytes, start, seconds, bound, min(stall, seconds))

    def restore(self) -> None:
        """Put every offloaded layer's weights back on the device, in tensors of its own,
        and drop the buffers."""
        for slots, host in zip(self._slots, self.host, strict=True):
            for (container, key), t in zip(slots, host, strict=True):
                _assign(container, key, t.to(self.device, copy=True))
        self.buffers = []
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
