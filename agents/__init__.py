"""Agents that run on the cluster's machines. Never imports `disagg`."""
