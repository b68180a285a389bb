"""MaterializeCache and the process's memory: evicted items' pages go back to the OS, and leases pin.

The allocator keeps the pages of freed large blocks (glibc raises its mmap threshold after large frees), so
the cache releases them after each eighth of its budget evicted; bench/engine_memory.py measures the RSS.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rawmm.materialize import cache as cache_module
from rawmm.materialize.cache import TRIM_EVERY, MaterializeCache


@dataclass(frozen=True)
class Item:
    nbytes: int


async def test_evicting_an_eighth_of_the_budget_releases_freed_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    releases: list[int] = []
    cache: MaterializeCache[Item] = MaterializeCache(800)
    monkeypatch.setattr(cache_module, "release_freed_memory", lambda: releases.append(cache.stats.evictions))
    for index in range(40):
        await cache.get(f"k{index}", lambda: Item(50))
    # 800 bytes hold 16 items: 24 evicted, 50 bytes each; a release after every 100 bytes (800 / 8).
    assert cache.stats.evictions == 24
    assert releases == list(range(100 // 50, 25, 100 // 50))
    assert TRIM_EVERY == 800 // 100


async def test_a_leased_item_is_never_evicted_and_is_counted_over_budget() -> None:
    cache: MaterializeCache[Item] = MaterializeCache(100)
    async with cache.lease() as lease:
        await lease.get("held", lambda: Item(60))
        for index in range(5):
            await cache.get(f"other{index}", lambda: Item(30))
        assert "held" in cache and cache.pinned_bytes == 60
        big = await lease.get("big", lambda: Item(150))  # larger than the budget: kept while leased
        assert big.nbytes == 150 and cache.bytes == 210
    assert "big" not in cache and cache.bytes <= 100 and cache.pinned_bytes == 0
