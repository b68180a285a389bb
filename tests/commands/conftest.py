"""Fixtures of the command tests: the GC tests' shared directory, offload store and tiny processor."""

from retention_kit import loaded, shared, store

__all__ = ["loaded", "shared", "store"]
