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
    detect_family,
    get_family,
    resolve_preset,
)
from rawmm.contract.features import FeatureImage, parse_features, request_features
from rawmm.contract.messages import offload_message_images
from rawmm.contract.refs import REF_PREFIX, RawImageDescriptor, RawImageRef, encode_ref, parse_ref
from rawmm.contract.render import RenderedImage, RenderedPrompt, describe_stored_image, render_chat
from rawmm.contract.store import OffloadStore, StoredImage, resolve_uri

__all__ = [
    "BACKENDS",
    "FAMILIES",
    "PRESETS",
    "REASONS",
    "REF_PREFIX",
    "Family",
    "FeatureImage",
    "ImageIngestError",
    "InvalidImageRef",
    "KimiK25Config",
    "Layout",
    "OffloadStore",
    "QwenVLConfig",
    "RawImageDescriptor",
    "RawImageRef",
    "RenderedImage",
    "RenderedPrompt",
    "StoredImage",
    "describe_stored_image",
    "encode_ref",
    "detect_family",
    "get_family",
    "offload_message_images",
    "parse_features",
    "parse_ref",
    "render_chat",
    "request_features",
    "resolve_preset",
    "resolve_uri",
]
