"""The inference-side materialize cache (docs/architecture.md §4): byte-bounded LRU, single-flight, off
at size 0.

A multi-turn rollout re-sends every earlier image on every turn; without this cache each request would
re-read, re-hash, re-decode and re-process all of them. Keys are content-addressed (the whole ref is in
the key), so an entry can only go cold, never stale: eviction is invisible except as a later miss.

Concurrency model: every mutation happens on the event-loop thread; only the materialization itself runs
in a worker thread. A miss starts one task that the cache holds strongly until it finishes; requesters
await it through ``asyncio.shield`` so a cancelled (disconnected) requester never cancels the work that
other requesters share. Failures are never cached: the task's exception reaches every requester that
joined it, and the next request starts afresh.

Memory (docs/architecture.md §4): a request holds its items through a ``Lease``; a leased item is pinned
(never evicted) and always stored, so every item a request holds is in ``bytes``. A miss reserves its
expected size and starts only while the pinned bytes plus the reservations fit the budget, so the bytes
held overshoot the budget by at most the oldest lease's items (it never waits, so something always
progresses) and one miss of unknown size at a time.

Evicting must also shrink the process: glibc raises its mmap threshold after freeing a large block, so
later items live on the heap and in per-thread arenas, whose freed pages it keeps. After each eighth of the
budget evicted, the cache hands the free pages back (``malloc_trim``) on a thread of its own, because one
trim of a large heap is too long to stall the event loop.

A server also keeps all its threads on one allocator arena (``share_one_allocator_arena``): items are
allocated on whichever worker thread missed and freed on eviction, and glibc gives each thread an arena of
its own, whose freed pages only that thread's later allocations reuse, so until the next trim the others
grow anew. The resulting memory against the budget is measured by bench/engine_memory.py
(docs/architecture.md §4).
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import logging
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from rawmm.materialize import metrics
from rawmm.materialize.workers import run_on_miss_thread

log = logging.getLogger(__name__)

T = TypeVar("T")

TRIM_EVERY = 8  # release freed memory after evicting 1/TRIM_EVERY of the budget
_libc = ctypes.CDLL(None)
_malloc_trim = getattr(_libc, "malloc_trim", None)  # glibc only
_mallopt = getattr(_libc, "mallopt", None)
_M_ARENA_MAX = -8  # glibc's mallopt parameter


def share_one_allocator_arena() -> None:
    """Have threads created from now on allocate from glibc's main arena (a no-op elsewhere): call it before
    the server starts its worker threads. Only this process: passing it on to vLLM's engine core
    (``MALLOC_ARENA_MAX``) left the engine core's growth as it was and raised the API server's peak
    (bench/engine_memory.py)."""
    if _mallopt is not None:
        _mallopt(_M_ARENA_MAX, 1)


def release_freed_memory() -> None:
    """Return the allocator's free pages to the OS (glibc; a no-op elsewhere)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def release_freed_memory_soon() -> None:
    """``release_freed_memory`` on a short-lived thread: on a large heap one trim takes tens of milliseconds,
    which the event loop must not stall for."""
    threading.Thread(target=release_freed_memory, name="rawmm-release-memory", daemon=True).start()


def cache_key(ref: str, *, engine_modality: str, placeholder_length: int, processor_identity: str) -> str:
    """Digest of everything that decides what a materialization produces.

    The placeholder length is part of the key so that a ref arriving with a different claimed length misses
    and meets the adapter's check instead of being served an item that never passed it.
    """
    material = json.dumps(
        [ref, engine_modality, placeholder_length, processor_identity], separators=(",", ":")
    )
    return hashlib.sha256(material.encode()).hexdigest()


def _nbytes(item: object) -> int:
    return int(item.nbytes)  # type: ignore[attr-defined]


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    inflight_joins: int = 0
    evictions: int = 0

    @property
    def lookups(self) -> int:
        return self.hits + self.misses + self.inflight_joins


