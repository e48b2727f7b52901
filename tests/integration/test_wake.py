"""Waking from idle (`runtime/planning/wake.py`): the measured extra cost of the first step
after an idle spell, probed from outside, kept in the profile and added by the sim."""

from __future__ import annotations

import os

import pytest

from kvdeck.runtime.core.config import EngineConfig
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.executors.sim import SimConfig, SimExecutor
from kvdeck.runtime.planning.calibrate import Point, fit_step_model, fit_toml
from kvdeck.runtime.planning.probe import (
    WAKE_TRIES,
    ProbeError,
    Probes,
    first_timed,
    prefill_point,
    probe,
    wake_point,
    wake_probe,
)
from kvdeck.runtime.planning.profiles import ModelProfile
from kvdeck.runtime.planning.wake import pooled, wake_seconds
from kvdeck.runtime.runs.runner import run_arrivals
from kvdeck.runtime.runs.trace import Arrival
from tests.integration.test_calibrate import probed_profiles
from tests.servers import sim_process

FIT = "\n[fit.rtx-pro-6000-probed]\nfixed_ms = 20\nper_token_us = 30\nper_pair_ns = 0\n"
WAKE = "\n[wake.rtx-pro-6000-probed]\npoints = [[10, 30.0], [2, 10.0]]\n"


def test_the_wake_is_linear_between_measured_spells_and_bounded_beyond_them() -> None:
    points = ((2.0, 0.010), (10.0, 0.030))
    assert wake_seconds(points, 0.0) == 0.0 and wake_seconds((), 5.0) == 0.0
    assert wake_seconds(points, 1.0) == pytest.approx(0.005)
    assert wake_seconds(points, 6.0) == pytest.approx(0.020)
    assert wake_seconds(points, 100.0) == pytest.approx(0.030)
    # Measured once per spell, a longer spell can come out cheaper; it is pooled with its
    # neighbour, since a longer spell never costs less.
    smooth = pooled(((2.0, 0.0), (5.0, 0.038), (10.0, 0.018), (20.0, 0.044)))
    assert [x for x, _ in smooth] == [2.0, 5.0, 10.0, 20.0]
    assert [y for _, y in smooth] == pytest.approx([0.0, 0.028, 0.028, 0.044])


def test_a_wake_point_is_the_prompt_after_idling_less_the_same_prompt_back_to_back() -> None:
    back = prefill_point([{"ttft": t, "queue_time": 0.0} for t in (0.10, 0.12, 0.11)], 64)
    p = wake_point([{"ttft": 0.15, "queue_time": 0.0}], back, 5.0)
    assert p.kind == "wake" and p.idle_s == 5.0 and p.label == "wake after 5 s"
    assert p.seconds == pytest.approx(0.04)
    # No step shape: the fit is the same with it or without it, and the profile keeps it.
    decode = Point("decode", 1, 65, "decode 1 at 64", 0.05, 65)
    assert fit_step_model([back, decode, p]) == fit_step_model([back, decode])
    assert "[wake.hw]\npoints = [[5, 40.000]]" in fit_toml(fit_step_model([back, decode]),
                                                          "hw", [back, decode, p])


def test_a_wake_prompt_whose_token_streamed_no_text_is_sent_again() -> None:
    # A token that is a piece of a character streams no text and has no time: the spell
    # takes another prompt, up to WAKE_TRIES, then prefill_point names it in a sentence.
    silent, timed = {"ttft": None, "queue_time": 0.0}, {"ttft": 0.15, "queue_time": 0.0}
    for replies, sends, ttft in (([timed], 1, 0.15), ([silent, timed], 2, 0.15),
                                 ([silent] * WAKE_TRIES, WAKE_TRIES, None)):
        left = [([r], (0.002 * i,)) for i, r in enumerate(replies)]
        done, saved = first_timed(lambda left=left: left.pop(0))
        assert len(replies) - len(left) == sends and done[0]["ttft"] == ttft
        assert saved == (0.002 * (sends - 1),)  # the saves of the send that counts
    back = prefill_point([timed], 64)
    with pytest.raises(ProbeError, match="streamed any text"):
        wake_point(first_timed(lambda: ([silent], ()))[0], back, 5.0)


