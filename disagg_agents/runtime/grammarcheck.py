"""Every grammar is compiled first in a child process, so that a grammar that
crashes the compiler (llguidance recurses along rule references: a chain of
3,000 Lark rules overflows its stack, SIGSEGV) kills only that child, and the
request is a 400; the gateway and the decode agent go on serving.

The children are long-lived (a spawn costs ~0.2 s, a check of a small grammar
~1 ms), at most `workers` at a time, each killed when a check runs past its
time. The protocol is one JSON line each way over the child's stdin/stdout; a
child whose parent died reads EOF and exits. Stdlib only, but the child needs
llguidance (without it, nothing is checked and the in-process compile reports).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

CHECK_WORKERS = 3  # children checking at once, per process (a model's compile workers)
CHECK_TIMEOUT_S = 10.0
CHILD_MAX_BYTES = 4 << 30  # a checking child's address space
# llguidance's own limits, below its defaults (500k symbols, 2,000 items a row),
# and errors without the parser state (it echoes the caller's text, escapes and all).
LIMITS: dict[str, Any] = {
    "max_grammar_size": 200_000,
    "max_items_in_row": 2000,
    "verbose_errors": False,
}


def limits() -> Any:
    """LIMITS as llguidance's LLParserLimits (None without llguidance)."""
    try:
        import llguidance as llg
    except ImportError:
        return None
    return llg.LLParserLimits(**LIMITS)


def _validate(grammar: str) -> str | None:
    import llguidance as llg

    try:
        return llg.LLMatcher.validate_grammar(grammar, None, limits=limits()) or None
    except BaseException as e:  # llguidance's PanicException is a BaseException
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        return str(e) or type(e).__name__


def main() -> None:
    """The child: one {"grammar": llguidance JSON} line in, one {"error": ...} line out.
    Its memory is capped: a grammar that blows up kills the child, not the machine."""
    with contextlib.suppress(ValueError, OSError):  # not enforced everywhere (macOS)
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_MAX_BYTES, CHILD_MAX_BYTES))
    for line in sys.stdin:
        grammar = json.loads(line)["grammar"]
        sys.stdout.write(json.dumps({"error": _validate(grammar)}) + "\n")
        sys.stdout.flush()


class _Died(Exception):
    pass


class TooSlow(Exception):
    """A check ran past its time: no verdict on the grammar (a busy machine is
    not the grammar's fault, so it is never remembered as a refusal)."""


class CompileCheck:
    """A small pool of checking children, shared by the threads of one process."""

    def __init__(self, workers: int = CHECK_WORKERS) -> None:
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._idle: list[subprocess.Popen[bytes]] = []
        self.crashes = 0  # children a grammar killed (for status and tests)

    def check(self, grammar: str, timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
        """Why `grammar` (llguidance's JSON form) is refused, or None when it compiles.
        Raises TooSlow past `timeout_s`."""
        if not available():
            return None
        with self._slots:
            child = self._take()
            try:
                reply = _ask(child, grammar, timeout_s)
            except TimeoutError:
                _kill(child)
                raise TooSlow(f"the grammar did not compile within {timeout_s:g}s") from None
            except _Died:
                code = _kill(child)
                self.crashes += 1
                how = _signal_name(-code) if code < 0 else f"exit {code}"
                return f"the grammar crashed the grammar compiler ({how}); make it simpler"
            with self._lock:
                self._idle.append(child)
            return reply

    def warm(self) -> None:
        """Start one child now, off the request path."""
        if available():
            with self._lock:
                self._idle.append(_spawn())

    def _take(self) -> subprocess.Popen[bytes]:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.poll() is None:
                    return child
        return _spawn()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            _kill(child)


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _spawn() -> subprocess.Popen[bytes]:
    root = str(Path(__file__).resolve().parents[2])  # the folder holding disagg_agents/
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", "from disagg_agents.runtime.grammarcheck import main; main()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # llguidance's panic text would reach our log raw
        env=env,
        start_new_session=True,  # a terminal's ^C is the parent's to handle
    )


def _ask(child: subprocess.Popen[bytes], grammar: str, timeout_s: float) -> str | None:
    assert child.stdin is not None and child.stdout is not None
    try:
        child.stdin.write(json.dumps({"grammar": grammar}).encode() + b"\n")
        child.stdin.flush()
    except (BrokenPipeError, OSError):
        raise _Died from None
    deadline = time.monotonic() + timeout_s
    fd, data = child.stdout.fileno(), b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            piece = os.read(fd, 1 << 16)
            if not piece:
                raise _Died
            data += piece
    error = json.loads(data)["error"]
    return str(error) if error else None


def _kill(child: subprocess.Popen[bytes]) -> int:
    """Its exit code (negative: the signal), after killing it if it still runs."""
    if child.poll() is None:
        child.kill()
    for stream in (child.stdin, child.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    return child.wait()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
