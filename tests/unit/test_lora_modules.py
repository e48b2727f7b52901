"""`--lora-modules` is read before any model loads: NAME=PATH, names given once."""

from __future__ import annotations

import pytest

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.session import parse_lora_modules


def test_names_and_paths_are_read_and_trimmed() -> None:
    assert parse_lora_modules([" a = p ", "b=/x/y=z"]) == [("a", "p"), ("b", "/x/y=z")]
    assert parse_lora_modules([]) == []


@pytest.mark.parametrize("module", ["a", "=p", "a=", "a:b=p", " = "])
def test_a_malformed_module_gets_one_sentence(module: str) -> None:
    with pytest.raises(ConfigError, match=r"--lora-modules takes NAME=PATH \(a name without "
                                          r"':'\), got "):
        parse_lora_modules([module])


def test_a_name_given_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="--lora-modules names 'a' twice"):
        parse_lora_modules(["a=p", " a=q"])
