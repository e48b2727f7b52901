"""A profile's measured `[<name>.<hardware>] points` tables, read the one way
(`planning/profile_tables.py`): each kind keeps its points and refuses bad ones with one
sentence naming the table and what it must be."""

from __future__ import annotations

import pytest

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.planning.profiles import _prefill_tables
from kvdeck.runtime.planning.slot_save import slot_save_tables
from kvdeck.runtime.planning.wake import wake_tables


def test_each_table_keeps_its_points_in_seconds() -> None:
    assert wake_tables({"wake": {"cpu": {"points": [[5, 40], [2, 10]]}}}, "x") == \
        {"cpu": ((2.0, 0.01), (5.0, 0.04))}
    assert _prefill_tables({"prefill": {"cpu": {"points": [[64, 0, 100]]}}}, "x") == \
        {"cpu": ((64, 0, 0.1),)}
    assert slot_save_tables({"slot_save": {"cpu": {"points": [[1536, 20]]}}}, "x") == \
        {"cpu": ((1536, 0.02),)}
    assert wake_tables({}, "x") == {} == slot_save_tables({}, "x")


@pytest.mark.parametrize("read, d, message", [
    (wake_tables, {"wake": {"cpu": {"points": [[2, 10], [2, 20]]}}},
     "Profile x: wake.cpu.points must be a list of [idle seconds, extra milliseconds] pairs "
     "(idle above 0, each once; extra 0 or more), got [[2, 10], [2, 20]]."),
    (wake_tables, {"wake": {"cpu": {"points": [[2, True]]}}}, "wake.cpu.points must be"),
    (wake_tables, {"wake": [1, 2]}, "Profile x: wake must be a table of [wake.<hardware>] "
                                    "tables, got [1, 2]."),
    (_prefill_tables, {"prefill": {"cpu": {"points": [[64.5, 0, 100]]}}},
     "prefill.cpu.points must be a list of [new tokens, cached tokens, milliseconds] "
     "triples"),
    (slot_save_tables, {"slot_save": {"cpu": {"points": []}}},
     "slot_save.cpu.points must be a list of [tokens, milliseconds] pairs"),
    (slot_save_tables, {"slot_save": {"cpu": "fast"}}, "got None."),
])
def test_a_bad_table_is_one_sentence(read, d: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        read(d, "x")
    assert message in str(e.value)
