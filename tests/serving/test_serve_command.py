"""`rawmm serve` arguments: the cache budget knob and one-line errors before anything is loaded."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from ports import free_port

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
        (["--max-image-pixels", "-5"], "--max-image-pixels must be at least 1, got -5"),
        (["--max-image-pixels", "0"], "--max-image-pixels must be at least 1, got 0"),
        (["--max-pixels-in-flight", "0"], "--max-pixels-in-flight must be at least 1, got 0"),
        (["--engine", "vllm", "--dtype", "bfloat16"], "give vLLM its own after `--`"),
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


@pytest.mark.parametrize(
    ("config", "message"), [("null", "does not hold a JSON object"), ("{", "is not valid JSON")]
)
def test_a_config_json_that_is_no_object_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str, message: str
) -> None:
    (tmp_path / "config.json").write_text(config)
    assert main(["serve", "--model", str(tmp_path), "--offload-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err


def test_weights_that_do_not_load_are_a_one_line_error(
    tmp_path: Path, tiny_qwen2_vl: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    broken = shutil.copytree(tiny_qwen2_vl, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"\x07" * 100)
    argv = ["serve", "--model", str(broken), "--offload-root", str(tmp_path), "--port", str(free_port())]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"rawmm serve: error: cannot load {broken}: "), err


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("/missing/checkpoint", "no such directory"),
        ("./rel", "no such directory"),
        ("a/b/c", "no such directory"),
    ],
)
def test_a_missing_model_path_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, message: str
) -> None:
    assert main(["serve", "--model", model, "--offload-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"rawmm serve: error: --model {model}: {message}"


def test_out_of_range_ports_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for port in ("99999", "0", "-1", "http"):
        with pytest.raises(SystemExit) as info:
            main(["serve", "--model", str(tmp_path), "--offload-root", str(tmp_path), "--port", port])
        assert info.value.code == 2
        assert "--port" in capsys.readouterr().err


def test_a_busy_port_is_one_line_and_a_non_zero_exit_within_a_second(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys
    import time

    (tmp_path / "config.json").write_text('{"model_type": "qwen2_vl"}')
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "rawmm.cli", "serve", "--model", str(tmp_path), "--offload-root", str(tmp_path),
             "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        elapsed = time.monotonic() - started
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == f"rawmm serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    # The interpreter and the CLI start in this time too; the model is never loaded.
    assert elapsed < 5.0, elapsed
