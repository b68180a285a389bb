"""Prometheus metrics of materialization, which the engine and the trainer both do (docs/architecture.md §8).

Every process exports only what it owns. The series both sides use (labelled by ``side``) live in the
default registry from import: a labelled metric shows no samples until a child is used, so the trainer
exports only ``side="trainer"`` series. The cache metrics are created unregistered and join the default
registry with the engine's own (`rawmm.serving.metrics`), so a trainer that imports this module does not
export a zero-valued cache.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Shared: engine and trainer.
MATERIALIZE_SECONDS = Histogram(
    "rawmm_materialize_seconds",
    "Time to turn one raw image ref into model inputs (read, verify, decode, process)",
    ["side"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
IMAGES_MATERIALIZED = Counter(
    "rawmm_images_materialized",
    "Images materialized from raw refs (cache misses only on the engine)",
    ["side"],
)
INVALID_MM_IMAGE_REF = Counter(
    "rawmm_invalid_mm_image_ref",
    "Raw image refs refused with a client error, by reason (malformed_ref, missing_file, hash_mismatch, ...)",
    ["reason"],
)

# The engine's materialize cache: registered by rawmm.serving.metrics.register_engine_metrics().
CACHE_HITS = Counter(
    "rawmm_materialize_cache_hits", "Materialize cache lookups served from the cache", registry=None
)
CACHE_MISSES = Counter(
    "rawmm_materialize_cache_misses",
    "Materialize cache lookups that started a materialization",
    registry=None,
)
CACHE_INFLIGHT_JOINS = Counter(
    "rawmm_materialize_cache_inflight_joins",
    "Materialize cache lookups that joined a materialization already in flight",
    registry=None,
)
CACHE_EVICTIONS = Counter(
    "rawmm_materialize_cache_evictions", "Items evicted from the materialize cache", registry=None
)
CACHE_BYTES = Gauge("rawmm_materialize_cache_bytes", "Bytes held by the materialize cache", registry=None)
CACHE_CAPACITY_BYTES = Gauge(
    "rawmm_materialize_cache_capacity_bytes", "Byte budget of the materialize cache (0 = off)", registry=None
)
CACHE_ENTRIES = Gauge("rawmm_materialize_cache_entries", "Items held by the materialize cache", registry=None)
CACHE_METRICS = (
    CACHE_HITS,
    CACHE_MISSES,
    CACHE_INFLIGHT_JOINS,
    CACHE_EVICTIONS,
    CACHE_BYTES,
    CACHE_CAPACITY_BYTES,
    CACHE_ENTRIES,
)
