"""The default executor per machine (`kvdeck.runtime.executors.choice`), on this machine's real
llama-cpp-python and torch: which one settings without an executor resolve to, and why."""

from __future__ import annotations

import pytest

from kvdeck.runtime.executors.choice import choose_executor, llama_cpp_gpu_offload, torch_cuda
from kvdeck.runtime.settings import EXECUTOR_DEFAULTS, resolve


def test_a_cpu_machine_with_llama_cpp_defaults_to_it_and_says_why() -> None:
    if llama_cpp_gpu_offload() is not False or torch_cuda():
        pytest.skip("this rule is for a CPU-only llama.cpp on a machine without CUDA")
    settings = resolve({}, {"model": "gemma3-270m"}, default_executor="auto")
    assert settings.executor == "llama_cpp"
    assert settings.session.n_gpu_layers == 0
    # The llama_cpp executor's defaults, not torch's.
    assert settings.engine.knobs.max_num_seqs == EXECUTOR_DEFAULTS["llama_cpp"]["max_num_seqs"]
    assert settings.engine.knobs.max_num_seqs != EXECUTOR_DEFAULTS["torch"].get(
        "max_num_seqs", 256)
    assert "llama_cpp, because on a CPU" in settings.executor_choice


@pytest.mark.parametrize("key, value", [("dtype", "int8"), ("device", "cpu"),
                                        ("weight_format", "int4"),
                                        ("host_kv_memory_bytes", 1 << 30),
                                        ("offload_layers", 2)])
def test_a_torch_only_setting_picks_torch(key: str, value) -> None:
    executor, extra, why = choose_executor({key: value})
    assert (executor, extra) == ("torch", {})
    flag = "--host-kv-memory-gib" if key == "host_kv_memory_bytes" else \
        "--" + key.replace("_", "-")
    assert why == f"torch, because {flag} is a torch-executor setting"


def test_settings_that_leave_torch_mechanisms_unused_do_not_pick_torch() -> None:
    if llama_cpp_gpu_offload() is None:
        pytest.skip("llama-cpp-python is not installed")
    executor, _, _ = choose_executor({"weight_format": "dense", "offload_layers": 0,
                                      "dtype": None})
    assert executor == "llama_cpp" or torch_cuda()


def test_a_named_executor_is_never_overridden() -> None:
    for name in ("torch", "sim", "llama_cpp"):
        settings = resolve({}, {"executor": name}, default_executor="auto")
        assert settings.executor == name and settings.executor_choice == ""
    # Commands that do not choose keep their own default.
    assert resolve({}, {}).executor == "torch"