class MaterializeCache(Generic[T]):
    """Byte-bounded LRU of finished, immutable items with single-flight misses.

    Misses run on the process's miss threads (``workers.materialize_workers``). ``max_bytes == 0`` turns
    the cache off: every call runs the work on one of them, with no lookup, no single-flight and no
    statistics. Unleased, bytes held never exceed ``max_bytes`` and an item larger
    than the whole budget is returned to its requesters but not kept; leased items are kept regardless
    (see ``lease``). Use from the event loop only.
    """

    def __init__(
        self, max_bytes: int, *, size_of: Callable[[T], int] = _nbytes, log_every: int = 1000
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"cache size must not be negative, got {max_bytes}")
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self._size_of = size_of
        self._log_every = log_every
        self._items: OrderedDict[str, tuple[T, int]] = OrderedDict()
        self._inflight: dict[str, asyncio.Task[T]] = {}
        self._bytes = 0
        self._pins: Counter[str] = Counter()  # key -> leases holding it
        self._leases: deque[Lease[T]] = deque()  # oldest first
        self._reserved = 0  # expected bytes of leased misses not yet stored
        self._unsized = 0  # leased misses of unknown size not yet stored
        self._room: asyncio.Condition | None = None
        self._notifying: set[asyncio.Task[None]] = set()  # referenced until done (asyncio keeps weak refs)
        self._evicted_since_trim = 0
        if self.enabled:
            metrics.CACHE_CAPACITY_BYTES.set(max_bytes)
            self._publish_sizes()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    @property
    def pinned_bytes(self) -> int:
        return sum(size for key, (_, size) in self._items.items() if self._pins[key])

    def lru_keys(self) -> list[str]:
        """Cached keys, least recently used first."""
        return list(self._items)

    async def get(self, key: str, work: Callable[[], T]) -> T:
        """Return the item for ``key``, running ``work`` in a worker thread at most once at a time per key."""
        if not self.enabled:
            return await run_on_miss_thread(work)
        cached = self._items.get(key)
        if cached is not None:
            self._items.move_to_end(key)
            self.stats.hits += 1
            metrics.CACHE_HITS.inc()
            self._maybe_log()
            return cached[0]
        task = self._inflight.get(key)
        if task is None:
            self.stats.misses += 1
            metrics.CACHE_MISSES.inc()
            task = asyncio.get_running_loop().create_task(self._fill(key, work))
            self._inflight[key] = task
            # Retrieve the exception even if every requester left, so asyncio does not log it as lost.
            task.add_done_callback(lambda done: done.cancelled() or done.exception())
        else:
            self.stats.inflight_joins += 1
            metrics.CACHE_INFLIGHT_JOINS.inc()
        self._maybe_log()
        return await asyncio.shield(task)

    async def _fill(self, key: str, work: Callable[[], T]) -> T:
        try:
            item = await run_on_miss_thread(work)
            self._store(key, item)
            return item
        finally:
            del self._inflight[key]

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[Lease[T]]:
        """Items got through the lease stay pinned (held and accounted) until the block exits."""
        lease = Lease(self)
        self._leases.append(lease)
        try:
            yield lease
        finally:
            for key in lease.keys:
                self._pins[key] -= 1
                if not self._pins[key]:
                    del self._pins[key]
            self._leases.remove(lease)
            self._evict_down_to(self.max_bytes)
            self._publish_sizes()
            await self._notify_room()

    async def _reserve(
        self, lease: Lease[T], key: str, estimate: Callable[[], int | None]
    ) -> tuple[bool, int | None]:
        """Wait until a miss of ``key`` fits beside what is held and reserved, then reserve its expected bytes.

        ``estimate`` is asked again at every check (the bytes per patch may be learned meanwhile; ``None``:
        unknown). Returns ``(False, None)``, reserving nothing, when another lease cached or started ``key``
        meanwhile: the caller then joins that work for free.
        """
        if self._room is None:
            self._room = asyncio.Condition()

        def taken() -> bool:
            return key in self._items or key in self._inflight

        def fits() -> bool:
            # Unpinned items do not count: the store evicts them to make room.
            if taken() or self._leases[0] is lease:
                return True
            expected = estimate()
            held = self.pinned_bytes + self._reserved
            if expected is None:
                return self._unsized == 0 and held < self.max_bytes
            return self._unsized == 0 and held + expected <= self.max_bytes

        async with self._room:
            await self._room.wait_for(fits)
        if taken():
            return False, None
        expected = estimate()
        if expected is None:
            self._unsized += 1
        else:
            self._reserved += expected
        return True, expected

    def _settle(self, expected: int | None) -> None:
        if expected is None:
            self._unsized -= 1
        else:
            self._reserved -= expected

    def _settle_soon(self, expected: int | None) -> None:
        """Settle the reservation of a fill whose requester left, once the fill has ended: its bytes stay
        reserved while its thread still works, or every hang-up would admit one more miss past the budget."""
        self._settle(expected)
        notify = asyncio.get_running_loop().create_task(self._notify_room())
        self._notifying.add(notify)
        notify.add_done_callback(self._notifying.discard)

    async def _notify_room(self) -> None:
        if self._room is not None:
            async with self._room:
                self._room.notify_all()

    def _store(self, key: str, item: T) -> None:
        size = self._size_of(item)
        # A leased item is kept even over budget: its lease holds it anyway, and this way it is counted.
        pinned = self._pins[key] > 0
        if not pinned and size > self.max_bytes:
            log.debug("materialize cache: item of %d bytes exceeds the %d-byte budget", size, self.max_bytes)
            return
        self._evict_down_to(self.max_bytes - size)
        if self._bytes + size > self.max_bytes and not pinned:
            log.debug(
                "materialize cache: no room for an item of %d bytes (budget %d, %d pinned); not cached",
                size,
                self.max_bytes,
                self.pinned_bytes,
            )
            return
        self._items[key] = (item, size)
        self._bytes += size
        self._publish_sizes()

    def _evict_down_to(self, limit: int) -> None:
        """Evict unpinned items, least recently used first, until at most ``limit`` bytes are held."""
        if self._bytes <= limit:
            return
        for key in [key for key in self._items if not self._pins[key]]:
            if self._bytes <= limit:
                break
            _, evicted_size = self._items.pop(key)
            self._bytes -= evicted_size
            self.stats.evictions += 1
            metrics.CACHE_EVICTIONS.inc()
            self._evicted_since_trim += evicted_size
        if self._evicted_since_trim * TRIM_EVERY >= self.max_bytes:
            self._evicted_since_trim = 0
            release_freed_memory_soon()

    def _publish_sizes(self) -> None:
        metrics.CACHE_BYTES.set(self._bytes)
        metrics.CACHE_ENTRIES.set(len(self._items))

    def summary(self) -> str:
        s = self.stats
        hit_rate = 100.0 * s.hits / s.lookups if s.lookups else 0.0
        return (
            f"materialize cache: hits={s.hits} misses={s.misses} inflight_joins={s.inflight_joins} "
            f"hit_rate={hit_rate:.1f}% bytes={self._bytes}/{self.max_bytes} entries={len(self._items)} "
            f"evictions={s.evictions}"
        )

    def _maybe_log(self) -> None:
        if self.stats.lookups % self._log_every == 0:
            log.info(self.summary())


class Lease(Generic[T]):
    """One request's hold on its items (``MaterializeCache.lease``)."""

    def __init__(self, cache: MaterializeCache[T]) -> None:
        self._cache = cache
        self.keys: list[str] = []

    async def get(
        self, key: str, work: Callable[[], T], *, expected_bytes: Callable[[], int | None] = lambda: None
    ) -> T:
        """``MaterializeCache.get``, pinned for the lease; a miss first waits for room for ``expected_bytes()``
        (asked again while it waits), unless another lease caches or starts the same key meanwhile."""
        cache = self._cache
        if not cache.enabled:
            return await cache.get(key, work)
        cache._pins[key] += 1
        self.keys.append(key)
        if key in cache or key in cache._inflight:
            return await cache.get(key, work)
        reserved, expected = await cache._reserve(self, key, expected_bytes)
        if not reserved:
            return await cache.get(key, work)
        try:
            return await cache.get(key, work)
        finally:
            fill = cache._inflight.get(key)
            if fill is not None:  # the request left (cancelled) while its fill runs on in its thread
                fill.add_done_callback(lambda _: cache._settle_soon(expected))
            else:
                cache._settle(expected)
                await cache._notify_room()
