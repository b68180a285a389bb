"""MaterializeCache: LRU by bytes, single-flight, cancellation-safe, failures never cached, off at 0."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rawmm.materialize.cache import MaterializeCache, cache_key

WAIT = 10.0  # generous bound on every wait; a correct cache finishes in milliseconds


@dataclass(frozen=True)
class Item:
    name: str
    nbytes: int


class Work:
    """A materialization stand-in that counts its runs and can be held until released."""

    def __init__(self, name: str, nbytes: int = 10, *, hold: bool = False, fail: bool = False) -> None:
        self.name, self.nbytes, self.fail = name, nbytes, fail
        self.calls = 0
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self._lock = threading.Lock()

    def __call__(self) -> Item:
        with self._lock:
            self.calls += 1
        self.started.set()
        assert self.release.wait(WAIT), "work was never released"
        if self.fail:
            raise RuntimeError(f"{self.name} failed")
        return Item(self.name, self.nbytes)


async def wait_started(work: Work) -> None:
    assert await asyncio.to_thread(work.started.wait, WAIT), "work never started"


async def until(condition: Callable[[], bool]) -> None:
    """Until ``condition`` holds (checked between other tasks' turns), at most ``WAIT``."""
    async with asyncio.timeout(WAIT):
        while not condition():
            await asyncio.sleep(0.001)


def never() -> Callable[[], Item]:
    def run() -> Item:
        raise AssertionError("the cache ran work it should have served from memory")

    return run


async def test_hit_skips_the_work_and_returns_the_same_item() -> None:
    cache: MaterializeCache[Item] = MaterializeCache(1000)
    work = Work("a")
    first = await cache.get("a", work)
    second = await cache.get("a", never())
    assert second is first
    assert work.calls == 1
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)


async def test_lru_evicts_least_recently_used_first_and_evicted_keys_rematerialize() -> None:
    cache: MaterializeCache[Item] = MaterializeCache(30)
    for name in ("a", "b", "c"):
        await cache.get(name, Work(name, 10))
    await cache.get("a", never())  # a is now most recent; b is least recent
    await cache.get("d", Work("d", 10))
    assert cache.lru_keys() == ["c", "a", "d"]
    assert cache.stats.evictions == 1
    again = Work("b", 10)
    assert (await cache.get("b", again)).name == "b"
    assert again.calls == 1
    assert cache.lru_keys() == ["a", "d", "b"]
    assert cache.bytes == 30


async def test_a_failure_is_not_cached_and_the_next_request_succeeds() -> None:
    cache: MaterializeCache[Item] = MaterializeCache(1000)
    with pytest.raises(RuntimeError, match="failed"):
        await cache.get("a", Work("a", fail=True))
    assert "a" not in cache
    retry = Work("a")
    assert (await cache.get("a", retry)).name == "a"
    assert retry.calls == 1


async def test_concurrent_requests_for_one_new_item_do_the_work_once() -> None:
    cache: MaterializeCache[Item] = MaterializeCache(1000)
    work = Work("a", hold=True)
    requests = [asyncio.create_task(cache.get("a", work)) for _ in range(8)]
    await wait_started(work)
    work.release.set()
    results = await asyncio.wait_for(asyncio.gather(*requests), WAIT)
    assert work.calls == 1
    assert all(result is results[0] for result in results)
    assert (cache.stats.misses, cache.stats.inflight_joins) == (1, 7)


async def test_joined_requests_all_see_the_failure_then_a_retry_works() -> None:
    cache: MaterializeCache[Item] = MaterializeCache(1000)
    work = Work("a", hold=True, fail=True)
    requests = [asyncio.create_task(cache.get("a", work)) for _ in range(3)]
    await wait_started(work)
    work.release.set()
    outcomes = await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), WAIT)
    assert all(isinstance(outcome, RuntimeError) for outcome in outcomes)
    assert work.calls == 1
    assert (await cache.get("a", Work("a"))).name == "a"


async def test_cancelling_the_first_requester_does_not_fail_the_others() -> None:
    cache: MaterializeCache[Item] = MaterializeCache(1000)
    work = Work("a", hold=True)
    first = asyncio.create_task(cache.get("a", work))
    await wait_started(work)
    second = asyncio.create_task(cache.get("a", never()))
    await until(lambda: cache.stats.inflight_joins == 1)  # the second request has joined the flight
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    work.release.set()
    assert (await asyncio.wait_for(second, WAIT)).name == "a"
    assert "a" in cache
    assert work.calls == 1


