"""Model families: layout math, payloads and processor identity per family (DESIGN §3.4)."""

from __future__ import annotations

from typing import Any

from rawmm.contract.errors import InvalidImageRef
from rawmm.contract.families.base import BACKENDS, Family, Layout, check_backend
from rawmm.contract.families.kimi_k25 import KimiK25Config, KimiK25Family
from rawmm.contract.families.qwen_vl import QwenVLConfig, QwenVLFamily

FAMILIES: dict[str, Family[Any]] = {family.name: family for family in (QwenVLFamily(), KimiK25Family())}
# Model presets (as named in run configs) -> the family that owns them.
PRESETS: dict[str, str] = {preset: family.name for family in FAMILIES.values() for preset in family.presets}


def get_family(name: str) -> Family[Any]:
    """The family called ``name``; anything else is ``InvalidImageRef("unknown_family")``."""
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):
        raise InvalidImageRef(
            "unknown_family", f"unknown model family {name!r}; known: {sorted(FAMILIES)}"
        ) from None


def resolve_preset(preset: str) -> tuple[Family[Any], Any]:
    """The family and config of a model preset such as ``qwen3_vl``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; presets: {sorted(PRESETS)}")
    family = FAMILIES[PRESETS[preset]]
    return family, family.preset(preset)


def vllm_modality_of(family_name: str) -> str | None:
    """The engine modality override of a known family, None for unknown families or plain images."""
    family = FAMILIES.get(family_name)
    return family.vllm_modality if family is not None else None


__all__ = [
    "BACKENDS",
    "FAMILIES",
    "PRESETS",
    "Family",
    "KimiK25Config",
    "KimiK25Family",
    "Layout",
    "check_backend",
    "QwenVLConfig",
    "QwenVLFamily",
    "get_family",
    "resolve_preset",
    "vllm_modality_of",
]
