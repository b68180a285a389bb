"""Family adapters: engine items and trainer inputs, and every descriptor/processor disagreement as a reason."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rawmm.contract import InvalidImageRef, OffloadStore
from rawmm.materialize import (
    FieldKind,
    ForwardPolicy,
    collate,
    get_adapter,
    load_processor,
    materialize_engine_item,
    read_ref_image,
)


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def reason(excinfo: pytest.ExceptionInfo[InvalidImageRef]) -> str:
    return excinfo.value.reason


def engine_item(ref, loaded, store: OffloadStore, placeholder_length: int | None = None):
    """The engine path for ``ref``, with the placeholder length a renderer gives it unless overridden."""
    if placeholder_length is None:
        height, width = read_ref_image(ref, mm_hash=ref.mm_hash, roots=[store.root]).shape[:2]
        layout = loaded.family.describe(width=width, height=height, config=loaded.config)
        placeholder_length = layout.num_placeholder_tokens
    return materialize_engine_item(
        ref, placeholder_length=placeholder_length, processor=loaded, roots=[store.root], max_pixels=10**8
    )


def test_qwen_engine_item_is_one_image_under_the_image_modality(
    tiny_qwen2_vl: Path, offload_store: OffloadStore, make_ref
) -> None:
    loaded = load_processor(tiny_qwen2_vl)
    ref = make_ref(noise(150, 100), loaded)
    item = engine_item(ref, loaded, offload_store)
    grid = ref.payload["image_grid_thw"][0]
    assert item.modality == "image"
    assert dict(item.kinds) == {"pixel_values": FieldKind.FLAT, "image_grid_thw": FieldKind.BATCHED}
    assert item.tensors["image_grid_thw"].tolist() == grid
    assert item.tensors["pixel_values"].shape[0] == grid[0] * grid[1] * grid[2]
    assert item.nbytes == sum(t.nbytes for t in item.tensors.values())


def test_engine_and_trainer_produce_the_same_tensors(
    tiny_qwen2_vl: Path, offload_store: OffloadStore, make_ref
) -> None:
    loaded = load_processor(tiny_qwen2_vl)
    refs = [make_ref(noise(150, 100, 1), loaded), make_ref(noise(64, 200, 2), loaded)]
    items = [engine_item(ref, loaded, offload_store) for ref in refs]
    images = [read_ref_image(ref, mm_hash=ref.mm_hash, roots=[offload_store.root]) for ref in refs]
    trainer = get_adapter("qwen_vl").materialize_for_trainer(images, [r.descriptor() for r in refs], loaded)
    engine = collate(items)
    assert set(trainer.kwargs) == set(engine) == {"pixel_values", "image_grid_thw"}
    for key in engine:
        assert torch.equal(trainer.kwargs[key], engine[key]), key
    assert trainer.forward_policy == ForwardPolicy(pass_position_ids=False, requires_mm_token_type_ids=True)


def test_kimi_engine_item_is_filed_under_vision_chunk(
    kimi_checkpoint: Path, offload_store: OffloadStore, make_ref
) -> None:
    loaded = load_processor(kimi_checkpoint)
    ref = make_ref(noise(300, 120), loaded)
    t, h, w = ref.payload["grid_thws"][0]
    item = engine_item(ref, loaded, offload_store, placeholder_length=t * h * w // 4)  # one per vision token
    assert item.modality == "vision_chunk"
    assert item.tensors["grid_thws"].tolist() == [t, h, w]
    assert item.tensors["pixel_values"].shape == (t * h * w, 3, 14, 14)
    assert get_adapter("kimi_k25").forward_policy == ForwardPolicy(
        pass_position_ids=True, requires_mm_token_type_ids=False
    )
    # transformers' Kimi_K25ForConditionalGeneration names the grid image_grid_thw; vLLM's grid_thws.
    assert get_adapter("kimi_k25").model_kwargs(item.tensors).keys() == {"pixel_values", "image_grid_thw"}


def test_a_grid_the_processor_does_not_produce_is_a_grid_mismatch(
    tiny_qwen2_vl: Path, offload_store: OffloadStore, make_ref
) -> None:
    loaded = load_processor(tiny_qwen2_vl)
    ref = make_ref(noise(150, 100), loaded, payload={"image_grid_thw": [[1, 4, 4]]})
    with pytest.raises(InvalidImageRef) as excinfo:
        engine_item(ref, loaded, offload_store)
    assert reason(excinfo) == "grid_mismatch"
    image = read_ref_image(ref, mm_hash=ref.mm_hash, roots=[offload_store.root])
    with pytest.raises(InvalidImageRef) as excinfo:
        get_adapter("qwen_vl").materialize_for_trainer([image], [ref.descriptor()], loaded)
    assert reason(excinfo) == "grid_mismatch"


def test_a_placeholder_length_that_does_not_fit_the_image_is_a_placeholder_mismatch(
    tiny_qwen2_vl: Path, kimi_checkpoint: Path, offload_store: OffloadStore, make_ref
) -> None:
    for checkpoint, wrong_length in ((tiny_qwen2_vl, 3), (kimi_checkpoint, 2)):
        loaded = load_processor(checkpoint)
        ref = make_ref(noise(150, 100), loaded)
        with pytest.raises(InvalidImageRef) as excinfo:
            engine_item(ref, loaded, offload_store, placeholder_length=wrong_length)
        assert reason(excinfo) == "placeholder_mismatch"


def test_a_ref_rendered_for_another_backend_is_a_fingerprint_mismatch(
    tiny_qwen2_vl: Path, offload_store: OffloadStore, make_ref
) -> None:
    pil = load_processor(tiny_qwen2_vl, "pil")
    tv = load_processor(tiny_qwen2_vl, "torchvision")
    ref = make_ref(noise(150, 100), tv)
    with pytest.raises(InvalidImageRef) as excinfo:
        engine_item(ref, pil, offload_store)
    assert reason(excinfo) == "fingerprint_mismatch"
    assert engine_item(ref, tv, offload_store).modality == "image"


def test_a_ref_without_fingerprint_is_accepted(
    tiny_qwen2_vl: Path, offload_store: OffloadStore, make_ref
) -> None:
    loaded = load_processor(tiny_qwen2_vl)
    ref = make_ref(noise(150, 100), loaded, fingerprint=None)
    assert ref.fingerprint is None
    assert engine_item(ref, loaded, offload_store).modality == "image"


def test_family_and_modality_disagreements(
    tiny_qwen2_vl: Path, kimi_checkpoint: Path, offload_store: OffloadStore, make_ref
) -> None:
    qwen, kimi = load_processor(tiny_qwen2_vl), load_processor(kimi_checkpoint)
    kimi_ref = make_ref(noise(150, 100), kimi)
    with pytest.raises(InvalidImageRef) as excinfo:
        engine_item(kimi_ref, qwen, offload_store, placeholder_length=1)
    assert reason(excinfo) == "unknown_family"
    video = make_ref(noise(150, 100), qwen, modality="video")
    with pytest.raises(InvalidImageRef) as excinfo:
        engine_item(video, qwen, offload_store)
    assert reason(excinfo) == "modality_mismatch"
    stranger = replace(make_ref(noise(150, 100), qwen), family="llava")
    with pytest.raises(InvalidImageRef) as excinfo:
        engine_item(stranger, qwen, offload_store)
    assert reason(excinfo) == "unknown_family"
    with pytest.raises(InvalidImageRef) as excinfo:
        get_adapter("llava")
    assert reason(excinfo) == "unknown_family"


def test_trainer_rejects_a_count_mismatch(tiny_qwen2_vl: Path, offload_store: OffloadStore, make_ref) -> None:
    loaded = load_processor(tiny_qwen2_vl)
    ref = make_ref(noise(150, 100), loaded)
    image = read_ref_image(ref, mm_hash=ref.mm_hash, roots=[offload_store.root])
    with pytest.raises(InvalidImageRef) as excinfo:
        get_adapter("qwen_vl").materialize_for_trainer([image, image], [ref.descriptor()], loaded)
    assert reason(excinfo) == "count_mismatch"


def test_every_family_has_an_adapter() -> None:
    from rawmm.contract import FAMILIES

    for name in FAMILIES:
        assert get_adapter(name).family_name == name
