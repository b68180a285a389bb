"""Fixtures of the retention tests: a run's shared directory with its offload store, and the tiny processor."""

from __future__ import annotations

from pathlib import Path

import pytest

from rawmm.contract import OffloadStore
from rawmm.contract.shared_dir import SharedDir
from rawmm.materialize import LoadedProcessor, load_processor


@pytest.fixture
def shared(tmp_path: Path) -> SharedDir:
    return SharedDir(tmp_path / "shared")


@pytest.fixture
def store(shared: SharedDir) -> OffloadStore:
    return OffloadStore(shared.offload_dir)


@pytest.fixture(scope="session")
def loaded(tiny_qwen2_vl: Path) -> LoadedProcessor:
    return load_processor(tiny_qwen2_vl)
