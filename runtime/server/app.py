"""The OpenAI-compatible API over an engine running in its own thread.

Every request is owned by a live client: a non-streaming request is aborted as soon as its
client disconnects (a watcher waits on the connection while the answer is produced), a
streaming one when a write fails, and any request past `request_timeout_s`. Its blocks come
back after the in-flight step. Prompts are tokenized off the event loop, so a large one
does not stall other clients. Errors are OpenAI-shaped (see `api_errors.py`); the ASGI
`Guard` in front handles auth, the body limit and read timeouts before any parsing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from runtime.checks import parse_check
from runtime.engine import Engine
from runtime.engine_loop import EngineLoop
from runtime.errors import ConfigError, EngineFailedError, QueueFullError, RequestError
from runtime.guided import ConstraintError
from runtime.request import Request as EngineRequest
from runtime.request import RequestStatus, SamplingParams
from runtime.server.api_errors import error, validation_sentence
from runtime.server.guard import Guard
from runtime.server.metrics import ServerMetrics
from runtime.server.schemas import (
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    GenerateBody,
    TokenizeBody,
)
from runtime.server.streams import OutputHub
from runtime.settings import Settings

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions when `max_tokens` is not given."""


@dataclass(frozen=True)
class ServeLimits:
    """Bounds a server holds every client to (flags of `kvdeck serve`)."""

    max_body_bytes: int = 4 << 20
    read_timeout_s: float = 10.0
    """Seconds a request body may take between chunks before the answer is 408."""
    request_timeout_s: float | None = 600.0
    """Seconds a request may run before it is aborted (None: no bound)."""
    default_max_tokens: int = 1024
    """Output bound of a chat request that names none (within the context)."""
    metrics_need_key: bool = False


