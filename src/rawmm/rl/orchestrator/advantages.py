"""Group-normalized advantages (GRPO): each rollout's reward against its group's mean and spread."""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) over one group. A group whose rewards are all equal learns nothing
    from it (all zeros), and so does a group of one."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]
