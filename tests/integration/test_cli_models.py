"""`kvdeck models` run as a user runs it: a subprocess of the installed console script."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def kvdeck(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvdeck.console.cli", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )


def test_report_json_on_tiny_model(tiny_llama: Path) -> None:
    r = kvdeck("models", "--json", "--block-size", "4", str(tiny_llama))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["architecture"] == "llama" and data["num_kv_heads"] == 2
    assert data["kv_bytes_per_token"]["fp16"] == 2 * 2 * 2 * 16 * 2
    assert data["blocks_per_1k_tokens"] == 256
    assert data["kv_bytes_per_block"]["q8_0"] == 4 * data["kv_bytes_per_token"]["q8_0"]


def test_report_table_on_tiny_model(tiny_gemma3: Path) -> None:
    r = kvdeck("models", str(tiny_gemma3))
    assert r.returncode == 0, r.stderr
    for text in ("gemma3", "KV heads", "sliding window", "q4_0", "blocks per 1K tokens"):
        assert text in r.stdout


@pytest.mark.parametrize(
    "arg, message",
    [
        ("no-such-model", "Unknown model 'no-such-model'; known models are"),
        ("/nonexistent/dir/model.gguf", "does not exist"),
    ],
)
def test_bad_targets_one_sentence_exit_2(arg: str, message: str) -> None:
    r = kvdeck("models", arg)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr + r.stdout


def test_not_gguf_and_truncated(tmp_path: Path, tiny_llama: Path) -> None:
    text = tmp_path / "readme.txt"
    text.write_text("not a model, just some words in a file")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_llama.read_bytes()[:5000])
    for path, message in ((text, "is not a GGUF file"), (cut, "is truncated")):
        r = kvdeck("models", str(path))
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_bad_block_size_is_refused() -> None:
    r = kvdeck("models", "--block-size", "0", "--default")
    assert r.returncode == 2
    assert "--block-size must be an integer from 1 to 256, got 0." in r.stderr


def test_listing_includes_user_dir(tmp_path: Path, tiny_llama: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tiny.gguf").write_bytes(tiny_llama.read_bytes())
    r = kvdeck("models", "--json", env={"KVDECK_MODELS": str(tmp_path / "m")})
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows["tiny"]["source"] == "user directory"
    assert rows["gemma3-270m"]["source"] == "embedded" and rows["gemma3-270m"]["available"]


@pytest.mark.slow
def test_default_model_acceptance() -> None:
    r = kvdeck("models", "--json", "gemma3-270m")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert (data["num_layers"], data["num_kv_heads"], data["head_dim"]) == (18, 1, 256)
    assert data["kv_bytes_per_token"]["fp16"] == 18_432


def test_the_bare_kvdeck_takes_the_consoles_options(tmp_path: Path) -> None:
    """`kvdeck --executor X` is `kvdeck console --executor X`: the option reaches the
    settings (a bad value is refused by name), and `kvdeck models` does not run the
    llama.cpp probe."""
    cache = {"KVDECK_CACHE": str(tmp_path)}
    r = kvdeck("--executor", "bogus", env=cache)
    assert r.returncode == 2 and "executor must be one of sim, torch, llama_cpp" in r.stderr
    r = kvdeck("--help")
    assert "--executor" in r.stdout and "--llama-repack" in r.stdout
    r = kvdeck("--executor", "sim", "models", env=cache)
    assert r.returncode == 2 and "put them after `models`" in r.stderr
    assert kvdeck("models", env=cache).returncode == 0
    assert not (tmp_path / "llama-probe.json").exists()
