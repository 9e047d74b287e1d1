"""Benchmarks: shared setup in common, one module per section."""
