from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from rawmm.cli import main
from rawmm.contract import OffloadStore, get_family, parse_ref


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "shots"
    (folder / "nested").mkdir(parents=True)
    Image.new("RGB", (640, 480), "red").save(folder / "a.png")
    Image.new("RGB", (100, 30), "blue").save(folder / "nested" / "b.jpg")
    (folder / "notes.txt").write_text("not an image, skipped when walking folders")
    return folder


def test_ingest_folder_prints_refs_for_a_preset(
    capsys: pytest.CaptureFixture[str], image_folder: Path, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    code, out, _ = run_cli(
        capsys, "ingest", str(image_folder), "--offload-root", str(root), "--preset", "qwen3_vl"
    )
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [Path(line["source"]).name for line in lines] == ["a.png", "b.jpg"]
    qwen = get_family("qwen_vl")
    config = qwen.preset("qwen3_vl")
    for line in lines:
        ref = parse_ref(line["ref"])
        layout = qwen.describe(width=line["width"], height=line["height"], config=config)
        assert (
            ref.payload == qwen.payload(layout)
            and line["placeholder_tokens"] == layout.num_placeholder_tokens
        )
        # No --backend: the one vLLM's own Qwen-VL path runs, as `rawmm serve` and the run config default to.
        assert ref.fingerprint == qwen.fingerprint(config, "torchvision")
        assert OffloadStore(root).read_verified(ref.raw_image_uri, ref.mm_hash)


def test_ingest_without_a_model_prints_uris(
    capsys: pytest.CaptureFixture[str], image_folder: Path, tmp_path: Path
) -> None:
    code, out, _ = run_cli(
        capsys, "ingest", str(image_folder / "a.png"), "--offload-root", str(tmp_path / "s")
    )
    (line,) = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and "ref" not in line and line["uri"].startswith(f"file://{tmp_path / 's'}")


def test_ingest_with_a_model_directory(
    capsys: pytest.CaptureFixture[str], image_folder: Path, tmp_path: Path, tiny_qwen2_vl: Path
) -> None:
    argv = ["ingest", str(image_folder), "--offload-root", str(tmp_path / "s"), "--model", str(tiny_qwen2_vl)]
    code, out, _ = run_cli(capsys, *argv, "--backend", "torchvision")
    qwen = get_family("qwen_vl")
    expected = qwen.fingerprint(qwen.config_from_pretrained(tiny_qwen2_vl), "torchvision")
    assert code == 0 and {parse_ref(json.loads(line)["ref"]).fingerprint for line in out.splitlines()} == {
        expected
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ingest", "/no/such/file.png", "--offload-root", "{tmp}"], "no such file or directory"),
        (["ingest", "{tmp}/empty", "--offload-root", "{tmp}"], "no image files found"),
        (["ingest", "{tmp}/bad.png", "--offload-root", "{tmp}"], "not a decodable image"),
        (["ingest", "{tmp}/empty", "--offload-root", "{tmp}", "--model", "{tmp}"], "no config.json"),
        (["layout", "--preset", "qwen2_vl", "12x"], "WIDTHxHEIGHT"),
        (["layout", "--preset", "qwen2_vl", "1x300"], "aspect ratio"),
        (["layout", "--preset", "llava", "10x10"], "unknown model preset"),
        (["ref", "inspect", "mmraw:{}"], "malformed_ref"),
    ],
)
def test_errors_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], message: str
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.png").write_bytes(b"not a png")
    code, out, err = run_cli(capsys, *[arg.replace("{tmp}", str(tmp_path)) for arg in argv])
    assert code == 2 and out == ""
    assert (
        len(err.strip().splitlines()) == 1 and message in err and err.startswith(f"rawmm {argv[0]}: error:")
    )


def test_layout_matches_describe(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "layout", "--preset", "kimi_k25", "1920x1080", "1x1", "--json")
    kimi = get_family("kimi_k25")
    rows = [json.loads(line) for line in out.splitlines()]
    for row, (w, h) in zip(rows, [(1920, 1080), (1, 1)], strict=True):
        layout = kimi.describe(width=w, height=h, config=kimi.preset("kimi_k25"))
        assert row["grid_thw"] == list(layout.grid_thw)
        assert row["placeholder_tokens"] == row["vision_tokens"] == layout.num_vision_tokens
    code, out, _ = run_cli(capsys, "layout", "--preset", "qwen2_vl", "1920x1080")
    assert code == 0 and out.strip() == (
        "1920x1080 -> resized 1932x1092, grid [1, 78, 138], 2691 placeholder tokens, 2691 vision tokens"
    )


def test_ref_inspect_verifies_against_the_store(
    capsys: pytest.CaptureFixture[str], image_folder: Path, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    _, out, _ = run_cli(
        capsys, "ingest", str(image_folder / "a.png"), "--offload-root", str(root), "--preset", "kimi_k25"
    )
    ref = json.loads(out)["ref"]
    code, out, _ = run_cli(capsys, "ref", "inspect", ref, "--offload-root", str(root))
    report = json.loads(out)
    assert code == 0 and report["engine_modality"] == "vision_chunk" and report["bytes_verified"] > 0
    assert report["grid_thw"] == list(get_family("kimi_k25").grid_from_payload(parse_ref(ref).payload))
    code, _, err = run_cli(capsys, "ref", "inspect", ref, "--offload-root", str(tmp_path / "elsewhere"))
    assert code == 2 and "outside_offload_root" in err


def test_tiny_model_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run_cli(
        capsys, "tiny-model", "--preset", "qwen2_vl", "--out", str(tmp_path / "m"), "--seed", "3"
    )
    assert code == 0 and str(tmp_path / "m") in out
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "qwen2_vl"


def test_entry_point_exits_non_zero_with_one_line() -> None:
    result = subprocess.run(
        [Path(sys.executable).with_name("rawmm"), "ref", "inspect", "mmraw:not-json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "malformed_ref" in result.stderr
