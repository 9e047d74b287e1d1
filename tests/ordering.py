"""A pytest plugin: a module that is one story keeps its order under a shuffle."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle (`-p randomly`)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    keep_stories_in_order(items)


def keep_stories_in_order(items: list[pytest.Item]) -> None:
    """A module that is one story (`ORDERED = True`: the test bed kills agents, then
    opens a leak window over the faults that follow, then restarts the fleet) keeps
    its tests in file order wherever a shuffle puts the module."""
    at: dict[Any, list[int]] = {}
    for i, item in enumerate(items):
        module = getattr(item, "module", None)
        if getattr(module, "ORDERED", False):
            at.setdefault(module, []).append(i)
    for places in at.values():
        story = sorted((items[i] for i in places), key=lambda it: it.reportinfo()[1] or 0)
        for i, item in zip(places, story, strict=True):
            items[i] = item
