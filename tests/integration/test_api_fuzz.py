"""Property-based fuzzing of the API from its own OpenAPI schema.

Schemathesis reads `/openapi.json` (FastAPI publishes it) and sends, for every operation,
bodies that fit the schema and bodies that break it (wrong types, missing and extra fields,
odd strings). It is the tool picked over hypothesis-jsonschema because it covers the whole
document — paths, methods, headers and negative cases — and shrinks a failure to a small
reproducible request, where hypothesis-jsonschema would only generate bodies and leave the
rest to code of ours. Whatever it sends: no 5xx, every error in OpenAI's shape with one
sentence, and afterwards a healthy server with nothing held and `check_integrity()` true.

CI runs a bounded number of examples per operation; `make fuzz` runs many more. Schemathesis
needs Python 3.11 or newer: on 3.10 this module is skipped.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from kvdeck.runtime.server.app import ServeLimits
from kvdeck.runtime.server.serve import ApiServer
from kvdeck.runtime.session import build_session
from kvdeck.runtime.settings import resolve

schemathesis = pytest.importorskip("schemathesis",
                                   reason="schemathesis runs on Python 3.11 and newer")

EXAMPLES = int(os.environ.get("KVDECK_FUZZ_EXAMPLES", "40"))
MODEL = "qwen3-8b"


@pytest.fixture(scope="module")
def fuzz_server():
    # A simulated card 1,000× faster than the wall clock: a generation the fuzzer asks for
    # at the whole context takes about a second, not minutes.
    session = build_session(resolve({"executor": "sim", "pace": 1000.0}), live=True)
    srv = ApiServer(session, port=0, limits=ServeLimits(read_timeout_s=5.0)).start()
    yield srv
    base = f"http://127.0.0.1:{srv.port}"
    end = time.monotonic() + 60
    while True:  # everything the fuzzer started has ended
        snap = srv.loop.latest
        if snap is not None and not snap.running and not snap.waiting and snap.kv.usage == 0:
            break
        assert time.monotonic() < end, "requests are still held after the fuzz run"
        time.sleep(0.05)
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    srv.stop()
    srv.engine.check_integrity()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{fuzz_server.port}/openapi.json")
    schema.config.generation.update(modes=list(schemathesis.GenerationMode),
                                    max_examples=EXAMPLES)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
def test_no_5xx_and_every_error_in_openai_shape(case) -> None:
    if isinstance(case.body, dict) and "model" in case.body and \
            case.meta is not None and case.meta.generation.mode.is_positive:
        case.body["model"] = MODEL  # reach the engine, not only the model check
    response = case.call(timeout=60)
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["code"] == response.status_code
        message = err["message"]
        assert message and message.endswith(".") and "\n" not in message, message
        assert "Input should" not in message and "pydantic" not in message, message
