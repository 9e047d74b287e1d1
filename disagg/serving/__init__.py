"""Serving: the Python client, routing, batches, the HTTP gateway, local agents."""
