"""Fixtures of the trainer tests: a tiny run's config and its rollout factory (see rollout_kit)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from rollout_kit import RolloutFactory, run_config

from rawmm.config import RunConfig


@pytest.fixture
def make_config(tiny_qwen2_vl: Path, tmp_path: Path) -> Callable[..., RunConfig]:
    return lambda **trainer: run_config(tiny_qwen2_vl, tmp_path / "shared", **trainer)


@pytest.fixture
def rollouts(make_config: Callable[..., RunConfig]) -> RolloutFactory:
    return RolloutFactory(make_config())
