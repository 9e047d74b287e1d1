"""Serving: requests, routing, the wire client, local agents, the default model and
verification; what the Python API (`disagg.api`) is built on."""