def config_json(settings: Settings | None, engine: Engine) -> dict:
    """The resolved settings and the engine's configuration as JSON."""
    return {"settings": settings.flat() if settings is not None else None,
            "engine": dataclasses.asdict(engine.config),
            "num_blocks": engine.kv.num_blocks, "max_model_len": engine.max_model_len}


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(engine: Engine, tokenizer, model_id: str, loop: EngineLoop, *,
               api_key: str | None = None, settings: Settings | None = None,
               limits: ServeLimits = ServeLimits()) -> Guard:
    """The API for one engine serving one model, behind its `Guard`; `loop` (which the
    caller runs) publishes the snapshots /metrics and /health read."""
    app = FastAPI(title="kvdeck", version="1", docs_url=None, redoc_url=None)
    hub = OutputHub(engine)
    metrics = ServerMetrics(loop, model_id)
    # One worker: tokenization leaves the event loop, and the tokenizer sees one caller.
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvdeck-tokenize")
    app.state.hub = hub

    async def off_loop(fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            tokenizing, lambda: fn(*args, **kwargs))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_sentence(list(exc.errors()))
        return error(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error(404, f"There is no endpoint {request.url.path}; see /openapi.json "
                              "for the ones this server has.")
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "another method")
            return error(405, f"{request.url.path} does not take {request.method}; use "
                              f"{allowed}.")
        if exc.status_code == 400:
            return error(400, "The request body could not be parsed as JSON (is it nested "
                              "too deeply?).", "body")
        return error(exc.status_code, f"{exc.detail}.")

    def failed() -> JSONResponse | None:
        """503 with the reason once the engine has stopped, as the latest snapshot says."""
        snap = loop.latest
        if snap is None or snap.failure is None:
            return None
        where = f" (traceback in {snap.failure.log_path})" if snap.failure.log_path else ""
        return error(503, f"The engine has stopped: {snap.failure.message}{where}.")

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
                                            "created": 0, "owned_by": "kvdeck",
                                            "max_model_len": engine.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> JSONResponse:
        tokens = await off_loop(tokenizer.encode, body.prompt,
                                add_bos=None if body.add_special_tokens else False)
        return JSONResponse({"tokens": tokens, "count": len(tokens),
                             "max_model_len": engine.max_model_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> JSONResponse:
        if any(t >= tokenizer.vocab_size for t in body.tokens):
            return error(400, f"'tokens' must be token ids from 0 to "
                              f"{tokenizer.vocab_size - 1}.", "tokens")
        return JSONResponse({"prompt": await off_loop(tokenizer.decode, body.tokens)})

    async def generate(request: Request, body: GenerateBody, prompt: list[int], chat: bool,
                       echo: str | None = None):
        """`echo`: the prompt's text, to put before the completion's (completions' `echo`)."""
        if body.model != model_id:
            return error(404, f"The model '{body.model}' does not exist; this server serves "
                              f"'{model_id}'.", "model")
        down = failed()
        if down is not None:
            return down
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        limit = body.output_limit()
        # `max_tokens: 0` with echo scores the prompt only. The engine still samples the
        # one token the prefill yields anyway (as vLLM does); the answer leaves it out.
        echo_only = limit == 0
        if echo_only:
            limit = 1
        elif limit is None:
            room = engine.max_model_len - len(prompt)
            limit = max(min(limits.default_max_tokens if chat
                            else COMPLETIONS_DEFAULT_MAX_TOKENS, room), 1)
        if isinstance(body, ChatBody) and body.top_logprobs and not body.logprobs:
            return error(400, "'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        if body.num_logprobs() is not None and engine.executor.name == "sim":
            return error(400, "This server runs the sim executor, which computes no logits; "
                              "logprobs need a real model.", "logprobs")
        try:
            guided = body.guide_spec()
        except (RequestError, ValueError) as e:
            return error(400, str(e))
        if guided is not None and engine.executor.name == "sim":
            return error(400, "This server runs the sim executor, which computes no logits; "
                              "constrained output needs a real model.", guided[0])
        try:
            check = body.answer_check()
        except RequestError as e:
            return error(400, str(e), "check")
        if check is None and guided is not None and guided[1].kind == "json_schema":
            # The schema an answer was constrained to is what it must satisfy: one cut
            # short by max_tokens is finished but not good. (A schema llguidance compiles
            # but jsonschema cannot read goes unchecked.)
            with contextlib.suppress(RequestError):
                check = parse_check({"json_schema": json.loads(guided[1].source)})
        try:
            bias = body.bias_pairs()
            vocab = tokenizer.vocab_size
            if any(token >= vocab for token, _ in bias):
                return error(400, f"logit_bias keys must be token ids from 0 to {vocab - 1}.",
                             "logit_bias")
            if any(t >= vocab for t in body.stop_token_ids or ()):
                return error(400, f"stop_token_ids must be token ids from 0 to {vocab - 1}.",
                             "stop_token_ids")
            ends = (*(tokenizer.end_of_turn_ids if chat else ()), *(body.stop_token_ids or ()))
            sampling = SamplingParams(
                temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
                max_tokens=limit, stop=stop, seed=body.seed, ignore_eos=body.ignore_eos,
                stop_token_ids=tuple(dict.fromkeys(ends)), logprobs=body.num_logprobs(),
                prompt_logprobs=body.num_logprobs() if echo is not None else None,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=body.repetition_penalty or 1.0, min_p=body.min_p or 0.0,
                min_tokens=body.min_tokens or 0, logit_bias=bias,
                guide=guided[1] if guided else None)
            rid = f"{'chat' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}"
            # A constraint compiles on submission (milliseconds; the vocabulary's first
            # reading takes seconds): off the event loop.
            if guided:
                req = await off_loop(engine.add_request, prompt, sampling, request_id=rid,
                                     check=check)
            else:
                req = engine.add_request(prompt, sampling, request_id=rid, check=check)
        except ConstraintError as e:
            return error(400, str(e), guided[0])
        except (RequestError, ConfigError, ValueError) as e:
            return error(400, str(e))
        except QueueFullError as e:
            return error(429, str(e))
        except EngineFailedError as e:
            return error(503, str(e))
        answer = Answer(req, model_id, chat, hub.watch(req), tokenizer, echo, echo_only)
        if not body.stream:
            return await answer.whole(request, engine, hub, limits.request_timeout_s)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(answer.events(engine, hub, include_usage,
                                               limits.request_timeout_s),
                                 media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        if body.max_tokens == 0 and not body.echo:
            return error(400, "'max_tokens' must be at least 1, or 0 with 'echo': true (the "
                              "prompt scored, nothing generated).", "max_tokens")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                return error(400, f"'prompt' holds {len(prompt)} prompts; this server takes "
                                  "one prompt per request.", "prompt")
            prompt = prompt[0]
        echo = prompt if body.echo and isinstance(prompt, str) else None
        if isinstance(prompt, str):
            prompt = await off_loop(tokenizer.encode, prompt)
        elif any(t >= tokenizer.vocab_size for t in prompt):
            return error(400, f"'prompt' token ids must be from 0 to "
                              f"{tokenizer.vocab_size - 1}.", "prompt")
        elif body.echo and prompt:
            echo = (await off_loop(token_pieces, tokenizer, prompt)).decode(
                "utf-8", errors="replace")
        return await generate(request, body, prompt, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatBody):
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.text()} for m in body.messages]
        try:
            text = await off_loop(tokenizer.render_chat, messages)
        except RequestError as e:
            return error(400, str(e), "messages")
        prompt = await off_loop(tokenizer.encode, text, add_bos=False)
        return await generate(request, body, prompt, chat=True)

    return Guard(app, api_key=api_key, max_body_bytes=limits.max_body_bytes,
                 read_timeout_s=limits.read_timeout_s,
                 metrics_need_key=limits.metrics_need_key)


def token_pieces(tokenizer, tokens: list[int]) -> bytes:
    """The text of token ids as their logprobs report it: each token's bytes in the context
    of the ones before it (leading-space rules; `decode` drops a leading space), joined."""
    return b"".join(tokenizer.token_bytes(t, tokens[max(i - 4, 0):i])
                    for i, t in enumerate(tokens))


class Answer:
    """One request's answer, whole or streamed, in OpenAI's shapes.

    Completions' `echo` (`echo` holds the prompt's text): the first choice (the first
    chunk of a stream, as vLLM streams it) starts with the prompt's text, and with
    logprobs its report starts with the prompt's tokens — the first with null logprob and
    alternatives, each later one scored given the tokens before it — and `text_offset`
    runs from 0 over the prompt, then the completion. `echo_only` (`max_tokens: 0`): the
    token the engine sampled is left out of the text, the report and the usage."""

    def __init__(self, req: EngineRequest, model_id: str, chat: bool, stream, tokenizer=None,
                 echo: str | None = None, echo_only: bool = False):
        self.req, self.model_id, self.chat, self.stream = req, model_id, chat, stream
        self.tokenizer = tokenizer
        self.echo, self.echo_only = echo, echo_only
        self.echoed = False
        self.created = int(time.time())
        self.reported: list[int] = []
        """Tokens whose logprobs were reported (the context of the next ones' bytes)."""
        self.reported_bytes = b""

    def usage(self) -> dict:
        r = self.req
        out = 0 if self.echo_only else r.num_output_tokens
        return {"prompt_tokens": r.num_prompt_tokens, "completion_tokens": out,
                "total_tokens": r.num_prompt_tokens + out,
                "prompt_tokens_details": {"cached_tokens": r.num_cached_tokens}}

    def logprobs(self, tokens: tuple[int, ...], lps: tuple, final: bool = False,
                 prompt: tuple | None = None) -> dict | None:
        """The tokens' logprobs in OpenAI's shape: chat's `{"content": [{token, logprob,
        bytes, top_logprobs}]}`, or completions' legacy `{tokens, token_logprobs,
        top_logprobs, text_offset}`. None when the request asked for none. `prompt`: the
        echoed prompt's logprobs (its second token on), reported first."""
        if self.req.sampling.logprobs is None or self.tokenizer is None:
            return None
        tokens, lps = tuple(tokens), tuple(lps)
        # The token that ended the answer (end of turn, end of sequence) is not part of its
        # text, and OpenAI reports none for it.
        ends = {*self.req.sampling.stop_token_ids, self.tokenizer.eos_token_id}
        if final and tokens and tokens[-1] in ends and \
                self.req.status is RequestStatus.FINISHED_STOPPED:
            tokens, lps = tokens[:-1], lps[:-1]
        tok = self.tokenizer
        raw, offsets = [], []

        def report(ts) -> None:
            for t in ts:
                # A token's bytes after the ones before it (leading-space rules); the offset
                # counts the whole characters of the text before it.
                b = tok.token_bytes(t, self.reported[-4:])
                offsets.append(len(self.reported_bytes.decode("utf-8", errors="ignore")))
                self.reported.append(t)
                self.reported_bytes += b
                raw.append(b)

        if prompt is not None:
            report(self.req.prompt_token_ids)
            # The completion's offsets count from the end of the echoed text.
            self.reported_bytes = (self.echo or "").encode()
            # The first prompt token has nothing before it to be scored on: null.
            lps = (None, *prompt, *lps)
        report(tokens)
        pieces = [b.decode("utf-8", errors="replace") for b in raw]
        if self.chat:
            def alt(token: int, logprob: float) -> dict:
                b = tok.token_bytes(token)
                return {"token": b.decode("utf-8", errors="replace"), "logprob": logprob,
                        "bytes": list(b)}

            return {"content": [
                {"token": piece, "logprob": lp.logprob, "bytes": list(b),
                 "top_logprobs": [alt(t, v) for t, v in lp.top]}
                for piece, b, lp in zip(pieces, raw, lps, strict=True)], "refusal": None}
        return {"tokens": pieces,
                "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": [None if lp is None else
                                 {tok.token_bytes(t).decode("utf-8", errors="replace"): v
                                  for t, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def choice(self, text: str, final: bool, delta: bool, tokens: tuple[int, ...] = (),
               lps: tuple = (), prompt_lps: tuple = ()) -> dict:
        """One choice (whole or a stream's delta); `prompt_lps`: the prompt's logprobs,
        which the first one reports when echoing."""
        length = self.echo_only or self.req.status is RequestStatus.FINISHED_LENGTH
        reason = ("length" if length else "stop") if final else None
        if self.echo_only:
            text, tokens, lps = "", (), ()
        prompt = None
        if self.echo is not None and not self.echoed:
            self.echoed = True
            text, prompt = self.echo + text, tuple(prompt_lps)
        c: dict = {"index": 0, "finish_reason": reason,
                   "logprobs": self.logprobs(tokens, lps, final, prompt)}
        if self.chat:
            c["delta" if delta else "message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        return c

    def failure(self) -> str | None:
        r = self.req
        if r.status in (RequestStatus.REJECTED, RequestStatus.ABORTED):
            return f"The request was {r.status.value}: {r.reason}."
        return None

    async def whole(self, request: Request, engine: Engine, hub: OutputHub,
                    timeout_s: float | None) -> Response:
        """Wait for the whole answer while watching the client: a disconnect or the timeout
        aborts the request."""
        async def collect() -> tuple[str, tuple[int, ...], tuple, tuple]:
            parts, tokens, lps, prompt = [], [], [], []
            while True:
                d = await self.stream.get()
                parts.append(d.text)
                tokens.extend(d.tokens)
                lps.extend(d.logprobs)
                prompt.extend(d.prompt_logprobs)
                if d.finished:
                    return "".join(parts), tuple(tokens), tuple(lps), tuple(prompt)

        text_task = asyncio.ensure_future(collect())
        gone_task = asyncio.ensure_future(wait_for_disconnect(request))
        done, _ = await asyncio.wait({text_task, gone_task}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        gone_task.cancel()
        rid = self.req.request_id
        if text_task not in done:
            text_task.cancel()
            gone = gone_task in done
            engine.abort(rid, "client disconnected" if gone else
                         f"ran longer than the server's --request-timeout of {timeout_s:g} s")
            hub.forget(rid)
            if gone:
                return Response(status_code=499)  # nobody is listening
            return error(504, f"The request ran longer than the server's limit of "
                              f"{timeout_s:g} s (--request-timeout) and was aborted.")
        problem = self.failure()
        if problem is not None:
            return error(503, problem)
        kind = "chat.completion" if self.chat else "text_completion"
        return JSONResponse({"id": rid, "object": kind, "created": self.created,
                             "model": self.model_id,
                             "choices": [self.choice(*text_task.result()[:1], True, False,
                                                     *text_task.result()[1:])],
                             "usage": self.usage()})

    async def events(self, engine: Engine, hub: OutputHub, include_usage: bool,
                     timeout_s: float | None) -> AsyncIterator[str]:
        """Server-sent events; a failed request ends with an error event."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        rid = self.req.request_id
        deadline = time.monotonic() + timeout_s if timeout_s else None

        def event(payload: dict) -> str:
            return "data: " + json.dumps(payload) + "\n\n"

        try:
            while True:
                remaining = None if deadline is None else max(deadline - time.monotonic(), 0)
                try:
                    d = await asyncio.wait_for(self.stream.get(), remaining)
                except asyncio.TimeoutError:
                    engine.abort(rid, f"ran longer than the server's --request-timeout of "
                                      f"{timeout_s:g} s")
                    yield event({"error": {
                        "message": f"The request ran longer than the server's limit of "
                                   f"{timeout_s:g} s (--request-timeout) and was aborted.",
                        "type": "timeout_error", "param": None, "code": 504}})
                    return
                problem = self.failure() if d.finished else None
                if problem is not None:
                    yield event({"error": {"message": problem, "type": "service_unavailable",
                                           "param": None, "code": 503}})
                    return
                echo = self.echo is not None and not self.echoed
                if d.text or d.finished or echo or \
                        (d.logprobs and self.req.sampling.logprobs is not None):
                    payload = {"id": rid, "object": kind, "created": self.created,
                               "model": self.model_id,
                               "choices": [self.choice(d.text, d.finished, True, d.tokens,
                                                       d.logprobs, d.prompt_logprobs)]}
                    if include_usage:
                        payload["usage"] = None
                    yield event(payload)
                if d.finished:
                    if include_usage:
                        yield event({"id": rid, "object": kind, "created": self.created,
                                     "model": self.model_id, "choices": [],
                                     "usage": self.usage()})
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not self.req.status.is_finished:  # the client went away mid-stream
                engine.abort(rid, "client disconnected")
            hub.forget(rid)
