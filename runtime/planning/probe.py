"""`kvdeck calibrate --url`: the step model fitted to a live server, from outside.

No server lets a client time its steps, but its token stream shows them:

- **Prefill.** One request at a time, `c` prompt tokens and one output token: the time from
  sending it to its first token is a step that computes `c` tokens plus the request's way
  through the server (HTTP in, tokenizing, the token streamed out), which the fit keeps
  apart as `overhead_s` — the decode gaps have none of it.
- **Prefill on a cached prefix.** A prompt of `h` tokens, then the same prompt with `c`
  more: the second's time to first token is a step computing `c` tokens over `h` cached
  ones, as chunks that extend a long history do — or over as many as the server says it
  kept (`cached_tokens` in its usage, or llama-server's `cache_n`; llama-server keeps less
  of it on models with sliding-window layers). A server that says nothing gives no such
  point.
- **Decode.** `b` requests of `L` prompt tokens sent at once, `M` outputs each: from the
  moment the last of them has its first token until the first of them ends, all `b` decode
  together, and the gaps between one request's streamed tokens are steps of `b` rows at
  about context `L + M/2` (their median is the point). Behind llama-server's slots (its
  `/props` say how many) the `b` requests go to slots 0 to `b − 1` (`id_slot`): rows of
  slots that are not neighbours decode in passes of their own, and the point is then one
  pass of `b` rows (`pinned` in the profile).
- **A slot's save** (behind llama-server, given the model's shape). Before a request's
  first step, llama-server saves its idle slots to its host prompt cache, and its loop
  waits (`slot_save.py`): the save of a 1,536-token slot is timed (`save_point`), and every
  point below is taken less the saves its requests waited for (`SlotSaves`).
- **A prompt beside a decode.** One request of `L` prompt tokens decoding, and while it
  does, prompts of `c` tokens sent one at a time: where a prompt's first token comes out
  with one of the decoder's tokens, they were computed in one step, and the decoder's gap
  before that token is the step's time. Such steps cost more than their tokens on some
  servers (two attention paths, one for prompt chunks and one for decode rows); the fit
  keeps that apart as `mixed_s`. A server that never runs them together gives no point.

The points go through the same fit as an executor's sweep (`calibrate.fit_step_model`), and
the measured decode steps become the profile's `[decode.<hw>]` table. Prompts are random
token ids below 32,000 (in every modern vocabulary), new for every request, so no probe
hits the server's prefix cache unasked. Requests ask for exact lengths with `ignore_eos`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from kvdeck.runtime.core.step_data import causal_pairs
from kvdeck.runtime.errors import KvdeckError
from kvdeck.runtime.planning.calibrate import (
    Point,
    efficiencies,
    fit_step_model,
    fit_toml,
    hardware_toml,
    mixed_point,
    model_toml,
    profile_paths,
)
from kvdeck.runtime.planning.profiles import (
    HardwareProfile,
    ModelProfile,
    StepFit,
)
from kvdeck.runtime.planning.slot_save import SlotSaves, save_seconds
from kvdeck.runtime.runs.endpoints import bearer, server_root
from kvdeck.runtime.runs.loadgen import RequestShape, run_bench
from kvdeck.runtime.runs.trace import Arrival


@dataclass(frozen=True)
class Probes:
    """What to send: prefill lengths, (batch, prompt length) decode cases, outputs per
    decode request, repeats of each prefill, and (cached history, new tokens) prefills."""

    prefill: tuple[int, ...]
    decode: tuple[tuple[int, int], ...]
    outputs: int
    repeats: int
    history: tuple[tuple[int, int], ...] = ()
    mixed: tuple[tuple[int, int], ...] = ()
    """(decoding request's prompt tokens, prompt tokens sent beside it)."""
    wake: tuple[float, ...] = ()
    """Idle seconds before a prompt of the first prefill length is sent again (`wake.py`)."""


# Two and three rows too: a server that runs its rows one after another there (llama-server
# does) is not on the line through one, four and eight. 256 new tokens over 512 cached is the
# chunk a long prompt's second half runs as; without it the attention term rests on short
# chunks alone, and moved between 0 and 363 ns a pair from one run to the next. Idle spells
# up to 20 s: a trace's requests seconds apart leave the server idle that long between them.
# One and four rows of 576 prompt tokens: a trace's requests decode at 576–800 positions,
# and a ratio carried from 396 missed torch's one row at 576–608 by 2–26 %. A prompt of 768
# alone: up to 512 the attention is a fifth of a prompt's time, and a few per cent of noise
# in those points moved the fitted cost of a pair between 640 and 1,400 ns from one run to
# the next on llama-server, and its prediction of a burst of 768-token prompts by a tenth.
FULL = Probes((64, 256, 512, 768), tuple((b, n) for b in (1, 2, 3, 4, 8) for n in (64, 384))
              + ((1, 576), (4, 576)), 24, 3,
              ((256, 64), (512, 64), (256, 256), (512, 256)), ((384, 64),),
              (2.0, 5.0, 10.0, 20.0))
QUICK = Probes((32, 128), ((1, 32), (4, 32)), 12, 2, ((128, 32),), ((32, 32),), (2.0,))


class ProbeError(KvdeckError):
    """The server did not answer a probe as asked (one sentence says how)."""


def _prompts(rng: random.Random, n: int, length: int) -> list[tuple[int, ...]]:
    return [tuple(rng.randrange(100, 32_000) for _ in range(length)) for _ in range(n)]


def _send(url: str, model: str, arrivals: list[Arrival], api_key: str | None,
          concurrency: int | None, slots: tuple[int, ...] = ()) -> list[dict]:
    """Send `arrivals` (token-id prompts, exact output lengths; `slots`: arrival `i` to
    llama-server's slot `slots[i]`); every request's figures, each of which must have
    finished."""
    out = asyncio.run(run_bench(url, model, arrivals, shape=RequestShape(slots=slots),
                                api_key=api_key, concurrency=concurrency, warmup=False))
    bad = [r for r in out["requests"] if not r["status"].startswith("finished")]
    if bad:
        raise ProbeError(f"The server at {url} did not finish a probe request "
                         f"({bad[0]['status']}: {bad[0]['reason']}).")
    short = [(r, a) for r, a in zip(out["requests"], arrivals, strict=True)
             if r["output_tokens"] < a.output_len]
    if short:
        r, a = short[0]
        raise ProbeError(f"The server at {url} streamed {r['output_tokens']} tokens "
                         f"where {a.output_len} were asked with ignore_eos; a probe "
                         "needs exact lengths.")
    return out["requests"]


def llama_server_slots(url: str, api_key: str | None = None) -> int:
    """How many slots the server at `url` runs where it is llama-server (its `/props` give
    `total_slots`); 0 for any other server (vLLM and kvdeck answer 404 there)."""
    try:
        r = httpx.get(server_root(url) + "/props", headers=bearer(api_key), timeout=30.0)
        n = r.json().get("total_slots") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):  # not JSON, or not an object
        return 0
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def _first(r: dict, saved: float = 0.0) -> float:
    """A request's time from sending to its first token, less the `saved` seconds its
    launch waited for llama-server's saves of idle slots (`slot_save.py`)."""
    return r["ttft"] - r["queue_time"] - saved


