"""Answer checks: what a finished answer must satisfy to count as correct.

A request may carry one check, in the same JSON shape on the API and in a kvdeck trace:

    {"json_schema": {...}}   the answer parses as JSON and validates against the schema
    {"regex": "..."}         the answer matches the pattern in full (Python's re syntax;
                             matched with the `regex` module under a time limit)
    {"expected": "..."}      the answer equals this text, both stripped of surrounding
                             whitespace (models often open with a space or a newline;
                             case and inner spacing stay significant: they can be the answer)

A finished answer that fails its check is finished but not good: goodput counts only
requests that met their SLOs and passed their check (`figures.py`). Checks are validated
when made, so a bad schema or pattern is refused with one sentence before any work is done,
and `passes` never raises: it runs on the engine thread, which a client's check must not
stop.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import regex

from kvdeck.runtime.errors import KvdeckError, RequestError

CHECK_KINDS = ("json_schema", "regex", "expected")
log = logging.getLogger("kvdeck.checks")


@dataclass(frozen=True)
class AnswerCheck:
    """One check: its `kind` (json_schema, regex or expected) and its `source` — the schema
    as JSON text, the pattern, or the expected answer. Construction validates it (a
    RequestError says what is wrong); `parse_check` builds one from its JSON shape."""

    kind: str
    source: str
    _test: Callable[[str], bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            test = _compile(self.kind, self.source)
        except ValueError as e:
            raise RequestError(f"The check {e}.") from None
        object.__setattr__(self, "_test", test)

    def passes(self, text: str) -> bool:
        """Whether `text` (a finished answer) satisfies the check."""
        return self._test(text)

    def to_json(self) -> dict[str, Any]:
        """The check's JSON shape (what `parse_check` reads)."""
        return {self.kind: json.loads(self.source) if self.kind == "json_schema"
                else self.source}


def parse_check(obj: object, *, where: str = "The check",
                error: type[KvdeckError] = RequestError) -> AnswerCheck:
    """A check from its JSON shape, exactly one of `{"json_schema": {...}}`,
    `{"regex": "..."}` or `{"expected": "..."}`; anything else raises `error` with one
    sentence that starts with `where` (an API body's check, a trace's line)."""
    if not isinstance(obj, dict) or len(obj) != 1 or next(iter(obj)) not in CHECK_KINDS:
        raise error(f"{where} must be an object with exactly one of the keys json_schema, "
                    f"regex or expected, got {json.dumps(obj)[:80]}.")
    kind, value = next(iter(obj.items()))
    if kind == "json_schema":
        if not isinstance(value, dict):
            raise error(f"{where} has a json_schema that is not a JSON object; a schema is "
                        "an object such as {\"type\": \"object\"}.")
        try:
            source = json.dumps(value, separators=(",", ":"))
        except RecursionError:
            raise error(f"{where} has a json_schema nested too deeply to check.") from None
    elif not isinstance(value, str):
        raise error(f"{where} has {kind} {json.dumps(value)[:40]}, which is not a string.")
    else:
        source = value
    try:
        return AnswerCheck(kind, source)
    except RequestError as e:
        raise error(str(e).replace("The check", where, 1)) from None


MATCH_TIMEOUT_S = 0.5
"""The longest one pattern match of a check may run (a client's pattern can backtrack
exponentially, and checks run on the engine thread): past it the answer fails its check."""


def _match(pattern, text: str, how: str) -> bool:
    """`pattern.fullmatch` or `.search` under MATCH_TIMEOUT_S (False once it runs out)."""
    try:
        return getattr(pattern, how)(text, timeout=MATCH_TIMEOUT_S) is not None
    except TimeoutError:
        log.warning("a check's pattern %r ran past %.1f s on a %d-character answer; the "
                    "answer counts as failing it", pattern.pattern[:80], MATCH_TIMEOUT_S,
                    len(text))
        return False


