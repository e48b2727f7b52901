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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from kvdeck.runtime.core.commands import ResetPrefixCache
from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import Request as EngineRequest
from kvdeck.runtime.core.request import SamplingParams
from kvdeck.runtime.errors import ConfigError, EngineFailedError, QueueFullError, RequestError
from kvdeck.runtime.runs.loop import EngineLoop, SharedBusy
from kvdeck.runtime.server.answer import Answer, Reply, whole_as_events
from kvdeck.runtime.server.api_errors import error, validation_sentence
from kvdeck.runtime.server.cascade import CascadeConfig, CascadeStats
from kvdeck.runtime.server.guard import Guard
from kvdeck.runtime.server.metrics import ServerMetrics
from kvdeck.runtime.server.schemas import (
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    GenerateBody,
    TokenizeBody,
)
from kvdeck.runtime.server.streams import OutputHub
from kvdeck.runtime.settings import Settings
from kvdeck.runtime.text.checks import AnswerCheck, parse_check
from kvdeck.runtime.text.guided import ConstraintError, GuideSpec

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


class Refused(Exception):
    """A request answered with an error instead of run; `response` is that answer."""

    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


def output_bound(body: GenerateBody, prompt_len: int, chat: bool, engine: Engine,
                 limits: ServeLimits) -> tuple[int, bool]:
    """The request's `max_tokens` for the engine, and whether it only scores its prompt."""
    limit = body.output_limit()
    # `max_tokens: 0` with echo scores the prompt only. The engine still samples the
    # one token the prefill yields anyway (as vLLM does); the answer leaves it out.
    if limit == 0:
        return 1, True
    if limit is None:
        room = engine.max_model_len - prompt_len
        limit = max(min(limits.default_max_tokens if chat
                        else COMPLETIONS_DEFAULT_MAX_TOKENS, room), 1)
    return limit, False


def check_sampling(body: GenerateBody, engine: Engine) -> None:
    """Refused for `best_of` or logprobs this request cannot have from this server."""
    samples = body.num_samples()
    if samples < body.n:
        raise Refused(error(400, f"'best_of' ({samples}) must be at least 'n' ({body.n}).",
                            "best_of"))
    if samples > body.n and body.stream:
        raise Refused(error(400, "'best_of' cannot be used with 'stream' (the best samples "
                                 "are known only at the end).", "best_of"))
    if samples > body.n and not engine.executor.info.computes_logits:
        raise Refused(error(400, "This server runs the sim executor, which computes no "
                                 "logits; 'best_of' ranks samples by their log-probabilities "
                                 "and needs a real model.", "best_of"))
    if isinstance(body, ChatBody) and body.top_logprobs and not body.logprobs:
        raise Refused(error(400, "'top_logprobs' needs 'logprobs': true.", "top_logprobs"))
    if body.num_logprobs() is not None and not engine.executor.info.computes_logits:
        raise Refused(error(400, "This server runs the sim executor, which computes no "
                                 "logits; logprobs need a real model.", "logprobs"))


def guide_and_check(body: GenerateBody, engine: Engine) \
        -> tuple[tuple[str, GuideSpec] | None, AnswerCheck | None]:
    """The (field, constraint) the request asks for and the check its answer must pass;
    Refused where either is malformed or the executor cannot constrain output."""
    try:
        guided = body.guide_spec()
    except (RequestError, ValueError) as e:
        raise Refused(error(400, str(e))) from None
    if guided is not None and not engine.executor.info.computes_logits:
        raise Refused(error(400, "This server runs the sim executor, which computes no "
                                 "logits; constrained output needs a real model.", guided[0]))
    try:
        check = body.answer_check()
    except RequestError as e:
        raise Refused(error(400, str(e), "check")) from None
    if check is None and guided is not None and guided[1].kind == "json_schema":
        # The schema an answer was constrained to is what it must satisfy: one cut
        # short by max_tokens is finished but not good. (A schema llguidance compiles
        # but jsonschema cannot read goes unchecked.)
        with contextlib.suppress(RequestError, ValueError, RecursionError):
            check = parse_check({"json_schema": json.loads(guided[1].source)})
    return guided, check


