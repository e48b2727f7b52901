"""The OpenAI-compatible API over an engine running in its own thread.

Errors are OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`): 400 for invalid
parameters (naming the field) and prompts longer than the context, 401 for a missing or
wrong API key, 404 for an unknown model, 413 for oversized bodies, 429 when the waiting
queue is full, 503 when admission control rejects a request. A client that disconnects
aborts its request; its blocks come back after the in-flight step.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from runtime.engine import Engine
from runtime.engine_loop import EngineLoop
from runtime.errors import ConfigError, EngineFailedError, QueueFullError, RequestError
from runtime.request import RequestStatus, SamplingParams
from runtime.server.metrics import ServerMetrics
from runtime.server.streams import OutputHub
from runtime.settings import Settings
from runtime.tokenizer import Tokenizer

MAX_BODY_BYTES = 4 << 20


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    """vLLM's extension: keep generating past end-of-sequence (benchmarks need exact
    output lengths)."""


class CompletionBody(_Common):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)


def error(status: int, message: str, kind: str = "invalid_request_error",
          param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": kind, "param": param, "code": status}})


def config_json(settings: Settings | None, engine: Engine) -> dict:
    """The resolved settings and the engine's configuration as JSON."""
    return {"settings": settings.flat() if settings is not None else None,
            "engine": dataclasses.asdict(engine.config),
            "num_blocks": engine.kv.num_blocks, "max_model_len": engine.max_model_len}


