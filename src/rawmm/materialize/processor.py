"""Loading a checkpoint's image processor with an explicit backend, and its identity.

transformers 5 ships two image-processor backends (PIL and torchvision) whose pixel values differ by up
to ~0.03, so the trainer and the engines of one run must load the same one. The backend is always
chosen explicitly, and the identity (hence the fingerprint refs are checked against) is read back from
the processor actually loaded — never from what was asked for — so a silent fallback cannot go unseen.
Each family's adapter (``adapters.py``) loads its processor and says which backend a loaded one runs.

Engine items come as one of two pixel representations (``PIXELS``): ``normalized`` float32 model inputs
(the trainer, the transformers engine), or the ``uint8`` resized pixels before rescale and normalize, for
an engine whose vision tower normalizes on the device (vLLM's ``mm_device_do_normalize``): 4x smaller in
the cache and on the way to the engine core. The representation is part of the identity (hence of every
cache key), not of the fingerprint: both reach the model as the same normalized values, up to fp32
rounding of the one affine transform.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rawmm.contract.families import BACKENDS, Family, detect_family
from rawmm.materialize.adapters import get_adapter

PIXELS: tuple[str, ...] = ("normalized", "uint8")


@dataclass(frozen=True)
class LoadedProcessor:
    """An image processor plus who it is: family, layout/pixel config, backend, identity and fingerprint."""

    processor: Any
    family: Family[Any]
    config: Any
    backend: str
    pixels: str  # one of PIXELS: what engine items carry
    identity: str  # canonical JSON of family, config, backend, pixels, processor class (a cache-key part)
    fingerprint: str  # the family's short digest of (config, backend), as carried in refs


def qwen_image_processor(config: Any, backend: str = "pil") -> Any:
    """A transformers Qwen-VL image processor with ``config``'s layout and pixel values, on ``backend``.

    For writing a checkpoint's processor (tiny models, benchmarks); serving loads with ``load_processor``.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    if backend not in BACKENDS:
        raise ValueError(f"processor backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    processor_class = Qwen2VLImageProcessorPil if backend == "pil" else Qwen2VLImageProcessor
    return processor_class(
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
        patch_size=config.patch_size,
        merge_size=config.merge_size,
        temporal_patch_size=config.temporal_patch_size,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
    )


@functools.lru_cache(maxsize=16)
def _load(path: str, backend: str, trust_remote_code: bool, pixels: str) -> LoadedProcessor:
    family = detect_family(path)
    adapter = get_adapter(family.name)
    processor = adapter.load_image_processor(path, backend, trust_remote_code)
    loaded_backend = adapter.backend_of(processor)
    if loaded_backend != backend:
        raise ValueError(
            f"{path}: asked for the {backend} image-processor backend but transformers loaded "
            f"{type(processor).__name__} ({loaded_backend}); install what the {backend} backend needs"
        )
    config = family.config_from_processor(processor)
    identity = json.dumps(
        {
            "family": family.name,
            "config": dataclasses.asdict(config),
            "backend": loaded_backend,
            "pixels": pixels,
            "class": f"{type(processor).__module__}.{type(processor).__qualname__}",
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return LoadedProcessor(
        processor=processor,
        family=family,
        config=config,
        backend=loaded_backend,
        pixels=pixels,
        identity=identity,
        fingerprint=family.fingerprint(config, loaded_backend),
    )


def load_processor(
    path: str | Path, backend: str | None = None, trust_remote_code: bool = False, pixels: str = "normalized"
) -> LoadedProcessor:
    """The image processor of checkpoint ``path`` (a local dir or a hub id) with ``backend`` (None: its
    family's default, what vLLM's own image path runs), making engine items of the ``pixels``
    representation; cached."""
    if backend is None:
        backend = detect_family(path).default_backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown image-processor backend {backend!r}; expected one of {BACKENDS}")
    if pixels not in PIXELS:
        raise ValueError(f"unknown pixel representation {pixels!r}; expected one of {PIXELS}")
    local = Path(path)
    key = str(local.resolve()) if local.exists() else str(path)
    return _load(key, backend, trust_remote_code, pixels)
