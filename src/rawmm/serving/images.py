"""A request's images: features parsed against the prompt, then materialized through the cache, concurrently.

Memory: decoding and processing an image costs a multiple of its decoded pixels at its peak
(docs/architecture.md §4 has the measured figure), so unbounded concurrency would let N large images cost N
times that. A ``PixelBudget`` admits materializations by their decoded pixels (read from the header of the
verified file, before any decode): at most ``capacity`` pixels are in flight across all requests, and an
image larger than the whole budget runs alone.

A request holds its items through a cache lease (``RequestImages.hold``) until its response: they stay in
the cache's accounting, and a miss waits for room for its expected size (patches from the ref's grid times
the bytes per patch this processor's items take), so finished items in flight are bounded by the cache
budget, not by the number of requests (docs/architecture.md §4).
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from rawmm.contract import FeatureImage, InvalidImageRef, parse_features, resolve_uri
from rawmm.materialize import (
    EngineItem,
    LoadedProcessor,
    MaterializeCache,
    cache_key,
    get_adapter,
    materialize_engine_item,
)
from rawmm.serving.engine import ImageInput


class PixelBudget:
    """At most ``capacity`` decoded pixels in flight; blocking admission for the materialize worker threads."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the pixel budget must be at least 1, got {capacity}")
        self.capacity = capacity
        self.in_flight = 0
        self._changed = threading.Condition()

    @contextmanager
    def admit(self, pixels: int) -> Iterator[None]:
        """Hold ``pixels`` of the budget (at most all of it) while the block runs; waits until they are free."""
        pixels = min(max(pixels, 0), self.capacity)
        with self._changed:
            self._changed.wait_for(lambda: self.in_flight + pixels <= self.capacity)
            self.in_flight += pixels
        try:
            yield
        finally:
            with self._changed:
                self.in_flight -= pixels
                self._changed.notify_all()


class RequestImages:
    """Turns a request's features into engine items for one processor, behind the materialize cache."""

    def __init__(
        self,
        processor: LoadedProcessor,
        *,
        roots: Sequence[Path],
        cache: MaterializeCache[EngineItem],
        max_pixels: int,
        budget: PixelBudget | None = None,
    ) -> None:
        """``budget`` defaults to one image at the pixel limit; share one budget between instances of a server."""
        self.processor = processor
        self.roots = [Path(root).resolve() for root in roots]
        self.cache = cache
        self.max_pixels = max_pixels
        self.budget = budget or PixelBudget(max_pixels)
        self._bytes_per_patch: float | None = None  # learned from the first item: fixed per processor

    def parse(self, features: Any, token_ids: Sequence[int], placeholder_token_id: int) -> list[FeatureImage]:
        """The images of a request in prompt order; every placeholder token must belong to one of them."""
        images = (
            parse_features(features, token_ids=token_ids, placeholder_token_id=placeholder_token_id)
            if features is not None
            else []
        )
        in_prompt = sum(1 for token in token_ids if token == placeholder_token_id)
        covered = sum(image.length for image in images)
        if in_prompt != covered:
            raise InvalidImageRef(
                "count_mismatch",
                f"the prompt holds {in_prompt} image placeholder tokens but the features cover {covered}: "
                "every request must carry a ref for every image in its prompt",
            )
        return images

    async def materialize(self, images: Sequence[FeatureImage]) -> list[ImageInput]:
        """Engine items for ``images``, all materialized concurrently; a fresh list per request."""
        items = await asyncio.gather(
            *(self.cache.get(self._key(image), self._work(image)) for image in images)
        )
        return [ImageInput(image, item) for image, item in zip(images, items, strict=True)]

    @asynccontextmanager
    async def hold(self, images: Sequence[FeatureImage]) -> AsyncIterator[list[ImageInput]]:
        """``materialize`` for a request that uses its items inside the block: they stay leased until it exits.

        The first image that fails fails the request at once: its siblings are cancelled (and settled before
        the lease ends), so a bad ref's 4xx never waits for room the others are waiting for."""
        async with self.cache.lease() as lease:

            async def get(image: FeatureImage) -> EngineItem:
                key = self._key(image)
                if self.cache.enabled and key not in self.cache:
                    # A miss may wait for room: a ref that cannot be materialized is refused before it waits
                    # (on the loop: a stat, no read; a thread hop would cost more than it saves).
                    self._precheck(image)
                expected = functools.partial(self._expected_bytes, image)
                return await lease.get(key, self._work(image), expected_bytes=expected)

            tasks = [asyncio.ensure_future(get(image)) for image in images]
            try:
                got = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            yield [ImageInput(image, item) for image, item in zip(images, got, strict=True)]

    def _key(self, image: FeatureImage) -> str:
        return cache_key(
            image.ref.canonical,
            engine_modality=image.modality,
            placeholder_length=image.length,
            processor_identity=self.processor.identity,
        )

    def _precheck(self, image: FeatureImage) -> None:
        """The checks of a miss that need no pixels: family, modality and fingerprint, and a file confined to
        the roots that exists (``InvalidImageRef`` with the materialization's own reasons)."""
        get_adapter(image.ref.family).check_descriptor(image.ref.descriptor(), self.processor)
        resolve_uri(image.ref.raw_image_uri, self.roots)

    def _work(self, image: FeatureImage) -> functools.partial[EngineItem]:
        return functools.partial(self._materialize, image)

    def _patches(self, image: FeatureImage) -> int:
        """Patches (rows of the item's pixels) the ref's grid claims; a malformed grid counts as none."""
        try:
            return math.prod(self.processor.family.grid_from_payload(image.ref.payload))
        except (InvalidImageRef, TypeError, ValueError):
            return 0

    def _expected_bytes(self, image: FeatureImage) -> int | None:
        """The item's size the ref's grid claims, capped at the cache budget (a claim is only a claim: an
        absurd grid then waits its turn as the oldest lease and fails its materialization's checks)."""
        if self._bytes_per_patch is None:
            return None
        cap = self.cache.max_bytes
        # Every patch takes at least one byte, so a claim of more patches than the budget has bytes is capped
        # before it meets a float (a 10**400-patch grid would overflow one).
        return min(cap, math.ceil(min(self._patches(image), cap) * self._bytes_per_patch))

    def _materialize(self, image: FeatureImage) -> EngineItem:
        item = materialize_engine_item(
            image.ref,
            placeholder_length=image.length,
            processor=self.processor,
            roots=self.roots,
            max_pixels=self.max_pixels,
            admit=self.budget.admit,
        )
        if self._bytes_per_patch is None and (patches := self._patches(image)):
            self._bytes_per_patch = item.nbytes / patches
        return item
