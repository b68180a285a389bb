"""Engine-side materialization: our read path and cache, measured side by side with the bare work.

1. Per image (1280x720 screenshot, Qwen2-VL processor): bare read + decode + processor vs our cache-miss
   path (confined read, sha256 verify, bomb check, decode, processor, grid/placeholder checks, worker
   thread) vs a cache hit. Goals: miss <= 1.15x bare; hit >= 1000x faster than a miss.
2. Multi-turn: 8 concurrent rollouts x 20 turns, one new image per turn, all rollouts sharing the first
   image, every request carrying every earlier ref. Materializations with the cache must equal the number
   of unique images exactly; wall time uncached vs cached (goal >= 10x; the bound is lookups / unique
   images = 1680 / 153 = 11.0x, reached only if hits cost nothing).
3. One request with 8 images: concurrent vs sequential materialization latency.
4. Capacity: entries per GiB for a 1280x720 screenshot (Qwen2-VL and Qwen3-VL processors), and the
   process RSS growth while filling a cache vs its byte budget.

    .venv/bin/python bench/materialize.py [--rounds 15] [--turn-image 320x192] [--budget BYTES]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from prometheus_client import REGISTRY
from screens import screenshot_png

from rawmm.contract import FeatureImage, OffloadStore, describe_stored_image, encode_ref, parse_ref
from rawmm.materialize import LoadedProcessor, MaterializeCache, load_processor, materialize_engine_item
from rawmm.serving.images import RequestImages


def processor_dir(root: Path, preset: str) -> Path:
    """A checkpoint directory holding the public preset's image processor (no weights needed)."""
    from rawmm.contract import resolve_preset
    from rawmm.materialize import qwen_image_processor

    _, config = resolve_preset(preset)
    path = root / preset
    qwen_image_processor(config, "pil").save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": preset}))
    return path


def feature(store: OffloadStore, loaded: LoadedProcessor, data: bytes, offset: int = 0) -> FeatureImage:
    stored = store.put(data)
    descriptor, layout = describe_stored_image(
        loaded.family, loaded.config, stored, fingerprint=loaded.fingerprint
    )
    return FeatureImage(
        "image", parse_ref(encode_ref(descriptor, stored.mm_hash)), offset, layout.num_placeholder_tokens
    )


@dataclass
class Clock:
    """Wall time and this process's CPU time (all threads). CPU time is what the work costs even when other
    processes crowd the machine; wall time is what a caller waits."""

    wall: float = 0.0
    cpu: float = 0.0

    def scaled(self, factor: float) -> Clock:
        return Clock(self.wall * factor, self.cpu * factor)


@contextmanager
def clock() -> Iterator[Clock]:
    result = Clock()
    wall, cpu = time.perf_counter(), time.process_time()
    yield result
    result.wall, result.cpu = time.perf_counter() - wall, time.process_time() - cpu


def median(clocks: list[Clock]) -> Clock:
    return Clock(statistics.median(c.wall for c in clocks), statistics.median(c.cpu for c in clocks))


def engine_item_work(image: FeatureImage, loaded: LoadedProcessor, store: OffloadStore) -> Callable[[], Any]:
    return lambda: materialize_engine_item(
        image.ref, placeholder_length=image.length, processor=loaded, roots=[store.root], max_pixels=10**8
    )


