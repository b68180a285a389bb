"""Telling a missing checkpoint from a hub id before anything loads (`rawmm.config.model_path`). How
`rawmm serve` and `rawmm run` word the answer is tested with them (tests/serving/test_serve_command.py,
tests/run/test_local.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rawmm.config.model_path import model_path_problem


def test_a_checkpoint_directory_names_a_model(tmp_path: Path) -> None:
    assert model_path_problem(str(tmp_path)) is None
    assert model_path_problem(f"{tmp_path}/") is None


def test_a_directory_named_like_a_hub_id_is_taken_as_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "Qwen" / "tiny").mkdir(parents=True)
    (tmp_path / "file-not-dir").write_text("")
    monkeypatch.chdir(tmp_path)
    assert model_path_problem("Qwen/tiny") is None
    assert model_path_problem("file-not-dir") == "is not a checkpoint directory"


def test_a_path_under_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    assert model_path_problem("~/models/tiny") is None
    assert model_path_problem("~/models/absent") == "no such directory"


def test_a_file_is_not_a_checkpoint_directory(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    assert model_path_problem(str(weights)) == "is not a checkpoint directory"


@pytest.mark.parametrize(
    "hub_id",
    ["Qwen/Qwen2-VL-2B-Instruct", "moonshotai/Kimi-K2.5", "gpt2", "owner_1/name.v2", "a/b"],
)
def test_a_hub_id_that_is_not_a_local_directory_is_left_to_the_hub(
    hub_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # nothing of that name here
    assert model_path_problem(hub_id) is None


@pytest.mark.parametrize(
    "path",
    [
        "/missing/checkpoint",  # absolute
        "./rel",  # relative
        "../up",
        "a/b/c",  # two slashes: no hub id has them
        "owner/",  # an empty name
        "/name",
        "-name",  # a hub name starts with a letter or digit
        "_owner/name",
        "owner/.name",
        "has space",
    ],
)
def test_a_missing_local_path_is_no_such_directory(
    path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert model_path_problem(path) == "no such directory"


def test_the_home_of_an_unknown_user_is_no_such_directory() -> None:
    assert model_path_problem("~rawmm-no-such-user/ckpt") == "no such directory"