def test_the_sim_adds_the_wake_to_the_first_step_after_an_idle_spell(
        tmp_path, monkeypatch) -> None:
    models, shipped = probed_profiles(tmp_path, monkeypatch)
    for name, extra in (("awake", ""), ("waking", WAKE)):
        (models / f"{name}.toml").write_text(
            shipped.replace('name = "qwen3-8b"', f'name = "{name}"') + FIT + extra)
    assert ModelProfile.load("waking").wake_times == \
        {"rtx-pro-6000-probed": ((2.0, 0.010), (10.0, 0.030))}

    def run(name: str) -> list[dict]:
        sim = SimExecutor(SimConfig(model_profile=name, hardware="rtx-pro-6000-probed",
                                    timing="fit"))
        engine = Engine(EngineConfig(kv_memory_bytes=1 << 30), sim)
        arrivals = [Arrival(0.0, 100, 1), Arrival(6.0, 100, 1), Arrival(6.001, 100, 1)]
        out = run_arrivals(engine, arrivals, vocab_size=32_000)["requests"]
        engine.close()
        return out

    awake, waking = run("awake"), run("waking")
    # The first request found the engine as it started; the second after an idle spell of
    # 6 s less the first one's time; the third came while the second's step ran.
    assert waking[0]["ttft"] == pytest.approx(awake[0]["ttft"])
    idle = 6.0 - awake[0]["ttft"]
    assert waking[1]["ttft"] - awake[1]["ttft"] == pytest.approx(wake_seconds(
        ((2.0, 0.010), (10.0, 0.030)), idle))
    assert waking[2]["ttft"] - awake[2]["ttft"] == \
        pytest.approx(waking[1]["ttft"] - awake[1]["ttft"])  # it waited out the same step


def test_a_bad_wake_table_is_one_sentence(tmp_path, monkeypatch) -> None:
    models, shipped = probed_profiles(tmp_path, monkeypatch)
    (models / "bad.toml").write_text(shipped.replace('name = "qwen3-8b"', 'name = "bad"')
                                     + FIT + "\n[wake.rtx-pro-6000-probed]\npoints = [[0, 5]]\n")
    with pytest.raises(ConfigError, match=r"idle seconds, extra milliseconds\] pairs"):
        ModelProfile.load("bad")


def test_probes_find_the_wake_a_paced_sim_server_pays(tmp_path, monkeypatch) -> None:
    """A paced sim server whose profile has a wake takes that long more after idling; the
    probe, through HTTP and the token stream only, must find it."""
    models, shipped = probed_profiles(tmp_path, monkeypatch)
    (models / "waking.toml").write_text(
        shipped.replace('name = "qwen3-8b"', 'name = "waking"') + FIT
        + "\n[wake.rtx-pro-6000-probed]\npoints = [[1, 1000.0], [3, 2000.0]]\n")
    few = Probes((32,), ((1, 32),), 4, 3, wake=(1.0, 3.0))
    with sim_process("--pace", "1", "--served-model-name", "sim", "--model-profile", "waking",
                     "--hardware", "rtx-pro-6000-probed", "--timing", "fit",
                     env={"KVDECK_CACHE": os.environ["KVDECK_CACHE"]}) as srv:
        points = probe(srv.url, "sim", few, progress=lambda m: None)
        # Later, alone: the back-to-back prompt timed anew, and the same spells.
        again = wake_probe(srv.url, "sim", few, progress=lambda m: None, seed=1)
    for found in (points, again):
        wake = {p.idle_s: p.seconds for p in found if p.kind == "wake"}
        assert set(wake) == {1.0, 3.0}
        # What the sim adds, and a little more: the machine's own waking is in it too (the
        # server's HTTP path and the client's, each point timed once: 40 ms after 3 s in one
        # run beside the suite, 166 ms after 1 s in another), hence a wake this large.
        assert 0.95 < wake[1.0] < 1.4 and 1.95 < wake[3.0] < 2.4
    assert [p.kind for p in again] == ["wake", "wake"]
