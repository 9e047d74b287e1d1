"""Shared fixtures: the converted default model (cached across runs) and real
agents as processes on 127.0.0.1, shared across a test module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.serving.defaultmodel import ensure_default_model
from disagg.serving.localagents import AgentProc, start_local_pair

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model() -> Path:
    # Converted once per machine into DISAGG_CACHE (or ~/.cache/disagg) and reused.
    return ensure_default_model()


@pytest.fixture(scope="module")
def smol_agents(
    default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[AgentProc, AgentProc]]:
    pair = start_local_pair(default_model, log_dir=tmp_path_factory.mktemp("agent-logs"))
    yield pair
    for agent in reversed(pair):
        agent.stop()
