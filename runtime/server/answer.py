"""Answers in OpenAI's shapes: one `Answer` renders one sample (a choice) of a request,
whole or as stream deltas; a `Reply` gathers the `n` choices of one API request (its
samples share the prompt's KV blocks: `Engine.add_request(branches=...)`), waits for them
while watching the client, and streams their deltas tagged with each choice's `index`.
With `best_of`, the samples are ranked by the mean log-probability of their tokens and the
best `n` are returned (OpenAI's legacy completions).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import Request as EngineRequest
from kvdeck.runtime.core.request import RequestStatus
from kvdeck.runtime.server.api_errors import error
from kvdeck.runtime.server.streams import Delta, OutputHub, RequestStream


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return



class Answer:
    """One sample's choice (`index` among the request's), whole or as stream deltas.

    Completions' `echo` (`echo` holds the prompt's text): the first choice (the first
    chunk of a stream, as vLLM streams it) starts with the prompt's text, and with
    logprobs its report starts with the prompt's tokens — the first with null logprob and
    alternatives, each later one scored given the tokens before it — and `text_offset`
    runs from 0 over the prompt, then the completion. `echo_only` (`max_tokens: 0`): the
    token the engine sampled is left out of the text, the report and the usage."""

    def __init__(self, req: EngineRequest, chat: bool, stream: RequestStream, tokenizer=None,
                 echo: str | None = None, echo_only: bool = False, *, index: int = 0,
                 report: bool = True, prompt_of: EngineRequest | None = None,
                 top: int | None = None):
        """`report`: the client asked for logprobs (a `best_of` request samples with them
        to rank its samples, reported or not); `prompt_of`: the request whose prompt
        logprobs an echoing branch reports (the first sample scored the prompt); `top`:
        alternatives the client asked for, when the request was sampled with more (a
        cascade's small model samples with one, to read its confidence)."""
        self.req, self.chat, self.stream = req, chat, stream
        self.index, self.report, self.top = index, report, top
        self.prompt_of = prompt_of or req
        self.tokenizer = tokenizer
        self.echo, self.echo_only = echo, echo_only
        self.echoed = False
        self.reported: list[int] = []
        """Tokens whose logprobs were reported (the context of the next ones' bytes)."""
        self.reported_bytes = b""

    @property
    def completion_tokens(self) -> int:
        return 0 if self.echo_only else self.req.num_output_tokens

    def logprobs(self, tokens: tuple[int, ...], lps: tuple, final: bool = False,
                 prompt: tuple | None = None) -> dict | None:
        """The tokens' logprobs in OpenAI's shape: chat's `{"content": [{token, logprob,
        bytes, top_logprobs}]}`, or completions' legacy `{tokens, token_logprobs,
        top_logprobs, text_offset}`. None when the request asked for none. `prompt`: the
        echoed prompt's logprobs (its second token on), reported first."""
        if not self.report or self.req.sampling.logprobs is None or self.tokenizer is None:
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
                 "top_logprobs": [alt(t, v) for t, v in lp.top[:self.top]]}
                for piece, b, lp in zip(pieces, raw, lps, strict=True)], "refusal": None}
        return {"tokens": pieces,
                "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": [None if lp is None else
                                 {tok.token_bytes(t).decode("utf-8", errors="replace"): v
                                  for t, v in lp.top[:self.top]} for lp in lps],
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
            # A branch's prompt was scored once, by the first sample (before any branch
            # started, so it is complete by now).
            prompt = tuple(prompt_lps) if self.prompt_of is self.req else \
                tuple(self.prompt_of.prompt_logprobs_out)
            text = self.echo + text
        c: dict = {"index": self.index, "finish_reason": reason,
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

    def mean_logprob(self, lps: tuple) -> float:
        """The sampled tokens' mean log-probability: how `best_of` ranks, as OpenAI defines
        it ("the highest log probability per token"; a sum would favour short answers)."""
        values = [lp.logprob for lp in lps if lp is not None]
        return sum(values) / len(values) if values else float("-inf")


class Reply:
    """The answer to one API request: its `answers` (one per sample, `best_of` of them),
    of which the `n` best are returned."""

    def __init__(self, answers: list[Answer], model_id: str, n: int):
        self.answers, self.model_id, self.n = answers, model_id, n
        self.first = answers[0]
        self.chat = self.first.chat
        self.rid = self.first.req.request_id
        self.created = int(time.time())

    def usage(self, answers: list[Answer]) -> dict:
        """OpenAI's usage: the prompt once, the completion tokens of every sample generated
        (`best_of` ones not returned included, as OpenAI bills them)."""
        r = self.first.req
        out = sum(a.completion_tokens for a in answers)
        return {"prompt_tokens": r.num_prompt_tokens, "completion_tokens": out,
                "total_tokens": r.num_prompt_tokens + out,
                "prompt_tokens_details": {"cached_tokens": r.num_cached_tokens}}

    def failure(self) -> str | None:
        return next((p for p in (a.failure() for a in self.answers) if p), None)

    def abort(self, engine: Engine, hub: OutputHub, reason: str) -> None:
        """Abort every sample still running (and stop watching them all)."""
        for a in self.answers:
            if not a.req.status.is_finished:
                engine.abort(a.req.request_id, reason)
            hub.forget(a.req.request_id)

    async def whole(self, request: Request, engine: Engine, hub: OutputHub,
                    timeout_s: float | None) -> Response:
        """Wait for every sample while watching the client: a disconnect or the timeout
        aborts them all."""
        async def collect(a: Answer) -> tuple[str, tuple[int, ...], tuple, tuple]:
            parts, tokens, lps, prompt = [], [], [], []
            while True:
                d = await a.stream.get()
                parts.append(d.text)
                tokens.extend(d.tokens)
                lps.extend(d.logprobs)
                prompt.extend(d.prompt_logprobs)
                if d.finished:
                    return "".join(parts), tuple(tokens), tuple(lps), tuple(prompt)

        texts = asyncio.ensure_future(asyncio.gather(*(collect(a) for a in self.answers)))
        gone_task = asyncio.ensure_future(wait_for_disconnect(request))
        done, _ = await asyncio.wait({texts, gone_task}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        gone_task.cancel()
        if texts not in done:
            texts.cancel()
            gone = gone_task in done
            self.abort(engine, hub, "client disconnected" if gone else
                       f"ran longer than the server's --request-timeout of {timeout_s:g} s")
            if gone:
                return Response(status_code=499)  # nobody is listening
            return error(504, f"The request ran longer than the server's limit of "
                              f"{timeout_s:g} s (--request-timeout) and was aborted.")
        problem = self.failure()
        if problem is not None:
            return error(503, problem)
        results = texts.result()
        ranked = list(zip(self.answers, results, strict=True))
        if len(ranked) > self.n:  # best_of: the n most likely samples, best first
            ranked.sort(key=lambda ar: -ar[0].mean_logprob(ar[1][2]))
            ranked = ranked[:self.n]
        choices = []
        for index, (a, (text, tokens, lps, prompt)) in enumerate(ranked):
            a.index = index
            choices.append(a.choice(text, True, False, tokens, lps, prompt))
        kind = "chat.completion" if self.chat else "text_completion"
        return JSONResponse({"id": self.rid, "object": kind, "created": self.created,
                             "model": self.model_id, "choices": choices,
                             "usage": self.usage(self.answers)})

    async def events(self, engine: Engine, hub: OutputHub, include_usage: bool,
                     timeout_s: float | None) -> AsyncIterator[str]:
        """Server-sent events, each carrying one choice's delta with its `index`; a failed
        sample ends the stream with an error event."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        deadline = time.monotonic() + timeout_s if timeout_s else None
        merged: asyncio.Queue[tuple[Answer, Delta]] = asyncio.Queue()

        async def forward(a: Answer) -> None:
            while True:
                d = await a.stream.get()
                await merged.put((a, d))
                if d.finished:
                    return

        def event(payload: dict) -> str:
            return "data: " + json.dumps(payload) + "\n\n"

        readers = [asyncio.ensure_future(forward(a)) for a in self.answers]
        pending = len(self.answers)
        reason = "client disconnected"
        try:
            while pending:
                remaining = None if deadline is None else max(deadline - time.monotonic(), 0)
                try:
                    a, d = await asyncio.wait_for(merged.get(), remaining)
                except asyncio.TimeoutError:
                    self.abort(engine, hub, f"ran longer than the server's --request-timeout "
                                            f"of {timeout_s:g} s")
                    yield event({"error": {
                        "message": f"The request ran longer than the server's limit of "
                                   f"{timeout_s:g} s (--request-timeout) and was aborted.",
                        "type": "timeout_error", "param": None, "code": 504}})
                    return
                problem = a.failure() if d.finished else None
                if problem is not None:
                    reason = "another sample of the request failed"
                    yield event({"error": {"message": problem, "type": "service_unavailable",
                                           "param": None, "code": 503}})
                    return
                echo = a.echo is not None and not a.echoed
                if d.text or d.finished or echo or (d.logprobs and a.report):
                    payload = {"id": self.rid, "object": kind, "created": self.created,
                               "model": self.model_id,
                               "choices": [a.choice(d.text, d.finished, True, d.tokens,
                                                    d.logprobs, d.prompt_logprobs)]}
                    if include_usage:
                        payload["usage"] = None
                    yield event(payload)
                pending -= d.finished
            if include_usage:
                yield event({"id": self.rid, "object": kind, "created": self.created,
                             "model": self.model_id, "choices": [],
                             "usage": self.usage(self.answers)})
            yield "data: [DONE]\n\n"
        finally:
            for r in readers:
                r.cancel()
            # The client went away mid-stream, or a sample failed: stop the others.
            self.abort(engine, hub, reason)


async def whole_as_events(reply: dict, include_usage: bool) -> AsyncIterator[str]:
    """A finished answer (`Reply.whole`'s JSON) as a stream: one chunk per choice carrying
    all its text (and logprobs), the finish reason and any extra fields, then the usage
    chunk when asked for, then `[DONE]` — for answers decided only once whole (a cascade)."""
    chat = reply["object"] == "chat.completion"
    kind = "chat.completion.chunk" if chat else "text_completion"
    extra = {k: v for k, v in reply.items()
             if k not in ("id", "object", "created", "model", "choices", "usage")}
    for choice in reply["choices"]:
        c = dict(choice)
        if chat:
            c["delta"] = c.pop("message")
        chunk = {"id": reply["id"], "object": kind, "created": reply["created"],
                 "model": reply["model"], "choices": [c], **extra}
        if include_usage:
            chunk["usage"] = None
        yield "data: " + json.dumps(chunk) + "\n\n"
    if include_usage:
        yield "data: " + json.dumps({"id": reply["id"], "object": kind,
                                     "created": reply["created"], "model": reply["model"],
                                     "choices": [], "usage": reply["usage"]}) + "\n\n"
    yield "data: [DONE]\n\n"
