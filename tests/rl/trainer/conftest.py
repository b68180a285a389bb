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


@pytest.fixture(scope="session")
def tiny_kimi_k25(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Kimi K2.5 checkpoint (seed 0)."""
    from rawmm.run.tiny import build_tiny_model

    return build_tiny_model("kimi_k25", tmp_path_factory.mktemp("tiny") / "kimi_k25", seed=0)


PRESETS = {"tiny_qwen2_vl": "qwen2_vl", "tiny_qwen3_vl": "qwen3_vl", "tiny_kimi_k25": "kimi_k25"}


@pytest.fixture(params=list(PRESETS))
def family_model(request: pytest.FixtureRequest) -> tuple[Path, str]:
    """Each family's tiny checkpoint (Qwen2-VL, Qwen3-VL, Kimi K2.5) with its preset."""
    return request.getfixturevalue(request.param), PRESETS[request.param]