def bench_per_image(store: OffloadStore, loaded: LoadedProcessor, rounds: int) -> None:
    image = feature(store, loaded, screenshot_png(1))
    path = store.resolve(image.ref.raw_image_uri)

    kept: list[Any] = []

    def bare() -> None:
        decoded = Image.open(io.BytesIO(path.read_bytes())).convert("RGB")
        # Kept, as the cache keeps its items: both sides then pay for fresh pages the same way.
        kept.append(loaded.processor(images=[decoded], return_tensors="pt"))

    work = engine_item_work(image, loaded, store)

    async def measure() -> dict[str, Clock]:
        cache: MaterializeCache[Any] = MaterializeCache(2**34)
        # Both sides on a worker thread, where the engine runs this work (allocator behaviour differs by thread).
        await asyncio.to_thread(bare)  # warm up both sides (imports, allocator, worker thread)
        await cache.get("warm-up", work)
        bare_times, miss_times = [], []
        for round_ in range(rounds):  # alternate sides so machine noise hits both
            with clock() as bare_time:
                await asyncio.to_thread(bare)
            bare_times.append(bare_time)
            with clock() as miss_time:
                await cache.get(f"miss-{round_}", work)
            miss_times.append(miss_time)
        count = 20_000
        with clock() as hit_time:
            for _ in range(count):
                await cache.get("warm-up", work)
        return {"bare": median(bare_times), "miss": median(miss_times), "hit": hit_time.scaled(1 / count)}

    t = asyncio.run(measure())
    bare_t, miss_t, hit_t = t["bare"], t["miss"], t["hit"]
    print("1. per image, 1280x720 screenshot, Qwen2-VL processor (pil)  [wall | process CPU]")
    print(f"   bare read+decode+processor {bare_t.wall * 1e3:8.2f} ms | {bare_t.cpu * 1e3:8.2f} ms")
    print(f"   our miss path              {miss_t.wall * 1e3:8.2f} ms | {miss_t.cpu * 1e3:8.2f} ms")
    print(f"   cache hit                  {hit_t.wall * 1e6:8.2f} us | {hit_t.cpu * 1e6:8.2f} us")
    print(
        f"   miss/bare = {miss_t.wall / bare_t.wall:.3f} wall | {miss_t.cpu / bare_t.cpu:.3f} CPU   (goal <= 1.15)"
    )
    print(
        f"   miss/hit  = {miss_t.wall / hit_t.wall:,.0f}x wall | {miss_t.cpu / hit_t.cpu:,.0f}x CPU   (goal >= 1000x)"
    )


def materialized() -> float:
    return REGISTRY.get_sample_value("rawmm_images_materialized_total", {"side": "engine"}) or 0.0


def bench_multi_turn(store: OffloadStore, loaded: LoadedProcessor, size: tuple[int, int]) -> None:
    rollouts, turns = 8, 20
    shared = feature(store, loaded, screenshot_png(1000, *size))
    own = [
        [feature(store, loaded, screenshot_png(2000 + r * 100 + t, *size)) for t in range(1, turns)]
        for r in range(rollouts)
    ]
    unique = 1 + rollouts * (turns - 1)

    def run(cache_bytes: int) -> tuple[Clock, int]:
        images = RequestImages(
            loaded, roots=[store.root], cache=MaterializeCache(cache_bytes), max_pixels=10**8
        )
        before = materialized()

        async def rollout(r: int) -> None:
            for turn in range(1, turns + 1):
                await images.materialize([shared, *own[r][: turn - 1]])  # every request carries every ref

        async def all_rollouts() -> None:
            await asyncio.gather(*(rollout(r) for r in range(rollouts)))

        with clock() as took:
            asyncio.run(all_rollouts())
        return took, int(materialized() - before)

    run(2**34)  # warm-up: page cache, worker threads

    def best_of_three(cache_bytes: int) -> tuple[Clock, int]:
        # The least disturbed of three runs: other processes share this machine.
        return min((run(cache_bytes) for _ in range(3)), key=lambda result: result[0].wall)

    cached, cached_n = best_of_three(2**34)
    uncached, uncached_n = best_of_three(0)
    lookups = rollouts * turns * (turns + 1) // 2
    print(f"2. multi-turn: {rollouts} concurrent rollouts x {turns} turns, {size[0]}x{size[1]} screenshots")
    print(f"   lookups {lookups}, unique images {unique}")
    print(
        f"   uncached: {uncached_n:5d} materializations, {uncached.wall:6.2f} s wall | {uncached.cpu:6.2f} s CPU"
    )
    print(
        f"   cached:   {cached_n:5d} materializations, {cached.wall:6.2f} s wall | {cached.cpu:6.2f} s CPU"
        f"   (equals unique images: {cached_n == unique})"
    )
    print(f"   uncached/cached = {uncached.wall / cached.wall:.1f}x wall | {uncached.cpu / cached.cpu:.1f}x CPU"
          "   (goal >= 10x)")  # fmt: skip


