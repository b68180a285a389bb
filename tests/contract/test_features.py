from __future__ import annotations

import copy
from typing import Any

import pytest

from rawmm.contract import InvalidImageRef, RawImageDescriptor, parse_features, request_features
from rawmm.contract.render import RenderedImage

PAD = 9


def placed(offset: int, length: int, n: int, family: str = "qwen_vl") -> RenderedImage:
    vllm_modality = "vision_chunk" if family == "kimi_k25" else None
    descriptor = RawImageDescriptor(
        family, "image", {"image_grid_thw": [[1, 2, 2]]}, f"file:///s/{n}.png", None, vllm_modality
    )
    return RenderedImage(descriptor, f"{n:032x}", offset, length)


def prompt() -> tuple[list[int], dict[str, Any]]:
    token_ids = [1, PAD, PAD, 2, 3, PAD, PAD, PAD, 4]
    return token_ids, request_features([placed(1, 2, 1), placed(5, 3, 2)])


def test_valid_features_parse_in_prompt_order() -> None:
    token_ids, features = prompt()
    parsed = parse_features(features, token_ids=token_ids, placeholder_token_id=PAD)
    assert [(p.modality, p.offset, p.length, p.ref.mm_hash) for p in parsed] == [
        ("image", 1, 2, f"{1:032x}"),
        ("image", 5, 3, f"{2:032x}"),
    ]


def test_modalities_group_separately() -> None:
    features = request_features([placed(0, 1, 1, "kimi_k25"), placed(2, 1, 2)])
    assert set(features["kwargs_data"]) == {"vision_chunk", "image"}
    parsed = parse_features(features, token_ids=[PAD, 0, PAD], placeholder_token_id=PAD)
    assert [p.modality for p in parsed] == ["vision_chunk", "image"]


def mutate(path: tuple, value: Any) -> dict[str, Any]:
    features = copy.deepcopy(prompt()[1])
    target = features
    for key in path[:-1]:
        target = target[key]
    if value is ...:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return features


@pytest.mark.parametrize(
    ("features", "reason"),
    [
        (mutate(("mm_hashes",), ...), "malformed_ref"),
        (mutate(("mm_hashes",), []), "malformed_ref"),
        (mutate(("mm_hashes", "image", 0), ...), "count_mismatch"),
        (mutate(("kwargs_data", "video"), []), "count_mismatch"),
        (mutate(("mm_hashes", "image", 0), "f" * 32), "hash_mismatch"),
        (mutate(("kwargs_data", "image", 0), "mmraw:{}"), "malformed_ref"),
        (mutate(("mm_placeholders", "image", 0), {"offset": 1}), "malformed_ref"),
        (mutate(("mm_placeholders", "image", 0), {"offset": -1, "length": 2}), "malformed_ref"),
        (mutate(("mm_placeholders", "image", 0), {"offset": 1, "length": True}), "malformed_ref"),
        (mutate(("mm_placeholders", "image", 0), {"offset": 1, "length": 0}), "placeholder_mismatch"),
        (
            mutate(("mm_placeholders", "image", 0), {"offset": 4, "length": 2}),
            "placeholder_mismatch",
        ),  # overlap
        (
            mutate(("mm_placeholders", "image", 1), {"offset": 7, "length": 3}),
            "placeholder_mismatch",
        ),  # past end
        (
            mutate(("mm_placeholders", "image", 0), {"offset": 0, "length": 2}),
            "placeholder_mismatch",
        ),  # text token
        ("not features", "malformed_ref"),
    ],
)
def test_broken_features(features: Any, reason: str) -> None:
    with pytest.raises(InvalidImageRef) as info:
        parse_features(features, token_ids=prompt()[0], placeholder_token_id=PAD)
    assert info.value.reason == reason


def test_image_filed_under_the_wrong_engine_modality() -> None:
    features = request_features([placed(0, 1, 1, "kimi_k25")])
    for key in features:
        features[key]["image"] = features[key].pop("vision_chunk")
    with pytest.raises(InvalidImageRef) as info:
        parse_features(features, token_ids=[PAD], placeholder_token_id=PAD)
    assert info.value.reason == "modality_mismatch"


def test_overlapping_placeholders_on_image_tokens_only() -> None:
    # Both spans lie wholly on placeholder tokens inside the prompt: only the overlap check can refuse them.
    token_ids = [1, PAD, PAD, PAD, PAD, PAD, 4]
    features = request_features([placed(1, 3, 1), placed(3, 3, 2)])
    with pytest.raises(InvalidImageRef) as info:
        parse_features(features, token_ids=token_ids, placeholder_token_id=PAD)
    assert info.value.reason == "placeholder_mismatch" and "overlaps" in str(info.value)
    # Adjacent spans (the second starts where the first ends) are fine.
    adjacent = request_features([placed(1, 2, 1), placed(3, 3, 2)])
    assert len(parse_features(adjacent, token_ids=token_ids, placeholder_token_id=PAD)) == 2
