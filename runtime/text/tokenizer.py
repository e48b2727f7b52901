"""Tokenization exactly as llama.cpp does it, streaming detokenization, stop strings, and
chat templates.

`Tokenizer` loads a GGUF vocabulary-only through llama-cpp-python, the tokenizer the
llama.cpp executor uses too. `IncrementalDetokenizer` turns tokens into text as they arrive:
bytes of a character split across tokens are held until complete, and text that could be the
start of a stop string is held until it is known not to be one, so a stop string spanning
token boundaries is honoured and never streamed. Chat templates from the GGUF are rendered
in a sandboxed Jinja environment (a GGUF is untrusted input).
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvdeck.runtime.errors import ModelFileError, RequestError
from kvdeck.runtime.resources import read_cache_json, write_cache_entry

# Used when a Gemma GGUF carries no template (the embedded 270M file does not).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "{% if m['role'] == 'system' %}{{ '<start_of_turn>user\\n' + m['content'] + '\\n\\n' }}"
    "{% else %}{% if not (loop.index0 == 1 and messages[0]['role'] == 'system') %}"
    "{{ '<start_of_turn>' + role + '\\n' }}{% endif %}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


class Tokenizer:
    """A GGUF model's tokenizer (vocabulary only: no weights are loaded)."""

    def __init__(self, model_path: str | Path):
        # imported here: loading the library takes a moment
        from kvdeck.runtime.executors.llama_cpp_probe import open_llama

        self.path = Path(model_path)
        _probe_vocab(self.path)
        with quiet_stderr():  # llama.cpp logs a context warning even with verbose=False
            self._llm = open_llama(self.path, vocab_only=True, verbose=False)
        meta = self._llm.metadata
        self.architecture = meta.get("general.architecture", "")
        self.bos_token_id = self._llm.token_bos()
        self.eos_token_id = self._llm.token_eos()
        self.vocab_size = self._llm.n_vocab()
        self.add_bos = meta.get("tokenizer.ggml.add_bos_token", "true") == "true"
        template = meta.get("tokenizer.chat_template")
        self.is_instruct = template is not None
        """The file carries a chat template: an instruct (chat-tuned) model. Without one the
        model is a base model; the chat endpoint still formats messages (Gemma's turn
        markers for Gemma), but the prompt panel runs plain completions."""
        if template is None and self.architecture.startswith("gemma"):
            template = GEMMA_TEMPLATE
        self.chat_template = template

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Ids of the chat templates' end-of-turn markers this vocabulary has as single
        tokens (Gemma's <end_of_turn>, ChatML's <|im_end|>, Llama 3's <|eot_id|>)."""
        ids = []
        for marker in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>"):
            t = self.encode(marker, add_bos=False)
            if len(t) == 1:
                ids.append(t[0])
        return tuple(ids)

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`; special-token text (e.g. '<start_of_turn>') maps to its id."""
        bos = self.add_bos if add_bos is None else add_bos
        return self._llm.tokenize(text.encode("utf-8"), add_bos=bos, special=special)

    def token_bytes(self, token: int, prev: list[int] | None = None) -> bytes:
        """The bytes one token adds after `prev` (llama.cpp handles leading-space rules)."""
        return self._llm.detokenize([token], prev_tokens=prev)

    def decode(self, tokens: list[int]) -> str:
        return self._llm.detokenize(tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        return self._llm.detokenize([token], special=True).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for chat `messages` per the model's template."""
        if self.chat_template is None:
            raise RequestError(f"Model {self.path.name} has no chat template; "
                               "use the completions endpoint with a plain prompt.")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.token_text(self.bos_token_id),
                eos_token=self.token_text(self.eos_token_id),
            )
        except TemplateError as e:
            raise RequestError(f"The chat template rejected the messages: {e}.") from None


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence llama.cpp's logging while in the block: its native writes to file descriptor 2,
    and llama-cpp-python's log callback, which prints to whatever `sys.stderr` is (a test's or
    a UI's capture). Both are restored afterwards."""
    sys.stderr.flush()
    saved, saved_py = os.dup(2), sys.stderr
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        sys.stderr = io.StringIO()
        yield
    finally:
        sys.stderr = saved_py
        os.dup2(saved, 2)
        os.close(saved)


VOCAB_PROBE_FILE = "vocab-probe.json"
"""Vocabularies seen to load and round-trip in a child process: by the file's path, what
it and llama-cpp-python were then."""


def _probe_vocab(path: Path) -> None:
    """Load the vocabulary and round-trip a sample text in a child process first: llama.cpp
    aborts the whole process (an uncaught C++ exception) on some malformed vocabularies, and
    a user's bad file must end in a sentence, not a crash. A file seen to pass is not
    probed again (a second a load) until it or llama-cpp-python changes."""
    from importlib.metadata import version

    st = path.stat()
    key = str(path.resolve())
    seen = {"llama_cpp_python": version("llama_cpp_python"), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns}
    passed = read_cache_json(VOCAB_PROBE_FILE).get(key)
    if isinstance(passed, dict) and all(passed.get(k) == v for k, v in seen.items()):
        return
    code = ("import sys\nfrom llama_cpp import Llama\n"
            "t = Llama(sys.argv[1], vocab_only=True, verbose=False)\n"
            "t.detokenize(t.tokenize('Hello, wörld 123 😀'.encode(), add_bos=True))\n")
    try:
        r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                           timeout=120)
    except subprocess.TimeoutExpired:
        raise ModelFileError(f"Loading the vocabulary of {path} took over 2 minutes.") from None
    if r.returncode != 0:
        raise ModelFileError(f"llama.cpp cannot load the vocabulary of {path} (it exited with "
                             f"status {r.returncode}); the file's tokenizer data is malformed "
                             "or unsupported.")
    with contextlib.suppress(OSError):  # an unwritable cache: probe again next time
        write_cache_entry(VOCAB_PROBE_FILE, key, {**seen, "probed": time.time()})


class IncrementalDetokenizer:
    """Text of one request's output, produced token by token."""

    def __init__(self, tokenizer: Tokenizer, prompt_tokens: list[int],
                 stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self._prev = list(prompt_tokens[-8:])  # enough context for leading-space rules
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        """Decoded output so far (cut at a matched stop string)."""
        self.emitted = 0
        """Characters of `text` already handed out by `push`."""
        self.stopped_by: str | None = None

    def push(self, token: int) -> str:
        """Add a token; returns newly safe-to-stream text. Sets `stopped_by` on a stop match,
        after which further tokens add nothing."""
        if self.stopped_by is not None:
            return ""
        piece = self._utf8.decode(self.tokenizer.token_bytes(token, self._prev))
        self._prev = (self._prev + [token])[-8:]
        start = max(len(self.text) - self.hold, 0)
        self.text += piece
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0:  # later strings only ever cut earlier: the first match wins
                self.text = self.text[:i]
                self.stopped_by = s
        if self.stopped_by is not None:
            return self.flush()
        safe = len(self.text) - self.hold
        out = self.text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted += len(out)
        return out

    def flush(self) -> str:
        """Everything not yet emitted (at the end of the request)."""
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out


def forced_runs(tokenizer: Tokenizer, prompt: list[int], output: list[int],
                forced: list[bool]) -> tuple[tuple[str, bool], ...]:
    """`output`'s text in runs of (text, forced) — `forced[i]`: a grammar allowed token i
    nothing else — decoded token by token as `IncrementalDetokenizer` does."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    prev = list(prompt[-8:])
    runs: list[list] = []
    for i, token in enumerate(output):
        piece = utf8.decode(tokenizer.token_bytes(token, prev))
        prev = (prev + [token])[-8:]
        flag = i < len(forced) and forced[i]
        if runs and runs[-1][1] == flag:
            runs[-1][0] += piece
        elif piece:
            runs.append([piece, flag])
    return tuple((text, flag) for text, flag in runs)
