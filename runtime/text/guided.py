"""Constrained (guided) decoding: outputs that follow a JSON schema, a regex, a list of
choices or a grammar, with llguidance as the grammar engine.

Why llguidance (over xgrammar): it computes a token mask in well under a millisecond even
for Gemma's 262K vocabulary (an Earley parser over a lexer, no per-grammar precomputation of
token tables), covers JSON Schema broadly (including `$ref`, `anyOf`, string formats and
length bounds), takes Lark and GBNF grammars and regexes, reads the vocabulary straight
from llama.cpp's (the tokenizer this project already loads), and needs neither
`transformers` nor a compiler; a grammar state copies cheaply, so speculation walks a
draft on a copy.

The pieces:

- `GuideSpec`: what a request asked for (kind and source text), hashable and recordable.
- `Grammars`: one per tokenizer; compiles a spec (one clear sentence when it cannot) and
  starts a `Guide` for a request.
- `Guide`: one request's grammar state. The engine commits every emitted token to it (the
  scheduler's stop rule); a finished grammar ends the request.
- `MaskJob`: the masks one step needs, computed on a worker thread while the forward pass
  runs (llguidance drops the GIL), then applied in the shared sampler (`sampling.py`).
"""

from __future__ import annotations

import json
import re
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvdeck.runtime.errors import RequestError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
_GBNF_RULE = re.compile(r"^\s*[A-Za-z][\w-]*\s*::=", re.MULTILINE)
"""A GBNF rule at the start of a line (Lark writes `name: ...`)."""

# Compact separators: a small model is not tempted into endless whitespace between items.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ",
                 "key_separator": ": "}


class ConstraintError(RequestError):
    """An output constraint that cannot be compiled (one sentence, llguidance's reason)."""


@dataclass(frozen=True)
class GuideSpec:
    """A request's output constraint: `kind` (one of KINDS) and its source — the schema as
    JSON text, the regex, the choices as a JSON list, or a Lark or GBNF grammar."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"A constraint kind must be one of {', '.join(KINDS)}, got "
                               f"{self.kind!r}.")

    @property
    def label(self) -> str:
        """A short description for the console and traces."""
        text = self.source if len(self.source) <= 40 else self.source[:37] + "..."
        return self.kind if self.kind == "json_object" else f"{self.kind} {text}"

    def grammar(self) -> str:
        """The llguidance grammar (a JSON envelope) this spec compiles to."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"},
                                                      overrides=_JSON_OPTIONS)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except ValueError as e:
                raise ConstraintError(f"The JSON schema is not valid JSON ({e}).") from None
            except RecursionError:
                raise ConstraintError("The JSON schema is nested too deeply to compile.") \
                    from None
            if not isinstance(schema, dict | bool):
                raise ConstraintError("A JSON schema must be an object (or true/false), got "
                                   f"{type(schema).__name__}.")
            return LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            choices = json.loads(self.source)
            # Lark string literals take JSON's escapes, so each choice is matched verbatim.
            return LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        text = self.source
        if _GBNF_RULE.search(text):  # GBNF (llama.cpp's format), as vLLM's clients send it
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions
                raise ConstraintError(f"The GBNF grammar could not be read ({e}).") from None
        return LLMatcher.grammar_from_lark(text)


def choice_spec(choices: list[str]) -> GuideSpec:
    """A spec for exactly one of `choices` (at least one, none empty)."""
    if not choices:
        raise ConstraintError("choice needs at least one string to choose from.")
    if any(not c for c in choices):
        raise ConstraintError("choice strings must not be empty.")
    return GuideSpec("choice", json.dumps(list(choices), ensure_ascii=False))


class Grammars:
    """Compiles constraints against one tokenizer. Building llguidance's view of the
    vocabulary reads every token (about 1.7 s for Gemma), so it is built once, on first use,
    by the thread that submits the request (never the engine thread)."""

    def __init__(self, tokenizer, end_ids: tuple[int, ...], vocab_size: int):
        """`end_ids`: the tokens that may end a guided output (end of sequence and the chat
        template's end of turn); `vocab_size`: the model's logits width."""
        self.tokenizer = tokenizer
        self.end_ids = tuple(end_ids)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._lltok = None

    def lltokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llama_cpp
                from llguidance.llamacpp import lltokenizer_from_vocab

                vocab = llama_cpp.llama_model_get_vocab(self.tokenizer._llm.model)
                # llguidance's reader calls a llama.cpp function deprecated in this
                # binding: one warning per token (262K for Gemma) would be printed.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._lltok = lltokenizer_from_vocab(
                        vocab, n_vocab=max(self.vocab_size, self.tokenizer.vocab_size),
                        eos_token=list(self.end_ids) or None)
            return self._lltok

    def start(self, spec: GuideSpec) -> Guide:
        """A fresh `Guide` for one request; RequestError with llguidance's reason when the
        constraint does not compile."""
        from llguidance import LLMatcher

        lltok = self.lltokenizer()
        grammar = spec.grammar()
        error = LLMatcher.validate_grammar(grammar, lltok)
        if error:
            raise ConstraintError(f"The {spec.kind.replace('_', ' ')} constraint cannot be "
                               f"compiled: {_first_line(error)}.")
        matcher = LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"The {spec.kind.replace('_', ' ')} constraint cannot be "
                               f"compiled: {_first_line(matcher.get_error())}.")
        return Guide(spec, matcher, lltok, self.vocab_size)


