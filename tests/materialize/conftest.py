"""Fixtures for materialization tests: a Kimi K2.5 processor checkpoint and a ref factory."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from rawmm.contract import OffloadStore, RawImageDescriptor, RawImageRef, encode_ref, parse_ref

# Small patch limits keep Kimi images (and tests) small; the math is the same at any limit.
KIMI_MEDIA_PROC_CFG = {
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 256,
    "patch_limit_on_one_side": 24,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


@pytest.fixture(scope="session")
def kimi_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Kimi K2.5 checkpoint directory as far as image processing goes (config + media_proc_cfg)."""
    path = tmp_path_factory.mktemp("kimi_k25")
    (path / "config.json").write_text(json.dumps({"model_type": "kimi_k25"}))
    (path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": KIMI_MEDIA_PROC_CFG}))
    return path


def noise_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4}.get(mode)
    shape = (height, width) if channels is None else (height, width, channels)
    pixels = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    return Image.fromarray(pixels, mode=mode)


MakeRef = Callable[..., RawImageRef]


@pytest.fixture
def make_ref(offload_store: OffloadStore) -> MakeRef:
    """Offload an image and return the ref a renderer would send for it with ``loaded`` (a LoadedProcessor)."""

    def make(image: Image.Image, loaded: Any, **overrides: Any) -> RawImageRef:
        stored = offload_store.put(image)
        layout = loaded.family.describe(width=image.width, height=image.height, config=loaded.config)
        fields = {
            "family": loaded.family.name,
            "modality": loaded.family.modality,
            "payload": loaded.family.payload(layout),
            "raw_image_uri": stored.uri,
            "fingerprint": loaded.fingerprint,
            "vllm_modality": loaded.family.vllm_modality,
        }
        mm_hash = overrides.pop("mm_hash", stored.mm_hash)
        fields.update(overrides)
        return parse_ref(encode_ref(RawImageDescriptor(**fields), mm_hash))

    return make