def _compile(kind: str, source: str) -> Callable[[str], bool]:
    """The test for a check; ValueError with the end of a sentence ("has a regex that...")
    when it is not a valid one."""
    if kind == "regex":
        try:
            pattern = regex.compile(source)
        except regex.error as e:
            where = f" at position {e.pos}" if e.pos is not None else ""
            raise ValueError(f"has a regex that does not compile ({e.msg}{where}); "
                             "patterns use Python's re syntax") from None
        return lambda text: _match(pattern, text, "fullmatch")
    if kind == "expected":
        want = source.strip()
        return lambda text: text.strip() == want
    if kind == "json_schema":
        return _schema_test(source)
    raise ValueError(f"has kind {kind!r}; kinds are {', '.join(CHECK_KINDS)}")


def _schema_test(source: str) -> Callable[[str], bool]:
    # Imported here: only schema checks need it, and it costs every command's start-up.
    from referencing.exceptions import Unresolvable

    try:
        validator = _validator(source)
    except RecursionError:
        raise ValueError("has a json_schema nested too deeply to check") from None

    def test(text: str) -> bool:
        try:
            return validator.is_valid(json.loads(text))
        # Not JSON, or nested deeper than the parser or a recursive schema can follow:
        # the answer fails its check, and the engine thread goes on.
        except (ValueError, RecursionError, Unresolvable):
            return False
        except Exception:  # noqa: BLE001 - a client's schema must never stop the engine
            log.warning("a json_schema check raised; the answer counts as failing it",
                        exc_info=True)
            return False

    return test


def _validator(source: str):
    """A jsonschema validator for a schema given as JSON text; ValueError (the end of a
    sentence) for one that is not a valid schema of a dialect jsonschema knows, or refers
    outside itself."""
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for
    from referencing import Registry, Resource
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import specification_with

    try:
        schema = json.loads(source)
    except ValueError:
        raise ValueError("has a json_schema that is not JSON text") from None
    if not isinstance(schema, dict):
        raise ValueError("has a json_schema that is not a JSON object; a schema is an object "
                         "such as {\"type\": \"object\"}")
    # Without a default, an unknown $schema gives None instead of a silent latest draft.
    cls = validator_for(schema, default=None) if "$schema" in schema else \
        validator_for(schema)
    if cls is None:
        raise ValueError(f"has a json_schema whose $schema {schema['$schema']!r} names no "
                         "dialect this kvdeck knows; leave it out (draft 2020-12) or name "
                         "draft 4, 6, 7, 2019-09 or 2020-12")
    try:
        cls.check_schema(schema)
    except SchemaError as e:
        raise ValueError(f"has a json_schema that is not a valid JSON Schema: {e.message} "
                         f"(at {e.json_path})") from None
    # An unresolvable reference would otherwise fail every answer: refuse it now.
    root = Resource.from_contents(
        schema, default_specification=specification_with(cls.META_SCHEMA["$schema"]))
    resolver = Registry().resolver_with_root(root)
    for ref in _refs(schema):
        try:
            resolver.lookup(ref)
        except Unresolvable:
            raise ValueError(f"has a json_schema whose $ref {ref!r} points nowhere; "
                             "references must point inside the schema") from None
    return _with_timed_patterns(cls)(schema)


def _with_timed_patterns(cls):
    """`cls` with its `pattern` and `patternProperties` keywords matched under
    MATCH_TIMEOUT_S (jsonschema's own use `re`, which no time limit stops)."""
    from jsonschema import ValidationError
    from jsonschema.validators import extend

    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and \
                not _match(_compiled(patrn), instance, "search"):
            yield ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator, properties, instance, schema):
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in properties.items():
            for key, value in instance.items():
                if _match(_compiled(patrn), key, "search"):
                    yield from validator.descend(value, subschema, path=key,
                                                 schema_path=patrn)

    return extend(cls, {"pattern": pattern, "patternProperties": pattern_properties})


@functools.lru_cache(maxsize=256)
def _compiled(patrn: str):
    """A schema's pattern, compiled once. One `regex` cannot read (`re` read it when the
    schema was checked) matches nothing: the answer fails rather than the engine."""
    try:
        return regex.compile(patrn)
    except regex.error:
        return regex.compile(r"(?!)")


def _refs(node: object) -> list[str]:
    """Every `$ref` string in a schema."""
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []
