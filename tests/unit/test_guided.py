"""Constrained decoding's pieces on the real Gemma 3 270M vocabulary: compiling constraints
(and the one sentence a bad one gets), the grammar state a request carries (commits, forced
tokens, forks, draft masks that roll back), and masking in the shared sampler."""

from __future__ import annotations

import json

import pytest
import torch

from kvdeck.runtime.core.request import Request, SamplingParams
from kvdeck.runtime.spec.verify import sample_draft
from kvdeck.runtime.text.guided import (
    ConstraintError,
    Grammars,
    GuideSpec,
    apply_mask,
    choice_spec,
    unpack,
)
from kvdeck.runtime.text.sampling import constrain, sample
from kvdeck.runtime.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def grammars(gemma_path) -> Grammars:
    tok = Tokenizer(gemma_path)
    return Grammars(tok, (tok.eos_token_id, *tok.end_of_turn_ids), tok.vocab_size)


def ids(grammars: Grammars, text: str) -> list[int]:
    return grammars.tokenizer.encode(text, add_bos=False)


def test_a_schema_guide_walks_a_valid_answer_and_finishes(grammars) -> None:
    g = grammars.start(GuideSpec("json_schema", json.dumps(SCHEMA)))
    for t in ids(grammars, '{"name": "Ada", "age": 36}'):
        assert not g.finished
        assert g.allowed()[t], grammars.tokenizer.token_text(t)
        assert g.commit(t)
    # The closing brace is the end: only the end-of-sequence tokens remain allowed.
    allowed = g.allowed()
    assert set(torch.nonzero(allowed).flatten().tolist()) <= set(grammars.end_ids)


def test_tokens_outside_the_grammar_are_refused(grammars) -> None:
    g = grammars.start(GuideSpec("json_schema", json.dumps(SCHEMA)))
    bad = ids(grammars, "Hello")[0]
    assert not g.allowed()[bad]
    assert not g.commit(bad) and g.error


def test_forced_tokens_are_marked(grammars) -> None:
    g = grammars.start(GuideSpec("json_schema", json.dumps(SCHEMA)))
    tokens = ids(grammars, '{"name": "Ada", "age": 36}')
    for t in tokens:
        g.commit(t)
    pieces = [grammars.tokenizer.token_text(t) for t in tokens]
    forced = dict(zip(pieces, g.forced, strict=True))
    # The brace and the key names follow from the schema; the name's letters do not.
    assert forced["{\""] is True or forced.get("{") is True
    assert forced["Ada"] is False and forced["3"] is False


def test_a_fork_follows_its_own_tokens(grammars) -> None:
    g = grammars.start(GuideSpec("choice", json.dumps(["yes", "no"])))
    twin = g.fork()
    g.commit(ids(grammars, "yes")[0])
    assert g.finished and not twin.finished
    assert twin.allowed()[ids(grammars, "no")[0]]


def test_draft_masks_score_each_position_and_leave_the_state_alone(grammars) -> None:
    g = grammars.start(GuideSpec("regex", r"[0-9]{3}-[0-9]{4}"))
    before = g.allowed().clone()
    digits = ids(grammars, "555")
    draft = [*digits, ids(grammars, "x")[0], digits[0]]
    rows = g.draft_allowed(draft)
    assert rows.shape == (len(draft) + 1, before.shape[0])
    assert torch.equal(rows[0], before)
    for i, t in enumerate(digits):  # each valid draft token allowed where it stands
        assert rows[i][t]
    assert not rows[len(digits)][draft[len(digits)]]  # the refused one: probability 0
    assert torch.equal(g.allowed(), before)  # the request's state is where it was
    assert g.commit(digits[0])


def test_a_draft_running_past_the_grammars_end(grammars) -> None:
    """A draft that completes the grammar and goes on to an end token (as a draft model
    proposes `}` then end-of-turn) leaves the request's grammar state intact."""
    g = grammars.start(GuideSpec("regex", "ab"))
    (ab,) = ids(grammars, "ab")
    eos = grammars.end_ids[0]
    rows = g.draft_allowed([ab, eos, eos])
    assert rows[0][ab] and rows[1][eos] and not rows[1][ab]
    assert torch.equal(rows[0], g.allowed())  # untouched by the walk
    assert g.commit(ab) and g.finished


