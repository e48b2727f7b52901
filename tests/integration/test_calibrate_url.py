"""`kvdeck calibrate --url`: the step model fitted to a live server from outside, by its token
stream. Against a real `kvdeck serve` of the paced sim (its steps take their modelled time on
the wall clock), the probes must find the steps the sim executor prices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvdeck.runtime.planning.probe import (
    QUICK,
    ProbeError,
    decode_point,
    history_point,
    llama_server_slots,
    mixed_steps,
    prefill_point,
    probe,
    server_name,
)
from kvdeck.runtime.planning.profiles import HardwareProfile, ModelProfile
from tests.servers import sim_process


def stream(first: float, gaps: list[float], queue: float = 0.0, ttft: float = 0.0) -> dict:
    return {"first_token": first, "itls": tuple(gaps), "ttft": ttft, "queue_time": queue}


def test_decode_points_take_only_the_gaps_while_every_request_decodes() -> None:
    # `a` starts alone (gaps of 10), `b` joins at 1.03; both end after 1.10: the window is
    # [1.03, 1.09], where the gaps are 20 — the two-row steps.
    a = stream(1.00, [0.01, 0.01, 0.01, 0.02, 0.02, 0.02, 0.02])
    b = stream(1.03, [0.02, 0.02, 0.02, 0.02])
    p = decode_point([a, b], 2, 100, 8)
    assert p is not None and p.kind == "decode" and p.new_tokens == 2 and p.sampled == 2
    assert p.seconds == pytest.approx(0.02)
    assert p.context == 2 * (104 + 1)
    # One after the other: no moment when both decode, so no point.
    assert decode_point([stream(1.0, [0.01] * 3), stream(2.0, [0.01] * 3)], 2, 100, 4) is None


def test_a_mixed_step_is_the_decoders_gap_that_ends_with_a_prompts_first_token() -> None:
    # The decoder's steps take 10 ms, and 40 where a prompt ran beside it (ending at 1.07);
    # a second prompt's first token at 1.125 falls between two of its tokens: that prompt
    # ran in a step of its own, and gives no mixed step.
    decoder = stream(1.00, [0.01, 0.01, 0.01, 0.04, 0.01, 0.01, 0.03, 0.01, 0.01])
    prompts = [stream(1.0701, []), stream(1.125, []), {"first_token": None, "itls": ()}]
    assert mixed_steps(decoder, prompts) == [(pytest.approx(0.04), 4)]
    assert mixed_steps(decoder, []) == [] and mixed_steps(stream(1.0, []), prompts) == []


def test_a_prefill_point_is_the_time_from_send_to_first_token() -> None:
    reqs = [stream(0, [], queue=q, ttft=t) for q, t in ((0.0, 0.05), (0.1, 0.16), (0.0, 0.07))]
    p = prefill_point(reqs, 256)
    assert p.kind == "prefill" and p.new_tokens == 256 and p.seconds == pytest.approx(0.06)
    # A token that streamed no text (a piece of a character) has no time: left out, and
    # where no request has one, one sentence rather than a fit of nothing.
    silent = {"first_token": None, "itls": (), "ttft": None, "queue_time": 0.0}
    assert prefill_point([*reqs, silent], 256).seconds == pytest.approx(0.06)
    with pytest.raises(ProbeError, match="streamed any text"):
        prefill_point([silent], 256)


def test_a_history_point_is_what_the_server_computed_over_what_it_kept() -> None:
    reqs = [dict(stream(0, [], ttft=t), cached_tokens=c) for t, c in
            ((0.03, 256), (0.05, 256), (0.40, 0))]  # the last computed all 320 again
    p = history_point(reqs, 256, 64)
    assert p.label == "prefill 64 on 256" and p.seconds == pytest.approx(0.04)
    assert p.pairs == 64 * 256 + 64 * 65 // 2 and p.context == 320
    assert history_point(reqs[2:], 256, 64) is None
    # llama-server on a sliding-window model keeps 251 of the 256 (a checkpoint): the
    # point is the 69 tokens it computed over them.
    part = [dict(stream(0, [], ttft=t), cached_tokens=c) for t, c in
            ((0.06, 251), (0.07, 251), (0.05, 251), (0.40, 0))]
    p = history_point(part, 256, 64)
    assert p.label == "prefill 69 on 251" and p.seconds == pytest.approx(0.06)
    assert p.new_tokens == 69 and p.pairs == 69 * 251 + 69 * 70 // 2 and p.context == 320


def test_server_profile_names_are_bare_toml_keys() -> None:
    assert server_name("http://127.0.0.1:8080/v1") == "server-127-0-0-1-8080"
    assert server_name("https://gpu.example.com/v1") == "server-gpu-example-com"


def test_probing_the_paced_sim_finds_the_steps_it_prices() -> None:
    """The sim prices each step and its pacing makes the step take that long; the probes,
    through HTTP and the token stream only, must see those steps."""
    with sim_process("--pace", "1", "--served-model-name", "sim") as srv:
        points = probe(srv.url, "sim", QUICK, progress=lambda m: None)
        slots = llama_server_slots(srv.url)
    assert slots == 0  # no llama-server: its probes go to no slot
    hw, model = HardwareProfile.load("rtx-pro-6000"), ModelProfile.load("qwen3-8b")
    from kvdeck.runtime.executors.sim import SimConfig, SimExecutor

    sim = SimExecutor(SimConfig())
    assert sim.hardware == hw and sim.model.name == model.name
    decode = [p for p in points if p.kind == "decode"]
    assert {p.new_tokens for p in decode} == {b for b, _ in QUICK.decode}
    assert not any(p.pinned for p in decode)
    for p in decode:
        priced = sim.estimate_step_seconds(p.new_tokens, p.pairs, p.context)
        assert p.seconds == pytest.approx(priced, rel=0.2), p.label
    prefill = [p for p in points if p.kind == "prefill"]
    # The history probes too: the server says it reused each prefix, and the step computes
    # the new tokens over it.
    assert len(prefill) == len(QUICK.prefill) + len(QUICK.history)
    assert [p.label for p in prefill[len(QUICK.prefill):]] == \
        [f"prefill {c} on {h}" for h, c in QUICK.history]
    for p in prefill:  # the step, plus the request's way in and out: never less
        assert p.seconds >= 0.9 * sim.estimate_step_seconds(p.new_tokens, p.pairs, p.context)
    # A prompt sent while a request decodes runs in the decode's step (the sim's scheduler
    # puts them together), and the decoder's gap that ends with the prompt's first token is
    # that step, priced by the sim as its tokens.
    (mixed,) = [p for p in points if p.kind == "mixed"]
    prompt, c = QUICK.mixed[0]
    assert mixed.label == f"prefill {c} beside a decode of {prompt}"
    assert mixed.new_tokens == c + 1 and mixed.sampled == 2 and mixed.context > c + prompt
    assert mixed.seconds == pytest.approx(
        sim.estimate_step_seconds(mixed.new_tokens, mixed.pairs, mixed.context), rel=0.2)


def test_calibrate_url_writes_profiles_the_sim_runs_with(tmp_path) -> None:
    env = {**os.environ, "KVDECK_CACHE": str(tmp_path)}

    def kvdeck(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvdeck.console.cli", *args],
                              capture_output=True, text=True, timeout=600, env=env)

    with sim_process("--pace", "1", "--served-model-name", "sim") as srv:
        r = kvdeck("calibrate", "sim", "--url", srv.url, "--model-profile", "qwen3-8b",
                   "--like", "rtx-pro-6000", "--quick", "--name", "probed", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    hw = server_name(srv.url)
    assert out["hardware_profile"].endswith(f"{hw}.toml") and len(out["points"]) >= 3
    text = (tmp_path / "profiles" / "models" / "probed.toml").read_text()
    assert f"[fit.{hw}]" in text and f"[decode.{hw}]" in text and f"[wake.{hw}]" in text
    assert [w["idle_s"] for w in out["wake"]] == list(QUICK.wake)
    t = kvdeck("run-trace", "azure-conv", "--limit", "4", "--model-profile", "probed",
               "--hardware", hw, "--timing", "fit", "--json")
    assert t.returncode == 0, t.stderr
    assert sum(json.loads(t.stdout)["summary"]["statuses"].values()) == 4
    # Nothing answers there: one sentence, no traceback.
    bad = kvdeck("calibrate", "sim", "--url", "http://127.0.0.1:9/v1", "--model-profile",
                 "qwen3-8b", "--quick")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "did not finish a probe request" in bad.stderr + bad.stdout


def test_no_server_there_is_one_sentence_not_a_fit() -> None:
    with pytest.raises(ProbeError, match="did not finish"):
        probe("http://127.0.0.1:9/v1", "sim", QUICK, progress=lambda m: None)
