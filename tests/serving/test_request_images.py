"""RequestImages: a request's images materialize concurrently, through the cache, keyed per processor."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from prometheus_client import REGISTRY

from rawmm.contract import (
    FeatureImage,
    InvalidImageRef,
    OffloadStore,
    describe_stored_image,
    encode_ref,
    parse_ref,
)
from rawmm.materialize import MaterializeCache, load_processor
from rawmm.materialize.adapters import FamilyAdapter
from rawmm.materialize.read import OpenedImage
from rawmm.materialize.workers import usable_cpus
from rawmm.serving import images as images_module
from rawmm.serving.images import PixelBudget, RequestImages

WAIT = 10.0


def materialize_seconds() -> float:
    return REGISTRY.get_sample_value("rawmm_materialize_seconds_sum", {"side": "engine"}) or 0.0


def feature_images(store: OffloadStore, loaded, count: int) -> list[FeatureImage]:
    """``count`` distinct images laid out back to back as a renderer would place them."""
    out, offset = [], 5
    for seed in range(count):
        pixels = np.random.default_rng(seed).integers(0, 256, (40 + seed, 60, 3), dtype=np.uint8)
        stored = store.put(Image.fromarray(pixels))
        descriptor, layout = describe_stored_image(
            loaded.family, loaded.config, stored, fingerprint=loaded.fingerprint
        )
        ref = parse_ref(encode_ref(descriptor, stored.mm_hash))
        out.append(FeatureImage("image", ref, offset, layout.num_placeholder_tokens))
        offset += layout.num_placeholder_tokens + 3
    return out


async def test_the_images_of_one_request_materialize_concurrently(
    tiny_qwen2_vl: Path, offload_store: OffloadStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As many at once as there are miss threads (one per usable CPU), the rest as threads free up."""
    threads, count = usable_cpus(), usable_cpus() + 2
    lock, running, peak, all_busy = threading.Lock(), [0], [0], threading.Event()
    real = images_module.materialize_engine_item

    def gated(*args, **kwargs):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            if running[0] == threads:
                all_busy.set()
        try:
            assert all_busy.wait(WAIT)  # fails unless every miss thread runs one at once
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(images_module, "materialize_engine_item", gated)
    loaded = load_processor(tiny_qwen2_vl)
    request_images = RequestImages(
        loaded, roots=[offload_store.root], cache=MaterializeCache(0), max_pixels=10**8
    )
    images = feature_images(offload_store, loaded, count)
    inputs = await request_images.materialize(images)
    assert [i.feature for i in inputs] == images and peak[0] == threads
    assert [i.item.tensors["image_grid_thw"].tolist() for i in inputs] == [
        image.ref.payload["image_grid_thw"][0] for image in images
    ]


async def test_each_request_gets_a_fresh_list_of_the_shared_items(
    tiny_qwen2_vl: Path, offload_store: OffloadStore
) -> None:
    loaded = load_processor(tiny_qwen2_vl)
    request_images = RequestImages(
        loaded, roots=[offload_store.root], cache=MaterializeCache(10**9), max_pixels=10**8
    )
    images = feature_images(offload_store, loaded, 2)
    first = await request_images.materialize(images)
    second = await request_images.materialize(images)
    assert first is not second
    assert all(a.item is b.item for a, b in zip(first, second, strict=True))
    assert request_images.cache.stats.misses == 2 and request_images.cache.stats.hits == 2


async def test_processors_with_different_identities_never_share_an_entry(
    tiny_qwen2_vl: Path, offload_store: OffloadStore
) -> None:
    cache = MaterializeCache(10**9)
    pil, tv = load_processor(tiny_qwen2_vl, "pil"), load_processor(tiny_qwen2_vl, "torchvision")
    images = feature_images(offload_store, pil, 1)
    # No fingerprint: both processors accept the refs, so only the key keeps their items apart.
    unfingerprinted = [replace(image, ref=replace(image.ref, fingerprint=None)) for image in images]
    for loaded in (pil, tv):
        await RequestImages(loaded, roots=[offload_store.root], cache=cache, max_pixels=10**8).materialize(
            unfingerprinted
        )
    assert cache.stats.misses == 2 and cache.stats.hits == 0


def test_every_placeholder_token_must_belong_to_an_image(
    tiny_qwen2_vl: Path, offload_store: OffloadStore
) -> None:
    loaded = load_processor(tiny_qwen2_vl)
    request_images = RequestImages(
        loaded, roots=[offload_store.root], cache=MaterializeCache(0), max_pixels=10**8
    )
    pad = 99
    with pytest.raises(InvalidImageRef) as excinfo:
        request_images.parse(None, [1, pad, pad, 2], pad)
    assert excinfo.value.reason == "count_mismatch"
    assert request_images.parse(None, [1, 2, 3], pad) == []


