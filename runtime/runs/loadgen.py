"""`kvdeck bench`: send an arrival trace to any OpenAI-compatible server and measure it.

Requests go out at their trace times (scaled), streaming, as token-id prompts of the traced
lengths with `max_tokens` set to the traced output and `ignore_eos` (vLLM's extension) so
lengths are exact. Timings follow vLLM's serving benchmark: TTFT is the time to the first
streamed chunk with content, ITL the gaps between content chunks, E2E the time to the last
byte, TPOT = (E2E − TTFT) / (output tokens − 1), output tokens from the final usage chunk.
Cached prompt tokens are the server's own account: the usage chunk's
`prompt_tokens_details.cached_tokens` (vLLM with `--enable-prompt-tokens-details`, kvdeck)
or llama-server's `timings.cache_n`; 0 where it gives none.
Summaries (percentiles, throughput, goodput under SLOs) use the same code as `run-trace`.

For servers that differ from vLLM's request shape (llama-cpp-python's server takes no
token-id prompts and no `ignore_eos`), prompts can go as text (`text_prompt`) and exact
output lengths be asked with `min_tokens` instead. With a concurrency limit, at most that
many requests are in flight (vLLM's `--max-concurrency`). A request's clock starts at its
scheduled arrival, as the engine's does: time spent waiting for a free place is queueing
outside the server, and counts in TTFT and E2E (the chapters' rule). The send time is kept
beside it: `admitted` and `queue_time` in each request's figures, and `ttft_from_send_s`
(vLLM's serving benchmark's TTFT, which starts at the send) in the summary.

Answer checks (`runtime/text/checks.py`, a trace's `check`) are judged here, on the streamed
text, so they work against any server: a checked request is sent without the exact-length
field (its answer ends where the model ends it), and one that fails its check counts as
finished but not good. With `retries`, a request whose answer fails its check, or that
errors, is sent again, up to that many times; the summary's usual figures count every send,
and beside them come the retries and the time to a correct answer — from the scheduled
arrival to the end of the first correct answer — of each request that got one. A retry's
clock starts when it is sent. Requests never
answered correctly are not good.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Sequence

import httpx

from kvdeck.runtime.runs.endpoints import bearer
from kvdeck.runtime.runs.trace import Arrival, synthesize_tokens
from kvdeck.runtime.stats.figures import summarize
from kvdeck.runtime.stats.metrics import SLO, Distribution, RequestMetrics


def cap_arrivals(arrivals: Sequence[Arrival], max_prompt_len: int | None,
                 max_output_len: int | None, hash_block_tokens: int = 512) -> list[Arrival]:
    """Arrivals with prompts and outputs cut to the given lengths (None: no cap)."""
    out = []
    for a in arrivals:
        prompt = min(a.prompt_len, max_prompt_len or a.prompt_len)
        out.append(dataclasses.replace(
            a, prompt_len=prompt, output_len=min(a.output_len, max_output_len or a.output_len),
            hash_ids=a.hash_ids[:-(-prompt // hash_block_tokens)] if a.hash_ids else None,
            prompt_tokens=a.prompt_tokens[:prompt] if a.prompt_tokens else None))
    return out


EXACT_LENGTH_FIELDS = ("ignore_eos", "min_tokens")
"""How a request asks for exactly `max_tokens` outputs: vLLM's `ignore_eos` (kvdeck, vLLM,
SGLang) or `min_tokens = max_tokens` (llama-cpp-python's server)."""


@dataclasses.dataclass(frozen=True)
class RequestShape:
    """How requests are written for the server under test."""

    vocab_size: int = 32_000
    hash_block_tokens: int = 512
    text_prompt: Callable[[int, int], str] | None = None
    """(request index, prompt tokens) -> the prompt as text; None: token ids."""
    exact_length_field: str = "ignore_eos"
    temperature: float = 0.0
    send_checks: bool = False
    """Also send each request's check as kvdeck's `check` field, so a kvdeck server counts
    it in its own goodput (other servers may refuse the field)."""
    slots: tuple[int, ...] = ()
    """Send request `index` to llama-server's slot `slots[index]` (its `id_slot` field): the
    probes put requests sent at once in neighbouring slots (`executors/server_slots.py`),
    and time a slot's save with requests in slots of their choosing (`planning/probe.py`)."""

    def body(self, model: str, a: Arrival, index: int, attempt: int = 0) -> dict:
        prompt = self.text_prompt(index, a.prompt_len) if self.text_prompt else \
            synthesize_tokens(a, index, self.vocab_size, self.hash_block_tokens)
        body = {"model": model, "prompt": prompt, "max_tokens": a.output_len,
                "temperature": self.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.temperature > 0:
            # Reproducible draws, and a different one for each retry.
            body["seed"] = attempt_seed(index, attempt)
        if a.check is not None:
            if self.send_checks:
                body["check"] = a.check.to_json()
        elif self.exact_length_field == "min_tokens":
            body["min_tokens"] = a.output_len
        else:
            body["ignore_eos"] = True
        if self.slots:
            body["id_slot"] = self.slots[index]
        return body


MAX_RETRIES = 1_000


def attempt_seed(index: int, attempt: int) -> int:
    """The seed of send `attempt` (0: the first) of the trace's request `index`, when
    requests are sampled (temperature above 0)."""
    return index * (MAX_RETRIES + 1) + attempt


@dataclasses.dataclass(frozen=True)
class Outcome:
    """Every send of one trace request, and how long it took to get a correct answer."""

    sends: list[RequestMetrics]
    time_to_correct: float | None
    """From the scheduled arrival to the end of the first correct answer (None: never)."""

    @property
    def retries(self) -> int:
        return len(self.sends) - 1


EARLY_S = 0.2
"""How long before a request's time a long sleep ends (see `_until`): more than the kernel's
largest slack on a timeout (100 ms)."""


async def _until(t: float) -> None:
    """Sleep until `t` (perf_counter seconds), on time after a long idle too. Linux lets a
    poll's timeout fire late by a thousandth of it, up to 100 ms (the slack of a task that
    is not real-time): 11 ms after 10 s idle, 55 ms after a minute, which sent a burst
    due 5 ms apart all at once, and the server took it in another order. So a long sleep
    ends `EARLY_S` early and the rest is slept apart (its slack: a fifth of a millisecond)."""
    left = t - time.perf_counter()
    if left > EARLY_S:
        await asyncio.sleep(left - EARLY_S)
    await asyncio.sleep(max(t - time.perf_counter(), 0.0))


async def _one(client: httpx.AsyncClient, url: str, model: str, a: Arrival, index: int,
               shape: RequestShape, start: float, headers: dict,
               slots: asyncio.Semaphore | None, retries: int) -> Outcome:
    """Send one trace request at its time, and again (up to `retries` times) while its
    answer fails its check or it errors; a retry keeps its place under the concurrency
    limit."""
    rid = a.request_id or f"r{index}"
    scheduled = start + a.arrival_s
    await _until(scheduled)
    if slots is not None:
        await slots.acquire()
    sends: list[RequestMetrics] = []
    try:
        for attempt in range(retries + 1):
            m, text = await _send(client, url, shape.body(model, a, index, attempt), a,
                                  rid if attempt == 0 else f"{rid}.retry{attempt}", start,
                                  headers, scheduled if attempt == 0 else None)
            finished = m.status.startswith("finished")
            if finished and a.check is not None:
                m = dataclasses.replace(m, correct=a.check.passes(text))
            sends.append(m)
            if finished and m.correct is not False:
                return Outcome(sends, m.finish - sends[0].arrival)
        return Outcome(sends, None)
    finally:
        if slots is not None:
            slots.release()


async def _send(client: httpx.AsyncClient, url: str, body: dict, a: Arrival, rid: str,
                start: float, headers: dict, arrival: float | None = None,
                sent: float | None = None) -> tuple[RequestMetrics, str]:
    """Send one streaming request now; its metrics and text. Its clock starts at `arrival`
    (its scheduled arrival; None: now, as for a retry). A connection the server closed
    before answering anything (a kept-alive one it had dropped: llama-server does now and
    then) is sent once more at once (`sent`: the first send), the clock still running, as
    the openai client retries such errors."""
    again = sent is not None
    sent = sent if sent is not None else time.perf_counter()
    arrival = arrival if arrival is not None else sent
    times: list[float] = []
    parts: list[str] = []
    output_tokens = cached = 0
    status, reason = "finished_length", None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")
                status, reason = "rejected", f"HTTP {r.status_code}: {detail[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        status, reason = "rejected", chunk["error"].get("message")
                        break
                    if chunk.get("usage"):
                        output_tokens = chunk["usage"]["completion_tokens"]
                        cached = (chunk["usage"].get("prompt_tokens_details") or {}).get(
                            "cached_tokens") or cached
                    if chunk.get("timings"):  # llama-server's own account of the prompt
                        cached = chunk["timings"].get("cache_n") or cached
                    texts = [c.get("text") or (c.get("delta") or {}).get("content") or ""
                             for c in chunk.get("choices", [])]
                    if any(texts):
                        times.append(time.perf_counter())
                        parts.extend(texts)
                    if any(c.get("finish_reason") == "stop" for c in chunk.get("choices", [])):
                        status = "finished_stopped"
    except (httpx.RemoteProtocolError, httpx.ConnectError) as e:
        if times or again:
            status, reason = "aborted", f"{type(e).__name__}: {e}"
        else:  # a kept-alive connection the server had closed: nothing ran; send once more
            return await _send(client, url, body, a, rid, start, headers, arrival, sent)
    except httpx.HTTPError as e:
        status, reason = "aborted", f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    ok = status.startswith("finished")
    if not output_tokens and ok:
        # No usage chunk (llama-cpp-python's server sends none): one token per content
        # chunk, as such servers stream.
        output_tokens = len(times)
    ttft = times[0] - arrival if times else None
    e2e = end - arrival if ok else None
    tpot = (e2e - ttft) / (output_tokens - 1) if ok and ttft is not None and output_tokens > 1 \
        else None
    rel = [t - start for t in times]
    return RequestMetrics(
        rid, status, reason, arrival - start, sent - start, rel[0] if rel else None,
        end - start if ok else None, a.prompt_len, output_tokens, cached, 0, ttft, tpot, e2e,
        sent - arrival,
        tuple(b - a_ for a_, b in zip(times, times[1:], strict=False)), None, None), \
        "".join(parts)


def passage_prompts(tokenizer) -> Callable[[int, int], str]:
    """(index, tokens) -> a window of that many tokens of the built-in English passage
    (repeated as needed), as text: both servers re-tokenize the same text with the same
    vocabulary, so they see the same prompt. Windows start at different places per index."""
    from kvdeck.runtime.resources import PASSAGE

    ids = tokenizer.encode(PASSAGE.read_text(encoding="utf-8"), add_bos=False)

    def text(index: int, n: int) -> str:
        reps = ids * (n // len(ids) + 2)
        start = (index * 61) % len(ids)
        return tokenizer.decode(reps[start:start + n])

    return text


WARMUP_IDS = tuple(range(3, 19))
"""The warm-up's token ids, repeated to its length: no trace's prompt starts with them, so the
warm-up leaves no cache block a trace's prompts could share."""


def warmup(arrivals: Sequence[Arrival]) -> Arrival:
    """The uncounted request sent before a run: a prompt as long as the first arrival's
    (vLLM's serving benchmark sends that request itself first) and two outputs. A server's
    first steps of a shape cost more than the same steps after: the first request of a
    trace on a kvdeck torch server just started took 646–693 ms where the probes' steps
    add up to 546–618, and a warm-up of 16 tokens had not run those steps. `kvdeck
    run-trace --warmup` runs it first in the sim too."""
    n = arrivals[0].prompt_len if arrivals else 16
    return Arrival(0.0, n, 2, tuple(itertools.islice(itertools.cycle(WARMUP_IDS), n)))


def warmup_body(model: str, shape: RequestShape, arrivals: Sequence[Arrival]) -> dict:
    """`warmup` as the body sent (its prompt as text where the server takes text)."""
    w = warmup(arrivals)
    prompt = shape.text_prompt(len(arrivals), w.prompt_len) if shape.text_prompt else \
        list(w.prompt_tokens or ())
    return {"model": model, "max_tokens": w.output_len, "prompt": prompt}


async def run_bench(url: str, model: str, arrivals: Sequence[Arrival], *,
                    shape: RequestShape = RequestShape(), api_key: str | None = None,
                    concurrency: int | None = None, slo: SLO = SLO(), warmup: bool = True,
                    retries: int = 0,
                    on_done: Callable[[Outcome], None] | None = None) -> dict:
    """Send every arrival at its time, at most `concurrency` at once (None: no limit), each
    again up to `retries` times while its answer fails its check or it errors; returns
    `{"summary": ..., "requests": [...]}` (every send, retries included).

    With `warmup`, one request as long as the first goes first and is not counted (as
    vLLM's serving benchmark does; `warmup_body`), so first-request costs on either side do
    not land on the trace's first arrivals."""
    endpoint = url.rstrip("/") + "/completions"
    headers = bearer(api_key)
    limits = httpx.Limits(max_connections=concurrency or 256)
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        if warmup:
            try:
                await client.post(endpoint, headers=headers,
                                  json=warmup_body(model, shape, arrivals))
            except httpx.HTTPError:
                pass  # an unreachable server shows in every request's result below
        start = time.perf_counter()

        async def tracked(i: int, a: Arrival) -> Outcome:
            o = await _one(client, endpoint, model, a, i, shape, start, headers, slots,
                           retries)
            if on_done is not None:
                on_done(o)
            return o

        outcomes = await asyncio.gather(*(tracked(i, a) for i, a in enumerate(arrivals)))
    results = [m for o in outcomes for m in o.sends]
    summary = summarize(results, None, slo)
    answered = [o.time_to_correct for o in outcomes if o.time_to_correct is not None]
    summary.update(
        trace_requests=len(outcomes), retries=sum(o.retries for o in outcomes),
        answered_correctly=len(answered),
        time_to_correct_s=dataclasses.asdict(Distribution.of(answered)),
        ttft_from_send_s=dataclasses.asdict(Distribution.of(
            m.ttft - m.queue_time for m in results if m.ttft is not None)))
    # What only the server knows (its steps, residents, busy time) a client cannot measure:
    # None shows as "—", not as a measured zero.
    summary["steps"] = None
    summary["littles_law"]["measured_mean_resident"] = None
    summary["accelerator_s_per_good_result"] = None
    summary["endpoint"] = endpoint
    return {"summary": summary, "requests": [m.to_dict() for m in results]}
