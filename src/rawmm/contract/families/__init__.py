"""Model families: layout math, payloads and processor identity per family (docs/architecture.md, "The
contract"). Each family's class is its one record (presets, model types, layout); what the rest of rawmm
knows about families (the run config's preset type, checkpoint detection, adapters) derives from here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from rawmm.contract.errors import InvalidImageRef
from rawmm.contract.families.base import BACKENDS, Backend, Family, Layout, check_backend, read_json_object
from rawmm.contract.families.kimi_k25 import KimiK25Config, KimiK25Family, KimiK25Preset
from rawmm.contract.families.qwen_vl import QwenVLConfig, QwenVLFamily, QwenVLPreset

FAMILIES: dict[str, Family[Any]] = {family.name: family for family in (QwenVLFamily(), KimiK25Family())}
# A preset name as run configs spell it; a family added above adds its preset type here.
Preset = Literal[QwenVLPreset, KimiK25Preset]
# Model presets -> the family that owns them.
PRESETS: dict[str, str] = {preset: family.name for family in FAMILIES.values() for preset in family.presets}
# config.json model_type -> family.
MODEL_TYPES: dict[str, str] = {
    model_type: family.name for family in FAMILIES.values() for model_type in family.model_types
}


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


def checkpoint_file(path: str | Path, name: str) -> Path | None:
    """A file of a local checkpoint dir, or of a hub id (through transformers' cache); None if absent."""
    local = Path(path)
    if local.is_dir():
        file = local / name
        return file if file.is_file() else None
    # Imported here: only hub ids need transformers, and `import rawmm.contract` must not pull it in.
    from transformers.utils.hub import cached_file

    resolved = cached_file(str(path), name, _raise_exceptions_for_missing_entries=False)
    return Path(resolved) if resolved else None


def detect_family(path: str | Path) -> Family[Any]:
    """The family of a checkpoint (a local dir or a hub id): its ``config.json`` model type, else the first
    family whose marker keys its ``preprocessor_config.json`` holds."""
    config_file = checkpoint_file(path, "config.json")
    model_type = read_json_object(config_file).get("model_type") if config_file else None
    if model_type in MODEL_TYPES:
        return FAMILIES[MODEL_TYPES[model_type]]
    preprocessor_file = checkpoint_file(path, "preprocessor_config.json")
    preprocessor = read_json_object(preprocessor_file) if preprocessor_file else {}
    for family in FAMILIES.values():
        if any(marker in preprocessor for marker in family.preprocessor_markers):
            return family
    if config_file is None:
        raise ValueError(f"{path} has no config.json; is it a checkpoint directory or hub id?")
    raise ValueError(f"{path}: model type {model_type!r} is not supported; supported: {sorted(MODEL_TYPES)}")


def vllm_modality_of(family_name: str) -> str | None:
    """The engine modality override of a known family, None for unknown families or plain images."""
    family = FAMILIES.get(family_name)
    return family.vllm_modality if family is not None else None


__all__ = [
    "BACKENDS",
    "FAMILIES",
    "MODEL_TYPES",
    "PRESETS",
    "Backend",
    "Family",
    "KimiK25Config",
    "KimiK25Family",
    "Layout",
    "Preset",
    "check_backend",
    "checkpoint_file",
    "detect_family",
    "QwenVLConfig",
    "QwenVLFamily",
    "get_family",
    "resolve_preset",
    "vllm_modality_of",
]
