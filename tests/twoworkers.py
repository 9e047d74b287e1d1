"""`pytest -n 2`, CI's command: the test bed in one worker, everything else in the
other, each in its collection order.

Why two groups and not xdist's per-test or per-file spreading: the test bed is one
story on fixed namespaces (a second worker must not start it again), and the rest
shares one pool of agent sets (two pools would hold every set twice: 23 of 24 GB
when tried). The test bed's ~230 s wait on sshd, shaped links and real deadlines as
much as they compute, so beside the rest they cost less than their length.
(xdist's own `--dist loadgroup` marks do not group under pytest 9.2: xdist 3.8
renames `item._nodeid`, which pytest no longer reads.)"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

BED = "tests/testbed/"


class TestBedBeside(LoadScopeScheduling):
    """Scopes: the test bed's modules, and everything else; one per worker."""

    __test__ = False  # a scheduler, not a test class (its name starts with Test)

    def _split_scope(self, nodeid: str) -> str:
        return "testbed" if nodeid.startswith(BED) else "rest"
