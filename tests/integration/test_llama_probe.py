"""llama.cpp's start-up probe: a short decode in a child process decides whether its
re-packed kernels, its plain ones or neither are used here; the verdict is cached so a second
start does not probe again; the executor choice follows it. A machine whose AMX kernels
crash is simulated with `KVDECK_FAULT` (`runtime/faults.py`) where the real one does not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors import llama_cpp_probe as probe
from kvdeck.runtime.executors.choice import choose_executor

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch, gemma_path):
    """An empty cache directory: the probe has not run on this 'machine' yet."""
    monkeypatch.setenv("KVDECK_CACHE", str(tmp_path))
    return tmp_path


def probes_run(cache) -> int:
    log = cache / probe.LOG_FILE
    return log.read_text().count("--- probe:") if log.exists() else 0


def cli(*args: str, env_cache) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "kvdeck.console.cli", *args], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "KVDECK_CACHE": str(env_cache)})


def test_the_verdict_is_measured_once_and_read_from_the_cache_after(fresh_cache) -> None:
    first = probe.verdict()
    assert not first.cached and first.attempts
    assert first.attempts[-1].outcome == "ok"  # this machine runs llama.cpp in some mode
    # Re-packed kernels are tried first; a second attempt happens only after a crash.
    assert first.attempts[0].repack is True
    if len(first.attempts) == 2:
        assert first.attempts[0].outcome.startswith("signal") and first.repack is False
    assert probes_run(fresh_cache) == len(first.attempts)
    record = json.loads((fresh_cache / probe.CACHE_FILE).read_text())[first.key]
    assert record["repack"] == first.repack
    assert record["parts"]["llama_cpp_python"] and record["parts"]["cpu_flags"]
    # A second start (a new process) reads the verdict and probes nothing.
    r = cli("probe", "--json", env_cache=fresh_cache)
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout)
    assert again["cached"] and again["repack"] == first.repack and again["key"] == first.key
    assert probes_run(fresh_cache) == len(first.attempts)
    # --refresh probes again.
    assert not probe.verdict(refresh=True).cached
    assert probes_run(fresh_cache) > len(first.attempts)


def test_a_crash_with_repacked_kernels_falls_back_to_plain_ones(fresh_cache,
                                                                monkeypatch) -> None:
    monkeypatch.setenv("KVDECK_FAULT", "repack-decode")
    v = probe.verdict()
    assert [(a.repack, a.outcome) for a in v.attempts] == [(True, "signal SIGSEGV"),
                                                           (False, "ok")]
    assert v.repack is False and "crash on this CPU" in v.note
    assert probe.resolve_repack("auto") == (False, v.note)
    executor, extra, why = choose_executor({})
    assert executor == "llama_cpp" and extra["llama_repack"] == "off"
    assert v.note in why
    # The settings the choice adds say how llama.cpp runs; a user's on/off is left alone.
    assert choose_executor({"llama_repack": "on"})[1] == {}


def test_where_llama_cpp_crashes_either_way_the_console_runs_torch(fresh_cache,
                                                                   monkeypatch) -> None:
    monkeypatch.setenv("KVDECK_FAULT", "probe")
    v = probe.verdict()
    assert v.repack is None and [a.outcome for a in v.attempts] == ["signal SIGSEGV"] * 2
    executor, extra, why = choose_executor({})
    assert executor == "torch" and "crashes on this CPU" in why
    with pytest.raises(ConfigError, match="--executor torch"):
        probe.resolve_repack("auto")
    # An explicit mode is the user's word: no probe, no refusal.
    assert probe.resolve_repack("off") == (False, "")


def test_an_explicit_mode_skips_the_probe(fresh_cache) -> None:
    assert probe.resolve_repack("on") == (True, "")
    assert probe.resolve_repack("off") == (False, "")
    assert probes_run(fresh_cache) == 0
    with pytest.raises(ConfigError, match="llama_repack must be one of auto, on, off"):
        probe.resolve_repack("maybe")


def test_the_executor_and_references_open_llama_cpp_as_the_verdict_says(
        fresh_cache, monkeypatch, gemma_path) -> None:
    """On a simulated crashing machine the executor decodes without re-packed weights and
    says so; the tests' reference `Llama` opens the same way and agrees token for token."""
    from kvdeck.runtime.core.config import EngineConfig, Knobs
    from kvdeck.runtime.core.engine import Engine
    from kvdeck.runtime.core.request import SamplingParams
    from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor
    from kvdeck.runtime.text.tokenizer import Tokenizer

    monkeypatch.setenv("KVDECK_FAULT", "repack-decode")
    ex = LlamaCppExecutor(gemma_path, threads=2, batch_invariant=True)
    assert ex.repack is False and "crash on this CPU" in ex.info.start_note
    assert "not re-packed" in ex.describe_weights("fp16").detail
    tok = Tokenizer(gemma_path)
    prompt = tok.encode("The capital of France is")
    e = Engine(EngineConfig(knobs=Knobs(max_num_seqs=8)), ex)
    e.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                  request_id="a")
    while e.has_work:
        e.step()
        e.check_integrity()
    ours = list(e.completed[0].output_token_ids)
    e.close()
    llm = probe.open_llama(gemma_path, n_ctx=256, n_threads=2, verbose=False)
    theirs = []
    for t in llm.generate(prompt, temp=0.0):
        theirs.append(t)
        if len(theirs) == 8:
            break
    llm.close()
    assert ours == theirs
    with pytest.raises(ConfigError, match="llama_repack"):
        LlamaCppExecutor(gemma_path, repack="sometimes")


def test_the_start_up_line_says_how_llama_cpp_runs(fresh_cache, monkeypatch) -> None:
    from kvdeck.runtime.session import build_session
    from kvdeck.runtime.settings import resolve

    monkeypatch.setenv("KVDECK_FAULT", "repack-decode")
    for values in ({}, {"executor": "llama_cpp"}):
        session = build_session(resolve(values, default_executor="auto"))
        try:
            assert session.executor.repack is False
            assert session.settings.executor_choice.count("crash on this CPU") == 1
        finally:
            session.close()
