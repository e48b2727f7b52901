"""A stand-in tokenizer for the sim executor when no real tokenizer is named: one token per
word, each token id a readable pseudo-word, so a simulated server's answers have exactly as
many tokens as they have words and a person can read them.

Token id `t` spells a word from syllables (consonant + vowel): ids below 4,900 take two
syllables, the rest three, so every id has its own word and a word from `decode` encodes
back to its id. Any other word is hashed into the vocabulary.
"""

from __future__ import annotations

import zlib

from kvdeck.runtime.errors import RequestError

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)
_BASE = len(SYLLABLES)  # 70
_TWO = _BASE * _BASE  # ids below this spell two syllables
_INDEX = {s: i for i, s in enumerate(SYLLABLES)}


def word(token: int) -> str:
    """The word token id `token` stands for."""
    if token < _TWO:
        return SYLLABLES[token // _BASE] + SYLLABLES[token % _BASE]
    t = token - _TWO
    return SYLLABLES[t // _TWO % _BASE] + SYLLABLES[t // _BASE % _BASE] + SYLLABLES[t % _BASE]


def _parse(w: str) -> int | None:
    parts = [w[i:i + 2] for i in range(0, len(w), 2)]
    if len(w) % 2 or len(parts) not in (2, 3) or any(p not in _INDEX for p in parts):
        return None
    digits = [_INDEX[p] for p in parts]
    if len(digits) == 2:
        return digits[0] * _BASE + digits[1]
    return _TWO + (digits[0] * _BASE + digits[1]) * _BASE + digits[2]


class StandInTokenizer:
    """Whitespace-separated words as tokens, ids as pseudo-words (see the module doc)."""

    architecture = "stand-in"
    chat_template = "role: content lines"
    add_bos = False
    end_of_turn_ids: tuple[int, ...] = ()
    is_instruct = False

    def __init__(self, vocab_size: int, eos_token_id: int):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.bos_token_id = eos_token_id
        self.path = None

    def _id(self, w: str) -> int:
        t = _parse(w)
        if t is None or t >= self.vocab_size or t == self.eos_token_id:
            t = zlib.crc32(w.encode()) % self.vocab_size
            if t == self.eos_token_id:
                t = (t + 1) % self.vocab_size
        return t

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        return [self._id(w) for w in text.split()]

    def token_bytes(self, token: int, prev: list[int] | None = None) -> bytes:
        return (" " + word(token) if prev else word(token)).encode()

    def decode(self, tokens: list[int]) -> str:
        return " ".join(word(t) for t in tokens)

    def token_text(self, token: int) -> str:
        return word(token)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Each message as 'role: content' on its own line, then 'assistant:'."""
        for m in messages:
            if not isinstance(m.get("content"), str):
                raise RequestError("Each message's content must be text.")
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return text + ("\nassistant:" if add_generation_prompt else "")
