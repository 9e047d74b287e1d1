"""Local agents die with the process that started them, even one SIGKILLed.

`disagg serve --local` and `Client.local()` start agents as child processes and
stop them on exit; a parent killed with SIGKILL (or crashing) cannot, and the
agents would hold their ports and ~1 GB each forever. The launcher sets
`DISAGG_LIFELINE=<its pid>` in the child's environment; `arm()` then watches for
that parent to go: Linux's `prctl(PR_SET_PDEATHSIG)` signals at once, and a
watchdog thread (every platform) notices the agent was reparented. Either way the
agent gets SIGTERM, drains as `disagg stop` would, and is gone within
`GRACE_S`. Agents started by systemd, launchd or nohup have no such variable
and are unaffected.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

ENV = "DISAGG_LIFELINE"  # the parent's pid
ENV_PDEATHSIG = "DISAGG_LIFELINE_PDEATHSIG"  # "1": the parent's spawning thread lives as long
POLL_S = 0.5
GRACE_S = 10.0  # after SIGTERM, the longest a drain may take before a hard exit
PR_SET_PDEATHSIG = 1

armed = False


def arm() -> bool:
    """Watch the parent named in DISAGG_LIFELINE, if any; True when armed."""
    global armed
    raw = os.environ.pop(ENV, None)  # not inherited by anything we start
    pdeathsig = os.environ.pop(ENV_PDEATHSIG, None) == "1"
    if armed or not raw or not raw.isdigit():
        return armed
    parent = int(raw)
    # Linux signals on the death of the thread that forked us, so the launcher
    # asks for it only when that was its main thread.
    if pdeathsig and sys.platform == "linux":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still works
    if os.getppid() != parent:  # it died before we could ask
        _parent_gone()
    threading.Thread(target=_watch, args=(parent,), daemon=True, name="lifeline").start()
    armed = True
    return True


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    _parent_gone()


def _parent_gone() -> None:
    # Drain and exit as on `disagg stop`; a hard exit if that takes too long.
    timer = threading.Timer(GRACE_S, os._exit, args=(1,))
    timer.daemon = True
    timer.start()
    os.kill(os.getpid(), signal.SIGTERM)
