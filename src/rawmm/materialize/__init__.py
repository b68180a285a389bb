"""Materialization: raw image refs back into model inputs, for the engine and the trainer
(docs/architecture.md §4).

Names resolve lazily, so ``from rawmm.materialize import parse_byte_size`` (the config and the operator)
does not import torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "DEFAULT_MAX_IMAGE_PIXELS": "rawmm.materialize.decode",
    "EngineItem": "rawmm.materialize.items",
    "FamilyAdapter": "rawmm.materialize.adapters",
    "FieldKind": "rawmm.materialize.items",
    "ForwardPolicy": "rawmm.materialize.items",
    "KimiK25ImageProcessor": "rawmm.materialize.kimi",
    "LoadedProcessor": "rawmm.materialize.processor",
    "MaterializeCache": "rawmm.materialize.cache",
    "TrainerInputs": "rawmm.materialize.items",
    "cache_key": "rawmm.materialize.cache",
    "collate": "rawmm.materialize.items",
    "get_adapter": "rawmm.materialize.adapters",
    "load_processor": "rawmm.materialize.processor",
    "materialize_engine_item": "rawmm.materialize.engine",
    "parse_byte_size": "rawmm.config.quantity",
    "qwen_image_processor": "rawmm.materialize.processor",
    "read_ref_image": "rawmm.materialize.read",
}

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "EngineItem",
    "FamilyAdapter",
    "FieldKind",
    "ForwardPolicy",
    "KimiK25ImageProcessor",
    "LoadedProcessor",
    "MaterializeCache",
    "TrainerInputs",
    "cache_key",
    "collate",
    "get_adapter",
    "load_processor",
    "materialize_engine_item",
    "parse_byte_size",
    "qwen_image_processor",
    "read_ref_image",
]

if TYPE_CHECKING:
    from rawmm.config.quantity import parse_byte_size
    from rawmm.materialize.adapters import FamilyAdapter, get_adapter
    from rawmm.materialize.cache import MaterializeCache, cache_key
    from rawmm.materialize.decode import DEFAULT_MAX_IMAGE_PIXELS
    from rawmm.materialize.engine import materialize_engine_item
    from rawmm.materialize.items import EngineItem, FieldKind, ForwardPolicy, TrainerInputs, collate
    from rawmm.materialize.kimi import KimiK25ImageProcessor
    from rawmm.materialize.processor import LoadedProcessor, load_processor, qwen_image_processor
    from rawmm.materialize.read import read_ref_image


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rawmm.materialize' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
