"""What materialization produces (`rawmm.materialize.items`): engine items, read-only and shared, and their
collation into a model's kwargs, flat fields concatenated and batched ones stacked as vLLM joins them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rawmm.materialize.items import EngineItem, FieldKind, collate

FLAT, BATCHED = FieldKind.FLAT, FieldKind.BATCHED
KINDS = {"pixel_values": FLAT, "image_grid_thw": BATCHED}


def qwen_like(patches: int, fill: float, modality: str = "image") -> EngineItem:
    """An item shaped as a Qwen-VL image: one row per patch, and its grid."""
    return EngineItem(
        modality,
        {
            "pixel_values": torch.full((patches, 6), fill),
            "image_grid_thw": torch.tensor([1, 1, patches]),
        },
        KINDS,
    )


def test_field_kinds_are_vllms_names() -> None:
    assert (FieldKind("flat"), FieldKind("batched")) == (FLAT, BATCHED)


def test_an_item_needs_a_kind_for_every_tensor_and_no_other() -> None:
    tensors = {"pixel_values": torch.zeros(2, 3), "image_grid_thw": torch.tensor([1, 1, 2])}
    with pytest.raises(ValueError, match=r"tensors \['image_grid_thw', 'pixel_values'\] and kinds"):
        EngineItem("image", tensors, {"pixel_values": FLAT})
    with pytest.raises(ValueError, match="disagree"):
        EngineItem("image", {"pixel_values": tensors["pixel_values"]}, KINDS)


def test_an_items_size_is_the_bytes_of_its_tensors() -> None:
    item = EngineItem(
        "image",
        {
            "pixel_values": torch.zeros(4, 3, dtype=torch.uint8),
            "image_grid_thw": torch.zeros(3, dtype=torch.int64),
        },
        KINDS,
    )
    assert item.nbytes == 4 * 3 + 3 * 8
    assert EngineItem("image", {}, {}).nbytes == 0


def test_items_are_read_only_mappings_that_owe_nothing_to_the_dicts_they_were_built_from() -> None:
    """Items are shared between requests by the cache: nobody may change one, nor change it by accident
    through the dicts it was made from. (This was checked on an adapter's item in test_adapters.py.)"""
    tensors = {"pixel_values": torch.zeros(2, 3), "image_grid_thw": torch.tensor([1, 1, 2])}
    kinds = dict(KINDS)
    item = EngineItem("image", tensors, kinds)
    with pytest.raises(TypeError):
        item.tensors["pixel_values"] = torch.zeros(1)  # type: ignore[index]
    with pytest.raises(TypeError):
        item.kinds["pixel_values"] = BATCHED  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.modality = "video"  # type: ignore[misc]
    tensors["extra"] = torch.ones(1)
    kinds["pixel_values"] = BATCHED
    assert set(item.tensors) == {"pixel_values", "image_grid_thw"}
    assert item.kinds["pixel_values"] is FLAT


def test_collate_concatenates_flat_fields_and_stacks_batched_ones_in_prompt_order() -> None:
    first, second = qwen_like(2, 1.0), qwen_like(3, 2.0)
    kwargs = collate([first, second])
    assert set(kwargs) == {"pixel_values", "image_grid_thw"}
    assert kwargs["pixel_values"].shape == (5, 6)
    assert kwargs["pixel_values"][:, 0].tolist() == [1.0, 1.0, 2.0, 2.0, 2.0]
    assert kwargs["image_grid_thw"].tolist() == [[1, 1, 2], [1, 1, 3]]


def test_collating_one_item_still_gives_batched_fields_their_batch_dimension() -> None:
    kwargs = collate([qwen_like(2, 1.0)])
    assert kwargs["image_grid_thw"].shape == (1, 3)
    assert torch.equal(kwargs["pixel_values"], torch.full((2, 6), 1.0))


def test_collating_no_items_gives_no_kwargs() -> None:
    assert collate([]) == {}


def test_items_of_different_modalities_or_fields_are_not_collated() -> None:
    with pytest.raises(ValueError, match="different modalities or fields"):
        collate([qwen_like(2, 1.0), qwen_like(2, 1.0, modality="vision_chunk")])
    other_kinds = EngineItem(
        "image",
        {"pixel_values": torch.zeros(2, 6), "image_grid_thw": torch.tensor([1, 1, 2])},
        {"pixel_values": FLAT, "image_grid_thw": FLAT},
    )
    with pytest.raises(ValueError, match="different modalities or fields"):
        collate([qwen_like(2, 1.0), other_kinds])
