"""Which real executor a command runs when no `executor` is given: the faster one for the
interactive console on this machine.

The rule, measured (docs/executors.md, "Default executor"; `make bench`,
`benchmarks/torch_vs_llama.py`):

1. A setting only the torch executor has (`--dtype`, `--device`, a re-packed
   `--weight-format`, `--offload-layers`, `--host-kv-memory-gib`, ...) picks torch: the
   user asked for one of its mechanisms.
2. Without llama-cpp-python, torch.
3. A CUDA GPU that torch can use, with a llama.cpp built for the CPU only, picks torch:
   CUDA kernels beat llama.cpp's CPU kernels.
4. llama.cpp is trusted only as its start-up probe found it (`llama_cpp_probe.py`): where
   its re-packed kernels crash (AMX on some Xeons), llama_cpp without them; where it
   crashes either way, torch.
5. Otherwise llama_cpp. On a CPU it decodes one request about 2.6× as fast as the torch
   executor in fp32 (0.95× against 0.36× llama-cpp-python's own generation, Gemma 3 270M,
   2 threads), and one request is what an operator at the console feels first. With a
   Metal or CUDA build of llama.cpp, every layer goes to the GPU (`n_gpu_layers = -1`)
   unless `--n-gpu-layers` says otherwise.
"""

from __future__ import annotations

from typing import Any

TORCH_ONLY: dict[str, Any] = {
    "device": "auto", "dtype": None, "int4_group_size": 32,
    "int8_group_size": 64, "weight_activations": "measured", "offload_layers": 0,
    "host_kv_memory_bytes": 0, "preemption": "recompute", "free_window_kv": False,
}
"""Torch-executor settings, with the values that leave them unused."""

TORCH_ONLY_WEIGHT_FORMATS = ("dense", "measured")
"""`weight_format` values the llama_cpp executor also runs (the GGUF's own weights)."""


FLAG_NAMES = {"host_kv_memory_bytes": "--host-kv-memory-gib"}
"""Settings whose flag is not `--` + the key with dashes."""


def _flag(key: str) -> str:
    return FLAG_NAMES.get(key, "--" + key.replace("_", "-"))


def _torch_only_setting(values: dict[str, Any]) -> str | None:
    """The flag of the first torch-only setting `values` use, if any."""
    for key, unused in TORCH_ONLY.items():
        if key in values and values[key] != unused:
            return _flag(key)
    wf = values.get("weight_format")
    if wf is not None and wf not in TORCH_ONLY_WEIGHT_FORMATS:
        return "--weight-format"
    return None


def llama_cpp_gpu_offload() -> bool | None:
    """Whether the installed llama.cpp offloads layers to a GPU (Metal or CUDA build);
    None when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return bool(llama_cpp.llama_supports_gpu_offload())


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def choose_executor(values: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    """(executor, settings it adds, why) for settings `values` that name no executor."""
    flag = _torch_only_setting(values)
    if flag is not None:
        return "torch", {}, f"torch, because {flag} is a torch-executor setting"
    offload = llama_cpp_gpu_offload()
    if offload is None:
        return "torch", {}, "torch, because llama-cpp-python is not installed"
    if not offload and torch_cuda():
        return "torch", {}, ("torch, because torch sees a CUDA GPU and this llama.cpp is "
                             "built for the CPU only")
    extra, note = _probed(values)
    if extra is None:
        return "torch", {}, f"torch, because {note}"
    if offload:
        extra.update({} if "n_gpu_layers" in values else {"n_gpu_layers": -1})
        why = ("llama_cpp, because this llama.cpp offloads to the GPU (all layers unless "
               "--n-gpu-layers says otherwise)")
    else:
        why = ("llama_cpp, because on a CPU llama.cpp's kernels decode one request faster "
               "than the torch executor (--executor torch for its mechanisms)")
    return "llama_cpp", extra, why + (f"; {note}" if note else "")


def _probed(values: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(settings llama_cpp runs with, or None where llama.cpp crashes here; the probe's
    line) for `--llama-repack auto`."""
    from kvdeck.runtime.errors import ModelNotFoundError
    from kvdeck.runtime.executors.llama_cpp_probe import verdict

    if values.get("llama_repack", "auto") != "auto":
        return {}, ""
    try:
        v = verdict(values.get("model"))
    except (ModelNotFoundError, OSError):
        return {}, ""  # nothing to probe with: the executor names the missing model
    if v.repack is None:
        return None, v.note
    return {"llama_repack": "on" if v.repack else "off"}, v.note