def prefill_point(requests: list[dict], c: int, saved: Sequence[float] = ()) -> Point:
    """A prefill of `c` tokens: the median time from send to first token, less what each
    waited for saves (`saved`, by request), of the requests whose token streamed any text
    (a piece of a character streams none, and has no time)."""
    timed = [_first(r, s) for r, s in zip(requests, saved or [0.0] * len(requests),
                                          strict=True) if r["ttft"] is not None]
    if not timed:
        raise ProbeError(f"No {c}-token probe's output streamed any text; nothing to time "
                         "its first token by.")
    seconds = statistics.median(timed)
    return Point("prefill", c, causal_pairs(c, 0), f"prefill {c}", seconds, c, outside=True)


def wake_point(requests: list[dict], alone: Point, idle: float,
               saved: Sequence[float] = ()) -> Point:
    """A prompt of `alone`'s length sent after `idle` idle seconds: what its time from
    send to first token (less `saved`) took beyond `alone`'s (the same prompt sent back
    to back)."""
    seconds = prefill_point(requests, alone.new_tokens, saved).seconds - alone.seconds
    return Point("wake", alone.new_tokens, alone.pairs, f"wake after {idle:g} s", seconds,
                 alone.context, outside=True, idle_s=idle)


def history_point(requests: list[dict], h: int, c: int,
                  saved: Sequence[float] = ()) -> Point | None:
    """The `h + c`-token prompts sent after their first `h` tokens: each computed what the
    server did not keep of them over what it kept. The point is the median time from send
    to first token of the requests that kept the most common number of tokens, `k > 0` of
    them (None: none kept any). `k` is `h` where the server keeps a prefix whole; llama-server
    on a model with sliding-window layers keeps a slot's state only up to a checkpoint it
    took near its last prompt's end, one token before it (251 of a 256-token prefix).
    `saved`: what each request waited for saves at its launch."""
    saved = saved or [0.0] * len(requests)
    kept = [r["cached_tokens"] for r in requests
            if 0 < r["cached_tokens"] <= h and r["ttft"] is not None]
    if not kept:
        return None
    k = statistics.mode(kept)
    seconds = statistics.median(_first(r, w) for r, w in zip(requests, saved, strict=True)
                                if r["cached_tokens"] == k and r["ttft"] is not None)
    n = h + c - k
    return Point("prefill", n, causal_pairs(n, k), f"prefill {n} on {k}", seconds, h + c,
                 outside=True)


