"""The failure contract's second half: after an unexpected exception the engine stops for
good (`Engine.fail`), and every request it holds or was about to take ends aborted with the
reason, so no client waits forever and no block stays held."""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass

from kvdeck.runtime.core.commands import AddRequest, InboxMessage
from kvdeck.runtime.core.intake import Intake
from kvdeck.runtime.core.request import RequestStatus
from kvdeck.runtime.core.scheduler import Scheduler
from kvdeck.runtime.errors import EngineFailedError
from kvdeck.runtime.kv.manager import BlockManager

log = logging.getLogger("kvdeck.engine")


@dataclass(frozen=True)
class EngineFailure:
    """Why the engine stopped, in one sentence, and where the full traceback is."""

    message: str
    log_path: str | None

    def error(self, what: str) -> EngineFailedError:
        """The one sentence a caller that drove the engine raises: `what` stopped, why,
        and where the traceback is."""
        return EngineFailedError(f"{what} stopped: {self.message}; the traceback is in "
                                 f"{self.log_path}.")


def abort_all(scheduler: Scheduler, intake: Intake, inbox: queue.SimpleQueue[InboxMessage],
              kv: BlockManager, reason: str, now: float) -> None:
    """Abort every request — running, waiting, due to arrive or still in the inbox, and the
    samples of a prompt whose branches never started — and release their blocks. The
    admitted ones go to the scheduler's finished list, the others to the intake's
    cancelled one, for their listeners."""
    admitted = list(scheduler.running) + list(scheduler.waiting)
    future = intake.drop_all()
    while True:
        try:
            msg = inbox.get_nowait()
        except queue.Empty:
            break
        if isinstance(msg, AddRequest):
            future.append(msg.request)
    scheduler.running.clear()
    scheduler.waiting.clear()
    kv.in_flight = False
    future += [b for r in admitted + future if not r.branched for b in r.branches]
    for req in admitted + future:
        req.status, req.reason, req.finish_time = RequestStatus.ABORTED, reason, now
    for req in admitted:
        try:
            kv.release(req)
        except Exception:  # noqa: BLE001 - state may be inconsistent after the failure
            log.exception("could not release %s after the failure", req.request_id)
    scheduler.finished.extend(admitted)
    intake.cancelled.extend(future)
