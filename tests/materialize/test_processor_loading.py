"""load_processor: explicit backend, identity read back from the processor actually loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rawmm.contract import get_family
from rawmm.materialize import processor as processor_module
from rawmm.materialize.kimi import KimiK25ImageProcessor
from rawmm.materialize.processor import load_processor


def test_each_backend_loads_its_own_processor_class_and_identity(tiny_qwen2_vl: Path) -> None:
    pil = load_processor(tiny_qwen2_vl, "pil")
    tv = load_processor(tiny_qwen2_vl, "torchvision")
    assert type(pil.processor).__name__ == "Qwen2VLImageProcessorPil"
    assert type(tv.processor).__name__ == "Qwen2VLImageProcessor"
    assert (pil.backend, tv.backend) == ("pil", "torchvision")
    assert pil.config == tv.config
    assert pil.fingerprint != tv.fingerprint
    assert pil.identity != tv.identity
    family = get_family("qwen_vl")
    assert pil.fingerprint == family.fingerprint(pil.config, "pil")
    assert json.loads(pil.identity)["backend"] == "pil"


def test_the_two_backends_really_produce_different_pixels(tiny_qwen2_vl: Path) -> None:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (90, 130, 3), dtype=np.uint8))
    pil = load_processor(tiny_qwen2_vl, "pil").processor(images=[image], return_tensors="pt")
    tv = load_processor(tiny_qwen2_vl, "torchvision").processor(images=[image], return_tensors="pt")
    assert pil["image_grid_thw"].tolist() == tv["image_grid_thw"].tolist()
    assert (pil["pixel_values"] - tv["pixel_values"]).abs().max() > 0


def test_the_identity_comes_from_the_checkpoint_not_from_presets(tiny_qwen2_vl: Path) -> None:
    loaded = load_processor(tiny_qwen2_vl)
    preset = get_family("qwen_vl").preset("qwen2_vl")
    # The tiny checkpoint lowers max_pixels: its fingerprint must not pass for the public preset's.
    assert loaded.config.max_pixels != preset.max_pixels
    assert loaded.fingerprint != get_family("qwen_vl").fingerprint(preset, "pil")


def test_loading_is_cached_per_path_and_backend(tiny_qwen2_vl: Path) -> None:
    assert load_processor(tiny_qwen2_vl, "pil") is load_processor(str(tiny_qwen2_vl), "pil")
    assert load_processor(tiny_qwen2_vl, "pil") is not load_processor(tiny_qwen2_vl, "torchvision")


def test_a_silent_backend_fallback_is_an_error(
    tiny_qwen2_vl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = shutil.copytree(tiny_qwen2_vl, tmp_path / "copy")  # a fresh path: not in the load cache
    pil_processor = load_processor(tiny_qwen2_vl, "pil").processor
    monkeypatch.setattr(processor_module, "_load_image_processor", lambda *args: pil_processor)
    with pytest.raises(ValueError, match="asked for the torchvision"):
        load_processor(copy, "torchvision")


def test_kimi_checkpoints_load_our_own_processor(kimi_checkpoint: Path) -> None:
    loaded = load_processor(kimi_checkpoint, "pil")
    assert isinstance(loaded.processor, KimiK25ImageProcessor)
    assert loaded.family.name == "kimi_k25"
    assert (loaded.config.in_patch_limit, loaded.config.patch_limit_on_one_side) == (256, 24)
    assert loaded.fingerprint == get_family("kimi_k25").fingerprint(loaded.config, "pil")
    assert load_processor(kimi_checkpoint, "torchvision").fingerprint != loaded.fingerprint


def test_unsupported_models_and_backends_are_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not supported"):
        load_processor(tmp_path)
    with pytest.raises(ValueError, match="backend"):
        load_processor(tmp_path, "opencv")


def test_renderer_config_and_loaded_processor_agree_on_the_fingerprint(
    tiny_qwen3_vl: Path, kimi_checkpoint: Path
) -> None:
    # Refs are rendered from config_from_pretrained; materializers check them against the loaded processor.
    for path in (tiny_qwen3_vl, kimi_checkpoint):
        loaded = load_processor(path, "pil")
        assert loaded.family.config_from_pretrained(path) == loaded.config
