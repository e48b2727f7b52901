"""Constrained decoding on Gemma 3 270M with the torch and llama_cpp executors: outputs
follow their schema, regex or choices inside a continuous batch beside unconstrained
requests, and n-gram speculation leaves greedy constrained outputs token for token what
plain decoding gives (drafts the grammar refuses are rejected, its state rolled back)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvdeck.runtime.core.config import EngineConfig, Knobs
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import RequestStatus, SamplingParams
from kvdeck.runtime.text.guided import GuideSpec, choice_spec
from kvdeck.runtime.text.tokenizer import Tokenizer
from kvdeck.runtime.views.snapshot import snapshot_of
from tests.kernel_ties import assert_equal_up_to_kernel_ties

pytestmark = pytest.mark.slow

ITEMS = {"type": "object", "properties": {
    "people": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                         "age": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
        "required": ["name", "age"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False}
PROMPT = ('People as JSON: {"people": [{"name": "Ann", "age": 31}, {"name": "Bob", '
          '"age": 42}]}\nMore people as JSON:')
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PROMPTS = {"items": PROMPT, "phone": "Call us at (555) 123-4567 or at",
           "pick": "My favourite colour is", "free": "The capital of France is"}


def make_engine(path, executor: str, method: str) -> Engine:
    if executor == "torch":
        from kvdeck.runtime.executors.torch import TorchExecutor

        ex = TorchExecutor(path, device="cpu", dtype="fp32", weight_activations="fp32")
    else:
        from kvdeck.runtime.executors.llama_cpp import LlamaCppExecutor

        # Batch-invariant: a verify chunk's rows then score as plain decoding's do.
        ex = LlamaCppExecutor(path, threads=2, batch_invariant=True)
    return Engine(EngineConfig(knobs=Knobs(speculative_method=method, weight_format="dense",
                                           draft_length="fixed", num_speculative_tokens=4,
                                           max_num_seqs=8)),
                  ex, tokenizer=Tokenizer(path))


def run(path, executor: str, method: str) -> tuple[dict, Engine]:
    e = make_engine(path, executor, method)
    tok = e.tokenizer
    greedy = {"max_tokens": 90, "temperature": 0.0}
    specs = {"items": GuideSpec("json_schema", json.dumps(ITEMS)),
             "phone": GuideSpec("regex", PHONE),
             "pick": choice_spec(["red", "green", "blue"])}
    for name, spec in specs.items():
        e.add_request(tok.encode(PROMPTS[name]), SamplingParams(**greedy, guide=spec),
                      request_id=name)
    e.add_request(tok.encode(PROMPT), SamplingParams(temperature=0.8, seed=5, max_tokens=90,
                                                     guide=specs["items"]), request_id="sampled")
    e.add_request(tok.encode(PROMPTS["free"]), SamplingParams(**greedy),
                  request_id="free")
    while e.has_work:
        e.step()
        e.check_integrity()
    return {r.request_id: r for r in e.completed}, e


@pytest.mark.parametrize("executor", ["torch", "llama_cpp"])
def test_constrained_outputs_with_and_without_speculation(gemma_path, executor) -> None:
    plain, e0 = run(gemma_path, executor, "off")
    spec, e1 = run(gemma_path, executor, "ngram")
    for done in (plain, spec):
        for name in ("items", "sampled"):
            assert done[name].status is RequestStatus.FINISHED_STOPPED
            jsonschema.validate(json.loads(done[name].output_text), ITEMS)
        assert re.fullmatch(PHONE, done["phone"].output_text)
        assert done["pick"].output_text in ("red", "green", "blue")
        assert len(done["free"].output_token_ids) == 90  # unconstrained beside them
    names = ("items", "phone", "pick", "free")
    expected = {n: plain[n].output_token_ids for n in names}
    got = {n: spec[n].output_token_ids for n in names}
    if executor == "llama_cpp":  # greedy: speculation is lossless up to kernel ties
        # A phone number's digits are near-ties (measured: rows of a 5-row verify chunk
        # and of a lone decode differ by up to 0.2 there); torch's run is exact.
        assert_equal_up_to_kernel_ties(gemma_path, PROMPTS, expected, got, tol=0.3)
    else:
        assert got == expected
    stats = e1.scheduler.spec
    # Drafts were verified against the grammar's masks, and some were turned down.
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert sum(spec["items"].guide.forced) > 10  # the keys and punctuation are forced
    e0.close()
    e1.close()


def test_the_console_marks_forced_tokens(gemma_path) -> None:
    """The followed request's text comes in runs: the schema's keys and punctuation forced
    (underlined in the prompt panel), the values chosen by the model."""
    from kvdeck.console.widgets.prompt import FORCED_STYLE, tracked_text

    e = make_engine(gemma_path, "torch", "off")
    spec = GuideSpec("json_schema", json.dumps(ITEMS))
    req = e.add_request(e.tokenizer.encode(PROMPT), SamplingParams(temperature=0,
                                                                  max_tokens=90, guide=spec),
                        track=True, branches=2)
    e.run_until_idle()
    (t,) = snapshot_of(e).tracked
    assert "".join(text for text, _ in t.segments) == req.output_text
    forced = "".join(text for text, f in t.segments if f)
    assert '{"people": [{"name": "' in forced and '"age": ' in forced
    assert t.constraint.startswith("json_schema") and len(t.branches) == 1
    assert t.branches[0].segments  # the other sample's grammar forked with it
    line = tracked_text(t)
    assert "forced underlined" in line.plain
    assert any(span.style == FORCED_STYLE for span in line.spans)
    e.check_integrity()
    e.close()
