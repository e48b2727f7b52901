"""Hardware profiles: the shipped datasheet cards load, and a bad profile gets one sentence
naming the file, the field and the problem."""

from __future__ import annotations

import pytest

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.profiles import HardwareProfile, available_profiles, user_profiles_dir

CARDS = {  # name: (memory bytes, bandwidth bytes/s, dense BF16 flop/s, link bytes/s, watts)
    "rtx-pro-6000": (96e9, 1.792e12, 503.8e12, 64e9, 600),
    "h100-sxm": (80e9, 3.35e12, 989.4e12, 64e9, 700),
    "h200": (141e9, 4.8e12, 989.4e12, 64e9, 700),
    "a100-80gb-pcie": (80e9, 1.935e12, 312e12, 32e9, 300),
    "gh200": (96e9, 4.0e12, 989.4e12, 450e9, 1000),
    "m2-max-96gb": (96e9, 400e9, 13.6e12, 400e9, 90),
}


@pytest.mark.parametrize("name", CARDS)
def test_shipped_cards_load_with_their_datasheet_figures(name: str) -> None:
    hw = HardwareProfile.load(name)
    assert (hw.memory_bytes, hw.bandwidth_bytes_per_s, hw.peak_flops,
            hw.link_bandwidth_bytes_per_s, hw.power_watts) == pytest.approx(CARDS[name])
    assert 0 < hw.mfu <= 1 and 0 < hw.mbu <= 1
    assert name in available_profiles("hardware")


@pytest.mark.parametrize("body, message", [
    ('memory_bytes = 1e9\npeak_flops = 1e12\n',
     "lacks the required key 'bandwidth_bytes_per_s'."),
    ('memory_bytes = 1e9\nbandwidth_bytes_per_s = -5\npeak_flops = 1e12\n',
     ": bandwidth_bytes_per_s must be greater than 0, got -5."),
    ('memory_bytes = 1e9\nbandwidth_bytes_per_s = 1e9\npeak_flops = "fast"\n',
     ": peak_flops must be a number, got 'fast'."),
    ('memory_bytes = 1e9\nbandwidth_bytes_per_s = 1e9\npeak_flops = 1e12\n'
     '[efficiency]\nmfu = 1.5\n', ": efficiency.mfu must be at most 1.0, got 1.5."),
    ('memory_bytes = 1e9\nbandwidth_bytes_per_s = 1e9\npeak_flops = 1e12\n'
     '[link]\nbandwidth_bytes_per_s = -1\n',
     ": link.bandwidth_bytes_per_s must be 0 or more, got -1."),
    ("memory_bytes = = 1\n", " is not valid TOML: Invalid value (at line 1, column 16)."),
])
def test_a_bad_profile_names_the_file_the_field_and_the_problem(body: str, message: str,
                                                                monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVDECK_CACHE", str(tmp_path))
    path = user_profiles_dir() / "hardware" / "broken.toml"
    path.parent.mkdir(parents=True)
    path.write_text(body)
    with pytest.raises(ConfigError) as e:
        HardwareProfile.load("broken")
    assert str(e.value).startswith(f"Profile {path}") and str(e.value).endswith(message)


def test_an_unknown_card_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"^Unknown hardware profile 'h900'; available: "
                                          r"a100-80gb-pcie, gh200, h100-sxm, h200, "):
        HardwareProfile.load("h900")
