"""The console and the server run in a child process that this parent waits for.

A fault in a native library (llama.cpp, torch's kernels) kills a process outright: no
`finally` runs, so a console leaves the terminal in raw mode on the alternate screen, and
nobody says what happened. The parent imports nothing heavy and runs no native code, so it
survives the child: when the child dies by a signal it restores the terminal as it found
it, prints one sentence (the signal, the executor, the log file, what to try) and exits
with 128 + the signal's number, as a shell reports it. A server's port belonged to the
child, so it closes with it: never a port that accepts and never answers.

Signals: the terminal's own (Ctrl+C, a hang-up) reach the child directly, as it shares the
terminal's process group; a signal sent to the parent by another process (`kill`, a test's
`terminate()`) is forwarded to the child. The parent exits when the child does, with its
status. Where the platform lacks `sigtimedwait` (macOS, Windows), the command runs in one
process as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUPERVISED = "KVDECK_SUPERVISED"
"""Set in the child: it runs the command itself."""
STATE = "KVDECK_SUPERVISOR_STATE"
"""A file the child writes what it runs (executor, log) into, for the parent's sentence."""
PARENT = "KVDECK_SUPERVISOR_PID"
"""The parent's pid, for the child to notice that it died."""
SUPERVISED_COMMANDS = ("console", "serve")
"""Commands run under the supervisor (and the bare `kvdeck`, which opens the console)."""
STOP_GRACE_S = 30.0
"""Seconds a child asked to stop (a forwarded signal) has before it is killed, beyond the
drain it recorded (`serve --shutdown-timeout`): the engine's current step fits well within
it."""
SI_KERNEL = 0x80
"""siginfo's code for a signal the kernel sent (the terminal's Ctrl+C and hang-up)."""
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

# Leave the alternate screen, show the cursor, stop mouse, focus and paste reporting, and
# pop the kitty keyboard mode: what Textual sets up and a killed process never undoes.
RESET = ("\x1b[?1049l\x1b[?25h\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1006l\x1b[?1015l"
         "\x1b[?1004l\x1b[?2004l\x1b[<u\x1b[0m")

SIGNAL_WORDS = {signal.SIGSEGV: "a segmentation fault", signal.SIGBUS: "a bus error",
                signal.SIGILL: "an illegal instruction", signal.SIGFPE: "an arithmetic fault",
                signal.SIGABRT: "an abort", signal.SIGKILL: "killed, e.g. by the kernel's "
                "out-of-memory killer"}


def command_of(argv: list[str], commands: set[str]) -> str | None:
    """The subcommand `argv` runs ('' for the bare `kvdeck`), or None for `--help`."""
    if any(a in ("--help", "-h") for a in argv):
        return None
    for a in argv:
        if a in commands:
            return a
    return ""


def wants_supervisor(argv: list[str], commands: set[str]) -> bool:
    """Whether `argv` should run under a supervising parent here."""
    if os.environ.get(SUPERVISED) or not hasattr(signal, "sigtimedwait"):
        return False
    cmd = command_of(argv, commands)
    return cmd is not None and cmd in ("", *SUPERVISED_COMMANDS)


def record(**fields: str) -> None:
    """In the child: note what it runs, for the parent's sentence if it dies."""
    path = os.environ.get(STATE)
    if not path:
        return
    try:
        Path(path).write_text(json.dumps(fields))
    except OSError:
        pass  # the sentence then names less; the command must not fail for it


def fault_log(pid: int) -> Path:
    """Where child `pid` writes the Python stacks of a native fault (`faulthandler`)."""
    from kvdeck.runtime.logs import log_dir

    return log_dir() / f"native-fault-{pid}.log"


