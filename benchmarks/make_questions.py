"""Writes runtime/text/questions.jsonl: the checked question set of `kvdeck bench --models`.

Short questions with one right answer each, mostly easy (the traffic a cascade is for):
two-digit sums, products and differences, capitals, and a few Python expressions. Seeded:
running it again writes the same file. Each line is {"question": ..., "check": {"regex":
...}}, the regex accepting the answer alone with any punctuation or spacing around it.
"""

import json
import random
import re
import sys
from pathlib import Path

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Germany", "Berlin"), ("Egypt", "Cairo"), ("Russia", "Moscow"),
            ("China", "Beijing"), ("Kenya", "Nairobi"), ("Greece", "Athens"),
            ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Turkey", "Ankara"),
            ("Brazil", "Brasilia")]
WORDS = ["hello", "python", "kernel", "cache", "token", "stream"]


def questions(seed: int = 2026) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    qs = []
    for _ in range(20):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        qs.append((f"What is {a} + {b}?", str(a + b)))
    for _ in range(10):
        a, b = rng.randint(12, 99), rng.randint(3, 9)
        qs.append((f"What is {a} * {b}?", str(a * b)))
    for _ in range(8):
        b = rng.randint(100, 800)
        a = rng.randint(b, 999)
        qs.append((f"What is {a} - {b}?", str(a - b)))
    qs += [(f"What is the capital of {c}?", k) for c, k in CAPITALS]
    qs += [(f"In Python, what does len('{w}') return?", str(len(w))) for w in WORDS]
    for _ in range(6):
        a, b = rng.randint(20, 99), rng.randint(3, 9)
        qs.append((f"In Python, what does {a} % {b} evaluate to?", str(a % b)))
    for _ in range(6):
        xs = [rng.randint(1, 9) for _ in range(rng.randint(3, 4))]
        qs.append((f"In Python, what does sum({xs}) return?", str(sum(xs))))
    return qs


def main(path: str) -> None:
    lines = [json.dumps({"question": q + " Reply with the answer only.",
                         "check": {"regex": r"\W*" + re.escape(a) + r"\W*"}})
             for q, a in questions()]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runtime/text/questions.jsonl")
