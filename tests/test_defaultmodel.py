"""The default model's first-use conversion, one converter per machine: a second
process asking while the first converts waits for it and uses its result (it used
to convert too, then remove the dir the first had just renamed in)."""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path

import pytest

from disagg.serving import defaultmodel


def test_a_second_caller_waits_for_the_converter_and_uses_its_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISAGG_CACHE", str(tmp_path))
    target = defaultmodel.default_model_dir()
    target.parent.mkdir(parents=True)

    def no_second_conversion(*_a: object) -> Path:
        raise AssertionError("converted although another process had just done it")

    monkeypatch.setattr(defaultmodel, "_convert", no_second_conversion)
    said: list[str] = []
    got: list[Path] = []
    with open(target.parent / ".convert.lock", "a") as first:  # the converter at work
        fcntl.flock(first, fcntl.LOCK_EX)
        waiter = threading.Thread(
            target=lambda: got.append(defaultmodel.ensure_default_model(said.append))
        )
        waiter.start()
        deadline = time.monotonic() + 10
        while not said and time.monotonic() < deadline:
            time.sleep(0.01)
        assert said == ["another process is converting the default model: waiting for it"]
        time.sleep(0.2)
        assert waiter.is_alive() and not got  # held until the converter is done
        target.mkdir()
        (target / defaultmodel.MARKER).write_text("converted by the first")
        fcntl.flock(first, fcntl.LOCK_UN)
    waiter.join(10)
    assert got == [target]


def test_an_uncontended_first_use_converts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_CACHE", str(tmp_path))
    calls: list[Path] = []

    def convert(target: Path, _say: object) -> Path:
        calls.append(target)
        return target

    monkeypatch.setattr(defaultmodel, "_convert", convert)
    said: list[str] = []
    assert defaultmodel.ensure_default_model(said.append) == defaultmodel.default_model_dir()
    assert calls == [defaultmodel.default_model_dir()] and not said