def as_child() -> None:
    """In the child, first thing: die with the parent (a parent killed outright, SIGKILL,
    must not leave an orphaned server holding its port), and on a fatal signal write every
    thread's Python stack to a file of its own (not the shared log, which another thread
    may be writing), for the parent to name."""
    import faulthandler

    _die_with_parent()

    path = fault_log(os.getpid())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        faulthandler.enable(open(path, "w"))  # open for the process's life
    except OSError:
        pass


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent exits (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.environ.get(PARENT)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if parent and os.getppid() != int(parent):  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def supervise(argv: list[str]) -> int:
    """Run `kvdeck argv` in a child process; its exit status, or 128 + the signal that
    killed it (after the terminal is restored and the sentence printed)."""
    fd, state = tempfile.mkstemp(prefix="kvdeck-", suffix=".json")
    os.close(fd)
    tty = _save_terminal()
    code = ("import sys; sys.argv[0] = 'kvdeck'; from kvdeck.console.cli import main; main()")
    env = {**os.environ, SUPERVISED: "1", STATE: state, PARENT: str(os.getpid())}
    try:
        child = subprocess.Popen([sys.executable, "-c", code, *argv], env=env)
    except BaseException:
        Path(state).unlink(missing_ok=True)
        raise
    stacks = fault_log(child.pid)
    try:
        status, forwarded = _wait(child, state)
        if status >= 0:
            return status
        sig = -status
        if sig == signal.SIGKILL and sig in forwarded:
            _restore_terminal(tty)  # we killed it: it restored nothing
        if sig in forwarded:
            return 128 + sig  # the signal someone sent us, passed on: no crash to explain
        _restore_terminal(tty)
        traced = stacks.is_file() and stacks.stat().st_size > 0
        sys.stderr.write(crash_sentence(sig, _read_state(state), stacks if traced else None)
                         + "\n")
        sys.stderr.flush()
        return 128 + sig
    finally:
        Path(state).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # an empty stacks file: nothing crashed
            if not stacks.stat().st_size:
                stacks.unlink()


def crash_sentence(sig: int, state: dict, stacks: Path | None = None) -> str:
    """One sentence for a child killed by `sig`, naming what it ran, its log and the file
    of Python stacks at the fault."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    what = SIGNAL_WORDS.get(sig, "a signal")
    executor = state.get("executor")
    where = f"in the {executor} executor" if executor else "while starting"
    log = state.get("log") or _default_log()
    hint = "try --executor torch" if executor != "torch" else "try --executor llama_cpp"
    if executor == "llama_cpp":
        hint += " or --llama-repack off"
    files = f"the log is {log}" + (f", the Python stacks at the fault are in {stacks}"
                                   if stacks else "")
    return (f"kvdeck's engine process died of {name} ({what}) {where}: a fault in native "
            f"code, not a Python error; {files}; {hint}.")


def _default_log() -> str:
    from kvdeck.runtime.logs import log_dir

    return str(log_dir() / "kvdeck.log")


def _read_state(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text() or "{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def forwardable(info: signal.struct_siginfo | None) -> bool:
    """Whether a signal `sigtimedwait` returned is the child's to receive: one another
    process sent, or a hang-up whoever sent it. The terminal's own Ctrl+C reaches the child
    directly (the whole foreground group gets it), but the kernel sends a hang-up (a closed
    terminal window, `tmux kill-server`) to the session leader alone, which the parent is
    when the terminal started kvdeck. A wait interrupted near its timeout (a profiler's
    ptrace attach) can hand back an unfilled siginfo, so only a signal we asked for
    counts."""
    if info is None or info.si_signo not in FORWARDED:
        return False
    return info.si_code != SI_KERNEL or info.si_signo == signal.SIGHUP


def _wait(child: subprocess.Popen, state: str) -> tuple[int, set[int]]:
    """Wait for `child`, forwarding signals other processes send us; (its return code,
    the signals forwarded). A child that has not ended `STOP_GRACE_S` after the first
    signal, plus the drain it recorded (`serve --shutdown-timeout`), is killed: one whose
    terminal is gone can block for good writing to it, still holding its port."""
    forwarded: set[int] = set()
    deadline = None
    old = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        while child.poll() is None:
            info = signal.sigtimedwait(FORWARDED, 0.2)
            if forwardable(info) and child.poll() is None:
                forwarded.add(info.si_signo)
                child.send_signal(info.si_signo)
                grace = STOP_GRACE_S + _drain_seconds(state)
                deadline = deadline or time.monotonic() + grace
            if deadline is not None and time.monotonic() > deadline and child.poll() is None:
                print(f"kvdeck did not stop within {grace:g} s of being asked to (was its "
                      "terminal closed?); killed it.", file=sys.stderr)
                child.kill()
                child.wait()
                forwarded.add(signal.SIGKILL)
        return child.returncode, forwarded
    finally:
        while signal.sigtimedwait(FORWARDED, 0) is not None:
            pass  # the terminal's Ctrl+C was the child's to handle, not ours on the way out
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _drain_seconds(state: str) -> float:
    """The drain the child recorded (`record(drain_s=...)`), 0 if none."""
    try:
        return max(float(_read_state(state).get("drain_s", 0)), 0.0)
    except (TypeError, ValueError):
        return 0.0


def _save_terminal():
    """(fd, termios attributes) of the controlling terminal, or None without one."""
    try:
        import termios

        fd = sys.stdin.fileno()
        if os.isatty(fd):
            return fd, termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError):
        pass
    return None


def _restore_terminal(tty) -> None:
    if tty is None:
        return
    import termios

    fd, attrs = tty
    try:
        termios.tcsetattr(fd, termios.TCSADRAIN, attrs)
        if os.isatty(sys.stdout.fileno()):
            sys.stdout.write(RESET)
            sys.stdout.flush()
    except (OSError, ValueError):
        pass
