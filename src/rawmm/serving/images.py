"""A request's images: features parsed against the prompt, then materialized through the cache, concurrently."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
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
from rawmm.serving.engine import ImageInput


class RequestImages:
    """Turns a request's features into engine items for one processor, behind the materialize cache."""

    def __init__(
        self,
        processor: LoadedProcessor,
        *,
        roots: Sequence[Path],
        cache: MaterializeCache[EngineItem],
        max_pixels: int,
    ) -> None:
        self.processor = processor
        self.roots = [Path(root).resolve() for root in roots]
        self.cache = cache
        self.max_pixels = max_pixels

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
        work = functools.partial(
            materialize_engine_item,
            image.ref,
            placeholder_length=image.length,
            processor=self.processor,
            roots=self.roots,
            max_pixels=self.max_pixels,
        )
        return await self.cache.get(key, work)
