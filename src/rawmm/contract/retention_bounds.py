"""The time bounds of the offload store's GC protocol (`rawmm.contract.gc` has the argument).

Dependency-free, like ``rawmm.config.duration``: the store and the collector use them, and the run config checks
``offload.retention.older_than`` against them without importing the contract (the operator reads it too).
"""

from __future__ import annotations

# A stored file last used longer ago than this is reused only under its directory's shared GC lock; a
# younger one is touched lock-free.
REUSE_UNLOCKED_AGE_S = 300.0
# So a pass never takes a file a writer may still touch lock-free; the margin absorbs clock skew and stalls.
MIN_OLDER_THAN_S = 2 * REUSE_UNLOCKED_AGE_S


def check_older_than(seconds: float) -> None:
    """Refuse a bound under MIN_OLDER_THAN_S."""
    if seconds < MIN_OLDER_THAN_S:
        raise ValueError(
            f"older-than must be at least {MIN_OLDER_THAN_S:.0f}s: images used within the last "
            f"{REUSE_UNLOCKED_AGE_S:.0f}s are reused without a lock and must never be collectable"
        )
