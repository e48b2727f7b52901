"""Request bodies of the OpenAI-compatible API, strictly typed.

- Types are strict: `"10"` is not an integer and `"yes"` is not a boolean.
- A field the server does not know is refused by name (`extra="forbid"`); a field OpenAI or
  vLLM define that this server does not implement is accepted only at its neutral value
  (what "not asked for" means: `logprobs: null`, `echo: false`, `n: 1`, ...) and
  refused by name otherwise — never silently ignored.
- Every text field must be valid Unicode (JSON lets a lone surrogate through, which no
  tokenizer can encode).
- `max_completion_tokens`, OpenAI's current name, takes precedence over `max_tokens`.
- Chat content is a string or a list of text parts; roles are system, developer (treated as
  system), user and assistant.
- `check` is kvdeck's extension: what the answer must satisfy to count as correct
  (`runtime/text/checks.py`); it changes nothing in the answer, only whether it counts as good.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from kvdeck.runtime.core.intake import MAX_BRANCHES
from kvdeck.runtime.text.checks import AnswerCheck, parse_check
from kvdeck.runtime.text.guided import ConstraintError, GuideSpec, choice_spec


def valid_unicode(text: str) -> str:
    """Refuse text that cannot be encoded as UTF-8 (a lone surrogate from a JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode text (it holds a lone surrogate, such as "
                         "\\ud800)") from None
    return text


Text = Annotated[str, AfterValidator(valid_unicode)]
TokenId = Annotated[int, Field(ge=0)]

NEUTRAL: dict[str, tuple[Any, ...]] = {
    # field: values that mean "not asked for"; anything else is refused by name.
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none"),
    "service_tier": (None, "auto", "default"),
}
"""Fields this server does not implement yet, with their neutral values."""


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: a named schema."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: Text
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: Text | None = None
    strict: bool | None = None
    """Accepted; the output always follows the schema exactly."""


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: plain text, any JSON object, or a JSON schema."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("needs a 'json_schema' object when its type is json_schema, and "
                             "none otherwise")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its current name for the guided_* fields): one of a
    JSON schema, a regex, a list of choices, a grammar (Lark or GBNF) or any JSON object."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    # vLLM's, not implemented here: refused by name when given.
    whitespace_pattern: Any = None
    structural_tag: Any = None
    disable_fallback: Any = None
    disable_any_whitespace: Any = None
    disable_additional_properties: Any = None

    @model_validator(mode="after")
    def _implemented(self):
        for name in ("whitespace_pattern", "structural_tag", "disable_fallback",
                     "disable_any_whitespace", "disable_additional_properties"):
            if getattr(self, name) not in (None, False):
                raise NotImplementedField(f"structured_outputs.{name}")
        return self

    def specs(self) -> list[tuple[str, GuideSpec]]:
        out = []
        if self.json_ is not None:
            out.append(("structured_outputs.json", schema_spec(self.json_)))
        if self.regex is not None:
            out.append(("structured_outputs.regex", GuideSpec("regex", self.regex)))
        if self.choice is not None:
            out.append(("structured_outputs.choice", choice_spec(self.choice)))
        if self.grammar is not None:
            out.append(("structured_outputs.grammar", GuideSpec("grammar", self.grammar)))
        if self.json_object:
            out.append(("structured_outputs.json_object", GuideSpec("json_object")))
        return out


