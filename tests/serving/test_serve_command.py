"""`rawmm serve` arguments: the cache budget knob and one-line errors before anything is loaded."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rawmm.cli import main
from rawmm.commands import serve


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_cache_budget_comes_from_the_flag_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ("--model", "m", "--offload-root", str(tmp_path))
    monkeypatch.delenv(serve.CACHE_SIZE_ENV, raising=False)
    assert parse(*base).materialize_cache_size == "2Gi"
    monkeypatch.setenv(serve.CACHE_SIZE_ENV, "512Mi")
    assert parse(*base).materialize_cache_size == "512Mi"
    assert parse(*base, "--materialize-cache-size", "0").materialize_cache_size == "0"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--materialize-cache-size", "2GB"], "--materialize-cache-size"),
        (["--offload-root", "/nonexistent/offload"], "is not a directory"),
        (["--", "--max-model-len", "4096"], "--engine vllm only"),
    ],
)
def test_bad_arguments_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    argv = ["serve", "--model", str(tmp_path), *extra]
    if "--offload-root" not in extra:
        argv[3:3] = ["--offload-root", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rawmm serve: error:") and message in err and "\n" not in err


def test_a_model_without_a_supported_processor_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert main(["serve", "--model", str(tmp_path), "--offload-root", str(tmp_path)]) == 2
    assert "not supported" in capsys.readouterr().err
