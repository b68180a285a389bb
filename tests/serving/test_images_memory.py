"""Memory of a request's items: a burst of requests holds at most the cache budget plus one request.

Real uint8 items from the torchvision backend (what vLLM's device-normalize path consumes). Live bytes are
counted independently of the cache's own accounting: every distinct item a request holds plus every item
the cache keeps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rawmm.contract import (
    FeatureImage,
    InvalidImageRef,
    OffloadStore,
    describe_stored_image,
    encode_ref,
    parse_ref,
)
from rawmm.materialize import EngineItem, LoadedProcessor, MaterializeCache, load_processor
from rawmm.serving.images import RequestImages

WAIT = 30.0


@pytest.fixture
def loaded(tiny_qwen2_vl: Path) -> LoadedProcessor:
    return load_processor(tiny_qwen2_vl, "torchvision", pixels="uint8")


def same_size_images(
    store: OffloadStore, loaded: LoadedProcessor, count: int, seed: int = 0
) -> list[FeatureImage]:
    """``count`` distinct 96x64 images, each the only image of its prompt (offset 5)."""
    out = []
    for index in range(count):
        pixels = np.random.default_rng(seed + index).integers(0, 256, (64, 96, 3), dtype=np.uint8)
        stored = store.put(Image.fromarray(pixels))
        descriptor, layout = describe_stored_image(
            loaded.family, loaded.config, stored, fingerprint=loaded.fingerprint
        )
        ref = parse_ref(encode_ref(descriptor, stored.mm_hash))
        out.append(FeatureImage("image", ref, 5, layout.num_placeholder_tokens))
    return out


def live_bytes(held: dict[int, list[EngineItem]], cache: MaterializeCache[EngineItem]) -> int:
    live = {id(item): item for items in held.values() for item in items}
    live.update({id(item): item for item, _ in cache._items.values()})
    return sum(item.nbytes for item in live.values())


async def quiescent(cache: MaterializeCache[EngineItem]) -> None:
    """Until no miss is admitted or running (every request holds its items or waits for room)."""
    deadline = time.monotonic() + WAIT
    settled = 0
    while settled < 3:
        busy = cache._inflight or cache._reserved or cache._unsized
        settled = 0 if busy else settled + 1
        assert time.monotonic() < deadline, "materializations did not settle"
        await asyncio.sleep(0 if not busy else 0.005)


@dataclasses.dataclass(frozen=True)
class Sized:
    nbytes: int


async def assert_no_room_reserved(cache: MaterializeCache[EngineItem]) -> None:
    """No room is held for a miss: one that needs the whole budget, behind an older lease that pins
    nothing, gets in at once."""
    async with cache.lease(), cache.lease() as probe:
        size = cache.max_bytes
        work = lambda: Sized(size)  # noqa: E731
        await asyncio.wait_for(probe.get("probe of the room", work, expected_bytes=lambda: size), WAIT)  # type: ignore[arg-type]


async def assert_no_lease_left(cache: MaterializeCache[EngineItem]) -> None:
    """No lease outlived its request: a new one is the oldest, which never waits for room."""
    async with cache.lease() as lease:
        size = cache.max_bytes + 1
        work = lambda: Sized(size)  # noqa: E731
        await asyncio.wait_for(lease.get("probe of the leases", work, expected_bytes=lambda: size), WAIT)  # type: ignore[arg-type]


async def budgeted(
    loaded: LoadedProcessor, store: OffloadStore, image: FeatureImage, *, items: float
) -> tuple[RequestImages, int, int]:
    """Request images over a cache whose budget is ``items`` times ``image``'s item size; with that size and budget."""
    probe = RequestImages(loaded, roots=[store.root], cache=MaterializeCache(0), max_pixels=10**8)
    size = (await probe.materialize([image]))[0].item.nbytes
    budget = int(items * size)
    cache: MaterializeCache[EngineItem] = MaterializeCache(budget)
    return RequestImages(loaded, roots=[store.root], cache=cache, max_pixels=10**8), size, budget


async def run_burst(request_images: RequestImages, requests: list[list[FeatureImage]]) -> tuple[int, int]:
    """All ``requests`` at once, each holding its items until the driver releases it (oldest first, only
    once nothing else can progress). Returns the peak live bytes and the most requests holding at once."""
    cache = request_images.cache
    held: dict[int, list[EngineItem]] = {}
    releases = [asyncio.Event() for _ in requests]
    peak, most = 0, 0

    async def request(index: int) -> None:
        nonlocal peak, most
        async with request_images.hold(requests[index]) as inputs:
            held[index] = [image.item for image in inputs]
            peak, most = max(peak, live_bytes(held, cache)), max(most, len(held))
            await releases[index].wait()
            del held[index]

    tasks = [asyncio.create_task(request(index)) for index in range(len(requests))]
    while not all(task.done() for task in tasks):
        await quiescent(cache)
        if all(task.done() for task in tasks):
            break
        assert held, "no request holds its items and none can get them: deadlock"
        releases[min(held)].set()
        await asyncio.sleep(0)
    for task in tasks:
        task.result()
    return peak, most


