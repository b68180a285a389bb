"""uint8 engine items (for vLLM's ``mm_device_do_normalize``) are the normalized items, before normalization.

The reference for "normalized on the device" is vLLM's own ``FusedMMInputNorm`` (its eager path, which
every platform falls back to): applied to our uint8 patches it must give the pixels the HF processor
(or our Kimi processor) gives the trainer, to a few fp32 ulps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rawmm.materialize import get_adapter, load_processor

PARITY_TOLERANCE = (
    1e-6  # measured: at most 4.8e-7 (2 ulps near 1.0); the affine transform is done once either way
)


@pytest.fixture(scope="module")
def device_norm() -> type:
    from vllm.model_executor.layers.fusion.mm_input_norm import FusedMMInputNorm

    return FusedMMInputNorm


def normalized_on_device(device_norm: type, pixels: torch.Tensor, config: object) -> torch.Tensor:
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        norm = device_norm(list(config.image_mean), list(config.image_std), 1 / 255)  # type: ignore[attr-defined]
    return norm.forward_native(pixels.reshape(pixels.shape[0], -1), torch.float32).reshape(pixels.shape)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("checkpoint", "backend"),
    [
        ("tiny_qwen2_vl", "pil"),
        ("tiny_qwen2_vl", "torchvision"),
        ("tiny_qwen3_vl", "torchvision"),
        ("kimi", "pil"),
    ],
)
def test_uint8_items_normalized_like_vllm_equal_the_normalized_items(
    device_norm: type, checkpoint: str, backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    path = request.getfixturevalue("kimi_checkpoint" if checkpoint == "kimi" else checkpoint)
    normalized = load_processor(path, backend)
    raw = load_processor(path, backend, pixels="uint8")
    adapter = get_adapter(normalized.family.name)
    image = np.random.default_rng(0).integers(0, 256, (90, 130, 3), dtype=np.uint8)
    expected = adapter._process(normalized.processor, [image])
    got = adapter._process(raw.processor, [image], normalize=False)
    assert got["pixel_values"].dtype == torch.uint8
    assert torch.equal(got[adapter.grid_key], expected[adapter.grid_key])
    on_device = normalized_on_device(device_norm, got["pixel_values"], normalized.config)
    assert (on_device - expected["pixel_values"]).abs().max().item() <= PARITY_TOLERANCE


def test_the_pixel_representation_is_in_the_identity_not_the_fingerprint(tiny_qwen2_vl: Path) -> None:
    normalized, raw = load_processor(tiny_qwen2_vl), load_processor(tiny_qwen2_vl, pixels="uint8")
    assert (normalized.pixels, raw.pixels) == ("normalized", "uint8")
    assert normalized.identity != raw.identity  # so cache keys differ
    assert normalized.fingerprint == raw.fingerprint  # the model sees the same pixels: refs stay valid
    with pytest.raises(ValueError, match="pixel representation"):
        load_processor(tiny_qwen2_vl, pixels="float16")