def _first_line(message: str) -> str:
    """llguidance's reason in one line: its `error:` line where it has one (a regex's
    parse error), else its first line, without the grammar position prefix."""
    lines = [x.strip() for x in message.strip().splitlines() if x.strip()] or ["unknown error"]
    line = next((x[len("error:"):].strip() for x in lines if x.startswith("error:")), lines[0])
    return re.sub(r"^at \d+\(\d+\): ", "", line).rstrip(".:")


class Guide:
    """One request's position in its grammar. Touched by the engine thread (commits) and by
    a step's `MaskJob` (masks) — never both at once: a job is always finished before the
    step's results are applied."""

    def __init__(self, spec: GuideSpec, matcher, lltok, vocab_size: int):
        self.spec = spec
        self.matcher = matcher
        self.lltok = lltok
        self.vocab_size = vocab_size
        self.forced: list[bool] = []
        """Per committed token: the grammar allowed nothing else there (its bytes were all
        forced), as the console marks them."""
        self.error: str | None = None

    def fork(self) -> Guide:
        """An independent copy at the same position (a parallel-sampling branch)."""
        twin = Guide(self.spec, self.matcher.deep_copy(), self.lltok, self.vocab_size)
        twin.forced = list(self.forced)
        return twin

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits nothing more: the request should stop."""
        return self.matcher.is_stopped()

    def commit(self, token: int) -> bool:
        """Advance past an emitted token; False (with `error` set) if the grammar refused it
        (which masking prevents: a stop string or `ignore_eos` can still get there)."""
        forced = self.matcher.compute_ff_bytes()
        if not self.matcher.consume_token(token):
            self.error = self.matcher.get_error() or f"token {token} is not allowed here"
            return False
        piece = self.lltok.decode_bytes([token])
        self.forced.append(bool(piece) and forced.startswith(piece))
        return True

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next, as a bool row of the model's vocabulary."""
        return unpack(self._bitmask(), self.vocab_size)

    def draft_allowed(self, draft: list[int]) -> torch.Tensor:
        """Masks [len(draft) + 1, vocab] for verifying `draft`: row i is what the grammar
        allows after the first i draft tokens. The draft is walked on a copy of the
        grammar state, so the request's own state never holds a token until it is emitted
        (rejected drafts never reach it). Rows past the first draft token the grammar
        refuses repeat that position's mask: verification rejects the token there (its
        probability is 0), so those rows are never reached."""
        walk = self.matcher.deep_copy()
        rows = []
        for token in draft:
            rows.append(self._bitmask(walk))
            if not walk.consume_token(token):
                break
        else:
            rows.append(self._bitmask(walk))  # the position after the whole draft
        rows.extend(rows[-1:] * (len(draft) + 1 - len(rows)))
        return unpack(torch.stack(rows), self.vocab_size)

    def _bitmask(self, matcher=None) -> torch.Tensor:
        bits = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        (matcher or self.matcher).unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        return bits


_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed bitmask (int32 words, bit j of word w = token 32w + j) as bools."""
    flat = ((bits.unsqueeze(-1) >> _SHIFTS) & 1).flatten(-2).bool()
    return flat[..., :vocab_size]


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`logits` with every token the grammar refuses at -inf (a copy). Logits wider than
    the mask (padding columns) are refused too."""
    width = logits.shape[-1]
    if allowed.shape[-1] < width:
        pad = torch.zeros((*allowed.shape[:-1], width - allowed.shape[-1]), dtype=torch.bool)
        allowed = torch.cat([allowed, pad], dim=-1)
    return logits.masked_fill(~allowed[..., :width], float("-inf"))


_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvdeck-masks")


class MaskJob:
    """The grammar masks one step needs — one row per guided request that samples, and
    `1 + k` rows per guided request that verifies a draft of `k` — started on a worker thread
    before the forward pass so their computation overlaps it. `wait()` before the step's
    results are applied (the executors do so even when the forward pass fails)."""

    def __init__(self, sampling: list, verifying: list[tuple[object, list[int]]]):
        self._sampling = [r for r in sampling if r.guide is not None]
        self._verifying = [(r, d) for r, d in verifying if r.guide is not None]
        self._masks: dict[str, torch.Tensor] = {}
        self.errors: dict[str, str] = {}
        """Request id → why its grammar cannot go on (an error state, a mask that allows
        nothing): the executor fails those requests in this step's result."""
        self._future: Future | None = _WORKER.submit(self._compute) \
            if self._sampling or self._verifying else None

    def _compute(self) -> dict[str, torch.Tensor]:
        out = {}
        for r, draft in [(r, None) for r in self._sampling] + self._verifying:
            matcher = r.guide.matcher
            if matcher.is_error():  # e.g. a user grammar past llguidance's limits
                self.errors[r.request_id] = ("its constraint failed: "
                                             f"{_first_line(matcher.get_error())}")
                continue
            mask = r.guide.allowed() if draft is None else r.guide.draft_allowed(draft)
            if not (mask if mask.dim() == 1 else mask[0]).any():
                self.errors[r.request_id] = "its constraint allows no token here"
                continue
            out[r.request_id] = mask
        return out

    def wait(self) -> dict[str, torch.Tensor]:
        """Request id → allowed-token mask (a row, or rows for a verify chunk); requests
        in `errors` have none."""
        if self._future is not None:
            self._masks = self._future.result()
            self._future = None
        return self._masks
