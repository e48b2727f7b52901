"""One llama.cpp model and its context of slots, over llama-cpp-python's low-level API:
what the `llama_cpp` executor's target and its draft model each hold
(`runtime/executors/llama_cpp.py` explains the layout)."""

from __future__ import annotations

import ctypes
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from kvdeck.runtime.errors import ConfigError, ModelFileError, StepError
from kvdeck.runtime.executors.llama_cpp_probe import model_params
from kvdeck.runtime.faults import crash_at
from kvdeck.runtime.text.tokenizer import quiet_stderr

KV_TYPES = {"fp16": "GGML_TYPE_F16", "q8_0": "GGML_TYPE_Q8_0", "q4_0": "GGML_TYPE_Q4_0"}
"""kvdeck KV format -> llama.cpp ggml type of K and V."""

FLASH_ATTN = 1
"""llama.cpp's flash-attention mode for every context kvdeck creates (1: enabled)."""

Row = tuple[int, int, int, int]
"""(token, position, slot, logits row or -1) of one batch row."""


def one_batch(groups: list[list[Row]]) -> list[list[Row]]:
    """Every row of `groups` in one group, in slot order (positions ascending within a
    slot). With a stream per slot llama.cpp splits a batch into micro-batches of
    *consecutive, increasing* sequence ids with an equal number of tokens each: in slot
    order the decode rows of slots 0..7 share one pass over the weights, and a prefill
    chunk's rows past its first continue in micro-batches of their own; in another order
    a batch falls apart into a micro-batch per slot."""
    rows = [row for group in groups for row in group]
    return [sorted(rows, key=lambda r: (r[2], r[1]))] if rows else []


def lib():
    import llama_cpp  # imported here: loading the shared library takes a moment
    from llama_cpp._logger import set_verbose

    # llama-cpp-python's log callback prints llama.cpp's info lines (some outside any
    # quiet_stderr block, e.g. the SWA cache notice) unless its logger is set to errors.
    set_verbose(False)
    return llama_cpp


def set_adapter(ctx, adapter) -> None:
    """Apply `adapter` (a loaded llama.cpp adapter, or None: the base model) to every row
    `ctx` decodes next (`llama_cpp_lora.py`)."""
    L = lib()
    if adapter is None:
        rc = L.llama_set_adapters_lora(ctx, None, 0, None)
    else:
        rc = L.llama_set_adapters_lora(ctx, (L.llama_adapter_lora_p_ctypes * 1)(adapter), 1,
                                       (ctypes.c_float * 1)(1.0))
    if rc != 0:
        raise StepError(f"llama.cpp could not set a LoRA adapter on its context ({rc}).")


class LlamaModel:
    """A GGUF loaded by llama.cpp (`n_gpu_layers` on a Metal or CUDA build; -1 all), with
    its weights re-packed for the CPU's gemm kernels (llama.cpp's extra buffer types: faster,
    but they crash on some CPUs, so the caller passes what `llama_cpp_probe` decided)."""

    def __init__(self, path: Path, n_gpu_layers: int, repack: bool):
        L = lib()
        L.llama_backend_init()
        mp = model_params(n_gpu_layers, repack)
        self.repack = repack
        t0 = time.perf_counter()
        with quiet_stderr():
            self.ptr = L.llama_model_load_from_file(str(path).encode(), mp)
        if not self.ptr:
            raise ModelFileError(f"llama.cpp could not load {path}; is it a GGUF model of an "
                                 "architecture llama.cpp supports?")
        self.load_seconds = time.perf_counter() - t0
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.vocab_size = L.llama_vocab_n_tokens(self.vocab)
        self.weight_bytes = int(L.llama_model_size(self.ptr))
        self._free = released(self, L.llama_model_free, self.ptr)

    def close(self) -> None:
        """Free the model: after its contexts' `close()` (a context collected unclosed
        holds the model until it is freed)."""
        self._free()
        self.ptr = None


