"""The one `rawmm serve` command line of an engine replica (local runs and the operator's pods)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rawmm.commands import serve
from rawmm.config import RunConfig
from rawmm.config.serve_argv import serve_argv

VLLM = {
    "name": "r",
    "model": {"path": "/models/qwen", "preset": "qwen2_vl", "processor_backend": "torchvision"},
    "shared_dir": "/shared",
    "inference": {"engine": "vllm", "materialize_cache_size": "512Mi", "vllm_args": ["--enforce-eager"]},
}


def parse(argv: list[str]) -> argparse.Namespace:
    """What `rawmm serve` itself makes of `argv`."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    serve.add_arguments(parser)
    assert argv[0] == "serve"
    return parser.parse_args(argv[1:])


def test_every_setting_reaches_rawmm_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(serve.CACHE_SIZE_ENV, raising=False)
    config = RunConfig.model_validate(VLLM)
    args = parse(serve_argv(config, host="0.0.0.0", port=8123))
    assert (args.model, args.engine, args.host, args.port) == ("/models/qwen", "vllm", "0.0.0.0", 8123)
    assert args.offload_root == [Path("/shared/images")] and args.weights_root == Path("/shared/checkpoints")
    assert (args.materialize_cache_size, args.processor_backend) == ("512Mi", "torchvision")
    assert args.vllm_args == ["--enforce-eager"] and not args.trust_remote_code


def test_the_cache_budget_is_a_flag_whatever_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(serve.CACHE_SIZE_ENV, "7Gi")
    plain = RunConfig.model_validate({**VLLM, "inference": {"engine": "transformers"}})
    remote = RunConfig.model_validate({**VLLM, "model": {**VLLM["model"], "trust_remote_code": True}})
    args = parse(serve_argv(plain, host="127.0.0.1", port=8100))
    assert args.materialize_cache_size == plain.inference.materialize_cache_size == "2Gi"
    assert args.vllm_args == []
    assert parse(serve_argv(remote, host="127.0.0.1", port=8100)).trust_remote_code
