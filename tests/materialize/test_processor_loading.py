"""load_processor: explicit backend, identity read back from the processor actually loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rawmm.contract import get_family
from rawmm.contract.families import FAMILIES
from rawmm.materialize.adapters import FamilyAdapter, QwenVLAdapter, get_adapter
from rawmm.materialize.kimi import KimiK25ImageProcessor
from rawmm.materialize.processor import load_processor

# One processor checkpoint fixture per family: a family added to the contract fails the test below until
# its adapter loads a checkpoint of it.
CHECKPOINT_FIXTURES = {"qwen_vl": "tiny_qwen2_vl", "kimi_k25": "kimi_checkpoint"}


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


def test_without_a_backend_qwen_loads_what_transformers_and_vllm_load(tiny_qwen2_vl: Path) -> None:
    """vLLM's Qwen-VL path runs transformers' own AutoImageProcessor choice; every side's default follows it,
    so raw refs and a chat request to the same engine see the same pixels (tests/serving/test_vllm_*.py)."""
    from transformers import AutoImageProcessor

    loaded = load_processor(tiny_qwen2_vl)
    assert type(loaded.processor) is type(AutoImageProcessor.from_pretrained(tiny_qwen2_vl))
    assert loaded.backend == get_family("qwen_vl").default_backend == "torchvision"


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
    monkeypatch.setattr(QwenVLAdapter, "load_image_processor", lambda *args: pil_processor)
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_every_family_has_an_adapter_that_loads_its_processor(
    family: str, backend: str, request: pytest.FixtureRequest
) -> None:
    assert family in CHECKPOINT_FIXTURES, f"no processor checkpoint fixture for family {family!r}"
    adapter = get_adapter(family)
    # Its own loader, not an inherited one: an adapter that forgot it cannot even be instantiated.
    assert "load_image_processor" in type(adapter).__dict__
    assert "load_image_processor" in FamilyAdapter.__abstractmethods__
    loaded = load_processor(request.getfixturevalue(CHECKPOINT_FIXTURES[family]), backend)
    assert (loaded.family.name, loaded.backend) == (family, backend)
    assert adapter.backend_of(loaded.processor) == backend


def test_an_adapter_refuses_another_familys_processor(tiny_qwen2_vl: Path, kimi_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="not rawmm's Kimi"):
        get_adapter("kimi_k25").backend_of(load_processor(tiny_qwen2_vl).processor)
    with pytest.raises(ValueError, match="neither a PIL nor a torchvision"):
        get_adapter("qwen_vl").backend_of(load_processor(kimi_checkpoint).processor)
