"""Kimi K2.5 preprocessing: grids from the layout math, pixels from the published resize/pad/normalize/patchify."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from rawmm.contract import KimiK25Config, get_family
from rawmm.materialize.kimi import KimiK25ImageProcessor

SMALL = KimiK25Config(in_patch_limit=256, patch_limit_on_one_side=24)


def reference(image: np.ndarray, config: KimiK25Config) -> tuple[np.ndarray, list[int]]:
    """The published pipeline written out step by step: navit size, bicubic, pad, (x/255 - mean)/std, patchify."""
    patch, factor = config.patch_size, config.patch_size * config.merge_size
    height, width = image.shape[:2]
    scale = min(
        1.0,
        math.sqrt(config.in_patch_limit / (max(1.0, width // patch) * max(1.0, height // patch))),
        config.patch_limit_on_one_side * patch / width,
        config.patch_limit_on_one_side * patch / height,
    )
    new_w = min(max(1, int(width * scale)), config.patch_limit_on_one_side * patch)
    new_h = min(max(1, int(height * scale)), config.patch_limit_on_one_side * patch)
    pixels = np.asarray(Image.fromarray(image).resize((new_w, new_h), resample=Image.Resampling.BICUBIC))
    pixels = np.pad(pixels, ((0, (-new_h) % factor), (0, (-new_w) % factor), (0, 0)))
    normalized = (pixels / 255.0 - np.asarray(config.image_mean)) / np.asarray(config.image_std)
    grid_h, grid_w = normalized.shape[0] // patch, normalized.shape[1] // patch
    patches = normalized.reshape(grid_h, patch, grid_w, patch, 3).transpose(0, 2, 4, 1, 3)
    return patches.reshape(-1, 3, patch, patch), [1, grid_h, grid_w]


def noise(width: int, height: int, seed: int) -> np.ndarray:
    """Decoded RGB rows, as the processor receives them."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    ("width", "height"),
    [(1, 1), (27, 29), (28, 28), (100, 37), (37, 100), (640, 360), (2000, 30), (30, 2000)],
)
def test_pil_backend_matches_the_published_pipeline(width: int, height: int) -> None:
    image = noise(width, height, seed=width * 7 + height)
    out = KimiK25ImageProcessor(SMALL, "pil")([image])
    expected_pixels, expected_grid = reference(image, SMALL)
    assert out["grid_thws"].tolist() == [expected_grid]
    assert out["pixel_values"].dtype == torch.float32
    assert out["pixel_values"].shape == expected_pixels.shape
    np.testing.assert_allclose(out["pixel_values"].numpy(), expected_pixels, atol=1e-6)


@pytest.mark.parametrize(("width", "height"), [(1, 1), (13, 500), (333, 222), (1280, 720), (5000, 5000)])
def test_grids_agree_with_the_family_layout_math(width: int, height: int) -> None:
    layout = get_family("kimi_k25").describe(width=width, height=height, config=SMALL)
    # A solid image: cheap to build at any size, and the grid does not depend on content.
    out = KimiK25ImageProcessor(SMALL)([np.full((height, width, 3), (10, 20, 30), np.uint8)])
    assert tuple(out["grid_thws"][0].tolist()) == layout.grid_thw
    t, h, w = layout.grid_thw
    assert out["pixel_values"].shape == (t * h * w, 3, 14, 14)
    assert h % SMALL.merge_size == 0 and w % SMALL.merge_size == 0
    assert h * w <= SMALL.in_patch_limit + 2 * (h + w)  # within the limit up to the padding to merge size


def test_patches_are_row_major_with_channels_first_and_padding_normalizes_to_minus_one() -> None:
    config = KimiK25Config(patch_size=2, merge_size=2, in_patch_limit=10_000, patch_limit_on_one_side=100)
    # 6x3 image (no resize: under every limit); each pixel's red channel encodes its position.
    height, width = 3, 6
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[..., 0] = np.arange(height * width).reshape(height, width) * 10
    pixels[..., 1] = 255
    out = KimiK25ImageProcessor(config)([pixels])
    assert out["grid_thws"].tolist() == [[1, 2, 4]]  # padded to 4x8: multiples of patch*merge = 4
    values = out["pixel_values"].numpy()
    assert values.shape == (8, 3, 2, 2)
    red = (values[:, 0] + 1) / 2 * 255  # undo (x/255 - 0.5)/0.5

    # Patch 1 is grid row 0, column 1: image rows 0-1, columns 2-3.
    np.testing.assert_allclose(red[1], [[20, 30], [80, 90]], atol=1e-3)
    # Patch 4 is grid row 1, column 0: image row 2 then a padded row.
    np.testing.assert_allclose(red[4], [[120, 130], [0, 0]], atol=1e-3)
    assert np.all(values[:, 1][values[:, 1] != -1] == 1.0)  # green: 255 -> 1 wherever it is not padding
    assert values[4, 1, 1, 0] == -1.0 and values[7, :, :, :].min() == -1.0  # padding -> -1 in every channel


def test_torchvision_backend_gives_the_same_layout_and_close_pixels() -> None:
    image = noise(300, 200, seed=3)
    pil = KimiK25ImageProcessor(SMALL, "pil")([image])
    tv = KimiK25ImageProcessor(SMALL, "torchvision")([image])
    assert torch.equal(pil["grid_thws"], tv["grid_thws"])
    assert pil["pixel_values"].shape == tv["pixel_values"].shape
    difference = (pil["pixel_values"] - tv["pixel_values"]).abs()
    assert difference.mean() < 0.05  # same picture...
    assert difference.max() > 0  # ...but not the same pixels: why the backend is part of the identity


def test_a_batch_concatenates_patches_and_stacks_grids() -> None:
    images = [noise(50, 40, 1), noise(90, 30, 2)]
    processor = KimiK25ImageProcessor(SMALL)
    batch = processor(images)
    singles = [processor([image]) for image in images]
    assert batch["grid_thws"].tolist() == [s["grid_thws"][0].tolist() for s in singles]
    assert torch.equal(batch["pixel_values"], torch.cat([s["pixel_values"] for s in singles]))


def test_media_proc_cfg_round_trips_through_the_family() -> None:
    processor = KimiK25ImageProcessor(SMALL)
    assert get_family("kimi_k25").config_from_processor(processor) == SMALL


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="backend"):
        KimiK25ImageProcessor(SMALL, "opencv")
