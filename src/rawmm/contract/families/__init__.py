"""Model families: layout math, payloads and processor identity per family (DESIGN §3.4)."""

from __future__ import annotations

import json
from pathlib import Path
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


# config.json model_type -> family, for checkpoints named by directory rather than preset.
MODEL_TYPES: dict[str, str] = {
    "qwen2_vl": "qwen_vl",
    "qwen2_5_vl": "qwen_vl",
    "qwen3_vl": "qwen_vl",
    "qwen3_vl_moe": "qwen_vl",
    "kimi_k25": "kimi_k25",
}


def family_of_checkpoint(path: str | Path) -> Family[Any]:
    """The family of a local checkpoint directory, from its ``config.json`` ``model_type``."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; is it a checkpoint directory?")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {model_type!r} is not a supported family; known: {sorted(MODEL_TYPES)}"
        )
    return FAMILIES[MODEL_TYPES[model_type]]


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
    "family_of_checkpoint",
    "QwenVLConfig",
    "QwenVLFamily",
    "get_family",
    "resolve_preset",
    "vllm_modality_of",
]
