"""What materialization produces: engine items (one image each) and trainer inputs (a batch)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class ForwardPolicy:
    """How a family's model wants its forward pass: who computes positions, and what it needs.

    Qwen computes its own M-RoPE positions from the token types and grids (pass no position ids, but
    ``mm_token_type_ids``); Kimi takes plain position ids.
    """

    pass_position_ids: bool
    requires_mm_token_type_ids: bool


class FieldKind(StrEnum):
    """How one image's tensor joins those of other images in a batch (vLLM's field kinds)."""

    FLAT = "flat"  # concatenated along dim 0 (e.g. pixel patches: one row per patch)
    BATCHED = "batched"  # stacked along a new dim 0 (e.g. a grid: one row per image)


@dataclass(frozen=True)
class EngineItem:
    """One materialized image for an engine, engine-neutral: tensors plus how each joins a batch.

    ``modality`` is the engine modality key the item is filed under (``image``; Kimi: ``vision_chunk``).
    Items are shared between requests by the cache and must never be mutated.
    """

    modality: str
    tensors: Mapping[str, torch.Tensor]
    kinds: Mapping[str, FieldKind]

    def __post_init__(self) -> None:
        if set(self.tensors) != set(self.kinds):
            raise ValueError(f"tensors {sorted(self.tensors)} and kinds {sorted(self.kinds)} disagree")
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "kinds", MappingProxyType(dict(self.kinds)))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def collate(items: Sequence[EngineItem]) -> dict[str, torch.Tensor]:
    """The model kwargs for ``items`` (one modality, prompt order): flat fields concatenated, batched stacked."""
    if not items:
        return {}
    kinds = items[0].kinds
    if any(item.kinds != kinds or item.modality != items[0].modality for item in items):
        raise ValueError("cannot collate engine items of different modalities or fields")
    return {
        key: (torch.cat if kind is FieldKind.FLAT else torch.stack)([item.tensors[key] for item in items])
        for key, kind in kinds.items()
    }


@dataclass(frozen=True)
class TrainerInputs:
    """A batch of images as the model's kwargs (grids checked), plus the family's forward policy."""

    kwargs: dict[str, torch.Tensor]
    forward_policy: ForwardPolicy
