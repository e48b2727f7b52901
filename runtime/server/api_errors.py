"""OpenAI-shaped error responses, and one sentence for each way a request body can be wrong.

Every error the API returns — validation, 404, 405, 408, 413, body parse errors, engine
refusals — has the shape `{"error": {"message", "type", "param", "code"}}`, with one
sentence naming what was wrong and what is allowed, and the field in `param` where there
is one. Pydantic's own wording (types, union branches) never reaches a client.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from kvdeck.runtime.server.guard import error_payload
from kvdeck.runtime.server.schemas import NotImplementedField

KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
         429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}

SHAPES = {
    "prompt": "a string or a list of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
    "messages": "a list of messages",
    "stream_options": "an object",
}
"""What a field of several possible shapes must be, for a union's error."""

_TYPES = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
          "string_type": "a string", "list_type": "a list", "dict_type": "an object",
          "model_type": "an object", "model_attributes_type": "an object",
          "int_from_float": "an integer", "none_required": "null"}
_TAG_CHARS = ("[", "(", "-")
_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "ChatMessage"}


def error(status: int, message: str, param: str | None = None,
          kind: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error response."""
    return JSONResponse(status_code=status, content=error_payload(
        status, message, kind or KINDS.get(status, "api_error"), param))


def field_path(loc: tuple, key_last: bool = False) -> str:
    """'messages.0.content' from pydantic's location, without the union-branch tags, and
    with characters that do not print escaped (`\\n`): a client's own key is part of it,
    and the error stays one line. `key_last`: the last part is a client's key (a field the
    endpoint does not take), kept whatever it holds ("x-y" is no tag there)."""
    parts = []
    for i, p in enumerate(loc):
        if p == "body" and i == 0:
            continue
        if (not key_last or i < len(loc) - 1) and isinstance(p, str) and (
                p in _TAGS or any(c in p for c in _TAG_CHARS)):
            continue
        parts.append("".join(c if c.isprintable() else c.encode("unicode_escape").decode()
                             for c in str(p)))
    return ".".join(parts)


def validation_sentence(errors: list[dict]) -> tuple[str, str | None]:
    """(one sentence, the field) for a request body's validation errors."""
    # A value that has the right type but is wrong (bad Unicode, say) says more than the
    # type errors of a union's other branches.
    first = next((e for e in errors if e["type"] == "value_error"), errors[0])
    kind = first["type"]
    path = field_path(first["loc"], key_last=kind == "extra_forbidden")
    if kind == "json_invalid":
        return "The request body is not valid JSON.", "body"
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, NotImplementedField):
        return (f"'{cause.field}' is not supported by this server yet; leave it out or send "
                "its default.", cause.field)
    if not path:
        return ("The request body must be a JSON object, sent with 'Content-Type: "
                "application/json'.", "body")
    name = path.rsplit(".", 1)[-1]
    if kind == "value_error":
        return f"'{path}' {cause}.", path
    if kind == "extra_forbidden":
        return f"'{path}' is not a field this endpoint takes.", path
    if kind == "missing":
        return f"'{path}' is required.", path
    if name in SHAPES:  # a field of several shapes: say them all, not one branch's error
        return f"'{path}' must be {SHAPES[name]}.", path
    if kind in _TYPES:
        return f"'{path}' must be {_TYPES[kind]}.", path
    ctx = first.get("ctx") or {}
    bounds = {"greater_than_equal": "at least", "less_than_equal": "at most",
              "greater_than": "greater than", "less_than": "less than"}
    if kind in bounds:
        limit = next(iter(ctx.values()), "")
        return f"'{path}' must be {bounds[kind]} {limit}.", path
    if kind == "finite_number":
        return f"'{path}' must be a finite number, not NaN or infinity.", path
    if kind == "too_short":
        return f"'{path}' must hold at least {ctx.get('min_length', 1)} item.", path
    if kind == "literal_error":
        return f"'{path}' must be one of {ctx.get('expected', 'the allowed values')}.", path
    return f"'{path}' is not valid here.", path