# --- the memory bound: admission by decoded pixels in flight -----------------------------------------------


def test_the_pixel_budget_holds_back_what_would_exceed_it() -> None:
    budget = PixelBudget(100)
    release_a, a_entered, b_entered = threading.Event(), threading.Event(), threading.Event()

    def hold(pixels: int, entered: threading.Event, release: threading.Event | None = None) -> None:
        with budget.admit(pixels):
            entered.set()
            if release is not None:
                release.wait(WAIT)

    a = threading.Thread(target=hold, args=(60, a_entered, release_a))
    a.start()
    assert a_entered.wait(WAIT)
    b = threading.Thread(target=hold, args=(60, b_entered))
    b.start()
    assert not b_entered.wait(0.3)  # 60 + 60 > 100: B waits for A
    release_a.set()
    assert b_entered.wait(WAIT)
    a.join(WAIT), b.join(WAIT)
    assert budget.in_flight == 0
    with budget.admit(10**9):  # larger than the whole budget: admitted alone, never refused
        assert budget.in_flight == 100


async def test_concurrent_images_never_exceed_the_pixels_in_flight(
    tiny_qwen2_vl: Path, offload_store: OffloadStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From decoding to the item, an image's pixels stay within the budget (the file is read first: its
    header gives the count)."""
    loaded = load_processor(tiny_qwen2_vl)
    images = feature_images(offload_store, loaded, 6)
    pixels = []
    for image in images:
        with Image.open(offload_store.resolve(image.ref.raw_image_uri)) as header:
            pixels.append(header.width * header.height)
    capacity = max(pixels)  # one at a time: any two exceed it (there may be as few as two miss threads)
    assert sum(sorted(pixels)[:2]) > capacity
    lock, active, peaks = threading.Lock(), [0], []
    real_decode, real_process = OpenedImage.decode, FamilyAdapter.materialize_for_engine

    def decode(opened: OpenedImage):
        with lock:
            active[0] += opened.pixels
            peaks.append(active[0])
        threading.Event().wait(0.05)  # long enough for unadmitted work to overlap (not for correctness)
        return real_decode(opened)

    def process(adapter, image, *args):
        try:
            return real_process(adapter, image, *args)
        finally:
            with lock:
                active[0] -= image.shape[0] * image.shape[1]

    monkeypatch.setattr(OpenedImage, "decode", decode)
    monkeypatch.setattr(FamilyAdapter, "materialize_for_engine", process)
    request_images = RequestImages(
        loaded,
        roots=[offload_store.root],
        cache=MaterializeCache(0),
        max_pixels=10**8,
        budget=PixelBudget(capacity),
    )
    inputs = await request_images.materialize(images)
    assert len(inputs) == 6 and len(peaks) == 6
    assert max(peaks) <= capacity, (peaks, capacity)


async def test_an_offload_root_given_through_a_symlink_is_read(
    tiny_qwen2_vl: Path, offload_store: OffloadStore, tmp_path: Path
) -> None:
    # The engine resolves its roots once; the read confines to resolved roots only.
    link = tmp_path / "offload-link"
    link.symlink_to(offload_store.root, target_is_directory=True)
    loaded = load_processor(tiny_qwen2_vl)
    images = feature_images(offload_store, loaded, 1)
    request_images = RequestImages(loaded, roots=[link], cache=MaterializeCache(0), max_pixels=10**8)
    [got] = await request_images.materialize(images)
    assert got.item.tensors["image_grid_thw"].tolist() == images[0].ref.payload["image_grid_thw"][0]


async def test_waiting_for_the_pixel_budget_is_not_materialization_time(
    tiny_qwen2_vl: Path, offload_store: OffloadStore
) -> None:
    loaded = load_processor(tiny_qwen2_vl)
    [image] = feature_images(offload_store, loaded, 1)
    request_images = RequestImages(
        loaded, roots=[offload_store.root], cache=MaterializeCache(0), max_pixels=10**8
    )
    budget = PixelBudget(1)
    held, entered = threading.Event(), threading.Event()

    def hold_the_budget() -> None:
        with budget.admit(1):
            held.set()
            entered.wait(WAIT)

    holder = threading.Thread(target=hold_the_budget)
    holder.start()
    assert held.wait(WAIT)
    request_images.budget = budget
    before = materialize_seconds()
    materializing = asyncio.ensure_future(request_images.materialize([image]))
    waited = 0.5
    await asyncio.sleep(waited)  # the miss waits for the holder this long (a floor, not a race)
    entered.set()
    await materializing
    holder.join(WAIT)
    assert 0 < materialize_seconds() - before < waited
