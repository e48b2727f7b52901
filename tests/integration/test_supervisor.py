"""A native crash never leaves a dead terminal or a silent server: the console and the server
run in a child process, and when it dies by a signal the parent restores the terminal, says
one sentence and exits non-zero. The crash is injected with `KVDECK_FAULT=decode:N`: the
llama.cpp executor's Nth decode kills its process with SIGSEGV, as a fault in llama.cpp's
kernels does."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import termios
import time

import httpx
import pytest

from kvdeck.console.supervisor import SI_KERNEL, command_of, crash_sentence, forwardable
from tests.terminal import Terminal

pytestmark = pytest.mark.slow


def test_which_commands_run_supervised() -> None:
    commands = {"console", "serve", "models", "probe"}
    assert command_of([], commands) == ""
    assert command_of(["--executor", "torch"], commands) == ""
    assert command_of(["serve", "--port", "0"], commands) == "serve"
    assert command_of(["serve", "--help"], commands) is None
    assert command_of(["models"], commands) == "models"


def test_only_signals_another_process_sent_are_forwarded() -> None:
    """py-spy attaching to the supervisor (ptrace) once made `sigtimedwait` return an
    unfilled siginfo (si_signo -688717824), whose forwarding raised and took the server
    down with its parent."""
    def info(signo: int, code: int) -> signal.struct_siginfo:
        return signal.struct_siginfo((signo, code, 0, 1234, 0, 0, 0))

    assert forwardable(info(signal.SIGTERM, 0))  # SI_USER: kill(1) or a process manager
    assert not forwardable(info(signal.SIGINT, SI_KERNEL))  # the terminal's, sent to both
    # The kernel sends a hang-up to the session leader alone: the child needs it passed on.
    assert forwardable(info(signal.SIGHUP, SI_KERNEL))
    assert not forwardable(info(-688717824, 986934256))
    assert not forwardable(info(signal.SIGUSR1, 0))
    assert not forwardable(None)


def test_the_sentence_names_the_signal_the_executor_the_log_and_what_to_try() -> None:
    text = crash_sentence(signal.SIGSEGV, {"executor": "llama_cpp", "log": "/x/kvdeck.log"})
    assert "SIGSEGV" in text and "segmentation fault" in text and "llama_cpp executor" in text
    assert "/x/kvdeck.log" in text and "--executor torch" in text and "--llama-repack off" in text
    assert text.count(".") >= 1 and "\n" not in text


def test_a_segfault_in_the_console_restores_the_terminal(tmp_path) -> None:
    term = Terminal([sys.executable, "-m", "kvdeck.console.cli", "--executor", "llama_cpp",
                     "--rate", "5"], cwd=str(tmp_path),
                    env={"KVDECK_FAULT": "decode:3"})
    before = termios.tcgetattr(term.fd)
    try:
        status = term.wait(300)
        after = termios.tcgetattr(term.fd)
    finally:
        term.close()
    screen = term.screen.decode("utf-8", errors="replace")
    assert status is not None, screen[-2000:]
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGSEGV, screen[-2000:]
    assert "died of SIGSEGV" in screen and "llama_cpp executor" in screen, screen[-2000:]
    assert "kvdeck.log" in screen and "--executor torch" in screen
    stacks = re.search(r"stacks at the fault are in (\S+\.log)", screen).group(1)
    assert "llama_cpp_context.py" in open(stacks).read()  # where in Python it died
    # The console had entered the alternate screen; the parent left it and gave back the
    # line discipline it found (echo and canonical input on again).
    assert b"\x1b[?1049h" in term.screen
    assert term.screen.rindex(b"\x1b[?1049l") > term.screen.rindex(b"\x1b[?1049h")
    assert after[3] & (termios.ECHO | termios.ICANON) == before[3] & (termios.ECHO |
                                                                      termios.ICANON)


def test_a_segfault_in_a_served_engine_closes_the_port(tmp_path) -> None:
    env = {**os.environ, "KVDECK_FAULT": "decode:2"}
    proc = subprocess.Popen([sys.executable, "-m", "kvdeck.console.cli", "serve", "--port", "0",
                             "--executor", "llama_cpp"], cwd=str(tmp_path), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.monotonic() + 300
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", line)
            port = int(m.group(1)) if m else None
        assert port is not None, proc.stderr.read()
        url = f"http://127.0.0.1:{port}"
        with pytest.raises(httpx.HTTPError):  # the engine dies under this request
            httpx.post(f"{url}/v1/completions", json={"model": "gemma3-270m", "prompt": "Hello",
                                                       "max_tokens": 8},
                       timeout=120)
        code = proc.wait(60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + signal.SIGSEGV, err
    assert "died of SIGSEGV" in err and "llama_cpp executor" in err, err
    with pytest.raises(httpx.ConnectError):  # nothing half-alive listens there
        httpx.get(f"{url}/health", timeout=5)


def serving_sim(cwd) -> subprocess.Popen:
    """`kvdeck serve --executor sim` (the parent's process), once it says it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "kvdeck.console.cli", "serve", "--port", "0",
                             "--executor", "sim"], cwd=str(cwd),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = ""
    while "serving" not in line:
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            raise AssertionError(proc.stderr.read())
    return proc


def test_a_signal_sent_to_the_parent_reaches_the_server(tmp_path) -> None:
    proc = serving_sim(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0  # the server shut down as it does on SIGTERM, and so did the parent


def test_a_parent_killed_outright_takes_its_server_with_it(tmp_path) -> None:
    import psutil

    proc = serving_sim(tmp_path)
    try:
        (child,) = psutil.Process(proc.pid).children()
        proc.kill()  # SIGKILL: the parent runs nothing more
        proc.wait()
        child.wait(60)  # the kernel's parent-death signal ended the server too
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not child.is_running()


def test_closing_the_terminal_ends_the_console_and_frees_its_port(tmp_path) -> None:
    """`tmux kill-server` or a closed terminal window hangs up the terminal: the kernel
    signals the session leader (the supervisor) alone. The console's process must end with
    it, its port closed (it once stayed alive, blocked writing to the dead terminal)."""
    import psutil

    term = Terminal([sys.executable, "-m", "kvdeck.console.cli", "serve", "--executor",
                     "sim", "--console", "--port", "0"], cwd=str(tmp_path))
    try:
        assert b"Queue" in term.read(90, until=(b"Queue",))
        (child,) = psutil.Process(term.pid).children()
        ports = [c.laddr.port for c in child.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN]
        assert ports
        os.close(term.fd)  # the terminal goes away
        child.wait(60)
        _, status = os.waitpid(term.pid, 0)
        term.status = status
    finally:
        if term.status is None:
            os.kill(term.pid, 9)
            os.waitpid(term.pid, 0)
    assert not child.is_running()
    # The hang-up, passed on, ended it (not the kill after the grace period: 128 + 9).
    assert os.waitstatus_to_exitcode(term.status) == 128 + signal.SIGHUP
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{ports[0]}/health", timeout=5)
