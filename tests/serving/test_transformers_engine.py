"""The transformers engine on uint8 items: a quarter of the cached bytes, the same generation bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rawmm.contract import FeatureImage, OffloadStore, describe_stored_image, encode_ref, parse_ref
from rawmm.contract.engine_api import Sampling
from rawmm.materialize import MaterializeCache, load_processor
from rawmm.serving.engine import ImageInput
from rawmm.serving.images import RequestImages
from rawmm.serving.transformers_engine import TransformersEngine


async def request_for(
    engine: TransformersEngine, store: OffloadStore, images: list[Image.Image]
) -> tuple[list[int], list[ImageInput]]:
    """A prompt of ``images`` (each between two text tokens) and its items, made with the engine's processor."""
    loaded = engine.processor
    features, token_ids = [], [5]
    for image in images:
        stored = store.put(image)
        descriptor, layout = describe_stored_image(
            loaded.family, loaded.config, stored, fingerprint=loaded.fingerprint
        )
        ref = parse_ref(encode_ref(descriptor, stored.mm_hash))
        features.append(FeatureImage("image", ref, len(token_ids), layout.num_placeholder_tokens))
        token_ids += [engine.placeholder_token_id] * layout.num_placeholder_tokens + [6]
    request_images = RequestImages(loaded, roots=[store.root], cache=MaterializeCache(0), max_pixels=10**8)
    return token_ids, await request_images.materialize(features)


@pytest.mark.slow
async def test_uint8_items_generate_exactly_what_normalized_items_do(
    tiny_qwen2_vl: Path, offload_store: OffloadStore
) -> None:
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (56 + 8 * i, 84, 3), dtype=np.uint8)) for i in range(2)]
    sampling = Sampling(max_tokens=6, temperature=1.0, seed=7)
    generations, item_bytes = {}, {}
    for pixels in ("normalized", "uint8"):
        engine = TransformersEngine(str(tiny_qwen2_vl), load_processor(tiny_qwen2_vl, pixels=pixels))
        try:
            token_ids, inputs = await request_for(engine, offload_store, images)
            item_bytes[pixels] = sum(i.item.tensors["pixel_values"].nbytes for i in inputs)
            generations[pixels] = await engine.generate(token_ids, inputs, sampling)
        finally:
            await engine.close()
    assert item_bytes["normalized"] == 4 * item_bytes["uint8"]
    normalized, raw = generations["normalized"], generations["uint8"]
    assert raw.token_ids == normalized.token_ids and raw.logprobs == normalized.logprobs


@pytest.mark.slow
async def test_a_cancelled_generation_stops_decoding_before_the_call_returns(tiny_qwen2_vl: Path) -> None:
    import asyncio
    import time

    engine = TransformersEngine(str(tiny_qwen2_vl), load_processor(tiny_qwen2_vl, pixels="uint8"))
    engine.eos_token_ids = set()  # every generation runs to max_tokens unless stopped
    forwards = 0

    def count(*_: object) -> None:
        nonlocal forwards
        forwards += 1

    engine.model.register_forward_hook(count)
    max_tokens = 2000
    try:
        endless = asyncio.ensure_future(engine.generate([5, 6, 7], [], Sampling(max_tokens=max_tokens)))
        deadline = time.monotonic() + 60
        while forwards < 5:
            assert time.monotonic() < deadline, "decoding did not start within 60 s"
            await asyncio.sleep(0.01)
        endless.cancel()
        with pytest.raises(asyncio.CancelledError):
            await endless
        stopped_at = forwards
        assert stopped_at < max_tokens
        # The engine thread is free: the next request runs at once (the prefill and 2 decoding steps).
        after = await engine.generate([5, 6, 7], [], Sampling(max_tokens=3, seed=0))
        assert len(after.token_ids) == 3 and forwards == stopped_at + 3 + 1
    finally:
        await engine.close()