def _stream(r: dict) -> list[float]:
    """When each of a request's tokens came out (the run's clock; none where it streamed
    no text)."""
    if r["first_token"] is None:
        return []
    t = [r["first_token"]]
    for gap in r["itls"]:
        t.append(t[-1] + gap)
    return t


def decode_point(requests: list[dict], b: int, prompt: int, outputs: int) -> Point | None:
    """Steps of `b` rows: the median gap between streamed tokens while all `b` decode (the
    window from the last first token to the first last token); None when no gap falls in
    it (the server ran them one after another)."""
    streams = [t for t in map(_stream, requests) if t]
    if len(streams) < b:
        return None
    start = max(t[0] for t in streams)
    end = min(t[-1] for t in streams)
    gaps = [b_ - a for t in streams for a, b_ in zip(t, t[1:], strict=False)
            if a >= start and b_ <= end]
    if not gaps:
        return None
    context = prompt + outputs // 2
    return Point("decode", b, b * causal_pairs(1, context), f"decode {b} at {context}",
                 statistics.median(gaps), b * (context + 1), b)


def mixed_steps(decoder: dict, prompts: list[dict],
                saved: Sequence[float] = ()) -> list[tuple[float, int]]:
    """(step seconds, decoder's tokens so far) for each prompt whose first token came out
    with one of the decoder's tokens — within a quarter of the decoder's median gap, where a
    prompt run in a step of its own would land a whole decode step away. A prompt whose
    token streamed no text (a piece of a character) has no time and is left out. The
    decoder's gap before that token also held the prompt's launch, and what it waited for
    saves (`saved`, by prompt) is taken out."""
    t = _stream(decoder)
    gaps = [b - a for a, b in zip(t, t[1:], strict=False)]
    if not gaps:
        return []
    near = statistics.median(gaps) / 4
    out = []
    for p, waited in zip(prompts, saved or [0.0] * len(prompts), strict=True):
        if p["first_token"] is None:  # its one token streamed no text: no time to match
            continue
        j = min(range(1, len(t)), key=lambda i: abs(t[i] - p["first_token"]))
        if abs(t[j] - p["first_token"]) <= near:
            out.append((t[j] - t[j - 1] - waited, j))
    return out


