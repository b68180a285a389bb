"""Request features: how a prompt's images travel to an engine (docs/architecture.md §3.3).

``{"mm_hashes": {mod: [h...]}, "mm_placeholders": {mod: [{"offset", "length"}...]}, "kwargs_data": {mod: [ref...]}}``
with ``mod`` the descriptor's engine modality (``vllm_modality`` if set, else ``modality``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rawmm.contract.errors import InvalidImageRef
from rawmm.contract.families import vllm_modality_of
from rawmm.contract.refs import RawImageDescriptor, RawImageRef, check_mm_hash, encode_ref, parse_ref

FEATURE_KEYS = ("mm_hashes", "mm_placeholders", "kwargs_data")


class PlacedImage(Protocol):
    """An image with its place in a prompt (a rendered image, or a training sample's image ref)."""

    @property
    def descriptor(self) -> RawImageDescriptor: ...
    @property
    def mm_hash(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...


def request_features(images: Iterable[PlacedImage]) -> dict[str, dict[str, list[Any]]]:
    """The request features of ``images`` (in prompt order), grouped by engine modality."""
    features: dict[str, dict[str, list[Any]]] = {key: {} for key in FEATURE_KEYS}
    for image in images:
        modality = image.descriptor.engine_modality
        features["mm_hashes"].setdefault(modality, []).append(image.mm_hash)
        features["mm_placeholders"].setdefault(modality, []).append(
            {"offset": image.offset, "length": image.length}
        )
        features["kwargs_data"].setdefault(modality, []).append(encode_ref(image.descriptor, image.mm_hash))
    return features


@dataclass(frozen=True)
class FeatureImage:
    """One image of a parsed request: its engine modality, ref and placeholder span."""

    modality: str
    ref: RawImageRef
    offset: int
    length: int


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_features(
    features: Any, *, token_ids: Sequence[int], placeholder_token_id: int
) -> list[FeatureImage]:
    """Validate request features against the prompt; the images in prompt order.

    Raises ``InvalidImageRef``: ``malformed_ref`` (shape, bad ref), ``count_mismatch`` (lists of one
    modality differ in length, or modalities differ across keys), ``hash_mismatch`` (outer hash is not
    the ref's), ``modality_mismatch`` (ref filed under another engine modality),
    ``placeholder_mismatch`` (span empty, out of the prompt, overlapping, or not on placeholder tokens).
    """
    if not isinstance(features, Mapping) or set(features) != set(FEATURE_KEYS):
        raise InvalidImageRef(
            "malformed_ref", f"features must be an object with exactly the keys {FEATURE_KEYS}"
        )
    groups = [features[key] for key in FEATURE_KEYS]
    if not all(isinstance(group, Mapping) for group in groups):
        raise InvalidImageRef("malformed_ref", "each feature must map modality -> list")
    if not groups[0].keys() == groups[1].keys() == groups[2].keys():
        raise InvalidImageRef(
            "count_mismatch", "mm_hashes, mm_placeholders and kwargs_data name different modalities"
        )
    images: list[FeatureImage] = []
    for modality, hashes in groups[0].items():
        placeholders, refs = groups[1][modality], groups[2][modality]
        if not all(isinstance(group, list) for group in (hashes, placeholders, refs)):
            raise InvalidImageRef("malformed_ref", f"features for {modality!r} must be lists")
        if not len(hashes) == len(placeholders) == len(refs):
            raise InvalidImageRef(
                "count_mismatch",
                f"{modality!r}: {len(hashes)} hashes, {len(placeholders)} placeholders, {len(refs)} refs",
            )
        for mm_hash, placeholder, text in zip(hashes, placeholders, refs, strict=True):
            ref = parse_ref(text)
            if check_mm_hash(mm_hash) != ref.mm_hash:
                raise InvalidImageRef(
                    "hash_mismatch", f"outer mm_hash {mm_hash} differs from the ref's {ref.mm_hash}"
                )
            expected_modality = vllm_modality_of(ref.family) or ref.modality
            if modality != expected_modality:
                raise InvalidImageRef(
                    "modality_mismatch",
                    f"{ref.family} image filed under {modality!r}, expected {expected_modality!r}",
                )
            if (
                not isinstance(placeholder, Mapping)
                or set(placeholder) != {"offset", "length"}
                or not _is_index(placeholder["offset"])
                or not _is_index(placeholder["length"])
            ):
                raise InvalidImageRef(
                    "malformed_ref",
                    f"placeholder must be {{offset, length}} of ints, got {placeholder!r:.80}",
                )
            images.append(FeatureImage(modality, ref, placeholder["offset"], placeholder["length"]))
    images.sort(key=lambda image: image.offset)
    end = 0
    for image in images:
        if image.length < 1 or image.offset < end or image.offset + image.length > len(token_ids):
            raise InvalidImageRef(
                "placeholder_mismatch",
                f"placeholder at {image.offset}+{image.length} is empty, overlaps another or leaves the "
                f"{len(token_ids)}-token prompt",
            )
        span = token_ids[image.offset : image.offset + image.length]
        if any(token != placeholder_token_id for token in span):
            raise InvalidImageRef(
                "placeholder_mismatch",
                f"placeholder at {image.offset}+{image.length} is not all image tokens",
            )
        end = image.offset + image.length
    return images