def bench_one_request(store: OffloadStore, loaded: LoadedProcessor, rounds: int) -> None:
    images = [feature(store, loaded, screenshot_png(3000 + i, 640, 360)) for i in range(8)]
    request_images = RequestImages(loaded, roots=[store.root], cache=MaterializeCache(0), max_pixels=10**8)

    async def sequential() -> None:
        for image in images:
            await request_images.materialize([image])

    async def both() -> tuple[Clock, Clock]:
        await request_images.materialize(images)  # warm-up
        concurrent_times, sequential_times = [], []
        for _ in range(rounds):
            with clock() as concurrent_time:
                await request_images.materialize(images)
            concurrent_times.append(concurrent_time)
            with clock() as sequential_time:
                await sequential()
            sequential_times.append(sequential_time)
        return median(concurrent_times), median(sequential_times)

    concurrent, sequential_ = asyncio.run(both())
    print(f"3. one request with 8 images (640x360), cache off, {os.cpu_count()} CPUs")
    print(f"   sequential {sequential_.wall * 1e3:8.1f} ms, concurrent {concurrent.wall * 1e3:8.1f} ms wall"
          f"   sequential/concurrent = {sequential_.wall / concurrent.wall:.2f}x"
          f"   (CPU {sequential_.cpu * 1e3:.0f} vs {concurrent.cpu * 1e3:.0f} ms)")  # fmt: skip


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def bench_capacity(store: OffloadStore, presets: dict[str, LoadedProcessor], budget: int) -> None:
    print("4. capacity for a 1280x720 screenshot")
    shot = screenshot_png(4000)
    for name, loaded in presets.items():
        image = feature(store, loaded, shot)
        item = engine_item_work(image, loaded, store)()
        print(
            f"   {name:10s} item {item.nbytes / 2**20:6.1f} MiB -> {2**30 // item.nbytes:4d} entries per GiB"
        )
    loaded = presets["qwen2_vl"]
    cache: MaterializeCache[Any] = MaterializeCache(budget)
    fill = [
        feature(store, loaded, screenshot_png(5000 + i, 640, 360)) for i in range(3 * budget // (5 * 2**20))
    ]
    start_rss = rss_bytes()
    start_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    async def fill_cache() -> None:
        for image in fill:
            await cache.get(image.ref.mm_hash, engine_item_work(image, loaded, store))
            assert cache.bytes <= budget

    asyncio.run(fill_cache())
    grew = rss_bytes() - start_rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start_peak
    print(f"   filled a {budget / 2**20:.0f} MiB cache with {len(fill)} 640x360 items: holds {cache.bytes / 2**20:.1f} MiB"
          f" in {len(cache)} entries, {cache.stats.evictions} evictions")  # fmt: skip
    print(
        f"   RSS grew {grew / 2**20:.1f} MiB = {grew / budget:.2f}x budget; peak RSS grew {peak / 2**20:.1f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--turn-image", default="320x192", help="WxH of the multi-turn screenshots")
    parser.add_argument(
        "--budget", default=256 * 2**20, type=int, help="cache budget for the RSS check (bytes)"
    )
    args = parser.parse_args()
    size = tuple(int(v) for v in args.turn_image.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = OffloadStore(root / "offload")
        presets = {name: load_processor(processor_dir(root, name)) for name in ("qwen2_vl", "qwen3_vl")}
        bench_capacity(store, presets, args.budget)  # first: the peak RSS it reports is this process's
        bench_per_image(store, presets["qwen2_vl"], args.rounds)
        bench_multi_turn(store, presets["qwen2_vl"], size)  # type: ignore[arg-type]
        bench_one_request(store, presets["qwen2_vl"], args.rounds)


if __name__ == "__main__":
    main()
