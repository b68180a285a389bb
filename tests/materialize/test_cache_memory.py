"""MaterializeCache and the process's memory: evicted items' pages go back to the OS, and leases pin.

The allocator keeps the pages of freed large blocks (glibc raises its mmap threshold after large frees), so
the cache releases them after each eighth of its budget evicted; bench/engine_memory.py measures the RSS.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable
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
    monkeypatch.setattr(
        cache_module, "release_freed_memory_soon", lambda: releases.append(cache.stats.evictions)
    )
    for index in range(40):
        await cache.get(f"k{index}", lambda: Item(50))
    # 800 bytes hold 16 items: 24 evicted, 50 bytes each; a release after every 100 bytes (800 / 8).
    assert cache.stats.evictions == 24
    assert releases == list(range(100 // 50, 25, 100 // 50))
    assert TRIM_EVERY == 800 // 100


def test_memory_is_released_off_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The event loop never waits for a trim: it runs on a thread of its own."""
    ran = threading.Event()
    threads: list[threading.Thread] = []

    def release() -> None:
        threads.append(threading.current_thread())
        ran.set()

    monkeypatch.setattr(cache_module, "release_freed_memory", release)
    cache_module.release_freed_memory_soon()
    assert ran.wait(5) and threads[0] is not threading.current_thread()


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


async def test_a_waiting_miss_joins_the_same_key_once_another_lease_caches_it() -> None:
    """Budget 90, 60 pinned: two leases want the same 50-byte key. The first gets room when the pin goes; the
    second must not wait for room for an item that is cached by then (nor count it twice)."""
    cache: MaterializeCache[Item] = MaterializeCache(90)
    runs: list[str] = []
    second_done = asyncio.Event()
    release_second = asyncio.Event()

    def work(key: str, size: int) -> Callable[[], Item]:
        return lambda: runs.append(key) or Item(size)

    async def holder(ready: asyncio.Event, release: asyncio.Event) -> None:
        async with cache.lease() as lease:
            await lease.get("pinned", work("pinned", 60))
            ready.set()
            await release.wait()

    async def wants_shared(
        got: asyncio.Event, asked: asyncio.Event, release: asyncio.Event | None = None
    ) -> None:
        async with cache.lease() as lease:
            await lease.get("shared", work("shared", 50), expected_bytes=lambda: asked.set() or 50)
            got.set()
            if release is not None:
                await release.wait()  # keeps "shared" pinned: its "generation" is still running

    pinned, release_pin, first_done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    hold = asyncio.create_task(holder(pinned, release_pin))
    await pinned.wait()
    misses = cache.stats.misses
    first_asked, second_asked = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(wants_shared(first_done, first_asked, release_second))
    second = asyncio.create_task(wants_shared(second_done, second_asked))
    # A request asks its size when it checks for room; one admitted would have counted its miss by now.
    for asked in (first_asked, second_asked):
        await asyncio.wait_for(asked.wait(), 5)
        assert cache.stats.misses == misses and runs == ["pinned"]  # waiting behind the 60 pinned bytes
    release_pin.set()
    await hold
    await asyncio.wait_for(first_done.wait(), 5)
    # The first lease still holds "shared"; the second joins it at once instead of waiting for room.
    await asyncio.wait_for(second_done.wait(), 5)
    assert runs == ["pinned", "shared"]
    release_second.set()
    await asyncio.gather(first, second)


