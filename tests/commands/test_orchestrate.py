"""`rawmm orchestrate` (`rawmm.commands.orchestrate`): user errors are one clear line (exit 2) before anything
starts, and so are the run's own failures. The orchestrator's loop is tested in tests/rl/orchestrator."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ports import free_port

from rawmm.cli import main


def write_config(tmp_path, **sections) -> str:
    data = {"model": {"path": str(tmp_path / "no-model"), "preset": "qwen2_vl"}, "shared_dir": str(tmp_path)}
    data.update(sections)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({}, "inference.urls is empty"),
        ({"inference": {"urls": ["ftp://x"]}}, "inference.urls: engine URL 'ftp://x' must start with http"),
        (
            {
                "inference": {"urls": ["http://127.0.0.1:9"]},
                "orchestrator": {"environment": {"name": "nope"}},
            },
            "orchestrator.environment: unknown environment 'nope'",
        ),
        (
            {"inference": {"urls": ["http://127.0.0.1:9"]}, "orchestrator": {"max_async_level": 0}},
            "orchestrator.max_async_level",
        ),
        (
            {"inference": {"urls": ["http://127.0.0.1:9"]}},
            "model.path",  # the tokenizer cannot be loaded from a missing checkpoint
        ),
    ],
)
def test_bad_configs_are_one_line_errors(tmp_path, capsys, sections, message):
    assert main(["orchestrate", write_config(tmp_path, **sections)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "rollouts").exists()


def test_a_missing_config_file_is_a_one_line_error(tmp_path, capsys):
    assert main(["orchestrate", str(tmp_path / "absent.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "absent.yaml" in err and "\n" not in err and "Traceback" not in err


def test_an_environment_that_cannot_be_imported_is_a_one_line_error(tmp_path, capsys):
    """The config only checks a user environment's form; the orchestrator imports it."""
    config = write_config(
        tmp_path,
        inference={"urls": ["http://127.0.0.1:9"]},
        orchestrator={"environment": {"name": "rawmm_no_such_module:Environment"}},
    )
    assert main(["orchestrate", config]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rawmm orchestrate: error: orchestrator.environment: ") and "\n" not in err, err
    assert "rawmm_no_such_module" in err


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_steps_below_one_are_refused(tmp_path, capsys, steps):
    config = write_config(tmp_path, inference={"urls": ["http://127.0.0.1:9"]})
    assert main(["orchestrate", config, "--steps", steps]) == 2
    assert f"--steps must be at least 1, got {steps}" in capsys.readouterr().err
    assert not (tmp_path / "rollouts").exists()


def test_no_engine_coming_up_in_time_is_a_one_line_error(tmp_path, capsys, tiny_qwen2_vl: Path):
    config = write_config(
        tmp_path,
        model={"path": str(tiny_qwen2_vl), "preset": "qwen2_vl"},
        inference={"urls": [f"http://127.0.0.1:{free_port()}"]},  # nothing listens there
        monitoring={"orchestrator_metrics_port": 0},
    )
    assert main(["orchestrate", config, "--engine-down-timeout", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no engine replica became healthy within 1s" in err, err
    assert "\n" not in err and "Traceback" not in err
    assert not list((tmp_path / "rollouts").glob("step_*"))
