"""The raw-image wire contract: offload store, descriptors, refs, families (layout math), rendering."""

from rawmm.contract.errors import REASONS, ImageIngestError, InvalidImageRef
from rawmm.contract.families import (
    BACKENDS,
    FAMILIES,
    PRESETS,
    Family,
    KimiK25Config,
    Layout,
    QwenVLConfig,
    get_family,
    resolve_preset,
)
from rawmm.contract.messages import offload_message_images
from rawmm.contract.refs import REF_PREFIX, RawImageDescriptor, RawImageRef, encode_ref, parse_ref
from rawmm.contract.store import OffloadStore, StoredImage, resolve_uri

__all__ = [
    "BACKENDS",
    "FAMILIES",
    "PRESETS",
    "REASONS",
    "REF_PREFIX",
    "Family",
    "ImageIngestError",
    "InvalidImageRef",
    "KimiK25Config",
    "Layout",
    "OffloadStore",
    "QwenVLConfig",
    "RawImageDescriptor",
    "RawImageRef",
    "StoredImage",
    "encode_ref",
    "get_family",
    "offload_message_images",
    "parse_ref",
    "resolve_preset",
    "resolve_uri",
]
