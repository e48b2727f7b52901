"""When a request stops after a token it generated, and the reason it finishes with: end of
sequence or a stop token id, `max_tokens` or the context limit, a stop string, a grammar
complete or left. The scheduler asks after every token it appends (`Scheduler.update`)."""

from __future__ import annotations

from collections.abc import Container

from kvdeck.runtime.core.request import Request, RequestStatus


def stop_after(req: Request, token: int, eos_token_ids: Container[int],
               max_model_len: int) -> RequestStatus | None:
    """The stop rules for `token`, just appended to `req`'s output: end of sequence or a
    stop token id, `max_tokens` or the context limit, or a stop string (the detokenizer
    takes the token here). None: the request goes on."""
    sp = req.sampling
    out = req.output_token_ids
    status = None
    if (token in eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
        status = RequestStatus.FINISHED_STOPPED
    elif len(out) >= sp.max_tokens or len(req.prompt_token_ids) + len(out) >= max_model_len:
        status = RequestStatus.FINISHED_LENGTH
    det = req.detokenizer
    if det is not None:
        det.push(token)
        if det.stopped_by is not None:
            status = RequestStatus.FINISHED_STOPPED
    guide = req.guide
    if guide is not None and status is None:
        if not guide.commit(token):  # masking prevents this: end it, and say why
            req.error = f"the output left its constraint ({guide.error})"
            status = RequestStatus.ABORTED
        elif guide.finished:  # complete, and nothing may follow but the end
            status = RequestStatus.FINISHED_STOPPED
    return status


def finish_reason(req: Request, status: RequestStatus) -> str:
    """The reason a request that stopped after a token is finished with."""
    return req.error if status is RequestStatus.ABORTED and req.error else status.value
