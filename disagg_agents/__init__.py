"""Agents that run on the cluster's machines. Never imports `disagg`.

Importing the package does one thing: a local agent started by disagg (the
launcher set DISAGG_LIFELINE) arms its lifeline, so it dies with its parent.
mlx's BLAS is set up by `disagg_agents.runtime.fastblas`, imported only where mlx runs.
"""

from disagg_agents.runtime.lifeline import arm

arm()
