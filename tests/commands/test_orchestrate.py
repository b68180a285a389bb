"""`rawmm orchestrate`: user errors are one clear line (exit 2) before anything starts."""

from __future__ import annotations

import pytest
import yaml

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
