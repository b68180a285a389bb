"""The engine's full path for one ref: checks, confined verified read, decode, processor, engine item."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from rawmm.contract import RawImageRef
from rawmm.materialize import metrics
from rawmm.materialize.adapters import get_adapter
from rawmm.materialize.items import EngineItem
from rawmm.materialize.processor import LoadedProcessor
from rawmm.materialize.read import open_ref_image


def materialize_engine_item(
    ref: RawImageRef,
    *,
    placeholder_length: int,
    processor: LoadedProcessor,
    roots: Sequence[Path],
    max_pixels: int,
    admit: Callable[[int], AbstractContextManager[Any]] = nullcontext,
) -> EngineItem:
    """Materialize one parsed ref for the engine (blocking: run it in a worker thread).

    The cheap checks (family, modality, fingerprint) come before any file access; the outer hash was
    checked against the ref when the request features were parsed. ``roots`` are resolved directories (a
    symlinked one refuses every ref). ``admit`` gets the image's pixel count from its header, once the file
    is read and verified; decoding and processing run inside the context it returns (a ``PixelBudget``'s
    admission), and the time spent waiting to enter it is not materialization time.
    """
    started = time.perf_counter()
    adapter = get_adapter(ref.family)
    descriptor = ref.descriptor()
    adapter.check_descriptor(descriptor, processor)
    opened = open_ref_image(ref, mm_hash=ref.mm_hash, roots=roots, max_pixels=max_pixels)
    reading = time.perf_counter() - started
    with admit(opened.pixels):
        admitted = time.perf_counter()
        item = adapter.materialize_for_engine(opened.decode(), descriptor, processor, placeholder_length)
        processing = time.perf_counter() - admitted
    metrics.MATERIALIZE_SECONDS.labels(side="engine").observe(reading + processing)
    metrics.IMAGES_MATERIALIZED.labels(side="engine").inc()
    return item