class LlamaContext:
    """A context of `n_parallel` slots, each a sequence id with a KV stream of its own of
    `n_ctx / n_parallel` cells, in `kv_format`; decodes groups of rows."""

    def __init__(self, model: LlamaModel, n_ctx: int, n_parallel: int, threads: int,
                 n_batch: int, kv_format: str):
        L = lib()
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = min(n_batch, n_ctx)
        cp.n_seq_max = n_parallel
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = False  # a stream per slot: see the executor's docstring
        cp.swa_full = True  # cached prefixes stay valid in sliding-window layers
        cp.no_perf = True
        cp.type_k = cp.type_v = getattr(L, KV_TYPES[kv_format])
        # Flash attention always: on a 2-core AVX-512 CPU it decodes 8 rows at 1,152
        # positions in 77 ms against 108 without, prefills 21 % faster there and is no
        # slower at 131 positions; a quantized V cache needs it anyway, and llama-server's
        # `--flash-attn auto` picks it. A reference `Llama` must use it too for its logits
        # to agree (`open_llama` does).
        cp.flash_attn_type = FLASH_ATTN
        with quiet_stderr():
            self.ctx = L.llama_init_from_model(model.ptr, cp)
        if not self.ctx:
            raise ConfigError(f"llama.cpp could not create a context of {n_ctx:,} cells in "
                              f"{kv_format}; lower the KV budget or use another kv_format.")
        self.mem = L.llama_get_memory(self.ctx)
        self.repack = model.repack
        self.batch_size = cp.n_batch
        self.batch = L.llama_batch_init(cp.n_batch, 0, 1)
        self._free = released(self, free_native_context, self.ctx, self.batch, model)
        self.vocab_size = model.vocab_size
        self.adapter = None
        """The LoRA adapter set on the context now (`llama_cpp_lora.py`; None: none)."""

    def remove(self, seq: int, start: int = 0) -> None:
        """Drop positions `start`.. of slot `seq`'s stream."""
        lib().llama_memory_seq_rm(self.mem, seq, start, -1)

    def copy_stream(self, src: int, dst: int, start: int) -> None:
        """Slot `dst` takes slot `src`'s first `start` positions (llama.cpp copies whole
        streams only, so the copy is cut at `start`)."""
        L = lib()
        L.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
        L.llama_memory_seq_rm(self.mem, dst, start, -1)

    def decode(self, groups: list[list[Row]], num_out: int,
               adapters: list | None = None) -> torch.Tensor:
        """Decode each group of rows in its own `llama_decode` (a group longer than the
        batch in several), with `adapters[i]` set for group i (None: no LoRA adapter); the
        logits rows as a float32 tensor [num_out, vocab]."""
        L = lib()
        if self.repack:
            crash_at("repack-decode")
        crash_at("decode")
        out = np.empty((num_out, self.vocab_size), dtype=np.float32)
        batch = self.batch
        for index, rows in enumerate(groups):
            adapter = adapters[index] if adapters else None
            if adapter is not self.adapter:
                set_adapter(self.ctx, adapter)
                self.adapter = adapter
            for first in range(0, len(rows), self.batch_size):
                part = rows[first:first + self.batch_size]
                batch.n_tokens = len(part)
                for i, (tok, pos, seq, dst) in enumerate(part):
                    batch.token[i] = tok
                    batch.pos[i] = pos
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = seq
                    batch.logits[i] = dst >= 0
                rc = L.llama_decode(self.ctx, batch)
                if rc != 0:
                    raise StepError(f"llama.cpp could not decode the step (llama_decode "
                                    f"returned {rc}: "
                                    f"{'no free cells' if rc == 1 else 'an error'}).")
                for i, (_, _, _, dst) in enumerate(part):
                    if dst >= 0:
                        ptr = L.llama_get_logits_ith(self.ctx, i)
                        out[dst] = np.ctypeslib.as_array(
                            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                            shape=(self.vocab_size,))
        return torch.from_numpy(out)

    def close(self) -> None:
        self._free()
        self.batch = self.ctx = self.mem = None


def free_native_context(ctx, batch, keep: LlamaModel) -> None:
    """Free a context and its batch. `keep`, the context's model, is an argument only so
    that the model outlives the context however the two are collected (llama_free reads
    the model)."""
    L = lib()
    L.llama_batch_free(batch)
    L.llama_free(ctx)


def released(owner: object, free, *args) -> weakref.finalize:
    """`free(*args)`, to be called by the owner's `close()`, and by the collector if that
    never was; once either way (a later call does nothing), and never from the interpreter's
    exit on. An executor dropped without `close()` (a server stopped and let go, a
    session) otherwise keeps its native model, KV and mapping of the file for the life of
    the process; at exit the process's end frees them, and native calls during shutdown are
    the ones that crash."""
    finalizer = weakref.finalize(owner, free, *args)
    finalizer.atexit = False
    return finalizer
