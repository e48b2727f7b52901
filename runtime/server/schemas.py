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
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


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
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none"),
    "service_tier": (None, "auto", "default"),
}
"""Fields this server does not implement yet, with their neutral values."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    """vLLM's extension: keep generating past end-of-sequence (benchmarks need exact
    output lengths)."""
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
    # Known but not implemented: accepted only at their neutral values (see NEUTRAL).
    top_logprobs: Any = None
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    response_format: Any = None
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
    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset({"echo"})

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
