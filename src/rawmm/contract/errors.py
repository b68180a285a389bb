"""Errors of the raw-image contract.

Every way a raw image ref can be bad maps to one stable ``reason`` string (docs/architecture.md §3.5).
Servers turn an ``InvalidImageRef`` into a 400 carrying that reason; nothing about a bad ref is ever a
server error.
"""

from __future__ import annotations

REASONS: tuple[str, ...] = (
    "malformed_ref",
    "unknown_family",
    "modality_mismatch",
    "hash_mismatch",
    "outside_offload_root",
    "missing_file",
    "unreadable_file",
    "decode_error",
    "image_too_large",
    "fingerprint_mismatch",
    "grid_mismatch",
    "placeholder_mismatch",
    "count_mismatch",
)


class InvalidImageRef(ValueError):
    """A raw image ref (or the image it points to) is unusable; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown InvalidImageRef reason {reason!r}; expected one of {REASONS}")
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message

    def __reduce__(self) -> tuple[type[InvalidImageRef], tuple[str, str]]:
        # Picklable with its two fields, so it survives process pools and multiprocessing queues.
        return (type(self), (self.reason, self.message))


class ImageIngestError(ValueError):
    """An image given to the offload store (or a message part) cannot be ingested."""