def _mixed(url: str, model: str, rng: random.Random, probes: Probes, prompt: int, c: int,
           fit: StepFit, api_key: str | None, saves: SlotSaves) -> Point | None:
    """One decoder of `prompt` tokens and, while it decodes, `probes.repeats` prompts of
    `c` tokens, each sent four decode steps after the one before it should be done (as the
    fit of the probes so far times them; the decoder asks for tokens enough to outlast
    them): the median of the steps that ran a prompt beside it, or None."""
    step = fit.seconds(1, causal_pairs(1, prompt), 1, prompt + 1)
    start = fit.overhead_s + fit.seconds(prompt, causal_pairs(prompt, 0), 1, prompt) \
        + 4 * step
    gap = fit.overhead_s + fit.seconds(c, causal_pairs(c, 0), 1, c) + 4 * step
    outputs = math.ceil((start + probes.repeats * gap) / step) + 8
    arrivals = [Arrival(0.0, prompt, outputs, prompt_tokens=_prompts(rng, 1, prompt)[0])]
    arrivals += [Arrival(start + gap * i, c, 1, prompt_tokens=p)
                 for i, p in enumerate(_prompts(rng, probes.repeats, c))]
    saved = saves.beside(arrivals[0], arrivals[1:])
    done = _send(url, model, arrivals, api_key, None)
    steps = mixed_steps(done[0], done[1:], saved[1:])
    if not steps:
        return None
    # Labelled by the decoder's prompt, not the context reached, so that the same probe
    # in another round carries the same label.
    # The step that streamed the decoder's token j read its prompt and j − 1 outputs.
    return mixed_point(c, prompt + int(statistics.median(j for _, j in steps)) - 1,
                       statistics.median(s for s, _ in steps),
                       f"prefill {c} beside a decode of {prompt}")


def _wake(url: str, model: str, rng: random.Random, spells: tuple[float, ...], alone: Point,
          api_key: str | None, progress: Callable[[str], None],
          saves: SlotSaves | None = None) -> list[Point]:
    """A prompt of `alone`'s length sent `idle` seconds after the last request finished, for
    each of `spells`: the wake points against `alone` (the same prompt sent back to back;
    `saves`: what each waited for saves, taken out as it was of `alone`)."""
    points, n = [], alone.new_tokens
    for idle in spells:
        def send(idle: float = idle) -> tuple[list[dict], Sequence[float]]:
            sent = [Arrival(idle, n, 1, prompt_tokens=_prompts(rng, 1, n)[0])]
            saved = saves.one_by_one(sent) if saves else ()
            return _send(url, model, sent, api_key, 1), saved

        done, saved = first_timed(send)
        points.append(wake_point(done, alone, idle, saved))
        progress(f"  {points[-1].label}: {points[-1].seconds * 1e3:+.1f} ms")
    return points


WAKE_TRIES = 3
"""Prompts one idle spell may take. A prompt whose one output token is a piece of a
character streams no text, so its first token has no time (it ended a three-run
`sim_vs_real` on Gemma 3 270M once); another prompt is sent after the same spell."""


def first_timed(send: Callable[[], tuple[list[dict], Sequence[float]]],
                tries: int = WAKE_TRIES) -> tuple[list[dict], Sequence[float]]:
    """What `send()` returns (requests and their saves), from the first of up to `tries`
    sends (at least one) where a request streamed text; the last send's where none did, which
    `prefill_point` then names in a sentence."""
    done, saved = send()
    for _ in range(tries - 1):
        if any(r["ttft"] is not None for r in done):
            break
        done, saved = send()
    return done, saved


def wake_probe(url: str, model: str, probes: Probes = FULL, api_key: str | None = None,
               progress: Callable[[str], None] = print, seed: int = 0) -> list[Point]:
    """The wake points alone, the back-to-back prompt they are measured against timed anew.
    How the machine wakes changes within minutes on a shared VM (a round of `probe` has
    found +40 ms after 5 s, and one ten minutes later nothing), so a run that predicts a
    trace sends this again beside it (`benchmarks/sim_vs_real.py`). Behind llama-server's
    slots, the first of the back-to-back prompts waits for the saves of the slots the
    requests before left (`slot_save.py`), and their median leaves it out; the others and
    the wake prompts each wait for the save of the one before, alike, and the points are
    differences."""
    rng = random.Random(seed)
    c = probes.prefill[0]
    arrivals = [Arrival(0.0, c, 1, prompt_tokens=p) for p in _prompts(rng, probes.repeats, c)]
    alone = prefill_point(_send(url, model, arrivals, api_key, 1), c)
    return _wake(url, model, rng, probes.wake, alone, api_key, progress)


SAVE_TOKENS = 1536
"""The prompt whose slot's save `save_point` times: its state (12 MiB on Gemma 3 270M)
took about 20 ms to save on a 2-core CPU, ten times a short request's jitter."""


