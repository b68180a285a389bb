"""``describe`` must equal transformers' own Qwen image processors, size for size, on both backends.

Every preset runs at its public config over small and medium sizes; sizes beyond ``max_pixels`` run
against the same preset with a small ``max_pixels`` (parity holds for any config, and a processor run
on a 16-megapixel image would cost seconds per size).
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from rawmm.contract import QwenVLConfig, get_family

qwen = get_family("qwen_vl")
BACKEND_CLASSES = {"pil": "Qwen2VLImageProcessorPil", "torchvision": "Qwen2VLImageProcessor"}
PRESETS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Qwen2.5-VL publishes the same image config as Qwen2-VL (test_families checks this), so the dense
# sweeps run once per distinct config; the random-size test still draws all three presets.
DISTINCT_PRESETS = ("qwen2_vl", "qwen3_vl")


def small_variant(config: QwenVLConfig) -> QwenVLConfig:
    return dataclasses.replace(config, min_pixels=4 * config.factor**2, max_pixels=48 * config.factor**2)


@cache
def processor_for(config: QwenVLConfig, backend: str, root: Path) -> object:
    from transformers import AutoImageProcessor

    directory = root / f"{abs(hash((config, backend)))}"
    directory.mkdir(exist_ok=True)
    public_style = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "size": {"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
        "patch_size": config.patch_size,
        "merge_size": config.merge_size,
        "temporal_patch_size": config.temporal_patch_size,
        "image_mean": list(config.image_mean),
        "image_std": list(config.image_std),
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(public_style))
    processor = AutoImageProcessor.from_pretrained(directory, backend=backend)
    assert type(processor).__name__ == BACKEND_CLASSES[backend]
    assert qwen.config_from_processor(processor) == config
    return processor


@pytest.fixture(scope="module")
def processor_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("processors")


def sides(factor: int) -> list[int]:
    """1-px sides and every rounding edge around multiples of the factor, incl. exact .5 ties."""
    half = factor // 2
    edges = {1, 2, 7, half - 1, half, half + 1, factor - 1, factor + 1, factor + half, 2 * factor + half}
    return sorted(edges | {3 * factor - 1, 3 * factor + 1})


def dense_sizes(factor: int) -> list[tuple[int, int]]:
    """All pairs of the edge sides, plus odd medium sizes against thin and square partners."""
    edge = sides(factor)
    medium = [97, 331, 5 * factor + factor // 2 + 1, 640, 1001]
    return [(w, h) for w in edge for h in edge] + [(m, o) for m in medium for o in (1, factor, 479)]


def aspect_sizes() -> list[tuple[int, int]]:
    thin = [
        (1, 199),
        (1, 200),
        (1, 201),
        (2, 399),
        (2, 400),
        (2, 401),
        (3, 600),
        (3, 601),
        (7, 1400),
        (7, 1401),
    ]
    return thin + [(h, w) for w, h in thin]


def huge_sizes(factor: int) -> list[tuple[int, int]]:
    """Sizes far beyond the small variant's max_pixels, and ones whose rounding crosses it."""
    limit = 48 * factor**2
    near = int(limit**0.5)
    return [
        (4000, 3000),
        (3001, 17),
        (17, 3001),
        (1999, 1001),
        (1200, 7),
        (near, near),
        (near + 1, near + 1),
        (near - factor // 2, near + factor // 2),
        (6 * factor + factor // 2, 8 * factor + factor // 2),
    ]


def processor_grids(processor: object, sizes: list[tuple[int, int]]) -> list[tuple[int, int, int] | None]:
    """The processor's grid per (width, height); None where it refuses the image."""
    grids: list[tuple[int, int, int] | None] = []
    for start in range(0, len(sizes), 48):
        chunk = sizes[start : start + 48]
        images = [Image.new("RGB", size) for size in chunk]
        try:
            out = processor(images=images)
            grids.extend(tuple(int(v) for v in row) for row in out["image_grid_thw"])
        except ValueError:  # one refused image sinks the batch; redo it one by one
            for image in images:
                try:
                    grids.append(tuple(int(v) for v in processor(images=[image])["image_grid_thw"][0]))
                except ValueError:
                    grids.append(None)
    return grids


def assert_parity(config: QwenVLConfig, processor: object, sizes: list[tuple[int, int]]) -> None:
    mismatches = []
    for (width, height), grid in zip(sizes, processor_grids(processor, sizes), strict=True):
        if grid is None:
            with pytest.raises(ValueError):
                qwen.describe(width=width, height=height, config=config)
            continue
        layout = qwen.describe(width=width, height=height, config=config)
        tokens = grid[0] * grid[1] * grid[2] // config.merge_size**2
        resized = (grid[1] * config.patch_size, grid[2] * config.patch_size)
        if (layout.grid_thw, layout.num_placeholder_tokens, layout.resized) != (grid, tokens, resized):
            mismatches.append(((width, height), layout, grid))
    assert not mismatches, mismatches[:5]


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
@pytest.mark.parametrize("preset", DISTINCT_PRESETS)
def test_public_preset_parity(preset: str, backend: str, processor_root: Path) -> None:
    # At the public config every small image is upscaled to min_pixels (costly on the torchvision
    # backend), so this runs a sample of the dense grid; the full grid runs in the next test.
    config = qwen.preset(preset)
    edge = sides(config.factor)
    sizes = (
        [(w, h) for w in edge for h in (1, edge[len(edge) // 2], w)]
        + aspect_sizes()
        + [(1001, 479), (640, 331)]
    )
    assert_parity(config, processor_for(config, backend, processor_root), sizes)


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
@pytest.mark.parametrize("preset", DISTINCT_PRESETS)
def test_dense_and_beyond_max_pixels_parity(preset: str, backend: str, processor_root: Path) -> None:
    config = small_variant(qwen.preset(preset))
    sizes = dense_sizes(config.factor) + aspect_sizes() + huge_sizes(config.factor)
    assert_parity(config, processor_for(config, backend, processor_root), sizes)


@given(
    width=st.integers(1, 1500),
    height=st.integers(1, 1500),
    preset=st.sampled_from(PRESETS),
    backend=st.sampled_from(["pil", "torchvision"]),
)
@settings(max_examples=60, deadline=None)
def test_random_size_parity(width: int, height: int, preset: str, backend: str, processor_root: Path) -> None:
    config = small_variant(qwen.preset(preset))
    assert_parity(config, processor_for(config, backend, processor_root), [(width, height)])