def sampling_params(body: GenerateBody, tokenizer, chat: bool, limit: int, echo: str | None,
                    guided: tuple[str, GuideSpec] | None) -> SamplingParams:
    """The request's sampling parameters; Refused for a `logit_bias` key or stop token id
    outside the vocabulary, ValueError for a `logit_bias` key that is no token id."""
    bias = body.bias_pairs()
    vocab = tokenizer.vocab_size
    if any(token >= vocab for token, _ in bias):
        raise Refused(error(400, f"logit_bias keys must be token ids from 0 to {vocab - 1}.",
                            "logit_bias"))
    if any(t >= vocab for t in body.stop_token_ids or ()):
        raise Refused(error(400, f"stop_token_ids must be token ids from 0 to {vocab - 1}.",
                            "stop_token_ids"))
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    ends = (*(tokenizer.end_of_turn_ids if chat else ()), *(body.stop_token_ids or ()))
    return SamplingParams(
        temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
        max_tokens=limit, stop=stop, seed=body.seed, ignore_eos=body.ignore_eos,
        stop_token_ids=tuple(dict.fromkeys(ends)),
        # best_of ranks its samples by their tokens' log-probabilities.
        logprobs=body.num_logprobs() if body.num_logprobs() is not None
        else (0 if body.num_samples() > body.n else None),
        prompt_logprobs=body.num_logprobs() if echo is not None else None,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0, min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens or 0, logit_bias=bias,
        guide=guided[1] if guided else None)


def config_json(settings: Settings | None, engine: Engine) -> dict:
    """The resolved settings and the engine's configuration as JSON."""
    return {"settings": settings.flat() if settings is not None else None,
            "engine": dataclasses.asdict(engine.config),
            "num_blocks": engine.kv.num_blocks, "max_model_len": engine.max_model_len}


@dataclass
class Served:
    """One model the server serves: its engine, the loop that runs it (and publishes the
    snapshots /metrics and /health read), its tokenizer and the settings that built it."""

    model_id: str
    engine: Engine
    tokenizer: object
    loop: EngineLoop
    settings: Settings | None = None
    adapters: dict[str, str] = field(default_factory=dict)
    """LoRA adapters served on this model: name → where it was loaded from."""
    hub: OutputHub = field(init=False)

    def __post_init__(self) -> None:
        self.hub = OutputHub(self.engine)