async def test_in_flight_work_survives_gc_after_every_requester_left() -> None:
    cache: MaterializeCache[Item] = MaterializeCache(1000)
    work = Work("a", hold=True)
    requester = asyncio.create_task(cache.get("a", work))
    await wait_started(work)
    requester.cancel()
    with pytest.raises(asyncio.CancelledError):
        await requester
    del requester
    gc.collect()
    work.release.set()
    # Joins the flight if it is still running, hits if it finished: either way, no second run.
    assert (await asyncio.wait_for(cache.get("a", never()), WAIT)).name == "a"
    assert work.calls == 1
    assert "a" in cache


async def test_an_item_larger_than_the_budget_is_returned_but_not_cached() -> None:
    cache: MaterializeCache[Item] = MaterializeCache(100)
    await cache.get("small", Work("small", 60))
    big = await cache.get("big", Work("big", 101))
    assert big.name == "big"
    assert "big" not in cache
    assert cache.lru_keys() == ["small"]  # the big item did not churn the cache either
    assert cache.bytes == 60


async def test_size_zero_gives_the_same_results_with_no_bookkeeping() -> None:
    off: MaterializeCache[Item] = MaterializeCache(0)
    on: MaterializeCache[Item] = MaterializeCache(1000)
    work_off, work_on = Work("a"), Work("a")
    results_off = [await off.get("a", work_off) for _ in range(3)]
    results_on = [await on.get("a", work_on) for _ in range(3)]
    assert results_off == results_on
    assert work_off.calls == 3 and work_on.calls == 1
    assert len(off) == 0 and off.bytes == 0
    assert off.stats.lookups == 0


async def test_size_zero_runs_concurrent_requests_independently() -> None:
    cache: MaterializeCache[Item] = MaterializeCache(0)
    work = Work("a")
    await asyncio.gather(*(cache.get("a", work) for _ in range(4)))
    assert work.calls == 4


@settings(max_examples=60, deadline=None)
@given(
    budget=st.integers(min_value=1, max_value=200),
    requests=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 120)), min_size=1, max_size=40),
)
def test_bytes_held_never_exceed_the_budget(budget: int, requests: list[tuple[int, int]]) -> None:
    sizes = {}  # one size per key: keys are content-addressed, so a key always yields the same item

    async def run() -> None:
        cache: MaterializeCache[Item] = MaterializeCache(budget)
        for key, size in requests:
            size = sizes.setdefault(key, size)
            item = await cache.get(str(key), lambda k=key, s=size: Item(str(k), s))
            assert item.nbytes == size
            assert cache.bytes <= budget
            assert cache.bytes == sum(sizes[int(k)] for k in cache.lru_keys())

    asyncio.run(run())


def test_cache_key_covers_ref_modality_placeholder_length_and_processor() -> None:
    base = {"engine_modality": "image", "placeholder_length": 4, "processor_identity": "p"}
    key = cache_key("mmraw:{}", **base)
    assert key == cache_key("mmraw:{}", **base)
    variants = [
        cache_key("mmraw:{ }", **base),
        cache_key("mmraw:{}", **{**base, "engine_modality": "vision_chunk"}),
        cache_key("mmraw:{}", **{**base, "placeholder_length": 5}),
        cache_key("mmraw:{}", **{**base, "processor_identity": "q"}),
    ]
    assert len({key, *variants}) == 5


def test_negative_budget_is_rejected() -> None:
    with pytest.raises(ValueError, match="negative"):
        MaterializeCache(-1)


async def test_a_summary_line_is_logged_every_n_lookups(caplog: pytest.LogCaptureFixture) -> None:
    cache: MaterializeCache[Item] = MaterializeCache(1000, log_every=3)
    with caplog.at_level(logging.INFO, logger="rawmm.materialize.cache"):
        for _ in range(2):
            await cache.get("a", Work("a"))
        assert not caplog.records
        await cache.get("a", Work("a"))
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage() == (
        "materialize cache: hits=2 misses=1 inflight_joins=0 hit_rate=66.7% bytes=10/1000 entries=1 evictions=0"
    )
