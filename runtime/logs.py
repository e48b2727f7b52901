"""Logging: `--log-level` for every command, and a file for what a user should not have to
read on screen (tracebacks of unexpected failures).

Log files live under `$KVDECK_CACHE/logs/` (default `~/.cache/kvdeck/logs/`). Commands that
own the terminal (the console) log only to a file; the others log to stderr as well.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path

from kvdeck.runtime.errors import ConfigError
from kvdeck.runtime.resources import cache_dir

LEVELS = ("debug", "info", "warning", "error")
log = logging.getLogger("kvdeck")


def log_dir() -> Path:
    return cache_dir() / "logs"


def setup_logging(level: str = "warning", *, to_stderr: bool = True) -> Path:
    """Configure the `kvdeck` logger at `level`; returns the log file it writes."""
    if level not in LEVELS:
        raise ConfigError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}.")
    path = log_dir() / "kvdeck.log"
    log.setLevel(level.upper())
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(path, encoding="utf-8")
        file_handler.setFormatter(fmt)
        log.addHandler(file_handler)
    except OSError:
        pass  # an unwritable cache directory must not stop the command; stderr remains
    if to_stderr:
        stream = logging.StreamHandler()
        stream.setFormatter(fmt)
        log.addHandler(stream)
    log.propagate = False
    return path


def write_failure(exc: BaseException, what: str) -> Path | None:
    """Write `exc`'s full traceback to its own file under the log directory; returns the
    path, or None when the directory cannot be written."""
    path = log_dir() / f"failure-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    text = f"{what}\n\n" + "".join(traceback.format_exception(type(exc), exc,
                                                               exc.__traceback__))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError:
        return None
    log.error("%s; traceback in %s", what, path)
    return path
