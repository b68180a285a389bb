"""The trainer's own Prometheus metrics (docs/architecture.md §8). Images materialized and time in
materialization are the shared `rawmm.materialize.metrics` series with `side="trainer"`."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

STEP = Gauge("rawmm_trainer_step", "Last training step done (its weights published to the engines)")
LOSS = Gauge("rawmm_trainer_loss", "Policy-gradient loss of the last step")
REWARD_MEAN = Gauge("rawmm_trainer_reward_mean", "Mean reward of the samples trained on in the last step")
MISSING_IMAGES = Counter(
    "rawmm_trainer_missing_images",
    "Images that could not be loaded for training (their samples trained with zero loss)",
)
TOKENS = Counter("rawmm_trainer_tokens", "Tokens forwarded by the trainer (all ranks of this process)")
