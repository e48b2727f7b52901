"""User-facing errors.

Every error a user can cause (a bad path, an unknown model, a bad knob, a malformed trace)
is raised as a `KvdeckError` whose message is one complete sentence naming what was wrong
and what is allowed. Front ends print the message and exit or notify; they never show a
traceback for these.
"""

from __future__ import annotations


class KvdeckError(Exception):
    """An error the user can fix; `str(err)` is one clear sentence."""


class ModelFileError(KvdeckError):
    """A model file is missing, not GGUF, truncated or otherwise unreadable."""


class ModelNotFoundError(KvdeckError):
    """A model name matches no embedded, installed or user-directory model."""


class ConfigError(KvdeckError):
    """A configuration value or knob is outside what is allowed."""


class TraceError(KvdeckError):
    """A trace file is malformed; the message names the line and the problem."""


class RequestError(KvdeckError):
    """A request is invalid: empty or over-long prompt, bad sampling parameters."""


class QueueFullError(KvdeckError):
    """The waiting queue is at its configured bound; the request was not queued."""


class RunFormatError(KvdeckError):
    """A recorded run directory is malformed, of another format version, or holds a record
    kind this version does not know."""


class EngineFailedError(KvdeckError):
    """The engine stopped on an unrecoverable error; it takes no new requests."""


class StepError(Exception):
    """An executor failure confined to one step (a device out of memory, say): the step's
    requests fail with the message and the engine keeps serving the others. Any other
    exception from an executor means the executor is unusable and stops the engine."""
