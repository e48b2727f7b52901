"""Locating the data that ships inside the wheel — `profiles/` (TOML), `themes/` (TCSS) and
`traces/` (sample arrival traces) — and the user's cache directory.

Each is an import package holding data files, so `importlib.resources` finds them the same
way from an editable install (the repository's folders) and from a built wheel
(site-packages).
"""

from __future__ import annotations

import json
import os
from importlib.resources import files
from pathlib import Path

try:
    from importlib.resources.abc import Traversable
except ImportError:  # Python 3.10: the class lives in importlib.abc
    from importlib.abc import Traversable

SAMPLE_TRACES = {
    "azure-conv": "azure-conv.csv",
    "azure-code": "azure-code.csv",
    "mooncake-conversation": "mooncake-conversation.jsonl",
    "llm-d-shared-prefix": "llm-d-shared-prefix.toml",
}
"""Sample traces by name (traces/README.md gives each one's source and license)."""

PASSAGE = files("kvdeck.runtime.text").joinpath("passage.txt")
"""The fixed text the quality measures read and a simulated server with a real tokenizer
answers from."""

QUESTIONS = files("kvdeck.runtime.text").joinpath("questions.jsonl")
"""The checked question set `kvdeck bench --questions` sends by default: 70 short questions,
each with the regex its answer must match (made by `benchmarks/make_questions.py`)."""


def cache_dir() -> Path:
    """Where kvdeck keeps assembled models, logs and other derived files: `$KVDECK_CACHE`,
    or `~/.cache/kvdeck`."""
    return Path(os.environ.get("KVDECK_CACHE") or Path.home() / ".cache" / "kvdeck")


def read_cache_json(name: str) -> dict:
    """The JSON object kept in `<cache>/name` (empty where it is missing or not an object)."""
    try:
        data = json.loads((cache_dir() / name).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_cache_entry(name: str, key: str, record: dict) -> None:
    """Set `key` to `record` in the JSON object kept in `<cache>/name`."""
    data = read_cache_json(name)
    data[key] = record
    path = cache_dir() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)  # atomic: two starting processes never read half a file


def profiles_dir() -> Traversable:
    """The `profiles/` folder: `hardware/`, `models/`, `workloads/` and `drafts/` TOML files."""
    return files("kvdeck.profiles")


def themes_dir() -> Traversable:
    """The `themes/` folder: the console's stylesheets and theme definitions."""
    return files("kvdeck.themes")


def sample_trace(name: str) -> Traversable | None:
    """The shipped sample trace called `name`, or None when there is no such sample."""
    file = SAMPLE_TRACES.get(name)
    return files("kvdeck.traces").joinpath(file) if file is not None else None


def profile_names(kind: str) -> list[str]:
    """Names (file stems) of the profiles of one kind: 'hardware', 'models', 'workloads' or
    'drafts'."""
    folder = profiles_dir().joinpath(kind)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))