def create_app(engine: Engine, tokenizer: Tokenizer, model_id: str, loop: EngineLoop, *,
               api_key: str | None = None, settings: Settings | None = None) -> FastAPI:
    """The API for one engine serving one model; `loop` (which the caller runs) publishes
    the snapshots /metrics and /health read."""
    app = FastAPI(title="kvdeck", docs_url=None, redoc_url=None)
    hub = OutputHub(engine)
    metrics = ServerMetrics(loop, model_id)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1") and \
                request.headers.get("authorization") != f"Bearer {api_key}":
            return error(401, "Missing or wrong API key; send 'Authorization: Bearer KEY'.",
                         "authentication_error")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            return error(413, f"The request body is {int(size):,} bytes; the limit is "
                              f"{MAX_BODY_BYTES:,}.")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
        if first["type"] == "json_invalid":
            return error(400, "The request body is not valid JSON.", param="body")
        return error(400, f"Invalid value for '{field}': {first['msg']}.", param=field)

    def failed() -> JSONResponse | None:
        """503 with the reason once the engine has stopped, as the latest snapshot says."""
        snap = loop.latest
        if snap is None or snap.failure is None:
            return None
        where = f" (traceback in {snap.failure.log_path})" if snap.failure.log_path else ""
        return error(503, f"The engine has stopped: {snap.failure.message}{where}.",
                     "service_unavailable")

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while serving; 503 with the reason once failed, or while the operator has
        paused the engine (requests are still queued then, and run when it resumes)."""
        down = failed()
        if down is not None:
            return JSONResponse(status_code=503, content={
                "status": "failed", "reason": json.loads(down.body)["error"]["message"]})
        if loop.latest is not None and loop.latest.paused:
            return JSONResponse(status_code=503, content={
                "status": "paused", "reason": "The engine is paused by its operator; "
                "requests queue until it resumes."})
        return JSONResponse({"status": "ok"})

    @app.get("/kvdeck/config")
    async def kvdeck_config() -> dict:
        return config_json(settings, engine)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model",
                                            "created": 0, "owned_by": "kvdeck"}]}

    @app.post("/tokenize")
    async def tokenize(body: dict) -> JSONResponse:
        text = body.get("prompt")
        if not isinstance(text, str):
            return error(400, "'prompt' must be a string.", param="prompt")
        tokens = tokenizer.encode(text)
        return JSONResponse({"tokens": tokens, "count": len(tokens)})

    @app.post("/detokenize")
    async def detokenize(body: dict) -> JSONResponse:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and 0 <= t < tokenizer.vocab_size for t in tokens):
            return error(400, f"'tokens' must be a list of token ids from 0 to "
                              f"{tokenizer.vocab_size - 1}.", param="tokens")
        return JSONResponse({"prompt": tokenizer.decode(tokens)})

    async def generate(request: Request, body: _Common, prompt: list[int], chat: bool):
        if body.model != model_id:
            return error(404, f"The model '{body.model}' does not exist; this server serves "
                              f"'{model_id}'.", param="model")
        down = failed()
        if down is not None:
            return down
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        room = engine.max_model_len - len(prompt)
        try:
            sampling = SamplingParams(
                temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                max_tokens=body.max_tokens if body.max_tokens is not None
                else max(min(16 if not chat else room, room), 1),
                stop=stop, seed=body.seed, ignore_eos=body.ignore_eos,
                stop_token_ids=tokenizer.end_of_turn_ids if chat else ())
            req = engine.add_request(prompt, sampling,
                                     request_id=f"{'chat' if chat else 'cmpl'}-"
                                                f"{uuid.uuid4().hex[:12]}")
        except (RequestError, ConfigError) as e:
            return error(400, str(e))
        except QueueFullError as e:
            return error(429, str(e), "rate_limit_error")
        except EngineFailedError as e:
            return error(503, str(e), "service_unavailable")
        stream = hub.watch(req)
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def usage() -> dict:
            return {"prompt_tokens": req.num_prompt_tokens,
                    "completion_tokens": req.num_output_tokens,
                    "total_tokens": req.num_prompt_tokens + req.num_output_tokens}

        def finish_reason() -> str:
            return "length" if req.status is RequestStatus.FINISHED_LENGTH else "stop"

        def choice(text: str, final: bool, delta: bool) -> dict:
            c: dict = {"index": 0, "finish_reason": finish_reason() if final else None}
            if chat:
                c["delta" if delta else "message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            return c

        if not body.stream:
            text = ""
            while True:
                d = await stream.get()
                text += d.text
                if d.finished:
                    break
                if await request.is_disconnected():
                    engine.abort(req.request_id, "client disconnected")
            if req.status in (RequestStatus.REJECTED, RequestStatus.ABORTED):
                return error(503, f"The request was {req.status.value}: {req.reason}.",
                             "service_unavailable")
            return JSONResponse({"id": req.request_id, "object": kind, "created": created,
                                 "model": model_id, "choices": [choice(text, True, False)],
                                 "usage": usage()})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        async def events() -> AsyncIterator[str]:
            try:
                while True:
                    d = await stream.get()
                    if req.status in (RequestStatus.REJECTED, RequestStatus.ABORTED) and \
                            d.finished:
                        yield "data: " + json.dumps({"error": {
                            "message": f"The request was {req.status.value}: {req.reason}.",
                            "type": "service_unavailable", "code": 503}}) + "\n\n"
                        break
                    if d.text or d.finished:
                        payload = {"id": req.request_id, "object": chunk_kind,
                                   "created": created, "model": model_id,
                                   "choices": [choice(d.text, d.finished, True)]}
                        if include_usage:
                            payload["usage"] = None
                        yield "data: " + json.dumps(payload) + "\n\n"
                    if d.finished:
                        if include_usage:
                            yield "data: " + json.dumps({
                                "id": req.request_id, "object": chunk_kind,
                                "created": created, "model": model_id, "choices": [],
                                "usage": usage()}) + "\n\n"
                        yield "data: [DONE]\n\n"
                        break
            finally:
                if not req.status.is_finished:  # the client went away mid-stream
                    engine.abort(req.request_id, "client disconnected")
                    hub.forget(req.request_id)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        prompt = body.prompt if isinstance(body.prompt, list) else tokenizer.encode(body.prompt)
        if isinstance(body.prompt, list) and not all(
                0 <= t < tokenizer.vocab_size for t in body.prompt):
            return error(400, f"'prompt' token ids must be from 0 to "
                              f"{tokenizer.vocab_size - 1}.", param="prompt")
        return await generate(request, body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatBody):
        try:
            text = tokenizer.render_chat([m.model_dump() for m in body.messages])
        except RequestError as e:
            return error(400, str(e), param="messages")
        prompt = tokenizer.encode(text, add_bos=False)
        return await generate(request, body, prompt, chat=True)

    return app
