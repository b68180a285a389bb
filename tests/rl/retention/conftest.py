"""Fixtures of the retention tests: a run's shared directory with its offload store, and the tiny processor."""

from retention_kit import loaded, shared, store

__all__ = ["loaded", "shared", "store"]
