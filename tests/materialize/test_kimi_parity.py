"""Kimi K2.5 pixel parity: what the trainer and the transformers engine feed the model equals the reference
processors' ``pixel_values`` and grids bit for bit, on odd sizes and RGBA, through the real read path.

- ``torchvision`` backend: transformers' own ``Kimi_K25ImageProcessor``;
- ``pil`` backend: the published processor as vLLM 0.32 runs it (``KimiK25FusedVisionProcessor``), the
  pixels a chat request to a vLLM engine gets.

Both sides are taken where they meet the model: the trainer's uint8 patches normalized by its
``PixelNormalizer`` (``forward_logprobs``), the engine's cached uint8 item normalized the same way (the
transformers engine). The references get the image as displayed (``decode_image``: transparency composited
over white, as vLLM's loader hands it to any processor); for an opaque RGBA image that is the file itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from rawmm.contract import KimiK25Config, OffloadStore, get_family
from rawmm.materialize import get_adapter, load_processor, materialize_engine_item
from rawmm.materialize.decode import decode_image
from rawmm.materialize.kimi import KimiK25ImageProcessor
from rawmm.materialize.normalize import PixelNormalizer
from rawmm.materialize.read import read_ref_image

SIZES = [(1, 1), (13, 7), (27, 29), (29, 27), (101, 37), (37, 601), (333, 999), (641, 359)]
MODES = ["RGB", "RGBA-opaque", "RGBA-translucent"]


def picture(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    if mode == "RGB":
        return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    pixels = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    if mode == "RGBA-opaque":
        pixels[..., 3] = 255
    return Image.fromarray(pixels, "RGBA")


def transformers_reference(image: Image.Image, config: KimiK25Config) -> dict[str, torch.Tensor]:
    from transformers import Kimi_K25ImageProcessor

    side = config.patch_limit_on_one_side
    processor = Kimi_K25ImageProcessor(
        size={"max_height": side, "max_width": side},
        max_patches=config.in_patch_limit,
        patch_size=config.patch_size,
        merge_size=config.merge_size,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
    )
    out = processor(images=[image], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "grid_thws": out["image_grid_thw"]}


def vllm_reference(image: Image.Image, config: KimiK25Config) -> dict[str, torch.Tensor]:
    from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor

    media_proc_cfg = KimiK25ImageProcessor(config).media_proc_cfg  # the checkpoint's vocabulary
    media_proc_cfg.update(fixed_output_tokens=None, temporal_merge_kernel_size=4)
    processor = KimiK25FusedVisionProcessor(media_proc_cfg)
    out = processor.preprocess([{"type": "image", "image": image}], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "grid_thws": out["grid_thws"]}


REFERENCES = {"torchvision": transformers_reference, "pil": vllm_reference}


def as_displayed(image: Image.Image, store: OffloadStore) -> Image.Image:
    """The image as every rawmm reader (and vLLM's loader) sees the stored file."""
    stored = store.put(image)
    data = Path(stored.uri.removeprefix("file://")).read_bytes()
    return decode_image(data, max_pixels=1 << 30, source=stored.uri)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
@pytest.mark.parametrize("mode", MODES)
def test_trainer_and_engine_inputs_equal_the_reference_processor_bit_for_bit(
    backend: str, mode: str, kimi_checkpoint: Path, offload_store: OffloadStore, make_ref: Any
) -> None:
    loaded = load_processor(kimi_checkpoint, backend, pixels="uint8")
    adapter = get_adapter("kimi_k25")
    normalizer = PixelNormalizer(loaded)
    for seed, (width, height) in enumerate(SIZES):
        image = picture(width, height, mode, seed)
        ref = make_ref(image, loaded)
        displayed = as_displayed(image, offload_store)
        reference = REFERENCES[backend](image if mode != "RGBA-translucent" else displayed, loaded.config)

        # Trainer: its materializer's read and uint8 patches, normalized by forward_logprobs' normalizer.
        pixels = read_ref_image(ref, mm_hash=ref.mm_hash, roots=[offload_store.root])
        trainer = adapter.materialize_for_trainer(
            [pixels], [ref.descriptor()], loaded, normalize=False
        ).kwargs
        # Engine: one item through the engine's full path (checks, read, decode, processor), as cached.
        layout = get_family("kimi_k25").describe(width=width, height=height, config=loaded.config)
        item = materialize_engine_item(
            ref,
            placeholder_length=layout.num_placeholder_tokens,
            processor=loaded,
            roots=[offload_store.root],
            max_pixels=1 << 30,
        )
        engine = adapter.model_kwargs(normalizer.inputs(item.tensors))

        for side, kwargs in (("trainer", normalizer.inputs(trainer)), ("engine", engine)):
            got = kwargs["pixel_values"]
            assert kwargs["image_grid_thw"].reshape(-1, 3).tolist() == reference["grid_thws"].tolist(), side
            assert got.dtype == reference["pixel_values"].dtype == torch.float32
            assert got.shape == reference["pixel_values"].shape, (side, width, height)
            assert torch.equal(got, reference["pixel_values"]), (
                side, (width, height), (got - reference["pixel_values"]).abs().max().item())  # fmt: skip


def test_translucent_rgba_is_composited_over_white_as_vllm_loads_it(offload_store: OffloadStore) -> None:
    """Why the translucent case feeds the references the displayed image: transformers' own processor
    drops alpha (``convert("RGB")``), vLLM's loader composites it over white, and rawmm follows vLLM."""
    from vllm.multimodal.media.image import ImageMediaIO

    image = picture(37, 29, "RGBA-translucent", seed=5)
    stored = offload_store.put(image)
    data = Path(stored.uri.removeprefix("file://")).read_bytes()
    vllm_loaded = np.asarray(ImageMediaIO().load_bytes(data).media)
    assert np.array_equal(np.asarray(as_displayed(image, offload_store)), vllm_loaded)
    assert not np.array_equal(vllm_loaded, np.asarray(image.convert("RGB")))


def test_the_reference_processors_differ_so_the_backend_matters(kimi_checkpoint: Path) -> None:
    image = picture(333, 999, "RGB", seed=1)
    config = load_processor(kimi_checkpoint).config
    tv, pil = transformers_reference(image, config), vllm_reference(image, config)
    assert torch.equal(tv["grid_thws"], pil["grid_thws"])
    assert not torch.equal(tv["pixel_values"], pil["pixel_values"])
    fingerprints = {
        load_processor(kimi_checkpoint, backend).fingerprint for backend in ("pil", "torchvision")
    }
    assert len(fingerprints) == 2
