"""A request's images: features parsed against the prompt, then materialized through the cache, concurrently.

Memory: decoding and processing an image costs about 20 bytes per decoded pixel at its peak (measured: an
8192x8192 PNG, within the default 64 Mi-pixel limit, +1.2 GiB peak RSS, 4.5 s to decode and 28 s through the
Qwen2-VL processor on a busy 2-core machine), so unbounded concurrency would let N such images cost N times that. A ``PixelBudget`` admits materializations by their decoded
pixels (read from the image header before any decode): at most ``capacity`` pixels are in flight across
all requests, and an image larger than the whole budget runs alone.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rawmm.contract import FeatureImage, InvalidImageRef, parse_features
from rawmm.materialize import (
    EngineItem,
    LoadedProcessor,
    MaterializeCache,
    cache_key,
    materialize_engine_item,
)
from rawmm.materialize.read import header_pixels
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
        items = await asyncio.gather(*(self._item(image) for image in images))
        return [ImageInput(image, item) for image, item in zip(images, items, strict=True)]

    async def _item(self, image: FeatureImage) -> EngineItem:
        key = cache_key(
            image.ref.canonical,
            engine_modality=image.modality,
            placeholder_length=image.length,
            processor_identity=self.processor.identity,
        )
        work = functools.partial(self._materialize, image)
        return await self.cache.get(key, work)

    def _materialize(self, image: FeatureImage) -> EngineItem:
        # A header that cannot be read admits nothing: materialization then fails with the right reason.
        with self.budget.admit(header_pixels(image.ref, self.roots) or 0):
            return materialize_engine_item(
                image.ref,
                placeholder_length=image.length,
                processor=self.processor,
                roots=self.roots,
                max_pixels=self.max_pixels,
            )