def save_point(url: str, model: str, rng: random.Random, repeats: int,
               state_bytes: Callable[[int], int], api_key: str | None) -> Point | None:
    """What saving a slot to llama-server's prompt cache takes (`slot_save.py`), each of
    `repeats` times: a short prompt in slot 1, then A (`SAVE_TOKENS`, one output) in slot 0,
    then B (16 tokens) in slot 1, whose launch saves A's slot, then C (16 tokens) in slot
    2, whose launch saves B's. TTFT(B) − TTFT(C) is A's save less B's (`state_bytes`:
    a state's bytes by its tokens); the point is A's, at their median. None where the
    server saves nothing to see (`--cache-ram 0`: a median of 1 ms or less)."""
    diffs = []
    for _ in range(repeats):
        s, b, c = (Arrival(0.0, 16, 1, prompt_tokens=p) for p in _prompts(rng, 3, 16))
        a = Arrival(0.0, SAVE_TOKENS, 1, prompt_tokens=_prompts(rng, 1, SAVE_TOKENS)[0])
        _send(url, model, [s], api_key, 1, (1,))
        _send(url, model, [a], api_key, 1, (0,))
        tb = _first(_send(url, model, [b], api_key, 1, (1,))[0])
        diffs.append(tb - _first(_send(url, model, [c], api_key, 1, (2,))[0]))
    d = statistics.median(diffs)
    if d <= 1e-3:
        return None
    n = SAVE_TOKENS
    if state_bytes(n) <= state_bytes(16):  # a state of no size: nothing to scale by
        return None
    return Point("save", n, 0, f"save {n}", d * state_bytes(n) / (state_bytes(n)
                                                               - state_bytes(16)), n)


def probe(url: str, model: str, probes: Probes = FULL, api_key: str | None = None,
          progress: Callable[[str], None] = print, seed: int = 0,
          shape: ModelProfile | None = None, save: Point | bool | None = True
          ) -> list[Point]:
    """Probe the server at `url` (an OpenAI-compatible base URL serving `model`): its
    prefill and decode points, as `calibrate.sweep` gives them for an executor. Behind
    llama-server's slots, with the model's `shape` given, first what saving a slot takes,
    and every point less the saves its requests waited for. `save`: True to time the save
    (`save_point`; its point is returned first), or what an earlier round found, a point
    (not returned again) or None (it saw none) — a speed check's few probes would take
    longer timing it again, and would take their points less other saves than the round's.

    Long because it runs the probes in their order, each kind a few lines."""
    rng = random.Random(seed)
    _send(url, model, [Arrival(0.0, 16, 2, prompt_tokens=_prompts(rng, 1, 16)[0])],
          api_key, 1)  # warm-up: first-request costs land on no point
    points = []
    slots = llama_server_slots(url, api_key)
    saves = SlotSaves(lambda n: 0.0)
    if shape is not None and slots >= 3:
        # Twice the repeats: one difference of two requests moved by 14–40 ms around a
        # median of 20 (a 16-token control's by −4 to +8).
        timed = save is True
        saved = save_point(url, model, rng, 2 * probes.repeats,
                           lambda n: shape.kv_bytes(n, 1), api_key) if timed else save or None
        if saved is None:
            progress("  save of a slot: none seen (the server's prompt cache is off)")
        else:
            if timed:
                points.append(saved)
            progress(f"  {saved.label}-token slot: {saved.seconds * 1e3:.1f} ms"
                     + ("" if timed else " (timed before)"))
            saves = SlotSaves(save_seconds(shape, ((saved.new_tokens, saved.seconds),)))
        saves.pending = [16]  # C's state, or the warm-up's (a token more: no matter)
    for c in probes.prefill:
        arrivals = [Arrival(0.0, c, 1, prompt_tokens=p)
                    for p in _prompts(rng, probes.repeats, c)]
        saved_by = saves.one_by_one(arrivals)
        points.append(prefill_point(_send(url, model, arrivals, api_key, 1), c, saved_by))
        progress(f"  {points[-1].label}: {points[-1].seconds * 1e3:.1f} ms")
    alone = next((p for p in points if p.kind == "prefill"), None)
    if alone is not None:
        points += _wake(url, model, rng, probes.wake, alone, api_key, progress, saves)
    for h, c in probes.history:
        again, saved_by = [], []
        for base in _prompts(rng, probes.repeats, h):  # the prefix, then it with c more
            first = Arrival(0.0, h, 1, prompt_tokens=base)
            more = Arrival(0.0, h + c, 1, prompt_tokens=base + _prompts(rng, 1, c)[0])
            saves.one_by_one([first])
            saved_by.append(saves.sharing(more))  # it takes first's slot, unsaved
            _send(url, model, [first], api_key, 1)
            again += _send(url, model, [more], api_key, 1)
        point = history_point(again, h, c, saved_by)
        if point is None:
            progress(f"  prefill {c} on {h}: the server did not say it reused any of the "
                     f"{h}-token prefix (vLLM: --enable-prompt-tokens-details); no point")
            continue
        points.append(point)
        progress(f"  {point.label}: {point.seconds * 1e3:.1f} ms")
    # Behind llama-server's slots, rows in slots that are not neighbours decode in passes of
    # their own (`executors/server_slots.py`): a probe's rows go to slots 0 to b − 1, so
    # that each of its steps is one pass of b rows.
    for b, n in probes.decode:
        arrivals = [Arrival(0.0, n, probes.outputs, prompt_tokens=p)
                    for p in _prompts(rng, b, n)]
        pin = 1 < b <= slots
        saves.together(arrivals)  # only the first token waits: no decode step does
        point = decode_point(_send(url, model, arrivals, api_key, None,
                                   tuple(range(b)) if pin else ()), b, n, probes.outputs)
        if point is None:
            progress(f"  decode {b} at {n}: the server never decoded all {b} together; "
                     "no point")
            continue
        point = dataclasses.replace(point, pinned=pin)
        points.append(point)
        progress(f"  {point.label}: {point.seconds * 1e3:.1f} ms"
                 + (f" (slots 0–{b - 1})" if point.pinned else ""))
    for prompt, c in probes.mixed:
        if not any(p.kind == "decode" for p in points):
            break
        point = _mixed(url, model, rng, probes, prompt, c, fit_step_model(points), api_key,
                       saves)
        if point is None:
            progress(f"  prefill {c} beside a decode of {prompt}: the server never ran a "
                     "prompt in the same step as a decode; no point")
            continue
        points.append(point)
        progress(f"  {point.label}: {point.seconds * 1e3:.1f} ms")
    if not any(p.kind == "decode" for p in points):
        raise ProbeError(f"The server at {url} decoded no probe's requests together; "
                         "nothing to fit a decode step to.")
    return points


