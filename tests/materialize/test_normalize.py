"""uint8 patches normalized on use give the processor's normalized pixels bit for bit, in every family and
backend, and refuse pixels that are normalized already."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rawmm.contract import InvalidImageRef
from rawmm.materialize import get_adapter, load_processor
from rawmm.materialize.normalize import PixelNormalizer

CASES = [
    ("tiny_qwen2_vl", "pil"),
    ("tiny_qwen2_vl", "torchvision"),
    ("tiny_qwen3_vl", "pil"),
    ("tiny_qwen3_vl", "torchvision"),
    ("kimi_checkpoint", "pil"),
    ("kimi_checkpoint", "torchvision"),
]


def every_value_image(width: int, height: int, seed: int) -> np.ndarray:
    """Decoded RGB noise in which every channel takes all 256 values (so every table entry is checked)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels.reshape(-1, 3)[:256] = np.arange(256, dtype=np.uint8)[:, None]
    return pixels


@pytest.mark.parametrize(("checkpoint", "backend"), CASES)
def test_uint8_normalized_on_use_equals_the_processors_pixels_bit_for_bit(
    checkpoint: str, backend: str, request: pytest.FixtureRequest
) -> None:
    loaded = load_processor(request.getfixturevalue(checkpoint), backend)
    adapter = get_adapter(loaded.family.name)
    normalizer = PixelNormalizer(loaded)
    for seed, (width, height) in enumerate([(90, 130), (300, 200)]):
        image = every_value_image(width, height, seed)
        expected = adapter._process(loaded.processor, [image])["pixel_values"]
        raw = adapter._process(loaded.processor, [image], normalize=False)["pixel_values"]
        assert raw.dtype == torch.uint8 and raw.unique().numel() == 256
        got = normalizer(raw)
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert torch.equal(got, expected), (got - expected).abs().max().item()


def test_each_channel_has_its_own_row(tiny_qwen2_vl: Path) -> None:
    loaded = load_processor(tiny_qwen2_vl)
    table = get_adapter(loaded.family.name).normalization_table(loaded.processor)
    assert table.shape == (3, 256) and table.dtype == torch.float32
    assert len({tuple(row.tolist()) for row in table}) == 3  # Qwen's mean/std differ per channel


def test_a_micro_batch_of_many_patch_rows_is_normalized_whole(tiny_qwen2_vl: Path) -> None:
    loaded = load_processor(tiny_qwen2_vl)
    table = get_adapter(loaded.family.name).normalization_table(loaded.processor)
    rows = 2 * 4096 + 5  # more rows than one lookup block, ending in a partial block
    pixels = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (rows, 1176), dtype=np.uint8))
    channel = torch.arange(3).repeat_interleave(1176 // 3).expand(rows, -1)
    assert torch.equal(PixelNormalizer(loaded)(pixels), table[channel, pixels.long()])


def test_normalizing_twice_is_refused(tiny_qwen2_vl: Path) -> None:
    normalizer = PixelNormalizer(load_processor(tiny_qwen2_vl))
    once = normalizer(torch.zeros(4, 1176, dtype=torch.uint8))
    with pytest.raises(TypeError, match="normalized twice"):
        normalizer(once)
    assert normalizer.inputs({"image_grid_thw": torch.tensor([[1, 2, 2]])}).keys() == {"image_grid_thw"}


def test_uint8_trainer_inputs_keep_the_trainer_paths_checks(tiny_qwen2_vl: Path, make_ref) -> None:  # noqa: ANN001
    loaded = load_processor(tiny_qwen2_vl)
    adapter = get_adapter("qwen_vl")
    image = every_value_image(90, 60, 0)
    descriptor = make_ref(Image.fromarray(image), loaded).descriptor()

    def uint8_trainer_inputs(images, descriptors, processor):  # noqa: ANN001, ANN202
        return adapter.materialize_for_trainer(images, descriptors, processor, normalize=False)

    inputs = uint8_trainer_inputs([image], [descriptor], loaded)
    assert inputs.kwargs["pixel_values"].dtype == torch.uint8
    want = adapter.materialize_for_trainer([image], [descriptor], loaded)
    assert inputs.forward_policy == want.forward_policy
    assert torch.equal(inputs.kwargs["image_grid_thw"], want.kwargs["image_grid_thw"])
    assert torch.equal(
        PixelNormalizer(loaded).inputs(inputs.kwargs)["pixel_values"], want.kwargs["pixel_values"]
    )
    with pytest.raises(InvalidImageRef) as caught:
        uint8_trainer_inputs([image.transpose(1, 0, 2).copy()], [descriptor], loaded)
    assert caught.value.reason == "grid_mismatch"
    with pytest.raises(InvalidImageRef) as caught:
        uint8_trainer_inputs([image, image], [descriptor], loaded)
    assert caught.value.reason == "count_mismatch"