def create_app(served: list[Served], *, api_key: str | None = None,
               limits: ServeLimits = ServeLimits(),
               cascade: CascadeConfig | None = None,
               busy: SharedBusy | None = None) -> Guard:
    """The API for the `served` models (each its own engine; requests go by `model`) and,
    with `cascade`, a model name that answers with the cascade's small model and escalates
    to its large one; behind its `Guard`. The caller runs each model's loop; `busy`, when
    given, is the device time the loops share (`/metrics`' `kvdeck:device_busy_seconds`).

    Long because every route is registered here as a closure over this one app's models,
    metrics and limits (the FastAPI way of binding routes to one instance); each route
    body is its own nested function."""
    app = FastAPI(title="kvdeck", version="1", docs_url=None, redoc_url=None)
    by_name = {s.model_id: s for s in served}
    first = served[0]
    stats = CascadeStats(cascade) if cascade is not None else None
    metrics = ServerMetrics([(s.loop, s.model_id, tuple(s.adapters),
                              s.settings.engine.max_loras if s.settings else 0)
                             for s in served], stats, busy)
    # One worker: tokenization leaves the event loop, and each tokenizer sees one caller.
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvdeck-tokenize")
    app.state.served = served
    app.state.cascade = stats
    app.state.tokenizing = tokenizing  # shut down with the server

    async def off_loop(fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            tokenizing, lambda: fn(*args, **kwargs))

    def pick(name: str | None) -> Served:
        """The model a request names (the cascade's small one for its name, the first
        without a name; an adapter's base for the adapter); Refused 404 for any other."""
        if name is None:
            return first
        if name in by_name:
            return by_name[name]
        if cascade is not None and name == cascade.name:
            return by_name[cascade.small]
        for s in served:
            if name in s.adapters or name.split(":", 1)[0] == s.model_id and \
                    name.split(":", 1)[-1] in s.adapters:
                return s
        names = [*by_name, *([cascade.name] if cascade else []),
                 *(a for s in served for a in s.adapters)]
        raise Refused(error(404, f"The model '{name}' does not exist; this server serves "
                                 f"{', '.join(repr(n) for n in names)}.", "model"))

    def adapter_of(s: Served, body: GenerateBody) -> str | None:
        """The LoRA adapter the request asks for: `model` naming it (`NAME` or `BASE:NAME`)
        or `lora`; Refused for one `s` does not serve, or for two different ones."""
        named = None
        if body.model not in by_name and not (cascade and body.model == cascade.name):
            named = body.model.split(":", 1)[-1]
        if body.lora is not None and named is not None and named != body.lora:
            raise Refused(error(400, f"'model' names the adapter '{named}' and 'lora' the "
                                     f"adapter '{body.lora}'; name one.", "lora"))
        asked = body.lora if body.lora is not None else named
        if asked is not None and asked not in s.adapters:
            known = ", ".join(repr(a) for a in s.adapters) or "none"
            raise Refused(error(404, f"The LoRA adapter '{asked}' is not served on "
                                     f"'{s.model_id}'; its adapters: {known} (kvdeck serve "
                                     "--lora-modules NAME=PATH).", "lora"))
        return asked

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_sentence(list(exc.errors()))
        return error(400, message, param)

    @app.exception_handler(Refused)
    async def refused(_: Request, exc: Refused) -> JSONResponse:
        return exc.response

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

    def failed(models: list[Served] = served) -> JSONResponse | None:
        """503 with the reason once an engine has stopped, as its latest snapshot says."""
        for s in models:
            snap = s.loop.latest
            if snap is None or snap.failure is None:
                continue
            where = f" (traceback in {snap.failure.log_path})" if snap.failure.log_path \
                else ""
            which = f"{s.model_id}'s engine" if len(served) > 1 else "The engine"
            return error(503, f"{which} has stopped: {snap.failure.message}{where}.")
        return None

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while serving; 503 with the reason once failed, or while the operator has
        paused the engine (requests are still queued then, and run when it resumes)."""
        down = failed()
        if down is not None:
            return JSONResponse(status_code=503, content={
                "status": "failed", "reason": json.loads(down.body)["error"]["message"]})
        if any(s.loop.latest is not None and s.loop.latest.paused for s in served):
            return JSONResponse(status_code=503, content={
                "status": "paused", "reason": "The engine is paused by its operator; "
                "requests queue until it resumes."})
        return JSONResponse({"status": "ok"})

    @app.get("/kvdeck/config")
    async def kvdeck_config() -> dict:
        """The first model's configuration; with several, each one's under `models`."""
        config = config_json(first.settings, first.engine)
        if len(served) > 1:
            config["models"] = {s.model_id: config_json(s.settings, s.engine) for s in served}
        if cascade is not None:
            config["cascade"] = dataclasses.asdict(cascade)
        return config

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's: drop every cached block no request holds (at the engine's next
        iteration); KV events then carry `AllBlocksCleared`."""
        for s in served:
            s.engine.post(ResetPrefixCache())
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        data = [{"id": s.model_id, "object": "model", "created": 0, "owned_by": "kvdeck",
                 "max_model_len": s.engine.max_model_len} for s in served]
        data += [{"id": name, "object": "model", "created": 0, "owned_by": "kvdeck",
                  "root": path, "parent": s.model_id, "max_model_len": s.engine.max_model_len}
                 for s in served for name, path in s.adapters.items()]
        if cascade is not None:
            data.append({"id": cascade.name, "object": "model", "created": 0,
                         "owned_by": "kvdeck", "root": cascade.small,
                         "max_model_len": min(by_name[cascade.small].engine.max_model_len,
                                              by_name[cascade.large].engine.max_model_len)})
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> JSONResponse:
        s = pick(body.model)
        tokens = await off_loop(s.tokenizer.encode, body.prompt,
                                add_bos=None if body.add_special_tokens else False)
        return JSONResponse({"tokens": tokens, "count": len(tokens),
                             "max_model_len": s.engine.max_model_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> JSONResponse:
        tokenizer = pick(body.model).tokenizer
        if any(t >= tokenizer.vocab_size for t in body.tokens):
            return error(400, f"'tokens' must be token ids from 0 to "
                              f"{tokenizer.vocab_size - 1}.", "tokens")
        return JSONResponse({"prompt": await off_loop(tokenizer.decode, body.tokens)})

    async def generate(request: Request, body: GenerateBody, prompt: list[int], chat: bool,
                       echo: str | None = None):
        """`echo`: the prompt's text, to put before the completion's (completions' `echo`)."""
        if cascade is not None and body.model == cascade.name:
            return await by_cascade(request, body, prompt, chat, echo)
        response, _ = await run_on(pick(body.model), request, body, prompt, chat, echo)
        return response

    async def run_on(s: Served, request: Request, body: GenerateBody, prompt: list[int],
                     chat: bool, echo: str | None, *, scored: bool = False):
        """The request run on model `s`: (the answer, the engine request or None when it was
        refused). `scored`: sample with each token's top-1 alternative (the cascade's
        confidence), whether or not the client asked for logprobs."""
        down = failed([s])
        if down is not None:
            return down, None
        limit, echo_only = output_bound(body, len(prompt), chat, s.engine, limits)
        try:
            check_sampling(body, s.engine)
            guided, check = guide_and_check(body, s.engine)
        except Refused as e:
            return e.response, None
        try:
            req = await submit(s, body, prompt, chat, echo, limit, guided, check, scored)
        except Refused as e:
            return e.response, None
        except ConstraintError as e:
            return error(400, str(e), guided[0]), None
        except (RequestError, ConfigError, ValueError) as e:
            return error(400, str(e)), None
        except QueueFullError as e:
            return error(429, str(e)), None
        except EngineFailedError as e:
            return error(503, str(e)), None
        return await answer(s, request, body, req, chat, echo, echo_only), req

    async def by_cascade(request: Request, body: GenerateBody, prompt: list[int], chat: bool,
                         echo: str | None):
        """The small model's answer, or the large one's when the small one is unsure of its
        answer or the answer fails its check (`cascade.py`)."""
        if body.num_samples() > 1:
            return error(400, f"The model '{cascade.name}' decides on one answer of the small "
                              f"model, so it answers one sample; ask '{cascade.small}' or "
                              f"'{cascade.large}' for more.", "n" if body.n > 1 else "best_of")
        stream, body = body.stream, body.model_copy(update={"stream": False})
        small, large = by_name[cascade.small], by_name[cascade.large]
        start = time.monotonic()
        response, req = await run_on(small, request, body, prompt, chat, echo, scored=True)
        small_latency = time.monotonic() - start
        if req is None or response.status_code != 200:
            return response
        confidence = cascade.confidence(req.output_logprobs)
        route = cascade.route(confidence, req.correct)
        answered, large_s, large_latency = req, 0.0, 0.0
        if route != "small":
            start = time.monotonic()
            response, answered = await run_on(large, request, body, prompt, chat, echo)
            large_latency = time.monotonic() - start
            if answered is None or response.status_code != 200:
                return response
            large_s = answered.occupancy.seconds
        stats.record(route, confidence, answered.correct is not False,
                     req.occupancy.seconds, large_s, small_latency, large_latency)
        reply = json.loads(response.body)
        reply["model"] = cascade.name
        reply["kvdeck_cascade"] = {"route": route, "confidence": round(confidence, 6),
                                   "threshold": cascade.threshold,
                                   "measure": cascade.measure,
                                   "answered_by": large.model_id if route != "small"
                                   else small.model_id}
        if stream:  # decided only once whole: streamed as one chunk per choice
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(whole_as_events(reply, include_usage),
                                     media_type="text/event-stream")
        return JSONResponse(reply)

    async def submit(s: Served, body: GenerateBody, prompt: list[int], chat: bool,
                     echo: str | None, limit: int, guided: tuple[str, GuideSpec] | None,
                     check: AnswerCheck | None, scored: bool = False) -> EngineRequest:
        """The request added to the engine; Refused for a token id outside the vocabulary,
        and the engine's own errors as it raises them."""
        sampling = sampling_params(body, s.tokenizer, chat, limit, echo, guided)
        lora = adapter_of(s, body)
        if lora is not None:
            sampling = dataclasses.replace(sampling, lora=lora)
        if scored:
            sampling = dataclasses.replace(sampling, logprobs=max(sampling.logprobs or 0, 1))
        rid = f"{'chat' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}"
        # A constraint compiles on submission (milliseconds; the vocabulary's first
        # reading takes seconds): off the event loop.
        if guided:
            return await off_loop(s.engine.add_request, prompt, sampling, request_id=rid,
                                  check=check, branches=body.num_samples())
        return s.engine.add_request(prompt, sampling, request_id=rid, check=check,
                                    branches=body.num_samples())

    async def answer(s: Served, request: Request, body: GenerateBody, req: EngineRequest,
                     chat: bool, echo: str | None, echo_only: bool):
        """The request's answer: whole once every sample is done, or streamed as
        server-sent events."""
        report = body.num_logprobs() is not None
        reply = Reply([Answer(r, chat, s.hub.watch(r), s.tokenizer, echo, echo_only, index=i,
                              report=report, prompt_of=req, top=body.num_logprobs())
                       for i, r in enumerate([req, *req.branches])], body.model, body.n)
        if not body.stream:
            return await reply.whole(request, s.engine, s.hub, limits.request_timeout_s)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(reply.events(s.engine, s.hub, include_usage,
                                              limits.request_timeout_s),
                                 media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        if body.max_tokens == 0 and not body.echo:
            return error(400, "'max_tokens' must be at least 1, or 0 with 'echo': true (the "
                              "prompt scored, nothing generated).", "max_tokens")
        tokenizer = pick(body.model).tokenizer
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
        tokenizer = pick(body.model).tokenizer
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
