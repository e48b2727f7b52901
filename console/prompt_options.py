"""Options typed at the start of the console's prompt line, before the prompt itself:

    n=4                      four samples of the prompt, sharing its KV blocks
    temp=0.8                 sampling temperature (default 0: greedy)
    seed=7                   the first sample's seed (the others take 8, 9, ...)
    json={"type": "object"}  the answer follows this JSON schema (any JSON, spaces allowed)
    regex=\\d{3}-\\d{4}        the answer matches this pattern (no spaces: use \\s)
    choice=red|green|blue    the answer is one of these

e.g. `n=3 temp=0.9 choice=yes|no Is the sky blue?`. Only `name=` words at the very start
are options; the rest of the line is the prompt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kvdeck.runtime.core.intake import MAX_BRANCHES
from kvdeck.runtime.errors import RequestError
from kvdeck.runtime.text.guided import GuideSpec, choice_spec

NAMES = ("n", "temp", "seed", "json", "regex", "choice")
_OPTION = re.compile(r"\s*(" + "|".join(NAMES) + r")=")


@dataclass(frozen=True)
class PromptOptions:
    """What the prompt line asked for besides its text."""

    text: str
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None
    guide: GuideSpec | None = None


def parse_prompt(line: str) -> PromptOptions:
    """Split `line` into its leading options and the prompt; RequestError (one sentence)
    for an option whose value is not valid."""
    pos = 0
    values: dict = {}
    guides: list[GuideSpec] = []
    while m := _OPTION.match(line, pos):
        name, pos = m.group(1), m.end()
        if name == "json":
            try:
                schema, end = json.JSONDecoder().raw_decode(line, pos)
            except ValueError:
                raise RequestError("json= needs a JSON schema right after it, such as "
                                   "json={\"type\": \"object\"}.") from None
            if not isinstance(schema, dict):
                raise RequestError("json= needs a JSON schema object ({...}).")
            guides.append(GuideSpec("json_schema", json.dumps(schema)))
            pos = end
            continue
        end = len(line) if (space := re.search(r"\s", line[pos:])) is None \
            else pos + space.start()
        value, pos = line[pos:end], end
        if name == "regex":
            guides.append(GuideSpec("regex", value))
        elif name == "choice":
            guides.append(choice_spec(value.split("|")))
        else:
            values[name] = _number(name, value)
    if len(guides) > 1:
        raise RequestError("A prompt takes one of json=, regex= and choice=.")
    text = line[pos:].strip()
    return PromptOptions(text, values.get("n", 1), values.get("temp", 0.0),
                         values.get("seed"), guides[0] if guides else None)


def _number(name: str, value: str) -> int | float:
    try:
        number = float(value) if name == "temp" else int(value)
    except ValueError:
        number = None
    if name == "n" and (number is None or not 1 <= number <= MAX_BRANCHES):
        raise RequestError(f"n= must be a whole number from 1 to {MAX_BRANCHES}, got "
                           f"{value!r}.")
    if name == "temp" and (number is None or not 0 <= number <= 2):
        raise RequestError(f"temp= must be a number from 0 to 2, got {value!r}.")
    if name == "seed" and number is None:
        raise RequestError(f"seed= must be a whole number, got {value!r}.")
    return number
