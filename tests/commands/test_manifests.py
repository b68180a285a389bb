"""`rawmm manifests` (`rawmm.commands.manifests`): the CRD file written only when it changed, `--check`
telling a stale one, and `--render` of an RLRun file with every unusable file as one line.

The CRD's first write and `--print`, and the children `--render` builds, are tested with the operator
(tests/operator/test_operator_commands.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from rawmm.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "manifests" / "examples" / "tiny-cpu.yaml"
CRD_FILE = "rlruns.rawmm.dev.yaml"


def current_crd(capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["manifests", "--print"]) == 0
    return capsys.readouterr().out


def test_an_up_to_date_crd_is_left_untouched(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / CRD_FILE
    path.write_text(current_crd(capsys))
    os.utime(path, ns=(1, 1))
    assert main(["manifests", "--out-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == ""  # no "wrote"
    assert path.stat().st_mtime_ns == 1


def test_a_stale_crd_is_replaced_and_a_missing_folder_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    crd = current_crd(capsys)
    stale = tmp_path / CRD_FILE
    stale.write_text(crd.replace("v1alpha1", "v0"))
    assert main(["manifests", "--out-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"wrote {stale}\n"
    assert stale.read_text() == crd
    nested = tmp_path / "a" / "b"
    assert main(["manifests", "--out-dir", str(nested)]) == 0
    assert (nested / CRD_FILE).read_text() == crd


def test_check_reports_a_stale_crd_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / CRD_FILE
    path.write_text("stale\n")
    assert main(["manifests", "--out-dir", str(tmp_path), "--check"]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"{path} is out of date: run `rawmm manifests`\n")
    assert path.read_text() == "stale\n"


def test_render_places_every_child_in_the_runs_namespace_owned_by_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = yaml.safe_load(EXAMPLE.read_text())
    assert main(["manifests", "--render", str(EXAMPLE)]) == 0
    children = list(yaml.safe_load_all(capsys.readouterr().out))
    assert children
    for child in children:
        assert child["metadata"]["namespace"] == "default", child["metadata"]
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("RLRun", "tiny-cpu", "<uid of the RLRun>")
    assert "Secret" not in {child["kind"] for child in children}  # the weights token is never rendered
    body["metadata"]["namespace"] = "team-a"
    placed = tmp_path / "placed.yaml"
    placed.write_text(yaml.safe_dump(body))
    assert main(["manifests", "--render", str(placed)]) == 0
    namespaces = {child["metadata"]["namespace"] for child in yaml.safe_load_all(capsys.readouterr().out)}
    assert namespaces == {"team-a"}


def test_render_writes_no_crd(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["manifests", "--render", str(EXAMPLE), "--out-dir", str(tmp_path)]) == 0
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"kind: Deployment\nmetadata: {name: a}\n", "{path}: not an RLRun manifest"),
        (b"- kind: RLRun\n", "{path}: not an RLRun manifest"),
        (b"", "{path}: not an RLRun manifest"),
        (b"kind: RLRun\nkind: RLRun\n", "{path}:2:1: not valid YAML"),  # a key given twice
        (b"kind: RLRun\nmetadata: {name: \xff}\n", "cannot read {path}: "),  # not UTF-8
    ],
    ids=["another kind", "a list", "empty", "a duplicate key", "not utf-8"],
)
def test_render_of_a_file_that_is_no_rlrun_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    assert main(["manifests", "--render", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"rawmm manifests: error: {message.format(path=path)}") and err.count("\n") == 1, (
        err
    )


def test_render_of_a_missing_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "absent.yaml"
    assert main(["manifests", "--render", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rawmm manifests: error: cannot read {path}: ") and err.count("\n") == 1, err


def test_render_of_an_invalid_spec_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("kind: RLRun\nmetadata: {name: a}\nspec: {model: {name: m}, trainer: {steps: 0}}\n")
    assert main(["manifests", "--render", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rawmm manifests: error: {path}: ") and "steps" in err and err.count("\n") == 1, (
        err
    )