def schema_spec(schema: dict | str) -> GuideSpec:
    """A JSON-schema constraint from a schema object or its JSON text."""
    if isinstance(schema, str):
        return GuideSpec("json_schema", schema)
    try:
        return GuideSpec("json_schema", json.dumps(schema))
    except RecursionError:
        raise ConstraintError("The JSON schema is nested too deeply to compile.") from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CheckBody(BaseModel):
    """kvdeck's `check`: exactly one of a JSON schema the answer must validate against, a
    regex it must match in full, or the expected answer."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_schema: dict[str, Any] | None = None
    regex: Text | None = None
    expected: Text | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        if len(self.model_dump(exclude_none=True)) != 1:
            raise ValueError("must hold exactly one of json_schema, regex or expected")
        return self


class GenerateBody(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: Text
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    """vLLM's extension; 0 and -1 mean off."""
    seed: int | None = None
    stop: Text | list[Text] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_BRANCHES)] = 1
    """Samples of the prompt to return (they share its KV blocks: one prefill)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    """vLLM's extension: keep generating past end-of-sequence (benchmarks need exact
    output lengths)."""
    lora: Text | None = None
    """kvdeck's extension: the LoRA adapter to run with, by the name it is served under
    (the same as asking for `model: "BASE:NAME"` or, as vLLM does, `model: "NAME"`)."""
    user: Text | None = None
    """An end-user id for the caller's own bookkeeping; accepted, not used."""
    # null means the default, as OpenAI's and vLLM's clients send it.
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] | None = 1.0
    """vLLM's extension; 1 is off."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = 0.0
    """vLLM's extension; 0 is off."""
    min_tokens: Annotated[int, Field(ge=0)] | None = 0
    """vLLM's extension: end-of-sequence and stop token ids are masked until this many."""
    stop_token_ids: list[TokenId] | None = None
    """vLLM's extension: token ids that end the output (beside end-of-sequence)."""
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0,
                                                 allow_inf_nan=False)]] | None = None
    """OpenAI's: token id (as a string, JSON keys being strings) → bias added to its logit."""
    response_format: ResponseFormat | None = None
    """OpenAI's: text, json_object or json_schema (`runtime/text/guided.py`)."""
    structured_outputs: StructuredOutputs | None = None
    """vLLM's current constraint field."""
    guided_json: dict[str, Any] | Text | None = None
    """vLLM's names before 0.12, still sent by older clients."""
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    check: CheckBody | None = None
    """kvdeck's extension: what the answer must satisfy to count as correct (goodput)."""
    # Known but not implemented: accepted only at their neutral values (see NEUTRAL).
    top_logprobs: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    service_tier: Any = None

    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset()
    """Fields of NEUTRAL this endpoint does implement (typed in its own body)."""

    @model_validator(mode="after")
    def _not_implemented(self):
        for name, neutral in NEUTRAL.items():
            if name in self.IMPLEMENTED:
                continue
            value = getattr(self, name)
            if value is not None and not any(value == v and type(value) is type(v)
                                             for v in neutral):
                raise NotImplementedField(name)
        return self

    def output_limit(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        """Alternatives per token to report (None: no logprobs asked for)."""
        return None

    def num_samples(self) -> int:
        """Samples to generate (`n`, or completions' `best_of`)."""
        return self.n

    def guide_spec(self) -> tuple[str, GuideSpec] | None:
        """(field, constraint) this request asks for, or None; ValueError when it names
        more than one (RequestError from `guided` when one is malformed)."""
        found: list[tuple[str, GuideSpec]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", GuideSpec("json_object")))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_
            found.append(("response_format", schema_spec(schema if schema is not None
                                                         else {})))
        if self.structured_outputs is not None:
            found.extend(self.structured_outputs.specs())
        if self.guided_json is not None:
            found.append(("guided_json", schema_spec(self.guided_json)))
        if self.guided_regex is not None:
            found.append(("guided_regex", GuideSpec("regex", self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice", choice_spec(self.guided_choice)))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", GuideSpec("grammar", self.guided_grammar)))
        if len(found) > 1:
            raise ValueError("A request takes one output constraint; this one names "
                             f"{' and '.join(name for name, _ in found)}.")
        return found[0] if found else None
    def answer_check(self) -> AnswerCheck | None:
        """The request's check; a schema or regex that is not valid raises RequestError with
        one sentence naming it."""
        if self.check is None:
            return None
        return parse_check(self.check.model_dump(exclude_none=True), where="'check'")

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs; a key that is not a token id raises
        ValueError naming it."""
        pairs: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}.")
            if int(key) in pairs:
                raise ValueError(f"logit_bias names token {int(key)} twice.")
            pairs[int(key)] = float(bias)
        return tuple(pairs.items())


class NotImplementedField(ValueError):
    """A known OpenAI/vLLM field at a value this server does not implement."""

    def __init__(self, name: str):
        super().__init__(name)
        self.field = name


class CompletionBody(GenerateBody):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    """0 only with `echo`: the prompt is scored, nothing is generated (app.py checks)."""
    logprobs: Annotated[int, Field(ge=0, le=20)] | bool | None = None
    """OpenAI's legacy form: the sampled token's logprob and this many alternatives
    (`false` and null: none)."""
    echo: bool | None = None
    """OpenAI's: the prompt's text comes before the completion's, and with `logprobs` the
    prompt's tokens come first in them (the first with null logprobs)."""
    best_of: Annotated[int, Field(ge=1, le=MAX_BRANCHES)] | None = None
    """OpenAI's legacy: sample this many (at least `n`), return the `n` whose tokens are
    most likely (cumulative log-probability); not with `stream`."""
    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset({"echo", "best_of"})

    def num_samples(self) -> int:
        return self.best_of or self.n

    def num_logprobs(self) -> int | None:
        if self.logprobs is None or self.logprobs is False:
            return None
        return 0 if self.logprobs is True else self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatBody(GenerateBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | Annotated[int, Field(ge=0, le=1)] | None = None
    """OpenAI's boolean (0 and 1 taken as false and true, as some clients send them)."""
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    """Alternatives per token (with `logprobs: true`)."""
    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset({"top_logprobs"})

    def output_limit(self) -> int | None:
        # OpenAI's current name wins over the deprecated one.
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    prompt: Text
    model: Text | None = None
    add_special_tokens: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    tokens: list[TokenId]
    model: Text | None = None
