"""Agents that run on the cluster's machines. Never imports `disagg`."""

from .fastblas import preload

preload()  # before anything imports mlx: see agents/fastblas.py