async def test_a_burst_of_requests_holds_at_most_the_budget_plus_one_item(
    loaded: LoadedProcessor, offload_store: OffloadStore
) -> None:
    images = same_size_images(offload_store, loaded, 12)
    request_images, size, budget = await budgeted(loaded, offload_store, images[0], items=3.5)
    peak, most = await run_burst(request_images, [[image] for image in images])
    # Without the lease's admission all twelve hold at once (12 items); with it, at most what fits.
    assert peak <= budget + size, (peak, budget, size)
    assert most >= 3  # not serialized: as many requests as fit hold their items together
    assert request_images.cache.bytes <= budget and request_images.cache.pinned_bytes == 0


async def test_a_request_larger_than_the_budget_runs_when_oldest_then_the_cache_shrinks_back(
    loaded: LoadedProcessor, offload_store: OffloadStore
) -> None:
    images = same_size_images(offload_store, loaded, 8)
    request_images, size, budget = await budgeted(loaded, offload_store, images[0], items=2.5)
    big = images[:5]  # five items: twice the budget
    peak, _ = await run_burst(request_images, [[images[5]], big, [images[6]], [images[7]]])
    assert peak <= budget + len(big) * size
    assert request_images.cache.bytes <= budget and request_images.cache.pinned_bytes == 0


async def test_a_failed_or_cancelled_request_releases_its_items(
    loaded: LoadedProcessor, offload_store: OffloadStore
) -> None:
    good, other = same_size_images(offload_store, loaded, 2)
    cache: MaterializeCache[EngineItem] = MaterializeCache(10**9)
    request_images = RequestImages(loaded, roots=[offload_store.root], cache=cache, max_pixels=10**8)
    gone = dataclasses.replace(
        good.ref.descriptor(), raw_image_uri=(offload_store.root / "gone.png").as_uri()
    )
    missing = dataclasses.replace(good, ref=parse_ref(encode_ref(gone, good.ref.mm_hash)), offset=50)
    with pytest.raises(InvalidImageRef):
        async with request_images.hold([good, missing]):
            pass
    assert cache.pinned_bytes == 0
    await quiescent(cache)  # the good item's work, started before its sibling failed, finishes
    assert len(cache) == 1 and cache.pinned_bytes == 0  # and stays cached, unpinned

    entered = asyncio.Event()

    async def hold_forever() -> None:
        async with request_images.hold([other]):
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(hold_forever())
    await asyncio.wait_for(entered.wait(), WAIT)
    assert cache.pinned_bytes > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cache.pinned_bytes == 0
    await assert_no_lease_left(cache)


async def test_an_absurd_grid_claim_is_a_client_error_not_an_overflow(
    loaded: LoadedProcessor, offload_store: OffloadStore
) -> None:
    """Once the bytes per patch are known, a ref claiming a 10**400-patch grid is estimated (capped at the
    budget), waits its turn and fails its materialization's grid check: a 4xx reason, never an OverflowError."""
    good, bad = same_size_images(offload_store, loaded, 2)
    request_images, _, budget = await budgeted(loaded, offload_store, good, items=3)
    async with request_images.hold([good]):
        pass  # the bytes per patch are learned
    absurd = FeatureImage(
        "image",
        dataclasses.replace(bad.ref, payload={"image_grid_thw": [[1, 10**200, 10**200]]}),
        5,
        bad.length,
    )
    with pytest.raises(InvalidImageRef) as caught:
        async with request_images.hold([absurd]):
            pass
    assert caught.value.reason == "grid_mismatch"
    # Not the oldest request, it is estimated: at the budget, so with nothing pinned it fits at once (an
    # estimate past the budget would wait for room forever, an uncapped one overflow).
    async with request_images.cache.lease():
        with pytest.raises(InvalidImageRef) as caught:
            async with asyncio.timeout(WAIT), request_images.hold([absurd]):
                pass
    assert caught.value.reason == "grid_mismatch"


async def test_a_failing_image_fails_its_request_without_waiting_for_its_siblings(
    loaded: LoadedProcessor, offload_store: OffloadStore
) -> None:
    """A request whose one ref is bad answers at once, though its other image waits for room behind an older
    request's held items; the waiting sibling is cancelled and the lease left clean."""
    images = same_size_images(offload_store, loaded, 3)
    request_images, _, _ = await budgeted(loaded, offload_store, images[0], items=1.5)
    missing = dataclasses.replace(images[2].ref, raw_image_uri=images[2].ref.raw_image_uri + ".gone")
    older_holds, older_release = asyncio.Event(), asyncio.Event()

    async def older() -> None:
        async with request_images.hold([images[0]]):
            older_holds.set()
            await older_release.wait()

    holder = asyncio.create_task(older())
    await older_holds.wait()
    with pytest.raises(InvalidImageRef) as caught:
        async with asyncio.timeout(WAIT):  # without the fail-fast this waits for the older request, forever
            async with request_images.hold([images[1], FeatureImage("image", missing, 5, images[2].length)]):
                pass
    assert caught.value.reason in {"missing_file", "outside_offload_root"}
    older_release.set()
    await holder
    assert request_images.cache.pinned_bytes == 0
    await assert_no_room_reserved(request_images.cache)
