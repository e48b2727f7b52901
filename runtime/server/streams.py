"""Per-request output channels: the engine thread publishes new text and the finish; an
asyncio consumer (an HTTP handler) awaits them.

After every engine iteration `OutputHub.publish` compares each watched request with what it
has already sent and posts the difference to the request's asyncio queue through
`call_soon_threadsafe`, so the engine never blocks on a slow client.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from kvdeck.runtime.core.engine import Engine
from kvdeck.runtime.core.request import Request


@dataclass(frozen=True)
class Delta:
    """New output since the last delta; `finished` is set on the last one. For a request
    that asked for logprobs, `tokens` are the output token ids sampled since the last delta
    and `logprobs` theirs (text may lag its tokens while a stop string could still
    match); empty otherwise. The first delta of a request that asked for prompt logprobs
    carries them all in `prompt_logprobs` (the prefill has scored the whole prompt before
    the first token is sampled)."""

    text: str
    finished: bool = False
    tokens: tuple[int, ...] = ()
    logprobs: tuple = ()
    prompt_logprobs: tuple = ()


class RequestStream:
    def __init__(self, req: Request, loop: asyncio.AbstractEventLoop):
        self.request = req
        self.loop = loop
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.sent_tokens = 0
        self.sent_chars = 0
        self.sent_any = False

    async def get(self) -> Delta:
        return await self.queue.get()


class OutputHub:
    """Watches requests for HTTP handlers; `publish` runs on the engine thread."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._publishing = threading.Lock()
        engine.after_step.append(self.publish)

    def watch(self, req: Request) -> RequestStream:
        """A stream of `req`'s output (on the running event loop). A request that already
        finished — the engine can finish or refuse it before its handler gets here, and
        then stay idle — gets its whole output at once."""
        stream = RequestStream(req, asyncio.get_running_loop())
        with self._lock:
            self._streams[req.request_id] = stream
        if req.status.is_finished:
            self._publish([stream])
        return stream

    def watched_ids(self) -> list[str]:
        """Ids of the requests clients are waiting on (any thread)."""
        with self._lock:
            return list(self._streams)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def publish(self, _engine: Engine) -> None:
        """Post every watched request's new output (the engine thread, after a step)."""
        with self._lock:
            streams = list(self._streams.values())
        self._publish(streams)

    def _publish(self, streams: list[RequestStream]) -> None:
        # One publisher at a time (the engine thread, or `watch` for a finished request),
        # so no delta is sent twice; a finished stream is forgotten once it has its last.
        with self._publishing:
            for s in streams:
                if s.request.request_id in self._streams:
                    self._publish_one(s)

    def _publish_one(self, s: RequestStream) -> None:
        req = s.request
        done = req.status.is_finished
        det = req.detokenizer
        text = ""
        if det is not None:
            # Hold back what could still become a stop string until the request ends.
            end = len(det.text) if done else max(len(det.text) - det.hold, 0)
            if end > s.sent_chars:
                text = det.text[s.sent_chars:end]
                s.sent_chars = end
        first, new_tokens = s.sent_tokens, req.num_output_tokens - s.sent_tokens
        s.sent_tokens += new_tokens
        if text or new_tokens or done:
            tokens, lps = (), ()
            if req.sampling.logprobs is not None:  # only their reports use the ids
                tokens = tuple(req.output_token_ids[first:s.sent_tokens])
                lps = tuple(req.output_logprobs[first:s.sent_tokens])
            prompt = ()
            if not s.sent_any and req.sampling.prompt_logprobs is not None:
                prompt = tuple(req.prompt_logprobs_out)
            s.sent_any = True
            s.loop.call_soon_threadsafe(s.queue.put_nowait,
                                        Delta(text, done, tokens, lps, prompt))
        if done:
            self.forget(req.request_id)