async def test_waiting_misses_are_sized_once_the_first_item_teaches_the_size() -> None:
    """Before any item, a miss's size is unknown and such misses run one at a time; the waiting ones ask their
    size again, so once the first item has taught it they are admitted together (not one by one)."""
    cache: MaterializeCache[Item] = MaterializeCache(1000)
    known: list[int] = []
    first, rest = threading.Event(), threading.Event()
    calls: list[int] = []

    def work() -> Item:
        calls.append(len(calls))
        assert (first if len(calls) == 1 else rest).wait(5)
        known.append(10)  # what RequestImages learns from its first item
        return Item(10)

    asked: set[str] = set()

    def expected(key: str) -> int | None:
        asked.add(key)  # asked at every check for room: the request is waiting for room, or admitted
        return known[0] if known else None

    async def one(key: str) -> None:
        async with cache.lease() as lease:
            await lease.get(key, work, expected_bytes=lambda: expected(key))

    async def until(condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(5):
            while not condition():
                await asyncio.sleep(0.001)

    async with cache.lease() as oldest:  # the oldest lease never waits: keep it out of the way
        await oldest.get("warm", lambda: Item(10))
        tasks = [asyncio.create_task(one(f"k{i}")) for i in range(4)]
        # An admitted request counts its miss in the same turn as its check for room.
        await until(lambda: len(asked) == 4)
        assert cache.stats.misses == 1 + 1  # "warm", then one miss of unknown size at a time
        first.set()
        # Once the first item is stored, the other three are sized and admitted together, while none of
        # their work has ended (`rest` holds it): one at a time, only one more miss would be counted.
        await until(lambda: cache.stats.misses == 2 + 3)
        assert len(cache) == 2 and not rest.is_set()
        rest.set()
        await asyncio.gather(*tasks)
        # Every reservation was given back: a miss needing every byte not pinned ("warm") gets in at once.
        async with cache.lease() as probe:
            await asyncio.wait_for(probe.get("probe", lambda: Item(990), expected_bytes=lambda: 990), 5)


async def test_a_request_that_leaves_keeps_its_room_reserved_until_its_fill_ends() -> None:
    """Budget 100, 90-byte items: a request that hangs up while its miss runs must not let the next miss in
    beside that still-running work (each hang-up would otherwise admit one more miss past the budget)."""
    cache: MaterializeCache[Item] = MaterializeCache(100)
    started = {key: threading.Event() for key in "ab"}
    finish = {key: threading.Event() for key in "ab"}

    def work(key: str) -> Callable[[], Item]:
        def run() -> Item:
            started[key].set()
            assert finish[key].wait(5)
            return Item(90)

        return run

    asks = {key: 0 for key in "ab"}

    def expected(key: str) -> int:
        asks[key] += 1  # asked at every check for room
        return 90

    async def request(key: str) -> None:
        async with cache.lease() as lease:
            await lease.get(key, work(key), expected_bytes=lambda: expected(key))

    async def until(condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(5):
            while not condition():
                await asyncio.sleep(0.01)

    async with cache.lease() as oldest:  # the oldest lease never waits: keep it out of the way
        await oldest.get("warm", lambda: Item(1))
        first = asyncio.create_task(request("a"))
        await until(started["a"].is_set)
        second = asyncio.create_task(request("b"))
        await until(lambda: asks["b"] == 1)  # b waits for room beside a's reservation
        misses = cache.stats.misses
        first.cancel()  # its client hung up; its fill runs on
        with pytest.raises(asyncio.CancelledError):
            await first
        # a's lease ended and b checked for room again; admitted, it would have counted its miss by now.
        await until(lambda: asks["b"] >= 2)
        assert cache.stats.misses == misses and not started["b"].is_set()  # still a's room
        finish["a"].set()
        await until(started["b"].is_set)  # a's fill ended and was stored: now b fits
        finish["b"].set()
        await second
        assert "b" in cache
        # Every reservation was given back: a miss needing every byte not pinned ("warm") gets in at once.
        async with cache.lease() as probe:
            await asyncio.wait_for(probe.get("probe", lambda: Item(99), expected_bytes=lambda: 99), 5)


ARENAS_PROBE = """
import ctypes, os, sys, threading
from rawmm.materialize.cache import share_one_allocator_arena
if sys.argv[1] == "shared":
    share_one_allocator_arena()
held, started = [], threading.Barrier(4)
def allocate():
    started.wait()  # all four threads allocate at once
    held.append([bytearray(1 << 20) for _ in range(4)])
threads = [threading.Thread(target=allocate) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
sys.stderr.flush()
ctypes.CDLL(None).malloc_stats()  # glibc: one "Arena N:" block per arena, on stderr
"""


@pytest.mark.parametrize(("mode", "one_arena"), [("shared", True), ("default", False)])
def test_a_server_allocates_from_one_arena_on_every_thread(mode: str, one_arena: bool) -> None:
    # Items freed on eviction are reused by the next miss whichever worker thread runs it; with an arena
    # per thread, each thread's freed pages wait for that thread (bench/engine_memory.py measures the RSS).
    out = subprocess.run(
        [sys.executable, "-c", ARENAS_PROBE, mode], capture_output=True, text=True, check=True
    )
    arenas = out.stderr.count("Arena ")
    assert (arenas == 1) == one_arena, out.stderr