def server_name(url: str) -> str:
    """A hardware profile name for the server at `url`: `server-<host>-<port>`, in the
    letters a TOML table name takes bare."""
    parts = urlsplit(url)
    where = parts.hostname or "server"
    if parts.port:
        where += f"-{parts.port}"
    return "server-" + re.sub(r"[^A-Za-z0-9_-]", "-", where)


def write_server_profiles(url: str, base: ModelProfile, name: str, hw: str, fit: StepFit,
                          points: list[Point], like: HardwareProfile) -> tuple[Path, Path]:
    """models/<name>.toml (`base`'s shape, the fit and decode table for `hw`) and
    hardware/<hw>.toml (the server's card: `like`'s memory and peaks, which a client cannot
    measure, with the efficiencies the probes reached against them)."""
    model = dataclasses.replace(base, name=name)
    model_path, hw_path = profile_paths(name, hw)
    model_path.write_text(
        f"# Written by kvdeck calibrate --url {url} ({time.strftime('%Y-%m-%d')}): "
        f"{base.name}'s shape, the server's steps as its token stream showed them.\n"
        + model_toml(model) + fit_toml(fit, hw, points))
    mfu, mbu = efficiencies(points, model, like.bandwidth_bytes_per_s, like.peak_flops)
    hw_path.write_text(
        f"# Written by kvdeck calibrate --url: the server at {url}.\n"
        + hardware_toml(hw, f"the server at {url}, on {like.description}", like.memory_bytes,
                        like.bandwidth_bytes_per_s, like.peak_flops,
                        like.link_bandwidth_bytes_per_s, mfu, mbu, name,
                        f"memory and peaks: the {like.name} profile's"))
    return model_path, hw_path
