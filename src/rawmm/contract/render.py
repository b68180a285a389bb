"""Rendering a multimodal chat into token ids with image placeholders, from the layout math alone.

The tokenizer's chat template renders one image marker per image part; each marker is then expanded
to the family's placeholder tokens (Qwen: N x ``<|image_pad|>`` between vision start/end; Kimi: N x
``<|media_pad|>``, as its processors expand it). No image processor runs: the grid comes from width,
height and the config.
Sizes are those of the stored image as decoded, with no EXIF transpose — exactly what the
materializers hand to the processor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rawmm.contract.families import Family, Layout, check_backend
from rawmm.contract.features import request_features
from rawmm.contract.messages import offload_images
from rawmm.contract.refs import RawImageDescriptor, encode_ref
from rawmm.contract.store import OffloadStore, StoredImage


@dataclass(frozen=True)
class RenderedImage:
    """One image of a rendered prompt: its descriptor, hash, and placeholder span in the token ids."""

    descriptor: RawImageDescriptor
    mm_hash: str
    offset: int
    length: int

    @property
    def ref(self) -> str:
        return encode_ref(self.descriptor, self.mm_hash)


@dataclass(frozen=True)
class RenderedPrompt:
    """Token ids of a rendered chat, the image-token mask and the images in prompt order."""

    token_ids: list[int]
    mm_token_type_ids: list[int]  # 1 on image placeholder tokens, 0 elsewhere
    images: list[RenderedImage]

    def features(self) -> dict[str, dict[str, list[Any]]]:
        """The request features for an engine (docs/architecture.md §3.3)."""
        return request_features(self.images)


def describe_stored_image(
    family: Family[Any], config: Any, image: StoredImage, *, fingerprint: str | None
) -> tuple[RawImageDescriptor, Layout]:
    """The descriptor a ref to the stored ``image`` carries under ``config``, and the image's layout."""
    layout = family.describe(width=image.width, height=image.height, config=config)
    descriptor = RawImageDescriptor(
        family=family.name,
        modality=family.modality,
        payload=family.payload(layout),
        raw_image_uri=image.uri,
        fingerprint=fingerprint,
        vllm_modality=family.vllm_modality,
    )
    return descriptor, layout


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    tokenizer: Any,
    family: Family[Any],
    config: Any,
    store: OffloadStore,
    backend: str | None = None,
    add_generation_prompt: bool = True,
) -> RenderedPrompt:
    """Offload the images of ``messages`` into ``store`` and render the chat for ``family``.

    ``tokenizer`` is a transformers tokenizer with a chat template that renders each image part as one
    ``family.placeholder_token``. Descriptors carry the fingerprint of ``config`` under ``backend`` (None:
    the family's default, what vLLM's own image path runs).
    """
    fingerprint = family.fingerprint(config, check_backend(backend or family.default_backend))
    offloaded, stored = offload_images(messages, store)
    text = tokenizer.apply_chat_template(
        offloaded, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    rendered_ids = tokenizer.encode(text, add_special_tokens=False)
    marker = tokenizer.convert_tokens_to_ids(family.placeholder_token)
    if not isinstance(marker, int) or tokenizer.convert_ids_to_tokens(marker) != family.placeholder_token:
        raise ValueError(f"tokenizer has no {family.placeholder_token} token for family {family.name}")
    markers = [i for i, token in enumerate(rendered_ids) if token == marker]
    if len(markers) != len(stored):
        raise ValueError(
            f"the chat template rendered {len(markers)} {family.placeholder_token} tokens for {len(stored)} images"
        )

    token_ids: list[int] = []
    images: list[RenderedImage] = []
    start = 0
    for position, image in zip(markers, stored, strict=True):
        descriptor, layout = describe_stored_image(family, config, image, fingerprint=fingerprint)
        token_ids.extend(rendered_ids[start:position])
        images.append(RenderedImage(descriptor, image.mm_hash, len(token_ids), layout.num_placeholder_tokens))
        token_ids.extend([marker] * layout.num_placeholder_tokens)
        start = position + 1
    token_ids.extend(rendered_ids[start:])

    mm_token_type_ids = [0] * len(token_ids)
    for rendered in images:
        mm_token_type_ids[rendered.offset : rendered.offset + rendered.length] = [1] * rendered.length
    return RenderedPrompt(token_ids=token_ids, mm_token_type_ids=mm_token_type_ids, images=images)
