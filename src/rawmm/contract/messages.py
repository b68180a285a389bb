"""Offloading the images of chat messages: every image part becomes a ``file://`` ``image_url`` part."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rawmm.contract.errors import ImageIngestError, InvalidImageRef
from rawmm.contract.store import OffloadStore, StoredImage

# HF chat-format image parts name their source with one of these keys.
_HF_IMAGE_KEYS = ("image", "url", "path")


def image_source(part: Mapping[str, Any]) -> Any | None:
    """The image a content part carries (URL string, bytes, path or PIL image), or None for a non-image part.

    Accepted shapes: OpenAI ``{"type": "image_url", "image_url": {"url": ...}}`` and
    ``{"type": "image_url", "image_url": "..."}``, HF ``{"type": "image", "image" | "url" | "path": ...}``.
    """
    kind = part.get("type")
    if kind == "image_url":
        value = part.get("image_url")
        if isinstance(value, Mapping):
            value = value.get("url")
        if value is None:
            raise ImageIngestError("image_url part has no URL")
        return value
    if kind == "image":
        for key in _HF_IMAGE_KEYS:
            if part.get(key) is not None:
                return part[key]
        raise ImageIngestError(f"image part has none of the keys {_HF_IMAGE_KEYS}")
    return None


def _as_mapping(part: Any) -> Mapping[str, Any]:
    if isinstance(part, Mapping):
        return part
    if hasattr(part, "model_dump"):  # typed (pydantic) content parts
        dumped: dict[str, Any] = part.model_dump(exclude_none=True)
        return dumped
    raise ImageIngestError(f"content part must be an object, got {type(part).__name__}")


def offload_images(
    messages: Sequence[Mapping[str, Any]], store: OffloadStore
) -> tuple[list[dict[str, Any]], list[StoredImage]]:
    """Copies of ``messages`` with every image part offloaded, and the stored images in prompt order."""
    out: list[dict[str, Any]] = []
    stored: list[StoredImage] = []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts: list[Any] = []
        for p, raw_part in enumerate(content):
            where = f"message {m} part {p}"
            try:
                part = _as_mapping(raw_part)
                source = image_source(part)
                if source is None:
                    if part.get("type", "text") != "text":
                        raise ImageIngestError(f"unsupported content part type {part.get('type')!r}")
                    parts.append(part)  # typed parts become plain dicts, which chat templates index
                    continue
                image = store.put(source)
            except (ImageIngestError, InvalidImageRef) as exc:
                raise ImageIngestError(f"{where}: {exc}") from None
            stored.append(image)
            parts.append({"type": "image_url", "image_url": {"url": image.uri}})
        out.append({**message, "content": parts})
    return out, stored


def offload_message_images(
    messages: Sequence[Mapping[str, Any]], store: OffloadStore
) -> list[dict[str, Any]]:
    """Copies of ``messages`` whose image parts all read ``{"type": "image_url", "image_url": {"url": "file://..."}}``.

    The input is not modified. An unknown part shape raises ``ImageIngestError`` naming the part.
    """
    return offload_images(messages, store)[0]
