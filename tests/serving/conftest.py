"""Fixtures for serving tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_harness import MAX_IMAGE_PIXELS, Server, running_server


@pytest.fixture(scope="session")
def kimi_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Kimi K2.5 checkpoint directory as far as image processing goes, with small patch limits."""
    path = tmp_path_factory.mktemp("kimi_k25_serving")
    (path / "config.json").write_text(json.dumps({"model_type": "kimi_k25"}))
    media_proc_cfg = {
        "patch_size": 14,
        "merge_kernel_size": 2,
        "in_patch_limit": 256,
        "patch_limit_on_one_side": 24,
    }
    (path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media_proc_cfg}))
    return path


@pytest.fixture(scope="session")
def server(tiny_qwen2_vl: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One `rawmm serve --engine transformers` of the tiny Qwen2-VL for the HTTP and fuzz tests."""
    serve_args = ["--engine", "transformers", "--materialize-cache-size", "256Mi",
                  "--max-image-pixels", str(MAX_IMAGE_PIXELS)]  # fmt: skip
    with running_server(tiny_qwen2_vl, tmp_path_factory.mktemp("serve"), serve_args) as running:
        yield running