@pytest.mark.parametrize("spec, needle", [
    (GuideSpec("json_schema", '{"type": "strin"}'), "Invalid type: strin"),
    (GuideSpec("json_schema", "{not json"), "not valid JSON"),
    (GuideSpec("json_schema", "[1, 2]"), "must be an object"),
    (GuideSpec("regex", "[a-"), "unclosed character class"),
    (GuideSpec("grammar", "start: foo"), "unknown name"),
])
def test_a_bad_constraint_gets_one_sentence(grammars, spec, needle) -> None:
    with pytest.raises(ConstraintError) as e:
        grammars.start(spec)
    message = str(e.value)
    assert needle in message and message.endswith(".") and "\n" not in message


def test_choices_and_gbnf(grammars) -> None:
    with pytest.raises(ConstraintError, match="at least one"):
        choice_spec([])
    g = grammars.start(choice_spec(['say "hi"', "bye"]))  # quotes matched verbatim
    for t in ids(grammars, 'say "hi"'):
        assert g.commit(t)
    assert g.finished
    g = grammars.start(GuideSpec("grammar", 'root ::= "yes" | "no"'))
    assert g.allowed()[ids(grammars, "no")[0]] and not g.allowed()[ids(grammars, "maybe")[0]]
    with pytest.raises(ConstraintError, match="kind must be one of"):
        GuideSpec("xml")


def test_unpack_reads_llguidance_bit_order() -> None:
    bits = torch.tensor([0b101, -(1 << 31) | 1], dtype=torch.int32)  # bit 31: the sign bit
    allowed = unpack(bits, 64)
    assert torch.nonzero(allowed).flatten().tolist() == [0, 2, 32, 63]
    assert torch.nonzero(unpack(bits, 40)).flatten().tolist() == [0, 2, 32]
    logits = torch.zeros(66)  # two padding columns past the mask: refused too
    assert torch.isfinite(apply_mask(logits, allowed)).nonzero().flatten().tolist() == \
        [0, 2, 32, 63]


def test_the_sampler_only_picks_allowed_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0]])
    allowed = torch.tensor([False, False, True, True])
    reqs = [Request("g", [1], SamplingParams(temperature=0)),
            Request("s", [1], SamplingParams(temperature=1.0, seed=3))]
    for _ in range(20):
        tokens, _ = sample(logits, reqs, masks={"g": allowed, "s": allowed})
        assert tokens[0] == 2 and tokens[1] in (2, 3)
        reqs[1].output_token_ids.append(tokens[1])  # a fresh draw each round
    unmasked, _ = sample(logits, reqs[:1])
    assert unmasked == [0]


def test_the_grammar_wins_over_min_tokens() -> None:
    """A finished grammar allows only the end; `min_tokens` masks the end: the grammar's
    choice stands rather than an all -inf row."""
    raw = torch.tensor([1.0, 2.0, 3.0])
    processed = torch.tensor([float("-inf"), 2.0, 3.0])
    only_end = torch.tensor([True, False, False])
    assert constrain(processed, raw, only_end).argmax() == 0


def test_draft_verification_under_a_mask_rejects_refused_tokens() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0], [0.0, 9.0, 0.0], [9.0, 0.0, 0.0]])
    req = Request("s", [1], SamplingParams(temperature=1.0, seed=1))
    allowed = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    # Token 2 is the target's favourite at position 0, but the grammar refuses it there.
    for _ in range(10):
        out = sample_draft(logits, req, [2, 1], allowed=allowed)
        assert out[0] != 2
        req.output_token_ids.append(0)


def test_a_grammar_in_error_fails_its_request_not_the_step(grammars) -> None:
    """A matcher in an error state (a refused token, a user grammar past llguidance's
    limits) gives no mask: the step's result fails that request with a sentence, and the
    others' masks are computed as usual."""
    from kvdeck.runtime.text.guided import MaskJob

    broken = Request("broken", [1], SamplingParams(temperature=1.0))
    broken.guide = grammars.start(GuideSpec("regex", "[0-9]+"))
    assert not broken.guide.commit(ids(grammars, "x")[0])
    fine = Request("fine", [1], SamplingParams(temperature=1.0))
    fine.guide = grammars.start(GuideSpec("regex", "[0-9]+"))
    job = MaskJob([broken, fine], [])
    masks = job.wait()
    assert set(masks) == {"fine"}
    assert job.errors["broken"].startswith("its constraint failed:")
