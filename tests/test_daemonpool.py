"""disagg_agents.runtime.daemonpool: a job runs at once on an idle thread or a new one (never
queued behind another), finished threads wait for the next job, and no more
than max_idle of them wait."""

from __future__ import annotations

import threading

import pytest

from disagg_agents.runtime.daemonpool import DaemonPool


def test_a_finished_thread_runs_the_next_job() -> None:
    pool = DaemonPool("t")
    ran: list[int] = []
    for _ in range(3):
        assert pool.run(lambda: ran.append(threading.get_ident())).wait(10)
    assert len(ran) == 3 and len(set(ran)) == 1  # one thread, reused
    t = next(t for t in threading.enumerate() if t.ident == ran[0])
    assert t.daemon and t.name == "t"


def test_jobs_never_wait_for_each_other_and_idle_threads_are_bounded() -> None:
    pool = DaemonPool("t", max_idle=2)
    gate = threading.Event()
    started = threading.Semaphore(0)

    def job() -> None:
        started.release()
        gate.wait(10)

    done = [pool.run(job) for _ in range(4)]
    for _ in range(4):  # all four run at once: none is queued behind a blocked one
        assert started.acquire(timeout=10)
    gate.set()
    assert all(d.wait(10) for d in done)
    for _ in range(100):
        if pool.idle() == 2:
            break
        threading.Event().wait(0.05)
    assert pool.idle() == 2  # two stay for the next jobs, two ended


def test_a_job_that_raises_still_sets_its_event(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # expected: not noise
    pool = DaemonPool("t")

    def boom() -> None:
        raise RuntimeError("boom")

    assert pool.run(boom).wait(10)
    assert pool.run(lambda: None).wait(10)  # the pool goes on (on a new thread)


def test_idle_threads_leave_after_idle_s() -> None:
    pool = DaemonPool("t-idle", idle_s=0.2)
    assert all(pool.run(lambda: None).wait(10) for _ in range(3))
    named = [t for t in threading.enumerate() if t.name == "t-idle"]
    assert named  # a thread waits for the next job
    for t in named:
        t.join(10)
    assert not any(t.is_alive() for t in named) and pool.idle() == 0
    assert pool.run(lambda: None).wait(10)  # and a new one serves the next
