"""`pytest -n 2` splits the suite in two: the test bed's modules, and the rest."""

from __future__ import annotations

from tests.twoworkers import TestBedBeside


def test_the_test_bed_is_one_scope_and_everything_else_the_other() -> None:
    split = TestBedBeside._split_scope
    bed = ["tests/testbed/test_fleet.py::test_x", "tests/testbed/test_reliability.py::t[a]"]
    rest = [
        "tests/test_cli.py::test_y",
        "tests/hostile/test_z.py::t",
        "tests/test_testbed_doc.py::t",
    ]
    assert {split(None, n) for n in bed} == {"testbed"}  # type: ignore[arg-type]
    assert {split(None, n) for n in rest} == {"rest"}  # type: ignore[arg-type]
